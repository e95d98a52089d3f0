"""The worker actor: placed cheaply, then loads the engine once, then runs the shards the driver hands it.

Creation does no work, so the driver can tell "the cluster has no room for this worker" (the actor is not
placed: `ping` does not answer) from "the model is loading" (`load` has not returned).
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import ray

from jobrunner.driver.cores import CoreClaim
from jobrunner.driver.engine_factory import build_engine, build_rank, describe_model, load_memory
from jobrunner.driver.hardware import describe_hardware
from jobrunner.driver.metrics import WorkerMetrics
from jobrunner.driver.rank_group import GroupShardRunner, here, in_bundle, local_rank_spec, rank_weights
from jobrunner.driver.shards import Shard
from jobrunner.driver.worker import ShardResult, ShardRunner
from jobrunner.redaction import known_secret_values, redact_text, remember_secrets
from jobrunner.spec import JobSpec

RAY_NICENESS_ENV = "RAY_worker_niceness"  # Ray's setting for the niceness of the worker processes it starts
# run_shard x2 (the running shard and the prefetched one) + load + progress/stats polls.
MAX_CONCURRENCY = 6


def _process_start_s() -> float:
    """Wall-clock start of this process (actor start, as a bill counts it); now if unknown."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - psutil missing or restricted: count from now
        return time.time()


class WorkerActor:
    """One engine per actor; the driver keeps up to two shards queued on it (see driver/worker.py)."""

    def __init__(self, spec_dict: dict[str, Any], worker_id: str, job_start_s: float,
                 secret_values: tuple[str, ...] = ()) -> None:
        remember_secrets(secret_values)  # the driver's known secrets: cut from every row error, log and record
        self.spec_dict, self.worker_id, self.job_start_s = spec_dict, worker_id, job_start_s
        self.started_s = _process_start_s()
        self.init_s = time.time()  # the worker process is up and has imported this module
        self.runner: ShardRunner | None = None
        self.model: dict[str, Any] = {}
        self.metrics: WorkerMetrics | None = None
        self.cores = CoreClaim()  # a CPU rank's cores, held for the life of the process (driver/cores.py)
        self.rank_record: dict[str, Any] = {}  # rank 0 of a tensor-parallel worker: node, pid, device, cores

    def ping(self) -> dict[str, Any]:
        """Answers once the actor is placed and running (before the model loads): its node, node ip and pid."""
        return here(0)

    def rendezvous(self) -> str:
        """Rank 0 of a tensor-parallel worker: a free port on this node, as the group's ``init_method``
        (``tcp://<this node's ip>:<port>``) that every rank joins (driver/rank_group.py)."""
        from jobrunner.engine.parallel import free_port

        return f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"

    def load(self, init_method: str | None = None) -> dict[str, Any]:
        """Build the engine; return the model as loaded and the worker's stats (with startup_s and its
        stages, `startup_stages_s`). ``init_method``: rank 0 of a tensor-parallel worker, whose engine joins
        the group there (a ``ParallelEngine``; this thread's cores are the rank's)."""
        load_start = time.time()
        spec = JobSpec.model_validate(self.spec_dict)
        imports_s = _import_engine() if not spec.engine.factory else 0.0
        rank_record: dict[str, Any] = {}
        if init_method is None:
            engine = _build_engine_redacted(lambda: build_engine(spec, worker_log_dir()))
        else:
            rank_spec, self.cores, rank_record = local_rank_spec(spec, 0, init_method)
            engine = _build_engine_redacted(lambda: build_rank(spec, rank_spec))
            self.rank_record = {**rank_record, **rank_weights(engine)}
        gpu_ids = ray.get_gpu_ids()
        device = str(engine.device or (f"cuda:{gpu_ids[0]}" if gpu_ids else "cpu"))
        now = time.time()
        info = {"node": socket.gethostname(), "node_ip": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "niceness": os.getpriority(os.PRIO_PROCESS, 0), "device": device,
                "startup_s": round(now - self.started_s, 3), **describe_hardware(), **load_memory(engine.model_info),
                "startup_stages_s": startup_stages(self.started_s, self.init_s, load_start, now, imports_s,
                                                   engine.model_info)}
        self.model = describe_model(engine, spec)
        runner = ShardRunner if init_method is None else GroupShardRunner  # a group's failure is not isolated in it
        self.runner = runner(engine, spec, self.worker_id, self.job_start_s, info)
        self.metrics = WorkerMetrics.start(spec.name, self.worker_id, self.runner)  # Ray dashboard / Prometheus
        return {"model": self.model, "stats": self.runner.stats()}

    def join_ranks(self, loaded: dict[str, Any], *followers: dict[str, Any]) -> dict[str, Any]:
        """Rank 0 of a tensor-parallel worker, once it (``loaded``: its `load`'s answer) and every follower
        (their records) have loaded: the ranks go into the worker's record; answers as `load` does."""
        self.runner.info["ranks"] = [self.rank_record, *followers]
        self.runner.info["tensor_parallel_size"] = len(followers) + 1
        return {"model": loaded["model"], "stats": self.runner.stats()}

    def ready(self) -> dict[str, Any]:
        """The model and the worker's stats (after `load`)."""
        return {"model": self.model, "stats": self.runner.stats() if self.runner else {}}

    def run_shard(self, shard: Shard, attempt_id: str = "a0", error_text: str | None = None,
                  one_at_a_time: bool = False) -> ShardResult:
        """Generate one shard (or piece) and write it to the attempt's temporary key (one_at_a_time: a hang's
        suspects, one row in the engine at a time)."""
        result = self.runner.run_shard(shard, attempt_id, error_text, one_at_a_time)
        self.metrics.on_shard(result)
        return result

    def progress(self) -> dict[str, Any]:
        """Rows and output tokens finished so far per running shard, and how long the engine has stalled."""
        return self.runner.progress() if self.runner else {"shards": {}, "stalled_s": 0.0}

    def finish(self) -> dict[str, Any]:
        """Stop the engine loop and return the final worker stats."""
        stats = self.runner.stats()
        self.metrics.stop()
        self.runner.stop()
        return stats


def _build_engine_redacted(build: Callable[[], Any]) -> Any:
    """build(), whose failure is re-raised with its text redacted: Ray writes a failed call's exception to
    the worker's log and hands it to the driver before jobrunner sees it, and a factory's error may quote the
    credentials it was given. The original traceback rides along as a note, redacted."""
    try:
        return build()
    except Exception as exc:  # noqa: BLE001 - re-raised, redacted
        text = redact_text(str(exc))
        try:
            clean = type(exc)(text)
        except Exception:  # noqa: BLE001 - an exception type that takes other arguments
            clean = RuntimeError(f"{type(exc).__name__}: {text}")
        clean.add_note(redact_text("".join(traceback.format_exception(exc))))
        raise clean from None


def worker_log_dir() -> str | None:
    """This worker's Ray log folder (where Ray writes its `worker-*.out` / `.err`), None outside Ray: an engine
    process of its own (vLLM) logs there, so its log is kept, and removed, with the worker logs."""
    try:
        node = ray._private.worker._global_node  # no public API names the session's log folder
        return node.get_logs_dir_path() if node is not None else None
    except Exception:  # noqa: BLE001 - another Ray version: fall back to the temp folder
        return None


def _import_engine() -> float:
    """Import our engine and model loader (torch, transformers) now; the seconds it took (0 when already
    imported in this process)."""
    start = time.perf_counter()
    import jobrunner.engine.llm_engine  # noqa: F401
    import jobrunner.models.factory  # noqa: F401
    import jobrunner.models.weights  # noqa: F401

    return time.perf_counter() - start


def startup_stages(process_s: float, init_s: float, load_s: float, end_s: float, imports_s: float,
                   model_info: dict[str, Any] | None) -> dict[str, float]:
    """A worker's start-up by stage, in seconds (they add up to its startup_s): ``process`` (the worker
    process up and this module imported), ``wait`` (until the driver's `load` call arrives), ``imports``
    (torch, transformers, the engine: the first engine import of a process), then the engine's own load stages
    (model_source, build_model, load_weights, quantize, pack_weights, tokenizer, adapters, engine) and
    ``other`` for what none of them counts. A custom engine (``engine.factory``) has ``load`` for its whole
    build."""
    stages = {"process": init_s - process_s, "wait": load_s - init_s}
    loaded = model_info.get("load_stages_s") if isinstance(model_info, dict) else None
    build = end_s - load_s
    if isinstance(loaded, dict) and loaded:
        named = {k: float(v) for k, v in loaded.items() if isinstance(v, (int, float))}
        stages.update(imports=imports_s, **named, other=build - imports_s - sum(named.values()))
    else:
        stages["load"] = build
    return {k: round(max(v, 0.0), 3) for k, v in stages.items()}


def worker_resources(spec: JobSpec) -> dict[str, float]:
    """What one worker asks the cluster for, in Ray's resource names."""
    c = spec.cluster
    resources = {"CPU": c.num_cpus_per_worker}
    if c.num_gpus_per_worker > 0:
        resources["GPU"] = c.num_gpus_per_worker
    return resources


def start_worker(spec: JobSpec, worker_id: str, job_start_s: float, run_token: str,
                 placement: tuple[Any, int, dict[str, float]] | None = None) -> Any:
    """Create one worker actor with the spec's resources (GPU worker when num_gpus_per_worker > 0), or, with
    ``placement`` (placement group, bundle index, bundle), with that bundle's resources inside it.

    The actor is named `jobrunner:<job name>:<run token>:<worker id>` so operators (and tests) can find it.
    """
    c = spec.cluster
    options: dict[str, Any] = dict(num_cpus=c.num_cpus_per_worker, max_concurrency=MAX_CONCURRENCY,
                                   max_restarts=0, max_task_retries=0,
                                   name=f"jobrunner:{spec.name}:{run_token}:{worker_id}")
    if c.num_gpus_per_worker > 0:
        options["num_gpus"] = c.num_gpus_per_worker
    if placement is not None:
        pg, index, bundle = placement
        options.update(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), scheduling_strategy=in_bundle(pg, index))
    # Ray renices its workers to 15 unless told otherwise (read by the worker process at start); env_vars merge
    # with the job's runtime_env (a submitted job keeps its working_dir and variables)
    options["runtime_env"] = {"env_vars": {RAY_NICENESS_ENV: str(c.worker_niceness)}}
    remote_cls = ray.remote(WorkerActor).options(**options)
    return remote_cls.remote(spec.model_dump(mode="json"), worker_id, job_start_s,
                             tuple(known_secret_values()))
