"""Poison rows isolated inside the worker, with no actor restart and no model load.

When the engine raises inside a step (or steps on without producing a token for progress_timeout_s), every
request then in the engine is a suspect; rows finished earlier keep their results and rows not yet added are
innocent. The worker rebuilds its engine over the weights it already holds and runs the suspects again in
groups, alone in the engine: a group that finishes is committed as usual; a group that fails again is split
in halves (one more rebuild), until a single failing row becomes an error row carrying the exception text.
Each shard may cause at most `cluster.max_engine_rebuilds_per_shard` rebuilds; past it, its remaining
suspects become error rows naming the cap. An engine that keeps failing with no row finishing in between
(more failures in a row than bisecting the whole engine could take: a broken device, not a poison row)
is given up: the worker reports itself broken and the driver replaces it (driver/tasks.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

Suspect = tuple[Any, Any]  # (the worker's shard state, its RowRequest)


@dataclass
class IsolationCost:
    """What isolating crashing rows cost: engine rebuilds (in-process), model loads (worker restarts), rows
    that became error rows, and wall seconds spent isolating."""

    engine_rebuilds: int = 0
    model_loads: int = 0
    rows_isolated: int = 0
    seconds: float = 0.0

    def add(self, other: IsolationCost | dict[str, Any] | None) -> None:
        """Add another cost (an IsolationCost or its dict) to this one."""
        values = asdict(other) if isinstance(other, IsolationCost) else dict(other or {})
        for key in ("engine_rebuilds", "model_loads", "rows_isolated", "seconds"):
            setattr(self, key, getattr(self, key) + (values.get(key) or 0))

    @property
    def is_empty(self) -> bool:
        return not (self.engine_rebuilds or self.model_loads or self.rows_isolated)

    def to_dict(self) -> dict[str, Any]:
        """The manifest's form (seconds rounded)."""
        return {**asdict(self), "seconds": round(self.seconds, 3)}


class Isolator:
    """Suspect groups waiting to run alone in the engine (a stack: the next group is the last one)."""

    def __init__(self, max_rebuilds_per_shard: int, max_in_engine: int) -> None:
        self.max_rebuilds_per_shard = max_rebuilds_per_shard
        # Bisecting max_in_engine suspects fails at most ~log2 times per poison row on one path.
        self.max_failures_in_a_row = 2 * math.ceil(math.log2(max(2, max_in_engine))) + 2
        self.groups: list[list[Suspect]] = []
        self.current: list[Suspect] | None = None
        self.failures_in_a_row = 0
        self._episode_start: float | None = None
        self._episode_states: dict[int, Any] = {}

    @property
    def is_active(self) -> bool:
        return self.current is not None or bool(self.groups)

    @property
    def is_broken(self) -> bool:
        """More failures in a row, with no row finishing in between, than poison rows can explain."""
        return self.failures_in_a_row > self.max_failures_in_a_row

    def on_failure(self, failed: list[Suspect], reason: str) -> list[tuple[Suspect, str]]:
        """The engine failed with `failed` in it (to be rebuilt once): queue halves to run alone; return the
        suspects that become error rows now, each with its error text."""
        self.current = None
        self.failures_in_a_row += 1
        if self._episode_start is None:
            self._episode_start = time.monotonic()
        states = {id(state): state for state, _ in failed}
        self._episode_states.update(states)
        for state in states.values():
            state.cost.engine_rebuilds += 1
        capped = {key for key, s in states.items() if s.cost.engine_rebuilds > self.max_rebuilds_per_shard}
        blamed = [(s, self._capped_text(len(failed), reason)) for s in failed if id(s[0]) in capped]
        rest = [s for s in failed if id(s[0]) not in capped]
        if len(rest) == 1:
            blamed.append((rest[0], f"engine crashed on this row: {reason}"))
        elif rest:
            mid = len(rest) // 2
            self.groups += [rest[mid:], rest[:mid]]  # the first half runs first
        for (state, _), _text in blamed:
            state.cost.rows_isolated += 1
        return blamed

    def _capped_text(self, num_rows: int, reason: str) -> str:
        return (f"engine crashed on one of {num_rows} rows run together, not isolated further "
                f"(cluster.max_engine_rebuilds_per_shard={self.max_rebuilds_per_shard} reached): {reason}")

    def next_group(self) -> list[Suspect] | None:
        """The next group to run alone (the engine is empty); None when isolation is over."""
        self.current = self.groups.pop() if self.groups else None
        if self.current is None:
            self._end_episode()
        return self.current

    def on_progress(self) -> None:
        """A row finished: the engine works (failures are counted in a row from here)."""
        self.failures_in_a_row = 0

    def _end_episode(self) -> None:
        if self._episode_start is not None:
            seconds = time.monotonic() - self._episode_start
            for state in self._episode_states.values():
                state.cost.seconds += seconds
        self._episode_start, self._episode_states = None, {}
