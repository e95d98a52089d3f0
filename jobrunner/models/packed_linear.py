"""float32 linear layers on CPU through a weight packed once into column panels (``kernels/csrc/gemm/packed_gemm.c``).

Why: on AVX2-only CPUs torch's float32 ``F.linear`` (MKL's sgemm) reaches a third to a half of the FMA units'
rate at the row counts of a decode step (16-256 rows): 50 GFLOP/s for SmolLM2's gate|up at 64 rows on a 2-core
Zen 3, where the packed kernel reaches over twice that (docs/bench.md, *GEMM paths*). The kernel keeps an
MR x NR tile of the output in vector registers and streams the packed weight once per block of rows.

Which CPUs: chosen by capability alone (:func:`packed_gemm_choice`): on by default where it was measured
faster than ``F.linear`` at every row count of the table (``avx2``); other capabilities keep ``F.linear``
unless ``JOBRUNNER_PACKED_GEMM=1`` asks for it; ``JOBRUNNER_PACKED_GEMM=0`` turns it off everywhere. A failed
build (no compiler) keeps ``F.linear`` too. Quantized layers are not touched: only float32 ``nn.Linear`` on CPU.

A row's result is one fused multiply-add chain over the input features in order, so it does not depend on the
other rows of the call (batch-invariant), unlike ``F.linear``, whose blocking changes with the row count. The
packed weight replaces the layer's weight (same memory), except where the weight is shared (a tied LM head
keeps the embedding's table and adds the packed copy).
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import nn

from jobrunner.kernels import capability_switch, detect_cpu_capability, load, source_path
from jobrunner.models.huge_pages import empty_huge

PACKED_ENV = "JOBRUNNER_PACKED_GEMM"
SOURCE = source_path("packed_gemm")
# capabilities where the packed kernel beat F.linear at every row count measured (1-1,024 rows, every
# SmolLM2 layer shape, 2 threads): AMD Zen 3 (avx2). AVX-512 CPUs were not measured with it: F.linear there.
DEFAULT_ON = frozenset({"avx2"})
_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _library(capability_key: str) -> ctypes.CDLL | str:
    return load("packed_gemm")


def packed_library() -> ctypes.CDLL | str:
    """The kernel built for this CPU's capability (detected or forced), or why there is none."""
    capability, forced = detect_cpu_capability()
    return _library(f"{capability}:{forced}")


def packed_gemm_choice() -> tuple[bool, str]:
    """``(use it, why)`` for this CPU, from the capability and ``JOBRUNNER_PACKED_GEMM`` (never a timing)."""
    use, why = capability_switch(PACKED_ENV, DEFAULT_ON, "packed float32 GEMM",
                                 f"F.linear (the packed kernel is the default on {', '.join(sorted(DEFAULT_ON))})")
    if not use:
        return False, why
    lib = packed_library()
    if isinstance(lib, str):
        return False, lib
    return True, f"{why} ({lib.jr_gemm_panel_width()}-column panels)"


def pack_weight(weight: torch.Tensor, panel_width: int) -> torch.Tensor:
    """``weight`` [N, K] as [ceil(N / panel_width), K, panel_width] (columns past N are zeros)."""
    n, k = weight.shape
    padded_n = -(-n // panel_width) * panel_width
    if padded_n != n:
        weight = torch.cat([weight, weight.new_zeros(padded_n - n, k)])
    panels = weight.view(padded_n // panel_width, panel_width, k).transpose(1, 2)
    packed = empty_huge(*panels.shape, dtype=weight.dtype)  # streamed every step: huge pages (models/huge_pages)
    return packed.copy_(panels)


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward (float32, CPU) on a packed weight; holds no row-major weight of its own."""

    def __init__(self, linear: nn.Linear, lib: ctypes.CDLL) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._fn = lib.jr_gemm_packed
        with torch.no_grad():
            self.register_buffer("packed", pack_weight(linear.weight.detach(), lib.jr_gemm_panel_width()),
                                 persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        flat = x.reshape(-1, self.in_features)
        if flat.stride(-1) != 1 or flat.dtype != torch.float32:
            flat = flat.contiguous().float()
        rows = flat.shape[0]
        out = flat.new_empty(rows, self.out_features)
        if rows:
            bias = self.bias.data_ptr() if self.bias is not None else None
            rc = self._fn(flat.data_ptr(), rows, self.in_features, flat.stride(0), self.packed.data_ptr(),
                          self.out_features, bias, out.data_ptr(), self.out_features, torch.get_num_threads())
            if rc:
                raise RuntimeError(f"packed GEMM refused its shape (rows {rows}, {self.in_features} -> "
                                   f"{self.out_features})")
        return out.view(*x.shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        """Bytes of the weight it stands for (the panels' zero padding not counted)."""
        return self.in_features * self.out_features * self.packed.element_size()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def pack_linears(model: nn.Module) -> tuple[int, str]:
    """Swap every float32 CPU ``nn.Linear`` of ``model`` for a :class:`PackedLinear` where this CPU's choice
    says so (:func:`packed_gemm_choice`). Returns ``(layers swapped, why)``."""
    use, why = packed_gemm_choice()
    if not use:
        return 0, why
    lib = packed_library()
    # names first, modules fetched one at a time: each old weight is freed as soon as its layer is packed, so
    # the model never holds two copies of all its weights
    swaps = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu"]
    for parent, name in swaps:
        setattr(parent, name, PackedLinear(getattr(parent, name), lib))
    return len(swaps), why
