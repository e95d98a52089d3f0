"""The fenced output lease (io/lease.py, io/conditional.py): on local disk, the S3 server and memory://.

Short ttls keep these quick; nothing asserts on durations, only on who holds the lease afterwards. A live holder's
heartbeats are written when its watcher waits (``on_wait``), not left to its heartbeat thread's timing: on a loaded
machine a thread starved for a ttl would look stalled and be taken over.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid

import pytest

from jobrunner.io.commits import read_commit_records, write_commit_record
from jobrunner.io.conditional import read_versioned, write_if
from jobrunner.io.layout import LEASE, LEASE_GENERATION, MANIFEST
from jobrunner.io.lease import (
    FencedStorage,
    Lease,
    LeaseHeld,
    LeaseLost,
    acquire_lease,
    host_identity,
    process_start,
    read_lease,
)
from jobrunner.io.manifest import read_manifest, read_manifest_with_records, write_manifest
from jobrunner.io.shard_file import from_entries
from jobrunner.io.storage import Storage
from tests.io.test_io_storage import make_bucket

NEVER_DEAD = {"is_dead": lambda holder: False}


@pytest.fixture(params=["file", "s3", "memory"])
def storage(request, tmp_path) -> Storage:
    if request.param == "file":
        return Storage(str(tmp_path / "out"))
    if request.param == "memory":
        return Storage(f"memory://lease-{uuid.uuid4().hex}/out")
    s3 = request.getfixturevalue("s3_server")
    return Storage(f"s3://{make_bucket(s3)}/out", s3["storage_options"])


def test_conditional_writes_create_once_and_swap_only_from_the_version_read(storage):
    first = write_if(storage, LEASE, b'{"n": 1}', None)
    assert first is not None
    assert write_if(storage, LEASE, b'{"n": 2}', None) is None  # exists: not created again
    second = write_if(storage, LEASE, b'{"n": 2}', first)
    assert second is not None and second != first
    assert write_if(storage, LEASE, b'{"n": 3}', first) is None  # stale version: refused
    assert read_versioned(storage, LEASE) == (b'{"n": 2}', second)


def test_live_holder_refuses_stalled_holder_is_taken_over_and_fenced(storage):
    first = acquire_lease(storage, "run-a", ttl_s=1.2, job_name="j")
    assert first.generation == 1 and read_lease(storage)["run_id"] == "run-a"
    first.stop_heartbeat()  # run-a beats below while run-b watches (the module's docstring)
    waits: list[float] = []

    def beat(holder, left: float) -> None:
        waits.append(left)
        first.renew()

    with pytest.raises(LeaseHeld, match="in use by run run-a on .* which is alive"):
        acquire_lease(storage, "run-b", ttl_s=1.2, on_wait=beat, **NEVER_DEAD)
    assert waits and all(0 < w <= 1.2 for w in waits)  # a countdown was shown while it watched
    # run-a stalls now (a stopped or partitioned driver): its lease object stops changing
    second = acquire_lease(storage, "run-b", ttl_s=1.2, **NEVER_DEAD)
    held = read_lease(storage)
    assert (held["run_id"], held["generation"], second.generation) == ("run-b", 2, 2)
    assert first.taken_over is None and "run run-a on" in second.taken_over and "renewed nothing" in second.taken_over
    with pytest.raises(LeaseLost, match="taken over by run run-b"):
        first.renew()
    fenced = FencedStorage(storage, first)
    with pytest.raises(LeaseLost):
        fenced.write_small("_commits/x.json", b"{}")
    with pytest.raises(LeaseLost):
        write_manifest(fenced, {}, from_entries({}))
    assert not storage.exists("_commits/x.json") and not storage.exists(MANIFEST)
    first.release()  # not ours any more: left alone
    assert read_lease(storage)["run_id"] == "run-b"
    second.release()
    assert read_lease(storage)["state"] == "released"
    third = acquire_lease(storage, "run-c", ttl_s=1.2, on_wait=lambda h, left: waits.append(-1.0), **NEVER_DEAD)
    assert third.generation == 3 and -1.0 not in waits  # a released lease is taken at once
    assert third.taken_over is None  # released, not taken over
    third.release()


def test_expiry_ignores_the_holders_clock(tmp_path):
    """A holder whose clock is hours ahead (or behind) neither blocks nor speeds up a takeover: the watcher
    only counts how long the object stays unchanged on its own clock."""
    storage = Storage(str(tmp_path / "out"))
    for skew in ("2126-01-01T00:00:00+00:00", "1999-01-01T00:00:00+00:00"):
        body = {"run_id": "skewed", "generation": 7, "beat": 3, "state": "held", "host": "elsewhere",
                "pid": 1, "heartbeat_at": skew, "expires_at_s": 4e9, "ttl_s": 0.6}
        current = read_versioned(storage, LEASE)
        assert write_if(storage, LEASE, json.dumps(body).encode(), current and current[1]) is not None
        waits: list[float] = []
        lease = acquire_lease(storage, "run-b", ttl_s=5, on_wait=_recorder(waits))
        assert lease.generation == 8 and waits  # it waited (no clock says "expired"), then took over
        lease.stop_heartbeat()


def _recorder(waits: list[float]):
    return lambda holder, left: waits.append(left)


@pytest.mark.parametrize("where", ["file", "s3"])
def test_racing_acquisitions_leave_exactly_one_holder(where, tmp_path, request):
    if where == "s3":
        s3 = request.getfixturevalue("s3_server")
        url, opts = f"s3://{make_bucket(s3)}/out", s3["storage_options"]
    else:
        url, opts = str(tmp_path / "out"), None
    for round_ in range(2):  # 1: an empty output; 2: a stalled holder's lease, taken over by all at once
        won, refused = race_acquisitions(url, opts, f"run-{round_}", 6)
        assert len(won) + len(refused) == 6, (won, refused)  # every racer won or was refused: none died
        if where == "file":
            assert len(won) == 1, won
        else:
            # moto checks If-None-Match / If-Match and then writes, without a lock, so two racers can both
            # get a 200 (S3 itself serialises them); the later write stands and the other racer is fenced
            # at its next renewal (If-Match on its own ETag fails): renew until one holder is left.
            _renew_until_one_is_left(won)
        (live,) = [lease for lease in won if lease.lost is None]
        assert read_lease(Storage(url, opts))["run_id"] == live.run_id
        assert live.generation == round_ + 1
        for lease in won:
            lease.stop_heartbeat()  # round 2 starts from this stalled holder


def _renew_each(won: list[Lease]) -> None:
    """A heartbeat from every lease still held (a fenced one records its loss)."""
    for lease in list(won):
        if lease.lost is None:
            try:
                lease.renew()
            except LeaseLost:
                pass


def _renew_until_one_is_left(won: list[Lease], deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while sum(lease.lost is None for lease in won) > 1 and time.monotonic() < deadline:
        _renew_each(won)
        time.sleep(0.05)


def race_acquisitions(url: str, opts: dict | None, name: str, n: int) -> tuple[list[Lease], list[str]]:
    """n threads, each with its own filesystem object, acquire at once; the leases won and the refusals. A racer
    that watches makes the winners beat (the module's docstring); any other exception fails the test."""
    barrier = threading.Barrier(n)
    won: list[Lease] = []
    refused: list[str] = []
    errors: list[BaseException] = []

    def take(i: int) -> None:
        storage = Storage(url, opts)
        barrier.wait()
        try:
            won.append(acquire_lease(storage, f"{name}-{i}", ttl_s=1.5, on_wait=lambda h, left: _renew_each(won),
                                     **NEVER_DEAD))
        except LeaseHeld as exc:
            refused.append(str(exc))
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads), errors
    return won, refused


def test_a_dead_holder_on_this_host_is_taken_over_at_once(tmp_path):
    storage = Storage(str(tmp_path / "out"))
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(done.stdout)
    body = {"run_id": "crashed", "generation": 4, "beat": 9, "state": "held", **host_identity(), "pid": dead_pid,
            "pid_start": "123", "ttl_s": 3600}
    write_if(storage, LEASE, json.dumps(body).encode(), None)
    waits: list[float] = []
    lease = acquire_lease(storage, "run-b", ttl_s=5, on_wait=lambda h, left: waits.append(left))
    assert lease.generation == 5 and not waits
    lease.release()
    # a live process with that pid but another start time: the pid was reused, the holder is dead too
    body.update(pid=os.getpid(), pid_start="1", generation=5)
    current = read_versioned(storage, LEASE)
    write_if(storage, LEASE, json.dumps(body).encode(), current[1])
    assert process_start(os.getpid()) not in ("1", None)
    lease = acquire_lease(storage, "run-c", ttl_s=5, on_wait=lambda h, left: waits.append(left))
    assert lease.generation == 6 and not waits
    lease.release()
    # the same pid on another host (or a holder whose start matches) is not provably dead: it is watched
    body.update(pid=dead_pid, host="another-host", generation=6, ttl_s=0.5)
    current = read_versioned(storage, LEASE)
    write_if(storage, LEASE, json.dumps(body).encode(), current[1])
    lease = acquire_lease(storage, "run-d", ttl_s=5, on_wait=lambda h, left: waits.append(left))
    assert lease.generation == 7 and waits
    lease.release()


class _FlakyMemory(Storage):
    """memory:// whose puts fail while `failing` is set (a storage outage)."""

    failing = False

    def put(self, rel: str, data: bytes) -> None:
        if self.failing:
            raise ConnectionError("injected outage")
        super().put(rel, data)


def test_renewal_errors_are_tolerated_for_part_of_the_ttl_then_the_run_stops():
    storage = _FlakyMemory(f"memory://lease-{uuid.uuid4().hex}/out")
    lease = acquire_lease(storage, "run-a", ttl_s=3.0)
    outage = threading.Event()
    storage.failing = True
    outage.wait(0.8)  # shorter than the valid window (0.75 * ttl): heartbeats fail, then succeed again
    storage.failing = False
    outage.wait(0.8)
    assert lease.num_renewal_errors > 0 and lease.lost is None
    lease.check()
    storage.failing = True
    while lease.lost is None:  # a longer outage: the run stops before any other run could take over
        outage.wait(0.1)
    assert "could not renew" in lease.lost
    with pytest.raises(LeaseLost):
        FencedStorage(storage, lease).delete("anything")
    storage.failing = False
    lease.release()  # the lease was still ours on storage: released, so the next run need not wait
    assert read_lease(storage)["state"] == "released"


def test_records_from_a_driver_that_lost_the_lease_are_ignored(tmp_path):
    storage = Storage(str(tmp_path / "out"))
    write_manifest(storage, {LEASE_GENERATION: 3},
                   from_entries({"s1": {"status": "pending"}, "s2": {"status": "pending"}}))
    write_commit_record(storage, "s1", {"status": "committed", "rows": 1}, epoch=3)
    write_commit_record(storage, "s2", {"status": "committed", "rows": 1}, epoch=2)  # a stale driver's
    assert set(read_commit_records(storage, ["s1", "s2"])) == {"s1", "s2"}
    merged = read_manifest_with_records(storage)
    assert (merged["shards"]["s1"]["status"], merged["shards"]["s1"]["rows"]) == ("committed", 1)
    assert (merged["shards"]["s2"]["status"], merged["shards"]["s2"]["rows"]) == ("pending", 0)
    assert read_manifest(storage)[LEASE_GENERATION] == 3
