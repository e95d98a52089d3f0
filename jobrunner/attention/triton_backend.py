"""The ``triton`` backend: one kernel launch per layer reads the paged KV cache in place (CUDA).

See :mod:`jobrunner.attention.triton_kernels` for the kernel. Per step the host lists the row offsets, the
context lengths, the block tables and the tiles (row, first query token) — a few small integer arrays that
go to the device with the runner's own inputs in one copy. On CPU the same kernel runs under Triton's
interpreter (``TRITON_INTERPRET=1`` set before ``triton`` is imported): slow, but it is how the tests check
it against the ``torch`` backend. An fp8 KV cache is read in place too (codes upcast in registers, per-row
scales applied to scores and weights: :mod:`jobrunner.attention.triton_kernels`).
"""

from __future__ import annotations

import os

import torch

from jobrunner.attention.base import AttentionBackend, AttentionMetadata, StepLayout, write_kv
from jobrunner.attention.block_tables import DeviceBlockTables
from jobrunner.attention.kv_quant import is_fp8, scales_of
from jobrunner.attention.split_decode import (
    check_split_mode,
    segment_keys_for,
    split_decode_attention,
    target_programs,
    use_split_decode,
)
from jobrunner.attention.upload import StepUpload

DECODE_BLOCK_M = 16     # query rows per tile when every row of the step decodes one token (tl.dot needs >= 16)
CHUNK_BLOCK_M = 64      # ... when the step holds a prompt chunk
BLOCK_N = 64            # keys per inner iteration


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton kernel cannot run on ``device`` (None when it can)."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpret:
        return f"the triton attention backend needs CUDA (or TRITON_INTERPRET=1), not {device.type}"
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton is not installed ({exc})"
    return None


class TritonMetadata(AttentionMetadata):
    """Device arrays of one step for :func:`~jobrunner.attention.triton_kernels.paged_attention_kernel`."""

    def __init__(self, backend: TritonBackend, tensors: dict[str, torch.Tensor], num_tokens: int,
                 block_m: int, covers_all_tokens: bool, num_segments: int = 0) -> None:
        self.backend = backend
        self.slot_mapping = tensors["slot_mapping"]
        self.query_start = tensors["query_start"]    # [B + 1]
        self.seq_lens = tensors["seq_lens"]          # [B]
        self.table_rows = tensors["table_rows"]      # [B] row of the device block table
        self.block_table = backend.tables.table      # [capacity, max_blocks], persistent
        self.tile_row = tensors["tile_row"]          # [num_tiles], -1 = padding tile
        self.tile_start = tensors["tile_start"]      # [num_tiles]
        self.num_tokens = num_tokens
        self.block_m = block_m
        self.covers_all_tokens = covers_all_tokens   # False: padding tokens exist, their output must be zeros
        self.num_segments = num_segments             # > 0: a decode-only step run split-K over this many segments


class TritonBackend(AttentionBackend):
    """Varlen paged attention in one Triton launch per layer (prompt chunks, prefix hits and decodes)."""

    name = "triton"

    def __init__(self, num_heads: int, num_kv_heads: int, block_size: int, device: torch.device,
                 max_num_seqs: int = 256, max_model_len: int = 8192, block_n: int = BLOCK_N,
                 split_decode: str = "off", segment_keys: int | None = None) -> None:
        self.n_rep = num_heads // num_kv_heads
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.block_n = block_n
        # split-K decode (jobrunner/attention/split_decode.py): off | auto | on, its segment and the grid it fills
        self.split_decode = check_split_mode(split_decode)
        self.segment_keys = segment_keys or segment_keys_for(block_size, block_n, max_model_len)
        self.max_segments = -(-max_model_len // self.segment_keys)
        self.target_programs = target_programs(device)
        self.num_split_steps = 0
        self.fixed_tiles = False  # deterministic mode: one tile height for every step (one compiled kernel)
        # twice the running batch: rows of requests that pause a step or two keep their synced tables
        self.tables = DeviceBlockTables(max(2 * max_num_seqs, 64), -(-max_model_len // block_size) + 1, device)

    def block_m(self, max_query_len: int) -> int:
        """Query rows per tile: small when the step only decodes, larger when it holds prompt chunks."""
        rows = DECODE_BLOCK_M if max_query_len <= 1 and not self.fixed_tiles else CHUNK_BLOCK_M
        return max(rows, _next_pow2(self.n_rep))

    def num_segments(self, layout: StepLayout, num_rows: int, fixed: bool) -> int:
        """Segments of a split-K launch for this step (0: the unsplit kernel). ``num_rows``: the grid's rows;
        ``fixed``: a fixed-shape (CUDA graph) step, whose grid has the most segments any row can have."""
        if self.split_decode == "off" or layout.max_query_len != 1 or self.fixed_tiles:
            return 0  # deterministic mode (fixed_tiles): a row's reduction order must not depend on the batch
        longest = max(layout.seq_lens)
        if self.split_decode == "auto" and not use_split_decode(num_rows, self.num_kv_heads, longest,
                                                               self.segment_keys, self.target_programs):
            return 0
        return self.max_segments if fixed else -(-longest // self.segment_keys)

    def counters(self) -> dict:
        """The split-K mode and how many steps ran split (nothing while it is off)."""
        if self.split_decode == "off":
            return {}
        return {"split_decode": self.split_decode, "split_decode_steps": self.num_split_steps}

    def may_split(self, num_rows: int) -> bool:
        """Whether a decode-only step with a grid of ``num_rows`` rows can run split-K (its graph is worth having)."""
        if self.fixed_tiles:
            return False
        return self.split_decode == "on" or (
            self.split_decode == "auto" and num_rows * self.num_kv_heads < self.target_programs)

    def tokens_per_tile(self, block_m: int) -> int:
        return block_m // self.n_rep

    def tiles(self, layout: StepLayout, block_m: int) -> tuple[list[int], list[int]]:
        """(row, first query token) of every tile of the step."""
        per_tile = self.tokens_per_tile(block_m)
        rows: list[int] = []
        starts: list[int] = []
        for row, q_len in enumerate(layout.query_lens):
            first = range(0, q_len, per_tile)
            rows.extend([row] * len(first))
            starts.extend(first)
        return rows, starts

    def add_arrays(self, layout: StepLayout, upload: StepUpload, block_m: int, num_rows: int | None = None,
                   num_tiles: int | None = None) -> None:
        """Queue this step's arrays; optional fixed sizes pad them (for a CUDA graph's persistent buffers).

        Fixed-size arrays first, then the variable-size block-table updates: with fixed sizes every array
        lands at the same offset of a persistent buffer at every step.
        """
        num_rows = num_rows or layout.num_rows
        pad_rows = num_rows - layout.num_rows
        tile_row, tile_start = self.tiles(layout, block_m)
        pad_tiles = (num_tiles or len(tile_row)) - len(tile_row)
        if pad_rows < 0 or pad_tiles < 0:
            raise ValueError(f"step has {layout.num_rows} rows / {len(tile_row)} tiles; room for "
                             f"{num_rows} / {num_tiles}")
        keys = layout.row_keys or [f"_row{i}" for i in range(layout.num_rows)]
        upload.add("query_start", list(layout.query_starts) + [layout.num_tokens] * (pad_rows + 1))
        upload.add("seq_lens", list(layout.seq_lens) + [0] * pad_rows)
        upload.add("tile_row", tile_row + [-1] * pad_tiles)
        upload.add("tile_start", tile_start + [0] * pad_tiles)
        table_rows, triples = self.tables.updates(keys, layout.block_tables)
        upload.add("table_rows", table_rows + [0] * pad_rows)
        self.tables.add_to(upload, triples)

    def release(self, key) -> None:
        self.tables.release(key)

    def build(self, layout: StepLayout, upload: StepUpload) -> TritonMetadata:
        block_m = self.block_m(layout.max_query_len)
        self.add_arrays(layout, upload, block_m)
        tensors = upload.flush()
        self.tables.apply(tensors)
        segments = self.num_segments(layout, layout.num_rows, fixed=False)
        self.num_split_steps += segments > 0
        return TritonMetadata(self, tensors, layout.num_tokens, block_m, True, segments)

    def forward(self, q, k, v, k_cache, v_cache, meta: TritonMetadata, scale: float) -> torch.Tensor:
        from jobrunner.attention.triton_kernels import paged_attention_kernel

        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        k_scales, v_scales = _scales(k_cache, v_cache)
        q = q.contiguous()  # the kernel assumes unit stride along head_dim (a no-op after rotary)
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        alloc = torch.empty if meta.covers_all_tokens else torch.zeros
        out = alloc(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
        dot_fp32 = q.dtype == torch.float32 or _interpreted()
        if meta.num_segments:
            split_decode_attention(q, k_cache, v_cache, out, meta, self.n_rep, meta.block_m, self.block_n,
                                   self.block_size, self.segment_keys, scale, dot_fp32)
            return out
        grid = (meta.tile_row.shape[0], num_kv_heads)
        paged_attention_kernel[grid](
            q, k_cache, v_cache, out, k_scales, v_scales,
            meta.query_start, meta.seq_lens, meta.table_rows, meta.block_table, meta.tile_row, meta.tile_start,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
            v_cache.stride(1), out.stride(0), meta.block_table.stride(0), k_scales.stride(0), k_scales.stride(1),
            scale,
            N_REP=self.n_rep, HEAD_DIM=head_dim, BLOCK_D=max(16, _next_pow2(head_dim)), BLOCK_M=meta.block_m,
            BLOCK_N=self.block_n, TOKENS_PER_TILE=self.tokens_per_tile(meta.block_m),
            BLOCK_SIZE=self.block_size, DOT_FP32=dot_fp32, KV_SCALED=is_fp8(k_cache.dtype),
        )
        return out


def _scales(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-row scales of fp8 caches (``[slots, Hkv, 1]`` float32 views; K and V laid out alike), else the
    caches themselves as placeholders the kernel never reads."""
    if not is_fp8(k_cache.dtype):
        return k_cache, v_cache
    k_scales, v_scales = scales_of(k_cache), scales_of(v_cache)
    if k_scales.stride() != v_scales.stride():
        raise ValueError("triton attention: the K and V caches of an fp8 layer must be laid out alike")
    return k_scales, v_scales


def _interpreted() -> bool:
    # Triton's CPU interpreter multiplies bfloat16 tiles wrongly (raw bits); it gets float32 products instead
    return os.environ.get("TRITON_INTERPRET") == "1"


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
