"""Int8 per-output-channel weight-only linear layer.

Storage: ``weight_int8`` [out, in] int8 and ``scales`` [out] float32, so
``W ~= weight_int8 * scales[:, None]`` (symmetric, no zero point). Activations stay in floating point.

Which path runs (chosen by :mod:`jobrunner.quant.dispatch` for this machine):

* few tokens (``num_tokens <= small_batch_max_tokens``): ``aten._weight_int8pack_mm`` on bfloat16 inputs
  (vectorized for AVX2 and AVX512; its float32 x86 path is a scalar loop, so float32 inputs go through
  bfloat16). CUDA builds without that kernel: W8A8 ``torch._int_mm`` with per-token activation scales, so the
  weight is never dequantized for a small batch.
* more tokens: the weight is converted (int8 values are exact in every float dtype) tile by tile into a
  reused buffer in the machine's fast compute dtype (float32 on an AVX2-only CPU, bfloat16 with avx512_bf16 /
  AMX, the activation dtype on CUDA), one dense GEMM per tile, and the [tokens, out] result is scaled.
"""

from __future__ import annotations

import torch

from jobrunner.quant.dispatch import QuantDispatch, dispatch_for
from jobrunner.quant.kernels import has_cuda_int8pack, int8_int_mm, int_mm_shape_ok
from jobrunner.quant.primitives import dequantize_int8, given_codes, quantize_int8_per_channel
from jobrunner.quant.tiled import DequantBuffer, tile_rows_for, tiled_linear
from jobrunner.quant.triton_quant import int8_triton_fn, record_failure


class Int8WeightOnlyLinear(torch.nn.Module):
    """Drop-in replacement for ``nn.Linear`` holding an int8 per-channel weight (see module docstring)."""

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 dispatch: QuantDispatch | None = None, scratch: DequantBuffer | None = None,
                 act_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scales", scales.float())
        self.register_buffer("scales_bf16", scales.to(torch.bfloat16))  # exact: scales are bf16 values
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.dispatch = dispatch or dispatch_for(weight_int8.device)
        self.scratch = scratch or DequantBuffer()
        self.small_batch_max_tokens = self.dispatch.kernel_tokens_for("int8", weight_int8.numel())
        self.tile_rows = tile_rows_for(self.out_features, self.in_features, self.dispatch.tile_weights)
        # Probed here, not in forward: forward may run inside CUDA graph capture.
        self.use_cuda_kernel = weight_int8.is_cuda and has_cuda_int8pack()
        # opt-in: above the crossover a Triton GEMM reads the int8 weight (quant.triton_mixed), None = dequant
        self.triton_mm = int8_triton_fn(self.dispatch.uses_triton("int8"), self.out_features, self.in_features)
        self._reserve(act_dtype, weight_int8.device)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, dispatch: QuantDispatch | None = None,
                    scratch: DequantBuffer | None = None) -> Int8WeightOnlyLinear:
        """Quantize ``linear`` (any float dtype, any device) into a new module on the same device."""
        q, scales = given_codes(linear, "int8") or quantize_int8_per_channel(linear.weight)
        return cls(q, scales, linear.bias, dispatch, scratch, linear.weight.dtype)

    def _reserve(self, act_dtype: torch.dtype | None, device: torch.device) -> None:
        """Size the shared buffer now (at load time), not inside a CUDA graph capture."""
        dtype = self.dispatch.compute_dtype or act_dtype
        if dtype is not None:
            self.scratch.reserve(self.tile_rows * self.in_features, dtype, device)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight this layer computes with, as a dense ``dtype`` tensor [out, in]."""
        return dequantize_int8(self.weight_int8, self.scales, dtype)

    def path(self, num_tokens: int) -> str:
        """Which path a call with ``num_tokens`` rows takes: ``packed`` | ``int_mm`` | ``triton`` | ``dequant``."""
        if num_tokens > self.small_batch_max_tokens:
            return "dequant" if self.triton_mm is None else "triton"
        if self.weight_int8.is_cuda and not self.use_cuda_kernel:
            return "int_mm" if int_mm_shape_ok(self.out_features, self.in_features) else "dequant"
        return "packed"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features]; the engine passes [num_tokens, in_features].
        x2 = x.reshape(-1, self.in_features)
        path = self.path(x2.shape[0])
        if path == "packed":  # bf16 in (the float32 packed kernel is a scalar loop on x86)
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16).contiguous(), self.weight_int8,
                                                   self.scales_bf16)
        elif path == "int_mm":
            y = int8_int_mm(x2, self.weight_int8, self.scales)
        elif path == "triton":
            y = self._triton_forward(x2)
        else:
            y = self._dequant_forward(x2)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _triton_forward(self, x2: torch.Tensor) -> torch.Tensor:
        try:
            return self.triton_mm(x2, self.weight_int8, self.scales)
        except Exception as exc:  # noqa: BLE001 - never a crash: fall back to the tested torch path for good
            record_failure("int8", exc)
            self.triton_mm = None
            return self._dequant_forward(x2)

    def _dequant_forward(self, x2: torch.Tensor) -> torch.Tensor:
        dtype = self.dispatch.compute_dtype_for(x2.dtype)

        def fill(n0: int, n1: int, out: torch.Tensor) -> torch.Tensor:
            return out.copy_(self.weight_int8[n0:n1])  # exact; the scale is applied to the result

        # scaling the [tokens, out] result is cheaper than scaling the [out, in] weight
        y = tiled_linear(x2.to(dtype), self.out_features, fill, self.scratch, self.tile_rows)
        return y.mul_(self.scales.to(dtype))

    def weight_bytes(self) -> int:
        """Bytes of the quantized weight and its scales (bias not included)."""
        return self.weight_int8.numel() + self.scales.numel() * 4  # float32 scales (the bf16 copy aside)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")
