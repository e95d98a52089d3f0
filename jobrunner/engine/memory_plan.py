"""How the engine's device memory is shared out before the KV cache is made, as vLLM's profile run does.

On CUDA the engine (``LLMEngine._num_kv_blocks``) measures, after the weights are loaded:

- ``weights``: ``torch.cuda.memory_allocated`` once the model is loaded (quantized or not, adapters included);
- ``activations``: the peak of one *profile step* (:func:`profile_step`: ``max_num_batched_tokens`` prompt tokens
  over up to ``max_num_seqs`` requests, every one sampled, so the sampler's logits are ``max_num_seqs`` rows)
  above what was allocated before it, on a throw-away cache just big enough for that step; then the cache
  allocator is emptied, so the blocks that step freed are not counted as used;
- ``graphs``: with ``use_cuda_graphs``, the decode graphs' private pool, reserved as one decode step's peak at
  ``max_num_seqs`` rows (the largest graph captured; they share one pool);

and gives the KV cache ``gpu_memory_utilization x share x the card's total - weights - activations - graphs -
other`` (:func:`kv_budget_bytes`). ``share`` is the worker's fraction of the card (``num_gpus_per_worker: 0.5``
-> 0.5), so two engines on one GPU each take their own share, never what the other left free. The result is
also capped by what is free on the card now (another process may hold memory), and recorded as
:class:`MemoryPlan` (the manifest's ``model.memory_*`` keys and one line, ``model.memory_plan``).

On CPU there is no allocator to ask: the KV cache is ``engine.kv_cache_memory_bytes`` (default
:data:`CPU_KV_DEFAULT_BYTES`, 2 GiB) and the breakdown beside it carries the weights' bytes and
:func:`estimate_activation_bytes` (a formula, the same one ``jobrunner validate`` shows).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

CPU_KV_DEFAULT_BYTES = 2 * 1024**3


@dataclass(frozen=True)
class MemoryPlan:
    """One engine's memory: what is measured (or estimated) and the KV cache that follows from it."""

    device: str
    how: str  # "profiled" | "cpu: kv_cache_memory_bytes" | "cpu: default 2 GiB" | "num_kv_blocks"
    weights_bytes: int
    activations_bytes: int
    graphs_bytes: int
    kv_bytes: int
    kv_bytes_per_block: int
    num_kv_blocks: int
    total_bytes: int | None = None  # the card's total (CUDA)
    budget_bytes: int | None = None  # gpu_memory_utilization x share x total
    other_bytes: int = 0  # LoRA workspace
    note: str = ""  # e.g. capped by the memory free on the card

    def describe(self) -> str:
        """One line: ``weights 16.1 GB, activations 0.4 GB, graphs 0.0 GB, KV 4.9 GB (2,512 blocks); profiled``."""
        gb = [f"{name} {value / 1e9:.2f} GB" for name, value in (
            ("weights", self.weights_bytes), ("activations", self.activations_bytes), ("graphs", self.graphs_bytes))]
        text = ", ".join(gb) + f", KV {self.kv_bytes / 1e9:.2f} GB ({self.num_kv_blocks:,} blocks)"
        if self.budget_bytes is not None:
            text += f" of a {self.budget_bytes / 1e9:.2f} GB budget (card {self.total_bytes / 1e9:.2f} GB)"
        return f"{text}; {self.how}" + (f"; {self.note}" if self.note else "")

    def to_info(self) -> dict[str, Any]:
        """Plain values for ``model_info`` (so the manifest's model section): ``memory_<field>`` keys."""
        info = {f"memory_{k}": v for k, v in asdict(self).items() if k not in ("device", "note")}
        info["memory_plan"] = self.describe()
        return info


def kv_budget_bytes(total_bytes: int, utilization: float, share: float, weights_bytes: int,
                    activations_bytes: int, graphs_bytes: int, other_bytes: int = 0) -> int:
    """``utilization x share x total - weights - activations - graphs - other`` (may be negative: no room)."""
    budget = int(utilization * min(share, 1.0) * total_bytes)
    return budget - weights_bytes - activations_bytes - graphs_bytes - other_bytes


def plan_from_numbers(*, device: str, total_bytes: int, free_bytes: int, utilization: float, share: float,
                      weights_bytes: int, activations_bytes: int, graphs_bytes: int, kv_bytes_per_block: int,
                      other_bytes: int = 0) -> MemoryPlan:
    """The CUDA plan from measured numbers (the engine passes what torch.cuda says; tests inject their own).

    Raises ``ValueError`` naming the figures when not even one KV block fits."""
    kv = kv_budget_bytes(total_bytes, utilization, share, weights_bytes, activations_bytes, graphs_bytes,
                         other_bytes)
    note = ""
    room = free_bytes - graphs_bytes - other_bytes  # what the card can still give (others may hold some)
    if kv > room:
        kv, note = max(room, 0), f"capped by the {free_bytes / 1e9:.2f} GB free on the card"
    if kv < kv_bytes_per_block:
        raise ValueError(
            f"no room for the KV cache on {device}: gpu_memory_utilization {utilization:g} x share {share:g} x "
            f"{total_bytes / 1e9:.2f} GB = {utilization * min(share, 1.0) * total_bytes / 1e9:.2f} GB, minus weights "
            f"{weights_bytes / 1e9:.2f} GB, activations {activations_bytes / 1e9:.2f} GB, graphs "
            f"{graphs_bytes / 1e9:.2f} GB leaves {kv / 1e9:.2f} GB ({note or 'budget'}); one block needs "
            f"{kv_bytes_per_block:,} bytes: raise engine.gpu_memory_utilization, lower max_num_batched_tokens, "
            "or quantize the model")
    blocks = kv // kv_bytes_per_block
    return MemoryPlan(device, "profiled", weights_bytes, activations_bytes, graphs_bytes,
                      blocks * kv_bytes_per_block, kv_bytes_per_block, blocks, total_bytes,
                      int(utilization * min(share, 1.0) * total_bytes), other_bytes, note)


def plan_cpu(*, weights_bytes: int, activations_bytes: int, kv_cache_memory_bytes: int | None,
             kv_bytes_per_block: int) -> MemoryPlan:
    """The CPU plan: the KV cache is ``kv_cache_memory_bytes`` (default 2 GiB), the rest is recorded beside it."""
    kv = kv_cache_memory_bytes or CPU_KV_DEFAULT_BYTES
    blocks = max(1, kv // kv_bytes_per_block)
    how = "cpu: engine.kv_cache_memory_bytes" if kv_cache_memory_bytes else "cpu: default 2 GiB"
    return MemoryPlan("cpu", how, weights_bytes, activations_bytes, 0, blocks * kv_bytes_per_block,
                      kv_bytes_per_block, blocks)


def estimate_activation_bytes(shape: Any, num_tokens: int, num_seqs: int, dtype_bytes: int) -> int:
    """A step's activation peak from the model's shape alone: per token the residual stream and its norm, q|k|v,
    the attention output and the MLP's gate|up and product (``dtype_bytes`` each), plus the sampler's float32
    logits for ``num_seqs`` rows twice over (logits and their softmax). Used where nothing can be measured
    (``jobrunner validate``, the CPU breakdown)."""
    s = shape
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    inter = getattr(s, "intermediate_size", 4 * s.hidden_size)
    per_token = 4 * s.hidden_size + q + 2 * kv + 3 * inter
    return num_tokens * per_token * dtype_bytes + 2 * num_seqs * s.vocab_size * 4


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's unique parameters and buffers (quantized layers' buffers included)."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def profile_lengths(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """Prompt lengths for the profile step: ``max_num_batched_tokens`` tokens over as many requests as
    ``max_num_seqs`` allows (at least enough that none is longer than ``max_model_len``)."""
    num_seqs = max(min(max_num_seqs, max_num_batched_tokens), math.ceil(max_num_batched_tokens / max_model_len))
    base, extra = divmod(max_num_batched_tokens, num_seqs)
    return [base + (i < extra) for i in range(num_seqs)]
