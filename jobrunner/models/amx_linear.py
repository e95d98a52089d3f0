"""bf16 linear layers at decode row counts on a weight packed once for the CPU's bf16 products: the AMX tiles
(``kernels/csrc/gemm/amx_gemm.c``) or, on CPUs with AVX-512 BF16 and no AMX (AMD Zen 4 / Zen 5), ``vdpbf16ps``
(``kernels/csrc/gemm/bf16_gemm.c``). Both read the same packed layout, so the packing, the layer and the layer
loop (``models/layer_loop.py``) are one whichever kernel runs.

AMX: oneDNN's reordered-weight matmul (:mod:`jobrunner.models.onednn_linear`) is the bf16 GEMM on AMX CPUs; at a
decode step's row counts it spends much of its time around the product (tile set-up, stores, its blocking
for a small K). ``amx_gemm.c`` packs each weight once into the tiles' B layout and streams it through the tile
registers, four products per K step, prefetching the weights ahead. Measured on a 2-core Xeon with AMX, 2
threads, SmolLM2-135M's four layer shapes (one decoder layer's GEMMs, 30 weights of each shape in turn):
8 rows 269 -> 187 µs, 64 rows 447 -> 284, 72 rows 496 -> 373, 128 rows 792 -> 504; above ~256 rows (prompt
chunks) oneDNN is faster, so a layer keeps both weights and chooses by the call's row count
(``AMX_GEMM_MAX_ROWS``).

AVX-512 BF16 (``avx512_bf16``): ``bf16_gemm.c`` keeps a 6-row x 64-column block of the output in registers and
reads the packed weight once per 6 rows. Measured on a 2-core AMD EPYC Zen 4 (2 threads, SmolLM2-135M's four
layer shapes, one decoder layer's GEMMs, against bf16 ``F.linear``, the default there): 1 row 114 vs 410 µs,
8 rows 242 vs 512, 64 rows 1,043 vs 1,373, 128 rows 2.10 vs 2.51 ms, 512 rows 8.1 vs 8.7 ms, 2,048 rows 36.0 vs
42.3 ms (~430 GFLOP/s from 32 rows up: the cores' vdpbf16ps rate). Faster at every row count, so on these CPUs
it takes every call and the layer keeps no other copy of the weight (:data:`MAX_ROWS`).

With AMX the second copy of the weights is the cost: kept only while a model's bf16 linear weights take at most
``AMX_GEMM_MAX_BYTES`` (small models, where decode steps are GEMM-bound on a CPU); larger models keep oneDNN
alone. Chosen by capability (``amx``, ``avx512_bf16``) and that size, never by a timing;
``JOBRUNNER_AMX_GEMM=0`` turns it off, ``=1`` lifts the size limit. A compiler without the ISA's flags, an OS
that refuses the tile state or a shape with ``out_features % 16`` or ``in_features % 32`` keeps the other path
for that layer.

Arithmetic: bf16 products summed in float32 in K order, the bias added in float32, rounded to bf16 once, as
oneDNN does; each row's result is independent of the other rows and of the thread count.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from jobrunner.kernels import capability_key, capability_switch, detect_cpu_capability, load, source_path, switch
from jobrunner.models.huge_pages import empty_huge

AMX_GEMM_ENV = "JOBRUNNER_AMX_GEMM"
AMX_GEMM_MAX_ROWS = 128        # calls with more rows take oneDNN (faster from ~256 rows: prompt chunks)
AMX_GEMM_MAX_BYTES = 2 << 30   # keep the second (tile-packed) copy of the weights up to this many bytes
SOURCE = source_path("amx_gemm")
# the library of each capability that has one, and its (pack, linear) entry points
KERNELS = {"amx": ("amx_gemm", "jr_amx_pack", "jr_amx_linear"),
           "avx512_bf16": ("bf16_gemm", "jr_bf16_pack", "jr_bf16_linear")}
# the most rows of a call the packed kernel takes (None: every call, and the layer keeps no other weight)
MAX_ROWS: dict[str, int | None] = {"amx": AMX_GEMM_MAX_ROWS, "avx512_bf16": None}
_P, _I = ctypes.c_void_p, ctypes.c_int64


def _library() -> ctypes.CDLL | str:
    """This CPU capability's packed bf16 GEMM library (detected or forced), or why there is none."""
    return _library_of(capability_key())


@functools.cache
def _library_of(key: str) -> ctypes.CDLL | str:
    capability, _ = detect_cpu_capability()
    if capability not in KERNELS:
        return f"packed bf16 GEMM unavailable ({capability}: needs AMX or AVX-512 BF16)"
    return load(KERNELS[capability][0])


def _entry(lib: ctypes.CDLL, which: int):
    """The library's pack (0) or linear (1) function."""
    for names in KERNELS.values():
        fn = getattr(lib, names[1 + which], None)
        if fn is not None:
            return fn
    raise AttributeError(f"{lib}: no packed bf16 GEMM entry points")


def linear_function(lib: ctypes.CDLL):
    """The linear entry point of a library :func:`_library` returned (the layer loop calls it from C)."""
    return _entry(lib, 1)


def packed_max_rows() -> int | None:
    """The most rows of a call this CPU's packed kernel takes (None: every call; see :data:`MAX_ROWS`)."""
    capability, _ = detect_cpu_capability()
    return MAX_ROWS.get(capability, AMX_GEMM_MAX_ROWS)


def amx_gemm_choice(weight_bytes: int) -> tuple[bool, str]:
    """``(pack the bf16 linears for the packed GEMM, why)`` for a model whose swapped linears hold
    ``weight_bytes``: the capability rule and the setting, the size limit (where a second copy is kept), then
    whether the kernel runs here."""
    capability, _ = detect_cpu_capability()
    kind = "AMX GEMM" if capability == "amx" else "AVX-512 BF16 GEMM"
    limit = packed_max_rows()
    use, why = capability_switch(AMX_GEMM_ENV, frozenset(KERNELS),
                                 f"{kind} up to {limit} rows" if limit else f"{kind} at every row count",
                                 "no packed bf16 GEMM (needs AMX or AVX-512 BF16)")
    if not use:
        return False, why
    forced = switch(AMX_GEMM_ENV) is True
    if limit is not None and weight_bytes > AMX_GEMM_MAX_BYTES and not forced:
        return False, (f"no {kind}: the linear weights take {weight_bytes / 2**30:.1f} GiB, above the "
                       f"{AMX_GEMM_MAX_BYTES / 2**30:.0f} GiB kept twice ({AMX_GEMM_ENV}=1 lifts it)")
    lib = _library()
    if isinstance(lib, str):
        return False, lib
    return True, why


def amx_packable(out_features: int, in_features: int) -> bool:
    """Whether the kernel takes this layer shape (output columns in blocks of 16, inputs in steps of 32)."""
    return out_features % 16 == 0 and in_features % 32 == 0 and out_features > 0 and in_features > 0


def amx_pack(weight: torch.Tensor) -> torch.Tensor:
    """The bf16 weight ``[out, in]`` in the kernel's tile layout (same size; see ``csrc/gemm/amx_gemm.c``)."""
    lib = _library()
    if isinstance(lib, str):
        raise RuntimeError(lib)
    weight = weight.detach().to(torch.bfloat16).contiguous()
    packed = empty_huge(*weight.shape, dtype=torch.bfloat16)  # streamed every step: huge pages (models/huge_pages)
    if _entry(lib, 0)(weight.data_ptr(), packed.data_ptr(), *weight.shape):
        raise ValueError(f"packed bf16 GEMM cannot pack a weight of shape {tuple(weight.shape)}")
    return packed


def amx_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [rows, in] @ W^T (+ bias)`` in bf16 from the packed weight; ``x`` bf16 with unit column stride."""
    rows, k = x.shape
    n = packed.shape[0]
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    rc = _entry(_library(), 1)(x.data_ptr(), x.stride(0), packed.data_ptr(),
                               None if bias is None else bias.data_ptr(), out.data_ptr(), n, rows, n, k,
                               torch.get_num_threads())
    if rc:
        raise RuntimeError(f"packed bf16 GEMM refused a call of {rows} x {k} -> {n} (code {rc})")
    return out
