"""How a model config splits over ``world`` tensor-parallel ranks: pure numbers, no weights, no collectives.

The rules (each rank gets the same sizes, so every rank's KV cache and GEMMs have the same shapes):

- attention: the q heads split evenly (``num_attention_heads % world == 0``). KV heads split evenly when there
  are at least as many as ranks (``num_key_value_heads % world == 0``); with fewer, each KV head is replicated
  on ``world / num_key_value_heads`` neighbouring ranks (``world`` must then be a multiple of it): rank ``r``
  keeps KV head ``r * num_kv_heads // world``, which is the head its q heads attend to.
- the dense MLP's intermediate size (and Qwen2-MoE's shared expert's) splits evenly; the MoE experts are split
  across the ranks whole (``num_experts % world == 0``), so an expert's own intermediate size need not divide.
- the vocabulary (embedding rows, LM head rows) is padded up to a multiple of ``world``: each rank holds
  ``ceil(vocab / world)`` rows, the padded rows' logits are trimmed after the gather.
- norms, rotary tables, MoE routers and a classifier's ``score`` head are replicated.

:func:`shard_problems` names every rule a config breaks (``jobrunner validate`` prints them);
:func:`shard_plan` returns the per-rank numbers or raises naming the first; :func:`rank_bytes` counts a rank's
weights.
"""

from __future__ import annotations

from typing import Any

import torch

from jobrunner.models.gemma import GEMMA_ARCHITECTURES, gemma_shape
from jobrunner.models.heads import split_architecture
from jobrunner.models.llama import ModelShape
from jobrunner.models.loader import build_model
from jobrunner.models.parallel.sizes import ShardPlan, plan_for_shape, problems_for_shape

__all__ = ["ShardPlan", "model_shape", "plan_for_shape", "rank_bytes", "shard_plan", "shard_problems"]


def model_shape(config: Any):
    """The engine's ``ModelShape`` of ``config`` (Gemma's own, else the Llama family's)."""
    arch = (getattr(config, "architectures", None) or ["LlamaForCausalLM"])[0]
    return gemma_shape(config) if split_architecture(arch)[0] in GEMMA_ARCHITECTURES else ModelShape.from_config(config)


def shard_problems(config: Any, world: int) -> list[str]:
    """Every reason ``config`` cannot be split over ``world`` ranks, with the numbers; ``[]`` when it can."""
    if world < 1:
        return [f"tensor_parallel_size must be at least 1, got {world}"]
    return problems_for_shape(model_shape(config), world)


def shard_plan(config: Any, world: int) -> ShardPlan:
    """The per-rank sizes of ``config`` over ``world`` ranks; ValueError naming the numbers when it does not
    split (see :func:`shard_problems`)."""
    return plan_for_shape(model_shape(config), world)


# --- bytes per rank (validate's "bytes per GPU")

INT4_GROUP = 32  # quant.apply's group size along K


def rank_bytes(config: Any, world: int, dtype_bytes: int, quantization: str = "none") -> dict[str, int]:
    """A rank's weight bytes when ``config`` is split over ``world`` ranks and loaded in a ``dtype_bytes``
    model with ``quantization`` (counted as quantize-at-load stores it: int8 / fp8 / w8a8 one byte per weight
    and a float32 scale per output row; int4 half a byte plus a bfloat16 scale and zero per 32 inputs, its LM
    head in int8; embeddings as int8 rows). Returns ``{"weights_bytes": per rank, "replicated_bytes": the
    parts every rank holds whole, "split_bytes": the rank's share of the split parts, "whole_bytes": the
    unsplit model's weights}``."""
    plan = shard_plan(config, world)
    model = build_model(config, torch.float32, torch.device("meta"), 1, materialize=False)
    split = replicated = whole = 0
    seen: set[int] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            continue
        seen.add(id(param))
        scheme = _param_scheme(name, param, quantization)
        whole += _bytes(tuple(param.shape), scheme, dtype_bytes)
        sliced = rank_param_shape(name, tuple(param.shape), plan, model.shape)
        if sliced is None:
            replicated += _bytes(tuple(param.shape), scheme, dtype_bytes)
        else:
            split += _bytes(sliced, scheme, dtype_bytes)
    return {"weights_bytes": split + replicated, "replicated_bytes": replicated, "split_bytes": split,
            "whole_bytes": whole}


def rank_param_shape(name: str, shape: tuple[int, ...], plan: ShardPlan, model_shape: Any
                     ) -> tuple[int, ...] | None:
    """The shape one rank holds of the whole-model parameter ``name`` (None: replicated whole)."""
    leaf = name.rsplit(".", 2)
    module, kind = (leaf[-2] if len(leaf) > 1 else ""), leaf[-1]
    hd = model_shape.head_dim
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return (plan.vocab_per_rank, *shape[1:])
    if module == "qkv_proj":
        return ((plan.num_heads + 2 * plan.num_kv_heads) * hd, *shape[1:])
    if module == "o_proj" and kind == "weight":
        return (shape[0], plan.num_heads * hd)
    if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
        return (plan.num_experts, *shape[1:])
    if module in ("gate_up_proj", "down_proj") and kind == "weight":
        size = plan.shared_expert_intermediate_size if ".shared_expert." in name else plan.intermediate_size
        return (2 * size, shape[1]) if module == "gate_up_proj" else (shape[0], size)
    return None


def _param_scheme(name: str, param: Any, quantization: str) -> str:
    if quantization == "none" or param.dim() < 2 or ".gate." in name or name.endswith("gate.weight") \
            or name.startswith("score") or "shared_expert_gate" in name:
        return "none"
    if name == "embed_tokens.weight":
        return "int8"
    return "int8" if quantization == "int4" and name == "lm_head.weight" else quantization


def _bytes(shape: tuple[int, ...], scheme: str, dtype_bytes: int) -> int:
    count = 1
    for n in shape:
        count *= n
    if scheme == "none" or len(shape) < 2:
        return count * dtype_bytes
    *experts, n, k = shape
    num = experts[0] if experts else 1
    if scheme == "int4" and k % INT4_GROUP == 0:
        return num * (n * k // 2 + (k // INT4_GROUP) * n * 2 * 2)
    return num * (n * k + 4 * n)  # int8, fp8, w8a8: a float32 scale per row
