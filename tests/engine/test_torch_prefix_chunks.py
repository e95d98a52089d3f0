"""Prompt chunks after a cached prefix on the torch backend (CPU): two mask-free flash-attention calls merged by
their log-sum-exps (torch_backend._attend_after_prefix) against attention computed directly in float64."""

from __future__ import annotations

import random

import pytest
import torch

from jobrunner.attention import StepLayout, StepUpload
from jobrunner.attention.torch_backend import TORCH_BACKEND


def _step(rows, block_size, num_kv_heads, head_dim, n_rep, dtype, seed=0):
    """A step of prompt chunks ``rows`` = [(cached prefix, chunk length)], its cache filled at random."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(s + n) // block_size) for s, n in rows) + 4
    free = list(range(num_blocks))
    rng.shuffle(free)
    layout = StepLayout([], [], [], [], 0, block_size)
    slots = []
    for start, q_len in rows:
        table = [free.pop() for _ in range(-(-(start + q_len) // block_size))]
        layout.query_starts.append(layout.num_tokens)
        layout.query_lens.append(q_len)
        layout.seq_lens.append(start + q_len)
        layout.block_tables.append(table)
        layout.num_tokens += q_len
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, start + q_len)]
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    T = layout.num_tokens
    q = torch.randn(T, num_kv_heads * n_rep, head_dim, generator=gen).to(dtype)
    k = torch.randn(T, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(T, num_kv_heads, head_dim, generator=gen).to(dtype)
    return layout, slots, q, k, v, k_cache, v_cache


def _reference(layout, q, k_cache, v_cache, n_rep, scale, softcap=None):
    """Each row's queries against its keys 0 .. own position, in float64, from the (written) cache."""
    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=torch.float64)
    bs = layout.block_size
    for first, q_len, seq_len, table in zip(layout.query_starts, layout.query_lens, layout.seq_lens,
                                            layout.block_tables):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(seq_len)])
        keys = k_cache[slots].double().repeat_interleave(n_rep, dim=1)     # [L, H, D]
        values = v_cache[slots].double().repeat_interleave(n_rep, dim=1)
        rows = q[first:first + q_len].double()                             # [Q, H, D]
        scores = torch.einsum("qhd,lhd->hql", rows, keys) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > pos, float("-inf"))
        attn = torch.einsum("hql,lhd->qhd", scores.softmax(-1), values)
        out[first:first + q_len] = attn.reshape(q_len, -1)
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("n_rep", [1, 3])
def test_chunks_after_a_prefix_match_direct_attention(dtype, tol, n_rep):
    # chunks after prefixes of whole and partial blocks, a chunk from position 0 (the causal path) beside them
    rows = [(40, 24), (17, 33), (0, 20), (128, 64), (5, 9)]
    layout, slots, q, k, v, k_cache, v_cache = _step(rows, 16, 2, 64, n_rep, dtype)
    upload = StepUpload(q.device)
    upload.add("slot_mapping", slots)
    meta = TORCH_BACKEND.build(layout, upload)
    prefixed = [g for g in meta.groups if g.prefix_len]
    # each after-prefix chunk takes the split (the 9-token row is a short row: packed, masked)
    assert sorted(g.prefix_len for g in prefixed) == [17, 40, 128]
    assert all(g.mask is None for g in prefixed)
    scale = 64 ** -0.5
    out = TORCH_BACKEND.forward(q, k, v, k_cache, v_cache, meta, scale)
    assert out.dtype == dtype
    want = _reference(layout, q, k_cache, v_cache, n_rep, scale)
    assert (out.double() - want).abs().max().item() < tol


def test_soft_capped_chunks_after_a_prefix_build_their_mask():
    rows = [(40, 24), (0, 20)]
    layout, slots, q, k, v, k_cache, v_cache = _step(rows, 16, 2, 32, 2, torch.float32, seed=1)
    upload = StepUpload(q.device)
    upload.add("slot_mapping", slots)
    meta = TORCH_BACKEND.build(layout, upload)
    out = TORCH_BACKEND.forward(q, k, v, k_cache, v_cache, meta, 32 ** -0.5, softcap=5.0)
    want = _reference(layout, q, k_cache, v_cache, 2, 32 ** -0.5, softcap=5.0)
    assert (out.double() - want).abs().max().item() < 2e-5
