"""The local-disk compare-and-swap (io/conditional.py): version files, no lock, so no stopped process blocks.

Racing writers (threads and processes), stale versions, create-if-absent, the upgrade of a plain key written
by the earlier flock scheme, garbage collection under readers, and writers SIGSTOPped mid-write (through
`conditional._test_hook`, which the child process sets to stop itself at a named step).
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from jobrunner.io import conditional
from jobrunner.io.conditional import read_versioned, write_if
from jobrunner.io.layout import LEASE
from jobrunner.io.lease import FencedStorage, LeaseLost, acquire_lease, read_lease
from jobrunner.io.storage import Storage

pytestmark = pytest.mark.timeout(300)
FORK = multiprocessing.get_context("fork")
NEVER_DEAD = {"is_dead": lambda holder: False}


def _versions(out: Path) -> list[int]:
    return sorted(int(p.name.rsplit(".v", 1)[1]) for p in out.glob(f"{LEASE}.v*"))


def _number(token: str) -> int:
    return int(token.split(":", 1)[0])


def _wait_stopped(pid: int, timeout_s: float = 120) -> None:
    """Until the process is in state T (stopped by a signal)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        assert time.monotonic() < deadline, "the child never stopped"
        time.sleep(0.01)


def _stop_at(step: str, thread_name: str | None = None) -> None:
    """In a child process: SIGSTOP this whole process the first time the local write path reaches `step` (a
    `conditional._step` name, or "os.replace": inside the rename, where the flock scheme held its lock)."""
    armed = [True]

    def stop(name: str) -> None:
        if name == step and armed[0] and (thread_name is None or threading.current_thread().name == thread_name):
            armed[0] = False
            os.kill(os.getpid(), signal.SIGSTOP)

    if step == "os.replace":
        real_replace = os.replace

        def replace(src, dst, *args, **kwargs):
            stop("os.replace")
            return real_replace(src, dst, *args, **kwargs)

        os.replace = replace  # this child process only
    else:
        conditional._test_hook = stop


# ---- one process -------------------------------------------------------------------------------------
def test_versions_swap_only_from_the_version_read_and_the_key_mirrors_the_newest(tmp_path):
    storage, out = Storage(str(tmp_path / "out")), tmp_path / "out"
    assert read_versioned(storage, LEASE) is None
    first = write_if(storage, LEASE, b"one", None)
    assert _number(first) == 1 and write_if(storage, LEASE, b"again", None) is None
    second = write_if(storage, LEASE, b"two", first)
    assert _number(second) == 2
    assert write_if(storage, LEASE, b"stale", first) is None
    assert read_versioned(storage, LEASE) == (b"two", second)
    assert (out / LEASE).read_bytes() == b"two" and _versions(out) == [1, 2]
    # the key is a second name of the newest version file: an in-place edit (an operator, a test) is the
    # current value, under a new token, so the holder of the old token loses its next swap
    assert os.path.samefile(out / LEASE, out / f"{LEASE}.v{2:012d}")
    (out / LEASE).write_bytes(b"edited")
    data, edited = read_versioned(storage, LEASE)
    assert data == b"edited" and edited != second and write_if(storage, LEASE, b"x", second) is None
    assert _number(write_if(storage, LEASE, b"three", edited)) == 3


def test_old_versions_are_collected_and_a_reader_racing_the_collection_retries(tmp_path, monkeypatch):
    storage, out = Storage(str(tmp_path / "out")), tmp_path / "out"
    token = None
    for i in range(30):
        token = write_if(storage, LEASE, f"{i}".encode(), token)
    assert _versions(out) == list(range(30 - conditional.KEEP_VERSIONS + 1, 31))
    assert not list(out.glob(f"{LEASE}.tmp-*"))
    # a reader lists the versions, then (before it opens the newest) KEEP_VERSIONS writes land and collect it
    real_scan, raced = conditional._scan, []

    def scan_then_race(path):
        found = real_scan(path)
        if not raced:
            raced.append(max(found[0]))
            current = token
            for i in range(conditional.KEEP_VERSIONS):
                current = write_if(storage, LEASE, f"later {i}".encode(), current)
        return found

    monkeypatch.setattr(conditional, "_scan", scan_then_race)
    data, version = read_versioned(storage, LEASE)
    assert raced == [30] and not (out / f"{LEASE}.v{30:012d}").exists()
    keep = conditional.KEEP_VERSIONS
    assert data == f"later {keep - 1}".encode() and _number(version) == 30 + keep


def test_a_paused_writers_intent_keeps_its_number_from_collection_and_it_is_refused(tmp_path, monkeypatch):
    """Paused after writing its intent (`<key>.tmp-2-<uuid>`), a writer's number is taken and would be
    collected: the intent keeps version 2's file, the resumed writer's check sees newer versions and it is
    refused without linking; the next write collects number 2."""
    storage, out = Storage(str(tmp_path / "out")), tmp_path / "out"
    base = write_if(storage, LEASE, b"base", None)
    other = Storage(str(tmp_path / "out"))
    keep = conditional.KEEP_VERSIONS

    def others_write_meanwhile(step):
        if step == "written":
            monkeypatch.setattr(conditional, "_test_hook", None)
            assert [p.name.split("-")[1] for p in out.glob(f"{LEASE}.tmp-*")] == ["2"]  # the intent names 2
            current = base
            for i in range(keep + 1):
                current = write_if(other, LEASE, f"other {i}".encode(), current)
            assert _versions(out) == [2, *range(keep + 2 - keep + 1, keep + 3)]  # 2 kept: an intent aims at it

    monkeypatch.setattr(conditional, "_test_hook", others_write_meanwhile)
    assert write_if(storage, LEASE, b"stale", base) is None
    data, version = read_versioned(storage, LEASE)
    assert data == f"other {keep}".encode() and _number(version) == keep + 2
    assert (out / f"{LEASE}.v{2:012d}").read_bytes() == b"other 0"  # never linked over: the first writer's
    assert not list(out.glob(f"{LEASE}.tmp-*")) and (out / LEASE).read_bytes() == data
    write_if(storage, LEASE, b"next", version)
    assert 2 not in _versions(out) and len(_versions(out)) == keep


def test_a_writer_paused_before_its_intent_whose_number_was_collected_never_links_it_again(tmp_path,
                                                                                          monkeypatch):
    """Paused between its compare and its intent, a writer's number is taken and collected (no intent
    protected it). Its link would succeed (the name is free): its check, made after its intent exists, sees
    the newer versions and refuses it first."""
    storage, out = Storage(str(tmp_path / "out")), tmp_path / "out"
    base = write_if(storage, LEASE, b"base", None)
    other = Storage(str(tmp_path / "out"))
    keep = conditional.KEEP_VERSIONS

    def others_write_meanwhile(step):
        if step == "compared":
            monkeypatch.setattr(conditional, "_test_hook", None)
            current = base
            for i in range(keep + 1):
                current = write_if(other, LEASE, f"other {i}".encode(), current)
            assert 2 not in _versions(out)  # number 2 taken, then collected
            links.clear()  # from here on: the paused writer's own links

    monkeypatch.setattr(conditional, "_test_hook", others_write_meanwhile)
    links = []
    real_link = conditional.os.link
    monkeypatch.setattr(conditional.os, "link", lambda src, dst: links.append(dst) or real_link(src, dst))
    assert write_if(storage, LEASE, b"stale", base) is None
    assert links == [] and 2 not in _versions(out)
    data, version = read_versioned(storage, LEASE)
    assert data == f"other {keep}".encode() and _number(version) == keep + 2
    assert not list(out.glob(f"{LEASE}.tmp-*"))


def test_a_winner_slow_to_return_keeps_its_win(tmp_path, monkeypatch):
    """The CI failure (test_racing_processes_lose_no_update, under load): a writer's link succeeded, and
    before it returned KEEP_VERSIONS others wrote on top of its version. It used to take its win back (the
    newest version was far ahead, so it could not tell it had been first) though the others had built on it:
    its update was counted as lost and redone. A win is final now."""
    storage, out = Storage(str(tmp_path / "out")), tmp_path / "out"
    write_if(storage, LEASE, b"0", None)
    other = Storage(str(tmp_path / "out"))
    keep = conditional.KEEP_VERSIONS

    real_fsync_dir = conditional._fsync_dir

    def others_build_on_it(folder):  # right after its link (the directory's fsync that follows it)
        monkeypatch.setattr(conditional, "_fsync_dir", real_fsync_dir)
        real_fsync_dir(folder)
        for _ in range(keep + 1):
            data, current = read_versioned(other, LEASE)
            assert write_if(other, LEASE, str(int(data) + 1).encode(), current) is not None

    monkeypatch.setattr(conditional, "_fsync_dir", others_build_on_it)
    data, version = read_versioned(storage, LEASE)
    assert _number(write_if(storage, LEASE, b"1", version)) == 2  # its win, returned
    data, version = read_versioned(storage, LEASE)
    assert data == str(keep + 2).encode() and _number(version) == keep + 3  # every update counted once
    assert len(_versions(out)) == keep and (out / LEASE).read_bytes() == data


def test_collection_spares_numbers_that_intents_aim_at_and_drops_stale_intents_first(tmp_path):
    storage, out = Storage(str(tmp_path / "out")), tmp_path / "out"
    token = None
    for i in range(12):
        token = write_if(storage, LEASE, f"{i}".encode(), token)
    keep = conditional.KEEP_VERSIONS
    assert _versions(out) == list(range(12 - keep + 1, 13))
    # intents aiming at 9 (young) and 10 (older than TMP_MAX_AGE_S); a mirror's temporary name aims at none
    young, stale = out / f"{LEASE}.tmp-9-{'a' * 32}", out / f"{LEASE}.tmp-10-{'b' * 32}"
    mirror_name = out / f"{LEASE}.tmp-{'1' * 32}"
    for f in (young, stale, mirror_name):
        f.write_bytes(b"x")
    old = time.time() - conditional.TMP_MAX_AGE_S - 5
    os.utime(stale, (old, old))
    assert conditional._intents(str(out / LEASE)) == {9, 10}
    for i in range(6):
        token = write_if(storage, LEASE, f"more {i}".encode(), token)
    assert _versions(out) == [9, *range(18 - keep + 1, 19)]  # 9 spared; 10 went once its stale intent did
    assert not stale.exists() and young.exists() and mirror_name.exists()
    young.unlink()
    write_if(storage, LEASE, b"last", token)
    assert _versions(out) == list(range(19 - keep + 1, 20))


def test_racing_threads_one_winner_per_version(tmp_path):
    url, n, rounds = str(tmp_path / "out"), 6, 15
    write_if(Storage(url), LEASE, b"start", None)
    barrier = threading.Barrier(n)
    wins: list[list[int]] = [[] for _ in range(n)]

    def writer(i: int) -> None:
        storage = Storage(url)
        for r in range(rounds):
            barrier.wait()
            current = read_versioned(storage, LEASE)
            barrier.wait()  # everyone has read the same version before anyone writes
            if write_if(storage, LEASE, f"{r} by {i}".encode(), current[1]) is not None:
                wins[i].append(r)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(r for w in wins for r in w) == list(range(rounds))  # exactly one winner each round
    assert _number(read_versioned(Storage(url), LEASE)[1]) == rounds + 1


def test_the_key_is_taken_only_through_write_if_without_links_too(tmp_path, monkeypatch, caplog):
    """A filesystem without hard links: version files are created with O_EXCL; still one winner each number."""
    real_link = os.link

    def no_link(src, dst, *args, **kwargs):
        raise OSError(errno.EPERM, "Operation not permitted", src, None, dst)

    monkeypatch.setattr(conditional.os, "link", no_link)
    storage, out = Storage(str(tmp_path / "out")), tmp_path / "out"
    first = write_if(storage, LEASE, b"one", None)
    assert write_if(storage, LEASE, b"again", None) is None
    second = write_if(storage, LEASE, b"two", first)
    assert write_if(storage, LEASE, b"stale", first) is None
    assert read_versioned(storage, LEASE) == (b"two", second) and (out / LEASE).read_bytes() == b"two"
    assert "no hard links" in caplog.text
    monkeypatch.setattr(conditional.os, "link", real_link)


# ---- processes ---------------------------------------------------------------------------------------
def _count(url: str, increments: int, queue) -> None:
    storage, done = Storage(url), []
    while len(done) < increments:
        data, version = read_versioned(storage, LEASE)
        value = int(data) + 1
        if write_if(storage, LEASE, str(value).encode(), version) is not None:
            done.append(value)
    queue.put(done)


def test_racing_processes_lose_no_update(tmp_path):
    """Each process adds 1 to a counter by read + write_if until it has added `increments`; with a CAS, every
    value from 1 to the total was written exactly once, and the counter ends at the total."""
    url, n, increments = str(tmp_path / "out"), 6, 12
    write_if(Storage(url), LEASE, b"0", None)
    queue = FORK.Queue()
    procs = [FORK.Process(target=_count, args=(url, increments, queue)) for _ in range(n)]
    for p in procs:
        p.start()
    values = sorted(v for _ in procs for v in queue.get(timeout=240))
    for p in procs:
        p.join(timeout=30)
    assert values == list(range(1, n * increments + 1))
    assert read_versioned(Storage(url), LEASE)[0] == str(n * increments).encode()
    assert len(_versions(tmp_path / "out")) == conditional.KEEP_VERSIONS  # older ones collected
    assert not list((tmp_path / "out").glob(f"{LEASE}.tmp-*"))


def _race_once(url: str, version: str | None, barrier, queue, i: int) -> None:
    storage = Storage(url)
    barrier.wait()
    queue.put((i, write_if(storage, LEASE, f"by {i}".encode(), version)))


def _race(url: str, version: str | None, n: int = 8) -> tuple[list[int], dict]:
    barrier, queue = FORK.Barrier(n), FORK.Queue()
    procs = [FORK.Process(target=_race_once, args=(url, version, barrier, queue, i)) for i in range(n)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    return [i for i, token in results.items() if token is not None], results


def test_racing_processes_create_the_key_once(tmp_path):
    url = str(tmp_path / "out")
    for _ in range(3):
        (tmp_path / "out").mkdir(exist_ok=True)
        winners, results = _race(url, None)
        assert len(winners) == 1, results
        assert read_versioned(Storage(url), LEASE) == (f"by {winners[0]}".encode(), results[winners[0]])
        for p in (tmp_path / "out").iterdir():  # deleting the key = the key and every version file
            p.unlink()


def test_a_plain_key_from_the_flock_scheme_is_version_0_and_upgraded_by_exactly_one(tmp_path):
    out, url = tmp_path / "out", str(tmp_path / "out")
    out.mkdir()
    legacy = json.dumps({"run_id": "old", "generation": 3, "state": "released"}).encode()
    (out / LEASE).write_bytes(legacy)
    data, version = read_versioned(Storage(url), LEASE)
    assert data == legacy and _number(version) == 0
    winners, results = _race(url, version)
    assert len(winners) == 1, results
    assert _versions(out) == [1] and (out / LEASE).read_bytes() == f"by {winners[0]}".encode()
    assert write_if(Storage(url), LEASE, b"late", version) is None  # version 0 is gone for good
    # and a run over an output whose lease was written by the old scheme takes it over with the next generation
    (out / LEASE).unlink()
    (out / f"{LEASE}.v{1:012d}").unlink()
    (out / LEASE).write_bytes(legacy)
    lease = acquire_lease(Storage(url), "new", ttl_s=5, **NEVER_DEAD)
    assert lease.generation == 4 and read_lease(Storage(url))["run_id"] == "new"
    lease.release()


def _write_stopped(url: str, step: str, version: str, queue) -> None:
    _stop_at(step)
    storage = Storage(url)
    token = write_if(storage, LEASE, b"from the stopped writer", version)
    again = None if token is None else write_if(storage, LEASE, b"again", token)
    queue.put((token, again))


@pytest.mark.parametrize("step", ["compared", "written", "linked", "mirrored"])
def test_a_writer_stopped_mid_write_blocks_nobody_and_fails_when_resumed(step, tmp_path):
    out, url = tmp_path / "out", str(tmp_path / "out")
    base = write_if(Storage(url), LEASE, b"base", None)
    queue = FORK.Queue()
    child = FORK.Process(target=_write_stopped, args=(url, step, base, queue))
    child.start()
    try:
        _wait_stopped(child.pid)
        storage = Storage(url)
        data, version = read_versioned(storage, LEASE)
        ours = write_if(storage, LEASE, b"ours", version)  # the flock scheme raised StorageError here
        assert ours is not None
        ours = write_if(storage, LEASE, b"ours, renewed", ours)
        assert ours is not None
    finally:
        os.kill(child.pid, signal.SIGCONT)
    token, again = queue.get(timeout=60)
    child.join(timeout=30)
    if step in ("compared", "written"):  # stopped before its version existed: its version is stale, refused
        assert data == b"base" and token is None
    else:  # it had won (the version we read was its own) and stopped before the mirror; its next swap fails
        assert data == b"from the stopped writer" and _number(token) == 2 and again is None
    assert read_versioned(Storage(url), LEASE) == (b"ours, renewed", ours)
    assert (out / LEASE).read_bytes() == b"ours, renewed"  # the resumed writer repaired the mirror, not undone it
    assert not list(out.glob(f"{LEASE}.tmp-*"))


def _hold_then_stop(url: str, step: str, queue) -> None:
    """Driver A: take the lease, stop inside a heartbeat's write, and after SIGCONT try to publish."""
    storage = Storage(url)
    lease = acquire_lease(storage, "run-a", ttl_s=1.0, **NEVER_DEAD)
    _stop_at(step, thread_name="lease-heartbeat")
    lease._thread.join(timeout=60)  # the heartbeat ends once a renewal finds the lease taken over
    try:
        FencedStorage(storage, lease).write_atomic("parts/part-x.parquet", b"published by A")
        published = "yes"
    except LeaseLost as exc:
        published = f"LeaseLost: {exc}"
    queue.put((lease.generation, lease.lost, published))


@pytest.mark.parametrize("step", ["compared", "os.replace"])
def test_a_driver_stopped_inside_a_lease_write_is_taken_over_and_publishes_nothing(step, tmp_path):
    """The CI failure, deterministically: A is SIGSTOPped inside its heartbeat's lease write (before its
    version exists, or in the rename after it won, where the flock scheme held its lock and B's takeover
    raised StorageError); B takes the lease over once A's ttl has passed; A, resumed, is fenced."""
    out, url = tmp_path / "out", str(tmp_path / "out")
    queue = FORK.Queue()
    a = FORK.Process(target=_hold_then_stop, args=(url, step, queue))
    a.start()
    try:
        _wait_stopped(a.pid)
        b = acquire_lease(Storage(url), "run-b", ttl_s=1.0, **NEVER_DEAD)
        assert b.generation == 2 and b.taken_over and "renewed nothing" in b.taken_over
    finally:
        os.kill(a.pid, signal.SIGCONT)
    a_generation, a_lost, published = queue.get(timeout=60)
    a.join(timeout=30)
    assert a_generation == 1 and "taken over by run run-b" in a_lost
    assert published.startswith("LeaseLost") and not (out / "parts").exists()
    b.renew()  # A's resumption did not disturb B's lease
    assert read_lease(Storage(url))["run_id"] == "run-b" and json.loads((out / LEASE).read_text())["run_id"] == "run-b"
    b.release()
