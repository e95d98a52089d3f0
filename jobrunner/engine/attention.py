"""Attention over the paged KV cache, in plain torch (CPU and CUDA).

The KV cache of one layer is a flat tensor of slots ``[num_blocks * block_size, num_kv_heads, head_dim]``; a
request's block table maps its token positions to slots. Each step the model runner groups the scheduled
requests: every request that computes several tokens (a prompt chunk) forms its own group; single-token
decodes are sorted by context length and packed into groups of similar length. For one group we gather its
keys/values block by block (whole blocks are long contiguous rows, so the copy runs at memory speed) into a
padded ``[G, num_blocks * block_size]`` layout and call ``scaled_dot_product_attention`` once with a boolean
mask (causal within the chunk, nothing past each request's context). Grouped-query attention is folded into
the query-length axis — queries ``[G, kv_heads, n_rep * Q, D]`` against keys ``[G, kv_heads, L, D]`` — so
keys and values are never repeated per query head. All indices and masks are built once per step (they are
the same for every layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionGroup:
    num_seqs: int                     # G
    query_len: int                    # Q (padded)
    kv_len: int                       # L (padded to whole blocks)
    query_index: torch.Tensor         # [G * Q] flat token index of each query row
    block_ids: torch.Tensor           # [G * L / block_size] cache block of each (padded) key block
    mask: torch.Tensor | None         # [G, 1, n_rep * Q, L] bool, True = attend; None = see ``causal``
    out_index: torch.Tensor           # [G * Q] flat token index to write each output row to
    causal: bool = False              # a chunk starting at position 0: plain causal attention, no mask


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor        # [T] cache slot that each new token's K/V is written to
    groups: list[AttentionGroup]
    num_tokens: int
    block_size: int


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write this step's K/V into the cache and attend. q: [T, H, D]; k, v: [T, Hkv, D] → [T, H * D]."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    n_rep = num_heads // num_kv_heads
    k_blocks = k_cache.view(-1, meta.block_size * num_kv_heads * head_dim)  # [num_blocks, block bytes]
    v_blocks = v_cache.view(-1, meta.block_size * num_kv_heads * head_dim)
    out = q.new_empty(meta.num_tokens, num_heads * head_dim)
    for g in meta.groups:
        rows = _attend_group(q, k_blocks, v_blocks, g, num_kv_heads, n_rep, head_dim, scale)
        out.index_copy_(0, g.out_index, rows)
    return out


def _attend_group(q, k_blocks, v_blocks, g: AttentionGroup, num_kv_heads: int, n_rep: int, head_dim: int,
                  scale: float) -> torch.Tensor:
    G, Q, L = g.num_seqs, g.query_len, g.kv_len
    if g.causal:
        return _attend_causal(q, k_blocks, v_blocks, g, num_kv_heads, head_dim, scale)
    # q: [G*Q, H, D] -> [G, Hkv, n_rep*Q, D] (query head h uses kv head h // n_rep)
    qg = q.index_select(0, g.query_index).view(G, Q, num_kv_heads, n_rep, head_dim)
    qg = qg.permute(0, 2, 3, 1, 4).reshape(G, num_kv_heads, n_rep * Q, head_dim)
    kg = k_blocks.index_select(0, g.block_ids).view(G, L, num_kv_heads, head_dim).transpose(1, 2)
    vg = v_blocks.index_select(0, g.block_ids).view(G, L, num_kv_heads, head_dim).transpose(1, 2)
    og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale)
    # [G, Hkv, n_rep*Q, D] -> [G*Q, H*D]
    og = og.view(G, num_kv_heads, n_rep, Q, head_dim).permute(0, 3, 1, 2, 4)
    return og.reshape(G * Q, num_kv_heads * n_rep * head_dim)


def _attend_causal(q, k_blocks, v_blocks, g: AttentionGroup, num_kv_heads: int, head_dim: int,
                   scale: float) -> torch.Tensor:
    # A whole prompt (or its first chunk) of one request: the causal kernel skips the upper triangle, which
    # an explicit mask cannot. Padded keys past the chunk sit right of every query, so causality hides them.
    Q, L = g.query_len, g.kv_len
    # index_select, not narrow(int(query_index[0])): reading the offset back would sync the device every layer
    qg = q.index_select(0, g.query_index).transpose(0, 1).unsqueeze(0)                # [1, H, Q, D]
    kg = k_blocks.index_select(0, g.block_ids).view(1, L, num_kv_heads, head_dim).transpose(1, 2)
    vg = v_blocks.index_select(0, g.block_ids).view(1, L, num_kv_heads, head_dim).transpose(1, 2)
    og = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale, enable_gqa=True)
    return og.squeeze(0).transpose(0, 1).reshape(Q, -1)                                  # [Q, H*D]
