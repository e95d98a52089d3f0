"""When and how the triton backend runs a decode-only step split-K (:mod:`.triton_split_kernels`).

The rule (:func:`use_split_decode`), for a decode-only step in ``auto`` mode: split when the unsplit grid,
``rows x num_kv_heads`` programs, is smaller than ``target_programs`` (twice the GPU's multiprocessors: below
that, multiprocessors idle while each program walks its row's keys alone) **and** the longest row has more
than one segment of keys (else splitting adds a merge and changes nothing). ``on`` splits every decode-only
step (tests, the GPU A/B), ``off`` never (the default until a GPU check has passed). Steps with a prompt chunk
or draft tokens never split.

A segment is :data:`SEGMENT_KEYS` keys, rounded up to a multiple of the block size and of the kernel's
``BLOCK_N``, and doubled until ``max_model_len`` needs at most :data:`MAX_SEGMENTS` of them (bounding the
partials and the fixed grid of a CUDA graph).
"""

from __future__ import annotations

import math

import torch

SPLIT_MODES = ("off", "auto", "on")
SEGMENT_KEYS = 512          # keys per segment (before rounding): 8 inner iterations of 64 keys
MAX_SEGMENTS = 64           # segments of the longest possible row, at most
DEFAULT_TARGET_PROGRAMS = 256   # without a GPU to ask (the interpreter): about an H100's 2 x 132


def use_split_decode(num_rows: int, num_kv_heads: int, max_seq_len: int, segment_keys: int,
                     target_programs: int) -> bool:
    """Whether a decode-only step of ``num_rows`` rows (longest ``max_seq_len`` keys) should split: its unsplit
    grid has fewer than ``target_programs`` programs and some row spans more than one segment."""
    return num_rows * num_kv_heads < target_programs and max_seq_len > segment_keys


def segment_keys_for(block_size: int, block_n: int, max_model_len: int) -> int:
    """The fixed segment length: :data:`SEGMENT_KEYS` rounded up to a multiple of both ``block_size`` and
    ``block_n``, doubled until ``max_model_len`` keys fill at most :data:`MAX_SEGMENTS` segments."""
    unit = math.lcm(block_size, block_n)
    keys = -(-SEGMENT_KEYS // unit) * unit
    while -(-max_model_len // keys) > MAX_SEGMENTS:
        keys *= 2
    return keys


def target_programs(device: torch.device) -> int:
    """Twice the multiprocessors of a CUDA ``device``; :data:`DEFAULT_TARGET_PROGRAMS` elsewhere."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_TARGET_PROGRAMS


def check_split_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`SPLIT_MODES`, else a ValueError naming the setting."""
    if mode not in SPLIT_MODES:
        raise ValueError(f"split_decode must be one of {'|'.join(SPLIT_MODES)}, got {mode!r}")
    return mode


def split_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                           meta, n_rep: int, block_m: int, block_n: int, block_size: int, segment_keys: int,
                           scale: float, dot_fp32: bool) -> None:
    """Attention of a decode-only step, split-K, into ``out`` ``[T, H * D]``: the segment kernel over a
    ``(rows, kv heads, meta.num_segments)`` grid, then the merge over ``(rows, heads)``. ``meta``: the step's
    :class:`~jobrunner.attention.triton_backend.TritonMetadata`."""
    from jobrunner.attention.kv_quant import is_fp8, scales_of
    from jobrunner.attention.triton_split_kernels import merge_segments_kernel, split_decode_kernel

    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    rows, segments = meta.seq_lens.shape[0], meta.num_segments
    part_m = torch.empty(rows, num_heads, segments, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(rows, num_heads, segments, head_dim, dtype=torch.float32, device=q.device)
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    fp8 = is_fp8(k_cache.dtype)  # per-row scales beside the codes (kv_quant); else placeholders never read
    k_scales, v_scales = (scales_of(k_cache), scales_of(v_cache)) if fp8 else (k_cache, v_cache)
    split_decode_kernel[(rows, num_kv_heads, segments)](
        q, k_cache, v_cache, part_m, part_l, part_acc, k_scales, v_scales,
        meta.query_start, meta.seq_lens, meta.table_rows, meta.block_table,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        meta.block_table.stride(0), k_scales.stride(0), k_scales.stride(1), num_heads, segments, scale,
        N_REP=n_rep, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, SEGMENT=segment_keys,
        BLOCK_SIZE=block_size, DOT_FP32=dot_fp32, KV_SCALED=fp8,
    )
    merge_segments_kernel[(rows, num_heads)](
        part_m, part_l, part_acc, out, meta.query_start, meta.seq_lens, out.stride(0), num_heads, segments,
        HEAD_DIM=head_dim, BLOCK_D=block_d, SEGMENT=segment_keys, BLOCK_S=max(2, 1 << (segments - 1).bit_length()),
    )
