"""Penalty state kept on the device per sequence and updated with each step's new tokens.

Repetition, presence and frequency penalties change a row's logits only at the token ids its prompt and
output hold. Rebuilding ``[rows, vocab]`` counts from the token lists every step costs O(rows x context) host
work, a large upload and several full ``[rows, vocab]`` passes (70-90 ms at 256 rows x 1.9k tokens). Here every
penalized sequence owns a row of two persistent device tensors:

* ``ids`` ``[capacity, width]``: its prompt + output token ids in order (the columns past its length repeat
  its first token, so a padded row only names tokens it holds);
* ``counts`` ``[capacity, vocab]``: how often each id occurs in its *output*.

A row is filled once, when its sequence is first penalized; then each step writes only the tokens appended
since (one ``index_put_`` into each tensor for the whole batch), so a step's host work is O(new tokens).
The penalties gather the batch's logits and counts at ``ids`` (``[rows, context]``, never ``[rows, vocab]``),
apply the same float32 formulas as :func:`~jobrunner.engine.sampling.penalties.apply_penalties` and scatter
back: the penalized logits are bit for bit those of counting afresh (an id held twice gets the same value
twice; ids a row never held are untouched, as there). ``scripts/penalty_cost.py`` (a one-off, at commit a75bf8c)
measured both.

Rows are keyed by ``Request.key`` and remember the request object: a different request under a reused key,
or an output that shrank, is counted again from scratch. A finished sequence's row is handed back by
:meth:`DevicePenaltyState.release`; rows of finished requests are also reclaimed whenever the table is full,
before it grows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from jobrunner.engine.sampling import to_device
from jobrunner.engine.sampling.row_table import SequenceRows

MIN_CAPACITY = 8
MIN_WIDTH = 256


@dataclass
class _Row:
    row: int
    request: object          # the request the row belongs to (identity tells a reused key)
    length: int = 0          # prompt + output tokens written to ``ids``


class DevicePenaltyState(SequenceRows):
    """Persistent per-sequence token ids and output counts on ``device`` (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.vocab = 0
        self.ids = torch.zeros(0, MIN_WIDTH, dtype=torch.int64, device=device)
        self.counts = torch.zeros(0, 0, device=device)

    @property
    def capacity(self) -> int:
        return self.ids.shape[0]

    def apply(self, logits: torch.Tensor, rows: list[int], requests: Sequence, repetition: list[float],
              presence: list[float], frequency: list[float]) -> None:
        """Penalize ``logits[rows[i]]`` for ``requests[i]`` in place, after adding the tokens new since last step.

        ``requests``: objects with ``key``, ``prompt_token_ids``, ``output_token_ids`` (engine ``Request``\\ s).
        """
        vocab = logits.shape[-1]
        if vocab != self.vocab:
            self._reset(vocab)
        slots, length = self.update(requests)
        dev = logits.device
        slot_index = to_device(slots, dev, torch.int64)
        ids = self.ids.index_select(0, slot_index)[:, :length]             # [R, L]
        row_index = to_device(rows, dev, torch.int64)[:, None].expand_as(ids)
        values = logits[row_index, ids]
        if any(p != 1.0 for p in repetition):                             # every gathered id was seen
            p = to_device(repetition, dev, torch.float32)[:, None]
            values = torch.where(values < 0, values * p, values / p)
        if any(presence) or any(frequency):
            counts = self.counts[slot_index[:, None].expand_as(ids), ids]
            values = values - (to_device(frequency, dev, torch.float32)[:, None] * counts
                               + to_device(presence, dev, torch.float32)[:, None] * (counts > 0).float())
        logits.index_put_((row_index, ids), values)

    def update(self, requests: Sequence) -> tuple[list[int], int]:
        """Write the tokens new since the last call; (each request's row, the longest row's length)."""
        slots: list[int] = []
        id_rows, id_cols, id_vals, count_rows, count_ids = [], [], [], [], []
        longest = 0
        for request in requests:
            entry = self._entry(request)
            prompt, outputs = request.prompt_token_ids, request.output_token_ids
            total = len(prompt) + len(outputs)
            if total > entry.length:
                if entry.length == 0:     # padding repeats a token the row holds: its first
                    self.ids[entry.row].fill_((list(prompt) or list(outputs))[0])
                new = (list(prompt) + list(outputs))[entry.length:] if entry.length < len(prompt) else \
                    outputs[entry.length - len(prompt):]
                id_rows += [entry.row] * len(new)
                id_cols += range(entry.length, total)
                id_vals += new
                new_outputs = outputs[max(0, entry.length - len(prompt)):]
                count_rows += [entry.row] * len(new_outputs)
                count_ids += new_outputs
                entry.length = total
            longest = max(longest, total)
            slots.append(entry.row)
        if longest > self.ids.shape[1]:
            self._widen(longest)
        if id_rows:
            index = to_device([id_rows, id_cols, id_vals], self.device, torch.int64)
            self.ids.index_put_((index[0], index[1]), index[2])
        if count_rows:
            index = to_device([count_rows, count_ids], self.device, torch.int64)
            self.counts.index_put_((index[0], index[1]), torch.ones(len(count_rows), device=self.device),
                                   accumulate=True)
        return slots, longest

    def _entry(self, request) -> _Row:
        entry = self.rows.get(request.key)
        if entry is not None and (entry.request is not request or entry.length > request.num_tokens):
            self.release(request.key)  # another request under this key, or an output rolled back: afresh
            entry = None
        if entry is None:
            entry = self.rows[request.key] = _Row(self._take_row(), request)
        return entry

    def _take_row(self) -> int:
        row = super()._take_row()
        self.counts[row].zero_()  # its output counts start from zero
        return row

    def _grow(self) -> None:
        old = self.capacity
        new = max(MIN_CAPACITY, 2 * old)
        ids = torch.zeros(new, self.ids.shape[1], dtype=torch.int64, device=self.device)
        ids[:old] = self.ids
        counts = torch.zeros(new, self.vocab, device=self.device)
        counts[:old] = self.counts
        self.ids, self.counts = ids, counts
        self.free.extend(range(new - 1, old - 1, -1))

    def _widen(self, length: int) -> None:
        width = self.ids.shape[1]
        while width < length:
            width *= 2
        # new columns repeat each row's first token (a token the row holds), like the rest of its padding
        self.ids = torch.cat([self.ids, self.ids[:, :1].expand(-1, width - self.ids.shape[1])], dim=1)

    def _reset(self, vocab: int) -> None:
        self.vocab, self.rows, self.free = vocab, {}, []
        self.ids = torch.zeros(0, MIN_WIDTH, dtype=torch.int64, device=self.device)
        self.counts = torch.zeros(0, vocab, device=self.device)
        self._grow()
