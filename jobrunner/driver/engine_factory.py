"""How a worker builds its engine: the spec's custom factory if set, else LLMEngine.from_source."""

from __future__ import annotations

import importlib
import os
from typing import Any

from jobrunner.engine.contract import WorkerEngine, check_worker_engine
from jobrunner.redaction import redact
from jobrunner.spec import JobSpec


def engine_config_kwargs(spec: JobSpec) -> dict[str, Any]:
    """EngineConfig keyword arguments: every engine setting of the spec (the keys are EngineConfig's own
    fields, jobrunner.spec_sections), the model's dtype and a fractional worker's share of its GPU."""
    from jobrunner.engine.config import EngineConfig
    from jobrunner.engine.settings import settings_of

    gpus = spec.cluster.num_gpus_per_worker  # a fractional worker plans on its share of the card
    return {**{s.name: getattr(spec.engine, s.name) for s in settings_of(EngineConfig)}, "dtype": spec.model.dtype,
            **({"gpu_share": gpus} if 0 < gpus < 1 else {})}


def build_engine(spec: JobSpec, log_dir: str | None = None) -> WorkerEngine:
    """The engine for one worker (loaded once per worker); a custom one (``engine.factory``) must meet the
    worker engine contract (jobrunner/engine/contract.py), or the load fails naming what it lacks. ``log_dir``:
    the worker's log folder, where an engine in a process of its own (vLLM) writes its log."""
    if spec.engine.factory:
        module_name, _, func_name = spec.engine.factory.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), func_name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"engine.factory {spec.engine.factory!r}: cannot import: {exc}") from None
        engine = factory(spec, **spec.engine.factory_options)
        check_worker_engine(engine, f"engine.factory {spec.engine.factory!r}")
        return engine
    if spec.engine.backend == "vllm":
        from jobrunner.vllm_backend.build import build_vllm_engine

        return build_vllm_engine(spec, log_dir, vllm_placement_here(spec))
    if spec.engine.backend == "openai":
        from jobrunner.endpoint_backend.build import build_endpoint_engine

        return build_endpoint_engine(spec)
    if is_rank_group(spec):
        raise RuntimeError(f"engine.tensor_parallel_size={spec.engine.tensor_parallel_size}: a rank's engine is "
                           "built by build_rank_engine in its group (a lost group is replaced, not reloaded)")
    return _our_engine(spec)


def _our_engine(spec: JobSpec, tensor_parallel: Any = None) -> WorkerEngine:
    from jobrunner.engine import EngineConfig, LLMEngine

    config = EngineConfig(**engine_config_kwargs(spec))
    template = {"chat_template": spec.input.chat_template} if spec.input.chat_template else {}
    group = {"tensor_parallel": tensor_parallel} if tensor_parallel is not None else {}
    return LLMEngine.from_source(spec.model.source, dtype=spec.model.dtype, quantization=spec.model.quantization,
                                 config=config, adapters=dict(spec.model.adapters) or None, **template, **group)


def vllm_placement_here(spec: JobSpec) -> dict[str, str] | None:
    """vLLM's pipeline stages over GPUs: the placement group this worker's actor runs in, by id, and the
    cluster's address, for vLLM's Ray executor to put its ranks in (driver/rank_group.vllm_placement); None
    otherwise (vLLM's ranks are processes of this node)."""
    if spec.cluster.num_gpus_per_worker <= 0 or spec.engine.pipeline_parallel_size <= 1:
        return None
    import ray

    pg = ray.util.get_current_placement_group()
    if pg is None:
        return None
    return {"placement_group_id": pg.id.hex(), "address": ray.get_runtime_context().gcs_address}


def is_rank_group(spec: JobSpec) -> bool:
    """Whether a worker of this job is a tensor-parallel group of ranks (our engine, no custom factory,
    ``engine.tensor_parallel_size`` > 1): driver/rank_group.py."""
    return spec.engine.backend == "jobrunner" and not spec.engine.factory and spec.engine.tensor_parallel_size > 1


def build_rank(spec: JobSpec, rank: Any) -> Any:
    """One rank's engine of a tensor-parallel worker (``rank``: its ``RankSpec``): it joins the group, then loads
    its shard of the model; the leader's (rank 0) is a ``ParallelEngine`` (a worker engine), the others'
    a ``Follower`` whose ``serve()`` runs the leader's steps."""
    from jobrunner.engine.parallel import build_rank_engine

    return build_rank_engine(lambda tp: _our_engine(spec, tp), rank)


def describe_model(engine: WorkerEngine, spec: JobSpec) -> dict[str, Any]:
    """The manifest's model section: the spec's names overlaid with what the loaded engine reports
    (``model_info``), with an embed / score job's task facts (driver/pooled.py: pooling, embedding_dim, labels);
    redacted, as it is written down (a source URL may carry credentials)."""
    from jobrunner.driver.pooled import job_pooling, task_facts

    info = {"source": spec.model.source, "dtype": spec.model.dtype, "quantization": spec.model.quantization}
    if spec.model.adapters:  # what the spec names; the engine's own record (rank, targets, bytes) below
        info["adapters"] = [{"name": n, "source": s} for n, s in spec.model.adapters.items()]
    loaded = engine.model_info
    facts = task_facts(spec, loaded, job_pooling(spec, loaded))  # embed / score: pooling, dimension, labels
    info.update({k: v for k, v in loaded.items() if k not in ("device", "labels") and _is_plain(v)})
    if isinstance(loaded.get("adapters"), list):
        info["adapters"] = loaded["adapters"]  # [{name, source, rank, ranks, lora_alpha, targets, bytes}]
    return redact({**info, **facts})  # the job's pooling over the model's own default


def _is_plain(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def rebuild_engine(engine: WorkerEngine, spec: JobSpec) -> tuple[WorkerEngine, bool]:
    """A fresh engine after `engine` failed (empty queues, a new KV cache), and whether the model was loaded
    again: the engine's own `rebuild()` reuses the weights it holds; one that cannot (`NotImplementedError`)
    is closed and built anew from the spec."""
    try:
        return engine.rebuild(), False
    except NotImplementedError:
        engine.close()
        log_path = getattr(engine, "log_path", None)  # the new engine's log beside the old one's
        return build_engine(spec, os.path.dirname(log_path) if log_path else None), True


LOAD_MEMORY_KEYS = ("weights_bytes", "load_host_anon_peak_bytes", "load_host_anon_rise_bytes",
                    "load_device_peak_bytes")


def load_memory(model_info: dict[str, Any] | None) -> dict[str, int]:
    """The load's memory beside its stages in the worker's record (models/factory.load_memory_info): the
    weights as loaded and the load's peak host anonymous memory (and its rise) and device memory."""
    info = model_info if isinstance(model_info, dict) else {}
    return {k: info[k] for k in LOAD_MEMORY_KEYS if isinstance(info.get(k), int)}
