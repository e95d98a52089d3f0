"""Read a PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) for our decoder.

What PEFT writes and how we read it:
- tensors ``base_model.model.model.layers.<i>.<module>.lora_A.weight`` (``[r, in]``) and ``...lora_B.weight``
  (``[out, r]``); the targets and each module's rank come from these tensors, so ``target_modules`` given as a
  regex, ``layers_to_transform`` and ``rank_pattern`` need no interpretation of their own;
- each module's scaling is ``alpha / r`` (``alpha / sqrt(r)`` with ``use_rslora``), ``alpha`` being the
  ``alpha_pattern`` entry that matches the module's name (PEFT's rule: the key is a suffix of the name at a dot
  boundary) or ``lora_alpha``; the scaling is folded into B once, at load.

Our layers are fused (q|k|v, gate|up): a ``q_proj`` adapter adds to the ``q`` columns of ``qkv_proj``
(:data:`TARGETS`). Phi-3 checkpoints, already fused, are adapted on ``qkv_proj`` / ``gate_up_proj`` whole.
Anything we would compute differently is refused with a ValueError naming the adapter and the field or key:
DoRA, modules_to_save, trainable tokens, LoRA biases, embedding or LM-head targets, other PEFT methods.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# PEFT module name (under model.layers.<i>) -> (our module, which output columns: a part of a fused layer or all)
TARGETS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "self_attn.qkv_proj": ("self_attn.qkv_proj", "all"),  # Phi-3 (fused in its checkpoint)
    "self_attn.o_proj": ("self_attn.o_proj", "all"),
    "mlp.gate_proj": ("mlp.gate_up_proj", "gate"),
    "mlp.up_proj": ("mlp.gate_up_proj", "up"),
    "mlp.gate_up_proj": ("mlp.gate_up_proj", "all"),  # Phi-3
    "mlp.down_proj": ("mlp.down_proj", "all"),
}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(.+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
# config fields that change what a forward computes when set (anything but null / false / "none" / empty)
_REFUSED_FIELDS = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "use_qalora": "QA-LoRA",
    "modules_to_save": "modules_to_save (fully trained copies of base layers)",
    "trainable_token_indices": "trainable token embeddings",
    "target_parameters": "target_parameters (LoRA on raw parameters)",
    "layer_replication": "layer_replication",
    "lora_bias": "LoRA biases",
    "bias": "trained base biases",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layouts)",
}
_UNSET = (None, False, "none", [], {})


@dataclass
class LoraPiece:
    """One PEFT module's update: ``out[:, col_start:col_end] += x @ a.T @ b.T`` (``b`` already scaled)."""

    col_start: int
    col_end: int
    a: torch.Tensor  # [r, in_features]
    b: torch.Tensor  # [col_end - col_start, r]


@dataclass
class LoraAdapter:
    """A PEFT LoRA adapter read for one model: its pieces keyed by ``(layer index, our module name)``."""

    name: str
    source: str
    ranks: dict[str, int]           # PEFT module short name (q_proj, ...) -> its largest rank over layers
    lora_alpha: float
    use_rslora: bool
    pieces: dict[tuple[int, str], list[LoraPiece]] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return max(self.ranks.values())

    @property
    def targets(self) -> list[str]:
        return sorted(self.ranks)

    @property
    def num_bytes(self) -> int:
        return sum(p.a.numel() * p.a.element_size() + p.b.numel() * p.b.element_size()
                   for pieces in self.pieces.values() for p in pieces)

    def describe(self) -> dict:
        """What the manifest records of this adapter."""
        return {"name": self.name, "source": self.source, "rank": self.rank, "ranks": dict(self.ranks),
                "lora_alpha": self.lora_alpha, "use_rslora": self.use_rslora, "targets": self.targets,
                "bytes": self.num_bytes}


@dataclass(frozen=True)
class LayerDims:
    """The widths our fused layers split into (from the model's shape and its layer modules)."""

    hidden: int
    q: int
    kv: int
    intermediate: int

    def columns(self, part: str) -> tuple[int, int]:
        q, kv, i = self.q, self.kv, self.intermediate
        return {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv), "gate": (0, i), "up": (i, 2 * i)}[part]

    def in_out(self, module: str) -> tuple[int, int]:
        return {"self_attn.qkv_proj": (self.hidden, self.q + 2 * self.kv), "self_attn.o_proj": (self.q, self.hidden),
                "mlp.gate_up_proj": (self.hidden, 2 * self.intermediate),
                "mlp.down_proj": (self.intermediate, self.hidden)}[module]


def read_adapter_config(name: str, adapter_dir: Path) -> dict:
    """The adapter's config, checked: a LoRA adapter whose every field we compute as PEFT does."""
    path = adapter_dir / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"adapter {name!r}: {adapter_dir} has no {CONFIG_FILE} (a PEFT adapter directory)")
    try:
        config = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"adapter {name!r}: {path} is not valid JSON: {exc}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {name!r}: peft_type {config['peft_type']!r} is not supported; supported: LORA")
    for key, what in _REFUSED_FIELDS.items():
        value = config.get(key)
        if not any(value == unset and type(value) is type(unset) for unset in _UNSET):
            raise ValueError(f"adapter {name!r}: {key}={value!r} ({what}) is not supported")
    return config


def read_adapter(name: str, source: str, adapter_dir: Path, dims: LayerDims, num_layers: int,
                 dtype: torch.dtype, device: torch.device) -> LoraAdapter:
    """Read and check ``adapter_dir`` for a model of ``dims`` and ``num_layers``; weights in ``dtype`` on
    ``device``."""
    config = read_adapter_config(name, adapter_dir)
    pairs = _tensor_pairs(name, adapter_dir)
    alpha, rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora"))
    adapter = LoraAdapter(name, source, {}, alpha, rslora)
    for (layer, module), (a, b) in sorted(pairs.items()):
        where = f"adapter {name!r}: model.layers.{layer}.{module}"
        if layer >= num_layers:
            raise ValueError(f"{where}: the model has {num_layers} layers")
        ours, part = TARGETS[module]
        in_features, out_features = dims.in_out(ours)
        start, end = (0, out_features) if part == "all" else dims.columns(part)
        rank = a.shape[0]
        if a.shape[1] != in_features or b.shape != (end - start, rank):
            raise ValueError(f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit this model "
                             f"(expected [r, {in_features}] / [{end - start}, r]): an adapter for another base model?")
        module_alpha = _pattern_value(config.get("alpha_pattern") or {}, f"model.layers.{layer}.{module}", alpha)
        scaling = module_alpha / (math.sqrt(rank) if rslora else rank)
        b = (b.double() * scaling).to(dtype)
        piece = LoraPiece(start, end, a.to(device=device, dtype=dtype).contiguous(), b.to(device).contiguous())
        adapter.pieces.setdefault((layer, ours), []).append(piece)
        short = module.rpartition(".")[2]
        adapter.ranks[short] = max(adapter.ranks.get(short, 0), rank)
    if not adapter.pieces:
        raise ValueError(f"adapter {name!r}: {WEIGHTS_FILE} holds no lora_A / lora_B weights")
    return adapter


def _tensor_pairs(name: str, adapter_dir: Path) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """``(layer, PEFT module) -> (lora_A, lora_B)`` of the weights file; any other tensor is refused by name."""
    path = adapter_dir / WEIGHTS_FILE
    if not path.is_file():
        raise ValueError(f"adapter {name!r}: {adapter_dir} has no {WEIGHTS_FILE} (pickle adapter_model.bin is not "
                         "read: save the adapter with safe_serialization)")
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(path), framework="pt") as handle:
        for key in handle.keys():
            match = _KEY.match(key)
            if match is None or match.group(2) not in TARGETS:
                raise ValueError(f"adapter {name!r}: tensor {key!r} is not supported (LoRA is supported on "
                                 f"{', '.join(sorted({t.rpartition('.')[2] for t in TARGETS}))} of the decoder "
                                 "layers; not on embeddings, the LM head or MoE experts)")
            layer, module, which = int(match.group(1)), match.group(2), match.group(3)
            found.setdefault((layer, module), {})[which] = handle.get_tensor(key)
    pairs = {}
    for (layer, module), tensors in found.items():
        if set(tensors) != {"A", "B"}:
            raise ValueError(f"adapter {name!r}: model.layers.{layer}.{module} has lora_{''.join(tensors)} only")
        pairs[(layer, module)] = (tensors["A"], tensors["B"])
    return pairs


def _pattern_value(patterns: dict[str, float], module_name: str, default: float) -> float:
    """PEFT's per-module override: the first key that is a dot-bounded suffix of the module's name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return float(value)
    return default
