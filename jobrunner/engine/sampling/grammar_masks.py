"""Grammar token masks kept on the device per sequence, refilled only where the grammar moved.

A constrained sample's next-token mask is a row of ``ceil(vocab / 32)`` int32 words (bit j of the row: token
j is allowed), which the grammar matcher (xgrammar) fills on the host: that fill is inherent, it walks the
grammar state. Everything around it is kept off the per-step path:

* every constrained sequence owns a row of one persistent device tensor ``masks`` ``[capacity, words]``;
* a row is refilled only when its grammar accepted a token since the row was filled
  (:attr:`Grammar.num_accepted <jobrunner.engine.sampling.structured.Grammar.num_accepted>`); a sequence
  sampled again without advancing (recomputed after preemption, say) keeps its row;
* the refilled rows, their row numbers and the step's row -> mask-row map travel in one host->device copy
  from one reusable int32 host buffer (pinned on CUDA, so the copy is asynchronous; an event guards reuse),
  are scattered into ``masks`` with one ``index_copy_``, and the step's logits are masked by one
  ``index_select`` plus xgrammar's ``apply_token_bitmask_inplace`` (its CPU or CUDA kernel; only the
  constrained logits rows are touched, in place).

The masked logits are those of filling a fresh bitmask for every row every step (``-inf`` where a bit is 0).
Rows are keyed by ``Request.key`` and remember the grammar object (another grammar under a reused key is
filled afresh); :meth:`DeviceGrammarMasks.release` hands a finished sequence's row back, and rows of finished
requests are reclaimed whenever the table is full, before it grows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from jobrunner.engine.sampling.row_table import SequenceRows

MIN_CAPACITY = 8


@dataclass
class _Row:
    row: int
    request: object        # the request the row belongs to (for reclaiming rows of finished requests)
    grammar: object        # the grammar whose mask the row holds (identity tells a reused key)
    version: int = -1      # grammar.num_accepted when the row was filled; -1: never filled


class DeviceGrammarMasks(SequenceRows):
    """Persistent per-sequence token masks on ``device`` (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.words = 0
        self.masks = torch.zeros(0, 0, dtype=torch.int32, device=device)
        self.staging = _HostInts(device)
        # mask rows filled by the grammar matchers (tests; scripts/grammar_overhead.py at commit a75bf8c)
        self.num_fills = 0

    @property
    def capacity(self) -> int:
        return self.masks.shape[0]

    def apply(self, logits: torch.Tensor, rows: list[int], requests: Sequence) -> None:
        """Mask ``logits[rows[i]]`` in place to the tokens ``requests[i].grammar`` allows next.

        ``requests``: objects with ``key`` and a not yet terminated ``grammar`` (engine ``Request``\\ s).
        """
        compiler = requests[0].grammar.compiler
        words = -(-compiler.vocab_size // 32)
        if words != self.words:
            self._reset(words)
        slots, stale = self._rows_of(requests)
        k, n = len(stale), logits.shape[0]
        # one int32 buffer, one copy: [k, words] refilled masks | their k rows | N mask rows | the masked rows
        host = self.staging.take(k * words + k + n + len(rows))
        fresh = host[:k * words].view(k, words)
        for i, entry in enumerate(stale):
            entry.grammar.fill(fresh, i)
            entry.version = entry.grammar.num_accepted
        row_slots = [0] * n                     # rows without a grammar read row 0: only ``rows`` are masked
        for row, slot in zip(rows, slots):
            row_slots[row] = slot
        host[k * words:].numpy()[:] = [e.row for e in stale] + row_slots + list(rows)
        dev = self.staging.to_device(host)
        ints = dev[k * words:]
        if k:
            self.masks.index_copy_(0, ints[:k].long(), dev[:k * words].view(k, words))
        step = self.masks.index_select(0, ints[k:k + n].long())   # [N, words]: row i masks logits row i
        compiler.apply_bitmask(logits, step, ints[k + n:])
        self.num_fills += k

    def _rows_of(self, requests: Sequence) -> tuple[list[int], list[_Row]]:
        """Each request's row, and the rows (each once) whose grammar moved since they were filled."""
        slots: list[int] = []
        stale: dict[int, _Row] = {}
        for request in requests:
            entry = self.rows.get(request.key)
            if entry is None or entry.grammar is not request.grammar:
                self.release(request.key)
                entry = self.rows[request.key] = _Row(self._take_row(), request, request.grammar)
            if entry.version != request.grammar.num_accepted:
                stale[entry.row] = entry
            slots.append(entry.row)
        return slots, list(stale.values())

    def _grow(self) -> None:
        old = self.capacity
        new = max(MIN_CAPACITY, 2 * old)
        masks = torch.zeros(new, self.words, dtype=torch.int32, device=self.device)
        masks[:old] = self.masks
        self.masks = masks
        self.free.extend(range(new - 1, old - 1, -1))

    def _reset(self, words: int) -> None:
        self.words, self.rows, self.free = words, {}, []
        self.masks = torch.zeros(0, words, dtype=torch.int32, device=self.device)


class _HostInts:
    """One reusable int32 host buffer (pinned on CUDA) and its single copy to the device per step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self.host = torch.empty(0, dtype=torch.int32)
        self.done: torch.cuda.Event | None = None

    def take(self, n: int) -> torch.Tensor:
        """The first ``n`` ints of the buffer, safe to overwrite (the previous copy out of it has finished)."""
        if self.done is not None:
            self.done.synchronize()
        if self.host.numel() < n:
            self.host = torch.empty(max(n, 2 * self.host.numel()), dtype=torch.int32, pin_memory=self.pinned)
        return self.host[:n]

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        if not self.pinned:
            return host if self.device.type == "cpu" else host.to(self.device)
        out = host.to(self.device, non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record()
        return out
