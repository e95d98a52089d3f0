"""A worker's deadlines and in-process isolation with the fake engine, no Ray: steps without progress, a
hung add_request, hung input reads and part writes (real FIFOs that block on open), engine crashes isolated by
engine rebuilds, the rebuild cap, an engine beyond repair, and rows that cannot be stored.

Deadlines here are short (1-3 s) but nothing asserts on elapsed time, and only calls that never return meet
them (a FIFO nobody opens, a stalled row): each test waits for the state it expects (a deadline has fired, a call
is reported hung), with generous outer timeouts; work that must succeed runs under a long deadline.
"""

from __future__ import annotations

import os
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobrunner.driver.deadlines import PhaseTimeout
from jobrunner.driver.shards import plan_shards
from jobrunner.driver.worker import EngineFailed, ShardRunner
from jobrunner.io.layout import attempt_part_key, part_key
from jobrunner.io.parts import commit_part, read_output
from jobrunner.io.reader import list_input_files
from jobrunner.io.storage import Storage
from jobrunner.spec import spec_from_dict
from tests.driver.fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(600)


def _runner(tmp_path, prompts, engine=None, rows_per_shard=8, **cluster):
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(prompts))], "prompt": prompts}),
                   tmp_path / "in.parquet", row_group_size=8)
    spec = spec_from_dict({"name": "t", "sampling": {"max_tokens": 3}, "engine": {"max_num_seqs": 2},
                           "input": {"url": str(tmp_path / "in.parquet"), "prompt_column": "prompt",
                                     "id_column": "id", "rows_per_shard": rows_per_shard,
                                     # rows enter the engine in input order: the isolation tests below name
                                     # which rows run together
                                     "prefix_grouping": "off"},
                           "cluster": cluster, "output": {"url": str(tmp_path / "out")}})
    engine = engine or FakeEngine(max_num_seqs=2, max_model_len=20)
    shards = plan_shards(list_input_files(spec.input.url, {}), spec.rows_per_shard)
    return spec, engine, ShardRunner(engine, spec, "w0", 0.0, {"device": "cpu"}), shards


def _rows(spec, *results) -> dict:
    storage = Storage(spec.output.url)
    for r in results:
        commit_part(storage, r.part, part_key(f"{r.shard_id}-{r.row_start}"))
    return {r["id"]: r for r in read_output(spec.output.url).to_pylist()}


def _wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_steps_without_progress_are_isolated_in_process(tmp_path):
    prompts = [f"prompt {i}" for i in range(8)]
    prompts[6] = "STALL here"
    engine = FakeEngine(max_num_seqs=2, max_model_len=20, stall_on="STALL")
    spec, engine, runner, shards = _runner(tmp_path, prompts, engine, progress_timeout_s=3.0)
    result = runner.run_shard(shards[0])
    runner.stop()
    assert result.num_errors == 1 and runner.cost.engine_rebuilds >= 1 and runner.cost.model_loads == 0
    error = _rows(spec, result)["r6"]["error"]
    assert error.startswith(f"engine crashed on this row: shard {shards[0].shard_id}: no token produced and no "
                            "row finished for ")
    assert "while decoding 1 rows (engine steps return; cluster.progress_timeout_s=3)" in error


class _HangingAdd(FakeEngine):
    """add_request blocks until released (a hung tokenizer or grammar compile)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.release = threading.Event()

    def add_request(self, request_id, prompt, params, **kwargs) -> None:
        if "HANG" in prompt:
            self.release.wait()
        super().add_request(request_id, prompt, params, **kwargs)


def test_a_hung_add_request_holds_no_lock_and_is_reported(tmp_path):
    engine = _HangingAdd(max_num_seqs=2, max_model_len=20)
    spec, engine, runner, shards = _runner(tmp_path, ["a b", "HANG c", "d e"], engine)
    box = {}
    thread = threading.Thread(target=lambda: box.update(result=runner.run_shard(shards[0])))
    thread.start()
    _wait_for(lambda: runner.progress()["stalled_s"] > 0.2)  # answers while the engine thread is stuck
    progress = runner.progress()
    assert progress["stall"].startswith(f"shard {shards[0].shard_id}: no token produced and no row finished for ")
    assert "(engine add_request has not returned for " in progress["stall"]
    assert runner.stats()["alive_s"] > 0  # stats do not wait for the engine either
    engine.release.set()
    thread.join(timeout=60)
    runner.stop()
    assert box["result"].rows == 3 and box["result"].num_errors == 0


def _fifo(path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    os.mkfifo(path)


def _unblock(path, mode) -> None:
    """Open the other end of a FIFO so the abandoned call it blocks returns (ends its thread)."""
    try:
        os.close(os.open(path, (os.O_RDONLY if mode == "r" else os.O_WRONLY) | os.O_NONBLOCK))
    except OSError:
        pass  # nobody waits on it any more


def test_an_input_read_that_hangs_fails_the_attempt_naming_shard_and_rows(tmp_path):
    spec, engine, runner, shards = _runner(tmp_path, ["a b", "c d"], io_timeout_s=1.0)
    _fifo(tmp_path / "in.parquet")  # replaced after planning: opening it blocks until a writer comes
    with pytest.raises(PhaseTimeout) as info:
        runner.run_shard(shards[0])
    runner.stop()
    assert str(info.value) == (f"shard {shards[0].shard_id}: reading input rows 0-2 of file://{tmp_path}/in.parquet: "
                               "no answer for 1 s (cluster.io_timeout_s)")
    _unblock(tmp_path / "in.parquet", "w")


def test_a_part_write_that_hangs_fails_the_attempt_naming_shard_and_phase(tmp_path):
    spec, engine, runner, shards = _runner(tmp_path, ["a b", "c d", "e f", "g h"], rows_per_shard=2,
                                           io_timeout_s=1.0)
    key = attempt_part_key("att", shards[0].shard_id, 0)
    _fifo(tmp_path / "out" / key)  # writing the attempt's part blocks on open
    with pytest.raises(PhaseTimeout, match=rf"^shard {shards[0].shard_id}: writing part \(2 rows\): no answer"):
        runner.run_shard(shards[0], "att")
    # the worker and its engine carry on: a real write, under a deadline no loaded machine reaches
    runner.spec = spec.model_copy(update={"cluster": spec.cluster.model_copy(update={"io_timeout_s": 600.0})})
    result = runner.run_shard(shards[1], "att-2")
    runner.stop()
    assert result.rows == 2 and result.num_errors == 0
    _unblock(tmp_path / "out" / key, "r")


def test_rebuild_cap_makes_the_remaining_suspects_error_rows(tmp_path):
    prompts = [f"prompt {i}" for i in range(8)]
    prompts[5] = "POISON row"
    engine = FakeEngine(max_num_seqs=2, max_model_len=20, fail_on="POISON")
    spec, engine, runner, shards = _runner(tmp_path, prompts, engine, max_engine_rebuilds_per_shard=1)
    result = runner.run_shard(shards[0])
    runner.stop()
    rows = _rows(spec, result)
    # rows 4-7 were in the engine: [4, 5] failed again (2nd rebuild, past the cap): both become error rows
    capped = ("engine crashed on one of 2 rows run together, not isolated further "
              "(cluster.max_engine_rebuilds_per_shard=1 reached): RuntimeError: fake engine failure")
    assert rows["r4"]["error"] == rows["r5"]["error"] == capped
    assert [i for i in range(8) if rows[f"r{i}"]["error"]] == [4, 5]
    assert result.isolation["engine_rebuilds"] == 2 and result.isolation["rows_isolated"] == 2


def test_an_engine_that_fails_on_everything_is_given_up(tmp_path):
    prompts = [f"BROKEN {i}" for i in range(8)]
    engine = FakeEngine(max_num_seqs=2, max_model_len=20, fail_on="BROKEN")
    spec, engine, runner, shards = _runner(tmp_path, prompts, engine)
    with pytest.raises(EngineFailed, match="times in a row with no row finishing in between"):
        runner.run_shard(shards[0])
    with pytest.raises(EngineFailed, match="failed earlier"):
        runner.run_shard(shards[0])
    runner.stop()


def test_a_row_that_cannot_be_stored_becomes_an_error_row(tmp_path):
    prompts = ["a b", "BADTEXT c", "d e", "f g"]
    engine = FakeEngine(max_num_seqs=2, max_model_len=20, bad_text_on="BADTEXT")
    spec, engine, runner, shards = _runner(tmp_path, prompts, engine)
    result = runner.run_shard(shards[0])
    runner.stop()
    rows = _rows(spec, result)
    assert rows["r1"]["error"].startswith("could not store the output row: ArrowTypeError: ")
    assert rows["r1"]["finish_reason"] == "error" and rows["r1"]["num_output_tokens"] == 3
    assert [rows[f"r{i}"]["generated_text"] for i in (0, 2, 3)] == ["tok0 tok1 tok2"] * 3
    assert result.num_errors == 1 and result.isolation["rows_isolated"] == 1


def test_our_engine_is_rebuilt_over_the_weights_it_holds(tiny_llama_hf_dir, tmp_path):
    from jobrunner.driver.engine_factory import build_engine, rebuild_engine
    from jobrunner.engine import SamplingParams

    spec = spec_from_dict({"name": "t", "model": {"source": str(tiny_llama_hf_dir), "dtype": "float32"},
                           "input": {"url": str(tmp_path / "unused.parquet"), "prompt_column": "prompt"},
                           "engine": {"max_num_seqs": 4, "num_kv_blocks": 32},
                           "output": {"url": str(tmp_path / "out")}})
    engine = build_engine(spec)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    before = engine.generate(["hello world", "the quick fox"], params)
    model = engine.model
    rebuilt, loaded = rebuild_engine(engine, spec)
    assert not loaded and rebuilt is not engine and rebuilt.model is model  # the same weights, no load
    assert engine.runner is None and engine.kv_manager is None  # the failed engine's KV cache is let go
    after = rebuilt.generate(["hello world", "the quick fox"], params)
    assert [o.output_token_ids for o in after] == [o.output_token_ids for o in before]
    assert rebuilt.stats().steps > 0
