"""Warnings that repeat, folded into a few lines: a full disk or a storage outage makes every write retry, and
a line per retry buries what matters (a nightly log once held 79 "retrying, 0 s left" lines).

The first warning of a kind is logged as it happens; the next ones within `fold_s` are only counted, and
one line then says how many there were and quotes the last: when the next warning of that kind comes after
the window (which then starts again), or at `flush()` (called at exit, and by whoever knows the episode ended).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

FOLD_S = 60.0


@dataclass
class _Episode:
    since: float  # when its first warning was logged (the clock's time)
    count: int = 0  # warnings counted since, not logged
    last: str = ""


class FoldedWarnings:
    """`warn(kind, text)` logs the first of a kind, counts the repeats within `fold_s`, summarises them once."""

    def __init__(self, logger: logging.Logger, what: str, fold_s: float = FOLD_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """what: how the summary names the warnings ('storage retries')."""
        self.logger, self.what, self.fold_s, self.clock = logger, what, fold_s, clock
        self._episodes: dict[str, _Episode] = {}
        self._lock = threading.Lock()

    def warn(self, kind: str, text: str) -> None:
        """Log `text`, or count it when a warning of `kind` was logged less than `fold_s` ago."""
        with self._lock:
            now, episode = self.clock(), self._episodes.get(kind)
            if episode is not None and now - episode.since < self.fold_s:
                episode.count, episode.last = episode.count + 1, text
                return
            summary = self._close(kind)
            self._episodes[kind] = _Episode(since=now)
        if summary:
            self.logger.warning("%s", summary)
        self.logger.warning("%s", text)

    def flush(self) -> None:
        """Log the summary of every kind with counted warnings, and forget them."""
        with self._lock:
            summaries = [self._close(kind) for kind in list(self._episodes)]
        for summary in filter(None, summaries):
            self.logger.warning("%s", summary)

    def _close(self, kind: str) -> str | None:
        episode = self._episodes.pop(kind, None)
        if episode is None or not episode.count:
            return None
        return f"{episode.count} more {self.what} ({kind}) not shown; the last: {episode.last}"
