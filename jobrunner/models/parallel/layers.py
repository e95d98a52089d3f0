"""The split model's pieces that are not plain per-rank ``nn.Linear`` layers: the per-rank shape, the
vocabulary-parallel embedding lookup and the LM head's logits gather.

Every projection of a split model stays an ``nn.Linear`` of the rank's size (quantization and the kernels see
an ordinary, smaller model). Who reduces what (one collective per sublayer):

- q|k|v and gate|up are column-parallel (each rank's q heads with its k and v heads, in [q|k|v] order; its gate
  rows with its up rows): no collective.
- o_proj and down_proj are row-parallel (each rank's input columns): their partial sums are all-reduced once,
  by the attention / MLP / MoE block that owns them (``tp.all_reduce``). A bias on a row-parallel layer is
  loaded on rank 0 only (zeros elsewhere), so the reduce adds it once.
- MoE: each rank runs its own experts for every token routed to them (the router is replicated, so every
  rank routes alike) plus its shard of a shared expert; the block's sum is all-reduced once.
- the embedding holds this rank's vocabulary rows; ids outside them give zero rows; one all-reduce.
- the LM head holds the same rows (a tied head shares the shard); its logits are gathered once per step along
  the vocabulary and the padding rows trimmed, so every rank samples from the same full logits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from jobrunner.models.parallel import SINGLE, TensorParallel
from jobrunner.models.parallel.sizes import ShardPlan, plan_for_shape


def split_shape(whole: Any, tensor_parallel: TensorParallel | None) -> tuple[Any, ShardPlan | None]:
    """``(the rank's ModelShape, the plan)``; at world 1 the whole shape and None.

    The rank's shape holds its own head counts and dense intermediate size (so the KV cache, the attention
    backends and the memory plan size themselves per rank); ``vocab_size`` and ``moe`` stay the whole model's.
    """
    tp = tensor_parallel or SINGLE
    if not tp.is_parallel:
        return whole, None
    plan = plan_for_shape(whole, tp.world)
    return dataclasses.replace(whole, num_heads=plan.num_heads, num_kv_heads=plan.num_kv_heads,
                               intermediate_size=plan.intermediate_size), plan


def vocab_rows(shape: Any, plan: ShardPlan | None) -> int:
    """Rows of the embedding and the LM head on this rank."""
    return shape.vocab_size if plan is None else plan.vocab_per_rank


def parallel_embed(embedding: torch.nn.Module, input_ids: torch.Tensor, tp: TensorParallel,
                   plan: ShardPlan) -> torch.Tensor:
    """The vocabulary-parallel embedding lookup: this rank's rows for its ids, zeros for the others, summed
    over the ranks. ``input_ids`` [T] -> [T, hidden]."""
    start = plan.vocab_start(tp.rank)
    local = input_ids - start
    outside = (local < 0) | (local >= plan.vocab_per_rank)
    x = embedding(local.masked_fill(outside, 0))
    x = x.masked_fill(outside[:, None], 0.0)
    return tp.all_reduce(x)


def gather_logits(logits: torch.Tensor, tp: TensorParallel, vocab_size: int) -> torch.Tensor:
    """Every rank's logits columns [rows, vocab_per_rank] -> the full [rows, vocab_size] (padding trimmed)."""
    full = tp.all_gather_last(logits)
    return full if full.shape[-1] == vocab_size else full[..., :vocab_size]
