"""What the tasks of a lost worker become: requeued, narrowed around a hang's suspects, bisected, error rows,
or failed. The blame rule is driver/tasks.py's (and shard_run.judge_loss), the suspects driver/suspects.py's;
the job loop (driver/job.py) hands every lost worker's tasks here and owns nothing of this."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jobrunner.driver.isolation import IsolationCost
from jobrunner.driver.shard_run import INFRA_LOSSES_PER_SHARD, ShardRun, ShardRuns, ShardState, judge_loss, worker_cap
from jobrunner.driver.suspects import cut
from jobrunner.driver.tasks import Task, TaskQueue
from jobrunner.redaction import redact_text, redacting_logger
from jobrunner.spec import JobSpec

log = redacting_logger(__name__)
ALONE_DEATHS_TO_BISECT = 2  # deaths of a whole shard running alone before it is split (pieces, crashes, stalls: 1)


class LossRules:
    """Requeues the tasks of lost workers into `queue`, charging isolation restarts to their shards and to
    `job_cost`; `fail(run, error)` fails a shard for good."""

    def __init__(self, spec: JobSpec, runs: ShardRuns, queue: TaskQueue, job_cost: IsolationCost,
                 fail: Callable[[ShardRun, str], None]) -> None:
        self.spec, self.runs, self.queue, self.job_cost, self.fail = spec, runs, queue, job_cost, fail

    def on_loss(self, worker_id: str, held: list[tuple[Any, Task]], error: str, stalled: bool, crash: str | None,
                suspects: dict[tuple[str, int], list[int]]) -> None:
        """The (ref, task) pairs a lost worker held: each requeued, blamed or not. `suspects`: the rows its engine
        held when a call hung (empty otherwise)."""
        alone_in_engine = sum(len(rows) for rows in suspects.values()) == 1
        counted: set[int] = set()  # runs charged this restart (the job's count takes it once)
        for run in {id(t.run): t.run for _, t in held}.values():
            run.workers_lost += 1
        cap = worker_cap(self.spec.cluster.max_isolation_restarts_per_shard)
        reason = f"worker {worker_id}: {error}"
        for ref, task in held:
            self.runs.returned(task, ref)
            run = task.run
            if run.state is ShardState.FAILED:
                continue
            if crash is None or task.error_text is not None:
                run.infra_failures += 1
            verdict = judge_loss(task, len(held) == 1, crash, stalled, cap, ALONE_DEATHS_TO_BISECT)
            if verdict.action == "fail":
                self.fail(run, f"lost {run.workers_lost} workers running its rows (more than {cap}: "
                               f"cluster.max_isolation_restarts_per_shard="
                               f"{self.spec.cluster.max_isolation_restarts_per_shard} + {INFRA_LOSSES_PER_SHARD} "
                               f"infrastructure losses); last: {reason}")
            elif verdict.action == "requeue":  # error rows: they never touched the engine
                self.queue.put(task)
            elif suspects:
                self._narrow(task, suspects.get((task.shard_id, task.row_start), []), alone_in_engine, reason,
                             counted)
            elif not verdict.blamed:
                task.alone = True
                self.queue.put(task)
            else:
                task.alone_crashes += 1
                self.runs.count_restart(run, self.job_cost)
                if verdict.action == "alone":
                    task.alone = True
                    self.queue.put(task)
                else:
                    self.isolate(task, crash or reason)

    def _narrow(self, task: Task, positions: list[int], alone_in_engine: bool, reason: str,
                counted: set[int]) -> None:
        """A task of a worker whose engine call hung, cut around the rows it had in the engine
        (driver/suspects.py): innocent rows run as usual, the suspects alone and one at a time."""
        found = cut(task, positions, alone_in_engine)
        if found is None:  # none of its rows was in the engine: innocent of the hang
            self.queue.put(task)
            return
        if id(task.run) not in counted:
            self.runs.count_restart(task.run, None if counted else self.job_cost)
            counted.add(id(task.run))
        task.run.num_pieces += len(found.pieces) - 1
        for piece in (found.before, found.after):
            if piece is not None:
                self.queue.put(piece)
        self.isolate(found.suspects, reason, culprit=found.culprit)

    def isolate(self, task: Task, reason: str, culprit: bool | None = None) -> None:
        """A task that fails alone: split it, or (one row, or past the restart caps) make its rows error rows.
        `culprit` (a hang's suspects, driver/suspects.py): True makes the row an error row, False queues the
        suspects to run one at a time; None (a death) bisects."""
        c, run = self.spec.cluster, task.run
        capped = (f"cluster.max_isolation_restarts_per_shard={c.max_isolation_restarts_per_shard}"
                  if run.isolation.model_loads >= c.max_isolation_restarts_per_shard else
                  f"cluster.max_isolation_restarts={c.max_isolation_restarts}"
                  if self.job_cost.model_loads >= c.max_isolation_restarts else None)
        is_culprit = task.num_rows <= 1 if culprit is None else culprit
        if is_culprit or capped:
            log.warning("shard %s rows %d-%d crash their worker: %s", task.shard_id, task.row_start, task.row_end,
                        redact_text(reason))
            task.error_text = (f"engine crashed on this row: {reason}" if is_culprit else
                               f"engine crashed on one of rows {task.row_start}-{task.row_end}, not isolated "
                               f"further ({capped} reached): {reason}")
            task.alone = task.one_at_a_time = False
            self.queue.put(task)
            return
        if culprit is not None:  # a hang's suspects: alone, one row in the engine at a time
            self.queue.put(task)
            return
        run.num_pieces += 1
        for half in task.halves():
            self.queue.put(half)
