"""How a worker builds its engine: the spec's custom factory if set, else LLMEngine.from_source."""

from __future__ import annotations

import importlib
from typing import Any

from jobrunner.redaction import redact
from jobrunner.spec import JobSpec


def engine_config_kwargs(spec: JobSpec) -> dict[str, Any]:
    """EngineConfig keyword arguments: every engine setting of the spec (the keys are EngineConfig's own
    fields, jobrunner.spec_sections) and the model's dtype."""
    from jobrunner.engine.config import EngineConfig
    from jobrunner.engine.settings import settings_of

    return {**{s.name: getattr(spec.engine, s.name) for s in settings_of(EngineConfig)}, "dtype": spec.model.dtype}


def build_engine(spec: JobSpec) -> Any:
    """The engine for one worker (loaded once per worker)."""
    if spec.engine.factory:
        module_name, _, func_name = spec.engine.factory.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), func_name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"engine.factory {spec.engine.factory!r}: cannot import: {exc}") from None
        return factory(spec, **spec.engine.factory_options)
    from jobrunner.engine import EngineConfig, LLMEngine

    config = EngineConfig(**engine_config_kwargs(spec))
    template = {"chat_template": spec.input.chat_template} if spec.input.chat_template else {}
    return LLMEngine.from_source(spec.model.source, dtype=spec.model.dtype, quantization=spec.model.quantization,
                                 config=config, adapters=dict(spec.model.adapters) or None, **template)


def describe_model(engine: Any, spec: JobSpec) -> dict[str, Any]:
    """The manifest's model section, from what the loaded engine reports (falling back to the spec), with an
    embed / score job's task facts (driver/pooled.py: pooling, embedding_dim, labels); redacted, as it is
    written down (a source URL may carry credentials)."""
    from jobrunner.driver.pooled import job_pooling, task_facts

    info = {"source": spec.model.source, "dtype": spec.model.dtype, "quantization": spec.model.quantization}
    if spec.model.adapters:  # what the spec names; the engine's own record (rank, targets, bytes) below
        info["adapters"] = [{"name": n, "source": s} for n, s in spec.model.adapters.items()]
    loaded = getattr(engine, "model_info", None)  # what the real engine says it loaded
    loaded = loaded if isinstance(loaded, dict) else None
    facts = task_facts(spec, loaded, job_pooling(spec, loaded))  # embed / score: pooling, dimension, labels
    if loaded is not None:
        info.update({k: v for k, v in loaded.items() if k not in ("device", "labels") and _is_plain(v)})
        if isinstance(loaded.get("adapters"), list):
            info["adapters"] = loaded["adapters"]  # [{name, source, rank, ranks, lora_alpha, targets, bytes}]
        return redact({**info, **facts})  # the job's pooling over the model's own default
    for key in ("dtype", "quantization", "architecture"):
        value = getattr(engine, key, None)
        if value is not None:
            info[key] = str(value).replace("torch.", "")
    return redact({**info, **facts})


def _is_plain(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def rebuild_engine(engine: Any, spec: JobSpec) -> tuple[Any, bool]:
    """A fresh engine after `engine` failed (empty queues, a new KV cache), and whether the model was loaded
    again. The weights the worker holds are reused: an engine's own `rebuild()` if it has one, our LLMEngine
    rebuilt over its model and tokenizer; only a custom engine with neither is built (loaded) anew."""
    if callable(getattr(engine, "rebuild", None)):
        return engine.rebuild(), False
    from jobrunner.engine import LLMEngine

    if not isinstance(engine, LLMEngine):
        _free_device_memory()
        return build_engine(spec), True
    args = (engine.model, engine.tokenizer, engine.config, engine.eos_token_ids, engine.model_info)
    draft = engine.draft  # a draft model's weights are reused too
    engine.runner = engine.kv_manager = engine.scheduler = engine.speculator = None  # old KV caches go first
    _free_device_memory()
    return LLMEngine(*args, chat_template=engine.chat_template, draft=draft), False


def _free_device_memory() -> None:
    import gc

    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - a device that cannot even free its cache fails the rebuild next
        pass
