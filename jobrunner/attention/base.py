"""The attention-backend interface: what a step looks like to attention, and what every backend implements.

A step's tokens are one flat batch ``[T]``. Each *row* is one request's slice of it: ``query_len`` new tokens
starting at flat offset ``query_start``, at positions ``seq_len - query_len .. seq_len - 1`` of that request
(a decode has ``query_len == 1``; a prompt chunk that hit the prefix cache, or a later chunk, starts past 0).
Its keys are positions ``0 .. seq_len - 1``, found through its block table. The model runner describes the
step once (:class:`StepLayout`); the backend turns that into its own metadata once per step; every layer then
calls :func:`paged_attention` with it. Backends own no state between steps.

Models whose layers differ in their window (Gemma 2/3: local sliding-window layers between global ones) set
``StepLayout.layer_windows``; a backend that supports it (``supports_layer_windows``: torch, cpu_paged,
invariant) builds one metadata view per distinct window, once per step, and each layer takes its own with
:meth:`AttentionMetadata.for_layer`. Attention logit soft-capping (Gemma 2: ``cap * tanh(scores / cap)``
before the mask and softmax) is a ``softcap`` argument of :func:`paged_attention`; only backends with
``supports_softcap`` (torch, invariant) take it, any other raises rather than attend without it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from jobrunner.attention.kv_quant import is_fp8, write_fp8_kv
from jobrunner.attention.upload import StepUpload


@dataclass
class StepLayout:
    """Host-side description of one step's rows, in flat-batch order (rows cover tokens ``0 .. num_tokens-1``)."""

    query_starts: list[int]       # flat offset of each row's first new token
    query_lens: list[int]         # new tokens of each row
    seq_lens: list[int]           # keys each row attends to (its context after this step)
    block_tables: list[list[int]]  # each row's block ids (at least ceil(seq_len / block_size) of them)
    num_tokens: int
    block_size: int
    # a stable key per row, unique per sequence (``Request.key``: request id + sample index; the n samples of
    # one request are n sequences with their own block tables): lets backends keep per-row state
    row_keys: list[Hashable] | None = None
    sliding_window: int | None = None  # a query at position p sees keys p - sliding_window + 1 .. p only
    # per layer, when the layers differ (Gemma 2/3: None on global layers); then ``sliding_window`` is unused
    layer_windows: tuple[int | None, ...] | None = None

    @property
    def windows(self) -> list[int | None]:
        """The distinct windows this step's layers attend with (one metadata view each)."""
        if self.layer_windows is None:
            return [self.sliding_window]
        return sorted(set(self.layer_windows), key=lambda w: (w is None, w or 0))

    @property
    def smallest_window(self) -> int | None:
        """The narrowest window of any layer (None: every layer attends to all earlier positions)."""
        return min((w for w in self.windows if w is not None), default=None)

    @property
    def num_rows(self) -> int:
        return len(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)


class AttentionMetadata:
    """Per-step inputs of one backend (the same for every layer). ``slot_mapping[t]``: cache slot of token t."""

    backend: AttentionBackend
    slot_mapping: torch.Tensor    # [T] long
    num_tokens: int
    layer_views: list[AttentionMetadata] | None = None  # per layer, built from StepLayout.layer_windows

    def for_layer(self, index: int) -> AttentionMetadata:
        """The metadata layer ``index`` attends with: its window's view, or this one when all layers share it."""
        return self if self.layer_views is None else self.layer_views[index]


class AttentionBackend(ABC):
    """Writes a step's K/V into the paged cache and attends over it.

    Cache of one layer: ``[num_slots, num_kv_heads, head_dim]`` (slot = block_id * block_size + offset); an fp8
    cache's rows are ``head_dim + 4`` wide, codes then a float32 scale (:mod:`jobrunner.attention.kv_quant`).
    """

    name: str = "?"
    supports_layer_windows: bool = False  # builds per-window views for StepLayout.layer_windows
    supports_softcap: bool = False        # forward takes ``softcap`` (attention logit soft-capping)
    chunk_route: str = ""                 # where long prompt chunks run, when a rule of the backend chose it

    @abstractmethod
    def build(self, layout: StepLayout, upload: StepUpload) -> AttentionMetadata:
        """This step's metadata (built once per step, used by every layer).

        ``upload`` already holds the runner's ``slot_mapping`` (and its other inputs); a backend adds its own
        integer arrays and calls ``upload.flush()`` once, so the whole step crosses to the device in one copy.
        """

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Store k, v at ``meta.slot_mapping`` and attend. q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H * D]."""

    def counters(self) -> dict:
        """What the backend counts for the runner's stats (the triton backend: its split-K decode steps)."""
        return {}

    def release(self, key: Hashable) -> None:  # noqa: B027 - optional hook: stateless backends keep nothing
        """Forget the per-row state kept for ``key`` (a finished sequence); stateless backends keep none."""


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    softcap: float | None = None) -> torch.Tensor:
    """One layer's attention through the backend that built ``meta`` (what the model calls).

    ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before masking (Gemma 2); a backend
    without ``supports_softcap`` raises ``NotImplementedError`` (the model runner routes such models to torch).
    """
    if softcap is None:
        return meta.backend.forward(q, k, v, k_cache, v_cache, meta, scale)
    if not meta.backend.supports_softcap:
        raise NotImplementedError(f"attention backend {meta.backend.name!r} cannot soft-cap attention logits")
    return meta.backend.forward(q, k, v, k_cache, v_cache, meta, scale, softcap=softcap)


def layer_views(layout: StepLayout, by_window: dict) -> list | None:
    """Per-layer metadata from one view per distinct window (None when the layout has no per-layer windows)."""
    if layout.layer_windows is None:
        return None
    return [by_window[w] for w in layout.layer_windows]


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's K/V at their cache slots (one index_copy_ each: a single kernel on CUDA); an fp8 cache
    quantizes them first (:mod:`jobrunner.attention.kv_quant`)."""
    if is_fp8(k_cache.dtype):
        write_fp8_kv(k, v, k_cache, v_cache, slot_mapping)
        return
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)
