"""The worker actor: placed cheaply, then loads the engine once, then runs the shards the driver hands it.

Creation does no work, so the driver can tell "the cluster has no room for this worker" (the actor is not
placed: `ping` does not answer) from "the model is loading" (`load` has not returned).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import ray

from jobrunner.driver.engine_factory import build_engine, describe_model
from jobrunner.driver.hardware import describe_hardware
from jobrunner.driver.metrics import WorkerMetrics
from jobrunner.driver.shards import Shard
from jobrunner.driver.worker import ShardResult, ShardRunner
from jobrunner.spec import JobSpec

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

    def __init__(self, spec_dict: dict[str, Any], worker_id: str, job_start_s: float) -> None:
        self.spec_dict, self.worker_id, self.job_start_s = spec_dict, worker_id, job_start_s
        self.started_s = _process_start_s()
        self.runner: ShardRunner | None = None
        self.model: dict[str, Any] = {}
        self.metrics: WorkerMetrics | None = None

    def ping(self) -> bool:
        """Answers once the actor is placed and running (before the model loads)."""
        return True

    def load(self) -> dict[str, Any]:
        """Build the engine; return the model as loaded and the worker's stats (with startup_s)."""
        spec = JobSpec.model_validate(self.spec_dict)
        engine = build_engine(spec)
        gpu_ids = ray.get_gpu_ids()
        device = str(getattr(engine, "device", "") or (f"cuda:{gpu_ids[0]}" if gpu_ids else "cpu"))
        info = {"node": socket.gethostname(), "node_ip": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(), "device": device,
                "startup_s": round(time.time() - self.started_s, 3), **describe_hardware()}
        self.model = describe_model(engine, spec)
        self.runner = ShardRunner(engine, spec, self.worker_id, self.job_start_s, info)
        self.metrics = WorkerMetrics.start(spec.name, self.worker_id, self.runner)  # Ray dashboard / Prometheus
        return {"model": self.model, "stats": self.runner.stats()}

    def ready(self) -> dict[str, Any]:
        """The model and the worker's stats (after `load`)."""
        return {"model": self.model, "stats": self.runner.stats() if self.runner else {}}

    def run_shard(self, shard: Shard, attempt_id: str = "a0", error_text: str | None = None) -> ShardResult:
        """Generate one shard (or piece) and write it to the attempt's temporary key."""
        result = self.runner.run_shard(shard, attempt_id, error_text)
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


def worker_resources(spec: JobSpec) -> dict[str, float]:
    """What one worker asks the cluster for, in Ray's resource names."""
    c = spec.cluster
    resources = {"CPU": c.num_cpus_per_worker}
    if c.num_gpus_per_worker > 0:
        resources["GPU"] = c.num_gpus_per_worker
    return resources


def start_worker(spec: JobSpec, worker_id: str, job_start_s: float, run_token: str) -> Any:
    """Create one worker actor with the spec's resources (GPU worker when num_gpus_per_worker > 0).

    The actor is named `jobrunner:<job name>:<run token>:<worker id>` so operators (and tests) can find it.
    """
    c = spec.cluster
    options: dict[str, Any] = dict(num_cpus=c.num_cpus_per_worker, max_concurrency=MAX_CONCURRENCY,
                                   max_restarts=0, max_task_retries=0,
                                   name=f"jobrunner:{spec.name}:{run_token}:{worker_id}")
    if c.num_gpus_per_worker > 0:
        options["num_gpus"] = c.num_gpus_per_worker
    remote_cls = ray.remote(WorkerActor).options(**options)
    return remote_cls.remote(spec.model_dump(mode="json"), worker_id, job_start_s)
