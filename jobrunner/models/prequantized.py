"""The streamed loader's transform for pre-quantized checkpoints (compressed-tensors FP8, GPTQ, AWQ).

Which linears are quantized is read from the checkpoint itself (the tensor names, known up front): a module
with a ``qweight`` (GPTQ / AWQ) or a ``weight_scale`` (FP8) is never materialised in float; the loader collects
its tensors (q / k / v or gate / up as the parts of our fused module) and :meth:`PrequantizedLoad.install`
builds our layer from them (:mod:`jobrunner.quant.prequantized`). Everything else (embeddings, norms, a head
the checkpoint kept in float) loads as usual, in the model's dtype.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from jobrunner.models.weight_map import Part, target
from jobrunner.quant.dispatch import CPU_CROSSOVERS, dispatch_for
from jobrunner.quant.prequantized import CheckpointQuant, build_fp8, build_int4
from jobrunner.quant.report import LayerQuant, QuantReport
from jobrunner.quant.tiled import DequantBuffer

MARKER = {"gptq": "qweight", "awq": "qweight", "fp8": "weight_scale"}  # the tensor that says "quantized"
FUSED_PARTS = {"qkv_proj": 3, "gate_up_proj": 2}  # our fused modules and how many checkpoint linears fill them


class PrequantizedLoad:
    """Builds each quantized linear of ``model`` (on meta) from its checkpoint tensors; ``names``: every tensor
    name of the checkpoint. After the load, :attr:`report` says what was built."""

    def __init__(self, model: torch.nn.Module, quant: CheckpointQuant, names: Iterable[str],
                 device: torch.device) -> None:
        self.quant = quant
        self.checkpoint_quant = quant  # read by a tensor-parallel rank's slicer (models/parallel/shard.py)
        self.device = torch.device(device)
        self.dispatch = dispatch_for(self.device)
        self.scratch = DequantBuffer()
        self.modules = quantized_modules(model, quant, names)
        self.report = QuantReport(scheme=quant.scheme, group_size=quant.group_size,
                                  notes=[f"pre-quantized checkpoint: {quant.describe()}"],
                                  dispatch=_dispatch_record(self.dispatch, quant.scheme))

    def replaces(self, module_name: str, module: torch.nn.Module) -> bool:
        """The linears the checkpoint stores quantized."""
        return module_name in self.modules

    def install(self, model: torch.nn.Module, module_name: str, tensors: dict[tuple[str, Part], torch.Tensor],
                device: torch.device) -> None:
        """Our layer for ``module_name`` from its (fused) parts' tensors, swapped in for the meta linear."""
        meta = model.get_submodule(module_name)
        try:
            parts = _parts(module_name, tensors)
            if self.quant.scheme == "int4":
                layer = build_int4(self.quant, parts, self.device, self.dispatch, self.scratch, meta.weight.dtype)
            else:
                layer = build_fp8(parts, self.device, self.dispatch, self.scratch, meta.weight.dtype)
        except (ValueError, KeyError, RuntimeError) as exc:
            raise ValueError(f"pre-quantized {module_name} ({self.quant.method}): {exc}") from None
        if (layer.out_features, layer.in_features) != (meta.out_features, meta.in_features):
            raise ValueError(f"pre-quantized {module_name}: weight [{layer.out_features}, {layer.in_features}] "
                             f"does not fit the model's [{meta.out_features}, {meta.in_features}]")
        parent, _, attr = module_name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, layer)
        self.report.layers.append(LayerQuant(
            name=module_name, shape=(meta.out_features, meta.in_features), scheme=self.quant.scheme,
            group_size=getattr(layer, "group_size", None), bytes_before=meta.weight.numel() * 2,
            bytes_after=layer.weight_bytes()))

    def unit_loaded(self, model: torch.nn.Module, unit_name: str) -> None:
        """Nothing to do: quantized modules are built as their tensors arrive."""

    def finish(self, model: torch.nn.Module) -> None:
        """Raise naming a quantized module the checkpoint did not complete; fill the report's totals."""
        built = {layer.name for layer in self.report.layers}
        missing = sorted(self.modules - built)
        if missing:
            raise ValueError(f"pre-quantized checkpoint is missing tensors of {len(missing)} module(s), e.g. "
                             f"{', '.join(missing[:3])}")
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name not in built:
                self.report.layers.append(LayerQuant(name=name, shape=tuple(module.weight.shape), scheme="none",
                                                     bytes_before=module.weight.numel() * 2))
                self.report.notes.append(f"{name} kept in float (as in the checkpoint)")
        report = self.report
        report.linear_bf16_bytes = sum(layer.bytes_before for layer in report.layers)
        report.linear_bytes_after = sum(layer.bytes_after for layer in report.layers if layer.scheme != "none")
        report.model_bytes_after = _model_bytes(model)
        report.model_bf16_bytes = report.model_bytes_before = report.model_bytes_after + sum(
            layer.bytes_before - layer.bytes_after for layer in report.layers if layer.scheme != "none")
        report.scratch_bytes = self.scratch.nbytes()


def _dispatch_record(dispatch, scheme: str) -> dict:
    """The dispatch as the manifest records it, for the layers built here: pre-quantized int4 layers never take
    the W4A8 path (:class:`~jobrunner.quant.prequantized.ExactInt4Linear`), so it is left out."""
    record = dispatch.to_dict()
    limits = record["max_kernel_tokens"]
    if scheme == "int4" and dispatch.device_type == "cpu" and limits.pop("int4_int8", 0) > limits["int4"]:
        limits["int4"] = max(limits["int4"], CPU_CROSSOVERS[dispatch.compute_dtype == torch.bfloat16]["int4"])
    return record


def quantized_modules(model: torch.nn.Module, quant: CheckpointQuant, names: Iterable[str]) -> set[str]:
    """Our module names that the checkpoint stores quantized (those with a :data:`MARKER` tensor)."""
    found: set[str] = set()
    for name in names:
        place = target(model, name)
        if place is None:
            if name.endswith("." + MARKER[quant.method]) and not name.startswith("model.layers."):
                raise ValueError(f"checkpoint tensor {name!r}: a quantized {name.rpartition('.')[0]} is not "
                                 "supported (only the decoder layers' linears)")
            continue
        module_name, _, kind = place[0].rpartition(".")
        if kind != MARKER[quant.method]:
            continue
        if isinstance(place[1], tuple):
            raise ValueError(f"checkpoint tensor {name!r}: pre-quantized MoE experts are not supported")
        found.add(module_name)
    if not found:
        raise ValueError(f"checkpoint says {quant.describe()} but has no '{MARKER[quant.method]}' tensors")
    return found


def _parts(module_name: str, tensors: dict[tuple[str, Part], torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The collected tensors as one ``{kind: tensor}`` per checkpoint linear, in our fused order."""
    by_part: dict[Part, dict[str, torch.Tensor]] = {}
    for (kind, part), tensor in tensors.items():
        by_part.setdefault(part, {})[kind] = tensor
    if list(by_part) == [None]:
        return [by_part[None]]
    expected = FUSED_PARTS.get(module_name.rpartition(".")[2], 1)
    if sorted(by_part, key=str) != list(range(expected)):
        raise ValueError(f"has parts {sorted(by_part, key=str)}, expected {list(range(expected))} "
                         "(all of q / k / v or gate / up quantized alike)")
    return [by_part[i] for i in range(expected)]


def _model_bytes(model: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen and not tensor.is_meta:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total
