"""What the driver hands out: tasks (a shard, or a piece of one after bisection) and the queue they wait in.

Blame, in one paragraph. An infrastructure failure (actor killed, node lost, worker stalled past its
progress deadline) costs the task nothing but a place in the queue; it then runs alone on its worker, since
a row that kills its process looks the same from outside. An engine crash while other shards shared the
engine only makes the task run alone. A crash (or a death, or a stall) while running alone is the task's
fault: a piece of many rows is split in halves, each run alone, until the crashing row is isolated; a
single crashing row becomes an error row carrying the exception text, and every other row is committed.
Any other error (reading the input, writing the part) is charged an attempt, with exponential backoff, and
after `max_shard_attempts` the whole shard is failed.

The queue is O(log n) per operation: requeued and alone-only tasks in two deques, backed-off tasks in a heap
ordered by the time they may run again. Shards not started yet wait as rows of the shard table
(`FreshTasks`): a `Task` (and its `ShardWork`) exists only from the moment a shard is handed out, so a job of
10^6 shards holds ~10^6 integers here, not 10^6 objects.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Task:
    """A row range of one shard, run as one unit on one worker."""

    shard_id: str
    row_start: int
    row_end: int
    alone: bool = False  # run with no other shard in the engine
    attempts: int = 0  # times started
    failures: int = 0  # charged failures (the task's own fault)
    alone_crashes: int = 0  # crashes / deaths / stalls while running alone
    infra_failures: int = 0
    error_text: str | None = None  # set: write its rows as error rows (an isolated poison row)

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start

    def halves(self) -> tuple[Task, Task]:
        """Two alone-only tasks covering this one's rows."""
        mid = (self.row_start + self.row_end) // 2
        return (Task(self.shard_id, self.row_start, mid, alone=True),
                Task(self.shard_id, mid, self.row_end, alone=True))


@dataclass
class ShardWork:
    """A shard in flight: pieces not yet done and the results of those that are."""

    num_pieces: int = 1
    results: list[Any] = field(default_factory=list)
    attempts: int = 0
    failures: int = 0
    infra_failures: int = 0

    @property
    def is_done(self) -> bool:
        return len(self.results) == self.num_pieces


class FreshTasks:
    """Shards never handed out in this run, as shard table rows in plan order; `make` builds a row's Task."""

    def __init__(self, rows: Sequence[int], make: Callable[[int], Task]) -> None:
        self.rows, self.make, self.next = rows, make, 0

    def __len__(self) -> int:
        return len(self.rows) - self.next

    def pop(self) -> Task:
        """The next shard's Task."""
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

    def take(self, worker_is_empty: bool) -> Task | None:
        """The next runnable task for a worker (alone-only tasks only go to an empty worker)."""
        self._release_due()
        if worker_is_empty and self.alone:
            return self.alone.popleft()
        if self.ready:
            return self.ready.popleft()
        return self.fresh.pop() if len(self.fresh) else None

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
