"""One record per handed-out shard (`ShardRun`), the states a shard goes through, and the blame rule for a
lost worker.

A shard is `pending` in the shard table (driver/shards.py) until the job loop hands it out; from then until
it is committed or failed everything this run knows about it lives in its `ShardRun`, keyed by its table
row: the attempts, the pieces still to finish (one, or more after bisection), the results of the pieces
that did, the refs of its pieces running on workers, its prompts' KV chains and its publish future.
`ShardRuns` is the only place that changes a run's state:

    pending --hand_out--> queued --started--> running --returned/lost--> queued (pieces left)
    running --all pieces returned--> publishing --published--> committed  (the table row; the run is dropped)
    any --failed--> failed  (the table row; pieces still out are dropped when they come back)

Which worker runs which piece is the pool's (driver/pool.py); the order pieces wait in is the queue's
(driver/tasks.py); the run holds the rest.
"""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jobrunner.driver.isolation import IsolationCost
from jobrunner.driver.shards import ShardTable
from jobrunner.driver.tasks import Task
from jobrunner.io.shard_file import COMMITTED, FAILED

INFRA_LOSSES_PER_SHARD = 3  # workers a shard may cost beyond its isolation restarts (nodes lost under it)
MAX_LISTED_RUNS = 10  # shards named one by one in a "cannot go on" error


class ShardState(enum.Enum):
    """Where a shard is in this run (pending / committed / failed are also the table's persisted states)."""

    PENDING = "pending"  # not handed out yet (a row of the table, no ShardRun)
    QUEUED = "queued"  # handed out; every unfinished piece waits in the queue
    RUNNING = "running"  # at least one piece runs on a worker
    PUBLISHING = "publishing"  # every piece finished; its parts are being moved to their final keys
    COMMITTED = "committed"
    FAILED = "failed"


@dataclass(eq=False)
class ShardRun:
    """A handed-out shard: everything this run knows about it until it is committed or failed."""

    row: int  # its row in the shard table
    shard_id: str
    state: ShardState = ShardState.QUEUED
    attempts: int = 0  # pieces started (the one count of them: a Task keeps none)
    failures: int = 0  # charged failures (the shard's own fault), over all its pieces
    infra_failures: int = 0
    workers_lost: int = 0  # workers lost while running one of its pieces
    num_pieces: int = 1  # pieces that must finish (more once bisected)
    results: list[Any] = field(default_factory=list)  # ShardResult of each finished piece
    refs: set[Any] = field(default_factory=set)  # refs of its pieces running now
    isolation: IsolationCost = field(default_factory=IsolationCost)
    isolating_since: float | None = None  # first worker death blamed on it (monotonic)
    chains: tuple[int, Any] = (0, None)  # its prompts' KV block chains, from commit until published
    publish: Future | None = None
    record: dict[str, Any] | None = None  # its commit record while publishing
    error: str | None = None  # why it failed

    @property
    def is_done(self) -> bool:
        return len(self.results) == self.num_pieces

    def describe(self) -> str:
        """One line for a "cannot go on" error."""
        return (f"{self.shard_id}: {self.state.value} ({len(self.results)}/{self.num_pieces} pieces done, "
                f"{len(self.refs)} running, {self.attempts} attempts, {self.workers_lost} workers lost)")


class ShardRuns:
    """The runs of the shards handed out and not yet committed or failed, by table row."""

    def __init__(self, table: ShardTable) -> None:
        self.table = table
        self.by_row: dict[int, ShardRun] = {}

    def __len__(self) -> int:
        return len(self.by_row)

    def open(self) -> list[ShardRun]:
        return list(self.by_row.values())

    def publishing(self) -> list[ShardRun]:
        return [r for r in self.by_row.values() if r.state is ShardState.PUBLISHING]

    def state_of(self, row: int) -> ShardState:
        run = self.by_row.get(row)
        if run is not None:
            return run.state
        status = self.table.status_of(row)
        return ShardState.COMMITTED if status == COMMITTED else ShardState.FAILED if status == FAILED \
            else ShardState.PENDING

    # ---- transitions ---------------------------------------------------------------------------------
    def hand_out(self, row: int) -> Task:
        """A pending shard leaves the table's queue: its run, and the task of its whole row range."""
        run = ShardRun(row, self.table.id_of(row))
        self.by_row[row] = run
        return Task(run.shard_id, *self.table.rows_of(row), run=run)

    def started(self, task: Task, ref: Any) -> None:
        run = task.run
        run.attempts += 1
        run.refs.add(ref)
        if run.state is ShardState.QUEUED:
            run.state = ShardState.RUNNING

    def returned(self, task: Task, ref: Any) -> None:
        """A piece came back (finished, failed or lost): running while others run, else queued."""
        run = task.run
        run.refs.discard(ref)
        if run.state is ShardState.RUNNING and not run.refs:
            run.state = ShardState.QUEUED

    def publishing_started(self, run: ShardRun, record: dict[str, Any], chains: tuple, future: Future) -> None:
        run.state, run.record, run.chains, run.publish = ShardState.PUBLISHING, record, chains, future

    def committed(self, run: ShardRun) -> None:
        run.state = ShardState.COMMITTED
        self.by_row.pop(run.row, None)

    def failed(self, run: ShardRun, error: str) -> None:
        run.state, run.error = ShardState.FAILED, error
        self.by_row.pop(run.row, None)

    # ---- isolation -----------------------------------------------------------------------------------
    def count_restart(self, run: ShardRun, job_cost: IsolationCost | None) -> None:
        """A worker died (or hung) running the shard's rows alone: one more model load spent isolating them
        (`job_cost` None: the job's count has this restart already, charged to another shard)."""
        run.isolation.model_loads += 1
        if job_cost is not None:
            job_cost.model_loads += 1
        if run.isolating_since is None:
            run.isolating_since = time.monotonic()

    # ---- reporting -----------------------------------------------------------------------------------
    def summary(self, fresh_left: int) -> str:
        """Counts per state and the open shards one by one (the error of a job that cannot go on)."""
        status = self.table.columns.status
        counts = {state: 0 for state in ShardState}
        for run in self.by_row.values():
            counts[run.state] += 1
        counts[ShardState.COMMITTED] = int(np.count_nonzero(status == COMMITTED))
        counts[ShardState.FAILED] = int(np.count_nonzero(status == FAILED))
        counts[ShardState.PENDING] = fresh_left
        text = ", ".join(f"{n} {state.value}" for state, n in counts.items())
        runs = sorted(self.by_row.values(), key=lambda r: r.row)
        listed = "; ".join(r.describe() for r in runs[:MAX_LISTED_RUNS])
        more = f"; ... and {len(runs) - MAX_LISTED_RUNS} more" if len(runs) > MAX_LISTED_RUNS else ""
        return f"shards: {text}" + (f" [{listed}{more}]" if runs else "")


def worker_cap(max_isolation_restarts_per_shard: int) -> int:
    """Workers one shard may cost before it is failed: its isolation restarts and a few infrastructure losses."""
    return max_isolation_restarts_per_shard + INFRA_LOSSES_PER_SHARD


@dataclass(frozen=True)
class LossVerdict:
    """What a lost worker means for one of its tasks."""

    action: str  # "fail" (the shard), "requeue" (charge nothing), "alone" (requeue, run alone), "isolate"
    blamed: bool  # the loss counts against the task's rows (a death while running alone)


def judge_loss(task: Task, ran_alone: bool, crash: str | None, stalled: bool, cap: int,
               bisect_after: int) -> LossVerdict:
    """The blame rule (driver/tasks.py) for one task of a lost worker; the run's `workers_lost` counts
    this loss already. Rows being written as error rows never touch the engine: losing their worker is the
    infrastructure's doing, never theirs. A shard that has cost more than `cap` workers is failed."""
    if task.run.workers_lost > cap:
        return LossVerdict("fail", blamed=False)
    if task.error_text is not None:
        return LossVerdict("requeue", blamed=False)
    if not ran_alone:
        return LossVerdict("alone", blamed=False)
    # An engine crash or a stall alone is surely the task's rows; a death may be the node's (unless the rows
    # are already suspects: a piece).
    limit = 1 if crash is not None or stalled or task.is_piece else bisect_after
    return LossVerdict("alone" if task.alone_crashes + 1 < limit else "isolate", blamed=True)
