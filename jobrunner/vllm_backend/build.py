"""Build a worker's vLLM engine from a job spec: the model resolved and fetched like ours (alias, local dir,
Hub id, storage URL), our tokenizer for the prompts, our dtype rule, vLLM in its own process."""

from __future__ import annotations

import os
import tempfile
from typing import Any

from jobrunner.models.stopwatch import Stopwatch
from jobrunner.vllm_backend.engine import VllmEngine
from jobrunner.vllm_backend.mapping import engine_args, unmapped_settings, vllm_env, vllm_problem, vllm_python


def build_vllm_engine(spec: Any, log_dir: str | None = None) -> VllmEngine:
    """The vLLM engine for one worker; ValueError naming what cannot run (a setting without a vLLM
    equivalent, no vLLM for the configured Python). vLLM's own output goes to `vllm_log_path(log_dir)`: the
    worker passes its Ray session's log folder, so the file is kept, and cleaned up, with the worker logs."""
    from jobrunner.models.factory import choose_dtype, describe_dtype_choice, resolve_device
    from jobrunner.models.sources import resolve_model_dir
    from jobrunner.models.weights import load_config, load_tokenizer

    problems = unmapped_settings(spec)
    if problems:
        raise ValueError("engine.backend vllm: " + "; ".join(problems))
    python = vllm_python(spec)
    problem = vllm_problem(python)
    if problem:
        raise ValueError(problem)
    clock = Stopwatch()
    model_dir = resolve_model_dir(spec.model.source)
    clock.mark("model_source")
    config = load_config(model_dir)
    tokenizer = load_tokenizer(model_dir)
    clock.mark("tokenizer")
    device = resolve_device(spec.engine.device)
    torch_dtype, choice = choose_dtype(spec.model.dtype, device)
    dtype = str(torch_dtype).removeprefix("torch.")
    info = {"source": spec.model.source, "architecture": (getattr(config, "architectures", None) or ["?"])[0],
            "dtype": dtype, "device": device.type, "quantization": spec.model.quantization,
            "dtype_choice": choice, "dtype_reason": describe_dtype_choice(choice)}
    log = vllm_log_path(log_dir)
    env = vllm_env(spec, python, device.type)
    engine = VllmEngine(python, engine_args(spec, str(model_dir), dtype, device=device.type),
                        tokenizer, info, chat_template=spec.input.chat_template, env=env, log_path=log,
                        device=device.type)
    clock.mark("engine")  # vLLM's process: its imports, the weights, its KV cache (and compile, if asked)
    engine.model_info["load_stages_s"] = clock.stages
    engine.model_info["vllm_log"] = log
    engine.model_info["vllm_preload"] = env.get("LD_PRELOAD") or os.environ.get("LD_PRELOAD", "")
    return engine


def vllm_log_path(log_dir: str | None = None) -> str:
    """Where this process's vLLM engine writes its output: `jobrunner-vllm-<pid>.log` in `log_dir` (a worker's
    Ray log folder, beside its `worker-*-<pid>.out`), else in the system temp folder (bench, a notebook)."""
    return os.path.join(log_dir or tempfile.gettempdir(), f"jobrunner-vllm-{os.getpid()}.log")
