"""LoRA adapters per request: rows of different adapters in one step, the adapter matmuls grouped per adapter.

:func:`attach_adapters` wraps each adapted layer of our decoder (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj``; the base layer stays what it is: float, packed, quantized) in a :class:`LoraLinear` and returns
the model's :class:`AdapterSet`. Every step the model runner tells the set which token rows belong to which
adapter (:meth:`AdapterSet.step`, a context manager, built once per step and read by every layer); a wrapped
layer then computes, for each adapter present in the step,

    out[rows_a, c0:c1] += (x[rows_a] @ A_a.T) @ B_a.T

where ``A_a`` stacks the adapter's ``lora_A`` of the PEFT modules this layer fuses (q, k, v: ``[r_q + r_k +
r_v, in]``) and ``B_a`` is their ``lora_B`` (scaled) laid out block-diagonally over the columns they touch,
so each adapter costs two small GEMMs per layer whatever its targets. Rows without an adapter (id 0) are
untouched; adapters may have different ranks and targets. A step of k adapters runs k such pairs, never k
steps. Row groups are a slice when the adapter's tokens are contiguous (one request, or requests the step
lists together), else an index gather / ``index_add_``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from jobrunner.models.lora_files import LayerDims, LoraAdapter, LoraPiece, read_adapter

BASE = 0  # the adapter id of rows that run the base model alone

RowGroup = tuple[int, slice | torch.Tensor]  # (adapter id, the step's token rows of that adapter)


@dataclass
class LoraWeights:
    """One adapter's update on one layer: ``out[:, col_start:col_end] += (x @ a.T) @ b.T``."""

    a: torch.Tensor  # [R, in]  (the stacked lora_A of every PEFT module this layer fuses)
    b: torch.Tensor  # [col_end - col_start, R]  (their scaled lora_B, block-diagonal)
    col_start: int
    col_end: int

    @classmethod
    def from_pieces(cls, pieces: list[LoraPiece]) -> LoraWeights:
        start, end = min(p.col_start for p in pieces), max(p.col_end for p in pieces)
        a = torch.cat([p.a for p in pieces])
        b = a.new_zeros(end - start, a.shape[0])
        rank_at = 0
        for p in pieces:
            r = p.a.shape[0]
            b[p.col_start - start:p.col_end - start, rank_at:rank_at + r] = p.b
            rank_at += r
        return cls(a, b, start, end)


class LoraLinear(nn.Module):
    """A base linear layer plus the LoRA updates of the adapters in the current step (see the module doc)."""

    def __init__(self, base: nn.Module, groups: StepGroups) -> None:
        super().__init__()
        self.base = base
        self.groups = groups  # shared by every wrapped layer of the model; set per step by AdapterSet.step
        self.adapters: dict[int, LoraWeights] = {}  # adapter id -> its weights on this layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> out: [T, out]
        out = self.base(x)
        for adapter_id, rows in self.groups.rows:
            weights = self.adapters.get(adapter_id)
            if weights is None:
                continue
            c0, c1 = weights.col_start, weights.col_end
            if isinstance(rows, slice):  # one contiguous run: the update accumulates in place (no delta tensor)
                h = x[rows] @ weights.a.t()
                target = out[rows, c0:c1]
                if target.dtype == h.dtype:
                    target.addmm_(h, weights.b.t())
                else:
                    target += (h @ weights.b.t()).to(target.dtype)
            else:
                delta = (x.index_select(0, rows) @ weights.a.t()) @ weights.b.t()
                out[:, c0:c1].index_add_(0, rows, delta.to(out.dtype))
        return out

    def extra_repr(self) -> str:
        return f"adapters={sorted(self.adapters)}"


class StepGroups:
    """The current step's ``(adapter id, token rows)`` groups: empty outside a step (base model only)."""

    def __init__(self) -> None:
        self.rows: list[RowGroup] = []


class AdapterSet:
    """The adapters attached to one model: names, ids (1..n; 0 is the base model), what each is, the step."""

    def __init__(self, adapters: list[LoraAdapter]) -> None:
        self.adapters = list(adapters)
        self.name_to_id = {a.name: i + 1 for i, a in enumerate(self.adapters)}
        self.groups = StepGroups()

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.adapters]

    @property
    def num_bytes(self) -> int:
        """Bytes of every adapter's weights (on the model's device)."""
        return sum(a.num_bytes for a in self.adapters)

    @property
    def max_rank_sum(self) -> int:
        """The widest stacked rank of any layer of any adapter (sizes the per-step activation workspace)."""
        return max((sum(p.a.shape[0] for p in pieces) for a in self.adapters for pieces in a.pieces.values()),
                   default=0)

    def id_of(self, name: str | None) -> int:
        """The adapter id of ``name`` (None or "" is the base model); ValueError naming the known adapters."""
        if not name:
            return BASE
        if name not in self.name_to_id:
            known = ", ".join(self.name_to_id) or "none"
            raise ValueError(f"unknown adapter {name!r} (model.adapters: {known})")
        return self.name_to_id[name]

    def describe(self) -> list[dict]:
        """The manifest's record of the adapters (name, source, rank, targets, bytes)."""
        return [a.describe() for a in self.adapters]

    @contextlib.contextmanager
    def step(self, groups: list[RowGroup]) -> Iterator[None]:
        """Every wrapped layer adds these groups' updates until the block ends (then: base model only)."""
        self.groups.rows = groups
        try:
            yield
        finally:
            self.groups.rows = []

    def token_groups(self, row_adapters: list[int], query_starts: list[int], query_lens: list[int],
                     device: torch.device) -> list[RowGroup]:
        """A step's token rows per adapter from its rows' adapter ids; built once per step, shared by all layers.

        An adapter whose tokens are one contiguous run gets a slice; the others share one index upload."""
        runs: dict[int, list[int]] = {}
        for adapter_id, start, n in zip(row_adapters, query_starts, query_lens):
            if adapter_id != BASE:
                runs.setdefault(adapter_id, []).extend(range(start, start + n))
        groups: list[RowGroup] = []
        gathered: list[tuple[int, list[int]]] = []
        for adapter_id, rows in runs.items():
            if rows[-1] - rows[0] + 1 == len(rows):
                groups.append((adapter_id, slice(rows[0], rows[-1] + 1)))
            else:
                gathered.append((adapter_id, rows))
        if gathered:
            flat = torch.tensor([r for _, rows in gathered for r in rows], dtype=torch.long).to(device)
            for (adapter_id, _), part in zip(gathered, flat.split([len(rows) for _, rows in gathered])):
                groups.append((adapter_id, part))
        return groups


def layer_dims(model: nn.Module) -> LayerDims:
    """The fused layers' column widths of our decoder."""
    s = model.shape
    attn = model.layers[0].self_attn
    intermediate = next((layer.mlp.intermediate_size for layer in model.layers
                         if hasattr(layer.mlp, "gate_up_proj")), s.intermediate_size)
    return LayerDims(s.hidden_size, attn.q_size, attn.kv_size, intermediate)


def check_not_split(model: nn.Module) -> None:
    """Refuse adapters on a tensor-parallel rank's model: their A / B matrices are not sliced to its shard."""
    tp = getattr(model, "tensor_parallel", None)
    if tp is not None:
        raise ValueError(f"LoRA adapters are not supported with tensor_parallel_size {tp.world}: "
                         "use tensor_parallel_size 1 (or merge the adapter into the checkpoint)")


def load_adapters(model: nn.Module, name_to_dir: dict[str, tuple[str, Path]]) -> list[LoraAdapter]:
    """Read each ``name -> (source, local dir)`` adapter for ``model`` (its dtype and device)."""
    if name_to_dir:
        check_not_split(model)
    device = next(model.parameters()).device
    dims = layer_dims(model)
    return [read_adapter(name, source, path, dims, model.shape.num_layers, model.dtype, device)
            for name, (source, path) in name_to_dir.items()]


def attach_adapters(model: nn.Module, adapters: list[LoraAdapter]) -> AdapterSet:
    """Wrap the adapted layers of ``model`` in :class:`LoraLinear` (in place) and set ``model.lora``."""
    if model.lora is not None:
        raise ValueError("the model already has adapters attached")
    if adapters:
        check_not_split(model)
    adapter_set = AdapterSet(adapters)
    for adapter_id, adapter in enumerate(adapters, start=1):
        for (layer_index, name), pieces in adapter.pieces.items():
            _wrapped(model, layer_index, name, adapter_set, adapter.name).adapters[adapter_id] = \
                LoraWeights.from_pieces(pieces)
    model.lora = adapter_set
    return adapter_set


def _wrapped(model: nn.Module, layer_index: int, name: str, adapter_set: AdapterSet, adapter: str) -> LoraLinear:
    """Layer ``layer_index``'s module ``name`` (e.g. ``mlp.gate_up_proj``), wrapped once."""
    parent_name, _, attr = name.rpartition(".")
    parent = model.layers[layer_index].get_submodule(parent_name)
    module = getattr(parent, attr, None)
    if module is None:
        raise ValueError(f"adapter {adapter!r}: layer {layer_index} has no {name} (a mixture-of-experts layer?): "
                         "LoRA is supported on dense layers only")
    if not isinstance(module, LoraLinear):
        module = LoraLinear(module, adapter_set.groups)
        setattr(parent, attr, module)
    return module
