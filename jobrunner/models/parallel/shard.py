"""Slice checkpoint tensors to one rank's rows / columns while they stream (``models/load_stream.py``).

A split model is built on ``meta`` at the rank's sizes; each checkpoint tensor (a memory-mapped view) is
narrowed here to what the rank holds before it is copied into the smaller parameter, so a rank never holds
the whole model — at most one checkpoint tensor's view plus its own shard.

What each of our parameters takes (``ShardPlan`` numbers; hd = head_dim):

- ``qkv_proj`` weight / bias: q rows of the rank's q heads, k and v rows of its KV heads (a replicated KV
  head is the same rows on the ranks that share it); Phi-3's fused checkpoint tensor is cut in three first.
- ``gate_up_proj`` (dense MLP, shared expert): the rank's rows of gate and of up; ``down_proj`` and
  ``o_proj``: the rank's input columns (a row-parallel bias on rank 0 only, zeros elsewhere).
- stacked experts: the rank's experts (a per-expert tensor of another rank's expert is skipped).
- ``embed_tokens`` / ``lm_head``: the rank's vocabulary rows, zero-padded to ``vocab_per_rank``.
- anything else (norms, routers, ``score``): whole.

Quantize-at-load then quantizes the shard. Column-parallel shards quantize exactly as the whole tensor's rows
did (per-output-row scales). A row-parallel shard (o_proj, down_proj) would get its own per-row scale from half
a row; for int8 / fp8 (and w8a8's o_proj) the codes and scales are instead computed here from the *whole* row
(the quantizer's own function on the streamed tensor) and handed to the layer (``row_parallel_codes``), the
codes sliced to the rank's columns and the row's scale kept: the shard's weights are then exactly those of the
whole int8 layer. int4 quantizes in groups along the input: the rank's columns start on a group boundary
(``K / world`` a multiple of the group), so its groups are the whole tensor's.

A pre-quantized checkpoint (GPTQ / AWQ / FP8: ``packed``) is cut here too, each tensor of its packed format
alike, so every shard keeps its own rows of the checkpoint's scales (:mod:`jobrunner.quant.prequantized.shard`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from jobrunner.models.parallel import TensorParallel
from jobrunner.models.parallel.sizes import ShardPlan
from jobrunner.models.weight_map import Part

FULL_ROW_SCHEMES = ("int8", "fp8", "w8a8")  # per-output-channel scales: a row-parallel shard takes the row's


class RankSlicer:
    """``slice(param_name, part, tensor) -> (part, tensor) | None`` for one rank of a split model."""

    def __init__(self, model: torch.nn.Module, quantization: str = "none",
                 device: torch.device | None = None, packed: Any = None,
                 packed_modules: Collection[str] = ()) -> None:
        self.model, self.device = model, torch.device(device or "cpu")  # where the weights are loaded
        self.tp: TensorParallel = model.tensor_parallel
        self.plan: ShardPlan = model.shard_plan
        self.quantization = quantization
        self.head_dim = model.shape.head_dim
        self.packed = packed  # a pre-quantized checkpoint's CheckpointQuant (None: a float checkpoint)
        self.packed_modules = set(packed_modules)  # our modules it stores quantized

    def slice(self, param_name: str, part: Part, tensor: torch.Tensor) -> tuple[Part, torch.Tensor] | None:
        """The rank's part of checkpoint ``tensor`` bound for ``param_name`` (``part`` of it); None when this
        rank holds none of it (another rank's expert)."""
        module, _, kind = param_name.rpartition(".")
        leaf = module.rpartition(".")[2]
        if param_name in ("embed_tokens.weight", "lm_head.weight"):
            return part, self._vocab_rows(tensor)
        if module in self.packed_modules:
            return part, self._packed(module, leaf, kind, part, tensor)
        if leaf == "qkv_proj":
            return part, self._qkv(tensor, part)
        if module.endswith("mlp.experts") and kind in ("gate_up_proj", "down_proj"):
            return self._experts(part, tensor)
        if leaf == "gate_up_proj":
            return part, self._gate_up(module, tensor, part)
        if leaf in ("o_proj", "down_proj"):
            return part, self._row_parallel(module, kind, tensor)
        return part, tensor

    def _rows(self, tensor: torch.Tensor, start: int, count: int) -> torch.Tensor:
        return tensor.narrow(0, start, count)

    def _vocab_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        start, rows = self.plan.vocab_start(self.tp.rank), self.plan.vocab_per_rank
        have = max(0, min(rows, tensor.shape[0] - start))
        if have == rows:
            return self._rows(tensor, start, rows)
        padded = tensor.new_zeros((rows, *tensor.shape[1:]))
        padded[:have] = tensor[start:start + have]
        return padded

    def _packed(self, module: str, leaf: str, kind: str, part: Part, tensor: torch.Tensor) -> torch.Tensor:
        """A pre-quantized layer's checkpoint tensor: its output columns (column-parallel) or input rows
        (row-parallel), each tensor of the packed format cut alike (``quant.prequantized.shard``)."""
        from jobrunner.quant.prequantized.shard import slice_columns, slice_rows

        quant = self.packed
        if leaf in ("qkv_proj", "gate_up_proj"):
            if part is None:
                raise ValueError(f"pre-quantized {module} ({quant.method}): a fused checkpoint tensor cannot be "
                                 f"split over tensor_parallel_size {self.tp.world} (only separate q / k / v and "
                                 "gate / up)")
            start, count = self._qkv_range(part) if leaf == "qkv_proj" else self._gate_up_range(module)
            where = f"{module} ({('q', 'k', 'v')[part] if leaf == 'qkv_proj' else ('gate', 'up')[part]})"
            return slice_columns(quant, kind, tensor, start, count, where)
        if leaf in ("o_proj", "down_proj"):
            if kind == "bias":
                return tensor if self.tp.rank == 0 else torch.zeros_like(tensor)
            return slice_rows(quant, kind, tensor, *self._row_range(module), module)
        raise ValueError(f"pre-quantized {module} ({quant.method}): not split over tensor-parallel ranks "
                         "(only q / k / v, o_proj, gate / up and down_proj)")

    def _qkv_range(self, part: int) -> tuple[int, int]:
        """``(first row, rows)`` of the rank's q heads (part 0) or KV heads (parts 1, 2)."""
        hd, plan, rank = self.head_dim, self.plan, self.tp.rank
        if part == 0:
            return plan.q_head_start(rank) * hd, plan.num_heads * hd
        return plan.kv_head_start(rank) * hd, plan.num_kv_heads * hd

    def _gate_up_range(self, module: str) -> tuple[int, int]:
        size = self._size_of(module)
        return self.tp.rank * size, size

    def _row_range(self, module: str) -> tuple[int, int]:
        """``(first input column, columns)`` of the rank's share of a row-parallel o_proj / down_proj."""
        if module.rpartition(".")[2] == "o_proj":
            return self.plan.q_head_start(self.tp.rank) * self.head_dim, self.plan.num_heads * self.head_dim
        count = self._size_of(module)
        return self.tp.rank * count, count

    def _qkv(self, tensor: torch.Tensor, part: Part) -> torch.Tensor:
        hd, plan = self.head_dim, self.plan
        q_rows, kv_rows = self._qkv_range(0), self._qkv_range(1)
        if part is not None:
            return self._rows(tensor, *(q_rows if part == 0 else kv_rows))
        q_total, kv_total = plan.num_heads * plan.world * hd, plan.total_kv_heads * hd  # fused (Phi-3)
        q, k, v = tensor.split([q_total, kv_total, kv_total])
        return torch.cat([self._rows(q, *q_rows), self._rows(k, *kv_rows), self._rows(v, *kv_rows)])

    def _size_of(self, module: str) -> int:
        shared = module.endswith("shared_expert.gate_up_proj") or module.endswith("shared_expert.down_proj")
        return self.plan.shared_expert_intermediate_size if shared else self.plan.intermediate_size

    def _gate_up(self, module: str, tensor: torch.Tensor, part: Part) -> torch.Tensor:
        size = self._size_of(module)
        start = self.tp.rank * size
        if part is not None:
            return self._rows(tensor, start, size)
        gate, up = tensor.chunk(2)  # fused (Phi-3)
        return torch.cat([self._rows(gate, start, size), self._rows(up, start, size)])

    def _row_parallel(self, module: str, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        if kind == "bias":  # added once: rank 0's, zeros elsewhere (the reduce sums them)
            return tensor if self.tp.rank == 0 else torch.zeros_like(tensor)
        start, count = self._row_range(module)
        if self.quantization in FULL_ROW_SCHEMES:
            self._hand_full_row_codes(module, tensor, start, count)
        return tensor.narrow(1, start, count)

    def _hand_full_row_codes(self, module: str, tensor: torch.Tensor, start: int, count: int) -> None:
        """The whole rows' quantization, sliced to this rank's columns, for the layer's quantizer to take."""
        from jobrunner.quant.primitives import quantize_fp8_per_channel, quantize_int8_per_channel

        whole = tensor.to(self.device)  # quantized where the layer will be (one tensor at a time)
        codes = {"int8": quantize_int8_per_channel(whole)}  # also what int8 / fp8 fall back to
        if self.quantization == "fp8":
            codes["fp8"] = quantize_fp8_per_channel(whole)
        del whole
        linear = self.model.get_submodule(module)
        linear.row_parallel_codes = {scheme: (q[:, start:start + count].clone(), scales)
                                     for scheme, (q, scales) in codes.items()}

    def _experts(self, part: Part, tensor: torch.Tensor) -> tuple[Part, torch.Tensor] | None:
        first, count = self.plan.expert_start(self.tp.rank), self.plan.num_experts
        if part is None:  # the stacked tensor [E, ., .]
            return None, self._rows(tensor, first, count)
        expert, half = part
        if not first <= expert < first + count:
            return None
        return (expert - first, half), tensor


def slicer_for(model: torch.nn.Module, quantization: str = "none", device: torch.device | None = None,
               packed: Any = None, packed_modules: Collection[str] = ()) -> RankSlicer | None:
    """The slicer of a split model (None for a whole one); ``device``: where its weights are loaded;
    ``packed`` / ``packed_modules``: a pre-quantized checkpoint's format and the modules it stores quantized."""
    if getattr(model, "shard_plan", None) is None:
        return None
    return RankSlicer(model, quantization, device, packed, packed_modules)
