"""Named stages of a worker's start-up (resolve the source, build the model, load weights, ...), each in
seconds, so a user can see where the start-up of a job goes (the manifest's worker records, `report`)."""

from __future__ import annotations

import time


class Stopwatch:
    """Seconds per named stage: :meth:`mark` closes the stage that began at the previous mark (or at start)."""

    def __init__(self) -> None:
        self.stages: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> float:
        """End stage ``name`` now (a stage marked twice adds up); its seconds."""
        now = time.perf_counter()
        seconds = now - self._last
        self._last = now
        self.stages[name] = round(self.stages.get(name, 0.0) + seconds, 4)
        return seconds

    def skip(self) -> None:
        """Start the next stage now without counting the time since the last mark."""
        self._last = time.perf_counter()
