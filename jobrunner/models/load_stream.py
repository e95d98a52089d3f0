"""Stream checkpoint tensors into a model built on ``meta``: each parameter is made on the device, in the model's
dtype, when its first tensor is read, and a *load unit* is handed to a transform as soon as it is complete.

A load unit is one decoder layer (``layers.7``) or one module outside the layers (``embed_tokens``, ``norm``,
``lm_head``). With a checkpoint that names its tensors up front (:class:`jobrunner.models.weights.Checkpoint`:
the safetensors headers), the loader counts each unit's tensors and calls ``transform.unit_loaded`` the moment
the last one is in, so quantize-at-load turns a layer into its quantized modules while the next layer is read:
the float model never exists whole. A plain ``(name, tensor)`` iterable (a state dict in tests, pickle files)
has no names up front: its units are handed over after the last tensor.

The hook (:class:`LoadTransform`; any object with these four methods, e.g. ``quant.at_load.QuantizeAtLoad``):

- ``replaces(module_name, module) -> bool`` — asked once per module of the meta model before reading. A module
  it replaces (a linear of a pre-quantized GPTQ / AWQ / FP8 checkpoint) is never materialised in float: every
  checkpoint tensor that maps to it — ``qweight``, ``scales``, ``weight_scale``, ... as well as ``weight`` —
  is collected instead of copied, and its float parameters are not required.
- ``install(model, module_name, tensors, device)`` — called once all of a replaced module's checkpoint tensors
  are read (after the last tensor for a plain iterable). ``tensors`` maps ``(kind, part)`` to a host tensor
  as read (memory-mapped, zero-copy: move only what you keep to ``device``): ``kind`` is the checkpoint's
  suffix (``"qweight"``), ``part`` the index in our fused module (q/k/v -> 0/1/2 of ``qkv_proj``, gate/up ->
  0/1 of ``gate_up_proj``) or None. It swaps its own module in (``model.get_submodule(parent)`` + setattr).
- ``unit_loaded(model, unit_name)`` — a load unit's float parameters are all loaded (on the device).
- ``finish(model)`` — after the last tensor; raise naming anything left undone.
- ``scheme`` (optional attribute) — the quantization it applies (quantize-at-load), read by the shard slicer.

A tensor-parallel rank's model (built with ``tensor_parallel``, :mod:`jobrunner.models.parallel`) is loaded
through :class:`jobrunner.models.parallel.shard.RankSlicer`: each checkpoint tensor is narrowed to the rank's
rows / columns (or skipped: another rank's expert) before it is copied.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Protocol

import torch

from jobrunner.models.parallel.shard import slicer_for
from jobrunner.models.weight_map import Part, missing_parts, param_slice, target


class LoadTransform(Protocol):
    """A per-module / per-layer plug-in of :func:`stream_weights` (see the module docstring)."""

    def replaces(self, module_name: str, module: torch.nn.Module) -> bool:
        """Whether this transform builds ``module`` itself from its checkpoint tensors."""

    def install(self, model: torch.nn.Module, module_name: str, tensors: dict[tuple[str, Part], torch.Tensor],
                device: torch.device) -> None:
        """Build and swap in the replaced module ``module_name`` from its checkpoint tensors."""

    def unit_loaded(self, model: torch.nn.Module, unit_name: str) -> None:
        """Called once every float parameter of load unit ``unit_name`` is on the device."""

    def finish(self, model: torch.nn.Module) -> None:
        """Called after the last tensor."""


def unit_of(param_name: str) -> str:
    """The load unit of one of our parameter names: ``layers.3.mlp.down_proj.weight`` -> ``layers.3``,
    ``embed_tokens.weight`` -> ``embed_tokens``."""
    parts = param_name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else ".".join(parts[:-1])


def stream_weights(model: torch.nn.Module, checkpoint: Iterable[tuple[str, torch.Tensor]], device: torch.device,
                   transform: LoadTransform | None = None) -> None:
    """Load ``checkpoint`` into ``model`` (built on meta, or already materialised), unit by unit; raise naming
    any parameter left unloaded or any checkpoint tensor without a place in the model."""
    run = _Run(model, torch.device(device), transform)
    names = checkpoint.names() if hasattr(checkpoint, "names") else None
    if names is not None:
        run.count(names)
    for name, tensor in checkpoint:
        run.take(name, tensor)
    run.flush()


class _Run:
    """One load: what is still expected per unit and per replaced module, and what arrived."""

    def __init__(self, model: torch.nn.Module, device: torch.device, transform: LoadTransform | None) -> None:
        self.model, self.device, self.transform = model, device, transform
        self.required = dict(model.named_parameters(remove_duplicate=False))  # meta or not: names and shapes
        self.ties = _tied_names(self.required)
        self.replaced = {n for n, m in model.named_modules() if transform is not None and transform.replaces(n, m)}
        self.required = {n: p for n, p in self.required.items() if n.rpartition(".")[0] not in self.replaced}
        self.loaded: set[str] = set()
        self.unit_todo: Counter[str] | None = None  # None: names unknown up front, units handed over at the end
        self.module_todo: Counter[str] = Counter()
        self.collected: dict[str, dict[tuple[str, Part], torch.Tensor]] = defaultdict(dict)
        self.units_seen: dict[str, None] = {}
        packed = getattr(transform, "checkpoint_quant", None)  # a pre-quantized checkpoint: its packed tensors cut
        self.slicer = slicer_for(model, getattr(transform, "scheme", "none"), device,  # a tensor-parallel rank's
                                 packed, self.replaced if packed is not None else ())

    def count(self, names: Iterable[str]) -> None:
        self.unit_todo = Counter()
        for name in names:
            found = target(self.model, name)
            if found is not None:
                self.unit_todo[unit_of(found[0])] += 1
                module_name = found[0].rpartition(".")[0]
                if module_name in self.replaced:
                    self.module_todo[module_name] += 1

    def take(self, name: str, tensor: torch.Tensor) -> None:
        found = target(self.model, name)
        if found is None:
            return
        param_name, part = found
        if self.slicer is not None:  # a tensor-parallel rank: its rows / columns only
            sliced = self.slicer.slice(param_name, part, tensor)
            if sliced is None:  # another rank's expert
                self._count_down(unit_of(param_name))
                return
            part, tensor = sliced
        module_name, _, kind = param_name.rpartition(".")
        if module_name in self.replaced:
            self.collected[module_name][(kind, part)] = tensor
            if self.unit_todo is not None:
                self.module_todo[module_name] -= 1
                if self.module_todo[module_name] == 0:
                    self.transform.install(self.model, module_name, self.collected.pop(module_name), self.device)
        else:
            self._copy(name, param_name, part, tensor)
        self._count_down(unit_of(param_name))

    def _copy(self, name: str, param_name: str, part: Part, tensor: torch.Tensor) -> None:
        if param_name not in self.required:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model ({param_name} is not one of "
                             "its parameters; a pre-quantized checkpoint needs its quantization_config read)")
        param = self.model.get_parameter(param_name)
        if param.is_meta:
            param = self._materialise(param_name, param)
        with torch.no_grad():
            param_slice(self.model, param_name, param, part).copy_(tensor)  # converts dtype on the way
        self.loaded.add(param_name if part is None else f"{param_name}#{part}")

    def _materialise(self, param_name: str, meta: torch.Tensor) -> torch.nn.Parameter:
        """An empty parameter on the device in the meta one's dtype, set at every name that shares it."""
        param = torch.nn.Parameter(torch.empty(meta.shape, dtype=meta.dtype, device=self.device),
                                   requires_grad=False)
        for name in self.ties.get(param_name, [param_name]):
            owner_name, _, attr = name.rpartition(".")
            owner = self.model.get_submodule(owner_name) if owner_name else self.model
            if owner._parameters.get(attr) is meta:
                owner._parameters[attr] = param
        return param

    def _count_down(self, unit: str) -> None:
        self.units_seen.setdefault(unit)
        if self.unit_todo is None:
            return
        self.unit_todo[unit] -= 1
        if self.unit_todo[unit] == 0 and self.transform is not None:
            self.transform.unit_loaded(self.model, unit)

    def flush(self) -> None:
        if self.unit_todo is None and self.transform is not None:
            for module_name, tensors in self.collected.items():
                self.transform.install(self.model, module_name, tensors, self.device)
            for unit in self.units_seen:
                self.transform.unit_loaded(self.model, unit)
        missing = missing_parts(self.model, self.required, self.loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weight(s), e.g. {', '.join(missing[:5])}")
        if self.transform is not None:
            self.transform.finish(self.model)
        left = [n for n, t in [*self.model.named_parameters(), *self.model.named_buffers()] if t.is_meta]
        if left:
            raise ValueError(f"{len(left)} tensor(s) of the model were never loaded, e.g. {', '.join(left[:5])}")


def _tied_names(params: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Parameter name -> every name of the same tensor, for the parameters registered more than once."""
    by_id: dict[int, list[str]] = defaultdict(list)
    for name, p in params.items():
        by_id[id(p)].append(name)
    return {name: names for names in by_id.values() if len(names) > 1 for name in names}
