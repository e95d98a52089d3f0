"""Build a worker's vLLM engine from a job spec: the model resolved and fetched like ours (alias, local dir,
Hub id, storage URL), our tokenizer for the prompts, our dtype rule, vLLM in its own process."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from jobrunner.models.stopwatch import Stopwatch
from jobrunner.vllm_backend.engine import VllmEngine
from jobrunner.vllm_backend.mapping import (
    engine_args,
    parallel_args,
    unmapped_settings,
    vllm_env,
    vllm_problem,
    vllm_python,
)


def build_vllm_engine(spec: Any, log_dir: str | None = None, placement: dict[str, Any] | None = None) -> VllmEngine:
    """The vLLM engine for one worker; ValueError naming what cannot run (a setting without a vLLM
    equivalent, no vLLM for the configured Python). vLLM's own output goes to `vllm_log_path(log_dir)`: the
    worker passes its Ray session's log folder, so the file is kept, and cleaned up, with the worker logs.

    ``placement`` (``{"placement_group_id": hex, "address": the Ray GCS address}``): the worker's placement
    group, for pipeline stages on other nodes: vLLM's Ray executor puts its rank actors in that group's
    one-GPU bundles (engine.tensor_parallel_size x pipeline_parallel_size of them). Without it the ranks are
    processes of this node over the GPUs the worker's actor holds."""
    import torch

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
    # pipeline stages on GPUs: this process holds none of the group's GPUs (vLLM's Ray executor places its ranks
    # on them), so CUDA is what the placement says, not what this process sees
    device = torch.device("cuda") if placement else resolve_device(spec.engine.device)
    torch_dtype, choice = choose_dtype(spec.model.dtype, device)
    dtype = str(torch_dtype).removeprefix("torch.")
    info = {"source": spec.model.source, "architecture": (getattr(config, "architectures", None) or ["?"])[0],
            "dtype": dtype, "device": device.type, "quantization": spec.model.quantization,
            "dtype_choice": choice, "dtype_reason": describe_dtype_choice(choice)}
    log = vllm_log_path(log_dir)
    env = vllm_env(spec, python, device.type)
    parallel = parallel_args(spec, device.type, visible_gpus(device.type), placement)
    if parallel.get("distributed_executor_backend") == "ray":
        env["RAY_ADDRESS"] = placement["address"]  # vLLM's engine-core process joins the cluster there
    info.update({k: v for k, v in parallel.items() if k != "distributed_executor_backend"},
                vllm_executor=parallel.get("distributed_executor_backend", "uni"))
    args = engine_args(spec, str(model_dir), dtype, device=device.type, parallel=parallel)
    template = spec.input.chat_template or (None if getattr(tokenizer, "chat_template", None) else
                                            processor_chat_template(model_dir))
    engine = VllmEngine(python, args, tokenizer, info, chat_template=template, env=env,
                        log_path=log, device=device.type,
                        placement=placement if parallel.get("distributed_executor_backend") == "ray" else None)
    clock.mark("engine")  # vLLM's process: its imports, the weights, its KV cache (and compile, if asked)
    engine.model_info["load_stages_s"] = clock.stages
    engine.model_info["vllm_log"] = log
    engine.model_info["vllm_preload"] = env.get("LD_PRELOAD") or os.environ.get("LD_PRELOAD", "")
    if "VLLM_CPU_OMP_THREADS_BIND" in env:  # each CPU rank's cores, as vLLM binds them
        engine.model_info["vllm_cpu_bind"] = env["VLLM_CPU_OMP_THREADS_BIND"]
    return engine


def processor_chat_template(model_dir: str | os.PathLike) -> str | None:
    """The chat template a model keeps for its processor rather than its tokenizer (vision-language models
    such as SmolVLM: ``chat_template.jinja``, or ``chat_template.json`` holding ``{"chat_template": ...}``),
    which the tokenizer alone does not load; None when there is neither."""
    folder = Path(model_dir)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    try:
        template = json.loads((folder / "chat_template.json").read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    return template if isinstance(template, str) and template else None


def visible_gpus(device: str) -> int | None:
    """GPUs this worker's process sees (Ray sets CUDA_VISIBLE_DEVICES to the actor's); None off CUDA."""
    if device != "cuda":
        return None
    import torch

    return torch.cuda.device_count()


def vllm_log_path(log_dir: str | None = None) -> str:
    """Where this process's vLLM engine writes its output: `jobrunner-vllm-<pid>.log` in `log_dir` (a worker's
    Ray log folder, beside its `worker-*-<pid>.out`), else in the system temp folder (bench, a notebook)."""
    return os.path.join(log_dir or tempfile.gettempdir(), f"jobrunner-vllm-{os.getpid()}.log")
