"""Dealing shards to workers so that a prefix lives on as few workers as possible (prefix-grouped plans).

A prefix-grouped plan lists the shards of one prefix next to each other (driver/prefix_plan.py). Handing
them out in plan order to whichever worker is free would spread every prefix over every worker, each
computing it again. Instead the shards not yet started are cut into one contiguous run ("lane") per
worker; a worker takes its lane's shards in order, and when its lane is empty it steals the back half of
the longest lane left (its front stays with the owner, which is working there). Work stays balanced (no
worker idles while shards wait) and a prefix is split between workers only at a lane boundary or a steal.
A worker seen for the first time (a replacement) takes a lane nobody has taken yet, else steals.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from jobrunner.driver.tasks import FreshTasks, Task


class LaneTasks(FreshTasks):
    """Fresh shards dealt in contiguous runs of plan order, one per worker, with stealing."""

    def __init__(self, rows: Sequence[int], make: Callable[[int], Task], num_lanes: int) -> None:
        super().__init__(rows, make)
        n = len(rows)
        k = max(1, min(num_lanes, n))
        bounds = [n * i // k for i in range(k + 1)]
        self.lanes: list[list[int]] = [[b, e] for b, e in zip(bounds, bounds[1:], strict=False)]
        self.lane_of: dict[str, int] = {}  # worker id -> its lane
        self.owned: set[int] = set()
        self.left = n

    def __len__(self) -> int:
        return self.left

    def pop(self, owner: str | None = None) -> Task:
        """The next shard for this worker: its lane's next, else the back half of the longest lane."""
        lane = self._lane_for(owner)
        position = self.lanes[lane][0]
        self.lanes[lane][0] += 1
        self.left -= 1
        return self.make(int(self.rows[position]))

    def drain(self) -> Sequence[int]:
        """Remove and return the rows not handed out."""
        parts = [np.asarray(self.rows[b:e]) for b, e in self.lanes if e > b]
        self.lanes, self.left = [], 0
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def _lane_for(self, owner: str | None) -> int:
        lane = self.lane_of.get(owner) if owner is not None else None
        if lane is not None and self._size(lane):
            return lane
        if lane is None:
            free = [i for i in range(len(self.lanes)) if i not in self.owned and self._size(i)]
            if free:
                lane = max(free, key=self._size)
                return self._own(owner, lane)
        return self._own(owner, self._steal())

    def _own(self, owner: str | None, lane: int) -> int:
        if owner is not None:
            old = self.lane_of.get(owner)
            if old is not None:
                self.owned.discard(old)
            self.lane_of[owner] = lane
        self.owned.add(lane)
        return lane

    def _steal(self) -> int:
        """A new lane: the back half of the longest lane (all of it when it has one shard)."""
        victim = max(range(len(self.lanes)), key=self._size)
        start, end = self.lanes[victim]
        if end - start <= 1:
            return victim
        middle = (start + end + 1) // 2
        self.lanes[victim][1] = middle
        self.lanes.append([middle, end])
        return len(self.lanes) - 1

    def _size(self, lane: int) -> int:
        start, end = self.lanes[lane]
        return end - start


def fresh_tasks(rows: Sequence[int], make: Callable[[int], Task], num_workers: int,
                shares_prefixes: bool) -> FreshTasks:
    """Lanes when the plan's rows share prefixes (and there is more than one worker), else plan order."""
    if shares_prefixes and num_workers > 1:
        return LaneTasks(rows, make, num_workers)
    return FreshTasks(rows, make)
