"""A hung worker's suspects: the rows it had in its engine, so that a hanging row costs one or two worker
restarts, not one per bisection level.

An engine call that never returns (a hung kernel, a row that loops forever inside a step) cannot be survived
in-process: the driver replaces the worker. Its poll thread still answers while the call hangs, and reports
which rows were in the engine then (`in_flight`: positions in each shard, by the worker's task), and only
those can have hung it: rows finished before, and rows the worker had not yet added, are innocent of this
hang. So the driver cuts each task of the lost worker around its suspects (`cut`): the rows before the first
suspect and after the last one run again as usual; the rows from the first suspect to the last run alone on a
worker **one at a time**, in position order. When that run hangs, the one row in the engine is the culprit:
it becomes an error row, the rows before it (finished) run again as usual, and the rows after it (never run
since) stay suspects, one at a time. A hanging row thus costs the restart of the hang that named it a suspect
and the restart of the hang it causes alone, whatever the shard's size; a worker whose engine held one row
when it hung names that row at once. Deaths (a process killed, a segfault) and silent workers are not
narrowed this way: the rows a dead worker last reported may be stale, and those tasks are bisected
(driver/tasks.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from jobrunner.driver.tasks import Task

SUSPECTS_AFTER_S = 1.0  # an engine call running this long: the poll reports the rows in the engine


def in_flight(entries: Iterable[tuple[Any, Any]]) -> dict[tuple[str, int], list[int]]:
    """(shard id, row start) -> sorted positions of the rows in the engine, from the worker's (shard state,
    request) pairs; a state's `positions` maps a row to its position (None: the same number)."""
    out: dict[tuple[str, int], list[int]] = {}
    for state, req in entries:
        positions = getattr(state, "positions", None)
        position = req.row_index if positions is None else positions.get(req.row_index, req.row_index)
        out.setdefault((state.shard.shard_id, state.shard.row_start), []).append(int(position))
    return {key: sorted(set(values)) for key, values in out.items()}


@dataclass(frozen=True)
class Cut:
    """A task cut around its suspects: `before` and `after` run as usual (None: empty), `suspects` runs alone,
    one row at a time (`culprit`: it is one row that hung alone in the engine: it becomes an error row)."""

    before: Task | None
    suspects: Task
    after: Task | None
    culprit: bool

    @property
    def pieces(self) -> list[Task]:
        return [t for t in (self.before, self.suspects, self.after) if t is not None]


def cut(task: Task, positions: list[int], alone_in_engine: bool) -> Cut | None:
    """The task cut around the suspects among `positions` (None: none of its rows was in the engine: it is
    innocent of the hang). `alone_in_engine`: the worker's engine held a single row when it hung. A task that
    ran one row at a time keeps the rows after its culprit one at a time (they were never run)."""
    inside = [p for p in positions if task.row_start <= p < task.row_end]
    if not inside:
        return None
    lo, hi = inside[0], inside[-1] + 1
    culprit = alone_in_engine and hi - lo == 1
    before = _piece(task, task.row_start, lo, sequential=False) if task.row_start < lo else None
    after = _piece(task, hi, task.row_end, sequential=task.one_at_a_time) if hi < task.row_end else None
    return Cut(before, _piece(task, lo, hi, sequential=not culprit), after, culprit)


def _piece(task: Task, start: int, end: int, sequential: bool) -> Task:
    """Rows [start, end) of the task as a new piece: suspects alone and one at a time, or a usual range."""
    return replace(task, row_start=start, row_end=end, alone=sequential,
                   alone_crashes=0, error_text=None, is_piece=sequential, one_at_a_time=sequential)
