"""The driver's progress display: stages, monotonic counts, a final line; plain lines in logs, a bar on a tty."""

from __future__ import annotations

import io
import logging
import sys

from jobrunner.driver.pool import Worker
from jobrunner.driver.progress import Progress
from jobrunner.driver.tasks import Task


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


def test_plain_lines_in_logs():
    out, clock = io.StringIO(), FakeClock()
    progress = Progress(total_rows=100, done_rows=20, file=out, interval_s=0.0, clock=clock)
    progress.stage("placing 1 worker, each asking {\"CPU\": 2}")
    progress.update(rows=20, output_tokens=0)  # the first report: no token yet
    clock.advance(8.0)
    progress.update(rows=60, output_tokens=400)  # 40 rows and 400 tokens in 8 s
    clock.advance(2.0)
    progress.close(rows=100, output_tokens=900)
    lines = out.getvalue().splitlines()
    assert lines == [
        '[jobrunner] placing 1 worker, each asking {"CPU": 2}',
        "[jobrunner] rows 20/100 (20%) | 0 out tokens, 0.0 out tok/s | elapsed 0s | ETA ?",
        # 40 rows in the 8 s since the report before the first token: 40 left take 8 s more
        "[jobrunner] rows 60/100 (60%) | 400 out tokens, 50.0 out tok/s | elapsed 8s | ETA 8s",
        "[jobrunner] done: rows 100/100 (100%) | 900 out tokens in this run, 90.0 out tok/s since the first "
        "token | elapsed 10s",
    ]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_rows_and_tokens_never_go_back():
    out = io.StringIO()
    progress = Progress(total_rows=64, file=out, interval_s=0.0)
    progress.update(rows=34, output_tokens=500)
    progress.update(rows=32, output_tokens=450)  # a stale report: the display keeps 34 / 500
    progress.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[jobrunner] rows 34/64 (53%) | 500 out tokens")
    assert lines[1].startswith("[jobrunner] rows 34/64 (53%) | 500 out tokens")
    assert lines[2].startswith("[jobrunner] ended: rows 34/64 (53%) | 500 out tokens")


def test_lines_at_the_interval_and_the_final_line_once():
    out = io.StringIO()
    progress = Progress(total_rows=16, file=out, interval_s=3600.0)
    for rows in range(0, 17, 4):
        progress.update(rows=rows, output_tokens=rows * 10)
    progress.close(rows=16, output_tokens=160)
    progress.close(rows=16, output_tokens=160)
    lines = out.getvalue().splitlines()
    assert lines == [lines[0], lines[1]]  # the first report, then (interval not reached) only the final line
    assert lines[0].startswith("[jobrunner] rows 0/16 (0%)")
    assert lines[1].startswith("[jobrunner] done: rows 16/16 (100%) | 160 out tokens in this run")


def test_tokens_per_s_counts_tokens_before_rows_finish():
    clock = FakeClock()
    progress = Progress(total_rows=8, file=io.StringIO(), interval_s=0.0, clock=clock)
    progress.update(rows=0, output_tokens=0)
    clock.advance(2.0)
    progress.update(rows=0, output_tokens=100)  # no row finished, tokens produced
    assert progress.tokens_per_s() == 50.0
    assert progress.eta_s() is None  # no row yet: no honest ETA


def test_tokens_per_s_is_over_the_last_window_only():
    clock = FakeClock()
    progress = Progress(total_rows=8, file=io.StringIO(), interval_s=0.0, clock=clock)
    progress.update(rows=0, output_tokens=0)
    clock.advance(100.0)
    progress.update(rows=1, output_tokens=10_000)  # start-up, then a burst: 100 tok/s over the first 100 s
    for _ in range(4):
        clock.advance(10.0)
        progress.update(rows=1, output_tokens=progress.tokens + 50)  # then 5 tok/s
    assert progress.tokens_per_s() == 5.0  # the samples older than 30 s (RATE_WINDOW_S) are gone


def test_average_rate_of_tokens_that_all_arrive_in_one_report_spans_from_the_report_before():
    clock = FakeClock()
    progress = Progress(total_rows=4, file=io.StringIO(), interval_s=0.0, clock=clock)
    clock.advance(6.0)  # start-up
    progress._take(0, 0)  # the last report without tokens
    clock.advance(4.0)
    progress._take(4, 24)  # a tiny job: every token in one report
    assert progress.average_tokens_per_s() == 6.0  # 24 tokens over the 4 s since that report, not microseconds
    # the run began ten seconds ago; one report carried every token: the rate is over the whole run
    assert progress.final_line() == ("[jobrunner] done: rows 4/4 (100%) | 24 out tokens in this run, "
                                     "2.4 out tok/s over the whole run (start-up included) | elapsed 10s")


def test_total_grows_when_rows_exceed_it():
    progress = Progress(total_rows=4, file=io.StringIO(), interval_s=0.0)
    progress.update(rows=6, output_tokens=10)
    assert progress.total == 6 and progress.eta_s() == 0.0


def test_terminal_bar_ends_at_the_final_count_and_other_output_gets_its_own_lines(monkeypatch):
    tty = FakeTty()
    monkeypatch.setattr(sys, "stderr", tty)
    logger = logging.getLogger("jobrunner-test-progress")
    handler = logging.StreamHandler(tty)
    logger.addHandler(handler)
    try:
        progress = Progress(total_rows=16, file=tty, interval_s=0.0)
        progress.stage("starting a local Ray instance")
        progress.update(rows=8, output_tokens=80)
        sys.stderr.write("WARNING ray: something Ray wanted to say")
        sys.stderr.write("\n")
        logger.warning("a logged warning")
        progress.stage("worker w1 placed; loading model m")
        progress.close(rows=16, output_tokens=160)
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
    pool.workers = [_worker({("s0", 0): (32, 600), ("s1", 0): (5, 90)}, [running], tokens=700)]
    assert pool.live_rows_tokens() == (5, 90)
    assert pool.tokens_produced() == 707
