"""Deterministic (batch-invariant) execution: ``EngineConfig(deterministic=True)`` / spec ``engine.deterministic``.

The same prompt, settings and seed give the same tokens whatever ``max_num_seqs``, ``max_num_batched_tokens``,
chunked prefill, prefix-cache hits, preemption and recompute, or the other rows of a step. Default execution
is not: a GEMM or a row reduction may take another kernel, blocking or vector/scalar path when the number of
rows in the step changes, and attention's reduction order follows the step's grouping and chunking; in
bfloat16 that flips sampled tokens (issue 18: 5 of 12 seeded rows changed with ``max_num_seqs`` 64 -> 2).

What deterministic mode changes, chosen when the engine's :class:`~jobrunner.engine.model_runner.ModelRunner` is
built (:func:`make_deterministic`):

* **Row-wise layers in fixed row tiles** (:class:`RowTiled`): every linear (``qkv``, ``o``, the LM head;
  quantized ones too), every RMSNorm and the whole MLP (gate/up, SiLU, down) run on exactly ``ROW_TILE`` rows
  per call (the step's tokens cut into tiles, the last one padded with zeros). A kernel then always sees one
  shape, so its blocking, threading and vector/scalar split are the same for every row: quantized layers,
  whose kernel choice depends on the row count (``int8``/``int4`` packed vs dequantised paths, ``fp8``), are
  invariant the same way. A MoE block's experts (:mod:`jobrunner.models.moe`) also run each expert's GEMMs on
  fixed tiles of ``ROW_TILE`` rows, so a row's bits do not depend on how many rows the step routed to its experts.
* **Attention** in a fixed reduction order per query token (:mod:`jobrunner.attention.invariant_ops`) on the
  torch backend; the triton kernel keeps one tile height for every step (``TritonBackend.fixed_tiles``), and
  its per-row key loop is already fixed (``BLOCK_N`` keys from position 0, masked blocks are exact no-ops).
  The torch backend's decode graphs (their own SDPA) are turned off. The ``cpu_paged`` backend is kept, with
  every row (long prompt chunks too) on its native kernel, whose order is fixed by absolute key positions
  (:mod:`jobrunner.attention.cpu_paged`): a row's bits do not depend on the step, its chunking or the threads.
* **Sampling**: the noise already depends only on (seed, output position, token id); rows are additionally
  grouped by their own ``top_k`` and top-p setting (:func:`sampler_groups`), so no row's candidate count or
  path depends on another row.

Not covered: another machine, CPU ISA, thread count, torch/oneDNN version or GPU model may give other (still
self-consistent) bits; ``block_size`` does not matter, ``dtype`` and ``quantization`` do.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from jobrunner.models.moe import StackedExperts

log = logging.getLogger(__name__)

ROW_TILE = {"cpu": 32, "cuda": 128}  # rows per call of every row-wise layer (fixed per device type)


class RowTiled(nn.Module):
    """Runs ``inner`` (a row-wise module: ``y[i]`` depends on ``x[i]`` only) on fixed tiles of ``tile`` rows."""

    def __init__(self, inner: nn.Module, tile: int) -> None:
        super().__init__()
        self.inner = inner
        self.tile = tile

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # weight, in_features, intermediate_size, ...: the wrapped module's
            return getattr(self._modules["inner"], name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, tile = x.shape[0], self.tile
        if rows == tile:
            return self.inner(x)
        num_tiles = -(-rows // tile)
        if num_tiles * tile != rows:
            x = torch.cat([x, x.new_zeros((num_tiles * tile - rows, *x.shape[1:]))])
        outs = [self.inner(x[i * tile:(i + 1) * tile]) for i in range(num_tiles)]
        out = outs[0] if num_tiles == 1 else torch.cat(outs)
        return out[:rows]


def tile_rows(model: nn.Module, tile: int) -> int:
    """Wrap the row-wise modules of our Llama-family model in :class:`RowTiled` (in place; idempotent).

    Returns how many modules were wrapped now.
    """
    targets = [(model, "norm"), (model, "lm_head")]
    for layer in model.layers:
        attn = layer.self_attn
        targets += [(layer, "input_layernorm"), (layer, "post_attention_layernorm"), (layer, "mlp"),
                    (attn, "qkv_proj"), (attn, "o_proj")]
        if getattr(attn, "q_norm", None) is not None:  # Qwen3, Gemma 3: per-head norms over [T, heads, head_dim]
            targets += [(attn, "q_norm"), (attn, "k_norm")]
        # Gemma 2/3: the norms around the feed-forward block
        targets += [(layer, name) for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm")
                    if hasattr(layer, name)]
    for module in model.modules():  # MoE: each expert's GEMMs on fixed row tiles too
        if isinstance(module, StackedExperts):
            module.row_tile = tile
    wrapped = 0
    for parent, name in targets:
        module = getattr(parent, name)
        if module is not None and not isinstance(module, RowTiled):  # None: a checkpoint without an LM head
            setattr(parent, name, RowTiled(module, tile))
            wrapped += 1
    return wrapped


def make_deterministic(model: nn.Module, backend, requested: str, device: torch.device):
    """The attention backend a runner in deterministic mode runs (``backend``, set to its fixed order, or the
    invariant torch twin, which runs eagerly), with ``model``'s row-wise layers tiled (in place).

    ``requested``: the ``attention_backend`` asked for. Raises ``ValueError`` on CUDA without triton and
    ``RuntimeError`` where this machine's kernels cannot give the invariant twin its fixed order."""
    from jobrunner.attention.invariant_ops import INVARIANT_BACKEND

    tile_rows(model, ROW_TILE.get(device.type, ROW_TILE["cuda"]))
    if backend.name == "triton":
        backend.fixed_tiles = True
        return backend
    if backend.name == "cpu_paged" and requested == "cpu_paged":
        # asked for by name: every row native (its fixed order ignores chunking and batch); `auto` keeps the
        # invariant torch twin below, as before cpu_paged was auto's choice on CPU
        backend.native_max_query = None
        backend.fast_min_query = 0  # the fast prompt-chunk kernel's order differs from a decode's
        return backend
    if device.type == "cuda":
        raise ValueError("engine.deterministic on CUDA needs attention_backend=triton: the torch path's "
                         "GEMMs take cuBLAS kernels that change with the number of rows")
    check_kernels(model.dtype, model.shape.head_dim, device)
    return INVARIANT_BACKEND


def sampler_groups(requests, with_k: list[int], without_k: list[int]) -> list[tuple[list[int], bool]]:
    """Rows of one sampling step grouped so that each row's arithmetic depends on its own settings only.

    Rows with a top_k are grouped by k (the candidate count, and so the length of the top-p softmax, is
    the row's own k, not the step's largest); rows without one by whether they use top-p (the CPU
    candidate path is taken per group).
    """
    groups: list[tuple[list[int], bool]] = []
    for k in sorted({requests[i].params.top_k for i in with_k}):
        groups.append(([i for i in with_k if requests[i].params.top_k == k], True))
    for wants_top_p in (True, False):
        rows = [i for i in without_k if (requests[i].params.top_p < 1.0) == wants_top_p]
        if rows:
            groups.append((rows, False))
    return groups


_CHECKED: set[tuple] = set()


def check_kernels(dtype: torch.dtype, head_dim: int, device: torch.device) -> None:
    """Check on this machine what the fixed-order attention relies on; raise ``RuntimeError`` if it fails.

    Float32 GEMM rows must not depend on the number of rows (multiples of ``ROW_ALIGN``) nor on the number of
    matrices batched, and ``exp`` must give the same bits on its vector and scalar paths. Runs once per
    (dtype, head_dim, device) in a process, in milliseconds.
    """
    from jobrunner.attention.invariant_ops import KV_CHUNK, ROW_ALIGN

    key = (dtype, head_dim, device.type)
    if key in _CHECKED or device.type != "cpu":
        return
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(8, 96, head_dim, generator=gen)
    k = torch.randn(8, head_dim, KV_CHUNK, generator=gen)
    p = torch.rand(8, 96, KV_CHUNK, generator=gen)
    v = torch.randn(8, KV_CHUNK, head_dim, generator=gen)
    full_s, full_o = torch.matmul(q, k), torch.matmul(p, v)
    for rows in range(ROW_ALIGN, 97, ROW_ALIGN):
        for batch in (1, 3, 8):
            if not (torch.equal(torch.matmul(q[:batch, :rows], k[:batch]), full_s[:batch, :rows])
                    and torch.equal(torch.matmul(p[:batch, :rows], v[:batch]), full_o[:batch, :rows])):
                raise RuntimeError(f"engine.deterministic: this machine's float32 GEMM gives row results that "
                                   f"change with the number of rows ({rows}) or matrices ({batch}); the "
                                   "fixed-order attention cannot be batch-invariant here")
    x = torch.randn(4096, generator=gen) * 8
    if not torch.equal(torch.exp(x), torch.exp(torch.stack([x, x], 1)[:, 0])):
        raise RuntimeError("engine.deterministic: torch.exp gives other bits on its scalar path on this machine")
    _CHECKED.add(key)
