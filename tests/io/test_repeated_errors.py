"""A full disk (any storage error that repeats) prints a few lines, not one per retry: the storage retries
are folded per cause (io/repeats.py), and a lease heartbeat that keeps failing logs its first failure and then
one line with the count, when it recovers or when the run stops."""

from __future__ import annotations

import errno
import logging
import threading
import uuid

import pytest

from jobrunner.io.lease import LeaseLost, acquire_lease
from jobrunner.io.repeats import FoldedWarnings
from jobrunner.io.storage import RETRY_WARNINGS, Storage, StorageError, retry

FULL = OSError(errno.ENOSPC, "No space left on device")


class _Clock:
    """A clock the test moves by hand (the fold window is a minute)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_repeats_within_the_window_are_counted_then_summarised(caplog):
    clock = _Clock()
    folded = FoldedWarnings(logging.getLogger("tests.repeats"), "storage retries", fold_s=60, clock=clock)
    with caplog.at_level(logging.WARNING, logger="tests.repeats"):
        for i in range(79):
            clock.now = i * 0.5
            folded.warn("OSError [Errno 28]", f"write part-{i}: full")
        folded.warn("TimeoutError", "read x: timed out")  # another cause: its own first line
        clock.now = 61.0
        folded.warn("OSError [Errno 28]", "write part-79: full")  # past the window: summary, then the line
        folded.flush()
        folded.flush()  # nothing left to say
    assert [r.getMessage() for r in caplog.records] == [
        "write part-0: full",
        "read x: timed out",
        "78 more storage retries (OSError [Errno 28]) not shown; the last: write part-78: full",
        "write part-79: full",
    ]


def test_storage_retries_of_one_cause_print_one_line(caplog):
    RETRY_WARNINGS.flush()

    def full() -> None:
        raise FULL

    with caplog.at_level(logging.WARNING, logger="jobrunner.io.storage"):
        caplog.clear()
        for key in ("a", "b", "c"):
            with pytest.raises(StorageError, match=f"write s3://b/{key}: failed after 3 attempts: OSError"):
                retry(f"write s3://b/{key}", full, attempts=3, backoff_s=0.001)
        RETRY_WARNINGS.flush()
    assert [r.getMessage() for r in caplog.records] == [
        "write s3://b/a: attempt 1 failed (OSError: [Errno 28] No space left on device); retrying",
        "5 more storage retries (OSError [Errno 28] No space left on device) not shown; the last: write s3://b/c: "
        "attempt 2 failed (OSError: [Errno 28] No space left on device); retrying",
    ]


class _FullMemory(Storage):
    """memory:// whose writes fail with ENOSPC while `full` is set (a disk that filled up)."""

    full = False

    def put(self, rel: str, data: bytes) -> None:
        if self.full:
            raise FULL
        super().put(rel, data)


def test_a_heartbeat_on_a_full_disk_logs_two_lines(caplog):
    storage = _FullMemory(f"memory://lease-{uuid.uuid4().hex}/out")
    with caplog.at_level(logging.WARNING, logger="jobrunner.io.lease"):
        lease = acquire_lease(storage, "run-a", ttl_s=2.0)
        storage.full = True
        stopped = threading.Event()
        while lease.lost is None:
            stopped.wait(0.05)
        lease._thread.join(timeout=10)
    assert lease.num_renewal_errors >= 2  # retried, every second and faster at the end of the window
    assert [r.getMessage() for r in caplog.records] == [
        "lease renewal failed (OSError: [Errno 28] No space left on device); retrying every 1 s, and this run "
        "stops unless one succeeds within 2 s of the last renewal (further failures are counted, not shown)",
        f"{storage.display('_lease.json')}: could not renew the lease within 2 s of its last renewal "
        f"({lease.num_renewal_errors} failed attempt(s), the last: OSError: [Errno 28] No space left on device); "
        "stopping",
    ]
    with pytest.raises(LeaseLost):
        lease.check()
    storage.full = False
    lease.release()


def test_a_heartbeat_that_recovers_says_after_how_many_failures(caplog):
    storage = _FullMemory(f"memory://lease-{uuid.uuid4().hex}/out")
    with caplog.at_level(logging.WARNING, logger="jobrunner.io.lease"):
        lease = acquire_lease(storage, "run-a", ttl_s=6.0)
        storage.full = True
        waited = threading.Event()
        while lease.num_renewal_errors < 2:
            waited.wait(0.05)
        storage.full = False
        while not any("renewed again" in r.getMessage() for r in caplog.records):
            waited.wait(0.05)
        lease.release()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and messages[0].startswith("lease renewal failed (OSError: [Errno 28]")
    assert messages[1] == f"lease renewed again after {lease.num_renewal_errors} failed attempt(s)"
