"""FP8 W8A8 with the per-token activation quantization fused into one Triton kernel.

Without it, ``Fp8Linear`` quantizes its input with ~7 torch kernels per linear (float copy, abs, amax, divide,
clamp, divide, clamp, cast, pad): ~900 extra launches per Llama-3-8B step. :func:`quantize_rows_fp8` does the
same in one launch: program ``r`` reads row ``r`` of ``x`` [M, K] (any float dtype), finds its absmax, writes
``scale = max(amax / 448, 1e-12)`` and ``x / scale`` rounded to e4m3 (to nearest even, saturated at 448), and
programs past M write the zero rows (scale 1) that pad M to a multiple of 16 for ``torch._scaled_mm``. So one
linear is one quantization kernel plus one GEMM (row-wise scales, bf16 output).

The numbers are those of :func:`jobrunner.quant.primitives.quantize_fp8_per_token`: IEEE divisions (``div_rn``) and
the e4m3 rounding done in float32 bit arithmetic, so the stored value is exact whatever the store converts
with. (Triton's CPU interpreter rounds float32 -> e4m3 wrongly when the mantissa carries into the exponent,
e.g. 125.1 -> 64; rounding first makes its conversion exact too, and lets the kernel write a float32 buffer
holding e4m3 values, which is how the tests compare it with torch where fp8 tensors are unusable.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)   # largest finite e4m3fn value
MAX_BLOCK_K = 4096   # columns per iteration; a longer row is read twice (absmax pass, then quantize pass)


@triton.jit
def _round_to_e4m3(q):
    """``q`` (float32, |q| <= 448) rounded to the nearest e4m3fn value, ties to even."""
    bits = q.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1                        # lowest mantissa bit e4m3 keeps (3 of float32's 23)
    normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)   # -1048576 = 0xFFF00000
    subnormal = (q + 24576.0) - 24576.0           # |q| < 2^-6: multiples of 2^-9 (ulp of 1.5 * 2^14)
    return tl.where(tl.abs(q) < 0.015625, subnormal, normal)


@triton.jit(do_not_specialize=["M"])
def fp8_quant_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr):
    # x: [M, K]; q: [rows >= M, K] e4m3 (or float32 holding e4m3 values); s: [rows] float32
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_K)
    q_row = q_ptr + row.to(tl.int64) * stride_qm
    if row >= M:                                  # padding row: zeros, scale 1
        for k0 in range(0, K, BLOCK_K):
            zero = tl.zeros([BLOCK_K], tl.float32)
            tl.store(q_row + k0 + cols, zero.to(q_ptr.dtype.element_ty), mask=k0 + cols < K)
        tl.store(s_ptr + row, 1.0)
        return
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.div_rn(tl.max(amax, 0), FP8_MAX), 1e-12)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        q = _round_to_e4m3(tl.clamp(tl.div_rn(x, scale), -FP8_MAX, FP8_MAX))
        tl.store(q_row + k0 + cols, q.to(q_ptr.dtype.element_ty), mask=k0 + cols < K)
    tl.store(s_ptr + row, scale)


def quantize_rows_fp8(x: torch.Tensor, pad_rows_to: int = 16,
                      out_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xq [rows, K] out_dtype, scales [rows, 1] float32)`` for ``x`` [M, K], rows = M rounded up to
    ``pad_rows_to`` (padding rows are zero with scale 1). One kernel launch.

    ``out_dtype`` float32 / bfloat16 gives the same e4m3 values in a wider dtype (for checking the kernel where
    fp8 tensors are not usable)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows_fp8 takes [M, K], got shape {tuple(x.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    m, k = x.shape
    rows = -(-m // pad_rows_to) * pad_rows_to
    xq = torch.empty(rows, k, dtype=out_dtype, device=x.device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    block_k = min(triton.next_power_of_2(k), MAX_BLOCK_K)
    fp8_quant_rows_kernel[(rows,)](x, xq, scales, m, k, x.stride(0), xq.stride(0), BLOCK_K=block_k,
                                   num_warps=8 if block_k >= 2048 else 4)
    return xq, scales


def fp8_linear_fused(x: torch.Tensor, weight_fp8: torch.Tensor, scales: torch.Tensor,
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """W8A8: ``x`` [M, K] times ``weight_fp8`` [N, K] (row scales ``scales`` [N]) -> [M, N] ``out_dtype``.

    One quantization launch, then ``torch._scaled_mm`` with row-wise scales (it needs a build and device that
    take them: :func:`jobrunner.quant.kernels.rowwise_scaled_mm`)."""
    m = x.shape[0]
    xq, x_scales = quantize_rows_fp8(x)
    y = torch._scaled_mm(xq, weight_fp8.t(), scale_a=x_scales, scale_b=scales[None, :], out_dtype=out_dtype)
    return y[:m]
