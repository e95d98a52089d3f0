"""The whole comparison: our engine (optionally with and without prefix caching), then the HF baseline."""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from typing import Any

import torch

from jobrunner.bench.ours import EngineOptions, build_engine, release, run_ours
from jobrunner.bench.prompts import PromptRow, fit_to_context, tokenize_all
from jobrunner.bench.result import RunResult


@dataclass(frozen=True)
class BenchOptions:
    """Everything ``jobrunner bench`` was asked to do (besides where the prompts come from)."""

    engine: EngineOptions
    max_tokens: int
    ignore_eos: bool = False
    prefix_caching: bool = True
    compare_prefix_caching: bool = False
    baseline: str = "none"                # "hf", "vllm" (bench --engine jobrunner,vllm) or "none"
    vllm_python: str | None = None        # the Python that has vLLM (baseline "vllm")
    vllm_eager: bool = False              # vLLM without its compile step (faster start, slower steps)
    baseline_batch_size: int | None = None  # None: pick from a pilot
    raw_prompts: bool = False
    profile: bool = False                 # time attention / GEMMs / other ops / host work per step


@dataclass
class _Prepared:
    token_ids: list[list[int]]
    num_dropped: int
    model_info: dict[str, Any]
    device: torch.device
    eos_ids: tuple[int, ...]
    max_model_len: int
    attention_backend: str  # the backend the steps ran through (after any fall-back)


def run_bench(options: BenchOptions, rows: list[PromptRow], log=print) -> dict[str, Any]:
    """Run every leg on the same token ids; return the result dict that ``report`` renders."""
    runs: dict[str, RunResult] = {}
    first = options.prefix_caching or options.compare_prefix_caching
    prep, runs["ours"] = _ours_leg(options, first, rows, None, "ours", log)
    if options.compare_prefix_caching:
        _, runs["ours_no_prefix_caching"] = _ours_leg(options, False, rows, prep, "ours_no_prefix_caching", log)
    if options.baseline == "hf":
        runs["baseline"] = _run_hf(options, prep, log)
    elif options.baseline == "vllm":
        runs["baseline"] = _run_vllm(options, prep, log)
    return _assemble(options, prep, runs)


def _run_vllm(options: BenchOptions, prep: _Prepared, log) -> RunResult:
    """vLLM's engine (its own process, engine.backend vllm's path) on the same token ids, dtype and batching,
    bound to every core as its CPU docs ask; its start-up (and compile, unless eager) is outside the timing."""
    import os

    from jobrunner.models.sources import resolve_model_dir
    from jobrunner.vllm_backend.engine import VllmEngine
    from jobrunner.vllm_backend.mapping import cpu_bind, cpu_preload, vllm_problem

    python = options.vllm_python or ""
    problem = vllm_problem(python)
    if problem:
        raise ValueError(problem)
    e = options.engine
    cores, world = os.cpu_count() or 1, e.tensor_parallel_size
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
           "OMP_NUM_THREADS": str(cores), "VLLM_CPU_KVCACHE_SPACE": "4"}
    if world > 1:  # a process per rank, each bound to its share of the cores, the 4 GiB of KV split over them
        env.update(VLLM_CPU_OMP_THREADS_BIND=cpu_bind(world, cores), OMP_NUM_THREADS=str(max(1, cores // world)),
                   VLLM_CPU_KVCACHE_SPACE=str(max(1, 4 // world)))
    preload = cpu_preload(python) if prep.device.type == "cpu" else ""
    if preload:
        env["LD_PRELOAD"] = preload  # tcmalloc + libiomp5, as vLLM's CPU docs ask
    env = {k: v for k, v in env.items() if k not in os.environ}
    args = {"model": str(resolve_model_dir(e.model)), "dtype": prep.model_info.get("dtype", "float32"), "seed": 0,
            "enforce_eager": options.vllm_eager, "max_num_seqs": e.max_num_seqs,
            "max_num_batched_tokens": e.max_num_batched_tokens, "enable_prefix_caching": options.prefix_caching,
            "max_model_len": prep.max_model_len}
    if world > 1:
        args.update(tensor_parallel_size=world, distributed_executor_backend="mp")
    log(f"vllm: starting vLLM at {python} ({'eager' if options.vllm_eager else 'compiling: 1-2 minutes on CPU'})")
    started = time.perf_counter()
    engine = VllmEngine(python, args, None, {"dtype": args["dtype"]}, env=env)
    load_s = time.perf_counter() - started
    try:
        log(f"vllm: vLLM {engine.model_info.get('vllm_version')} ready after {load_s:.0f}s; "
            f"{len(prep.token_ids)} prompts x up to {options.max_tokens} tokens")
        result = run_ours(engine, prep.token_ids, options.max_tokens, options.ignore_eos, "vllm",
                          progress=BenchProgress("vllm", len(prep.token_ids), log))
    finally:
        engine.close()
    result.extra.update(vllm_version=engine.model_info.get("vllm_version"), load_s=round(load_s, 1),
                        eager=options.vllm_eager, preload=env.get("LD_PRELOAD") or os.environ.get("LD_PRELOAD", ""))
    result.memory = {}  # this process's peak RSS says nothing of vLLM's own process
    return result


def _ours_leg(options: BenchOptions, prefix_caching: bool, rows: list[PromptRow], prep: _Prepared | None,
              name: str, log=print) -> tuple[_Prepared, RunResult]:
    """Build an engine, tokenize with it if ``prep`` is None, run, and free it before the next leg loads."""
    log(f"{name}: loading model {options.engine.model} (prefix caching {'on' if prefix_caching else 'off'})")
    engine = build_engine(options.engine, prefix_caching)
    try:
        prep = prep or _prepare(engine, rows, options)
        if not prep.token_ids:
            raise ValueError(f"no prompt fits the context ({engine.max_model_len} tokens) with "
                             f"--max-tokens {options.max_tokens}")
        log(f"{name}: {engine.model_info.get('dtype_reason') or engine.model_info.get('dtype')}; warming up, "
            f"then {len(prep.token_ids)} prompts x up to {options.max_tokens} tokens")
        result = run_ours(engine, prep.token_ids, options.max_tokens, options.ignore_eos, name,
                          progress=BenchProgress(name, len(prep.token_ids), log), profile=options.profile)
    finally:
        release(engine)
        del engine
    return prep, result


class BenchProgress:
    """Lines while a bench leg runs: requests finished, tokens produced, tokens/s, every PROGRESS_INTERVAL_S
    and at the end (what `run_ours` calls after each engine step; a clock read per step costs nothing)."""

    PROGRESS_INTERVAL_S = 5.0

    def __init__(self, name: str, total: int, log=print) -> None:
        self.name, self.total, self.log = name, total, log
        self.start = self.last = time.perf_counter()

    def begin(self) -> None:
        """The timed run starts now (after the warm-up): rates count from here."""
        self.start = self.last = time.perf_counter()

    def __call__(self, finished: int, tokens: int, done: bool = False) -> None:
        now = time.perf_counter()
        if not done and now - self.last < self.PROGRESS_INTERVAL_S:
            return
        self.last = now
        rate = tokens / max(now - self.start, 1e-9)
        self.log(f"{self.name}: {finished}/{self.total} prompts done, {tokens} output tokens, {rate:.1f} out "
                 f"tok/s, {now - self.start:.0f}s" + (" (finished)" if done else ""))


def _prepare(engine, rows: list[PromptRow], options: BenchOptions) -> _Prepared:
    token_ids = tokenize_all(engine, rows, options.raw_prompts)
    kept, dropped = fit_to_context(token_ids, options.max_tokens, engine.max_model_len)
    return _Prepared(kept, dropped, dict(engine.model_info), engine.device, tuple(engine.eos_token_ids),
                     engine.max_model_len, engine.runner.backend.name)


def _run_hf(options: BenchOptions, prep: _Prepared, log) -> RunResult:
    from jobrunner.bench.hf_baseline import load_baseline, pick_batch_size, run_baseline, warm_up
    from jobrunner.models.factory import DTYPES
    from jobrunner.models.sources import resolve_model_dir

    dtype = DTYPES[prep.model_info.get("dtype", "float32")]
    base = load_baseline(str(resolve_model_dir(options.engine.model)), dtype, prep.device, prep.eos_ids)
    rates: dict[int, float] = {}
    batch_size = options.baseline_batch_size
    if batch_size is None:
        batch_size, rates = pick_batch_size(base, prep.token_ids)
        log(f"hf: pilot tokens/s by batch size {_rounded(rates)} -> {batch_size}")
    else:
        warm_up(base, prep.token_ids)
    log(f"hf: {len(prep.token_ids)} prompts, batch size {batch_size}")
    result = run_baseline(base, prep.token_ids, options.max_tokens, options.ignore_eos, batch_size)
    result.extra["pilot_output_tokens_per_s"] = _rounded(rates)
    return result


def _assemble(options: BenchOptions, prep: _Prepared, runs: dict[str, RunResult]) -> dict[str, Any]:
    ours, base = runs["ours"], runs.get("baseline")
    ratio = _div(ours.output_tokens_per_s, base.output_tokens_per_s) if base else None
    total_ratio = _div(ours.total_tokens_per_s, base.total_tokens_per_s) if base else None
    out: dict[str, Any] = {"workload": _workload(options, prep)}
    for key, run in runs.items():
        out[key] = {**run.to_dict(), "ratio": ratio}
    out.setdefault("baseline", None)
    out["ratio"] = ratio
    out["total_tokens_ratio"] = total_ratio
    if "ours_no_prefix_caching" in runs:
        out["prefix_caching"] = prefix_summary(ours, runs["ours_no_prefix_caching"])
    out["versions"] = _versions()
    return out


def prefix_summary(on: RunResult, off: RunResult) -> dict[str, Any]:
    """What prefix caching saved: computed prompt tokens cut (a fraction) and the throughput ratios on/off."""
    computed_on, computed_off = on.computed_prompt_tokens, off.computed_prompt_tokens
    return {
        "computed_prompt_tokens_on": computed_on,
        "computed_prompt_tokens_off": computed_off,
        "computed_prompt_tokens_cut": 1 - computed_on / computed_off if computed_off else 0.0,
        "cached_token_share": on.cached_token_share,
        "throughput_ratio": _div(on.output_tokens_per_s, off.output_tokens_per_s),
        "total_throughput_ratio": _div(on.total_tokens_per_s, off.total_tokens_per_s),
    }


def _workload(options: BenchOptions, prep: _Prepared) -> dict[str, Any]:
    e = options.engine
    return {
        "num_prompts": len(prep.token_ids), "num_dropped_too_long": prep.num_dropped,
        "max_tokens": options.max_tokens, "ignore_eos": options.ignore_eos, "raw_prompts": options.raw_prompts,
        "prefix_caching": options.prefix_caching or options.compare_prefix_caching,
        "max_num_seqs": e.max_num_seqs, "max_num_batched_tokens": e.max_num_batched_tokens,
        "model": e.model, "dtype": prep.model_info.get("dtype"), "device": str(prep.device),
        "quantization": e.quantization, "baseline": options.baseline, "speculative": e.speculative,
        "profile": options.profile, "attention_backend": prep.attention_backend,
        "tensor_parallel_size": e.tensor_parallel_size,
    }


def _versions() -> dict[str, str]:
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "cpu_threads": str(torch.get_num_threads())}


def _div(a: float, b: float) -> float | None:
    return a / b if b else None


def _rounded(rates: dict[int, float]) -> dict[int, float]:
    return {k: round(v, 2) for k, v in rates.items()}
