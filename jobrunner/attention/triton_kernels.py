"""Triton kernel: attention of a whole step straight from the paged KV cache.

One launch per layer covers every row of the step: prompt chunks (with or without a cached prefix) and
single-token decodes alike. The grid is ``(num_tiles, num_kv_heads)``. A *tile* is up to
``TOKENS_PER_TILE`` consecutive query tokens of one row; the host lists the tiles of a step
(``tile_row``, ``tile_start``), padding the list with ``-1`` rows that return at once (so a CUDA graph can
replay a fixed grid). A program takes its tile's tokens times the ``N_REP`` query heads that share one KV
head (grouped-query attention folded into the row axis: ``BLOCK_M = TOKENS_PER_TILE * N_REP`` rows, keys
loaded once for all of them) and streams that row's keys ``BLOCK_N`` at a time through its block table,
with the online softmax of FlashAttention. Block tables are rows of a persistent device table
(``table_row[row]`` says which one; see :mod:`jobrunner.attention.block_tables`). Causality is a comparison
of positions; nothing is gathered into a copy and no mask tensor exists. Keys past a tile's last query
position are never loaded.

An fp8 cache (``KV_SCALED``; :mod:`jobrunner.attention.kv_quant`): keys and values are loaded as fp8 codes and
upcast in registers to the query dtype (exact: every e4m3 / e5m2 value is a bf16 and an fp16 value); each key's
scale multiplies its score column after ``q . k``, and each value's scale its probability column before
``p . v``, so no dequantized tile is ever formed.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,                  # q: [T, H, D]; k/v cache: [slots, Hkv, D (+4)]; o: [T, H * D]
    ks_ptr, vs_ptr,                              # fp8 cache: per-row float32 scales [slots, Hkv] (else unused)
    query_start_ptr, seq_len_ptr, table_row_ptr, block_table_ptr, tile_row_ptr, tile_start_ptr,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_bt,
    stride_ss, stride_sh,                        # the scales' slot and head strides (in floats; K's = V's)
    scale,
    N_REP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, TOKENS_PER_TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    DOT_FP32: tl.constexpr,                      # products in float32 (float32 caches; Triton's interpreter)
    KV_SCALED: tl.constexpr,                     # fp8 codes with per-row scales
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.load(tile_row_ptr + tile)
    if row < 0:  # padding tile of a fixed-size grid
        return
    # the host sends int64; positions and token offsets fit int32 (loop bounds and index math stay 32-bit)
    first = tl.load(tile_start_ptr + tile).to(tl.int32)    # first query token of the tile, within the row
    q_begin = tl.load(query_start_ptr + row).to(tl.int32)
    q_len = tl.load(query_start_ptr + row + 1).to(tl.int32) - q_begin
    seq_len = tl.load(seq_len_ptr + row).to(tl.int32)
    table = block_table_ptr + tl.load(table_row_ptr + row) * stride_bt   # the row's block ids
    prefix = seq_len - q_len                               # keys that were in the cache before this step

    m = tl.arange(0, BLOCK_M)
    token = first + m // N_REP                             # query token of each row of the tile
    head = kv_head * N_REP + m % N_REP
    m_ok = (m < TOKENS_PER_TILE * N_REP) & (token < q_len)
    position = prefix + token
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + (q_begin + token)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    last_token = tl.minimum(first + TOKENS_PER_TILE, q_len) - 1
    kv_end = prefix + last_token + 1                       # keys 0 .. kv_end - 1 are visible to the tile
    qk_scale = scale * 1.4426950408889634                  # exp(x) = exp2(x * log2(e))
    # every row sees key 0 in the first block, so the running maximum is finite from the first block on
    m_i, l_i, acc = attend_key_range(q, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr, table, kv_head, 0, kv_end,
                                     position, d, d_ok, stride_ks, stride_kh, stride_vs, stride_vh, stride_ss,
                                     stride_sh, qk_scale, BLOCK_N, BLOCK_SIZE, True, DOT_FP32, KV_SCALED)
    acc = acc / l_i[:, None]
    out = o_ptr + (q_begin + token)[:, None] * stride_ot + head[:, None] * HEAD_DIM + d[None, :]
    tl.store(out, acc.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


@triton.jit
def attend_key_range(q, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr, table, kv_head, key_lo, key_hi, position,
                     d, d_ok, stride_ks, stride_kh, stride_vs, stride_vh, stride_ss, stride_sh, qk_scale,
                     BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
                     DOT_FP32: tl.constexpr, KV_SCALED: tl.constexpr):
    """FlashAttention's online softmax of the tile's query rows ``q`` over keys ``key_lo .. key_hi - 1`` of one
    row (its block ids at ``table``), ``BLOCK_N`` at a time: returns the updated running maximum ``m_i`` (base-2
    exponents), sum ``l_i`` and unnormalised output ``acc``. ``CAUSAL``: a query row sees keys up to its
    ``position``. The first block must hold a key every row sees (key 0 / a segment's first key), so the
    maximum is finite from then on. Shared by the main kernel and the split-K decode kernel."""
    for start in range(key_lo, key_hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < key_hi
        block = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:  # exact float32 (no TF32 rounding); also the interpreter, whose bf16 dot is wrong
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        s = s * qk_scale                                   # [BLOCK_M, BLOCK_N]
        if KV_SCALED:                                      # fp8 codes: each key row's scale on its scores
            s = s * tl.load(ks_ptr + slot * stride_ss + kv_head * stride_sh, mask=n_ok, other=0.0)[None, :]
        visible = n_ok[None, :]
        if CAUSAL:
            visible = visible & (n[None, :] <= position[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        pw = p                                             # the weights, times each value row's scale (fp8)
        if KV_SCALED:
            pw = p * tl.load(vs_ptr + slot * stride_ss + kv_head * stride_sh, mask=n_ok, other=0.0)[None, :]
        if DOT_FP32:
            pv = tl.dot(pw, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(pw.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return m_i, l_i, acc
