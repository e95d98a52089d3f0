"""Our layers built straight from a pre-quantized checkpoint's tensors (one module, its fused parts in order).

:class:`ExactInt4Linear` is :class:`~jobrunner.quant.int4.Int4WeightOnlyLinear` with its scales and zeros kept
in float32 on CPU: a GPTQ / AWQ float16 scale is not a bfloat16 value, and rounding it would make our model
differ from the checkpoint's. The CPU packed kernel then runs in float32 (activations and scales), and the
dequantized weight (``(q - 8) * scale + zero``) is exact in float32. Its W4A8 batch path (int8 activations)
stays off: it is not the checkpoint's arithmetic. Above the packed kernel's token count the tiles are
dequantized into the machine's compute dtype (:mod:`jobrunner.quant.dispatch`: float32, or bfloat16 on CPUs with
bf16 hardware), as for every quantized layer. On CUDA tinygemm reads bfloat16 pairs, so there the scales are
rounded to bfloat16 (relative error <= 2^-9), as for our own int4.
"""

from __future__ import annotations

import torch

from jobrunner.quant.dispatch import CPU_CROSSOVERS, QuantDispatch
from jobrunner.quant.fp8 import Fp8Linear, fp8_shape_problem
from jobrunner.quant.int4 import Int4WeightOnlyLinear
from jobrunner.quant.kernels import INT4_GROUP_SIZES, int4_mm, int4_shape_problem
from jobrunner.quant.prequantized.formats import CheckpointQuant
from jobrunner.quant.prequantized.repack import awq_to_int4, fp8_weight_and_scales, gptq_to_int4, regroup
from jobrunner.quant.tiled import DequantBuffer


class ExactInt4Linear(Int4WeightOnlyLinear):
    """An int4 layer whose scale / zero pairs stay float32 on CPU (see the module docstring)."""

    def __init__(self, q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None, dispatch: QuantDispatch | None = None,
                 scratch: DequantBuffer | None = None, act_dtype: torch.dtype | None = None) -> None:
        super().__init__(q, scales_and_zeros, group_size, bias, dispatch, scratch, act_dtype)
        if not q.is_cuda:
            self.scales_and_zeros = scales_and_zeros.to(torch.float32).contiguous()
            if self.int8 is not None:  # W4A8 quantizes activations: not the checkpoint's model. Without it
                self.int8 = None  # the packed kernel keeps the sizes it wins at on this CPU (as for int4 alone)
                self.small_batch_max_tokens = max(self.small_batch_max_tokens, CPU_CROSSOVERS[
                    self.dispatch.compute_dtype == torch.bfloat16]["int4"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.scales_and_zeros.dtype != torch.float32 or self.path(x2.shape[0]) != "packed":
            return super().forward(x)
        y = int4_mm(x2.to(torch.float32).contiguous(), self.weight_int4pack, self.group_size,
                    self.scales_and_zeros).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _scales_and_offsets(self, n0: int, n1: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.scales_and_zeros.dtype != torch.float32:
            return super()._scales_and_offsets(n0, n1)
        pairs = self.scales_and_zeros[:, n0:n1]
        scale = pairs[..., 0].contiguous()
        return scale, pairs[..., 1] - 8 * scale  # zero - 8 * scale = -z * s: exact


def kernel_group(out_features: int, in_features: int, group_size: int, device: torch.device) -> int:
    """The group size the int4 kernel runs: the checkpoint's, or for one group per channel (``group_size`` =
    K) the largest kernel size dividing K. ``ValueError`` saying why when the kernel cannot take the shape."""
    sizes = [group_size] if group_size in INT4_GROUP_SIZES else \
        [g for g in sorted(INT4_GROUP_SIZES, reverse=True) if group_size % g == 0]
    problem = f"group size {group_size} is not a multiple of one of {INT4_GROUP_SIZES}"
    for size in sizes:
        problem = int4_shape_problem(out_features, in_features, size, device)
        if problem is None:
            return size
    raise ValueError(f"int4 kernel cannot take weight [{out_features}, {in_features}]: {problem}")


def build_int4(quant: CheckpointQuant, parts: list[dict[str, torch.Tensor]], device: torch.device,
               dispatch: QuantDispatch, scratch: DequantBuffer, act_dtype: torch.dtype) -> ExactInt4Linear:
    """One (possibly fused) linear from its parts' GPTQ / AWQ tensors, concatenated along the output rows."""
    codes, pairs, group = [], [], None
    for tensors in parts:
        if quant.method == "gptq":
            q, sz, group = gptq_to_int4(tensors, quant.group_size, quant.zero_format or "v1")
        else:
            q, sz, group = awq_to_int4(tensors, quant.group_size)
        codes.append(q)
        pairs.append(sz)
    q, sz = torch.cat(codes), torch.cat(pairs, dim=1)
    size = kernel_group(q.shape[0], q.shape[1], group, device)
    sz = regroup(sz, group, size)
    if sz.shape[0] * size != q.shape[1]:
        raise ValueError(f"{sz.shape[0]} groups of {size} do not cover in_features {q.shape[1]}")
    codes_dtype = torch.int32 if device.type == "cuda" else torch.uint8
    return ExactInt4Linear(q.to(device=device, dtype=codes_dtype), sz.to(device), size, _bias(parts, device),
                           dispatch, scratch, act_dtype)


def build_fp8(parts: list[dict[str, torch.Tensor]], device: torch.device, dispatch: QuantDispatch,
              scratch: DequantBuffer, act_dtype: torch.dtype) -> Fp8Linear:
    """One (possibly fused) linear from its parts' compressed-tensors FP8 weights and scales."""
    pairs = [fp8_weight_and_scales(tensors) for tensors in parts]
    weight = torch.cat([w for w, _ in pairs])
    scales = torch.cat([s for _, s in pairs])
    problem = fp8_shape_problem(weight.shape[0], weight.shape[1], device)
    if problem is not None:
        raise ValueError(f"fp8 kernel cannot take it: {problem}")
    return Fp8Linear(weight.to(device), scales.to(device), _bias(parts, device), dispatch, scratch, act_dtype)


def _bias(parts: list[dict[str, torch.Tensor]], device: torch.device) -> torch.Tensor | None:
    """The parts' biases concatenated (all or none: a fused layer has one bias)."""
    biases = [tensors.get("bias") for tensors in parts]
    if all(b is None for b in biases):
        return None
    if any(b is None for b in biases):
        raise ValueError("some fused parts have a bias and some do not")
    return torch.cat(biases).to(device)
