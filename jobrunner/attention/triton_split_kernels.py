"""Triton kernels: split-K (segmented) decode attention over the paged KV cache, and the merge of its segments.

:func:`~jobrunner.attention.triton_kernels.paged_attention_kernel` gives each (tile, KV head) one program
that streams all of a row's keys. In a decode-only step with few rows (or few rows per KV head of the GPU's
multiprocessors) and long contexts that grid is too small to keep a GPU busy: each program walks thousands of
keys alone. Here a decode row's keys ``0 .. seq_len - 1`` are cut into *segments* of ``SEGMENT`` keys (a
fixed multiple of the block size and of ``BLOCK_N``), and the grid is ``(rows, num_kv_heads, segments)``:

* :func:`split_decode_kernel`: one program per (row, KV head, segment) runs FlashAttention's online softmax
  over its segment's keys for the ``N_REP`` query heads that share the KV head (grouped-query attention folded
  into the tile's rows, as in the main kernel) and writes the *partial* state per query head: the running
  maximum ``m`` (of the scores times ``scale * log2(e)``: base-2 exponents throughout), the sum of
  exponentials ``l`` and the unnormalised output ``acc`` (float32).
* :func:`merge_segments_kernel`: one program per (row, query head) combines its segments by log-sum-exp:
  ``M = max_s m_s``, ``w_s = 2^(m_s - M)``, ``out = sum_s w_s acc_s / sum_s w_s l_s``.

The grid's segment count is fixed by the host (for a CUDA graph: the most segments any row can have); a
program whose segment starts at or past its row's ``seq_len`` returns at once, and so does every program of a
padding row (``seq_len`` 0), so one captured grid serves any mix of lengths. Partials: ``m``, ``l``
``[rows, num_heads, segments]`` and ``acc`` ``[rows, num_heads, segments, head_dim]``, contiguous. An fp8 cache
(``KV_SCALED``) is read as in the main kernel: codes upcast in registers, row scales on scores and weights.
"""

from __future__ import annotations

import triton
import triton.language as tl

from jobrunner.attention.triton_kernels import attend_key_range


@triton.jit
def split_decode_kernel(
    q_ptr, k_ptr, v_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,   # q: [T, H, D]; k/v cache: [slots, Hkv, D (+4)]
    ks_ptr, vs_ptr,                              # fp8 cache: per-row float32 scales [slots, Hkv] (else unused)
    query_start_ptr, seq_len_ptr, table_row_ptr, block_table_ptr,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt, stride_ss, stride_sh,
    num_heads, num_segments, scale,
    N_REP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SEGMENT: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_FP32: tl.constexpr,
    KV_SCALED: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq_len = tl.load(seq_len_ptr + row).to(tl.int32)
    seg_start = segment * SEGMENT
    if seg_start >= seq_len:  # a padding row (seq_len 0), or past this row's keys
        return
    seg_end = tl.minimum(seg_start + SEGMENT, seq_len)   # a decode sees every key before it: no causal mask
    token = tl.load(query_start_ptr + row)               # the row's one query token (decode-only steps)
    table = block_table_ptr + tl.load(table_row_ptr + row) * stride_bt

    m = tl.arange(0, BLOCK_M)                            # query heads of this KV head (rows past N_REP: padding)
    head = kv_head * N_REP + m
    m_ok = m < N_REP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + token * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    qk_scale = scale * 1.4426950408889634                # exp(x) = exp2(x * log2(e))
    # the segment is not empty, so its first key is real; a decode sees every key before it (not causal)
    m_i, l_i, acc = attend_key_range(q, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr, table, kv_head, seg_start,
                                     seg_end, m, d, d_ok, stride_ks, stride_kh, stride_vs, stride_vh, stride_ss,
                                     stride_sh, qk_scale, BLOCK_N, BLOCK_SIZE, False, DOT_FP32, KV_SCALED)
    part = (row * num_heads + head) * num_segments + segment    # [BLOCK_M] index into m / l
    tl.store(part_m_ptr + part, m_i, mask=m_ok)
    tl.store(part_l_ptr + part, l_i, mask=m_ok)
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=m_ok[:, None] & d_ok[None, :])


@triton.jit
def merge_segments_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, o_ptr,                # o: [T, H * D]
    query_start_ptr, seq_len_ptr, stride_ot, num_heads, num_segments,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SEGMENT: tl.constexpr, BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_len_ptr + row).to(tl.int32)
    if seq_len == 0:  # a padding row
        return
    s = tl.arange(0, BLOCK_S)
    s_ok = s < (seq_len + SEGMENT - 1) // SEGMENT        # the segments this row wrote
    part = (row * num_heads + head) * num_segments + s
    m_s = tl.load(part_m_ptr + part, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_l_ptr + part, mask=s_ok, other=0.0)
    weight = tl.exp2(m_s - tl.max(m_s, 0))               # 0 for segments the row does not have
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                  other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l_s * weight, 0)
    token = tl.load(query_start_ptr + row)
    tl.store(o_ptr + token * stride_ot + head * HEAD_DIM + d, out.to(o_ptr.dtype.element_ty), mask=d_ok)
