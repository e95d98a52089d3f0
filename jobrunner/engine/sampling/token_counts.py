"""Per-sequence token counts kept on the device and updated with each step's new tokens (for the penalties).

Repetition, presence and frequency penalties need, for every penalized row, how often each token id occurs in
its output (and, for repetition, in its prompt too). Rebuilding those counts from the token lists every step
costs O(rows x context) host work and a large upload (70-90 ms at 256 rows x 1.9k tokens). Here every
penalized sequence owns a row of two persistent ``[capacity, vocab]`` float tensors on the device:

* ``output``: counts of its output tokens;
* ``seen``: counts of its prompt + output tokens (allocated only once a row asks for a repetition penalty).

A row is filled once, when its sequence is first penalized (the prompt, and any output so far), then each step
adds only the tokens appended since (one ``index_put_(accumulate=True)`` for the whole batch), so a step costs
O(new tokens) on the host. The penalties then read the batch's rows with one ``index_select``. Counts are
exact small integers in float32, so the penalized logits equal those of
:func:`~jobrunner.engine.sampling.penalties.apply_penalties` bit for bit.

Rows are keyed by ``Request.key`` and remember the request object: a different request under a reused key, or
an output that shrank, is counted again from scratch. A finished sequence's row is handed back by
:meth:`DeviceTokenCounts.release`; rows of finished requests are also reclaimed whenever the table is full,
before it grows.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from jobrunner.engine.sampling import to_device

MIN_CAPACITY = 8


@dataclass
class _Row:
    row: int
    request: object          # the request the counts belong to (identity tells a reused key)
    num_output: int = 0      # output tokens already counted
    prompt_counted: bool = False


class DeviceTokenCounts:
    """Persistent per-sequence token counts on ``device`` (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.vocab = 0
        self.output: torch.Tensor | None = None   # [capacity, vocab]
        self.seen: torch.Tensor | None = None     # [capacity, vocab]: prompt + output
        self.rows: dict[Hashable, _Row] = {}
        self.free: list[int] = []

    @property
    def capacity(self) -> int:
        return 0 if self.output is None else self.output.shape[0]

    def counts(self, requests: Sequence, vocab: int, with_prompt: bool
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(output counts, prompt + output counts or None)``, each ``[len(requests), vocab]``, brought up to date.

        ``requests``: objects with ``key``, ``prompt_token_ids``, ``output_token_ids`` (engine ``Request``\\ s).
        """
        if vocab != self.vocab:
            self._reset(vocab)
        if with_prompt and self.seen is None:
            self.seen = torch.zeros_like(self.output)
            for entry in self.rows.values():
                entry.prompt_counted = False
        rows, out_rows, out_tokens, seen_rows, seen_tokens = [], [], [], [], []
        for request in requests:
            entry = self._entry(request)
            outputs = request.output_token_ids
            new = outputs[entry.num_output:]
            out_rows += [entry.row] * len(new)
            out_tokens += new
            if self.seen is not None:
                if not entry.prompt_counted:  # prompt plus the outputs counted so far
                    old = list(request.prompt_token_ids) + list(outputs[:entry.num_output])
                    seen_rows += [entry.row] * len(old)
                    seen_tokens += old
                    entry.prompt_counted = True
                seen_rows += [entry.row] * len(new)
                seen_tokens += new
            entry.num_output = len(outputs)
            rows.append(entry.row)
        self._add(self.output, out_rows, out_tokens)
        self._add(self.seen, seen_rows, seen_tokens)
        index = to_device(rows, self.device, torch.int64)
        out = self.output.index_select(0, index)
        return out, (self.seen.index_select(0, index) if with_prompt else None)

    def release(self, key: Hashable) -> None:
        """Forget a finished sequence (its row is zeroed when it is next handed out)."""
        entry = self.rows.pop(key, None)
        if entry is not None:
            self.free.append(entry.row)

    def _entry(self, request) -> _Row:
        entry = self.rows.get(request.key)
        if entry is not None and (entry.request is not request or entry.num_output > len(request.output_token_ids)):
            self.release(request.key)  # another request under this key, or an output rolled back: count afresh
            entry = None
        if entry is None:
            entry = self.rows[request.key] = _Row(self._take_row(), request)
        return entry

    def _take_row(self) -> int:
        if not self.free:
            for key in [k for k, e in self.rows.items() if getattr(e.request, "is_finished", False)]:
                self.release(key)
        if not self.free:
            self._grow()
        row = self.free.pop()
        self.output[row].zero_()
        if self.seen is not None:
            self.seen[row].zero_()
        return row

    def _grow(self) -> None:
        old = self.capacity
        new = max(MIN_CAPACITY, 2 * old)
        self.output = _grown(self.output, new, self.vocab, self.device)
        if self.seen is not None:
            self.seen = _grown(self.seen, new, self.vocab, self.device)
        self.free.extend(range(new - 1, old - 1, -1))

    def _reset(self, vocab: int) -> None:
        self.vocab, self.output, self.seen, self.rows, self.free = vocab, None, None, {}, []
        self._grow()

    def _add(self, table: torch.Tensor | None, rows: list[int], tokens: list[int]) -> None:
        if table is None or not rows:
            return
        index = to_device([rows, tokens], self.device, torch.int64)
        ones = torch.ones(len(rows), dtype=table.dtype, device=self.device)
        table.index_put_((index[0], index[1]), ones, accumulate=True)


def _grown(table: torch.Tensor | None, capacity: int, vocab: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(capacity, vocab, device=device)
    if table is not None:
        out[:table.shape[0]] = table
    return out
