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

from dataclasses import dataclass
from typing import Any

REPLICATED_PARTS = ("norms", "rotary", "router", "score")


@dataclass(frozen=True)
class ShardPlan:
    """The per-rank sizes of one config at one world size (every rank has the same)."""

    world: int
    num_heads: int  # q heads per rank
    num_kv_heads: int  # KV heads per rank (1 when replicated)
    kv_replicated: bool  # fewer KV heads than ranks: each rank keeps one whole KV head, shared by neighbours
    total_kv_heads: int
    intermediate_size: int  # the dense MLP's, per rank
    vocab_size: int  # the whole vocabulary
    vocab_per_rank: int  # ceil(vocab_size / world): rows of the embedding and of the LM head per rank
    num_experts: int = 0  # MoE experts per rank (0: a dense model)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert, per rank
    replicated: tuple[str, ...] = REPLICATED_PARTS

    @property
    def padded_vocab(self) -> int:
        return self.vocab_per_rank * self.world

    def q_head_start(self, rank: int) -> int:
        return rank * self.num_heads

    def kv_head_start(self, rank: int) -> int:
        """The first (whole-model) KV head of ``rank``."""
        if self.kv_replicated:
            return rank * self.total_kv_heads // self.world
        return rank * self.num_kv_heads

    def vocab_start(self, rank: int) -> int:
        return rank * self.vocab_per_rank

    def expert_start(self, rank: int) -> int:
        return rank * self.num_experts


def model_shape(config: Any):
    """The engine's ``ModelShape`` of ``config`` (Gemma's own, else the Llama family's)."""
    from jobrunner.models.gemma import GEMMA_ARCHITECTURES, gemma_shape
    from jobrunner.models.heads import split_architecture
    from jobrunner.models.llama import ModelShape

    arch = (getattr(config, "architectures", None) or ["LlamaForCausalLM"])[0]
    return gemma_shape(config) if split_architecture(arch)[0] in GEMMA_ARCHITECTURES else ModelShape.from_config(config)


def shard_problems(config: Any, world: int) -> list[str]:
    """Every reason ``config`` cannot be split over ``world`` ranks, with the numbers; ``[]`` when it can."""
    if world < 1:
        return [f"tensor_parallel_size must be at least 1, got {world}"]
    return _problems(model_shape(config), world)


def _problems(shape: Any, world: int) -> list[str]:
    def not_divisible(what: str, value: int) -> str:
        return f"{what} {value} is not divisible by tensor_parallel_size {world}"

    problems = []
    if shape.num_heads % world:
        problems.append(not_divisible("num_attention_heads", shape.num_heads))
    kv = shape.num_kv_heads
    if kv >= world and kv % world:
        problems.append(not_divisible("num_key_value_heads", kv))
    elif kv < world and world % kv:
        problems.append(f"tensor_parallel_size {world} is not a multiple of num_key_value_heads {kv} "
                        "(with fewer KV heads than ranks, each KV head is replicated on the same number of ranks)")
    moe = shape.moe
    if _has_dense_mlp(shape) and shape.intermediate_size % world:
        problems.append(not_divisible("intermediate_size", shape.intermediate_size))
    if moe is not None and moe.sparse_layers:
        if moe.num_experts % world:
            problems.append(not_divisible("num_experts", moe.num_experts))
        if moe.shared_expert_intermediate_size % world:
            problems.append(not_divisible("shared_expert_intermediate_size", moe.shared_expert_intermediate_size))
    return problems


def _has_dense_mlp(shape: Any) -> bool:
    moe = shape.moe
    return moe is None or len(moe.sparse_layers) < shape.num_layers


def shard_plan(config: Any, world: int) -> ShardPlan:
    """The per-rank sizes of ``config`` over ``world`` ranks; ValueError naming the numbers when it does not
    split (see :func:`shard_problems`)."""
    return plan_for_shape(model_shape(config), world)


def plan_for_shape(shape: Any, world: int) -> ShardPlan:
    """:func:`shard_plan` from an engine ``ModelShape`` (whole-model numbers)."""
    problems = [f"tensor_parallel_size must be at least 1, got {world}"] if world < 1 else _problems(shape, world)
    if problems:
        raise ValueError(f"{shape.architecture} cannot be split over {world} ranks: {'; '.join(problems)}")
    kv_replicated = shape.num_kv_heads < world
    moe = shape.moe
    sparse = moe is not None and bool(moe.sparse_layers)
    return ShardPlan(
        world=world,
        num_heads=shape.num_heads // world,
        num_kv_heads=1 if kv_replicated else shape.num_kv_heads // world,
        kv_replicated=kv_replicated,
        total_kv_heads=shape.num_kv_heads,
        intermediate_size=shape.intermediate_size // world if _has_dense_mlp(shape) else shape.intermediate_size,
        vocab_size=shape.vocab_size,
        vocab_per_rank=-(-shape.vocab_size // world),
        num_experts=moe.num_experts // world if sparse else 0,
        shared_expert_intermediate_size=moe.shared_expert_intermediate_size // world if sparse else 0,
    )


# --- bytes per rank (validate's "bytes per GPU")

INT4_GROUP = 32  # quant.apply's group size along K


def rank_bytes(config: Any, world: int, dtype_bytes: int, quantization: str = "none") -> dict[str, int]:
    """A rank's weight bytes when ``config`` is split over ``world`` ranks and loaded in a ``dtype_bytes``
    model with ``quantization`` (counted as quantize-at-load stores it: int8 / fp8 / w8a8 one byte per weight
    and a float32 scale per output row; int4 half a byte plus a bfloat16 scale and zero per 32 inputs, its LM
    head in int8; embeddings as int8 rows). Returns ``{"weights_bytes": per rank, "replicated_bytes": the
    parts every rank holds whole, "split_bytes": the rank's share of the split parts, "whole_bytes": the
    unsplit model's weights}``."""
    import torch

    from jobrunner.models.loader import build_model

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
