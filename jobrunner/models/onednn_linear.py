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

A row's result does not depend on the other rows of the call (oneDNN splits the product over output columns
and row blocks, never over the reduction of one row here); deterministic mode's row tiles wrap it as they wrap
any linear. The reordered weight replaces the layer's weight (a tied LM head keeps the embedding's table and adds
the reordered copy).
"""

from __future__ import annotations

import torch
from torch import nn

from jobrunner.kernels import capability_switch, detect_cpu_capability
from jobrunner.models.amx_linear import AMX_GEMM_MAX_ROWS, amx_gemm_choice, amx_linear, amx_pack, amx_packable

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
    """``nn.Linear``'s forward (bfloat16, CPU) on a weight reordered once for oneDNN; no row-major weight kept."""

    def __init__(self, linear: nn.Linear, batch_hint: int = BATCH_HINT, amx: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            weight = linear.weight.detach().to(torch.bfloat16)
            self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint),
                                 persistent=False)
            # calls of up to AMX_GEMM_MAX_ROWS rows: the AMX GEMM's own packing (models/amx_linear.py)
            use_amx = amx and amx_packable(self.out_features, self.in_features) and (
                linear.bias is None or linear.bias.dtype == torch.bfloat16)
            self.register_buffer("amx_packed", amx_pack(weight) if use_amx else None, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.bfloat16:
            flat = flat.to(torch.bfloat16)
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        if self.amx_packed is not None and flat.shape[0] <= AMX_GEMM_MAX_ROWS:
            out = amx_linear(flat, self.amx_packed, self.bias)
        else:
            out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        """Bytes of the weight it stands for."""
        return self.in_features * self.out_features * 2

    def extra_repr(self) -> str:
        amx = f", AMX GEMM up to {AMX_GEMM_MAX_ROWS} rows" if self.amx_packed is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn bf16{amx}"


def reorder_bf16_linears(model: nn.Module) -> tuple[int, str]:
    """Swap every bfloat16 CPU ``nn.Linear`` of ``model`` for a :class:`OneDnnLinear` where this CPU's choice
    says so (:func:`onednn_bf16_choice`). Returns ``(layers swapped, why)``."""
    use, why = onednn_bf16_choice()
    if not use:
        return 0, why
    swaps = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16
             and child.weight.device.type == "cpu"]
    weight_bytes = sum(getattr(parent, name).weight.numel() * 2 for parent, name in swaps)
    amx, amx_why = amx_gemm_choice(weight_bytes) if swaps else (False, "")
    for parent, name in swaps:  # one at a time: each old weight is freed as its layer is swapped
        setattr(parent, name, OneDnnLinear(getattr(parent, name), amx=amx))
    return len(swaps), f"{why}; {amx_why}" if swaps else why
