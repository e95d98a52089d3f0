"""What ``quantize_model`` did, layer by layer, and the weight bytes before and after."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class LayerQuant:
    """One linear layer: the scheme it ended up with and, if that is not the requested one, why."""

    name: str
    shape: tuple[int, int]
    scheme: str  # "int8" | "int4" | "fp8" | "none"
    group_size: int | None = None
    fallback_reason: str | None = None
    bytes_before: int = 0  # at the model's own dtype
    bytes_after: int = 0


@dataclass
class QuantReport:
    """Per-layer outcome of :func:`jobrunner.quant.quantize_model` plus model-wide weight bytes.

    ``*_bf16_bytes`` count the same tensors as if they were bfloat16, the reference the targets are stated in
    (int8 <= 0.55x, int4 <= 0.35x of bf16 for the linear weights). Tied tensors are counted once.
    """

    scheme: str
    group_size: int | None
    layers: list[LayerQuant] = field(default_factory=list)
    linear_bf16_bytes: int = 0
    linear_bytes_after: int = 0
    model_bf16_bytes: int = 0
    model_bytes_before: int = 0
    model_bytes_after: int = 0
    notes: list[str] = field(default_factory=list)
    dispatch: dict[str, Any] | None = None  # QuantDispatch.to_dict(): which kernel runs for how many tokens
    scratch_bytes: int = 0  # the shared dequantize buffer (not in the weight bytes)

    @property
    def fallbacks(self) -> list[LayerQuant]:
        """Layers that did not get the requested scheme (with ``fallback_reason`` set)."""
        return [layer for layer in self.layers if layer.fallback_reason]

    @property
    def linear_ratio_vs_bf16(self) -> float:
        """Quantized linear weight bytes over the same weights in bfloat16."""
        return self.linear_bytes_after / max(self.linear_bf16_bytes, 1)

    @property
    def model_ratio_vs_bf16(self) -> float:
        """All parameter and buffer bytes after quantization over the whole model in bfloat16."""
        return self.model_bytes_after / max(self.model_bf16_bytes, 1)

    def scheme_counts(self) -> dict[str, int]:
        """How many linear layers ended up in each scheme."""
        counts: dict[str, int] = {}
        for layer in self.layers:
            counts[layer.scheme] = counts.get(layer.scheme, 0) + 1
        return counts

    def summary(self) -> dict[str, Any]:
        """A small JSON-able dict for manifests and reports (fallbacks listed, not every layer)."""
        return {
            "scheme": self.scheme, "group_size": self.group_size, "layers": self.scheme_counts(),
            "fallbacks": [{"name": f.name, "scheme": f.scheme, "reason": f.fallback_reason}
                          for f in self.fallbacks],
            "linear_bf16_bytes": self.linear_bf16_bytes, "linear_bytes_after": self.linear_bytes_after,
            "linear_ratio_vs_bf16": round(self.linear_ratio_vs_bf16, 4),
            "model_bf16_bytes": self.model_bf16_bytes, "model_bytes_before": self.model_bytes_before,
            "model_bytes_after": self.model_bytes_after,
            "model_ratio_vs_bf16": round(self.model_ratio_vs_bf16, 4),
            "notes": list(self.notes), "dispatch": self.dispatch, "scratch_bytes": self.scratch_bytes,
        }

    def to_dict(self) -> dict[str, Any]:
        """Everything, including one entry per layer."""
        return {**self.summary(), "per_layer": [asdict(layer) for layer in self.layers]}
