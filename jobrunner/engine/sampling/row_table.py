"""The row bookkeeping shared by the sampler's persistent per-sequence device tables (penalties, grammar masks).

Each sequence owns one row of the subclass's tensors, keyed by ``Request.key``. Rows come from a free list and
go back to it on :meth:`SequenceRows.release`; when none is free, rows of finished requests are reclaimed
before the table grows (:meth:`SequenceRows._grow`, which enlarges the subclass's tensors and frees the new rows).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any


class SequenceRows:
    """``rows``: key -> an entry with a ``row`` and the ``request`` it belongs to; ``free``: unused rows."""

    def __init__(self) -> None:
        self.rows: dict[Hashable, Any] = {}
        self.free: list[int] = []

    def release(self, key: Hashable) -> None:
        """Forget a finished sequence (its row is reset when it is next handed out)."""
        entry = self.rows.pop(key, None)
        if entry is not None:
            self.free.append(entry.row)

    def _take_row(self) -> int:
        if not self.free:
            for key in [k for k, e in self.rows.items() if getattr(e.request, "is_finished", False)]:
                self.release(key)
        if not self.free:
            self._grow()
        return self.free.pop()

    def _grow(self) -> None:
        raise NotImplementedError
