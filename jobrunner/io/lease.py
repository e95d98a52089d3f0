"""One run per output: a lease object (`_lease.json`) naming the run that owns the output until it expires.

A run creates the lease exclusively (O_EXCL on disk, a conditional put on object stores), renews its
heartbeat every ttl/3 and deletes it at the end. A second run finds a live lease and refuses, naming the
holder and when the lease expires. A lease whose expiry has passed (its driver crashed) is taken over:
deleted, then created again exclusively, so of two runs taking over at once only one wins. Expiry is wall
clock (seconds since the epoch), compared across hosts.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from jobrunner.io.layout import LEASE
from jobrunner.io.storage import Storage


class LeaseHeld(RuntimeError):
    """Another run holds the output's lease; the message names it and when the lease expires."""


class LeaseLost(RuntimeError):
    """This run's lease was taken over (it expired while the run was stalled): the run must stop."""


def _iso(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, timezone.utc).isoformat(timespec="seconds")


@dataclass
class Lease:
    """This run's hold on an output."""

    storage: Storage
    run_id: str
    ttl_s: float
    job_name: str = ""
    renewed_at: float = 0.0  # time.monotonic() of the last successful write

    def body(self) -> dict[str, Any]:
        now = time.time()
        return {"run_id": self.run_id, "host": socket.gethostname(), "pid": os.getpid(),
                "job_name": self.job_name, "heartbeat_at": _iso(now), "expires_at": _iso(now + self.ttl_s),
                "expires_at_s": round(now + self.ttl_s, 3), "ttl_s": self.ttl_s}

    def is_fresh(self) -> bool:
        """Whether the lease is surely still ours without asking storage (renewed within 2/3 of its ttl)."""
        return time.monotonic() - self.renewed_at < self.ttl_s * 2 / 3

    def renew(self) -> None:
        """Write a new heartbeat; LeaseLost when another run holds the lease now."""
        current = read_lease(self.storage)
        if current is not None and current.get("run_id") != self.run_id:
            raise LeaseLost(f"{self.storage.display(LEASE)}: this run's lease was taken over by "
                            f"{describe_holder(current)}; stopping")
        self.storage.write_small(LEASE, json.dumps(self.body()).encode())
        self.renewed_at = time.monotonic()

    def release(self) -> None:
        """Delete the lease if it is still ours."""
        current = read_lease(self.storage)
        if current is not None and current.get("run_id") == self.run_id:
            self.storage.delete(LEASE)


def read_lease(storage: Storage) -> dict[str, Any] | None:
    """The lease object, or None (absent or unreadable: a torn write never holds an output)."""
    if not storage.exists(LEASE):
        return None
    try:
        data = json.loads(storage.read_bytes(LEASE))
    except (ValueError, FileNotFoundError):
        return None
    return data if isinstance(data, dict) else None


def describe_holder(lease: dict[str, Any]) -> str:
    """'run <id> on <host> (pid N), heartbeat <t>, expires <t>' for messages."""
    return (f"run {lease.get('run_id')} on {lease.get('host')} (pid {lease.get('pid')}), last heartbeat "
            f"{lease.get('heartbeat_at')}, expires {lease.get('expires_at')}")


def is_expired(lease: dict[str, Any], now_s: float | None = None) -> bool:
    """Whether a lease's expiry has passed."""
    expires = lease.get("expires_at_s")
    return not isinstance(expires, (int, float)) or expires <= (time.time() if now_s is None else now_s)


def acquire_lease(storage: Storage, run_id: str, ttl_s: float, job_name: str = "") -> Lease:
    """Take the output's lease for this run: LeaseHeld when another live run holds it."""
    lease = Lease(storage, run_id, ttl_s, job_name)
    for _ in range(3):
        if storage.create_exclusive(LEASE, json.dumps(lease.body()).encode()):
            lease.renewed_at = time.monotonic()
            return lease
        current = read_lease(storage)
        if current is not None and not is_expired(current):
            raise LeaseHeld(f"output {storage.display()} is in use by {describe_holder(current)}; wait for "
                            f"it to finish (or for the lease to expire if that run crashed)")
        storage.delete(LEASE)  # expired (a crashed driver) or unreadable: take it over
    raise LeaseHeld(f"output {storage.display()}: could not take the lease (another run keeps taking it)")
