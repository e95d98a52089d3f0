"""A file rewritten between planning and a worker's read: the shard's read fails naming the file and what
changed (size, ETag, content), on local disk and on the moto S3 server; the same version (or a copy put back,
only its mtime new) reads as planned. No Ray: the worker's ShardRunner reads the planned shard itself."""

from __future__ import annotations

import os

import fsspec
import pytest

from jobrunner.driver.plan import plan_job
from jobrunner.driver.rows import read_shard_input
from jobrunner.driver.worker import ShardRunner
from jobrunner.io.reader import InputChanged
from jobrunner.spec import spec_from_dict
from tests.driver.fake_engine import FakeEngine
from tests.driver.helpers import fake_spec, new_bucket, write_prompts


def test_rewritten_parquet_fails_the_shard_naming_the_file(tmp_path):
    write_prompts(tmp_path / "in.parquet", 16)
    spec = spec_from_dict(fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out")))
    shard = plan_job(spec).shards[0]
    table, _ = read_shard_input(spec, shard.file_url, shard.row_start, shard.row_end, shard.pin)
    assert table.num_rows == shard.num_rows
    os.utime(tmp_path / "in.parquet", ns=(1, 1))  # the same bytes, only a new mtime (copied back): still fine
    read_shard_input(spec, shard.file_url, shard.row_start, shard.row_end, shard.pin)
    write_prompts(tmp_path / "in.parquet", 24)
    runner = ShardRunner(FakeEngine(max_num_seqs=4, max_model_len=64), spec, "w0", 0.0, {"device": "cpu"})
    with pytest.raises(InputChanged) as info:
        runner.run_shard(shard, "a0")
    message = str(info.value)
    assert f"input file {shard.file_url} changed after the job was planned (size " in message
    assert "its rows are not the planned ones" in message and "output.mode=overwrite" in message


def test_rewritten_text_file_of_the_same_size_is_caught_by_its_digest(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n')
    spec = spec_from_dict(fake_spec(str(tmp_path / "in.jsonl"), str(tmp_path / "out"), output={"keep_columns": []}))
    shard = plan_job(spec).shards[0]
    read_shard_input(spec, shard.file_url, shard.row_start, shard.row_end, shard.pin)
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "z"}\n{"id": "b", "prompt": "y"}\n')  # same size
    os.utime(tmp_path / "in.jsonl", ns=(2, 2))  # a clock that did not tick between the two writes
    with pytest.raises(InputChanged, match=r"in\.jsonl changed after the job was planned \(content differs"):
        read_shard_input(spec, shard.file_url, shard.row_start, shard.row_end, shard.pin)


def test_rewritten_object_on_s3_fails_the_read(s3_server):
    opts = s3_server["storage_options"]
    base = f"s3://{new_bucket(s3_server)}"
    write_prompts(f"{base}/in.parquet", 16, storage_options=opts)
    jsonl = f"{base}/in.jsonl"
    fs = fsspec.filesystem("s3", **opts)
    fs.pipe_file(jsonl.removeprefix("s3://"), b'{"id": "j1", "prompt": "x"}\n')
    spec = spec_from_dict(fake_spec(f"{base}/", f"{base}/out", opts, output={"keep_columns": []},
                                    input={"format": "auto"}))
    shards = list(plan_job(spec).shards)
    assert {s.file_url.rsplit("/", 1)[-1] for s in shards} == {"in.parquet", "in.jsonl"}
    for s in shards:
        assert s.pin["etag"] and s.pin["bytes"]
        read_shard_input(spec, s.file_url, s.row_start, s.row_end, s.pin)
    write_prompts(f"{base}/in.parquet", 16, storage_options=opts, poison=3)  # one prompt differs: a new ETag
    fs.pipe_file(jsonl.removeprefix("s3://"), b'{"id": "j1", "prompt": "y"}\n')  # same size, new ETag
    fs.invalidate_cache()
    for s in shards:
        with pytest.raises(InputChanged, match=r"changed after the job was planned \(.*ETag "):
            read_shard_input(spec, s.file_url, s.row_start, s.row_end, s.pin)
