"""What the driver hands out: tasks (a shard, or a piece of one after bisection) and the queue they wait in.

Blame, in one paragraph. An engine exception (or an engine stepping without progress) is isolated inside
the worker, which rebuilds its engine from the weights it holds (driver/isolation.py): the driver sees a
normal result. What the worker cannot survive reaches the driver: an infrastructure failure (actor killed,
node lost, an engine call that never returns) costs the task nothing but a place in the queue; it then runs
alone on its worker, since a row that kills its process looks the same from outside. An engine call that
hangs is narrowed first: the worker's poll names the rows its engine held, and only those run again as
suspects, alone and one at a time (driver/suspects.py). A death (or a hang, or
an engine the worker gave up on) while running alone is the task's fault: after two deaths of a whole shard
(a node can die under a healthy shard), or one of a piece, the task is split in halves, each run alone,
until the killing row is isolated; a single such row becomes an error row carrying the reason, and every
other row is committed. Each of those deaths costs a worker restart (a model load): after
`cluster.max_isolation_restarts_per_shard` of them for one shard, or `cluster.max_isolation_restarts` in the
job, the remaining suspects (the piece being split) become error rows naming the cap. Losing a worker while
it writes a task's rows as error rows is the infrastructure's doing (those rows never reach the engine), and
a shard that has cost more workers than its isolation restarts plus a few such losses is failed
(driver/shard_run.py: `judge_loss`). Any other error (reading the input, writing the part) is charged an
attempt, with exponential backoff capped at `MAX_RETRY_BACKOFF_S` (or `retry_backoff_s` when larger), and
after `max_shard_attempts` the whole shard is failed.

The queue is O(log n) per operation: requeued and alone-only tasks in two deques, backed-off tasks in a heap
ordered by the time they may run again. Shards not started yet wait as rows of the shard table
(`FreshTasks`): a `Task` (and its shard's `ShardRun`, driver/shard_run.py) exists only from the moment a
shard is handed out, so a job of 10^6 shards holds ~10^6 integers here, not 10^6 objects.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

MAX_RETRY_BACKOFF_S = 60.0  # the longest wait before a retry (2^attempt grows past hours otherwise)


def retry_delay(backoff_s: float, failures: int) -> float:
    """Seconds before the retry after `failures` charged failures: backoff_s * 2^(failures-1), at most
    MAX_RETRY_BACKOFF_S (or backoff_s itself, when a user asked for a longer first wait)."""
    ceiling = max(MAX_RETRY_BACKOFF_S, backoff_s)
    return min(ceiling, backoff_s * 2.0 ** min(failures - 1, 64))


@dataclass(eq=False)
class Task:
    """A row range of one shard, run as one unit on one worker."""

    shard_id: str
    row_start: int
    row_end: int
    alone: bool = False  # run with no other shard in the engine
    alone_crashes: int = 0  # crashes / deaths / stalls while running alone (attempts and failures: its ShardRun's)
    error_text: str | None = None  # set: write its rows as error rows (an isolated poison row)
    is_piece: bool = False  # a half from bisection: its rows are already suspects
    one_at_a_time: bool = False  # suspects of a hang: run alone, one row in the engine at a time (driver/suspects.py)
    run: Any = None  # its shard's ShardRun (driver/shard_run.py); None only in tests of the queue

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start

    def halves(self) -> tuple[Task, Task]:
        """Two alone-only tasks covering this one's rows."""
        mid = (self.row_start + self.row_end) // 2
        return (Task(self.shard_id, self.row_start, mid, alone=True, is_piece=True, run=self.run),
                Task(self.shard_id, mid, self.row_end, alone=True, is_piece=True, run=self.run))


class FreshTasks:
    """Shards never handed out in this run, as shard table rows in plan order; `make` builds a row's Task."""

    def __init__(self, rows: Sequence[int], make: Callable[[int], Task]) -> None:
        self.rows, self.make, self.next = rows, make, 0

    def __len__(self) -> int:
        return len(self.rows) - self.next

    def pop(self, owner: str | None = None) -> Task:
        """The next shard's Task (`owner`, the worker asking, matters to LaneTasks: driver/prefix_dealing.py)."""
        task = self.make(int(self.rows[self.next]))
        self.next += 1
        return task

    def drain(self) -> Sequence[int]:
        """Remove and return the rows not handed out."""
        rows, self.rows, self.next = self.rows[self.next:], self.rows[:0], 0
        return rows


class TaskQueue:
    """Runnable tasks: requeued ones first-in first-out, then fresh shards in plan order; alone-only ones for
    a worker with nothing else."""

    def __init__(self, tasks: Iterable[Task] = (), fresh: FreshTasks | None = None) -> None:
        self.ready: deque[Task] = deque(tasks)
        self.fresh = fresh if fresh is not None else FreshTasks([], lambda row: Task("", 0, 0))
        self.alone: deque[Task] = deque()
        self.delayed: list[tuple[float, int, Task]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self.ready) + len(self.fresh) + len(self.alone) + len(self.delayed)

    def put(self, task: Task, delay_s: float = 0.0) -> None:
        """Queue a task, runnable after delay_s."""
        if delay_s > 0:
            heapq.heappush(self.delayed, (time.monotonic() + delay_s, next(self._seq), task))
        else:
            (self.alone if task.alone else self.ready).append(task)

    def take(self, worker_is_empty: bool, owner: str | None = None) -> Task | None:
        """The next runnable task for a worker (alone-only tasks only go to an empty worker)."""
        self._release_due()
        if worker_is_empty and self.alone:
            return self.alone.popleft()
        if self.ready:
            return self.ready.popleft()
        return self.fresh.pop(owner) if len(self.fresh) else None

    def discard(self, drop: Callable[[Task], bool]) -> None:
        """Remove the queued tasks `drop` says (a failed shard's pieces; O(queue): failures are rare)."""
        self.ready = deque(t for t in self.ready if not drop(t))
        self.alone = deque(t for t in self.alone if not drop(t))
        self.delayed = [entry for entry in self.delayed if not drop(entry[2])]
        heapq.heapify(self.delayed)

    def next_due_in(self) -> float | None:
        """Seconds until the next backed-off task may run (None when none waits)."""
        return max(0.0, self.delayed[0][0] - time.monotonic()) if self.delayed else None

    def drain_fresh(self) -> Sequence[int]:
        """Remove the shards never handed out and return their table rows (no Task built for them)."""
        return self.fresh.drain()

    def drain(self) -> list[Task]:
        """Remove and return every queued task (fresh shards' Tasks built here: see `drain_fresh`)."""
        tasks = list(self.ready) + [self.fresh.pop() for _ in range(len(self.fresh))]
        tasks += list(self.alone) + [t for _, _, t in self.delayed]
        self.ready.clear()
        self.alone.clear()
        self.delayed.clear()
        return tasks

    def _release_due(self) -> None:
        now = time.monotonic()
        while self.delayed and self.delayed[0][0] <= now:
            _, _, task = heapq.heappop(self.delayed)
            (self.alone if task.alone else self.ready).append(task)
