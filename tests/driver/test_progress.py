"""The driver's progress display: stages, monotonic counts, a final line; plain lines in logs, a bar on a tty."""

from __future__ import annotations

import io
import logging
import sys

import pyarrow as pa
import pyarrow.parquet as pq

from jobrunner.driver.pool import Worker
from jobrunner.driver.progress import Progress
from jobrunner.driver.progress_counts import CommittedCounts, ShardProgress, result_progress, snapshot
from jobrunner.driver.tasks import Task
from jobrunner.progress_view import Counts, counts_of


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


class FakeClock:
    """A monotonic clock that moves only when told (seconds): rates and ETAs come out exact."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _rows(done: int, total: int) -> Counts:
    """n = 1: prompts and samples are the same rows."""
    return Counts(done, total, done, total, 1)


def test_plain_lines_in_logs():
    out, clock = io.StringIO(), FakeClock()
    # the command started 5 s before the run's counts: elapsed is the command's
    progress = Progress(_rows(20, 100), file=out, interval_s=0.0, clock=clock, started_s=clock.now - 5.0)
    progress.stage("placing 1 worker, each asking {\"CPU\": 2}")
    progress.update(_rows(20, 100), tokens=0)  # the first report: no token yet
    clock.advance(8.0)
    progress.update(_rows(60, 100), tokens=400)  # 40 rows and 400 tokens in 8 s
    clock.advance(2.0)
    progress.close(_rows(100, 100), tokens=900)
    lines = out.getvalue().splitlines()
    assert lines == [
        '[jobrunner] placing 1 worker, each asking {"CPU": 2}',
        "[jobrunner] rows 20/100 (20%) | 0 out tokens, 0.0 out tok/s | elapsed 5s | ETA ?",
        # 40 rows in the 8 s since the report before the first token: 40 left take 8 s more
        "[jobrunner] rows 60/100 (60%) | 400 out tokens, 50.0 out tok/s | elapsed 13s | ETA 8s",
        "[jobrunner] done: rows 100/100 (100%) | 900 out tokens in this run, 90.0 out tok/s since the first "
        "token",
    ]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_prompts_and_samples_where_n_is_more_than_one():
    out, clock = io.StringIO(), FakeClock()
    progress = Progress(counts_of(0, 40, 0, 3), file=out, interval_s=0.0, clock=clock)
    progress.update(counts_of(0, 40, 0, 3), tokens=0)
    clock.advance(10.0)
    progress.update(counts_of(13, 40, 39, 3), tokens=1300)
    assert out.getvalue().splitlines() == [
        "[jobrunner] prompts 0/40 · samples 0/120 (0%) | 0 out tokens, 0.0 out tok/s | elapsed 0s | ETA ?",
        "[jobrunner] prompts 13/40 · samples 39/120 (32%) | 1,300 out tokens, 130.0 out tok/s | elapsed 10s | "
        "ETA 21s",
    ]


def test_a_job_of_error_rows_ends_at_100_percent():
    """Four prompts x n 3 that all failed before the engine: four error rows, each counting as its 3 samples."""
    out = io.StringIO()
    progress = Progress(counts_of(0, 4, 0, 3), file=out, interval_s=3600.0)
    progress.close(counts_of(4, 4, 12, 3), tokens=0)
    assert out.getvalue().splitlines()[-1].startswith("[jobrunner] done: prompts 4/4 · samples 12/12 (100%) | 0 out")


def test_the_eta_counts_rows_still_decoding():
    """40 prompts decode together and end together: after 27 s none is done, yet 90% of their tokens are out.
    The ETA counts them by their share (3 s left), not by whole rows (none: no ETA at all, or a minute)."""
    clock = FakeClock()
    progress = Progress(_rows(0, 40), file=io.StringIO(), interval_s=0.0, clock=clock)
    progress.update(_rows(0, 40), tokens=0)
    clock.advance(27.0)
    progress.update(_rows(0, 40), tokens=3600, in_flight=36.0)  # 36 of 40 prompts' worth of tokens
    assert progress.eta_s() == 3.0
    progress.update(_rows(40, 40), tokens=4000)
    assert progress.eta_s() == 0.0


def test_embed_counts_input_tokens():
    out, clock = io.StringIO(), FakeClock()
    progress = Progress(_rows(0, 8), file=out, interval_s=0.0, clock=clock, kind="in")
    progress.update(_rows(0, 8), tokens=0)
    clock.advance(2.0)
    progress.update(_rows(4, 8), tokens=200)
    clock.advance(2.0)
    progress.close(_rows(8, 8), tokens=400)
    lines = out.getvalue().splitlines()
    assert lines[1] == "[jobrunner] rows 4/8 (50%) | 200 in tokens, 100.0 in tok/s | elapsed 2s | ETA 2s"
    assert lines[2] == ("[jobrunner] done: rows 8/8 (100%) | 400 in tokens in this run, 100.0 in tok/s since the "
                        "first token")
    assert "out tok" not in out.getvalue()


def test_an_interrupted_run_ends_on_its_committed_counts():
    """Rows shown in flight are lost at an interrupt: the last line says what is committed (what `jobrunner
    status` says and a rerun keeps), and the elapsed time (nothing follows it)."""
    out, clock = io.StringIO(), FakeClock()
    progress = Progress(counts_of(0, 60, 0, 3), file=out, interval_s=0.0, clock=clock)
    progress.update(counts_of(45, 60, 135, 3), tokens=5000)
    clock.advance(65.0)
    progress.close(counts_of(38, 60, 114, 3), stopped="interrupted")
    assert out.getvalue().splitlines()[-1] == (
        "[jobrunner] stopped (interrupted): prompts 38/60 · samples 114/180 committed (63%) | 5,000 out tokens in "
        "this run, 76.9 out tok/s over the whole run (start-up included) | elapsed 1m05s; a rerun goes on from the "
        "committed rows")


def test_rows_and_tokens_never_go_back():
    out = io.StringIO()
    progress = Progress(_rows(0, 64), file=out, interval_s=0.0)
    progress.update(_rows(34, 64), tokens=500)
    progress.update(_rows(32, 64), tokens=450)  # a stale report: the display keeps 34 / 500
    progress.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[jobrunner] rows 34/64 (53%) | 500 out tokens")
    assert lines[1].startswith("[jobrunner] rows 34/64 (53%) | 500 out tokens")
    assert lines[2].startswith("[jobrunner] ended: rows 34/64 committed (53%) | 500 out tokens")


def test_lines_at_the_interval_and_the_final_line_once():
    out = io.StringIO()
    progress = Progress(_rows(0, 16), file=out, interval_s=3600.0)
    for rows in range(0, 17, 4):
        progress.update(_rows(rows, 16), tokens=rows * 10)
    progress.close(_rows(16, 16), tokens=160)
    progress.close(_rows(16, 16), tokens=160)
    lines = out.getvalue().splitlines()
    assert lines == [lines[0], lines[1]]  # the first report, then (interval not reached) only the final line
    assert lines[0].startswith("[jobrunner] rows 0/16 (0%)")
    assert lines[1].startswith("[jobrunner] done: rows 16/16 (100%) | 160 out tokens in this run")


def test_tokens_per_s_counts_tokens_before_rows_finish():
    clock = FakeClock()
    progress = Progress(_rows(0, 8), file=io.StringIO(), interval_s=0.0, clock=clock)
    progress.update(_rows(0, 8), tokens=0)
    clock.advance(2.0)
    progress.update(_rows(0, 8), tokens=100)  # no row finished, tokens produced
    assert progress.tokens_per_s() == 50.0
    assert progress.eta_s() is None  # no row and no share of one yet: no honest ETA


def test_tokens_per_s_is_over_the_last_window_only():
    clock = FakeClock()
    progress = Progress(_rows(0, 8), file=io.StringIO(), interval_s=0.0, clock=clock)
    progress.update(_rows(0, 8), tokens=0)
    clock.advance(100.0)
    progress.update(_rows(1, 8), tokens=10_000)  # start-up, then a burst: 100 tok/s over the first 100 s
    for _ in range(4):
        clock.advance(10.0)
        progress.update(_rows(1, 8), tokens=progress.tokens + 50)  # then 5 tok/s
    assert progress.tokens_per_s() == 5.0  # the samples older than 30 s (RATE_WINDOW_S) are gone


def test_average_rate_of_tokens_that_all_arrive_in_one_report_spans_from_the_report_before():
    clock = FakeClock()
    progress = Progress(_rows(0, 4), file=io.StringIO(), interval_s=0.0, clock=clock)
    clock.advance(6.0)  # start-up
    progress._take(_rows(0, 4), 0, 0.0)  # the last report without tokens
    clock.advance(4.0)
    progress._take(_rows(4, 4), 24, 0.0)  # a tiny job: every token in one report
    assert progress.average_tokens_per_s() == 6.0  # 24 tokens over the 4 s since that report, not microseconds
    # the run began ten seconds ago; one report carried every token: the rate is over the whole run
    assert progress.final_line() == ("[jobrunner] done: rows 4/4 (100%) | 24 out tokens in this run, "
                                     "2.4 out tok/s over the whole run (start-up included)")


def test_total_grows_when_rows_exceed_it():
    progress = Progress(_rows(0, 4), file=io.StringIO(), interval_s=0.0)
    progress.update(counts_of(6, 4, 6, 1), tokens=10)
    assert progress.counts.prompts_total == 6 and progress.eta_s() == 0.0


def test_terminal_bar_ends_at_the_final_count_and_other_output_gets_its_own_lines(monkeypatch):
    tty = FakeTty()
    monkeypatch.setattr(sys, "stderr", tty)
    logger = logging.getLogger("jobrunner-test-progress")
    handler = logging.StreamHandler(tty)
    logger.addHandler(handler)
    try:
        progress = Progress(_rows(0, 16), file=tty, interval_s=0.0)
        progress.stage("starting a local Ray instance")
        progress.update(_rows(8, 16), tokens=80)
        sys.stderr.write("WARNING ray: something Ray wanted to say")
        sys.stderr.write("\n")
        logger.warning("a logged warning")
        progress.stage("worker w1 placed; loading model m")
        progress.close(_rows(16, 16), tokens=160)
    finally:
        logger.removeHandler(handler)
    assert sys.stderr is tty  # restored
    text = tty.getvalue()
    for message in ("WARNING ray: something Ray wanted to say\n", "a logged warning\n",
                    "[jobrunner] worker w1 placed; loading model m\n"):
        before = text[:text.index(message)]
        assert before.endswith("\r") or before.endswith("\n"), (message, before[-80:])  # starts its own line
    bar_draws = [part for part in text.replace("\n", "\r").split("\r") if "/16" in part]
    assert "16/16" in bar_draws[-1]  # the bar's last state is the final count
    assert text.rstrip("\n").splitlines()[-1].startswith("[jobrunner] done: rows 16/16 (100%)")


def _worker(live: dict, tasks: list[Task], tokens: int = 0) -> Worker:
    worker = Worker("w0", actor=None, ping_ref=None, load_ref=None, is_placed=True, is_ready=True)
    worker.live, worker.engine_tokens = live, tokens
    worker.tasks = {object(): t for t in tasks}
    return worker


def test_live_rows_count_only_shards_still_running():
    from jobrunner.driver.pool import WorkerPool

    pool = WorkerPool.__new__(WorkerPool)
    pool.removed_tokens = 7
    running = Task("s1", 0, 32)
    # s0 returned already; a poll answered before it returned still lists it: it must not count twice
    pool.workers = [_worker({("s0", 0): ShardProgress(32, 600, 32, 32), ("s1", 0): ShardProgress(5, 90, 5, 5)},
                            [running], tokens=700)]
    assert pool.live_progress() == ShardProgress(5, 90, 5, 5)
    assert pool.tokens_produced() == 707


def _runner(tmp_path, prompts: list, n: int):
    from jobrunner.driver.shards import plan_shards
    from jobrunner.driver.worker import ShardRunner
    from jobrunner.io.reader import list_input_files
    from jobrunner.spec import spec_from_dict
    from tests.driver.fake_engine import FakeEngine

    pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(prompts))], "prompt": pa.array(prompts, pa.string())}),
                   tmp_path / "in.parquet")
    spec = spec_from_dict({"name": "t", "input": {"url": str(tmp_path / "in.parquet"), "prompt_column": "prompt",
                                                  "id_column": "id"},
                           "sampling": {"n": n, "max_tokens": 3}, "engine": {"max_num_seqs": 2},
                           "output": {"url": str(tmp_path / "out")}})
    runner = ShardRunner(FakeEngine(max_num_seqs=2, max_model_len=20), spec, "w0", 0.0, {"device": "cpu"})
    return runner, plan_shards(list_input_files(spec.input.url, {}), spec.rows_per_shard)


def test_a_worker_counts_an_error_row_as_its_n_samples(tmp_path):
    """Four prompts x n 3 that fail before the engine: four error rows, four prompts, twelve samples done."""
    runner, shards = _runner(tmp_path, [None, "", None, None], n=3)
    result = runner.run_shard(shards[0])
    runner.stop()
    assert (result.rows, result.num_errors, result.samples) == (4, 4, 12)
    from jobrunner.driver.job import _shard_entry

    entry, _ = _shard_entry([result], _Run())
    assert (entry["rows"], entry["num_samples"]) == (4, 12)


def test_a_worker_reports_prompts_samples_and_tokens_of_running_shards(tmp_path):
    runner, shards = _runner(tmp_path, ["one two", None, "three four five"], n=1)
    result = runner.run_shard(shards[0])
    runner.stop()
    assert (result.rows, result.num_errors, result.samples, result.num_prompt_tokens) == (3, 1, 3, 5)
    assert result_progress(result) == ShardProgress(rows=3, output_tokens=6, prompts=3, samples=3, prompt_tokens=5)


class _Run:
    """What _shard_entry reads of a ShardRun."""

    attempts, failures, infra_failures = 1, 0, 0

    class isolation:  # noqa: N801 - stands in for an IsolationCost
        is_empty = True


def _table(tmp_path, committed: dict[int, dict]) -> CommittedCounts:
    """4 shards of 10 prompts; `committed`: shard index -> its record's counts."""
    from jobrunner.driver.shards import plan_shards
    from jobrunner.io.reader import InputFile

    shards = plan_shards([InputFile(url=str(tmp_path / "in.parquet"), stem="in", num_rows=40,
                                    row_group_num_rows=(10,) * 4)], 10)
    for index, record in committed.items():
        shards.commit(index, {**shards.columns.entry(index), "status": "committed", **record})
    return CommittedCounts(shards)


def test_committed_counts_take_samples_or_rows_of_an_older_driver(tmp_path):
    counted = _table(tmp_path, {0: {"rows": 12, "num_samples": 30}, 1: {"rows": 30}})  # shard 1: no num_samples
    assert (counted.prompts, counted.prompts_total, counted.samples) == (20, 40, 60)
    counted.add({"row_start": 20, "row_end": 30, "rows": 30, "num_samples": 30, "num_output_tokens": 900})
    assert (counted.prompts, counted.samples, counted.this_run.output_tokens) == (30, 90, 900)


def test_a_snapshot_counts_rows_decoding_by_their_tokens(tmp_path):
    counted = _table(tmp_path, {0: {"rows": 30, "num_samples": 30}})
    # this run: 5 prompts (15 samples) finished in a running shard with 150 tokens; the engines sampled 450:
    # 300 more tokens at max_tokens x n = 96 a prompt = 3.125 prompts' worth in flight (not at the finished rows'
    # 30 a prompt: the short rows finish first, the long ones are still decoding)
    finished = ShardProgress(rows=15, output_tokens=150, prompts=5, samples=15)
    snap = snapshot(counted, finished, n=3, kind="out", tokens_produced=450, tokens_per_prompt=96.0)
    assert snap.counts == Counts(15, 40, 45, 120, 3) and snap.tokens == 450 and snap.in_flight == 300 / 96
    # max_tokens unknown: the finished rows' average
    snap = snapshot(counted, finished, n=3, kind="out", tokens_produced=450, tokens_per_prompt=0.0)
    assert snap.in_flight == 10.0
    # before any prompt of this run is done, a prompt is expected to cost max_tokens x n
    snap = snapshot(counted, ShardProgress(), n=3, kind="out", tokens_produced=192, tokens_per_prompt=96.0)
    assert snap.in_flight == 2.0
    # never more than 90% of what is left: the estimate cannot finish the job
    snap = snapshot(counted, ShardProgress(), n=3, kind="out", tokens_produced=10**6, tokens_per_prompt=96.0)
    assert snap.in_flight == 0.9 * 30
    # embed / score: input tokens, nothing in flight
    snap = snapshot(counted, ShardProgress(rows=4, prompts=4, samples=4, prompt_tokens=80), n=1, kind="in",
                    tokens_produced=0, tokens_per_prompt=0.0)
    assert snap.tokens == 80 and snap.in_flight == 0.0
