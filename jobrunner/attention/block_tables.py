"""Block tables kept on the device and updated incrementally (for the triton backend and its CUDA graphs).

Each running sequence (a request's sample: keyed by ``Request.key``, never by the request id alone, or the
``n`` samples of one request would share, and overwrite, one row) owns one row of a persistent
``[capacity, max_blocks]`` table on the device. A step uploads only the block ids that are new since the row
was last synced (a request's block list only grows while it runs, one block every ``block_size`` tokens),
as (row, column, block id) triples that travel in the step's single host->device copy and are scattered
into the table there. A request whose block list was replaced (freed and reallocated after preemption: the
KV manager assigns a new list) or whose last synced block changed is synced again from scratch. Rows of
requests not seen for a while are reused, least recently used first, when the table is full; a request
that comes back is simply synced again. A finished sequence's row is handed back at once
(:meth:`DeviceBlockTables.release`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from jobrunner.attention.upload import StepUpload


@dataclass
class _Row:
    row: int
    ids: list[int]        # the request's own block list (identity tells a replaced list)
    synced: int = 0       # leading entries already on the device
    last: int = -1        # the last synced block id (guards against an in-place change)
    step: int = 0         # last step that used the row


class DeviceBlockTables:
    """The device table plus the host's record of what each row holds."""

    def __init__(self, capacity: int, max_blocks: int, device: torch.device) -> None:
        self.capacity = capacity
        self.max_blocks = max_blocks
        self.table = torch.zeros(capacity, max_blocks, dtype=torch.long, device=device)
        self.rows: dict[Hashable, _Row] = {}
        self.free = list(range(capacity - 1, -1, -1))
        self.step = 0

    def updates(self, keys: list[Hashable], block_tables: list[list[int]]
                ) -> tuple[list[int], tuple[list[int], list[int], list[int]]]:
        """Each row's table row, and the (rows, columns, block ids) of the entries new since the last sync."""
        self.step += 1
        if len(keys) > self.capacity:
            raise ValueError(f"{len(keys)} rows in a step but the block table holds {self.capacity}")
        out: list[int] = []
        rows: list[int] = []
        cols: list[int] = []
        vals: list[int] = []
        if len(set(keys)) != len(keys):
            raise ValueError("two rows of a step share a block-table key: each sequence needs its own row")
        for key, ids in zip(keys, block_tables):
            entry = self.rows.get(key)
            if entry is None:
                entry = self.rows[key] = _Row(self._take_row(), ids)
            elif entry.ids is not ids or len(ids) < entry.synced or (entry.synced and ids[entry.synced - 1]
                                                                      != entry.last):
                entry.ids, entry.synced = ids, 0  # a new or changed list: sync it whole
            n = len(ids)
            if n > self.max_blocks:
                raise ValueError(f"request {key!r} holds {n} blocks; the block table has {self.max_blocks} columns")
            if n > entry.synced:
                rows.extend([entry.row] * (n - entry.synced))
                cols.extend(range(entry.synced, n))
                vals.extend(ids[entry.synced:n])
                entry.synced, entry.last = n, ids[n - 1]
            entry.step = self.step
            out.append(entry.row)
        return out, (rows, cols, vals)

    @staticmethod
    def add_to(upload: StepUpload, triples: tuple[list[int], list[int], list[int]]) -> None:
        """Queue the update triples (read back by :meth:`apply`)."""
        for name, values in zip(("bt_rows", "bt_cols", "bt_vals"), triples):
            upload.add(name, values)

    def apply(self, tensors: dict[str, torch.Tensor]) -> None:
        """Scatter the uploaded triples into the device table (one kernel; nothing when no block is new)."""
        if tensors["bt_rows"].numel():
            self.table.index_put_((tensors["bt_rows"], tensors["bt_cols"]), tensors["bt_vals"])

    def release(self, key: Hashable) -> None:
        """Hand a finished sequence's row back (its stale entries are overwritten by the next owner's sync)."""
        entry = self.rows.pop(key, None)
        if entry is not None:
            self.free.append(entry.row)

    def _take_row(self) -> int:
        if self.free:
            return self.free.pop()
        # full: reuse the least recently used row among those this step has not touched yet
        key = min((k for k, r in self.rows.items() if r.step != self.step), key=lambda k: self.rows[k].step)
        return self.rows.pop(key).row
