"""The compact shard table (no Ray): its size per shard, its Parquet form, resume from it and from a format 2
manifest, and compactions that leave the driver's thread free."""

from __future__ import annotations

import json
import threading
import tracemalloc

import numpy as np
import pytest

from jobrunner.driver.manifest import JobBook, new_manifest
from jobrunner.driver.output import describe_output, open_output
from jobrunner.driver.plan import with_absolute_output
from jobrunner.driver.shards import ShardTable, plan_shards
from jobrunner.driver.tasks import FreshTasks, Task, TaskQueue
from jobrunner.io.layout import COMMITS_DIR, MANIFEST, SHARDS_DIR, part_key
from jobrunner.io.manifest import read_manifest, read_manifest_table, read_manifest_with_records
from jobrunner.io.parts import rows_to_table, write_part
from jobrunner.io.reader import ROW_INDEX, InputFile
from jobrunner.io.shard_file import COMMITTED, PENDING, ShardColumns, from_parquet, to_entries, to_parquet
from jobrunner.io.storage import Storage
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import fake_spec, planned, write_prompts

NUM_SHARDS = 100_000
MAX_BYTES_PER_SHARD = 1024  # issue 15, item 12


def _entry(shard_id: str, rows: int, errors: int = 0, parts: list[str] | None = None) -> dict:
    parts = parts or [part_key(shard_id)]
    return {"rows": rows, "num_errors": errors, "num_prompt_tokens": 3 * rows, "num_cached_tokens": 0,
            "num_output_tokens": 4 * rows, "worker_id": "w0", "attempts": 1, "failures": 0, "infra_failures": 0,
            "seconds": 0.5, "part": parts[0], "parts": parts}


def _books(num_shards: int, out: str) -> tuple[ShardTable, TaskQueue, JobBook, dict, ShardColumns]:
    """Plan, manifest, book and queue for `num_shards`, 1% committed, compacted and read back."""
    files = [InputFile(url="file:///data/in.parquet", stem="in", num_rows=10 * num_shards,
                       row_group_num_rows=(10,) * num_shards)]
    spec = spec_from_dict({"name": "big", "input": {"url": "in", "prompt_column": "p"}, "output": {"url": out}})
    shards = plan_shards(files, 10)
    book = JobBook(Storage(out), new_manifest(spec, shards), shards, background=False)
    queue = TaskQueue(fresh=FreshTasks(shards.todo(), lambda row: Task(shards.id_of(row), *shards.rows_of(row))))
    for row in range(0, num_shards, 100):  # 1% committed, each with an error kind
        shard_id = shards.id_of(row)
        book.mark_committed(row, book.record_for(row, _entry(shard_id, 10, 1), {"bad prompt": 1}), 0)
    book.compact(drop_all_records=True)
    header, columns = read_manifest_table(book.storage)
    return shards, queue, book, header, columns


def test_bookkeeping_of_100k_shards_stays_under_1kb_per_shard(tmp_path):
    """Plan, manifest, book, queue and a written + re-read manifest for 10^5 shards: what Python and numpy
    allocate (tracemalloc; Arrow's own buffers are not traced) stays under 1 kB a shard, held or at peak."""
    _books(1000, str(tmp_path / "warm-up"))  # imports (torch, ray, pandas...) allocate nothing per shard
    tracemalloc.start()
    shards, queue, book, header, columns = _books(NUM_SHARDS, str(tmp_path / "out"))
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(shards) == len(queue) == NUM_SHARDS
    assert shards.columns.nbytes / NUM_SHARDS <= 200  # the columns themselves: ~120 bytes
    assert held / NUM_SHARDS <= MAX_BYTES_PER_SHARD  # two tables (the driver's and the one read back)
    assert peak / NUM_SHARDS <= MAX_BYTES_PER_SHARD
    assert int((columns.status == COMMITTED).sum()) == NUM_SHARDS // 100
    assert header["totals"]["error_kinds"] == {"bad prompt": NUM_SHARDS // 100}


def _shards(n: int = 4) -> ShardTable:
    f = InputFile(url="s3://bucket/in.parquet?X-Amz-Signature=abc123", stem="in", num_rows=10 * n,
                  row_group_num_rows=(10,) * n)
    return plan_shards([f], 10)


def test_table_round_trips_through_parquet_with_every_field():
    shards = _shards()
    cols = shards.columns
    ids = [shards.id_of(i) for i in range(4)]
    pieces = [part_key(ids[1], 10), part_key(ids[1], 15)]
    cols.set_entry(0, {**_entry(ids[0], 10, 2), "status": "committed", "error_kinds": {"too long": 2},
                       "isolation": {"engine_rebuilds": 3}})
    cols.set_entry(1, {**_entry(ids[1], 10, 1, pieces), "status": "committed", "error_kinds": {"crash": 1}})
    shards.fail(2, "read s3://bucket/in.parquet?token=hunter2 failed", attempts=3, failed=True)
    shards.mark_not_run(np.array([2, 3]), "not run: no workers")
    back = from_parquet(to_parquet(cols))
    entries = to_entries(back)
    assert entries == to_entries(cols)
    assert entries[ids[0]]["isolation"] == {"engine_rebuilds": 3}  # a field without a column is kept
    assert entries[ids[0]]["parts"] == [part_key(ids[0])] and entries[ids[1]]["parts"] == pieces
    assert entries[ids[1]]["error_kinds"] == {"crash": 1} and entries[ids[0]]["error_kinds"] == {"too long": 2}
    assert entries[ids[2]]["status"] == "failed" and "hunter2" not in entries[ids[2]]["error"]
    assert entries[ids[3]]["status"] == "pending" and entries[ids[3]]["error"] == "not run: no workers"
    assert all("abc123" not in e["file"] for e in entries.values())  # presigned input URLs redacted
    assert "abc123" not in to_parquet(cols).decode("latin-1")


def _job(tmp_path):
    write_prompts(tmp_path / "in.parquet", 40)  # 5 shards of 8 rows
    return with_absolute_output(spec_from_dict(fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out"))))


def _publish(book: JobBook, row: int, errors: int = 0) -> str:
    """What the driver does for a committed shard: its part, then its record."""
    shard_id = book.shards.id_of(row)
    # 8 rows, as its record says: a resume checks a part's row count against the record before trusting it
    table = rows_to_table([{"id": f"{shard_id}:{i}", ROW_INDEX: i, "generated_text": "x", "finish_reason": "length",
                            "error": None, "num_prompt_tokens": 2, "num_cached_tokens": 0, "num_output_tokens": 3,
                            "shard_id": shard_id, "worker_id": "w0", "finish_time_s": 1.0} for i in range(8)])
    write_part(book.storage, shard_id, table)
    book.commit(shard_id, _entry(shard_id, 8, errors), {"bad": errors} if errors else {})
    return shard_id


def test_resume_from_the_table_keeps_committed_shards_and_redoes_lost_ones(tmp_path):
    spec = _job(tmp_path)
    plan, previous = planned(spec)
    storage, manifest, lease = open_output(spec, plan, previous)
    book = JobBook(storage, manifest, plan.shards)
    book.compact(drop_all_records=True)
    done = [_publish(book, row, errors=row) for row in (0, 1, 2)]
    book.compact()  # shards 0-2 in the table
    _publish(book, 3)  # shard 3: a record only (the driver "crashed" before the next compaction)
    lease.release()
    assert storage.listdir(COMMITS_DIR) == [f"{COMMITS_DIR}/{plan.shards.id_of(3)}.json"]
    header = read_manifest(storage)
    assert "shards" not in header and header["shard_table"]["key"].startswith(f"{SHARDS_DIR}/")
    assert header["shard_table"]["status_counts"] == {"pending": 2, "committed": 3, "failed": 0}
    storage = Storage(spec.output.url)  # the released run's fenced storage writes nothing more
    storage.delete(part_key(done[1]))  # a committed part lost
    write_part(storage, plan.shards.id_of(4), rows_to_table([]))  # an orphan: published, never recorded

    again, previous = planned(spec)
    assert describe_output(spec, again, previous) == "output exists: 4/5 shards committed; resume runs the rest"
    storage, manifest, lease = open_output(spec, again, previous)
    lease.release()
    status = again.shards.columns.status
    assert status.tolist() == [COMMITTED, PENDING, COMMITTED, COMMITTED, PENDING]
    assert again.shards.todo().tolist() == [1, 4]
    assert storage.listdir("parts") == sorted(part_key(again.shards.id_of(i)) for i in (0, 2, 3))
    book = JobBook(storage, manifest, again.shards)
    assert book.committed_rows == 24 and book.top_error_kinds() == [("bad", 2)]  # shard 1's error is gone


def test_a_format_2_manifest_is_read_and_resumed(tmp_path):
    spec = _job(tmp_path)
    plan, previous = planned(spec)
    storage, manifest, lease = open_output(spec, plan, previous)
    book = JobBook(storage, manifest, plan.shards)
    book.compact(drop_all_records=True)
    for row in (0, 2):
        _publish(book, row)
    lease.release()
    storage = Storage(spec.output.url)  # the released run's fenced storage writes nothing more
    # The same state as a format 2 manifest: a JSON object per shard, shard 2 in a record only.
    old = {**{k: v for k, v in read_manifest(storage).items() if k != "shard_table"}, "format_version": 2,
           "shards": to_entries(plan.shards.columns)}
    old["shards"][plan.shards.id_of(2)].update(status="pending", rows=0, part=None, parts=[])
    storage.write_atomic(MANIFEST, json.dumps(old).encode())
    storage.delete(SHARDS_DIR, recursive=True)
    assert read_manifest_with_records(storage)["shards"][plan.shards.id_of(2)]["status"] == "committed"

    again, previous = planned(spec)
    storage, manifest, lease = open_output(spec, again, previous)
    try:
        assert again.shards.todo().tolist() == [1, 3, 4]
        JobBook(storage, manifest, again.shards).compact(drop_all_records=True)
    finally:
        lease.release()
    written = read_manifest(storage)
    assert written["format_version"] == 3 and "shards" not in written
    assert written["shard_table"]["status_counts"]["committed"] == 2


class GatedStorage(Storage):
    """Local storage whose shard-table writes wait for a gate (to hold a compaction in flight)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.gate = threading.Event()
        self.writer_threads: set[str] = set()

    def write_small(self, rel: str, data: bytes) -> None:
        if rel.startswith(SHARDS_DIR):
            self.writer_threads.add(threading.current_thread().name)
            assert self.gate.wait(timeout=60)
        super().write_small(rel, data)


def test_compaction_runs_off_the_drivers_thread(tmp_path):
    storage = GatedStorage(str(tmp_path / "out"))
    shards = _shards(1200)
    spec = spec_from_dict({"name": "b", "input": {"url": "in", "prompt_column": "p"},
                           "output": {"url": str(tmp_path / "out")}})
    book = JobBook(storage, new_manifest(spec, shards), shards)
    storage.gate.set()
    book.compact(drop_all_records=True)
    storage.gate.clear()
    for row in range(book.compact_every + 100):  # the compaction starts at 500 and waits at the gate...
        shard_id = shards.id_of(row)
        book.mark_committed(row, book.record_for(row, _entry(shard_id, 1), {}), 0)
    assert book.num_compactions == 1 and book._compacting is not None  # ...while commits go on
    assert read_manifest(storage)["shard_table"]["status_counts"]["committed"] == 0
    storage.gate.set()
    book.wait()
    assert book.num_compactions == 2 and len(book.unfolded) == 100
    assert any(name.startswith("compact") for name in storage.writer_threads)
    assert read_manifest(storage)["shard_table"]["status_counts"]["committed"] == book.compact_every


def test_a_failed_background_compaction_is_raised_on_the_drivers_thread(tmp_path):
    storage = Storage(str(tmp_path / "out"))
    shards = _shards(600)
    spec = spec_from_dict({"name": "b", "input": {"url": "in", "prompt_column": "p"},
                           "output": {"url": str(tmp_path / "out")}})
    book = JobBook(storage, new_manifest(spec, shards), shards)
    book.compact(drop_all_records=True)
    storage.write_small = _failing_write  # the next table write fails
    for row in range(book.compact_every):
        shard_id = shards.id_of(row)
        book.mark_committed(row, book.record_for(row, _entry(shard_id, 1), {}), 0)
    with pytest.raises(OSError, match="disk full"):
        book.wait()


def _failing_write(rel: str, data: bytes) -> None:
    raise OSError("disk full")
