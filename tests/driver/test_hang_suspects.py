"""A hung worker's suspects (driver/suspects.py): the rows its engine held when a call hung, reported by its poll;
the driver cuts the task around them and runs them one at a time, so a hanging row costs one or two worker
restarts (issue 47: 3 hanging rows in 24 spent the default 10 restarts bisecting and ended with 16 / 24 rows)."""

from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobrunner.driver.job import run_job
from jobrunner.driver.prefix_rows import read_shard_rows
from jobrunner.driver.shards import Shard, plan_shards
from jobrunner.driver.suspects import cut, in_flight
from jobrunner.driver.tasks import Task
from jobrunner.driver.worker import ShardRunner
from jobrunner.io.parts import read_output
from jobrunner.io.reader import ROW_INDEX, list_input_files
from jobrunner.io.storage import Storage
from jobrunner.spec import spec_from_dict
from tests.driver.fake_engine import FakeEngine
from tests.driver.helpers import fake_spec, read_manifest_file

pytestmark = pytest.mark.timeout(600)


def _ranges(c) -> list[tuple]:
    return [(t.row_start, t.row_end, t.alone, t.one_at_a_time) for t in c.pieces]


def test_a_task_is_cut_around_the_rows_its_engine_held():
    task = Task("s", 0, 8, alone=True, alone_crashes=2)
    found = cut(task, [2, 5, 11], alone_in_engine=False)  # 11: another piece's row
    assert _ranges(found) == [(0, 2, False, False), (2, 6, True, True), (6, 8, False, False)]
    assert not found.culprit and found.suspects.is_piece and found.suspects.alone_crashes == 0
    assert cut(task, [8, 9], alone_in_engine=False) is None  # none of its rows: innocent of this hang
    assert _ranges(cut(task, [0, 7], alone_in_engine=False)) == [(0, 8, True, True)]


def test_one_row_alone_in_the_engine_is_the_culprit_and_the_rows_after_it_stay_suspects():
    sequential = Task("s", 2, 8, alone=True, is_piece=True, one_at_a_time=True)
    found = cut(sequential, [4], alone_in_engine=True)
    assert found.culprit and (found.suspects.row_start, found.suspects.row_end) == (4, 5)
    assert _ranges(found) == [(2, 4, False, False), (4, 5, False, False), (5, 8, True, True)]
    # one row in the engine of a worker that also ran other rows: a suspect, not yet the culprit
    assert not cut(Task("s", 0, 8), [4], alone_in_engine=False).culprit


class _Hang(FakeEngine):
    """step() blocks while a HANG row runs, until released (so the test's engine thread ends)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.release = threading.Event()

    def step(self):
        while any("HANG" in r.text for r in self._running) and not self.release.is_set():
            time.sleep(0.05)
        return super().step()

    def rebuild(self):
        return self


def _runner(tmp_path, prompts: list[str]):
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(prompts))], "prompt": prompts}),
                   tmp_path / "in.parquet")
    spec = spec_from_dict({"name": "t", "sampling": {"max_tokens": 3}, "engine": {"max_num_seqs": 2},
                           "input": {"url": str(tmp_path / "in.parquet"), "prompt_column": "prompt",
                                     "id_column": "id", "prefix_grouping": "off"},
                           "output": {"url": str(tmp_path / "out")}})
    engine = _Hang(max_num_seqs=2, max_model_len=20)
    shard = plan_shards(list_input_files(spec.input.url, {}), 100)[0]
    return engine, ShardRunner(engine, spec, "w0", 0.0, {"device": "cpu"}), shard


def _suspects_when_hung(runner, shard, **kw) -> dict:
    box = {}
    thread = threading.Thread(target=lambda: box.update(result=runner.run_shard(shard, **kw)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not runner.progress()["suspects"]:
        assert time.monotonic() < deadline, "no hang reported"
        time.sleep(0.05)
    return runner.progress()["suspects"]


def test_the_poll_names_the_rows_in_a_hung_engine(tmp_path):
    # 2 rows decode at once, 4 are in the engine: rows 0-1 finish, then 2 (HANG) and 3 run and the step hangs
    engine, runner, shard = _runner(tmp_path, ["a b", "c d", "e HANG", "f g", "h i", "j k"])
    assert _suspects_when_hung(runner, shard) == {(shard.shard_id, 0): [2, 3, 4, 5]}
    engine.release.set()
    runner.stop()


def test_suspects_run_one_at_a_time_in_position_order(tmp_path):
    engine, runner, shard = _runner(tmp_path, ["z b", "c d", "a HANG", "f g"])
    assert _suspects_when_hung(runner, shard, one_at_a_time=True) == {(shard.shard_id, 0): [2]}
    assert engine.max_seen_unfinished == 1 and engine._num_finished == 2  # rows 0 and 1, one after the other
    engine.release.set()
    runner.stop()


def test_a_grouped_shard_reports_positions_not_rows(tmp_path):
    """A prefix-grouped shard reads the rows at its positions of the planned order: suspects are positions."""
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(6)], "prompt": [f"p{i}" for i in range(6)]}),
                   tmp_path / "in.parquet")
    (tmp_path / "out" / "_plan").mkdir(parents=True)
    np.array([5, 3, 0, 4, 1, 2], "<i8").tofile(tmp_path / "out" / "_plan" / "rows-x.bin")
    spec = spec_from_dict({"name": "t", "input": {"url": str(tmp_path / "in.parquet"), "prompt_column": "prompt"},
                           "output": {"url": str(tmp_path / "out"), "keep_columns": []}})
    shard = Shard("s", str(tmp_path / "in.parquet"), "in", 1, 4, order_key="_plan/rows-x.bin")
    table, _, positions = read_shard_rows(spec, shard, Storage(str(tmp_path / "out")))
    assert positions == {3: 1, 0: 2, 4: 3}
    assert table.column(ROW_INDEX).to_pylist() == [0, 3, 4]

    class _State:
        pass

    state, req = _State(), type("R", (), {"row_index": 4})()
    state.shard, state.positions = shard, positions
    assert in_flight([(state, req)]) == {("s", 1): [3]}


def test_three_hanging_rows_in_24_with_the_default_restart_limits(local_ray, tmp_path):
    """The issue's job: 24 rows in 3 shards, rows 3, 12 and 21 hang their engine's step, progress_timeout_s 3,
    default restart limits (10 replacement workers): every id once, the three as error rows, 2 restarts each."""
    ids = [f"p{i:03d}" for i in range(24)]
    prompts = [f"question {i} about things" + (" HANG" if i in (3, 12, 21) else "") for i in range(24)]
    pq.write_table(pa.table({"id": ids, "prompt": prompts, "topic": ["t"] * 24}), tmp_path / "in.parquet",
                   row_group_size=8)
    data = fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out"),
                     engine={"factory_options": {"hang_on": "HANG"}}, output={"max_error_rate": 0.2},
                     cluster={"progress_timeout_s": 3.0})
    result = run_job(spec_from_dict(data), show_progress=False)
    assert result.ok, result.summary()
    rows = read_output(str(tmp_path / "out")).to_pylist()
    assert Counter(r["id"] for r in rows) == Counter(ids)
    errors = {r["id"]: r["error"] for r in rows if r["error"]}
    assert sorted(errors) == ["p003", "p012", "p021"]
    assert all(e.startswith("engine crashed on this row: worker w") and "while decoding 1 rows (engine step has "
               "not returned for " in e for e in errors.values())
    cost = read_manifest_file(tmp_path / "out")["runs"][-1]["isolation"]
    assert cost["rows_isolated"] == 3 and 3 <= cost["model_loads"] <= 6
