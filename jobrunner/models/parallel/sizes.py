"""The per-rank sizes of a model split over tensor-parallel ranks, from the engine's ``ModelShape`` (pure
numbers; the rules are in :mod:`jobrunner.models.parallel.plan`, which reads them from a config). Kept apart
from the config side so the model classes can use it without importing themselves back."""

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


def problems_for_shape(shape: Any, world: int) -> list[str]:
    """Every split rule a ``ModelShape`` breaks at ``world`` ranks, with the numbers."""
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


def plan_for_shape(shape: Any, world: int) -> ShardPlan:
    """:func:`shard_plan` from an engine ``ModelShape`` (whole-model numbers)."""
    problems = problems_for_shape(shape, world) if world >= 1 else \
        [f"tensor_parallel_size must be at least 1, got {world}"]
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
