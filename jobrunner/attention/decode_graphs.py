"""Fixed-shape decode steps of the ``torch`` attention backend, replayed as CUDA graphs.

In a decode-only step (every scheduled request computes exactly one token) the model's work is small and
its cost on a GPU is mostly the launch of a few hundred kernels. A CUDA graph records those launches once
and replays them with one call, but it replays fixed shapes reading fixed addresses. So a decode step is
padded to a *batch bucket* ``B`` (rows) and a *context bucket* of ``N`` KV blocks, and its inputs are copied
into persistent buffers that every graph reads:

* ``input_ids``, ``positions``, ``slots`` ``[max_num_seqs]``: the new token of each row, its position and the
  cache slot its K/V goes to;
* ``context_lens`` ``[max_num_seqs]`` and ``block_table`` ``[max_num_seqs, max_blocks]``: what each row attends
  to. The attention mask is computed *inside* the graph from ``context_lens``, so one graph serves any mix
  of context lengths up to ``N`` blocks.

Padding rows read token 0 at position 0, write their K/V into a scratch block that no request owns (the
cache holds one block more than the pool hands out) and attend only to it; their outputs are dropped.

The graphs share one memory pool, up to :data:`MAX_GRAPHS` of them. :meth:`DecodeGraphs.warm_up` (called when
the runner is built on CUDA, before any timed step) captures the shapes steps are most likely to need; any
other (``B``, ``N``) a step needs is captured on first use. Steps that don't fit (a prefill chunk in the
batch, too many rows, too much padding) run eagerly through the torch backend's grouped path (the
backend's :class:`~jobrunner.attention.step_runner.StepRunner` decides). With ``capture=False`` the same
fixed-shape forward runs eagerly; the tests use that on CPU to check padding, masking and the scratch block
against the grouped path, token for token.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from jobrunner.attention.base import StepLayout
from jobrunner.attention.graph_capture import WeightsGuard, capture_graph, drop_graphs_if_weights_moved
from jobrunner.attention.input_patch import patch_input_ids
from jobrunner.attention.torch_backend import AttentionGroup, TorchMetadata

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
MIN_CONTEXT_BLOCKS = 16    # the smallest context bucket, in blocks (256 tokens at block size 16)
CONTEXT_GROWTH = 1.5       # each context bucket is about this much longer than the previous one
MAX_GRAPHS = 48            # captured graphs kept; steps needing another shape run eagerly
MAX_PADDED_KEYS = 1 << 19  # B * N * block_size above this runs eagerly (bounds the gathered K/V memory)
MAX_PADDING_RATIO = 2.0    # padded keys / real keys above this runs eagerly (it packs rows by length)
MIN_KEYS_FOR_RATIO = 8192  # ...unless the padded step is this small anyway


@dataclass
class DecodeRow:
    """One decode of the step: the token it reads, where it is, and the blocks it attends to."""

    token_id: int
    position: int
    slot: int
    block_ids: list[int]
    rope_position: int | None = None  # the model's rope-table row when not ``position`` (longrope's long table)


class DecodeGraphs:
    """Persistent input buffers plus one captured graph per (batch bucket, context bucket)."""

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int, max_num_seqs: int,
                 max_model_len: int, scratch_block: int, capture: bool) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.capture = capture
        self.device = kv_cache.device
        self.batch_buckets = _batch_buckets(max_num_seqs)
        self.max_num_seqs = self.batch_buckets[-1]
        self.context_buckets = _context_buckets(-(-max_model_len // block_size))
        max_blocks = self.context_buckets[-1]
        dev = self.device
        self.input_ids = torch.zeros(self.max_num_seqs, dtype=torch.long, device=dev)
        self.positions = torch.zeros(self.max_num_seqs, dtype=torch.long, device=dev)
        self.slots = torch.zeros(self.max_num_seqs, dtype=torch.long, device=dev)
        self.context_lens = torch.ones(self.max_num_seqs, dtype=torch.long, device=dev)
        self.block_table = torch.zeros(self.max_num_seqs, max_blocks, dtype=torch.long, device=dev)
        self.row_index = torch.arange(self.max_num_seqs, device=dev)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.weights = WeightsGuard(model)  # graphs dropped when the weights move after capture
        self.num_replays = 0
        self.num_eager_static = 0
        self.warmup_s: float | None = None

    def warm_up_keys(self) -> list[tuple[int, int]]:
        """The (batch bucket, context bucket) of every graph :meth:`warm_up` captures: every shape within
        ``MAX_PADDED_KEYS``, fewest padded keys first, at most ``MAX_GRAPHS``."""
        shapes = [(b, n) for b in self.batch_buckets for n in self.context_buckets
                  if b * n * self.block_size <= MAX_PADDED_KEYS]
        return sorted(shapes, key=lambda s: (s[0] * s[1], s))[:MAX_GRAPHS]

    def warm_up(self) -> int:
        """Capture every graph of :meth:`warm_up_keys` now (once; later calls do nothing); how many exist after.

        Each capture runs an all-padding step (every row reads and writes the scratch block only).
        """
        if not self.capture or self.warmup_s is not None:
            return len(self.graphs)
        drop_graphs_if_weights_moved(self)
        start = time.perf_counter()
        for shape in self.warm_up_keys():
            if shape in self.graphs:
                continue
            self._fill([], *shape)
            try:
                self.graphs[shape] = self._capture(*shape)
            except Exception as exc:  # never a crash at start-up: the rest is captured on first use
                log.warning("CUDA graph warm-up stopped at %s (%s: %s)", shape, type(exc).__name__, exc)
                break
        self.warmup_s = time.perf_counter() - start
        return len(self.graphs)

    def shape_for(self, rows: list[DecodeRow]) -> tuple[int, int] | None:
        """The (batch bucket, context bucket in blocks) for ``rows``, or None when the step should run eagerly."""
        if not rows or len(rows) > self.max_num_seqs:
            return None
        needed = max(len(r.block_ids) for r in rows)
        i = bisect.bisect_left(self.context_buckets, needed)
        if i == len(self.context_buckets):
            return None
        batch = self.batch_buckets[bisect.bisect_left(self.batch_buckets, len(rows))]
        blocks = self.context_buckets[i]
        padded_keys = batch * blocks * self.block_size
        real_keys = sum(r.position + 1 for r in rows)
        if padded_keys > MAX_PADDED_KEYS:
            return None
        if padded_keys > MIN_KEYS_FOR_RATIO and padded_keys > MAX_PADDING_RATIO * real_keys:
            return None
        if self.capture and (batch, blocks) not in self.graphs and len(self.graphs) >= MAX_GRAPHS:
            return None
        return batch, blocks

    def run_step(self, layout: StepLayout, lists) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden ``[rows, hidden]``, sample_rows on the device) of a decode-only step that fits a shape, or None
        (a prompt chunk or draft tokens in the step, or no shape: see :meth:`shape_for`) to run it eagerly.

        ``lists``: the step's :class:`~jobrunner.attention.step_runner.StepLists`.
        """
        if layout.max_query_len != 1:
            return None
        bs = self.block_size
        # the position from the row's length: lists.positions are rope-table rows (models/rope.py table_offset)
        rows = [DecodeRow(token, n - 1, slot, table[:(n - 1) // bs + 1], rope) for token, n, rope, slot, table
                in zip(lists.input_ids, layout.seq_lens, lists.positions, lists.slots, layout.block_tables)]
        shape = self.shape_for(rows)
        if shape is None:
            return None
        late = None if lists.input_sources is None else (lists.input_sources, lists.source_tokens)
        hidden = self.run(rows, shape, late)
        return hidden, _to_device(lists.sample_rows, self.device)

    def run(self, rows: list[DecodeRow], shape: tuple[int, int],
            late: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
        """Hidden states ``[len(rows), hidden]`` of one decode step padded to ``shape`` (see :meth:`shape_for`).

        ``late``: (per row, the row of the tensor whose id it reads, or -1; that tensor: ids the previous step
        left on the device), patched into the input ids before the forward (late readback: engine/readback.py).
        """
        batch, blocks = shape
        self._fill(rows, batch, blocks)
        if late is not None:
            sources, tokens = late
            patch_input_ids(self.input_ids[:len(rows)], _to_device(sources, self.device), tokens)
        if not self.capture:
            self.num_eager_static += 1
            return self._forward(batch, blocks)[:len(rows)]
        drop_graphs_if_weights_moved(self)
        entry = self.graphs.get(shape)
        if entry is None:
            entry = self.graphs[shape] = self._capture(batch, blocks)
        entry[0].replay()
        self.num_replays += 1
        return entry[1][:len(rows)]

    def _fill(self, rows: list[DecodeRow], batch: int, blocks: int) -> None:
        n, bs = len(rows), self.block_size
        pad = batch - n
        ids = [r.token_id for r in rows] + [0] * pad
        positions = [r.position if r.rope_position is None else r.rope_position for r in rows] + [0] * pad
        slots = [r.slot for r in rows] + [self.scratch_block * bs] * pad
        lens = [r.position + 1 for r in rows] + [1] * pad
        table = [r.block_ids + [0] * (blocks - len(r.block_ids)) for r in rows]   # padding blocks are masked
        table += [[self.scratch_block] + [0] * (blocks - 1)] * pad
        packed = _to_device([ids, positions, slots, lens], self.device)
        self.input_ids[:batch].copy_(packed[0])
        self.positions[:batch].copy_(packed[1])
        self.slots[:batch].copy_(packed[2])
        self.context_lens[:batch].copy_(packed[3])
        self.block_table[:batch, :blocks].copy_(_to_device(table, self.device))

    def _forward(self, batch: int, blocks: int) -> torch.Tensor:
        """The fixed-shape forward: one attention group of ``batch`` rows over ``blocks`` blocks each."""
        kv_len = blocks * self.block_size
        keys = torch.arange(kv_len, device=self.device)
        mask = (keys[None, :] < self.context_lens[:batch, None])[:, None, None, :]    # [B, 1, 1, L]
        index = self.row_index[:batch]
        table = self.block_table[:batch, :blocks].reshape(-1)
        group = AttentionGroup(batch, 1, kv_len, index, table, mask, index)
        meta = TorchMetadata(self.slots[:batch], [group], batch, self.block_size)
        return self.model(self.input_ids[:batch], self.positions[:batch], meta, self.kv_cache)

    def _capture(self, batch: int, blocks: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self.weights.capture_started()
        graph, output, self.pool = capture_graph(self.device, self.pool, lambda: self._forward(batch, blocks))
        return graph, output

    def stats(self) -> dict[str, int]:
        """Counters for tests and the engine's stats."""
        return {"graphs_captured": len(self.graphs), "graph_replays": self.num_replays,
                "static_eager_steps": self.num_eager_static, "graph_warmup_s": self.warmup_s,
                "graph_weight_moves": self.weights.num_moves}


def _to_device(values: list, device: torch.device) -> torch.Tensor:
    """A small host list as a long tensor on ``device``, copied without making the host wait for queued work
    (a blocking copy would stall the host behind the previous step: no overlap with late readback)."""
    host = torch.tensor(values, dtype=torch.long)
    return host if device.type == "cpu" else host.to(device, non_blocking=True)


def _batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    buckets = [b for b in BATCH_BUCKETS if b < max_num_seqs]
    return tuple(buckets + [max_num_seqs])


def _context_buckets(max_blocks: int) -> tuple[int, ...]:
    buckets: list[int] = []
    size = MIN_CONTEXT_BLOCKS
    while size < max_blocks:
        buckets.append(size)
        size = int(size * CONTEXT_GROWTH + 0.5)
    return tuple(buckets + [max_blocks])
