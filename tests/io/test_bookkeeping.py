"""Commit records + manifest compaction and URL checks: on local disk and the S3 server (the lease:
tests/io/test_lease.py)."""

from __future__ import annotations

import uuid

import pytest

from jobrunner.driver.manifest import JobBook, new_manifest
from jobrunner.driver.shards import Shard, ShardTable
from jobrunner.io.layout import COMMITS_DIR, part_key
from jobrunner.io.manifest import read_manifest, read_manifest_with_records
from jobrunner.io.parts import rows_to_table, write_part
from jobrunner.io.reader import ROW_INDEX
from jobrunner.io.report_reader import open_outputs
from jobrunner.io.storage import Storage
from jobrunner.spec import spec_from_dict
from tests.io.test_io_storage import make_bucket


def _book(url: str, num_shards: int, opts=None, background: bool = True) -> JobBook:
    spec = spec_from_dict({"name": "b", "input": {"url": "in", "prompt_column": "p"}, "output": {"url": url}})
    shards = ShardTable.from_shards([Shard(f"{i:05d}-x", "file:///in.parquet", "in", i, i + 1)
                                     for i in range(num_shards)])
    return JobBook(Storage(url, opts), new_manifest(spec, shards), shards, background=background)


def _commit(book: JobBook, shard_id: str, errors: int = 0, with_part: bool = True) -> None:
    row = {"id": shard_id, ROW_INDEX: 0, "generated_text": "x", "finish_reason": "length", "error": None,
           "num_prompt_tokens": 2, "num_cached_tokens": 0, "num_output_tokens": 3, "shard_id": shard_id,
           "worker_id": "w0", "finish_time_s": 1.0}
    part = write_part(book.storage, shard_id, rows_to_table([row])) if with_part else part_key(shard_id)
    entry = {"rows": 1, "num_errors": errors, "num_prompt_tokens": 2, "num_cached_tokens": 0,
             "num_output_tokens": 3, "worker_id": "w0", "attempts": 1, "seconds": 0.1, "part": part,
             "parts": [part]}
    book.commit(shard_id, entry, {"bad prompt": errors} if errors else {})


@pytest.mark.parametrize("where", ["file", "s3"])
def test_commits_write_records_and_compaction_folds_them(where, tmp_path, request):
    opts = None
    url = str(tmp_path / "out")
    if where == "s3":
        s3 = request.getfixturevalue("s3_server")
        opts, url = s3["storage_options"], f"s3://{make_bucket(s3)}/out"
    book = _book(url, 1200, opts)
    book.compact(drop_all_records=True)
    start_bytes = book.bytes_written
    for i in range(3):
        _commit(book, f"{i:05d}-x", errors=i)
    record_bytes = book.bytes_written - start_bytes
    assert 3 * 200 < record_bytes < 3 * 700  # small records, independent of the 1,200 shards
    storage = book.storage
    assert read_manifest(storage)["totals"]["shards_committed"] == 0  # the manifest was not rewritten
    merged = read_manifest_with_records(storage)
    assert sorted(s for s, e in merged["shards"].items() if e["status"] == "committed") == [
        "00000-x", "00001-x", "00002-x"]
    assert book.committed_rows == 3 and book.num_errors == 3 and book.top_error_kinds() == [("bad prompt", 3)]
    outputs = open_outputs(url, opts)  # a report of a running job sees the records too
    assert len(outputs.part_paths) == 3
    book.compact()
    assert storage.listdir(COMMITS_DIR) == []
    totals = read_manifest(storage)["totals"]
    assert totals["shards_committed"] == 3 and totals["error_kinds"] == {"bad prompt": 3}
    assert totals["error_rate"] == 1.0 and totals["shards_total"] == 1200


def test_compaction_runs_every_eighth_of_the_shards(tmp_path):
    book = _book(str(tmp_path / "out"), 4000, background=False)  # on a thread: test_shard_table.py
    assert book.compact_every == 500
    book.compact(drop_all_records=True)
    for i in range(1001):
        _commit(book, f"{i:05d}-x", with_part=False)
    assert book.num_compactions == 3 and len(book.unfolded) == 1 and book.num_records == 1001


def test_roots_and_containment(tmp_path):
    out = Storage(str(tmp_path / "out"))
    assert out.contains_url(str(tmp_path / "out" / "in.parquet"))
    assert out.contains_url(str(tmp_path / "out" / "*.parquet"))
    assert not out.contains_url(str(tmp_path / "outside" / "in.parquet"))
    assert not out.contains_url(str(tmp_path / "out2"))
    assert Storage("/").is_root() and not out.is_root()
    assert Storage(f"memory://{uuid.uuid4().hex}").is_root() is False
    assert part_key("s", 8) == "parts/part-s-r8.parquet"
