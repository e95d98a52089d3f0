"""validate's lines for a model split over tensor-parallel ranks (engine.tensor_parallel_size > 1), from its
config.json alone: what each rank holds (q heads, KV heads and whether they are replicated, the MLP's
intermediate size, vocabulary rows), every number that does not divide (models/parallel/plan.py), and with
``cluster.gpu`` the bytes on each GPU: the rank's weights (its shards + the parts every rank holds whole), a
step's activations and the KV cache left, in tokens of the whole model.

Our engine refuses a model that does not divide; for ``engine.backend: vllm`` the same rules are printed as a
warning (vLLM checks its own at load: q heads and the MLP must divide, KV heads are replicated as here; its MoE
layers split each expert rather than the experts).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from jobrunner.engine.memory_plan import estimate_activation_bytes, kv_budget_bytes


def split_line(config: Any, world: int) -> str:
    """``tensor parallel 8: per rank 8 of 64 q heads, 1 of 8 KV heads, intermediate 3,584 of 28,672, vocabulary
    16,032 of 128,256 rows; replicated on every rank: norms, rotary`` ("(padded to N)" after the rows where the
    vocabulary is padded to a multiple of the ranks). ValueError naming every number that does not divide."""
    from jobrunner.models.parallel.plan import model_shape, plan_for_shape, shard_problems

    problems = shard_problems(config, world)
    if problems:
        raise ValueError(f"engine.tensor_parallel_size {world}: the model does not split: {'; '.join(problems)}")
    shape = model_shape(config)
    plan = plan_for_shape(shape, world)
    kv = (f"KV heads replicated: each of the {plan.total_kv_heads} KV heads on {world // plan.total_kv_heads} "
          "ranks, 1 per rank" if plan.kv_replicated else f"{plan.num_kv_heads} of {plan.total_kv_heads} KV heads")
    experts = f", {plan.num_experts} of {plan.num_experts * world} experts" if plan.num_experts else ""
    whole = ["norms", "rotary"] + (["router"] if plan.num_experts else [])
    padded = f" (padded to {plan.padded_vocab:,})" if plan.padded_vocab != plan.vocab_size else ""
    return (f"tensor parallel {world}: per rank {plan.num_heads} of {shape.num_heads} q heads, {kv}, intermediate "
            f"{plan.intermediate_size:,} of {shape.intermediate_size:,}{experts}, vocabulary {plan.vocab_per_rank:,} "
            f"of {plan.vocab_size:,} rows{padded}; replicated on every rank: "
            f"{', '.join(whole)}")


def gpu_fit_line(config: Any, *, world: int, stages: int, dtype: str, quantization: str, engine: Any,
                 context: int, gpu: str) -> tuple[str, bool]:
    """``each of 8 GPUs (H100 ...): weights 17.64 GB (0.03 GB replicated) + activations ~0.41 GB; KV 51.2 GB
    = 1,562,500 tokens (11.9 sequences of 131,072): fits`` and whether it fits. ``stages`` pipeline stages
    (vLLM) hold a share of the layers each: the weights and the KV per token are divided by them (the
    embedding and the head sit on the first and last stage: an estimate)."""
    from jobrunner.gpus import gpu_memory_bytes
    from jobrunner.models.parallel.plan import model_shape, plan_for_shape, rank_bytes
    from jobrunner.models.preflight import BYTES_PER_WEIGHT

    name = dtype if dtype != "auto" else "bfloat16"
    width = int(BYTES_PER_WEIGHT[name])
    shape = model_shape(config)
    plan = plan_for_shape(shape, world)
    weights = rank_bytes(config, world, width, quantization)
    per_gpu = weights["weights_bytes"] // stages
    rank_shape = SimpleNamespace(hidden_size=shape.hidden_size, head_dim=shape.head_dim, num_heads=plan.num_heads,
                                 num_kv_heads=plan.num_kv_heads, intermediate_size=plan.intermediate_size,
                                 vocab_size=plan.vocab_size)
    activations = estimate_activation_bytes(rank_shape, engine.max_num_batched_tokens, engine.max_num_seqs, width)
    per_head = shape.head_dim + 4 if engine.kv_cache_dtype.startswith("fp8") else shape.head_dim * width
    kv_per_token = -(-shape.num_layers // stages) * 2 * plan.num_kv_heads * per_head
    total = gpu_memory_bytes(gpu)
    kv = kv_budget_bytes(total, engine.gpu_memory_utilization, 1.0, per_gpu, activations, 0)
    gpus = world * stages
    where = f"each of {gpus} GPUs ({gpu}, {total / 2**20:,.0f} MiB x gpu_memory_utilization " \
            f"{engine.gpu_memory_utilization:g})"
    staged = f", 1/{stages} of the layers" if stages > 1 else ""
    used = (f"weights {per_gpu / 1e9:.2f} GB ({_size(weights['replicated_bytes'])} of it replicated{staged}; "
            f"the whole model {weights['whole_bytes'] / 1e9:.2f} GB) + activations ~{activations / 1e9:.2f} GB")
    if kv < kv_per_token:
        return f"{where}: {used}: does NOT fit (short by {-kv / 1e9:.2f} GB)", False
    tokens = kv // kv_per_token
    fits = tokens >= context
    verdict = "fits" if fits else f"does NOT fit one sequence of {context:,} tokens"
    return (f"{where}: {used}; KV {kv / 1e9:.2f} GB = {tokens:,} tokens ({tokens / max(context, 1):.1f} "
            f"sequences of {context:,}): {verdict}"), fits


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:.2f} GB" if num_bytes >= 1e8 else f"{num_bytes / 1e6:.1f} MB"


OFFLINE_HOW = ("to check it offline, set HF_HUB_OFFLINE=1 with a Hugging Face cache (HF_HUB_CACHE) that holds the "
               "model's config.json, or name a local directory with its config.json in model.source")


def unchecked_note(spec: Any) -> str:
    """validate's line when the model's config cannot be read from here and the worker is split over ranks:
    the split and the bytes per rank (GPU) were not checked, and how to check them offline; empty for one
    rank."""
    e = spec.engine
    if e.tensor_parallel_size == 1 and e.pipeline_parallel_size == 1:
        return ""
    what = f"tensor parallel {e.tensor_parallel_size}" + (
        f" x pipeline parallel {e.pipeline_parallel_size}" if e.pipeline_parallel_size > 1 else "")
    fit = "the bytes per GPU" if spec.cluster.num_gpus_per_worker > 0 else "the weights per rank"
    return f"\n  {what}: the split of the model and {fit} not checked; {OFFLINE_HOW}"


def parallel_section(spec: Any, config: Any, context: int, scheme: str) -> str:
    """validate's tensor-parallel lines for ``config`` (empty for one rank). ValueError when the model does not
    split (our engine) or a GPU rank cannot hold its share; for vLLM a split problem is a warning line."""
    e = spec.engine
    world, stages = e.tensor_parallel_size, e.pipeline_parallel_size
    if world == 1 and stages == 1:
        return ""
    lines = []
    if world > 1:
        try:
            lines.append(split_line(config, world))
        except ValueError as exc:
            if e.backend != "vllm":
                raise
            lines.append(f"warning: {exc} (our engine's rules; vLLM checks its own when it loads the model)")
            return "".join(f"\n  {line}" for line in lines)
    if stages > 1:
        lines.append(f"pipeline parallel {stages}: the layers split over {stages} stages (vLLM), "
                     f"{world * stages} GPUs per worker")
    gpus = spec.cluster.num_gpus_per_worker
    if gpus > 0 and spec.cluster.gpu:
        line, fits = gpu_fit_line(config, world=world, stages=stages, dtype=spec.model.dtype, quantization=scheme,
                                  engine=e, context=context, gpu=spec.cluster.gpu)
        if not fits:
            raise ValueError(f"cluster.gpu {spec.cluster.gpu}: a rank's share does not fit: {line}; quantize it "
                             "(model.quantization), raise engine.tensor_parallel_size, or lower engine.max_model_len")
        lines.append(line + (" (our estimate: vLLM measures its own)" if e.backend == "vllm" else ""))
    elif world > 1:  # a CPU worker, or GPUs of no named card: the weights each rank holds
        lines.append(_rank_weights_line(config, world, spec.model.dtype, scheme) +
                     ("; bytes per GPU not checked (set cluster.gpu, e.g. H100)" if gpus > 0 else ""))
    return "".join(f"\n  {line}" for line in lines)


def _rank_weights_line(config: Any, world: int, dtype: str, scheme: str) -> str:
    """``weights per rank 0.13 GB (1.2 MB of it replicated; the whole model 0.27 GB)``."""
    from jobrunner.models.parallel.plan import rank_bytes
    from jobrunner.models.preflight import BYTES_PER_WEIGHT

    width = int(BYTES_PER_WEIGHT[dtype if dtype != "auto" else "bfloat16"])
    weights = rank_bytes(config, world, width, scheme)
    return (f"weights per rank {_size(weights['weights_bytes'])} ({_size(weights['replicated_bytes'])} of it "
            f"replicated; the whole model {_size(weights['whole_bytes'])})")


def vllm_section(spec: Any) -> str:
    """The tensor / pipeline lines for ``engine.backend: vllm`` (its model is not built here: its config.json is
    read, nothing else), or a note when the config cannot be read from here."""
    from jobrunner.models.preflight import ConfigUnavailable, read_config

    e = spec.engine
    if e.tensor_parallel_size == 1 and e.pipeline_parallel_size == 1:
        return ""
    try:
        found = read_config(spec.model.source)
    except ConfigUnavailable as exc:
        return f"\n  tensor / pipeline split not checked: {exc}; {OFFLINE_HOW}"
    if found is None:
        return ""
    config, where = found
    context = e.max_model_len or int(getattr(config, "max_position_embeddings", 0) or 0) or 4096
    return f"\n  config read from {where}" + parallel_section(spec, config, context, spec.model.quantization)
