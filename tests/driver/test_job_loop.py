"""The job loop never idles: its shard records and states, the blame for a lost worker, the retry backoff's
ceiling, the progress-deadline floor, and the two job-wide checks (a round where nothing can happen, a job
with no event). The first tests need no Ray; the last ones run whole jobs on a local Ray with the fake engine
and would hang (until the pytest timeout) without the checks they name.
"""

from __future__ import annotations

import re
import types

import pytest

from jobrunner.driver import pool as pool_module
from jobrunner.driver.job import run_job
from jobrunner.driver.pool import MIN_SILENCE_S, Worker, WorkerPool, silence
from jobrunner.driver.shard_run import ShardRuns, ShardState, judge_loss, worker_cap
from jobrunner.driver.shards import Shard, ShardTable
from jobrunner.driver.tasks import MAX_RETRY_BACKOFF_S, TaskQueue, retry_delay
from jobrunner.driver.watchdog import Watchdog, idle_problem
from jobrunner.io.parts import read_output
from jobrunner.spec import SpecError, spec_from_dict
from tests.driver.helpers import fake_spec, read_manifest_file, write_prompts

pytestmark = pytest.mark.timeout(600)


def _spec(tmp_path, **cluster):
    data = fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out"))
    data["cluster"].update(cluster)
    return spec_from_dict(data)


def _table(n: int = 3) -> ShardTable:
    return ShardTable.from_shards([Shard(f"{i:05d}-abcdef12", "file:///in.parquet", "in", 8 * i, 8 * i + 8)
                                   for i in range(n)])


# ---- spec ------------------------------------------------------------------------------------------------
def test_a_progress_timeout_below_three_polls_is_refused_naming_the_field(tmp_path):
    with pytest.raises(SpecError) as info:
        _spec(tmp_path, progress_timeout_s=1.0)
    assert ("cluster.progress_timeout_s=1 is below 3 s (3 progress polls, one every 1 s): healthy workers would be "
            "replaced as silent") in str(info.value)
    assert _spec(tmp_path, progress_timeout_s=3.0).cluster.progress_timeout_s == 3.0


def test_the_stall_timeout_defaults_to_1800_s_and_may_not_undercut_the_progress_timeout(tmp_path):
    assert _spec(tmp_path).cluster.job_stall_timeout_s == 1800.0
    with pytest.raises(SpecError) as info:
        _spec(tmp_path, job_stall_timeout_s=60.0)  # progress_timeout_s defaults to 600
    assert ("cluster.job_stall_timeout_s=60 is below cluster.progress_timeout_s=600: a hung worker would end the "
            "job before it is replaced") in str(info.value)


# ---- retry backoff ---------------------------------------------------------------------------------------
def test_the_retry_backoff_doubles_up_to_its_ceiling():
    assert MAX_RETRY_BACKOFF_S == 60.0
    assert [retry_delay(1.0, f) for f in range(1, 9)] == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert retry_delay(1.0, 19) == 60.0  # was 2^18 s with max_shard_attempts=20
    assert retry_delay(0.1, 3) == pytest.approx(0.4)
    assert retry_delay(120.0, 1) == 120.0 and retry_delay(120.0, 5) == 120.0  # a longer first wait is kept
    assert retry_delay(0.0, 7) == 0.0


# ---- silence ---------------------------------------------------------------------------------------------
def test_silence_is_the_age_of_the_oldest_unanswered_poll():
    worker = Worker("w0", actor=None, ping_ref=None, load_ref=None, is_placed=True, is_ready=True)
    worker.poll_sent = 100.0
    assert silence(worker, 102.5) == 0.0  # no poll outstanding: an answered worker is not silent
    worker.poll_ref = object()
    assert silence(worker, 102.5) == 2.5


def test_a_worker_is_lost_by_silence_only_after_the_silence_floor(tmp_path, monkeypatch):
    """The engine's stall (reported by the worker) ends it after progress_timeout_s; no answer at all only after
    max(progress_timeout_s, MIN_SILENCE_S): a slow reply on a starved machine is no death."""
    spec = spec_from_dict(fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out"),
                                    cluster={"progress_timeout_s": 3.0}))
    pool = WorkerPool.__new__(WorkerPool)
    pool.spec = spec
    worker = Worker("w0", actor=None, ping_ref=None, load_ref=None, is_placed=True, is_ready=True)
    worker.tasks = {"t": object()}
    pool.workers = [worker]
    now = 1000.0  # the pool's clock, fixed: the silence is exact whatever the machine's load
    monkeypatch.setattr(pool_module, "time", types.SimpleNamespace(monotonic=lambda: now))
    worker.poll_ref, worker.poll_sent = object(), now - 10.0  # 10 s without an answer
    assert pool.stalled() == []
    worker.poll_sent = now - MIN_SILENCE_S - 1.0
    [(lost, why, engine)] = pool.stalled()
    assert lost is worker and not engine and why.startswith("no answer for 31s (the most is max(")
    worker.poll_ref, worker.stalled_s, worker.stall = None, 4.0, "engine step has not returned for 4 s"
    assert pool.stalled() == [(worker, "engine step has not returned for 4 s; cluster.progress_timeout_s=3", True)]


# ---- shard records and blame -----------------------------------------------------------------------------
def test_a_shard_run_goes_queued_running_queued_publishing_and_leaves_when_committed_or_failed():
    table = _table()
    runs = ShardRuns(table)
    task = runs.hand_out(1)
    run = task.run
    assert (run.row, run.shard_id, task.row_start, task.row_end) == (1, "00001-abcdef12", 8, 16)
    assert runs.state_of(1) is ShardState.QUEUED and runs.state_of(0) is ShardState.PENDING
    runs.started(task, "ref-a")
    assert runs.state_of(1) is ShardState.RUNNING and run.attempts == 1 and run.refs == {"ref-a"}
    left, right = task.halves()
    assert left.run is run and right.run is run
    runs.started(left, "ref-b")
    runs.returned(task, "ref-a")
    assert runs.state_of(1) is ShardState.RUNNING  # a piece still runs
    runs.returned(left, "ref-b")
    assert runs.state_of(1) is ShardState.QUEUED and run.attempts == 2
    runs.publishing_started(run, {"rows": 8}, (0, None), future=None)
    assert [r.row for r in runs.publishing()] == [1]
    runs.committed(run)
    assert len(runs) == 0 and run.state is ShardState.COMMITTED
    other = runs.hand_out(2).run
    runs.failed(other, "boom")
    assert len(runs) == 0 and other.state is ShardState.FAILED and other.error == "boom"


def test_losing_a_worker_that_writes_error_rows_is_never_the_rows_fault():
    runs = ShardRuns(_table())
    task = runs.hand_out(0)
    task.error_text = "engine crashed on one of rows 0-8, not isolated further (...)"
    task.run.workers_lost = 1
    verdict = judge_loss(task, ran_alone=True, crash=None, stalled=True, cap=worker_cap(1), bisect_after=2)
    assert (verdict.action, verdict.blamed) == ("requeue", False)


def test_the_blame_rule_for_rows_that_touch_the_engine():
    runs = ShardRuns(_table())
    task = runs.hand_out(0)
    task.run.workers_lost = 1
    assert judge_loss(task, False, None, False, 11, 2).action == "alone"  # shared worker: not blamed
    assert judge_loss(task, True, None, False, 11, 2).action == "alone"  # a first death alone may be the node's
    assert judge_loss(task, True, None, True, 11, 2).action == "isolate"  # a stall alone: surely its rows
    assert judge_loss(task, True, "engine gave up", False, 11, 2).action == "isolate"
    task.alone_crashes = 1
    assert judge_loss(task, True, None, False, 11, 2).action == "isolate"  # a second death alone


def test_a_shard_that_cost_more_workers_than_its_cap_is_failed():
    assert worker_cap(8) == 11 and worker_cap(0) == 3
    runs = ShardRuns(_table())
    task = runs.hand_out(0)
    task.error_text = "error rows"
    task.run.workers_lost = worker_cap(1)
    assert judge_loss(task, True, None, False, worker_cap(1), 2).action == "requeue"
    task.run.workers_lost += 1
    assert judge_loss(task, True, None, False, worker_cap(1), 2).action == "fail"


# ---- job-wide checks -------------------------------------------------------------------------------------
def test_a_round_with_unfinished_shards_and_nothing_in_flight_is_an_error(tmp_path):
    pool = WorkerPool(_spec(tmp_path), 0, 0.0, "t")  # no worker (none started, no Ray needed)
    runs = ShardRuns(_table())
    queue = TaskQueue(fresh=None)
    assert idle_problem(pool, queue, runs) is None  # nothing left: the job is done
    task = runs.hand_out(1)
    queue.put(task, delay_s=30.0)
    assert idle_problem(pool, queue, runs) is None  # a backed-off task is due later: waiting is right
    queue.discard(lambda t: True)
    assert idle_problem(pool, queue, runs) == (
        "the job cannot go on: shards remain unfinished but nothing is running, starting or due "
        "(shards: 0 pending, 1 queued, 0 running, 0 publishing, 0 committed, 0 failed "
        "[00001-abcdef12: queued (0/1 pieces done, 0 running, 0 attempts, 0 workers lost)]; 0 task(s) queued; "
        "workers: none)")


def test_no_event_for_the_stall_timeout_names_what_the_job_waited_for(tmp_path):
    pool = WorkerPool(_spec(tmp_path), 0, 0.0, "t")
    runs = ShardRuns(_table())
    queue = TaskQueue()
    queue.put(runs.hand_out(0))
    watch = Watchdog(5.0)
    watch.event("shard 00002-abcdef12 committed")
    assert watch.problem(pool, queue, runs) is None
    watch.last_at -= 7.0  # seven quiet seconds, without sleeping
    assert watch.problem(pool, queue, runs) == (
        "no event for 7s (cluster.job_stall_timeout_s=5; the last: shard 00002-abcdef12 committed) while "
        "waiting for 1 queued task(s) to start")


# ---- whole jobs ------------------------------------------------------------------------------------------
def _job(tmp_path, n_rows=16, poison=None, engine=None, **cluster):
    write_prompts(tmp_path / "in.parquet", n_rows, poison=poison)
    data = fake_spec(str(tmp_path / "in.parquet"), str(tmp_path / "out"), engine=engine or {},
                     output={"max_error_rate": 1.0}, cluster={"num_workers": 1, **cluster})
    return spec_from_dict(data)


def test_an_empty_pool_that_may_not_be_refilled_ends_the_job_leaving_its_shards_pending(local_ray, tmp_path):
    """A hanging row costs the only worker; with no replacement allowed the job used to sleep forever."""
    spec = _job(tmp_path, poison=5, engine={"factory_options": {"hang_on": "POISON"}}, progress_timeout_s=3.0,
                max_worker_restarts=0)
    result = run_job(spec, show_progress=False)
    assert not result.ok
    assert result.error.startswith("no worker left and none may be started: cluster.max_worker_restarts=0 "
                                   "replacement(s) already started in the last cluster.worker_restart_window_s=600s; "
                                   "last loss: worker w0: ")
    shards = sorted(read_manifest_file(tmp_path / "out")["shards"].items())
    # the poison row's shard is left for a resume (not failed, not lost); the other one may have finished first
    assert shards[0][1]["status"] == "pending" and shards[1][1]["status"] in ("pending", "committed")
    assert all(e["error"] == f"not run: {result.error}" for _, e in shards if e["status"] == "pending")
    assert not (tmp_path / "out" / "_SUCCESS").exists()


def test_healthy_workers_slower_than_the_progress_timeout_are_not_declared_dead(local_ray, tmp_path):
    """Shards that take longer than progress_timeout_s, no replacement allowed: any worker wrongly called
    silent would end the job."""
    spec = _job(tmp_path, n_rows=16, engine={"factory_options": {"step_delay_s": 0.15}},
                progress_timeout_s=3.0, max_worker_restarts=0)
    result = run_job(spec, show_progress=False)
    assert result.ok, result.summary()
    assert len(read_output(str(tmp_path / "out"))) == 16
    shards = read_manifest_file(tmp_path / "out")["shards"].values()
    assert [e["infra_failures"] for e in shards] == [0, 0] and all(e["worker_id"] == "w0" for e in shards)


def test_a_job_with_no_event_for_the_stall_timeout_ends_naming_what_it_waited_for(local_ray, tmp_path):
    """A model load that never ends (within the 1800 s start deadline): the stall timeout ends the job."""
    spec = _job(tmp_path, engine={"factory_options": {"load_delay_s": 300.0}}, progress_timeout_s=3.0,
                job_stall_timeout_s=4.0)
    result = run_job(spec, show_progress=False)
    assert not result.ok
    assert result.error.startswith("no event for ")
    # On a loaded machine the placement event may not come within the 4 s: the last event is then the start.
    assert re.search(r"s \(cluster\.job_stall_timeout_s=4; the last: (worker w0 placed|the workers were started)\) "
                     r"while waiting for 1 worker\(s\) to be placed and load the model \(w0\); "
                     r"2 queued task\(s\) to start", result.error), result.error
    manifest = read_manifest_file(tmp_path / "out")
    assert {e["status"] for e in manifest["shards"].values()} == {"pending"}
