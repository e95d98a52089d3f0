"""The worker's engine loop with the fake engine, no Ray: shard overlap, error rows, failures."""

from __future__ import annotations

import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq

from jobrunner.driver.shards import plan_shards
from jobrunner.driver.worker import ShardRunner
from jobrunner.io.layout import part_key
from jobrunner.io.parts import commit_part, list_parts, read_output
from jobrunner.io.reader import list_input_files
from jobrunner.io.storage import Storage
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


def _publish(spec, *results) -> None:
    """What the driver does with the attempts it assigned."""
    storage = Storage(spec.output.url)
    for r in results:
        commit_part(storage, r.part, part_key(r.shard_id))


def test_next_shard_joins_before_previous_drains(tmp_path, monkeypatch):
    prompts = [f"prompt {i}" for i in range(8)]
    spec, engine, runner, shards = _setup(tmp_path, prompts)
    both_queued = threading.Event()
    joins = []  # per add_request: (its shard, the shards with unfinished requests in the engine at that moment)
    real_step, real_add = engine.step, engine.add_request

    def gated_step():  # the engine steps only once both shards wait in the worker: no race with thread starts
        assert both_queued.wait(timeout=60), "the second shard was never queued"
        return real_step()

    def recording_add(request_id, prompt, params, **kwargs):
        unfinished = {r.request_id.split("/")[0] for r in engine._waiting + engine._running}
        joins.append((request_id.split("/")[0], unfinished))
        real_add(request_id, prompt, params, **kwargs)

    monkeypatch.setattr(engine, "step", gated_step)
    monkeypatch.setattr(engine, "add_request", recording_add)
    results = [None, None]

    def go(i):
        results[i] = runner.run_shard(shards[i])

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    # Both shards read and queued for the engine (a shard is listed in progress() while its input is read).
    while sum(s.phase == "generating" for s in list(runner._active.values())) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    both_queued.set()
    for t in threads:
        t.join(timeout=60)
    runner.stop()
    assert [r.rows for r in results] == [4, 4]
    # Rows of one shard were added while rows of the other were still unfinished in the engine.
    overlaps = [(shard, others) for shard, others in joins if others - {shard}]
    assert overlaps, f"every shard drained before the next one joined: {joins}"
    assert engine.max_seen_unfinished == runner.target_in_engine == 4  # topped up to 2 x max_num_seqs
    assert all(r.num_output_tokens == 12 and r.num_errors == 0 for r in results)
    assert read_output(spec.output.url).num_rows == 0  # a worker never publishes a part itself
    _publish(spec, *results)
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
    assert result.error_kinds == {"prompt column 'prompt' is null or empty": 2,
                                  "prompt of N tokens is too long (max_model_len N)": 1}
    _publish(spec, result)
    out = {r["id"]: r for r in read_output(spec.output.url).to_pylist()}
    assert out["r0"]["error"] is None and out["r0"]["generated_text"] == "tok0 tok1 tok2"
    assert "null or empty" in out["r1"]["error"] and "null or empty" in out["r2"]["error"]
    assert "too long" in out["r3"]["error"] and out["r3"]["finish_reason"] == "error"
    assert out["r3"]["generated_text"] is None


def test_engine_failure_is_isolated_in_process(tmp_path):
    """The engine raises with a poison row in it: the worker rebuilds its engine (no new worker, no model
    load) and bisects the rows that were in the engine; only the poison row becomes an error row."""
    prompts = [f"prompt {i}" for i in range(8)]
    prompts[5] = "POISON row"
    spec, engine, runner, shards = _setup(tmp_path, prompts, rows_per_shard=8, fail_on="POISON")
    result = runner.run_shard(shards[0])
    runner.stop()
    assert result.rows == 8 and result.num_errors == 1
    # rows 4-7 were in the engine (2 x max_num_seqs): [4, 5] fails, [4] runs, [5] fails alone
    assert runner.cost.engine_rebuilds == 3 and runner.cost.model_loads == 0
    assert result.isolation["engine_rebuilds"] == 3 and result.isolation["rows_isolated"] == 1
    assert result.worker_stats["engine_rebuilds"] == 3
    _publish(spec, result)
    out = {r["id"]: r for r in read_output(spec.output.url).to_pylist()}
    assert out["r5"]["error"] == "engine crashed on this row: RuntimeError: fake engine failure"
    assert all(out[f"r{i}"]["generated_text"] == "tok0 tok1 tok2" for i in range(8) if i != 5)


def test_attempts_are_fenced_and_only_the_published_one_is_visible(tmp_path):
    spec, engine, runner, shards = _setup(tmp_path, ["a b", "c d", "e f", "g h"])
    first = runner.run_shard(shards[0], "attempt-1")
    late = runner.run_shard(shards[0], "attempt-2")  # a zombie attempt of the same shard, finishing later
    runner.stop()
    assert first.part != late.part and first.part.startswith("_temporary/attempt-1/")
    _publish(spec, first)
    storage = Storage(spec.output.url)
    assert list_parts(storage) == [part_key(shards[0].shard_id)]
    assert sorted(read_output(spec.output.url).column("id").to_pylist()) == ["r0", "r1", "r2", "r3"]


def test_isolated_rows_and_undecodable_bytes_become_error_rows(tmp_path):
    spec, engine, runner, shards = _setup(tmp_path, ["a b", "c d", "e f", "g h"])
    piece = shards[0].__class__(shards[0].shard_id, shards[0].file_url, shards[0].file_stem, 1, 2)
    text = "engine crashed on this row: RuntimeError: fake engine failure"
    isolated = runner.run_shard(piece, "iso", error_text=text)
    assert isolated.rows == 1 and isolated.num_errors == 1 and engine.stats().steps == 0
    bad = pa.array([b"ok", b"\xff\xfe bad", b"fine", b"x y"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"id": ["u0", "u1", "u2", "u3"], "prompt": bad, "src": ["s"] * 4}),
                   tmp_path / "in.parquet")
    shards = plan_shards(list_input_files(spec.input.url, {}), spec.rows_per_shard)  # a new file: planned anew
    result = runner.run_shard(shards[0], "utf8")
    runner.stop()
    commit_part(Storage(spec.output.url), isolated.part, part_key("iso"))
    commit_part(Storage(spec.output.url), result.part, part_key("utf8"))
    rows = {r["id"]: r for r in read_output(spec.output.url).to_pylist()}
    assert rows["r1"]["error"] == "engine crashed on this row: RuntimeError: fake engine failure"
    assert rows["u1"]["error"] == "column 'prompt': not valid UTF-8 (invalid start byte at byte 0)"
    assert rows["u1"]["finish_reason"] == "error" and rows["u1"]["src"] == "s"
    assert [rows[i]["generated_text"] for i in ("u0", "u2", "u3")] == ["tok0 tok1 tok2"] * 3
