"""One-pass int4 unpack for CPU (``kernels/csrc/quant/int4_unpack.c``): the thin wrappers over the native code.

Why: the large-batch int4 path must undo the CPU kernel's block layout ([blocks, K, block_n / 2] bytes) into
W^T [K, N]. With torch ops that takes two strided uint8 -> float copies plus a multiply and an add (~1 ms per
1.8 M weights on one AVX2 core, a third of the float32 GEMM it feeds at 64 tokens). This loop reads each byte
once and writes each float once, with the scale and offset applied on the way (vectorized by the compiler
for this CPU; OpenMP over K). The same library expands int4 blocks to int8 for the W4A8 path.

Built and loaded by :func:`jobrunner.kernels.load` (the one native build, for this CPU's capability). No
compiler, a failed build, or ``JOBRUNNER_QUANT_NATIVE=0``: :func:`int4_unpack_fn` returns ``None`` and the
torch path runs.
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from collections.abc import Callable

import torch

from jobrunner.kernels import is_off, load

NATIVE_ENV = "JOBRUNNER_QUANT_NATIVE"


Unpack = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, bool, int], None]


@functools.cache
def _library() -> ctypes.CDLL | None:
    if is_off(NATIVE_ENV):
        return None
    lib = load("int4_unpack")
    if isinstance(lib, str):
        warnings.warn(f"jobrunner.quant: {lib}; using torch ops", stacklevel=2)
        return None
    return lib


UNPACK_SYMBOLS = {torch.float32: "jr_int4_unpack_t", torch.bfloat16: "jr_int4_unpack_t_bf16"}


@functools.cache
def int4_unpack_fn(dtype: torch.dtype = torch.float32) -> Unpack | None:
    """The compiled unpack writing ``dtype`` (float32 or bfloat16) as ``fn(packed_blocks, scale, offset, out,
    block_n, split, group)``, or ``None`` (no such variant, or no native code here)."""
    lib = _library() if dtype in UNPACK_SYMBOLS else None
    if lib is None:
        return None
    fn = getattr(lib, UNPACK_SYMBOLS[dtype])

    def unpack(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, out: torch.Tensor,
               block_n: int, split: bool, group: int) -> None:
        # packed: uint8 [nb, K, block_n / 2]; scale, offset: float32 [K / group, ld]; out: dtype [K, ld],
        # of which the first nb * block_n columns are written
        nb, k, _ = packed.shape
        if out.shape[1] < nb * block_n or scale.shape[1] != out.shape[1] or offset.shape != scale.shape:
            raise ValueError("native int4 unpack: out / scale / offset widths do not match")
        for t, want in ((packed, torch.uint8), (scale, torch.float32), (offset, torch.float32), (out, dtype)):
            if t.dtype != want or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"native int4 unpack: expected a contiguous CPU {want} tensor, got {t.dtype}")
        fn(packed.data_ptr(), scale.data_ptr(), offset.data_ptr(), out.data_ptr(), k, nb, block_n, int(split),
           group, out.shape[1], torch.get_num_threads())

    return unpack


# fn(packed_blocks uint8 [nb, K, block_n / 2], pairs bf16 [groups, >= nb * block_n, 2] (a column slice of the
# layer's scales_and_zeros), inv_row_scale float32 [nb * block_n], out int8 [K, ld], block_n, split, group)
ToInt8 = Callable[..., None]


@functools.cache
def int4_to_int8_fn() -> ToInt8 | None:
    """The compiled int4 -> int8 expansion (the int4 layer's int8-GEMM path), or ``None`` without native code.

    Row ``c`` of the packed blocks becomes ``rint(((code - 8) * scale + zero) / row_scale[c])`` in [-127, 127],
    written transposed (``out[k, c]``), the ``B`` operand of ``torch._int_mm``."""
    lib = _library()
    if lib is None:
        return None
    fn = lib.jr_int4_to_int8_t

    def expand(packed: torch.Tensor, pairs: torch.Tensor, inv_row_scale: torch.Tensor, out: torch.Tensor,
               block_n: int, split: bool, group: int) -> None:
        nb, k, _ = packed.shape
        cols = nb * block_n
        if out.shape[0] != k or out.shape[1] < cols or inv_row_scale.numel() < cols or pairs.shape[1] < cols:
            raise ValueError("native int4 -> int8: out / pairs / row scale widths do not match")
        checks = ((packed, torch.uint8), (inv_row_scale, torch.float32), (out, torch.int8), (pairs, torch.bfloat16))
        for t, want in checks:
            if t.dtype != want or t.device.type != "cpu" or (t is not pairs and not t.is_contiguous()):
                raise ValueError(f"native int4 -> int8: expected a contiguous CPU {want} tensor, got {t.dtype}")
        if pairs.stride(2) != 1 or pairs.stride(1) != 2:
            raise ValueError("native int4 -> int8: pairs must be [groups, rows, 2] with contiguous rows")
        if block_n > 64 or block_n % 2:
            raise ValueError(f"native int4 -> int8: blocks of {block_n} rows (at most 64, even)")
        fn(packed.data_ptr(), pairs.data_ptr(), inv_row_scale.data_ptr(), out.data_ptr(), k, nb, block_n,
           int(split), group, out.stride(0), pairs.stride(0) // 2, torch.get_num_threads())

    return expand
