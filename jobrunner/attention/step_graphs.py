"""Every step of the ``triton`` attention backend at a fixed shape, replayed as CUDA graphs.

With the triton backend the attention of a step reads only small integer arrays (row offsets, context
lengths, block tables, the tile list) and its grid depends only on how many tiles it may have, so *any* step
— prompt chunks, prefix hits and decodes mixed — can run at a fixed shape: its tokens are padded to a
*token bucket* ``T`` (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, ... up to ``max_num_batched_tokens``), its rows to
``min(max_num_seqs, T)`` and its tile list to ``T / tokens_per_tile + rows`` (padding tiles return at once).
Context length needs no bucket: the kernel loops over each row's own keys. One graph is captured per
(token bucket, tile height, segments) — the tile height is small for decode-only steps, larger with a prompt
chunk; segments is 0, or for a decode-only step the backend runs split-K (:mod:`.split_decode`) the most
segments a row can have (the grid is fixed; segments past a row's keys and padding rows return at once).

All inputs live in one persistent int64 buffer that the step's single host->device copy lands in (the
arrays of one bucket always sit at the same offsets; the variable-size block-table updates come last and
are scattered, outside the graph, into the backend's persistent device block table). Padding tokens read
token 0 at position 0 and write their K/V into a scratch block the pool never hands out; no tile covers them,
so their attention output is zero and nothing reads them.

Every graph is captured up front by :meth:`StepGraphs.warm_up` (called when the runner is built on CUDA, so
before any timed step): each token bucket with the prompt-chunk tile height, and the buckets a decode-only
step can reach (up to ``max_num_seqs`` tokens) with the decode tile height (unsplit, and split-K where the
backend may split them). A warm-up capture runs an all-padding
step (no tile, K/V to the scratch block): nothing a request owns is touched. A step needing a graph the
warm-up did not make (more than ``MAX_GRAPHS``) still captures it on first use.

A failed capture warns once, counts, and that bucket runs eagerly from then on; tokens never change. With
``capture=False`` the same fixed-shape forward runs eagerly (tests run it on CPU under Triton's interpreter).
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from jobrunner.attention.base import StepLayout
from jobrunner.attention.graph_capture import WeightsGuard, capture_graph, drop_graphs_if_weights_moved
from jobrunner.attention.input_patch import patch_input_ids
from jobrunner.attention.triton_backend import TritonBackend, TritonMetadata
from jobrunner.attention.upload import PinnedStaging, StepUpload

log = logging.getLogger(__name__)

TOKEN_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072,
                 4096, 6144, 8192, 12288, 16384)
MAX_GRAPHS = 64   # captured graphs kept; steps needing another shape run eagerly


class StepGraphs:
    """Persistent inputs plus one captured graph per (token bucket, tile height)."""

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, backend: TritonBackend, max_num_seqs: int,
                 max_num_tokens: int, max_model_len: int, scratch_block: int, capture: bool,
                 staging: PinnedStaging | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.block_size = backend.block_size
        self.scratch_block = scratch_block
        self.capture = capture
        self.staging = staging
        self.device = kv_cache.device
        self.token_buckets = _token_buckets(max_num_tokens)
        self.max_num_seqs = max_num_seqs
        max_tokens = self.token_buckets[-1]
        width = backend.tables.max_blocks
        max_tiles = max_tokens + max_num_seqs   # a tile holds at least one token: tiles <= tokens + rows
        # tokens x3 + sample rows + input sources (late readback); row arrays; tiles; block-table updates (at most
        # every entry of every row)
        size = 5 * max_tokens + 3 * (max_num_seqs + 1) + 2 * max_tiles + 3 * max_num_seqs * width
        self.ints = torch.zeros(size, dtype=torch.long, device=self.device)
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.failed: set[tuple[int, int, int]] = set()
        self.pool = None
        self.weights = WeightsGuard(model)  # graphs dropped when the weights move after capture
        self.num_replays = 0
        self.num_eager_static = 0
        self.num_capture_failures = 0
        self.warmup_s: float | None = None

    def warm_up_keys(self) -> list[tuple[int, int, int]]:
        """The (token bucket, tile height, segments) of every graph :meth:`warm_up` captures, smallest first:
        decode-only buckets unsplit (unless the backend always splits) and split where it may split."""
        backend = self.backend
        chunk_m, decode_m = backend.block_m(2), backend.block_m(1)
        decode = [b for b in self.token_buckets if b <= self.max_num_seqs]
        keys = [(b, decode_m, 0) for b in decode if backend.split_decode != "on" or backend.fixed_tiles]
        keys += [(b, decode_m, backend.max_segments) for b in decode if backend.may_split(self._rows(b))]
        if chunk_m != decode_m:
            keys += [(b, chunk_m, 0) for b in self.token_buckets if b >= 2]
        return sorted(keys)[:MAX_GRAPHS]

    def _rows(self, bucket: int) -> int:
        """Rows of a bucket's grid (row arrays are padded to this)."""
        return min(self.max_num_seqs, bucket)

    def warm_up(self) -> int:
        """Capture every graph of :meth:`warm_up_keys` now (once; later calls do nothing); how many exist after.

        Each capture runs an all-padding step of its bucket: no tile, so no attention; K/V to the scratch block.
        Stops at the first failed capture (that bucket and the rest run eagerly / capture lazily, as before).
        """
        if not self.capture or self.warmup_s is not None:
            return len(self.graphs)
        start = time.perf_counter()
        empty = StepLayout([], [], [], [], 0, self.block_size, row_keys=[])
        for key in self.warm_up_keys():
            if key in self.graphs:
                continue
            bucket, block_m, segments = key
            meta, t = self._fill(empty, ([], [], [], []), bucket, self._rows(bucket), block_m, segments)
            if self._try_capture(key, t, meta) is None:
                break
        self.warmup_s = time.perf_counter() - start
        return len(self.graphs)

    def run_step(self, layout: StepLayout, lists) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden ``[T, hidden]``, sample_rows on the device), or None when the step should run eagerly.

        ``lists``: the step's :class:`~jobrunner.attention.step_runner.StepLists`.
        """
        num_tokens, num_rows = layout.num_tokens, layout.num_rows
        i = bisect.bisect_left(self.token_buckets, num_tokens)
        if i == len(self.token_buckets) or num_rows > self.max_num_seqs or num_tokens == 0:
            return None
        bucket = self.token_buckets[i]
        block_m = self.backend.block_m(layout.max_query_len)
        rows = self._rows(bucket)
        key = (bucket, block_m, self.backend.num_segments(layout, rows, fixed=True))
        if self.capture:
            drop_graphs_if_weights_moved(self)  # recaptured over the weights as they are now
        if self.capture and key not in self.graphs and (key in self.failed or len(self.graphs) >= MAX_GRAPHS):
            return None
        self.backend.num_split_steps += key[2] > 0
        meta, t = self._fill(layout, (lists.input_ids, lists.positions, lists.slots, lists.sample_rows), bucket,
                             rows, block_m, key[2], lists.input_sources)
        if lists.input_sources is not None:  # outside the graph: ids the previous step left on the device
            patch_input_ids(t["input_ids"], t["input_sources"], lists.source_tokens)
        if not self.capture:
            self.num_eager_static += 1
            return self._forward(t, meta)[:num_tokens], t["sample_rows"]
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._try_capture(key, t, meta)
            if entry is None:
                return None
        entry[0].replay()
        self.num_replays += 1
        return entry[1][:num_tokens], t["sample_rows"]

    def _fill(self, layout, lists, bucket: int, rows: int, block_m: int, segments: int = 0,
              input_sources: list[int] | None = None):
        input_ids, positions, slots, sample_rows = lists
        pad = bucket - layout.num_tokens
        scratch = self.scratch_block * self.block_size
        upload = StepUpload(self.device, self.staging)
        upload.add("input_ids", input_ids + [0] * pad)
        upload.add("positions", positions + [0] * pad)
        upload.add("slot_mapping", slots + [scratch + j % self.block_size for j in range(pad)])
        num_tiles = bucket // self.backend.tokens_per_tile(block_m) + rows
        self.backend.add_arrays(layout, upload, block_m, num_rows=rows, num_tiles=num_tiles)
        upload.add("sample_rows", sample_rows)
        if input_sources is not None:  # last: the graphs never read it (variable offsets are fine)
            upload.add("input_sources", input_sources + [-1] * pad)
        t = upload.flush(self.ints)
        self.backend.tables.apply(t)
        return TritonMetadata(self.backend, t, bucket, block_m, covers_all_tokens=False, num_segments=segments), t

    def _forward(self, t: dict[str, torch.Tensor], meta: TritonMetadata) -> torch.Tensor:
        return self.model(t["input_ids"], t["positions"], meta, self.kv_cache)

    def _try_capture(self, key, t, meta):
        try:
            entry = self.graphs[key] = self._capture(t, meta)
            return entry
        except Exception as exc:  # never a crash: this bucket runs eagerly from now on
            self.failed.add(key)
            self.num_capture_failures += 1
            if self.num_capture_failures == 1:
                log.warning("CUDA graph capture failed for %s (%s: %s); such steps run eagerly",
                            key, type(exc).__name__, exc)
            return None

    def _capture(self, t, meta) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self.weights.capture_started()
        graph, output, self.pool = capture_graph(self.device, self.pool, lambda: self._forward(t, meta))
        return graph, output

    def stats(self) -> dict[str, int]:
        """Counters for tests and the bench."""
        return {"graphs_captured": len(self.graphs), "graph_replays": self.num_replays,
                "static_eager_steps": self.num_eager_static, "graph_capture_failures": self.num_capture_failures,
                "graph_warmup_s": self.warmup_s, "graph_weight_moves": self.weights.num_moves}


def _token_buckets(max_num_tokens: int) -> tuple[int, ...]:
    buckets = [b for b in TOKEN_BUCKETS if b < max_num_tokens]
    return tuple(buckets + [max_num_tokens])
