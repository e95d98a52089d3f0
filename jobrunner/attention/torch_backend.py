"""The ``torch`` backend: paged attention in plain torch (CPU, and CUDA when Triton is not chosen).

For each group of rows we gather its keys/values block by block (whole blocks are long contiguous rows, so
the copy runs at memory speed) into a padded ``[G, num_blocks * block_size]`` layout and call
``scaled_dot_product_attention`` once. Every prompt chunk is its own group; single-token rows are sorted by
context length and packed into groups of similar length. A chunk starting at position 0 uses the causal
kernel with no mask; other groups get a boolean mask, built on the device from a few small index vectors
(with a sliding window, the mask also hides keys more than ``sliding_window - 1`` positions back).
Grouped-query attention is folded into the query-length axis — queries ``[G, kv_heads, n_rep * Q, D]``
against keys ``[G, kv_heads, L, D]`` — so keys and values are never repeated per query head.

Per-layer windows (``StepLayout.layer_windows``, Gemma 2/3): the groups' index arrays are uploaded once and
one set of groups (their masks) is built per distinct window; each layer takes its window's view. Attention
logit soft-capping (``softcap``, Gemma 2) cannot go through ``scaled_dot_product_attention``: those calls
compute scores, cap, mask and softmax (in float32, then back to the query dtype, as transformers' eager
attention does) explicitly.

An fp8 KV cache (``engine.kv_cache_dtype``): each group gathers its blocks' bytes (codes and per-row scales) and
dequantizes them into the query dtype before SDPA (:class:`~jobrunner.attention.kv_quant.BlockReader`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from jobrunner.attention.base import AttentionBackend, AttentionMetadata, StepLayout, layer_views, write_kv
from jobrunner.attention.kv_quant import BlockReader
from jobrunner.attention.torch_short_rows import is_short_row, short_row_index, short_row_mask
from jobrunner.attention.upload import StepUpload

MAX_DECODE_GROUP = 32     # decodes of similar context length attended together in one padded call
MAX_PADDING_WASTE = 0.5   # start a new group rather than pad the keys gathered by more than this share


@dataclass
class AttentionGroup:
    num_seqs: int                     # G
    query_len: int                    # Q (padded)
    kv_len: int                       # L (padded to whole blocks)
    query_index: torch.Tensor         # [G * Q] flat token index of each query row
    block_ids: torch.Tensor           # [G * L / block_size] cache block of each (padded) key block
    mask: torch.Tensor | None         # [G, 1, n_rep * Q or 1, L] bool, True = attend; None = see ``causal``
    out_index: torch.Tensor           # [G * Q] flat token index to write each output row to
    causal: bool = False              # a chunk starting at position 0: plain causal attention, no mask
    repeat_mask: bool = False         # mask is [Q, L]-shaped: repeat it n_rep times along the query axis
    tile_mask: bool = False           # mask is [G, 1, Q, L]: tile it n_rep times along the query axis
    prefix_len: int = 0               # a chunk after a cached prefix (CPU): keys before it, seen by every query


class TorchMetadata(AttentionMetadata):
    """The groups of one step (their indices and masks are shared by every layer)."""

    def __init__(self, slot_mapping: torch.Tensor, groups: list[AttentionGroup], num_tokens: int,
                 block_size: int) -> None:
        self.backend = TORCH_BACKEND
        self.slot_mapping = slot_mapping
        self.groups = groups
        self.num_tokens = num_tokens
        self.block_size = block_size


class TorchBackend(AttentionBackend):
    """Gather + ``scaled_dot_product_attention``; runs anywhere torch does."""

    name = "torch"
    supports_layer_windows = True
    supports_softcap = True

    def build(self, layout: StepLayout, upload: StepUpload) -> TorchMetadata:
        # Queue every group's small integer arrays in the step's single upload, then build the groups from
        # the device views (masks and ranges are computed on the device, never on the host), once per window.
        plan = self._queue(layout, upload)
        t = upload.flush()
        by_window = {w: TorchMetadata(t["slot_mapping"], self._groups(plan, t, layout, upload.device, w),
                                      layout.num_tokens, layout.block_size) for w in layout.windows}
        meta = by_window[layout.windows[0]]
        meta.layer_views = layer_views(layout, by_window)
        return meta

    def _queue(self, layout: StepLayout, upload: StepUpload) -> tuple[list, list, list]:
        """Sort the rows into chunk, decode and short-row groups and queue their arrays in ``upload``."""
        chunks, decodes, short = [], [], {}
        for start, q_len, seq_len, table in zip(layout.query_starts, layout.query_lens, layout.seq_lens,
                                                layout.block_tables):
            if q_len == 1:
                decodes.append((seq_len, start, table))
            elif is_short_row(q_len, seq_len, layout.smallest_window):
                short.setdefault(q_len, []).append((seq_len, start, table))
            else:
                chunks.append((start, q_len, seq_len))
                num_blocks = -(-seq_len // layout.block_size)
                upload.add(f"chunk{len(chunks)}", _padded_table(table, num_blocks))
        packed = list(_pack_by_length(decodes, layout.block_size))
        for i, group in enumerate(packed):
            num_blocks = -(-group[-1][0] // layout.block_size)
            upload.add(f"dec{i}_len", [d[0] for d in group])
            upload.add(f"dec{i}_index", [d[1] for d in group])
            upload.add(f"dec{i}_blocks", [b for d in group for b in _padded_table(d[2], num_blocks)])
        packed_short = [(q_len, group) for q_len, rows in short.items()
                        for group in _pack_by_length(rows, layout.block_size)]
        for i, (_, group) in enumerate(packed_short):
            num_blocks = -(-group[-1][0] // layout.block_size)
            upload.add(f"short{i}_len", [d[0] for d in group])
            upload.add(f"short{i}_offset", [d[1] for d in group])
            upload.add(f"short{i}_blocks", [b for d in group for b in _padded_table(d[2], num_blocks)])
        return chunks, packed, packed_short

    @staticmethod
    def _groups(plan: tuple[list, list, list], t: dict[str, torch.Tensor], layout: StepLayout,
                device: torch.device, window: int | None) -> list[AttentionGroup]:
        """The step's groups for layers with ``window``, from the uploaded arrays ``t``."""
        chunks, packed, packed_short = plan
        bs = layout.block_size
        groups = [_chunk_group(offset, q_len, seq_len, t[f"chunk{i + 1}"], bs, device, window)
                  for i, (offset, q_len, seq_len) in enumerate(chunks)]
        for i, group in enumerate(packed):
            groups.append(_decode_group(len(group), -(-group[-1][0] // bs) * bs, t[f"dec{i}_len"],
                                        t[f"dec{i}_index"], t[f"dec{i}_blocks"], device, window))
        for i, (q_len, group) in enumerate(packed_short):
            kv_len = -(-group[-1][0] // bs) * bs
            index = short_row_index(t[f"short{i}_offset"], q_len)
            groups.append(AttentionGroup(len(group), q_len, kv_len, index, t[f"short{i}_blocks"],
                                         short_row_mask(t[f"short{i}_len"], q_len, kv_len), index, tile_mask=True))
        return groups

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchMetadata, scale: float,
                softcap: float | None = None) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = q.new_empty(meta.num_tokens, q.shape[1] * q.shape[2])
        attend_groups(q, k_cache, v_cache, out, meta.groups, meta.block_size, scale, softcap)
        return out


TORCH_BACKEND = TorchBackend()


def attend_groups(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                  groups: list[AttentionGroup], block_size: int, scale: float, softcap: float | None = None) -> None:
    """Attend every group and write its rows into ``out`` ``[T, H * D]`` (rows of no group are left alone)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    n_rep = num_heads // num_kv_heads
    k_blocks = BlockReader(k_cache, block_size)  # whole blocks, dequantized as gathered where the cache is fp8
    v_blocks = BlockReader(v_cache, block_size)
    for g in groups:
        out.index_copy_(0, g.out_index, _attend_group(q, k_blocks, v_blocks, g, num_kv_heads, n_rep, head_dim, scale,
                                                      softcap))


def _padded_table(table: list[int], num_blocks: int) -> list[int]:
    table = table[:num_blocks]
    return table + [0] * (num_blocks - len(table))  # padding blocks are masked out


def _chunk_group(offset: int, q_len: int, seq_len: int, blocks: torch.Tensor, block_size: int,
                 device: torch.device, window: int | None = None) -> AttentionGroup:
    # One request computing Q tokens at positions start..start+Q-1, attending to keys 0..start+Q-1
    # (with a window w: keys row-w+1..row of each query row).
    start = seq_len - q_len
    padded_len = blocks.numel() * block_size
    index = torch.arange(offset, offset + q_len, device=device)
    if start == 0 and (window is None or seq_len <= window):
        return AttentionGroup(1, q_len, padded_len, index, blocks, None, index, causal=True)
    if device.type == "cpu" and (window is None or seq_len <= window):
        return AttentionGroup(1, q_len, padded_len, index, blocks, None, index, prefix_len=start)
    rows = torch.arange(start, seq_len, device=device)[:, None]
    keys = torch.arange(padded_len, device=device)[None, :]
    mask = keys <= rows      # [Q, L] causal with offset
    if window is not None:
        mask &= keys > rows - window
    return AttentionGroup(1, q_len, padded_len, index, blocks, mask, index, repeat_mask=True)


def _decode_group(num_seqs: int, kv_len: int, lengths: torch.Tensor, index: torch.Tensor, blocks: torch.Tensor,
                  device: torch.device, window: int | None = None) -> AttentionGroup:
    keys = torch.arange(kv_len, device=device)[None, :]
    mask = keys < lengths[:, None]    # [G, L]; the query sits at position length - 1
    if window is not None:
        mask &= keys >= lengths[:, None] - window
    return AttentionGroup(num_seqs, 1, kv_len, index, blocks, mask[:, None, None, :], index)


def _pack_by_length(decodes: list[tuple[int, int, list[int]]], block_size: int):
    """Sort decodes by context length and cut them into groups whose padding stays small.

    Every member of a group is padded to the group's longest context, so one long request in a group of
    short ones would multiply the keys gathered; a group closes when padding would pass MAX_PADDING_WASTE.
    """
    decodes = sorted(decodes, key=lambda d: d[0])
    group: list = []
    total = 0
    for d in decodes:
        padded = len(group) + 1
        blocks = -(-d[0] // block_size) * block_size
        if group and (padded > MAX_DECODE_GROUP or padded * blocks > (1 + MAX_PADDING_WASTE) * (total + d[0])):
            yield group
            group, total = [], 0
        group.append(d)
        total += d[0]
    if group:
        yield group


def _attend_group(q, k_blocks, v_blocks, g: AttentionGroup, num_kv_heads: int, n_rep: int, head_dim: int,
                  scale: float, softcap: float | None = None) -> torch.Tensor:
    G, Q, L = g.num_seqs, g.query_len, g.kv_len
    if g.causal:
        return _attend_causal(q, k_blocks, v_blocks, g, num_kv_heads, head_dim, scale, softcap)
    if g.prefix_len:
        if softcap is None:
            return _attend_after_prefix(q, k_blocks, v_blocks, g, num_kv_heads, n_rep, head_dim, scale)
        if g.mask is None:  # soft-capping needs the scores: the causal-with-offset mask, built once per step
            g.mask, g.repeat_mask = _offset_causal_mask(g.prefix_len, Q, L, q.device), True
    # q: [G*Q, H, D] -> [G, Hkv, n_rep*Q, D] (query head h uses kv head h // n_rep)
    qg = q.index_select(0, g.query_index).view(G, Q, num_kv_heads, n_rep, head_dim)
    qg = qg.permute(0, 2, 3, 1, 4).reshape(G, num_kv_heads, n_rep * Q, head_dim)
    kg = k_blocks.gather(g.block_ids, q.dtype).view(G, L, num_kv_heads, head_dim).transpose(1, 2)
    vg = v_blocks.gather(g.block_ids, q.dtype).view(G, L, num_kv_heads, head_dim).transpose(1, 2)
    if g.repeat_mask:  # once per step, not per layer: the group is shared by every layer
        g.mask, g.repeat_mask = g.mask.repeat(n_rep, 1)[None, None], False
    if g.tile_mask:
        g.mask, g.tile_mask = g.mask.repeat(1, 1, n_rep, 1), False
    if softcap is None:
        og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale)
    else:
        og = softcapped_attention(qg, kg, vg, g.mask, scale, softcap)
    # [G, Hkv, n_rep*Q, D] -> [G*Q, H*D]
    og = og.view(G, num_kv_heads, n_rep, Q, head_dim).permute(0, 3, 1, 2, 4)
    return og.reshape(G * Q, num_kv_heads * n_rep * head_dim)


def _offset_causal_mask(start: int, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """``[Q, L]``: query i (at position start + i) sees keys 0 .. start + i."""
    rows = torch.arange(start, start + q_len, device=device)[:, None]
    return torch.arange(kv_len, device=device)[None, :] <= rows


def _attend_after_prefix(q, k_blocks, v_blocks, g: AttentionGroup, num_kv_heads: int, n_rep: int,
                         head_dim: int, scale: float) -> torch.Tensor:
    """A prompt chunk after ``g.prefix_len`` cached keys, as two mask-free flash-attention calls merged by
    their log-sum-exps: every query against the whole prefix (no mask: the kernel runs dense tiles; grouped-
    query attention folded into the query axis), and the chunk against its own keys (causal: the kernel skips
    the upper triangle). One call with a causal-with-offset mask cost 1.4x the two on a 2-core Xeon with AMX
    (bf16, 240 queries after 1,040 cached keys, 9 / 3 heads of 64): a mask is read per score and no tile is
    skipped. The merge is in float32; each part's output is rounded to the query dtype once before it."""
    Q, P, H = g.query_len, g.prefix_len, num_kv_heads * n_rep
    kg = k_blocks.gather(g.block_ids, q.dtype).view(1, -1, num_kv_heads, head_dim)[:, :P + Q].transpose(1, 2)
    vg = v_blocks.gather(g.block_ids, q.dtype).view(1, -1, num_kv_heads, head_dim)[:, :P + Q].transpose(1, 2)
    rows = q.index_select(0, g.query_index)                                                   # [Q, H, D]
    q_fold = rows.view(Q, num_kv_heads, n_rep, head_dim).permute(1, 2, 0, 3).reshape(1, num_kv_heads, n_rep * Q,
                                                                                        head_dim)
    out_a, lse_a = _FLASH_CPU(q_fold, kg[:, :, :P], vg[:, :, :P], 0.0, False, scale=scale)
    own_k = kg[:, :, P:].repeat_interleave(n_rep, dim=1)                                       # [1, H, Q, D]
    own_v = vg[:, :, P:].repeat_interleave(n_rep, dim=1)
    out_b, lse_b = _FLASH_CPU(rows.transpose(0, 1).unsqueeze(0), own_k, own_v, 0.0, True, scale=scale)
    # both as [H, Q, ...] (head h = kv head * n_rep + r)
    out_a, lse_a = out_a.reshape(H, Q, head_dim), lse_a.reshape(H, Q)
    out_b, lse_b = out_b.reshape(H, Q, head_dim), lse_b.reshape(H, Q)
    top = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    merged = (out_a.float() * w_a[..., None] + out_b.float() * w_b[..., None]) / (w_a + w_b)[..., None]
    return merged.to(q.dtype).transpose(0, 1).reshape(Q, H * head_dim)


# torch's CPU flash attention with its log-sum-exp ([B, H, Q] float32): (out, lse)
_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _attend_causal(q, k_blocks, v_blocks, g: AttentionGroup, num_kv_heads: int, head_dim: int,
                   scale: float, softcap: float | None = None) -> torch.Tensor:
    # A whole prompt (or its first chunk) of one request: the causal kernel skips the upper triangle, which
    # an explicit mask cannot. The gathered whole blocks are cut to the chunk's own Q keys, so the call is
    # square (Q x Q): CUDA's flash kernel takes is_causal only when the query and key lengths are equal, and
    # would otherwise leave the call to a slower kernel; the padded keys were masked anyway.
    Q, L = g.query_len, g.kv_len
    # index_select, not narrow(int(query_index[0])): reading the offset back would sync the device every layer
    qg = q.index_select(0, g.query_index).transpose(0, 1).unsqueeze(0)                # [1, H, Q, D]
    kg = k_blocks.gather(g.block_ids, q.dtype).view(1, L, num_kv_heads, head_dim)[:, :Q].transpose(1, 2)
    vg = v_blocks.gather(g.block_ids, q.dtype).view(1, L, num_kv_heads, head_dim)[:, :Q].transpose(1, 2)
    if softcap is None:
        og = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale, enable_gqa=True)
    else:  # query i sees keys 0..i
        n_rep = qg.shape[1] // num_kv_heads
        causal = torch.arange(Q, device=q.device)[None, :] <= torch.arange(Q, device=q.device)[:, None]
        og = softcapped_attention(qg, kg.repeat_interleave(n_rep, dim=1), vg.repeat_interleave(n_rep, dim=1),
                                  causal, scale, softcap)
    return og.squeeze(0).transpose(0, 1).reshape(Q, -1)                                  # [Q, H*D]


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                         softcap: float) -> torch.Tensor:
    """Attention with logit soft-capping, in transformers' eager order: ``scores * scale``, then
    ``softcap * tanh(scores / softcap)``, then the mask, a float32 softmax cast back to the query dtype, then V.
    q: [..., Q, D]; k, v: [..., L, D]; mask: bool, broadcastable to [..., Q, L], True = attend."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)
