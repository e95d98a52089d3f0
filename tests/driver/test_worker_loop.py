"""The worker's engine loop with the fake engine, no Ray: shard overlap, error rows, failures."""

from __future__ import annotations

import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobrunner.driver.shards import plan_shards
from jobrunner.driver.worker import EngineFailed, ShardRunner
from jobrunner.io.parts import read_output
from jobrunner.io.reader import list_input_files
from jobrunner.spec import spec_from_dict
from tests.driver.fake_engine import FakeEngine


def _setup(tmp_path, prompts, max_num_seqs=2, rows_per_shard=4, **engine_kw):
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(prompts))], "prompt": prompts,
                             "src": ["s"] * len(prompts)}), tmp_path / "in.parquet", row_group_size=4)
    inp = {"url": str(tmp_path / "in.parquet"), "prompt_column": "prompt", "id_column": "id",
           "rows_per_shard": rows_per_shard}
    spec = spec_from_dict({"name": "t", "input": inp,
                           "sampling": {"max_tokens": 3}, "engine": {"max_num_seqs": max_num_seqs},
                           "output": {"url": str(tmp_path / "out"), "keep_columns": ["src"]}})
    engine = FakeEngine(max_num_seqs=max_num_seqs, max_model_len=20, **engine_kw)
    runner = ShardRunner(engine, spec, "w0", 0.0, {"device": "cpu"})
    shards = plan_shards(list_input_files(spec.input.url, {}), spec.rows_per_shard)
    return spec, engine, runner, shards


def test_next_shard_joins_before_previous_drains(tmp_path):
    prompts = [f"prompt {i}" for i in range(8)]
    spec, engine, runner, shards = _setup(tmp_path, prompts, step_delay_s=0.01)
    results = [None, None]

    def go(i):
        results[i] = runner.run_shard(shards[i])

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    runner.stop()
    assert [r.rows for r in results] == [4, 4]
    # 2 x max_num_seqs requests were in the engine at once: rows of both shards overlapped.
    assert engine.max_seen_unfinished == 4
    assert all(r.num_output_tokens == 12 and r.num_errors == 0 for r in results)
    out = read_output(spec.output.url)
    assert sorted(out.column("id").to_pylist()) == [f"r{i}" for i in range(8)]
    assert set(out.column("src").to_pylist()) == {"s"}
    assert results[0].worker_stats["alive_s"] > 0 and results[0].worker_stats["steps"] > 0


def test_bad_rows_become_error_rows(tmp_path):
    too_long = " ".join(["w"] * 30)
    spec, engine, runner, shards = _setup(tmp_path, ["fine", None, "", too_long])
    result = runner.run_shard(shards[0])
    runner.stop()
    assert result.rows == 4 and result.num_errors == 3
    out = {r["id"]: r for r in read_output(spec.output.url).to_pylist()}
    assert out["r0"]["error"] is None and out["r0"]["generated_text"] == "tok0 tok1 tok2"
    assert "null or empty" in out["r1"]["error"] and "null or empty" in out["r2"]["error"]
    assert "too long" in out["r3"]["error"] and out["r3"]["finish_reason"] == "error"
    assert out["r3"]["generated_text"] is None


def test_engine_failure_fails_shard_and_worker(tmp_path):
    spec, engine, runner, shards = _setup(tmp_path, ["a b", "c d"], rows_per_shard=2)
    engine.fail_on = "c d"
    with pytest.raises(EngineFailed):
        runner.run_shard(shards[0])
    with pytest.raises(EngineFailed, match="failed earlier"):
        runner.run_shard(shards[0])
