"""The job loop's two last-resort checks: a round where nothing can happen, and a job with no event.

Every other deadline belongs to one worker or one call (driver/pool.py, driver/deadlines.py). These two look
at the whole job, so that no combination of states the other rules missed can idle a job forever:

- `idle_problem`: shards remain unfinished, yet nothing is in flight (no task, no publish), no worker is
  starting and no backed-off task is due. The loop would only sleep; instead the job fails at once, naming
  every shard's state.
- `Watchdog`: no event (a shard result, a worker placed or ready, a commit, progress reported by a worker's
  poll) for `cluster.job_stall_timeout_s`; the job fails naming what it was waiting for.
"""

from __future__ import annotations

import time

from jobrunner.driver.pool import WorkerPool
from jobrunner.driver.shard_run import ShardRuns
from jobrunner.driver.tasks import TaskQueue

MAX_NAMED = 5  # tasks or workers named one by one in a message


class Watchdog:
    """The job-wide deadline: the time of the last event, and what it was."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.last_at, self.last = time.monotonic(), "the loop started"

    def event(self, what: str) -> None:
        self.last_at, self.last = time.monotonic(), what

    def problem(self, pool: WorkerPool, queue: TaskQueue, runs: ShardRuns) -> str | None:
        """Why the job ends (None while an event came in the last timeout_s)."""
        quiet = time.monotonic() - self.last_at
        if quiet <= self.timeout_s:
            return None
        return (f"no event for {quiet:.0f}s (cluster.job_stall_timeout_s={self.timeout_s:g}; the last: "
                f"{self.last}) while waiting for {waiting_for(pool, queue, runs)}")


def idle_problem(pool: WorkerPool, queue: TaskQueue, runs: ShardRuns) -> str | None:
    """Why the job cannot go on (None while something is in flight, starting or due, or all is done)."""
    unfinished = len(queue) or len(runs)
    if not unfinished or pool.busy or pool.start_refs() or runs.publishing() or queue.next_due_in() is not None:
        return None
    workers = ", ".join(f"{w.worker_id} ({'ready' if w.is_ready else 'starting'}, {len(w.tasks)} tasks)"
                        for w in pool.workers) or "none"
    return (f"the job cannot go on: shards remain unfinished but nothing is running, starting or due "
            f"({runs.summary(len(queue.fresh))}; {len(queue)} task(s) queued; workers: {workers})")


def waiting_for(pool: WorkerPool, queue: TaskQueue, runs: ShardRuns) -> str:
    """What the loop waits for now, in words."""
    running = [f"{t.shard_id} rows {t.row_start}-{t.row_end} on {w.worker_id}"
               for w in pool.workers for t in w.tasks.values()]
    starting = [w.worker_id for w in pool.workers if not w.is_ready]
    parts = []
    if running:
        parts.append(f"{len(running)} task(s) to return ({_first(running)})")
    if starting:
        parts.append(f"{len(starting)} worker(s) to be placed and load the model ({_first(starting)})")
    publishing = runs.publishing()
    if publishing:
        parts.append(f"{len(publishing)} shard(s) to be published ({_first([r.shard_id for r in publishing])})")
    if len(queue):
        parts.append(f"{len(queue)} queued task(s) to start")
    return "; ".join(parts) or "nothing"


def _first(names: list[str]) -> str:
    more = f", ... {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else ""
    return ", ".join(names[:MAX_NAMED]) + more
