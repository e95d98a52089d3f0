"""One run per output: a fenced lease (`_lease.json`) naming the run that may write the output.

Every write of the lease object is a compare-and-swap (io/conditional.py: S3 `If-None-Match` / `If-Match`
on the ETag, an exclusive `os.link` of the next version file on local disk, no lock), so of two runs racing
to create, renew or take over, exactly one succeeds. The body carries a `generation` (the fencing epoch: +1
at every acquisition or takeover, stamped into every commit record and the manifest) and a `beat` counter
(+1 at every renewal).

Expiry never compares clocks across hosts. A run that finds the lease held watches it: if the object does
not change for the holder's `ttl_s` on the watcher's own monotonic clock, the holder is gone and the watcher
takes over; if it changes (a heartbeat), the holder is alive and the watcher refuses. A released lease, or
one whose holder is provably dead (same host, boot and pid namespace, and its pid gone or reused; or, with
the `is_dead` the driver passes, its Ray job ended: driver/ray_holder.py), is taken over at once.

The holder renews from its own thread every ttl/6 through every phase of the run. It counts itself valid
until VALID_SHARE of the ttl after the start of its last successful renewal (a watcher can only take over a
full ttl after it), retries failed renewals in the meantime, and stops writing (`check()` raises LeaseLost)
once that window closes or a renewal finds another run's lease. `FencedStorage` puts that check in front of
every write the driver makes.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from jobrunner.io.conditional import read_versioned, write_if
from jobrunner.io.layout import LEASE
from jobrunner.io.storage import Storage
from jobrunner.redaction import redacting_logger

log = redacting_logger(__name__)
VALID_SHARE = 0.75  # the holder writes only within this share of the ttl after its last renewal began
BEATS_PER_TTL = 6  # renewals per ttl; failed renewals retry every RETRY_S until the valid window closes
RETRY_S = 1.0
MIN_RETRY_S = 0.05  # the tries just before the window closes: never a busy loop


class LeaseHeld(RuntimeError):
    """Another live run holds the output's lease; the message names it."""


class LeaseLost(PermissionError):
    """This run may no longer write the output (its lease was taken over or could not be renewed in time).

    A PermissionError so storage retries treat it as permanent."""


def _iso(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, timezone.utc).isoformat(timespec="seconds")


# ---- who holds it: host identity and provable death ----------------------------------------------------
def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def process_start(pid: int) -> str | None:
    """The start time (clock ticks since boot) of a local process, None when there is no such process."""
    stat = _read_text(f"/proc/{pid}/stat")
    if stat:
        return stat.rsplit(")", 1)[-1].split()[19]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return ""  # alive, start time unknown (no /proc)


def host_identity() -> dict[str, str]:
    """What makes a pid meaningful: the host name, its boot and this process's pid namespace."""
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = ""
    return {"host": socket.gethostname(), "boot_id": _read_text("/proc/sys/kernel/random/boot_id"),
            "pid_ns": pid_ns}


def holder_is_dead_here(holder: dict[str, Any]) -> bool:
    """True only when the holder ran on this host (same boot, same pid namespace) and its process is gone
    (or its pid now belongs to a process started later). Anything unknown: not provably dead."""
    me = host_identity()
    if not me["boot_id"] or any(holder.get(k) != v for k, v in me.items()):
        return False
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    start = process_start(pid)
    if start is None:
        return True
    return bool(start) and bool(holder.get("pid_start")) and holder["pid_start"] != start


def describe_holder(holder: dict[str, Any]) -> str:
    """'run <id> on <host> (pid N[, Ray job J]), last heartbeat <t> (its clock)' for messages."""
    ray_job = holder.get("ray") if isinstance(holder.get("ray"), dict) else {}
    job = ray_job.get("submission_id") or ray_job.get("job_id")
    return (f"run {holder.get('run_id')} on {holder.get('host')} (pid {holder.get('pid')}"
            f"{f', Ray job {job}' if job else ''}), last heartbeat {holder.get('heartbeat_at')} (its clock)")


# ---- this run's lease ---------------------------------------------------------------------------------
class Lease:
    """This run's hold on an output: renewed by a heartbeat thread; `check()` before every write."""

    def __init__(self, storage: Storage, run_id: str, ttl_s: float, job_name: str = "",
                 extra: dict[str, Any] | None = None) -> None:
        self.storage, self.run_id, self.ttl_s, self.job_name = storage, run_id, ttl_s, job_name
        self.extra = dict(extra or {})
        # the run's live progress (rows, tokens, workers: what the progress bar shows), written with each
        # heartbeat so that `jobrunner status` reads more than committed shards; set by the job loop
        self.live: dict[str, Any] | None = None
        self.generation = 0
        self.beat = 0
        self.version: str | None = None  # storage version of our last write
        self.valid_until = 0.0  # monotonic: no write after this without a newer renewal
        self.lost: str | None = None
        self.taken_over: str | None = None  # how the previous holder was found gone, when this run took over
        self.num_renewals = 0
        self.num_renewal_errors = 0
        self._lock = threading.Lock()  # one lease write at a time (heartbeat, release, verify)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def body(self, state: str = "held") -> dict[str, Any]:
        """The lease object this run writes."""
        pid = os.getpid()
        return {"run_id": self.run_id, "generation": self.generation, "beat": self.beat, "state": state,
                **host_identity(), "pid": pid, "pid_start": process_start(pid) or "", "job_name": self.job_name,
                "heartbeat_at": _iso(time.time()), "ttl_s": self.ttl_s, **self.extra,
                **({"progress": self.live} if self.live is not None else {})}

    # -- writing ---------------------------------------------------------------------------------------
    def _cas(self, expected: str | None, state: str = "held") -> bool:
        """One conditional write of our body over `expected`; True when it landed."""
        started = time.monotonic()
        self.beat += 1
        new = write_if(self.storage, LEASE, json.dumps(self.body(state)).encode(), expected)
        if new is None:
            return False
        self.version = new
        self.valid_until = started + self.ttl_s * VALID_SHARE
        return True

    def _is_ours(self, holder: dict[str, Any]) -> bool:
        return holder.get("run_id") == self.run_id and holder.get("generation") == self.generation

    def _renew_locked(self) -> None:
        if self.lost is not None:
            raise LeaseLost(self.lost)
        if self._cas(self.version):
            return
        current = read_versioned(self.storage, LEASE)  # our own write whose reply was lost, or a takeover?
        holder = _parse(current[0]) if current else {}
        if current is not None and self._is_ours(holder) and holder.get("state") == "held":
            self.version = current[1]
            if self._cas(self.version):
                return
        self._lose(f"{self.storage.display(LEASE)}: this run's lease (generation {self.generation}) was taken "
                   f"over by {describe_holder(holder) if holder else 'nobody (deleted)'}; stopping")

    def _lose(self, why: str) -> None:
        if self.lost is None:
            self.lost = why
            log.error("%s", why)
        raise LeaseLost(self.lost)

    def renew(self) -> None:
        """Write a heartbeat now; LeaseLost when another run holds the lease."""
        with self._lock:
            self._renew_locked()
            self.num_renewals += 1

    def advance_to(self, generation: int) -> None:
        """Raise our generation (a manifest written under a higher one: the lease object was deleted)."""
        with self._lock:
            if generation > self.generation:
                self.generation = generation
                self._renew_locked()

    # -- fencing ---------------------------------------------------------------------------------------
    def check(self) -> None:
        """LeaseLost unless this run may still write (not taken over, renewed recently on our clock)."""
        if self.lost is not None:
            raise LeaseLost(self.lost)
        if time.monotonic() >= self.valid_until:
            self.lost = (f"{self.storage.display(LEASE)}: this run's lease could not be renewed for "
                         f"{self.ttl_s * VALID_SHARE:.0f} s (another run may take it over); stopping")
            raise LeaseLost(self.lost)

    def verify(self) -> None:
        """`check()` and read the lease object: LeaseLost unless it is still this run's last write."""
        self.check()
        with self._lock:
            current = read_versioned(self.storage, LEASE)
            if current is None or current[1] != self.version:
                holder = _parse(current[0]) if current else {}
                if not (current and self._is_ours(holder)):
                    self._lose(f"{self.storage.display(LEASE)}: this run's lease (generation {self.generation}) "
                               f"is now {describe_holder(holder) if holder else 'gone'}; stopping")
                self.version = current[1]
        self.check()

    # -- heartbeat thread ------------------------------------------------------------------------------
    def start_heartbeat(self) -> None:
        """Renew every ttl/6 from a daemon thread until `release()` (or loss)."""
        self._thread = threading.Thread(target=self._heartbeat, name="lease-heartbeat", daemon=True)
        self._thread.start()

    def _heartbeat(self) -> None:
        wait_s, failures = self.ttl_s / BEATS_PER_TTL, 0
        while not self._stop.wait(wait_s):
            try:
                self.renew()
            except LeaseLost:
                return
            except Exception as exc:  # noqa: BLE001 - a storage hiccup: retry while the lease is still valid
                self.num_renewal_errors += 1
                failures += 1
                wait_s = self._after_failure(exc, failures)
                if wait_s is None:
                    return
                continue
            if failures:
                log.warning("lease renewed again after %d failed attempt(s)", failures)
            wait_s, failures = self.ttl_s / BEATS_PER_TTL, 0

    def _after_failure(self, exc: Exception, failures: int) -> float | None:
        """Seconds until the next try, or None when the valid window closed (then `lost` is set). One line for
        a run of failures (a full disk fails every try): the first, then the count when it ends."""
        left = self.valid_until - time.monotonic()
        window = f"{self.ttl_s * VALID_SHARE:.0f} s"
        error = f"{type(exc).__name__}: {exc}"
        if left <= 0:
            self.lost = (f"{self.storage.display(LEASE)}: could not renew the lease within {window} of its last "
                         f"renewal ({failures} failed attempt(s), the last: {error}); stopping")
            log.error("%s", self.lost)
            return None
        if failures == 1:
            log.warning("lease renewal failed (%s); retrying every %g s, and this run stops unless one succeeds "
                        "within %s of the last renewal (further failures are counted, not shown)", error, RETRY_S,
                        window)
        return max(MIN_RETRY_S, min(RETRY_S, left / 2))

    def stop_heartbeat(self) -> None:
        """Stop renewing (the lease then runs out as a crashed run's would)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def release(self) -> None:
        """Stop the heartbeat and mark the lease released (if it is still ours), so the next run starts at once."""
        self.stop_heartbeat()
        with self._lock:
            if self.version is not None and self.lost != "released":
                try:  # conditional on our last write: a lease taken over meanwhile is left alone
                    self._cas(self.version, state="released")
                except Exception as exc:  # noqa: BLE001 - the next run waits for the ttl instead
                    log.warning("could not release the lease: %s", exc)
            self.lost = self.lost or "released"


def _parse(data: bytes) -> dict[str, Any]:
    try:
        holder = json.loads(data)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def read_lease(storage: Storage) -> dict[str, Any] | None:
    """The lease object (an unreadable one is {}), or None when there is none."""
    current = read_versioned(storage, LEASE)
    return None if current is None else _parse(current[0])


def is_free(holder: dict[str, Any] | None) -> bool:
    """Whether a lease object holds nothing (absent or released)."""
    return holder is None or holder.get("state") == "released"


# ---- taking it ----------------------------------------------------------------------------------------
WaitCallback = Callable[[dict[str, Any], float], None]


class _Watch:
    """How long the lease object has stayed unchanged, on this process's monotonic clock."""

    def __init__(self) -> None:
        self.version: str | None = None
        self.since = 0.0
        self.changes = 0

    def seen(self, version: str) -> float:
        """Record an observation; returns seconds the object has been unchanged."""
        now = time.monotonic()
        if version != self.version:
            self.changes += self.version is not None
            self.version, self.since = version, now
        return now - self.since


def acquire_lease(storage: Storage, run_id: str, ttl_s: float, job_name: str = "", *,
                  is_dead: Callable[[dict[str, Any]], bool] = holder_is_dead_here,
                  on_wait: WaitCallback | None = None, extra: dict[str, Any] | None = None) -> Lease:
    """Take the output's lease for this run and start its heartbeat.

    Free, released or provably dead holder: taken at once. Otherwise watch it: unchanged for the holder's
    ttl (our clock) -> taken over; changed (a heartbeat) -> LeaseHeld naming the live holder. `on_wait` is
    called with the holder and the seconds left while waiting."""
    lease = Lease(storage, run_id, ttl_s, job_name, extra)
    watch = _Watch()
    while True:
        current = read_versioned(storage, LEASE)
        if current is None:
            if _claim(lease, None, 1):
                return lease
            continue
        holder, version = _parse(current[0]), current[1]
        generation = holder.get("generation") if isinstance(holder.get("generation"), int) else 0
        if is_free(holder) or is_dead(holder):
            if _claim(lease, version, generation + 1):
                if not is_free(holder):
                    lease.taken_over = f"{describe_holder(holder)}: no longer running"
                return lease
            continue
        unchanged_s = watch.seen(version)
        if watch.changes:
            raise LeaseHeld(f"output {storage.display()} is in use by {describe_holder(holder)}, which is alive "
                            "(its lease was renewed while this run waited); wait for it to finish")
        holder_ttl = holder.get("ttl_s") if isinstance(holder.get("ttl_s"), (int, float)) else ttl_s
        left = float(holder_ttl) - unchanged_s
        if left <= 0:
            if _claim(lease, version, generation + 1):
                lease.taken_over = (f"{describe_holder(holder)} renewed nothing for {float(holder_ttl):.0f} s "
                                    "(its lease's ttl)")
                return lease
            continue
        if on_wait is not None:
            on_wait(holder, left)
        time.sleep(min(left, max(0.05, holder_ttl / (4 * BEATS_PER_TTL))))


def _claim(lease: Lease, version: str | None, generation: int) -> bool:
    lease.generation, lease.beat = generation, 0
    with lease._lock:
        if not lease._cas(version):
            return False
    lease.start_heartbeat()
    return True


# ---- fenced writes ------------------------------------------------------------------------------------
class FencedStorage(Storage):
    """The same storage, but every write first checks the lease (LeaseLost: nothing is written).

    Publishes, records and deletes check locally (no extra round trip); whole-object writes through
    `write_atomic` (the manifest, `_SUCCESS`, result files) also read the lease object back first."""

    def __init__(self, storage: Storage, lease: Lease) -> None:  # noqa: D107 - shares the storage's state
        self.__dict__.update(storage.__dict__)
        self.lease = lease

    def put(self, rel: str, data: bytes) -> None:  # noqa: D102
        self.lease.check()
        super().put(rel, data)

    def commit(self, tmp: str, rel: str) -> None:  # noqa: D102
        self.lease.check()
        super().commit(tmp, rel)

    def write_atomic(self, rel: str, data: bytes) -> None:  # noqa: D102
        self.lease.verify()
        super().write_atomic(rel, data)

    def write_small(self, rel: str, data: bytes) -> None:  # noqa: D102
        self.lease.check()
        super().write_small(rel, data)

    def delete(self, rel: str, recursive: bool = False) -> None:  # noqa: D102
        self.lease.check()
        super().delete(rel, recursive)

    def delete_many(self, rels: list[str]) -> None:  # noqa: D102
        self.lease.check()
        super().delete_many(rels)
