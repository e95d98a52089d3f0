"""Checkpoint tensor names -> our parameters: Hugging Face names, fused q|k|v and gate|up, stacked experts.

:func:`target` says where one checkpoint tensor goes (``("layers.0.self_attn.qkv_proj.weight", 1)`` for a k_proj
weight: part 1 of the fused parameter), :func:`param_slice` is that part of the parameter, and
:func:`missing_parts` lists what a load left out. A part is ``None`` (the whole parameter), an index into a fused
parameter, or a tuple naming one expert of a stacked MoE tensor (:mod:`jobrunner.models.moe`).
"""

from __future__ import annotations

import re

import torch

from jobrunner.models import moe

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.shared_expert.gate_proj": ("mlp.shared_expert.gate_up_proj", 0),  # Qwen2-MoE
    "mlp.shared_expert.up_proj": ("mlp.shared_expert.gate_up_proj", 1),
}
Part = int | tuple | None


def target(model: torch.nn.Module, name: str) -> tuple[str, Part] | None:
    """``(our parameter name, part)`` for checkpoint tensor ``name``; None for a tensor we do not use
    (rotary ``inv_freq``, an untied model's head on a bare decoder, ...)."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    vision_target = getattr(model, "vision_target", None)  # a vision-language model (models/vision/)
    if vision_target is not None:
        found, name = vision_target(name)
        if found is not None:
            return found
    if name == "lm_head.weight":
        return None if model.shape.tie_word_embeddings or model.lm_head is None else ("lm_head.weight", None)
    if name == "score.weight":
        return ("score.weight", None) if getattr(model, "score", None) is not None else None
    if model.shape.head == "none" and not name.startswith("model."):  # a bare decoder (AutoModel) checkpoint
        name = "model." + name
    if name.startswith("model.") and not name.startswith("model.layers."):
        return name[len("model."):], None
    match = _LAYER.match(name)
    if not match:
        return None
    index, rest = match.groups()
    expert = moe.checkpoint_target(rest)  # per-expert tensors, Mixtral's block_sparse_moe names
    if expert is not None:
        return f"layers.{index}.{expert[0]}", expert[1]
    module, _, kind = rest.rpartition(".")
    if module in _FUSED:
        fused, part = _FUSED[module]
        return f"layers.{index}.{fused}.{kind}", part
    return f"layers.{index}.{rest}", None


def param_slice(model: torch.nn.Module, param_name: str, param: torch.Tensor, part: Part) -> torch.Tensor:
    """The rows of ``param`` that checkpoint part ``part`` fills (the whole parameter for ``None``)."""
    if part is None:
        return param
    if isinstance(part, tuple):  # one expert of a stacked MoE tensor
        return moe.expert_slice(param, part)
    s = model.shape
    if "qkv_proj" in param_name:
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        bounds = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][part]
    else:  # gate|up: the dense MLP's, or a shared expert's (its own intermediate size)
        half = param.shape[0] // 2
        bounds = [(0, half), (half, 2 * half)][part]
    return param[bounds[0]:bounds[1]]


def missing_parts(model: torch.nn.Module, params: dict[str, torch.Tensor], loaded: set[str]) -> list[str]:
    """Parameters (``name#part`` for a part of a fused one) of ``params`` that ``loaded`` does not name."""
    missing = []
    for name in params:
        if name == "lm_head.weight" and model.shape.tie_word_embeddings:
            continue
        if "qkv_proj" in name:
            parts = [f"{name}#{i}" for i in range(3)]
        elif name.endswith(moe.STACKED):  # the stacked tensor whole, or every expert's part
            parts = [] if name in loaded else [f"{name}#{p}" for p in moe.expert_parts(params[name], name)]
        elif "gate_up_proj" in name:
            parts = [f"{name}#{i}" for i in range(2)]
        else:
            parts = [name]
        missing += [p for p in parts if p not in loaded and name not in loaded]  # or loaded whole (Phi-3)
    return missing
