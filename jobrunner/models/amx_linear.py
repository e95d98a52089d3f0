"""bf16 linear layers on the AMX tiles at decode row counts (``kernels/csrc/gemm/amx_gemm.c``).

oneDNN's reordered-weight matmul (:mod:`jobrunner.models.onednn_linear`) is the bf16 GEMM on AMX CPUs; at a
decode step's row counts it spends much of its time around the product (tile set-up, stores, its blocking
for a small K). ``amx_gemm.c`` packs each weight once into the tiles' B layout and streams it through the tile
registers, four products per K step, prefetching the weights ahead. Measured on a 2-core Xeon with AMX, 2
threads, SmolLM2-135M's four layer shapes (one decoder layer's GEMMs, 30 weights of each shape in turn):
8 rows 269 -> 187 µs, 64 rows 447 -> 284, 72 rows 496 -> 373, 128 rows 792 -> 504; above ~256 rows (prompt
chunks) oneDNN is faster, so a layer keeps both weights and chooses by the call's row count
(``AMX_GEMM_MAX_ROWS``).

The second copy of the weights is the cost: kept only while a model's bf16 linear weights take at most
``AMX_GEMM_MAX_BYTES`` (small models, where decode steps are GEMM-bound on a CPU); larger models keep oneDNN
alone. Chosen by capability (``amx``) and that size, never by a timing; ``JOBRUNNER_AMX_GEMM=0`` turns it off,
``=1`` lifts the size limit. A compiler without ``-mamx-tile``, an OS that refuses the tile state or a shape
with ``out_features % 16`` or ``in_features % 32`` keeps oneDNN for that layer.

Arithmetic: bf16 products summed in float32 in K order, the bias added in float32, rounded to bf16 once, as
oneDNN does; each row's result is independent of the other rows and of the thread count.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from jobrunner.kernels import capability_switch, load, source_path, switch
from jobrunner.models.huge_pages import empty_huge

AMX_GEMM_ENV = "JOBRUNNER_AMX_GEMM"
AMX_GEMM_MAX_ROWS = 128        # calls with more rows take oneDNN (faster from ~256 rows: prompt chunks)
AMX_GEMM_MAX_BYTES = 2 << 30   # keep the second (tile-packed) copy of the weights up to this many bytes
SOURCE = source_path("amx_gemm")
_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _library() -> ctypes.CDLL | str:
    return load("amx_gemm")


def amx_gemm_choice(weight_bytes: int) -> tuple[bool, str]:
    """``(pack the bf16 linears for the AMX GEMM too, why)`` for a model whose swapped linears hold
    ``weight_bytes``: the capability rule and the setting, the size limit, then whether the kernel runs here."""
    use, why = capability_switch(AMX_GEMM_ENV, frozenset({"amx"}),
                                 f"AMX GEMM up to {AMX_GEMM_MAX_ROWS} rows",
                                 "no AMX GEMM (needs AMX)")
    if not use:
        return False, why
    forced = switch(AMX_GEMM_ENV) is True
    if weight_bytes > AMX_GEMM_MAX_BYTES and not forced:
        return False, (f"no AMX GEMM: the linear weights take {weight_bytes / 2**30:.1f} GiB, above the "
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
    if lib.jr_amx_pack(weight.data_ptr(), packed.data_ptr(), *weight.shape):
        raise ValueError(f"AMX GEMM cannot pack a weight of shape {tuple(weight.shape)}")
    return packed


def amx_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [rows, in] @ W^T (+ bias)`` in bf16 from the packed weight; ``x`` bf16 with unit column stride."""
    rows, k = x.shape
    n = packed.shape[0]
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    rc = _library().jr_amx_linear(x.data_ptr(), x.stride(0), packed.data_ptr(),
                                  None if bias is None else bias.data_ptr(), out.data_ptr(), n, rows, n, k,
                                  torch.get_num_threads())
    if rc:
        raise RuntimeError(f"AMX GEMM refused a call of {rows} x {k} -> {n} (code {rc})")
    return out
