"""validate's fit section: will the model fit a worker? From ``config.json`` alone: our model built on
``meta`` (no weights), its weights' bytes in the job's dtype or quantization, a step's activation estimate, and
the KV cache left of the worker's GPU (``cluster.gpu``) under the engine's memory plan
(:mod:`jobrunner.engine.memory_plan`): ``gpu_memory_utilization x share x the card - weights - activations -
graphs``. ``jobrunner validate`` prints :meth:`Fit.describe`; a model that does not fit is refused there.

Quantized weights are counted as quantize-at-load stores them (:mod:`jobrunner.quant.apply`): int8 / fp8 /
w8a8 one byte per weight and a float32 scale per row; int4 half a byte and a bfloat16 scale and zero per
group of 32 along K, with the head in int8 (``INT4_INT8_LAYERS``); embeddings as int8 rows, shared with an
int8 head when tied. Norms, biases and the rope tables stay in float. The activation figure is an estimate
(the engine measures it on the GPU before sizing its cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from jobrunner.engine.memory_plan import CPU_KV_DEFAULT_BYTES, estimate_activation_bytes, kv_budget_bytes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
INT4_GROUP = 32  # quant.apply.DEFAULT_GROUP_SIZE


@dataclass(frozen=True)
class Fit:
    """The memory of one worker's engine, from the config."""

    weights_bytes: int
    activations_bytes: int
    graphs_bytes: int
    kv_bytes: int  # what is left for the KV cache (negative: the model does not fit)
    kv_bytes_per_token: int
    context: int  # tokens one sequence may hold
    where: str  # "L4 (23034 MiB) x 0.85" or "CPU: kv_cache_memory_bytes"
    budget_bytes: int | None = None

    @property
    def kv_tokens(self) -> int:
        return max(self.kv_bytes, 0) // self.kv_bytes_per_token

    @property
    def fits(self) -> bool:
        """At least one sequence of the full context fits in the KV cache."""
        return self.kv_tokens >= self.context

    def describe(self) -> str:
        """``fit on L4 ...: weights 16.06 GB + activations 0.33 GB + graphs 0.00 GB; KV 4.10 GB = 31,250 tokens
        (3.8 sequences of 8,192): fits``."""
        used = (f"weights {self.weights_bytes / 1e9:.2f} GB + activations ~{self.activations_bytes / 1e9:.2f} GB"
                f" + graphs ~{self.graphs_bytes / 1e9:.2f} GB")
        budget = f" of {self.budget_bytes / 1e9:.2f} GB" if self.budget_bytes is not None else ""
        if self.kv_bytes < self.kv_bytes_per_token:
            return f"fit on {self.where}: {used}{budget}: does NOT fit (short by {-self.kv_bytes / 1e9:.2f} GB)"
        verdict = "fits" if self.fits else f"does NOT fit one sequence of {self.context:,} tokens"
        return (f"fit on {self.where}: {used}{budget}; KV {self.kv_bytes / 1e9:.2f} GB = {self.kv_tokens:,} tokens "
                f"({self.kv_tokens / max(self.context, 1):.1f} sequences of {self.context:,}): {verdict}")


def weights_bytes(model: torch.nn.Module, scheme: str, dtype_bytes: int) -> int:
    """Bytes of ``model``'s weights (on meta: shapes only) once loaded as ``scheme`` in a ``dtype_bytes`` model."""
    total, seen = 0, set()
    linear_weights = {id(m.weight): name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    head = _linear_scheme("lm_head", scheme)
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            if scheme == "none" or param.dim() < 2:
                total += param.numel() * dtype_bytes
            elif isinstance(module, torch.nn.Embedding):  # int8 rows, shared with an int8 head it is tied to
                tied_apart = id(param) in linear_weights and head != "int8"  # the head its own copy, then
                total += _quantized(param.shape, "int8") + (_quantized(param.shape, head) if tied_apart else 0)
            else:  # a linear (or a stacked [experts, N, K] tensor: each expert a linear of its own)
                total += _quantized(param.shape, _linear_scheme(name, scheme))
    return total + sum(b.numel() * b.element_size() for b in model.buffers())


def _linear_scheme(name: str, scheme: str) -> str:
    return "int8" if scheme == "int4" and name == "lm_head" else scheme


def _quantized(shape: torch.Size, scheme: str) -> int:
    *experts, n, k = shape
    count = experts[0] if experts else 1
    if scheme == "int4" and k % INT4_GROUP == 0:
        return count * (n * k // 2 + (k // INT4_GROUP) * n * 2 * 2)
    return count * (n * k + 4 * n)  # int8, fp8, w8a8 (and int4 where K has no group of 32)


def kv_bytes_per_token(shape: Any, kv_cache_dtype: str, dtype_bytes: int) -> int:
    """K and V of every layer for one token (an fp8 cache: one byte per element and a float32 scale per head)."""
    per_head = shape.head_dim + 4 if kv_cache_dtype.startswith("fp8") else shape.head_dim * dtype_bytes
    return shape.num_layers * 2 * shape.num_kv_heads * per_head


def fit_for(config: Any, *, dtype: str, quantization: str, engine: Any, context: int, gpu: str | None,
            num_gpus_per_worker: float) -> Fit:
    """The fit of ``config`` on one worker: a GPU worker's card (``gpu``: a name or size, jobrunner.gpus), or a
    CPU worker's KV budget. ``engine``: the job's engine settings (max_num_batched_tokens, max_num_seqs,
    gpu_memory_utilization, kv_cache_memory_bytes, kv_cache_dtype, use_cuda_graphs)."""
    from jobrunner.gpus import gpu_memory_bytes
    from jobrunner.models.loader import build_model

    on_gpu = num_gpus_per_worker > 0
    name = dtype if dtype != "auto" else "bfloat16"  # auto: bfloat16 on CUDA (and on bf16 CPUs)
    model = build_model(config, getattr(torch, name), torch.device("meta"), context)
    width = DTYPE_BYTES[name]
    weights = weights_bytes(model, quantization, width)
    activations = estimate_activation_bytes(model.shape, engine.max_num_batched_tokens, engine.max_num_seqs, width)
    per_token = kv_bytes_per_token(model.shape, engine.kv_cache_dtype, width)
    if not on_gpu:
        kv = engine.kv_cache_memory_bytes or CPU_KV_DEFAULT_BYTES
        how = "engine.kv_cache_memory_bytes" if engine.kv_cache_memory_bytes else "the default 2 GiB"
        return Fit(weights, activations, 0, kv, per_token, context, f"a CPU worker (KV cache: {how})")
    graphs = estimate_activation_bytes(model.shape, engine.max_num_seqs, engine.max_num_seqs, width) \
        if engine.use_cuda_graphs is True else 0  # auto: off for our engine (EngineConfig.graphs_on)
    total = gpu_memory_bytes(gpu)
    share = min(num_gpus_per_worker, 1.0)
    kv = kv_budget_bytes(total, engine.gpu_memory_utilization, share, weights, activations, graphs)
    where = f"{gpu} ({total / 2**20:,.0f} MiB) x gpu_memory_utilization {engine.gpu_memory_utilization:g}" + (
        f" x share {share:g}" if share < 1 else "")
    return Fit(weights, activations, graphs, kv, per_token, context, where,
               int(engine.gpu_memory_utilization * share * total))


def fit_section(spec: Any, check: Any) -> str:
    """validate's fit line for the job's model (``check``: models.preflight.ModelCheck with its config), or a
    hint to set ``cluster.gpu``. ``ValueError`` when a GPU worker's card cannot hold the model."""
    if spec.engine.backend == "vllm" or spec.engine.factory or getattr(check, "config", None) is None:
        return ""
    scheme = spec.model.quantization
    if check.checkpoint_quant is not None:
        from jobrunner.quant.prequantized.formats import resolve_scheme

        scheme = resolve_scheme(scheme, check.checkpoint_quant)
    if spec.engine.tensor_parallel_size > 1:  # the split and each GPU's share (cli/validate_parallel.py)
        from jobrunner.cli.validate_parallel import parallel_section

        return parallel_section(spec, check.config, check.context, scheme)
    gpus = spec.cluster.num_gpus_per_worker
    if gpus > 0 and not spec.cluster.gpu:
        return "\n  fit: not checked (set cluster.gpu, e.g. L4 or H100, to check weights + activations + KV " \
               "against the card)"
    fit = fit_for(check.config, dtype=spec.model.dtype, quantization=scheme, engine=spec.engine,
                  context=check.context, gpu=spec.cluster.gpu, num_gpus_per_worker=gpus)
    if gpus > 0 and not fit.fits:
        raise ValueError(f"cluster.gpu {spec.cluster.gpu}: the model does not fit: {fit.describe()}; quantize it "
                         "(model.quantization), use a larger GPU, or lower engine.max_model_len")
    return "\n  " + fit.describe()
