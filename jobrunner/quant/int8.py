"""Int8 per-output-channel weight-only linear layer.

Storage: ``weight_int8`` [out, in] int8 and ``scales`` [out] float32, so
``W ~= weight_int8 * scales[:, None]`` (symmetric, no zero point). Activations stay in floating point.

Which path runs (measured on a 2-core AVX512/AMX Xeon, torch 2.13, see docs/quantization.md):

* few tokens (``num_tokens <= small_batch_max_tokens``): ``aten._weight_int8pack_mm`` on bfloat16 inputs.
  Its float32 CPU path is a scalar loop (10-50x slower), so float32 inputs are cast to bfloat16 and back.
* more tokens: dequantize the weight to bfloat16 (int8 values are exact in bfloat16) and call
  ``F.linear``; the dense bfloat16 GEMM (oneDNN/AMX) beats the packed kernel, whose cost grows linearly
  with the token count.
* CUDA: ``_weight_int8pack_mm`` for bfloat16 when this torch build has it for CUDA, else
  dequantize-then-matmul (cuBLAS).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from jobrunner.quant.kernels import INT8_KERNEL_MAX_TOKENS, has_cuda_int8pack

INT8_MAX = 127


@torch.no_grad()
def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 quantization of ``weight`` [out, in].

    Returns ``(weight_int8 [out, in] int8, scales [out] float32)``; a zero row gets scale 1. With the codes
    chosen, each row's scale is refitted by least squares and rounded to the nearest bfloat16 where that
    lowers the row's error (as for int4, see ``jobrunner.quant.int4._refit_groups``).
    """
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scales = round_up_to_bf16(torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax)))
    q = torch.round(w / scales[:, None]).clamp(-INT8_MAX, INT8_MAX)
    qq = (q * q).sum(dim=1)
    fit = torch.where(qq > 0, (q * w).sum(dim=1) / qq.clamp(min=1), scales).to(torch.bfloat16).float()
    better = ((q * fit[:, None] - w) ** 2).sum(dim=1) < ((q * scales[:, None] - w) ** 2).sum(dim=1)
    return q.to(torch.int8), torch.where(better, fit, scales)


def dequantize_int8(weight_int8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight_int8 * scales[:, None]`` (computed in float32) as a dense ``dtype`` tensor."""
    return (weight_int8.to(torch.float32) * scales[:, None]).to(dtype)


def round_up_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """Smallest bfloat16-representable values >= ``x`` (x > 0), returned as float32.

    The kernels take scales in the activation dtype; rounding a scale *after* quantizing would give every
    output channel a fixed gain error of up to 0.4% (measured: +0.6% perplexity on SmolLM2). Choosing scales
    that bfloat16 holds exactly, then quantizing against them, removes that error at no cost.
    """
    bits = x.float().contiguous().view(torch.int32)  # bfloat16 is the top 16 bits of a float32
    truncated = bits & -65536  # 0xFFFF0000: drop the low 16 bits (rounds a positive value down)
    return torch.where(truncated == bits, truncated, truncated + 65536).view(torch.float32)


class Int8WeightOnlyLinear(torch.nn.Module):
    """Drop-in replacement for ``nn.Linear`` holding an int8 per-channel weight (see module docstring)."""

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scales", scales.float())
        self.register_buffer("scales_bf16", scales.to(torch.bfloat16))  # exact: scales are bf16 values
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.small_batch_max_tokens = INT8_KERNEL_MAX_TOKENS
        # Probed here, not in forward: forward may run inside CUDA graph capture.
        self.use_cuda_kernel = weight_int8.is_cuda and has_cuda_int8pack()

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> Int8WeightOnlyLinear:
        """Quantize ``linear`` (any float dtype, any device) into a new module on the same device."""
        q, scales = quantize_int8_per_channel(linear.weight)
        return cls(q, scales, linear.bias)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight this layer computes with, as a dense ``dtype`` tensor [out, in]."""
        return dequantize_int8(self.weight_int8, self.scales, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features]; the engine passes [num_tokens, in_features].
        x2 = x.reshape(-1, self.in_features)
        if x2.is_cuda:
            y = self._forward_cuda(x2)
        else:  # CPU: bf16 in, x.dtype out (the float32 packed kernel is a slow scalar loop)
            xb = x2.to(torch.bfloat16)
            if x2.shape[0] <= self.small_batch_max_tokens:
                y = torch.ops.aten._weight_int8pack_mm(xb.contiguous(), self.weight_int8, self.scales_bf16)
            else:  # scaling the [tokens, out] result is cheaper than scaling the [out, in] weight
                y = F.linear(xb, self.weight_int8.to(torch.bfloat16)) * self.scales_bf16
            y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _forward_cuda(self, x2: torch.Tensor) -> torch.Tensor:
        if x2.dtype == torch.bfloat16 and self.use_cuda_kernel:
            return torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.weight_int8, self.scales_bf16)
        return F.linear(x2, self.weight_int8.to(x2.dtype)) * self.scales.to(x2.dtype)

    def weight_bytes(self) -> int:
        """Bytes of the quantized weight and its scales (bias not included)."""
        return self.weight_int8.numel() + self.scales.numel() * 4  # float32 scales (the bf16 copy aside)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")
