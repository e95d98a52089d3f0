"""W8A8's per-call activation work in one C loop each (``kernels/csrc/quant/w8a8.c``, built by
:func:`jobrunner.kernels.load`).

Around oneDNN's int8 GEMM a W8A8 call quantizes its input rows and scales its output rows. With torch ops
that is ~10 small ops per call (cast, abs, amax, divide, round, add, cast; multiply, cast), each with its own
pass and OpenMP start; at 64 tokens on a 2-core Zen 4 they cost more than the GEMM itself for ``qkv_proj`` and
``o_proj`` (GEMM 111 / 86 µs, whole layer 316 / 297 µs). Here each is one pass:

* ``quantize``: per row, ``s = max|x| / 127`` (1 for a zero row; the max is taken on the bits, which vectorizes)
  and ``u8 = rint(x / s) + 128`` — the same float32 division and round-half-even as
  :func:`jobrunner.quant.primitives.quantize_rows_int8`, so the codes are identical (tested);
* ``rowscale``: ``out = y * s_m`` from the kernel's float32 output, written as bfloat16 (round to nearest
  even, as torch's cast) or in place as float32 — the same numbers as ``y.mul_(s).to(dtype)``;
* ``scale_int32``: the same for an int32 GEMM result with per-column scales too (int4's int8 path,
  :mod:`jobrunner.quant.int4_int8`): ``out = acc * s_n * s_m``.

No compiler or ``JOBRUNNER_QUANT_NATIVE=0``: :func:`w8a8_native` returns ``None`` and the torch ops run.
"""

from __future__ import annotations

import ctypes
import functools
import warnings

import torch

from jobrunner.kernels import is_off, load
from jobrunner.quant.int4_native import NATIVE_ENV


class W8A8Native:
    """The compiled ``quantize`` / ``rowscale`` pair (see the module docstring)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._quant = {torch.bfloat16: lib.jr_w8a8_quant_bf16, torch.float32: lib.jr_w8a8_quant_f32}
        self._scale_bf16, self._scale_f32 = lib.jr_w8a8_rowscale_bf16, lib.jr_w8a8_rowscale_f32
        self._i32_scale = {torch.bfloat16: lib.jr_i32_scale_bf16, torch.float32: lib.jr_i32_scale_f32}

    def takes(self, x: torch.Tensor) -> bool:
        """Whether ``quantize`` takes ``x`` (a contiguous 2-D CPU float32 / bfloat16 tensor)."""
        return x.dtype in self._quant and x.dim() == 2 and x.is_contiguous() and x.device.type == "cpu"

    def quantize(self, x: torch.Tensor, signed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """u8 codes [M, K] (int8 code + 128) and float32 row scales [M, 1] of ``x`` [M, K]; ``signed``: the
        int8 codes themselves (``torch._int_mm``'s input), the same as
        :func:`jobrunner.quant.primitives.quantize_rows_int8`."""
        m, k = x.shape
        q = torch.empty(m, k, dtype=torch.int8 if signed else torch.uint8)
        scale = torch.empty(m, 1, dtype=torch.float32)
        zero_point = 0 if signed else 128
        self._quant[x.dtype](x.data_ptr(), q.data_ptr(), scale.data_ptr(), m, k, zero_point, torch.get_num_threads())
        return q, scale

    def takes_scale(self, out: torch.Tensor) -> bool:
        """Whether :meth:`scale_int32` can write ``out`` (float32 / bfloat16, CPU, rows of unit stride)."""
        return out.dtype in self._i32_scale and out.dim() == 2 and out.stride(1) == 1 and out.device.type == "cpu"

    def scale_int32(self, acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor,
                    out: torch.Tensor) -> None:
        """``out = acc * col_scale * row_scale`` for a contiguous int32 ``acc`` [M, N], float32 ``row_scale`` [M, 1]
        and contiguous ``col_scale`` [N]: the same numbers as those two torch multiplies in that order, then the
        cast to ``out``'s dtype. ``out`` [M, N] may be a column slice of a wider tensor (see :meth:`takes_scale`)."""
        m, n = acc.shape
        if not (acc.dtype == torch.int32 and acc.is_contiguous() and out.shape == acc.shape and self.takes_scale(out)
                and col_scale.is_contiguous() and col_scale.numel() == n and row_scale.numel() == m
                and row_scale.is_contiguous() and row_scale.dtype == col_scale.dtype == torch.float32):
            raise ValueError("scale_int32: expected int32 acc [M, N], row scales [M], column scales [N], out [M, N]")
        self._i32_scale[out.dtype](acc.data_ptr(), row_scale.data_ptr(), col_scale.data_ptr(), out.data_ptr(), m, n,
                                   out.stride(0), torch.get_num_threads())

    def rowscale(self, y: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``(y * scale).to(dtype)`` for a contiguous float32 ``y`` [M, N] (in place when ``dtype`` is float32)."""
        m, n = y.shape
        if dtype == torch.float32:
            self._scale_f32(y.data_ptr(), scale.data_ptr(), m, n, torch.get_num_threads())
            return y
        if dtype != torch.bfloat16:
            return y.mul_(scale).to(dtype)
        out = torch.empty(m, n, dtype=torch.bfloat16)
        self._scale_bf16(y.data_ptr(), scale.data_ptr(), out.data_ptr(), m, n, torch.get_num_threads())
        return out


@functools.cache
def w8a8_native() -> W8A8Native | None:
    """The compiled W8A8 activation loops, or ``None`` (native code off, or no compiler here)."""
    if is_off(NATIVE_ENV):
        return None
    lib = load("w8a8")
    if isinstance(lib, str):
        warnings.warn(f"jobrunner.quant: {lib}; using torch ops", stacklevel=2)
        return None
    return W8A8Native(lib)
