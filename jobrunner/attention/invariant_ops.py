"""Batch-invariant paged attention in plain torch (``EngineConfig.deterministic``; CPU, and CUDA via triton).

Each query token's output depends only on its query vector and its own keys, never on what else is in the step
or on how its prompt was cut into chunks:

* keys are reduced in fixed chunks of ``KV_CHUNK`` positions aligned to absolute position 0 (chunk c holds
  positions ``c*KV_CHUNK .. c*KV_CHUNK + KV_CHUNK - 1``), in increasing order, with an online softmax in float32;
  a chunk whose keys a query cannot see (past its position) is an exact no-op for it (max unchanged,
  rescale by exp(0) = 1, weights exp(-inf) = 0), so a token computed in a long prompt chunk and the same token
  computed alone (a decode, a recompute after preemption, the tail after a prefix-cache hit) take the same
  arithmetic;
* scores and weighted values are float32 GEMMs of one fixed per-matrix shape ``[rows, head_dim] x
  [head_dim, KV_CHUNK]`` batched over (request, kv head); the query rows of a request (tokens x the query
  heads sharing a kv head) are padded to a multiple of ``ROW_ALIGN``: float32 GEMM kernels take special
  small-M paths below that (measured: M = 1, 2, 3, 5, 6, 7, 9, 10, 11 give other bits than M = 64 on
  oneDNN/MKL), and :func:`jobrunner.engine.invariant.check_kernels` verifies at engine start that row results
  do not depend on the number of rows or matrices on this machine;
* keys are gathered slot by slot, so the chunking does not depend on the KV block size either.

Cost against the default SDPA path: no causal skipping inside a chunk's GEMM, a Python loop over key chunks
per layer, and float32 products (docs/engine.md, *Deterministic mode*).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from jobrunner.attention.base import AttentionBackend, AttentionMetadata, StepLayout, layer_views, write_kv
from jobrunner.attention.kv_quant import read_slots
from jobrunner.attention.upload import StepUpload

KV_CHUNK = 128   # keys per reduction step (fixed: part of the arithmetic every token gets)
ROW_ALIGN = 4    # query rows per (request, kv head) padded to a multiple of this


@dataclass
class InvariantGroup:
    """Rows of one step that compute the same number of query tokens (decodes: 1), batched together."""

    query_len: int                   # Q
    query_index: torch.Tensor        # [U * Q] flat token index of each unit's tokens (unit-major)
    positions: torch.Tensor          # [U, Q] position of each query token
    chunk_slots: list[torch.Tensor]  # per key chunk c: [active_c * KV_CHUNK] cache slots of the active units
    active: list[int]                # per key chunk c: units (a prefix, sorted by chunks) that have chunk c
    row_pos: torch.Tensor | None = field(default=None)  # [U, 1, R_pad, 1], built on the first layer


class InvariantMetadata(AttentionMetadata):
    def __init__(self, slot_mapping: torch.Tensor, groups: list[InvariantGroup], num_tokens: int,
                 window: int | None) -> None:
        self.backend = INVARIANT_BACKEND
        self.slot_mapping = slot_mapping
        self.groups = groups
        self.num_tokens = num_tokens
        self.window = window


class InvariantBackend(AttentionBackend):
    """Fixed-order paged attention (see the module doc); the torch backend's deterministic twin."""

    name = "invariant"
    supports_layer_windows = True  # the window is applied at attention time: one view per window shares the groups
    supports_softcap = True

    def build(self, layout: StepLayout, upload: StepUpload) -> InvariantMetadata:
        by_len: dict[int, list[int]] = {}
        for i, q_len in enumerate(layout.query_lens):
            by_len.setdefault(q_len, []).append(i)
        bs = layout.block_size
        plans = []
        for q_len, rows in by_len.items():
            rows.sort(key=lambda i: -layout.seq_lens[i])  # most key chunks first: active units are a prefix
            num_chunks = [-(-layout.seq_lens[i] // KV_CHUNK) for i in rows]
            num_blocks = -(-num_chunks[0] * KV_CHUNK // bs)
            g = len(plans)
            upload.add(f"inv{g}_index", [layout.query_starts[i] + t for i in rows for t in range(q_len)])
            upload.add(f"inv{g}_start", [layout.seq_lens[i] - q_len for i in rows])
            upload.add(f"inv{g}_tables", [b for i in rows for b in _padded(layout.block_tables[i], num_blocks)])
            plans.append((q_len, len(rows), num_chunks, num_blocks))
        t = upload.flush()
        groups = [_group(g, plan, t, bs, upload.device) for g, plan in enumerate(plans)]
        meta = InvariantMetadata(t["slot_mapping"], groups, layout.num_tokens, layout.sliding_window)
        meta.layer_views = layer_views(layout, {w: _with_window(meta, w) for w in layout.windows})
        return meta

    def forward(self, q, k, v, k_cache, v_cache, meta: InvariantMetadata, scale: float,
                softcap: float | None = None) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        num_heads, head_dim = q.shape[1], q.shape[2]
        out = q.new_empty(meta.num_tokens, num_heads * head_dim)
        for g in meta.groups:
            out.index_copy_(0, g.query_index, attend_group(q, k_cache, v_cache, g, k.shape[1], scale, meta.window,
                                                           softcap))
        return out


def _with_window(meta: InvariantMetadata, window: int | None) -> InvariantMetadata:
    view = copy.copy(meta)  # the groups (and their row positions, built by the first layer) are shared
    view.window = window
    return view


INVARIANT_BACKEND = InvariantBackend()


def _padded(table: list[int], num_blocks: int) -> list[int]:
    table = table[:num_blocks]
    return table + [0] * (num_blocks - len(table))  # keys past a row's context are masked by causality


def _group(g: int, plan: tuple, t: dict[str, torch.Tensor], block_size: int,
           device: torch.device) -> InvariantGroup:
    q_len, units, num_chunks, num_blocks = plan
    starts = t[f"inv{g}_start"]
    positions = starts[:, None] + torch.arange(q_len, device=device)[None, :]
    tables = t[f"inv{g}_tables"].view(units, num_blocks)
    key_pos = torch.arange(num_chunks[0] * KV_CHUNK, device=device)
    slots = tables[:, key_pos // block_size] * block_size + key_pos % block_size   # [U, C_max * KV_CHUNK]
    active = [sum(1 for n in num_chunks if n > c) for c in range(num_chunks[0])]
    chunk_slots = [slots[:n, c * KV_CHUNK:(c + 1) * KV_CHUNK].reshape(-1) for c, n in enumerate(active)]
    return InvariantGroup(q_len, t[f"inv{g}_index"], positions, chunk_slots, active)


def attend_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: InvariantGroup,
                 num_kv_heads: int, scale: float, window: int | None = None,
                 softcap: float | None = None) -> torch.Tensor:
    """Outputs ``[U * Q, H * D]`` of one group's query tokens, each reduced in the fixed order above."""
    head_dim = q.shape[2]
    n_rep = q.shape[1] // num_kv_heads
    units, q_len = g.positions.shape
    rows = q_len * n_rep
    padded = -(-rows // ROW_ALIGN) * ROW_ALIGN
    qg = q.index_select(0, g.query_index).view(units, q_len, num_kv_heads, n_rep, head_dim)
    qg = qg.permute(0, 2, 1, 3, 4).reshape(units, num_kv_heads, rows, head_dim).float()
    if padded != rows:
        qg = torch.nn.functional.pad(qg, (0, 0, 0, padded - rows))
    if g.row_pos is None:  # once per step: every layer shares the group
        pos = g.positions.repeat_interleave(n_rep, dim=1)
        pos = torch.cat([pos, pos[:, -1:].expand(units, padded - rows)], dim=1)  # padding rows: a real position
        g.row_pos = pos[:, None, :, None]
    m = torch.full((units, num_kv_heads, padded, 1), float("-inf"), device=q.device)
    denom = torch.zeros_like(m)
    acc = torch.zeros(units, num_kv_heads, padded, head_dim, device=q.device)
    for c, (n, slots) in enumerate(zip(g.active, g.chunk_slots)):
        keys = read_slots(k_cache, slots, torch.float32).view(n, KV_CHUNK, num_kv_heads, head_dim)
        s = torch.matmul(qg[:n], keys.permute(0, 2, 3, 1).float()) * scale          # [n, Hkv, R, KV_CHUNK]
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        key_pos = torch.arange(c * KV_CHUNK, (c + 1) * KV_CHUNK, device=q.device)
        visible = key_pos <= g.row_pos[:n]
        if window is not None:
            visible &= key_pos > g.row_pos[:n] - window
        s = s.masked_fill(~visible, float("-inf"))
        m_new = torch.maximum(m[:n], s.amax(dim=-1, keepdim=True))
        alpha = torch.exp(m[:n] - m_new)
        p = torch.exp(s - m_new)
        values = read_slots(v_cache, slots, torch.float32).view(n, KV_CHUNK, num_kv_heads, head_dim)
        denom[:n] = denom[:n] * alpha + p.sum(dim=-1, keepdim=True)
        acc[:n] = acc[:n] * alpha + torch.matmul(p, values.permute(0, 2, 1, 3).float())
        m[:n] = m_new
    out = (acc / denom)[:, :, :rows].view(units, num_kv_heads, q_len, n_rep, head_dim)
    return out.permute(0, 2, 1, 3, 4).reshape(units * q_len, num_kv_heads * n_rep * head_dim).to(q.dtype)
