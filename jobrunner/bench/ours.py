"""Our engine on pre-tokenized prompts: build, warm up (untimed), then one timed continuous-batching run."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import torch

from jobrunner.bench.result import RunResult, peak_memory, reset_peak_memory, sync
from jobrunner.engine import EngineConfig, SamplingParams
from jobrunner.engine.profile import StepProfiler
from jobrunner.engine.settings import setting_default

WARMUP_PROMPTS = 2
WARMUP_TOKENS = 4


@dataclass(frozen=True)
class EngineOptions:
    """How to build our engine for a bench run; the engine settings default to :class:`EngineConfig`'s own (what a
    job gets), never to numbers of the bench's own."""

    model: str
    dtype: str = "auto"
    quantization: str = "none"
    device: str = setting_default(EngineConfig, "device")
    max_num_seqs: int = setting_default(EngineConfig, "max_num_seqs")
    max_num_batched_tokens: int = setting_default(EngineConfig, "max_num_batched_tokens")
    speculative: str = setting_default(EngineConfig, "speculative")
    attention_backend: str = setting_default(EngineConfig, "attention_backend")
    tensor_parallel_size: int = 1  # ranks (ours: local processes, engine/parallel spawn_local; vLLM: its own)

    def config(self, prefix_caching: bool) -> EngineConfig:
        return EngineConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                            enable_prefix_caching=prefix_caching, device=self.device, speculative=self.speculative,
                            attention_backend=self.attention_backend, tensor_parallel_size=self.tensor_parallel_size)


def build_engine(options: EngineOptions, prefix_caching: bool):
    """An ``LLMEngine`` for ``options`` (quantization is passed through to ``from_source``)."""
    from jobrunner.engine.llm_engine import LLMEngine

    return LLMEngine.from_source(options.model, options.dtype, options.quantization,
                                 config=options.config(prefix_caching))


def release(engine) -> None:
    """Drop an engine's model and KV cache now, through the engine contract's ``close`` (the caller must drop
    its own reference too)."""
    if hasattr(engine, "model"):
        engine.model = None  # our engine: its weights go with it (close keeps them for a rebuild)
    engine.close()


def warm_up(engine) -> None:
    """A few short requests of synthetic tokens (they share no prefix with the real prompts), through the
    worker engine contract (any backend)."""
    params = SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + 13 * k + 3) % 1000 + 100 for i in range(24)] for k in range(WARMUP_PROMPTS)]
    for k, ids in enumerate(prompts):
        engine.add_request(f"warm-up-{k}", ids, params)
    while engine.has_unfinished_requests():
        engine.step()


def run_ours(engine, token_ids: list[list[int]], max_tokens: int, ignore_eos: bool, name: str,
             progress=None, profile: bool = False) -> RunResult:
    """Time from the first ``add_request`` to the last output; engine stats are the run's own (deltas).
    ``progress(finished, tokens_sampled, done=False)`` is called after every step when given. ``profile``:
    time the steps' parts too (:class:`~jobrunner.engine.profile.StepProfiler`, result ``extra["profile"]``)."""
    warm_up(engine)
    device = torch.device(str(engine.device))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    before = dict(engine.stats().to_dict())
    reset_peak_memory(device)
    sync(device)
    if progress is not None and hasattr(progress, "begin"):
        progress.begin()
    profiler = StepProfiler(engine) if profile else contextlib.nullcontext()
    start = time.perf_counter()
    with profiler:
        outputs = _run_steps(engine, token_ids, params, progress)
    sync(device)
    seconds = time.perf_counter() - start
    if progress is not None:
        progress(len(outputs), sum(len(o.output_token_ids) for o in outputs), done=True)
    return RunResult(
        name=name, seconds=seconds, num_requests=len(outputs),
        num_prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        num_cached_tokens=sum(o.metrics.num_cached_tokens for o in outputs),
        num_output_tokens=sum(len(o.output_token_ids) for o in outputs),
        num_errors=sum(o.finish_reason == "error" for o in outputs),
        memory=peak_memory(device),
        extra={"engine_stats": stats_delta(before, engine.stats().to_dict()),
               "first_error": next((o.error for o in outputs if o.finish_reason == "error"), None),
               **({"profile": profiler.summary(seconds)} if profile else {})},
    )


def _run_steps(engine, token_ids: list[list[int]], params: SamplingParams, progress) -> list:
    """Add every prompt, step until all are done; the outputs in finishing order."""
    for i, ids in enumerate(token_ids):
        engine.add_request(f"bench-{i}", list(ids), params)
    outputs = []
    sampled0 = getattr(engine.stats(), "num_sampled_tokens", 0)
    while engine.has_unfinished_requests():
        outputs += engine.step()
        if progress is not None:
            progress(len(outputs), getattr(engine.stats(), "num_sampled_tokens", 0) - sampled0)
    return outputs


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The run's own counters: additive fields as differences, gauges (KV sizes, peaks) as they are now."""
    gauges = {"kv_num_blocks", "kv_block_size", "kv_blocks_used", "kv_peak_blocks_used"}
    out: dict[str, Any] = {}
    for key, value in after.items():
        if key in gauges or key not in before or not isinstance(value, (int, float)):
            out[key] = value
        else:
            out[key] = value - before[key]
    prompt, cached = out.get("num_prompt_tokens", 0), out.get("num_cached_tokens", 0)
    out["prefix_cache_hit_rate"] = cached / prompt if prompt else 0.0
    drafted, accepted = out.get("num_draft_tokens", 0), out.get("num_accepted_tokens", 0)
    if "draft_acceptance_rate" in out:
        out["draft_acceptance_rate"] = accepted / drafted if drafted else 0.0
    for key in ("prefill_s", "decode_s", "schedule_s"):
        if isinstance(out.get(key), float):
            out[key] = round(out[key], 4)
    return out
