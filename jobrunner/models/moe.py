"""Mixture-of-experts MLP blocks (Qwen2-MoE, Qwen3-MoE, Mixtral) for our decoder.

A sparse layer's MLP is a router (``gate``: one logit per expert per token), the top-k experts of each token
and, for Qwen2-MoE, a shared expert scaled by a sigmoid gate. The routing math copies transformers' own
(``modeling_{qwen2_moe,qwen3_moe,mixtral}.py``, 5.x): softmax over the logits in float32, top-k, optionally
renormalised to sum 1 (Qwen: ``norm_topk_prob``; Mixtral: always); Qwen casts the k weights back to the
compute dtype before scaling the experts' outputs, Mixtral scales in float32 and then casts.

How the experts run (:meth:`StackedExperts.forward`): the ``T * k`` (token, expert) slots are sorted by expert
id (stable), ``bincount`` gives each expert's contiguous slice of the sorted slots, and each expert that has
tokens runs one GEMM (gate|up, SiLU, down) over its slice; the weighted outputs go back to their slots and
each token sums its k slots. So a step costs one GEMM pair per *active expert*, never a loop over tokens.

Weights are stacked, as transformers 5 stores them: ``gate_up_proj`` [E, 2I, H] (gate rows first) and
``down_proj`` [E, H, I]. The loader fills them from either those names or a Hub checkpoint's per-expert
tensors (``mlp.experts.{e}.gate_proj`` ... ; Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2``), see
:func:`checkpoint_target`. Quantization splits them per expert (:func:`unstack_experts`): each expert's
gate|up and down become ordinary ``nn.Linear`` layers that ``quantize_model`` then swaps like any other, so
every expert gets its own per-channel scales and the scheme's real kernels. The routers (``gate``,
``shared_expert_gate``) are :class:`Router` modules, not ``nn.Linear``: they stay in the compute dtype.

Tensor parallel: each rank holds a contiguous slice of the experts (``first_expert``, its own count) and the
whole router; it runs its experts over the tokens routed to them and leaves the others' slots out, so the
block's outputs summed over the ranks (one all-reduce, in :class:`SparseMoeBlock`) are the whole block's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from jobrunner.models import fused_ops

MOE_ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")


@dataclass(frozen=True)
class MoeShape:
    """The numbers of a config's MoE layers (``ModelShape.moe``)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool  # renormalise the k weights to sum 1
    float32_weights: bool  # Mixtral: scale expert outputs by float32 weights (Qwen: weights cast to dtype first)
    shared_expert_intermediate_size: int  # Qwen2-MoE's shared expert; 0 = none
    sparse_layers: tuple[int, ...]  # indices of the layers whose MLP is a MoE block (the rest are dense)

    def is_sparse(self, layer_index: int) -> bool:
        return layer_index in self.sparse_layers


def moe_shape(config, arch: str) -> MoeShape | None:
    """The MoE numbers of ``config`` (None for a dense architecture), as transformers decides them."""
    if arch not in MOE_ARCHITECTURES:
        return None
    layers = range(config.num_hidden_layers)
    if arch == "MixtralForCausalLM":
        num_experts = config.num_local_experts
        return MoeShape(num_experts, config.num_experts_per_tok, config.intermediate_size, True, True, 0,
                        tuple(layers))
    num_experts = config.num_experts
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    sparse = tuple(i for i in layers if i not in dense and num_experts > 0 and (i + 1) % step == 0)
    shared = getattr(config, "shared_expert_intermediate_size", 0) if arch == "Qwen2MoeForCausalLM" else 0
    return MoeShape(num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                    bool(config.norm_topk_prob), False, int(shared or 0), sparse)


class Router(nn.Module):
    """``x @ weight.T`` in the compute dtype; deliberately not an ``nn.Linear`` (never quantized or packed)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def route(logits: torch.Tensor, top_k: int, normalize: bool, float32_weights: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k], expert_ids [T, k])`` from router ``logits`` [T, E], as transformers computes them."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if float32_weights else weights.to(logits.dtype)), expert_ids


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    act = fused_ops.silu_mul(gate_up)
    if act is None:
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) * up
    return act


class ExpertMLP(nn.Module):
    """One expert as two ``nn.Linear`` layers (after :func:`unstack_experts`; quantization swaps them)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_up_proj = _linear_over(gate_up)
        self.down_proj = _linear_over(down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_silu_mul(self.gate_up_proj(x)))


def _linear_over(weight: torch.Tensor) -> nn.Linear:
    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight, requires_grad=False)  # a view of the stacked tensor: no copy
    return linear


class StackedExperts(nn.Module):
    """All experts of a layer, grouped per step so each active expert runs one GEMM over its tokens."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, first_expert: int = 0,
                 total_experts: int | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts  # held here: experts first_expert .. first_expert + num_experts - 1
        self.first_expert, self.total_experts = first_expert, total_experts or num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.per_expert: nn.ModuleList | None = None  # set by unstack_experts(): then the stacked tensors are gone
        self.row_tile: int | None = None  # deterministic mode: each expert's GEMMs on fixed tiles of rows

    def unstack_experts(self) -> None:
        """Replace the stacked tensors by one :class:`ExpertMLP` per expert (views, no copy)."""
        if self.per_expert is not None:
            return
        gate_up, down = self.gate_up_proj, self.down_proj
        self.per_expert = nn.ModuleList(ExpertMLP(gate_up[e], down[e]) for e in range(self.num_experts))
        del self.gate_up_proj, self.down_proj

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]; weights, expert_ids: [T, k] -> [T, hidden]
        num_tokens, top_k = expert_ids.shape
        if num_tokens == 0:
            return torch.zeros_like(x)
        if self.num_experts != self.total_experts:
            return self._local_experts(x, weights, expert_ids)
        flat_ids = expert_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # slot indices grouped by expert, in token order
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_of_slot = order // top_k
        out = self._grouped(x[token_of_slot], counts)  # [T * k, hidden]: each expert's tokens contiguous
        out = out * weights.reshape(-1)[order, None]
        slots = torch.empty_like(out, dtype=x.dtype)
        slots[order] = out.to(x.dtype)  # back to (token, k) order
        return slots.view(num_tokens, top_k, x.shape[1]).sum(dim=1)

    def _local_experts(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """A tensor-parallel rank's part: only the slots routed to the experts held here; the rest add zero."""
        top_k = expert_ids.shape[1]
        local = expert_ids.reshape(-1) - self.first_expert
        slot = torch.nonzero((local >= 0) & (local < self.num_experts)).squeeze(1)  # the slots held here
        result = torch.zeros_like(x)
        if slot.numel() == 0:
            return result
        order = slot[torch.argsort(local[slot], stable=True)]  # those slots grouped by expert, in token order
        counts = torch.bincount(local[order], minlength=self.num_experts).tolist()
        out = self._grouped(x[order // top_k], counts) * weights.reshape(-1)[order, None]
        return result.index_add_(0, order // top_k, out.to(x.dtype))

    def _grouped(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each expert over its contiguous rows (``counts[e]`` of them, in expert order)."""
        outs, start = [], 0
        for expert, count in enumerate(counts):
            if count:
                outs.append(self._expert(expert, rows[start:start + count]))
                start += count
        return torch.cat(outs) if len(outs) != 1 else outs[0]

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        if self.row_tile is not None and x.shape[0] != self.row_tile:
            return self._tiled(expert, x, self.row_tile)
        return self._expert_untiled(expert, x)

    def _tiled(self, expert: int, x: torch.Tensor, tile: int) -> torch.Tensor:
        """The expert on fixed tiles of ``tile`` rows (zero-padded), so a row's bits never depend on the
        number of other rows routed to this expert in the step (batch-invariant GEMM shapes)."""
        rows = x.shape[0]
        padded = -(-rows // tile) * tile
        if padded != rows:
            x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
        outs = [self._expert_untiled(expert, x[i:i + tile]) for i in range(0, padded, tile)]
        return torch.cat(outs)[:rows]

    def _expert_untiled(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        if self.per_expert is not None:
            return self.per_expert[expert](x)
        return F.linear(_silu_mul(F.linear(x, self.gate_up_proj[expert])), self.down_proj[expert])


class SparseMoeBlock(nn.Module):
    """Router + top-k experts (+ Qwen2-MoE's gated shared expert): the MLP of a sparse layer.

    ``experts``: ``(first, count)`` of a tensor-parallel rank's slice of the experts (None: all of them); then
    ``tp`` is set and the block all-reduces its sum once."""

    tp = None  # TensorParallel of a split model

    def __init__(self, hidden_size: int, moe: MoeShape, shared_expert: nn.Module | None = None,
                 experts: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob, self.float32_weights = moe.top_k, moe.norm_topk_prob, moe.float32_weights
        self.gate = Router(hidden_size, moe.num_experts)
        first, count = experts or (0, moe.num_experts)
        self.experts = StackedExperts(count, hidden_size, moe.expert_intermediate_size, first, moe.num_experts)
        self.shared_expert = shared_expert
        self.shared_expert_gate = Router(hidden_size, 1) if shared_expert is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]
        weights, expert_ids = route(self.gate(x), self.top_k, self.norm_topk_prob, self.float32_weights)
        out = self.experts(x, weights, expert_ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.tp is None else self.tp.all_reduce(out)


def unstack_experts(model: nn.Module) -> int:
    """Split every float :class:`StackedExperts` of ``model`` into per-expert ``nn.Linear`` layers (before
    quantization: each expert is then quantized on its own). Returns how many expert blocks were split."""
    blocks = [m for m in model.modules() if isinstance(m, StackedExperts) and m.per_expert is None]
    for block in blocks:
        block.unstack_experts()
    return len(blocks)


# --- checkpoint names -> our parameters

# per-expert tensors of Hub checkpoints: Qwen's mlp.experts.{e}.gate_proj, Mixtral's block_sparse_moe.experts.{e}.w1
_PER_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
# which stacked tensor, and which half of gate|up (None: the whole expert slice)
_EXPERT_PART = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                "w3": ("gate_up_proj", 1), "down_proj": ("down_proj", None), "w2": ("down_proj", None)}
STACKED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def checkpoint_target(rest: str) -> tuple[str, tuple[int, int | None] | None] | None:
    """Our name (within a layer) and expert part for a checkpoint's layer-relative name ``rest``, or None when
    it is not a MoE tensor. Parts are ``(expert, half)``: half 0/1 = gate/up rows of gate|up, None = all."""
    match = _PER_EXPERT.match(rest)
    if match:
        stacked, half = _EXPERT_PART[match.group(2)]
        return f"mlp.experts.{stacked}", (int(match.group(1)), half)
    if rest.startswith("block_sparse_moe."):  # Mixtral's router (its experts matched above)
        return "mlp." + rest[len("block_sparse_moe."):], None
    return None


def expert_slice(param: torch.Tensor, part: tuple[int, int | None]) -> torch.Tensor:
    """The view of a stacked ``param`` that one per-expert checkpoint tensor fills."""
    expert, half = part
    view = param[expert]
    if half is None:
        return view
    rows = view.shape[0] // 2
    return view[half * rows:(half + 1) * rows]


def expert_parts(param: torch.Tensor, name: str) -> list[tuple[int, int | None]]:
    """Every part of a stacked ``param`` a per-expert checkpoint must fill (to report what is missing)."""
    halves = (0, 1) if name.endswith("gate_up_proj") else (None,)
    return [(e, h) for e in range(param.shape[0]) for h in halves]
