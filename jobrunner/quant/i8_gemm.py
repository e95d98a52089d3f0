"""W8A8 on our own GEMM (``kernels/csrc/gemm/i8_gemm.c``): a bf16 layer's per-token int8 quantization, the exact
int32 product and the output scaling in one native call, on a weight packed once; the product on AVX-512 VNNI
(``vpdpbusd``, W8A8 kernel ``"vnni"``) or on AMX-INT8 tiles (the same source built with ``-DJR_W8A8_TILES``,
kernel ``"amx"``). Both read one packing and give the same bits (integer sums are exact).

Where it runs: ``vnni`` on CPUs whose capability is ``avx512_bf16`` (AMD Zen 4 / Zen 5, Cooper Lake: VNNI plus
bf16 activations); ``JOBRUNNER_W8A8_VNNI=0`` turns it off, ``=1`` forces it on any capability whose CPU runs
it. ``amx`` only when asked (``JOBRUNNER_W8A8_AMX=1`` on an AMX CPU): its source is tested here with the tile
operations emulated on ``vpdpbusd`` (library ``i8_tile_emulated``), but it has not run on AMX hardware yet, so
on AMX oneDNN's int8 GEMM (its own AMX-INT8 kernel) stays the default until it is measured there. On
``avx512_vnni`` CPUs without bf16 the model computes in float32 and oneDNN takes its rows.

Measured on a 2-core AMD EPYC Zen 4 (2 threads, SmolLM2-135M's four layer shapes, one decoder layer's GEMMs,
µs): against the packed bf16 GEMM (``bf16_gemm.c``, the bf16 default there) 1 row 42 vs 85, 8 rows 90 vs 185,
64 rows 551 vs 1,043, 128 rows 1,123 vs 2,246, 512 rows 4,657 vs 8,362: ~2x at every row count (a
``vpdpbusd`` multiplies 64 byte pairs where ``vdpbf16ps`` multiplies 32 bf16 pairs, at the same rate). So the
layer has no weight-only crossover: every call, 1 row included, runs this kernel, and a row's result does not
depend on the batch.

Numbers: W8A8 layers quantize each row **asymmetrically** (:func:`jobrunner.quant.primitives.quantize_rows_asym`:
``x ~ s (u - z)``, u in 0..255, a zero point per row; ``jr_i8_linear_asym``; int4's W4A8 in ``jr_i4_linear`` too;
``jr_i8_linear`` keeps symmetric rows, :func:`~jobrunner.quant.primitives.quantize_rows_int8`); then the exact int32
product less ``z * sum_k W`` per column, and the two scalings (``(acc * s_w) * s_x``, oneDNN's order, rounded to
bf16 once; a bias added after, as a bf16 add): the bits of the ``int_mm`` reference path (tested). Why asymmetric: a
token's activations are often lopsided (one large value of one sign), and the symmetric codes then leave half their
range unused; on SmolLM2-135M the W8A8 perplexity cost went +2.62% -> +1.43% (docs/quantization.md). oneDNN's op
takes one zero point per call, so the ``onednn`` kernel (the default on AMX until ours is measured there) stays
symmetric. The order of the scalings matters more than one would think: the per-token quantization turns 1-ulp
differences into flipped codes that grow through the layers, so on SmolLM2-135M (30 held-out texts, symmetric rows)
the three exact orders gave perplexity +2.66% (this one, oneDNN's bits: also +2.62% via oneDNN), +3.06% (``(acc *
s_x) * s_w``) and +3.26% (``acc * (s_x * s_w)``) over bf16. None is more exact; this is oneDNN's.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from jobrunner.kernels import capability_key, load, switch

VNNI_ENV = "JOBRUNNER_W8A8_VNNI"
AMX_ENV = "JOBRUNNER_W8A8_AMX"
DEFAULT_ON = frozenset({"avx512_bf16"})
LIBRARIES = {"vnni": "i8_gemm", "amx": "amx_i8_gemm"}  # W8A8 kernel -> its build of i8_gemm.c


@functools.cache
def _library_of(name: str, key: str) -> ctypes.CDLL | str:
    return load(name)


def library(kernel: str = "vnni") -> ctypes.CDLL | str:
    """The compiled ``kernel`` (``vnni`` | ``amx``) for this capability (detected or forced), or why it does
    not run here."""
    return _library_of(LIBRARIES[kernel], capability_key())


def vnni_choice(capability: str) -> tuple[bool, str]:
    """``(W8A8 layers take the VNNI kernel, why)`` on a CPU of ``capability``: by the capability and
    ``JOBRUNNER_W8A8_VNNI``, then whether the kernel runs here."""
    value = switch(VNNI_ENV)
    if value is False:
        return False, f"{VNNI_ENV}=0"
    if value is not True and capability not in DEFAULT_ON:
        return False, f"{capability}: W8A8 on oneDNN's int8 GEMM"
    lib = library("vnni")
    return (False, lib) if isinstance(lib, str) else (True, f"{capability}: W8A8 on the AVX-512 VNNI kernel")


def amx_choice(capability: str) -> tuple[bool, str]:
    """``(W8A8 layers take the AMX-INT8 tile kernel, why)``: only on ``amx`` with ``JOBRUNNER_W8A8_AMX=1`` (not
    yet measured on AMX hardware: module doc), and where the OS grants the tile state."""
    if capability != "amx" or switch(AMX_ENV) is not True:
        return False, f"{capability}: the AMX-INT8 W8A8 kernel is opt-in ({AMX_ENV}=1 on amx)"
    lib = library("amx")
    return (False, lib) if isinstance(lib, str) else (True, f"{capability}: W8A8 on the AMX-INT8 tile kernel")


def vnni_packable(out_features: int, in_features: int) -> bool:
    """Whether the kernels take this layer shape (outputs in blocks of 16, inputs in steps of 64)."""
    return out_features > 0 and out_features % 16 == 0 and 0 < in_features < 66000 and in_features % 64 == 0


def vnni_pack(weight_int8: torch.Tensor, scales: torch.Tensor, kernel: str = "vnni") -> torch.Tensor:
    """The int8 weight ``[out, in]`` and its float32 scales ``[out]`` in the kernels' layout (uint8, ``out * in
    + 8 * out`` bytes: the tiles, ``128 * sum_k W[n, k]`` per column, the scales)."""
    lib = library(kernel)
    if isinstance(lib, str):
        raise RuntimeError(lib)
    n, k = weight_int8.shape
    weight_int8 = weight_int8.contiguous()
    scales = scales.to(torch.float32).contiguous()
    packed = torch.empty(n * k + 8 * n, dtype=torch.uint8)
    if lib.jr_i8_pack(weight_int8.data_ptr(), scales.data_ptr(), packed.data_ptr(), n, k):
        raise ValueError(f"W8A8 {kernel} kernel cannot pack a weight of shape {(n, k)}")
    return packed


def vnni_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None,
                kernel: str = "vnni", asymmetric: bool = True) -> torch.Tensor:
    """``x [rows, in]`` (bf16, unit column stride) times the packed weight (+ bf16 ``bias``), bf16 ``[rows, out]``;
    the rows quantized asymmetrically (:func:`~jobrunner.quant.primitives.quantize_rows_asym`, W8A8 layers) or
    symmetrically (``asymmetric=False``: :func:`~jobrunner.quant.primitives.quantize_rows_int8`)."""
    rows, k = x.shape
    out = torch.empty(rows, out_features, dtype=torch.bfloat16)
    fn = library(kernel).jr_i8_linear_asym if asymmetric else library(kernel).jr_i8_linear
    rc = fn(x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
            out_features, rows, out_features, k, torch.get_num_threads())
    if rc:
        raise RuntimeError(f"W8A8 {kernel} kernel refused a call of {rows} x {k} -> {out_features} (code {rc})")
    return out


def linear_address(kernel: str = "vnni", asymmetric: bool = True) -> int:
    """The kernel's entry point as an address (the layer loop calls it from C): :func:`vnni_linear`'s."""
    lib = library(kernel)
    return ctypes.cast(lib.jr_i8_linear_asym if asymmetric else lib.jr_i8_linear, ctypes.c_void_p).value
