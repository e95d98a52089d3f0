"""``quantize_model``: swap every ``nn.Linear`` of a model for an int8 / int4 weight-only or fp8 layer, in place.

Per layer, in order: skipped by request -> kept float; int4 wanted -> the largest allowed group size not above
the requested one that divides ``in_features`` (576 = 9 x 64 in SmolLM2 takes 64 when 128 is asked); int4
impossible for the shape (e.g. ``out_features % 16`` on CPU) -> int8, with the reason recorded. int8 takes
any 2-D float weight; fp8 takes any shape on CPU and multiples of 16 on CUDA (else int8). A tied
``lm_head`` gets its own quantized weight; embeddings become int8 rows, sharing
the ``lm_head`` tensor when both are int8 (or int4 on CPU); ``quantize_embeddings=False`` keeps them float.
MoE experts (stacked ``[E, ., .]`` tensors, :mod:`jobrunner.models.moe`) are first split into one ``nn.Linear``
pair per expert (by any module's ``unstack_experts()``: quant imports no model code), so each expert is quantized
like any layer (``layers.0.mlp.experts.per_expert.3.down_proj``, its own per-channel scales); MoE routers are
not ``nn.Linear`` and stay in the compute dtype.
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Iterable, Mapping

import torch

from jobrunner.quant.dispatch import QuantDispatch, dispatch_for
from jobrunner.quant.embedding import Int4SharedEmbedding, Int8Embedding
from jobrunner.quant.fp8 import Fp8Linear, fp8_shape_problem
from jobrunner.quant.int4 import Int4WeightOnlyLinear
from jobrunner.quant.int8 import Int8WeightOnlyLinear
from jobrunner.quant.kernels import INT4_GROUP_SIZES, int4_shape_problem
from jobrunner.quant.report import LayerQuant, QuantReport
from jobrunner.quant.smooth import mlp_pairs, smooth_mlps
from jobrunner.quant.tiled import DequantBuffer
from jobrunner.quant.w8a8 import W8A8Linear

SCHEMES = ("none", "int8", "int4", "fp8", "w8a8")
QUANTIZED_LINEARS = (Int8WeightOnlyLinear, Int4WeightOnlyLinear, Fp8Linear, W8A8Linear)
# Chosen by measurement on SmolLM2-135M (docs/quantization.md): perplexity +7% at 32 vs +36% at 64 (the
# kernels run both at the same speed); int4 bytes stay at 0.31x of bf16. 128 does not divide K = 576.
DEFAULT_GROUP_SIZE = 32
# w8a8 keeps these layers int8 weight-only: the input of down_proj (SiLU(gate) * up) has outlier channels that a
# per-token int8 scale flattens ... unless its input smoothing was folded into gate_up_proj (quant/smooth.py),
# which marks the layer SMOOTHED (every MLP whose gate_up_proj is W8A8 too; docs/quantization.md)
W8A8_WEIGHT_ONLY = ("*.down_proj",)
# int4 stores these layers (and so a tied embedding) in int8 unless an override says otherwise: on SmolLM2-135M
# the int4 head alone cost 5 points of perplexity (+5.40% -> +0.21% vs float32 on 10,065 held-out tokens,
# docs/quantization.md) for 0.625 -> 1 byte per head weight. Int4 recipes elsewhere keep the head wider too.
INT4_INT8_LAYERS = ("lm_head",)
INT4_INT8_NOTE = "stored in int8 under int4"  # the report's note on such a layer (read by the manifest line)
SMOOTH_DOWN_PROJ = True
SMOOTHED = "w8a8_smoothed"


def check_scheme(scheme: str) -> str:
    """Normalise ``scheme`` or raise ``ValueError`` naming the allowed values."""
    normalized = str(scheme).strip().lower()
    if normalized not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}: expected one of {'|'.join(SCHEMES)}")
    return normalized


def quantize_model(model: torch.nn.Module, scheme: str, *, group_size: int | None = None,
                   skip: Iterable[str] = (), overrides: Mapping[str, str] | None = None,
                   quantize_embeddings: bool = True, capability: str | None = None) -> QuantReport:
    """Quantize every ``nn.Linear`` of ``model`` in place (weight-only) and report what happened.

    ``scheme``: ``none`` | ``int8`` (per-channel) | ``int4`` (group-wise, ``group_size`` default 32) |
    ``fp8`` (e4m3, per-channel weight scales; W8A8 with per-token activation scales on CUDA sm89+) |
    ``w8a8`` (int8 per-channel weights and per-token int8 activations, one int8 GEMM; CPUs with VNNI / AMX,
    int8 weight-only elsewhere: see :mod:`jobrunner.quant.w8a8`).
    ``skip``: layer names or glob patterns (``"lm_head"``, ``"*.down_proj"``) to keep in float.
    ``overrides``: pattern -> scheme for some layers, e.g. ``{"*.down_proj": "int8"}``. Under ``int4`` the
    layers of :data:`INT4_INT8_LAYERS` (``lm_head``) are int8 unless overridden (``{"lm_head": "int4"}``).
    ``quantize_embeddings``: also store ``nn.Embedding`` tables quantized (shared with a tied head).
    ``capability``: force the CPU capability the kernels are chosen for (see :mod:`jobrunner.quant.dispatch`).
    Call it after the model is on its final device: int4 weights are packed for that device's kernel.
    To quantize layer by layer while a model loads, use :class:`QuantSession` (``quant/at_load.py``).
    """
    session = QuantSession(model, scheme, group_size=group_size, skip=skip, overrides=overrides,
                           quantize_embeddings=quantize_embeddings, capability=capability)
    session.quantize_under("")
    return session.finish()


class QuantSession:
    """One quantization of one model, run part by part: :meth:`quantize_under` a module prefix (a decoder
    layer the moment it is loaded), then :meth:`finish` (what is left, the tied embedding and head, the report).

    Built on the model before its weights exist (on ``meta``, with ``device`` the one they will be loaded
    on): the rules, the dispatch and the ties are settled from names and shapes alone.
    """

    def __init__(self, model: torch.nn.Module, scheme: str, *, group_size: int | None = None,
                 skip: Iterable[str] = (), overrides: Mapping[str, str] | None = None,
                 quantize_embeddings: bool = True, capability: str | None = None,
                 device: torch.device | None = None) -> None:
        scheme = check_scheme(scheme)
        if group_size is not None and group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"group_size {group_size} not supported: expected one of {INT4_GROUP_SIZES}")
        rules = {pattern: check_scheme(s) for pattern, s in (overrides or {}).items()}
        self.head_policy = tuple(p for p in INT4_INT8_LAYERS if p not in rules) if scheme == "int4" else ()
        rules.update({pattern: "int8" for pattern in self.head_policy})  # after the caller's patterns: theirs win
        rules.update({pattern: "none" for pattern in skip})
        self.model, self.scheme, self.rules = model, scheme, rules
        self.requested_group = group_size or DEFAULT_GROUP_SIZE
        self.quantize_embeddings = quantize_embeddings
        self.num_smoothed = 0  # MLPs whose down_proj input smoothing was folded (one note at the end)
        self.done: set[str] = set()  # the linears handled (quantized, or kept in float by a rule)
        self.seconds = 0.0  # spent quantizing (a streamed load reports it apart from reading the weights)
        self.report = QuantReport(scheme=scheme, group_size=self.requested_group if scheme == "int4" else None)
        self.dispatch, self.scratch = None, DequantBuffer()
        if scheme != "none":
            device = device or next((p.device for p in model.parameters()), torch.device("cpu"))
            self.dispatch = dispatch_for(device, capability)
            self.report.dispatch = self.dispatch.to_dict()
        self.report.model_bf16_bytes, self.report.model_bytes_before = _model_bytes(model)
        self.tied = _tied_embeddings(model)  # by name: a streamed load makes new tensors, ids change
        shared = _shared_parameters(model)  # once, not per layer: a MoE model has thousands of expert linears
        self.shared_linears = {name for name, linear in _linears(model) if id(linear.weight) in shared}

    def quantize_under(self, prefix: str) -> None:
        """Quantize the float linears under module ``prefix`` ("" = the whole model) and its embeddings, a
        tied embedding after the head that shares it (its weight is the embedding's, so loaded with it)."""
        start = time.perf_counter()
        root = self.model.get_submodule(prefix) if prefix else self.model
        if self.scheme != "none":
            _split_stacked(root)
        self.num_smoothed += _smooth_for_w8a8(self.model, self.scheme, self.dispatch, self.rules, prefix)
        names = [name for name, _ in _linears(root, prefix)]
        embeddings = [name for name, _ in _embeddings(root, prefix)]
        names += [self.tied[e] for e in embeddings if e in self.tied and self.tied[e] not in names]
        for name in names:  # by name: a layer's float weight is freed as soon as it is swapped
            if name not in self.done:
                self._quantize_linear(name, self.model.get_submodule(name))
        if self.scheme != "none" and self.quantize_embeddings:
            tied = {e: self.tied[e] for e in embeddings if e in self.tied}
            _quantize_embeddings(self.model, tied, self._kept_float(), self.report, set(embeddings))
        self.seconds += time.perf_counter() - start

    def _quantize_linear(self, name: str, linear: torch.nn.Linear) -> None:
        report = self.report
        self.done.add(name)
        layer_scheme = next((s for p, s in self.rules.items() if _matches(name, p)), self.scheme)
        layer_scheme = "none" if self.scheme == "none" else layer_scheme
        report.linear_bf16_bytes += linear.weight.numel() * 2
        report.layers.append(_quantize_one(self.model, name, linear, layer_scheme, self.requested_group, report,
                                           (self.dispatch, self.scratch), name in self.shared_linears))
        del linear
        report.linear_bytes_after += report.layers[-1].bytes_after
        if _is_skipped(name, self.head_policy) and report.layers[-1].scheme == "int8":
            report.notes.append(f"{name} {INT4_INT8_NOTE} (INT4_INT8_LAYERS: the int4 head cost ~5 "
                                "points of perplexity; override with {'lm_head': 'int4'})")

    def _kept_float(self) -> tuple[str, ...]:
        return tuple(p for p, s in self.rules.items() if s == "none")

    def finish(self) -> QuantReport:
        """Quantize what is left (layers never handed over, a tied head and its embedding); the report."""
        start = time.perf_counter()
        for name in [name for name, _ in _linears(self.model) if name not in self.done]:
            self._quantize_linear(name, self.model.get_submodule(name))  # a layer kept in float stays float
        if self.scheme != "none" and self.quantize_embeddings:
            _quantize_embeddings(self.model, self.tied, self._kept_float(), self.report)
        # plus the kernels' own weight copies that are not buffers (oneDNN's prepacked W8A8 weights)
        self.report.model_bytes_after = _model_bytes(self.model)[1] + sum(
            m.kernel_bytes() for m in self.model.modules() if isinstance(m, W8A8Linear))
        self.report.scratch_bytes = self.scratch.nbytes()
        if self.num_smoothed:
            self.report.notes.append(f"{self.num_smoothed} MLPs: down_proj input smoothing folded into "
                                     "gate_up_proj (data-free, see quant/smooth.py); their down_proj runs W8A8")
        self.seconds += time.perf_counter() - start
        return self.report


def _quantize_one(model: torch.nn.Module, name: str, linear: torch.nn.Linear, scheme: str, group_size: int,
                  report: QuantReport, kernels: tuple[QuantDispatch | None, DequantBuffer], is_tied: bool
                  ) -> LayerQuant:
    entry = LayerQuant(name=name, shape=tuple(linear.weight.shape), scheme="none",
                       bytes_before=_nbytes(linear.weight))
    if scheme == "none":
        if report.scheme != "none":
            report.notes.append(f"{name} kept in float (skip)")
    else:
        if is_tied:
            report.notes.append(f"{name} is tied to another parameter: quantized its own copy")
        _set_module(model, name, _quantize_linear(linear, scheme, group_size, entry, kernels, is_tied))
    entry.bytes_after = _layer_weight_bytes(model.get_submodule(name))
    return entry


def _split_stacked(model: torch.nn.Module) -> None:
    """Let every module holding stacked per-expert weights split them into ``nn.Linear`` layers
    (``unstack_experts()``: views, no copy), so the loop over linears quantizes each expert with its own scales."""
    for module in list(model.modules()):
        unstack = getattr(module, "unstack_experts", None)
        if callable(unstack):
            unstack()


def _tied_embeddings(model: torch.nn.Module) -> dict[str, str]:
    """Embedding name -> name of the linear layer that shares its weight (a tied ``lm_head``)."""
    linear_by_weight = {id(mod.weight): name for name, mod in _linears(model)}
    return {name: linear_by_weight[id(mod.weight)] for name, mod in model.named_modules()
            if isinstance(mod, torch.nn.Embedding) and id(mod.weight) in linear_by_weight}


def _embeddings(root: torch.nn.Module, prefix: str = "") -> list[tuple[str, torch.nn.Embedding]]:
    """The float ``nn.Embedding`` tables under ``root`` (named from the model's root: ``prefix``)."""
    return [(_join(prefix, n), m) for n, m in root.named_modules()
            if type(m) is torch.nn.Embedding and m.weight.is_floating_point()]


def _quantize_embeddings(model: torch.nn.Module, tied: dict[str, str], patterns: tuple[str, ...],
                         report: QuantReport, only: set[str] | None = None) -> None:
    """int8 rows for every float embedding (of ``only``, if given); one shared tensor with a tied int8 head."""
    for name, emb in _embeddings(model):
        if only is not None and name not in only:
            continue
        if _is_skipped(name, patterns):
            report.notes.append(f"{name} kept in float (skip)")
            continue
        head = model.get_submodule(tied[name]) if name in tied else None
        if isinstance(head, torch.nn.Linear):
            report.notes.append(f"{name} kept in float: its tied {tied[name]} is float")
            continue
        if isinstance(head, (Int8WeightOnlyLinear, W8A8Linear)):
            new = Int8Embedding.from_int8_linear(head, emb.weight.dtype)
            report.notes.append(f"{name} shares the int8 weight of {tied[name]}")
        elif isinstance(head, Int4WeightOnlyLinear) and head.cpu_layout is not None:
            new = Int4SharedEmbedding(head, emb.weight.dtype)
            report.notes.append(f"{name} shares the int4 weight of {tied[name]}")
        else:
            new = Int8Embedding.from_embedding(emb)
            report.notes.append(f"{name} quantized to int8 rows")
        _set_module(model, name, new)


def _quantize_linear(linear: torch.nn.Linear, scheme: str, group_size: int, entry: LayerQuant,
                     kernels: tuple[QuantDispatch | None, DequantBuffer], is_tied: bool = False) -> torch.nn.Module:
    if scheme == "w8a8":
        kernel, problem = _w8a8_kernel(linear, kernels[0])
        if problem is None and _is_skipped(entry.name, W8A8_WEIGHT_ONLY) and not getattr(linear, SMOOTHED, False):
            problem = "w8a8 keeps this layer's activations in float (outlier channels, see W8A8_WEIGHT_ONLY)"
        if problem is None:
            entry.scheme = "w8a8"
            # a tied head keeps its plain int8 weight: the embedding reads its rows
            return W8A8Linear.from_linear(linear, kernel, kernels[0].kernel_tokens("w8a8"), keep_plain=is_tied)
        entry.fallback_reason = f"{problem}; used int8 weight-only"
    if scheme == "fp8":
        problem = fp8_shape_problem(linear.out_features, linear.in_features, linear.weight.device)
        if problem is None:
            entry.scheme = "fp8"
            return Fp8Linear.from_linear(linear, *kernels)
        entry.fallback_reason = f"fp8 kernel cannot take this shape ({problem}); used int8"
    if scheme == "int4":
        group, problem = _pick_group_size(linear, group_size)
        if problem is None:
            entry.scheme, entry.group_size = "int4", group
            if group != group_size:
                entry.fallback_reason = (
                    f"group size {group_size} does not divide {linear.in_features}; used {group}")
            return Int4WeightOnlyLinear.from_linear(linear, group, *kernels)
        entry.fallback_reason = f"int4 kernel cannot take this shape ({problem}); used int8"
    entry.scheme = "int8"
    return Int8WeightOnlyLinear.from_linear(linear, *kernels)


def _smooth_for_w8a8(model: torch.nn.Module, scheme: str, dispatch: QuantDispatch | None,
                     rules: Mapping[str, str], prefix: str = "") -> int:
    """Fold input smoothing into every MLP whose gate_up and down both become W8A8 (quant/smooth.py); their
    ``down_proj`` is then W8A8 too (marked ``SMOOTHED``) instead of int8 weight-only."""
    if scheme != "w8a8" or dispatch is None or dispatch.w8a8_kernel is None or not SMOOTH_DOWN_PROJ:
        return 0
    root = model.get_submodule(prefix) if prefix else model
    names = {_join(prefix, n) for n, _ in mlp_pairs(root) if all(
        next((s for p, s in rules.items() if _matches(f"{_join(prefix, n)}.{c}", p)), scheme) == "w8a8"
        for c in ("gate_up_proj", "down_proj"))}
    done = smooth_mlps(model, names)
    for name in done:
        setattr(model.get_submodule(f"{name}.down_proj"), SMOOTHED, True)
    return len(done)


def _w8a8_kernel(linear: torch.nn.Linear, dispatch: QuantDispatch | None) -> tuple[str, str | None]:
    """The CPU W8A8 kernel for this layer, or why none runs here (then the layer is int8 weight-only)."""
    if linear.weight.device.type != "cpu":
        return "", f"w8a8 is a CPU scheme (weight on {linear.weight.device}; use fp8 on CUDA)"
    kernel = dispatch.w8a8_kernel if dispatch is not None else None
    if kernel is None:
        capability = dispatch.capability if dispatch is not None else "unknown"
        return "", f"no int8 dot-product hardware (capability {capability}, needs VNNI or AMX)"
    return kernel, None


def _pick_group_size(linear: torch.nn.Linear, requested: int) -> tuple[int, str | None]:
    """The largest allowed group size <= ``requested`` that the kernel takes, else (requested, why not).

    The reason given is the one for the smallest group size tried, i.e. what no group size can fix.
    """
    problem = None
    for group in sorted((g for g in INT4_GROUP_SIZES if g <= requested), reverse=True):
        problem = int4_shape_problem(linear.out_features, linear.in_features, group, linear.weight.device)
        if problem is None:
            return group, None
    return requested, problem


def _linears(root: torch.nn.Module, prefix: str = "") -> list[tuple[str, torch.nn.Linear]]:
    """The float ``nn.Linear`` layers under ``root`` (named from the model's root: ``prefix``)."""
    return [(_join(prefix, name), mod) for name, mod in root.named_modules()
            if isinstance(mod, torch.nn.Linear) and mod.weight.is_floating_point()]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _matches(name: str, pattern: str) -> bool:
    return name == pattern or name.endswith("." + pattern) or fnmatch.fnmatchcase(name, pattern)


def _is_skipped(name: str, patterns: tuple[str, ...]) -> bool:
    return any(_matches(name, p) for p in patterns)


def _shared_parameters(model: torch.nn.Module) -> set[int]:
    """Ids of the parameters registered more than once (a linear tied to the input embedding)."""
    seen: set[int] = set()
    shared: set[int] = set()
    for _, p in model.named_parameters(remove_duplicate=False):
        (shared if id(p) in seen else seen).add(id(p))
    return shared


def _set_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _layer_weight_bytes(module: torch.nn.Module) -> int:
    if isinstance(module, QUANTIZED_LINEARS):
        return module.weight_bytes()
    return _nbytes(module.weight)


def _model_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes if every float tensor were bfloat16, actual bytes) over unique parameters and buffers."""
    seen: set[int] = set()
    bf16 = actual = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        actual += _nbytes(t)
        bf16 += t.numel() * 2 if t.is_floating_point() else _nbytes(t)
    return bf16, actual
