"""bfloat16 linear layers on CPU through a weight reordered once for oneDNN (torch's mkldnn linear).

Why: torch's bf16 ``F.linear`` on CPU hands oneDNN a row-major weight, which it reorders into its blocked
layout on every call; at the row counts of a decode step that reorder costs as much as the product. Reordered
once at load (``torch.ops.mkldnn._reorder_linear_weight``) and multiplied with ``_linear_pointwise``, SmolLM2's
layers ran 1.3-2.5x faster at 1-256 rows on a 2-core Sapphire Rapids class Xeon with AMX, and 0.6-1.15x at
1,024-2,048 rows (prompt chunks; docs/bench.md, *GEMM paths*, ``jobrunner bench --gemm-paths --dtype
bfloat16``).

Which CPUs: chosen by capability alone (:func:`onednn_bf16_choice`), never by a timing: on by default with
AMX (where it was measured); ``avx512_bf16`` without AMX keeps ``F.linear`` (measured there only inside the
engine: 12% less decode GEMM time, slower prompt steps) unless ``JOBRUNNER_ONEDNN_LINEAR=1``;
``JOBRUNNER_ONEDNN_LINEAR=0`` turns it off. A torch without oneDNN's bf16 kernels keeps ``F.linear``.

The packed bf16 GEMM (:mod:`jobrunner.models.amx_linear`) rides on the same layer: with AMX calls of up to
``AMX_GEMM_MAX_ROWS`` rows take it and larger ones oneDNN's reordered weight; with AVX-512 BF16 and no AMX it
takes every call and the layer keeps only its packed weight. Where oneDNN's weight is not chosen and the packed
kernel does not take a call, ``F.linear`` runs on the row-major weight.

A row's result does not depend on the other rows of the call (oneDNN splits the product over output columns
and row blocks, never over the reduction of one row here); deterministic mode's row tiles wrap it as they wrap
any linear. The reordered weight replaces the layer's weight (a tied LM head keeps the embedding's table and adds
the reordered copy).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jobrunner.kernels import capability_switch, detect_cpu_capability
from jobrunner.models.amx_linear import amx_gemm_choice, amx_linear, amx_pack, amx_packable, packed_max_rows

ONEDNN_ENV = "JOBRUNNER_ONEDNN_LINEAR"
# capabilities where the reordered weight beat F.linear at decode row counts (1-256 rows, every SmolLM2 layer
# shape, 2 threads): Intel Xeon with AMX. Without AMX (avx512_bf16 alone) it stays opt-in.
DEFAULT_ON = frozenset({"amx"})
BATCH_HINT = 128  # the row count oneDNN picks its blocking for; measured as good as any from 1 to 2,048 rows


def onednn_bf16_supported() -> bool:
    """Whether this torch has oneDNN with bf16 kernels for this CPU."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def onednn_bf16_choice() -> tuple[bool, str]:
    """``(use it, why)`` for bf16 linears on this CPU, from the capability and ``JOBRUNNER_ONEDNN_LINEAR``."""
    use, why = capability_switch(ONEDNN_ENV, DEFAULT_ON, "bf16 GEMM on oneDNN-reordered weights",
                                 f"bf16 F.linear (oneDNN's reordered weights are the default on "
                                 f"{', '.join(sorted(DEFAULT_ON))})")
    if use and not onednn_bf16_supported():
        capability, _ = detect_cpu_capability()
        return False, f"{capability}: bf16 F.linear (this torch has no oneDNN bf16 kernels for this CPU)"
    return use, why


class OneDnnLinear(nn.Module):
    """``nn.Linear``'s forward (bfloat16, CPU): calls the packed bf16 GEMM takes on it (``amx=True``; up to
    ``max_rows`` rows, or all), the others on a weight reordered once for oneDNN, or on the row-major weight
    through ``F.linear`` (``onednn=False``)."""

    def __init__(self, linear: nn.Linear, batch_hint: int = BATCH_HINT, amx: bool = False,
                 onednn: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.onednn = onednn
        with torch.no_grad():
            weight = linear.weight.detach().to(torch.bfloat16)
            # calls of up to max_rows rows (None: all): the packed GEMM's own packing (models/amx_linear.py)
            use_amx = amx and amx_packable(self.out_features, self.in_features) and (
                linear.bias is None or linear.bias.dtype == torch.bfloat16)
            self.max_rows = packed_max_rows() if use_amx else 0
            self.register_buffer("amx_packed", amx_pack(weight) if use_amx else None, persistent=False)
            if use_amx and self.max_rows is None:
                large = None  # every call on the packed kernel
            elif onednn:
                large = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
            else:
                large = weight.contiguous()
            self.register_buffer("packed", large, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.bfloat16:
            flat = flat.to(torch.bfloat16)
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        if self.amx_packed is not None and (self.max_rows is None or flat.shape[0] <= self.max_rows):
            out = amx_linear(flat, self.amx_packed, self.bias)
        elif not self.onednn:
            out = F.linear(flat, self.packed, self.bias)
        else:
            out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        """Bytes of the weight it stands for."""
        return self.in_features * self.out_features * 2

    def extra_repr(self) -> str:
        if self.packed is None:
            return f"in_features={self.in_features}, out_features={self.out_features}, packed bf16 GEMM"
        amx = f", packed bf16 GEMM up to {self.max_rows} rows" if self.amx_packed is not None else ""
        large = "onednn bf16" if self.onednn else "F.linear bf16"
        return f"in_features={self.in_features}, out_features={self.out_features}, {large}{amx}"


def reorder_bf16_linears(model: nn.Module) -> tuple[int, str]:
    """Swap every bfloat16 CPU ``nn.Linear`` of ``model`` for a :class:`OneDnnLinear` where this CPU's choices
    say so (:func:`onednn_bf16_choice` for large calls, :func:`amx_gemm_choice` for decode row counts). Returns
    ``(layers swapped, why)``."""
    use, why = onednn_bf16_choice()
    swaps = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16
             and child.weight.device.type == "cpu"]
    weight_bytes = sum(getattr(parent, name).weight.numel() * 2 for parent, name in swaps)
    amx, amx_why = amx_gemm_choice(weight_bytes) if swaps else (False, "")
    if not use and not amx:
        return 0, why
    for parent, name in swaps:  # one at a time: each old weight is freed as its layer is swapped
        setattr(parent, name, OneDnnLinear(getattr(parent, name), amx=amx, onednn=use))
    return len(swaps), f"{why}; {amx_why}" if swaps else why
