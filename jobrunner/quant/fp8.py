"""FP8 (e4m3) linear layer: per-output-channel weight scales, dynamic per-token activation scales.

Storage: ``weight_fp8`` [out, in] ``float8_e4m3fn`` and ``scales`` [out] float32, ``W ~= weight_fp8 * scales``.

* CUDA sm89+ (Ada, Hopper): W8A8. Each token row of the input gets its own scale (``amax / 448``) and is cast
  to e4m3; ``torch._scaled_mm`` multiplies in fp8 with float32 accumulation and applies both scales
  (row-wise scaling where this build supports it, else the product is scaled afterwards).
* Elsewhere (CPU, older GPUs): the weight is converted to the compute dtype tile by tile (e4m3 values are
  exact in bf16 and float32) and multiplied in floating point; activations are not quantized, so this path
  is the more accurate of the two. :func:`~jobrunner.quant.primitives.fp8_w8a8_reference` computes the CUDA
  path's numbers on any device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from jobrunner.quant.dispatch import QuantDispatch, dispatch_for
from jobrunner.quant.kernels import rowwise_scaled_mm
from jobrunner.quant.primitives import (
    FP8_BITS,
    FP8_DTYPE,
    fp8_to_float_bits,
    given_codes,
    quantize_fp8_per_channel,
    quantize_fp8_per_token,
)
from jobrunner.quant.tiled import DequantBuffer, tile_rows_for, tiled_linear
from jobrunner.quant.triton_quant import fused_fp8_fn, record_failure


def fp8_shape_problem(out_features: int, in_features: int, device: torch.device) -> str | None:
    """Why ``_scaled_mm`` cannot take this weight on ``device`` (both dims multiples of 16), or ``None``."""
    if device.type == "cuda" and (out_features % 16 or in_features % 16):
        return f"weight [{out_features}, {in_features}]: _scaled_mm needs both dimensions multiples of 16"
    return None


class Fp8Linear(torch.nn.Module):
    """Drop-in replacement for ``nn.Linear`` with an e4m3 weight (see the module docstring)."""

    def __init__(self, weight_fp8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 dispatch: QuantDispatch | None = None, scratch: DequantBuffer | None = None,
                 act_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_fp8.shape
        problem = fp8_shape_problem(self.out_features, self.in_features, weight_fp8.device)
        if problem is not None:
            raise ValueError(f"fp8 cannot take this layer: {problem}")
        self.register_buffer("weight_fp8", weight_fp8.to(FP8_DTYPE))
        self.register_buffer("scales", scales.float())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.dispatch = dispatch or dispatch_for(weight_fp8.device)
        self.scratch = scratch or DequantBuffer()
        self.tile_rows = tile_rows_for(self.out_features, self.in_features, self.dispatch.tile_weights)
        # Probed here, not in forward: forward may run inside CUDA graph capture.
        self.native = weight_fp8.is_cuda and self.dispatch.fp8_native
        self.rowwise = self.native and rowwise_scaled_mm(weight_fp8.device)
        # opt-in: the per-token quantization in one Triton kernel (quant.triton_fp8), None = torch ops
        self.fused = fused_fp8_fn() if self.rowwise and self.dispatch.uses_triton("fp8") else None
        dtype = self.dispatch.compute_dtype or act_dtype
        if not self.native and dtype is not None:  # sized at load time, not inside a CUDA graph capture
            self.scratch.reserve(self.tile_rows * self.in_features, dtype, weight_fp8.device)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, dispatch: QuantDispatch | None = None,
                    scratch: DequantBuffer | None = None) -> Fp8Linear:
        """Quantize ``linear`` into a new module on its device."""
        q, scales = given_codes(linear, "fp8") or quantize_fp8_per_channel(linear.weight)
        return cls(q, scales, linear.bias, dispatch, scratch, linear.weight.dtype)

    def path(self, num_tokens: int) -> str:
        """``triton_scaled_mm`` (fused quantization, opt-in), ``scaled_mm`` (CUDA sm89+) or ``dequant``
        (elsewhere), whatever the token count."""
        return ("triton_scaled_mm" if self.fused else "scaled_mm") if self.native else "dequant"

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as a dense ``dtype`` tensor [out, in]."""
        return (self.weight_fp8.float() * self.scales[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features]; the engine passes [num_tokens, in_features].
        x2 = x.reshape(-1, self.in_features)
        y = self._scaled_mm(x2) if self.native else self._dequant_forward(x2)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _scaled_mm(self, x2: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            try:
                return self.fused(x2, self.weight_fp8, self.scales)
            except Exception as exc:  # noqa: BLE001 - never a crash: the torch path below is the tested one
                record_failure("fp8", exc)
                self.fused = None
        m = x2.shape[0]
        xq, x_scales = quantize_fp8_per_token(x2)
        rows = -(-m // 16) * 16  # keep every GEMM dimension a multiple of 16
        if rows != m:
            xq = F.pad(xq.view(torch.uint8), (0, 0, 0, rows - m)).view(FP8_DTYPE)
            x_scales = F.pad(x_scales, (0, 0, 0, rows - m), value=1.0)
        w = self.weight_fp8.t()  # column-major [K, N], as _scaled_mm wants
        if self.rowwise:
            y = torch._scaled_mm(xq, w, scale_a=x_scales, scale_b=self.scales[None, :],
                                 out_dtype=torch.bfloat16)
        else:
            one = torch.ones((), device=x2.device)
            y = torch._scaled_mm(xq, w, scale_a=one, scale_b=one, out_dtype=torch.float32)
            y = y * x_scales * self.scales[None, :]
        return y[:m]

    def _dequant_forward(self, x2: torch.Tensor) -> torch.Tensor:
        dtype = self.dispatch.compute_dtype_for(x2.dtype)

        def fill(n0: int, n1: int, out: torch.Tensor) -> torch.Tensor:
            if out.is_cuda or out.dtype not in FP8_BITS:
                return out.copy_(self.weight_fp8[n0:n1])  # exact; the scale is applied to the result
            return fp8_to_float_bits(self.weight_fp8[n0:n1], out)

        y = tiled_linear(x2.to(dtype), self.out_features, fill, self.scratch, self.tile_rows)
        return y.mul_(self.scales.to(dtype))

    def weight_bytes(self) -> int:
        """Bytes of the fp8 weight and its float32 scales (bias not included)."""
        return self.weight_fp8.numel() + self.scales.numel() * 4

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, native={self.native}")
