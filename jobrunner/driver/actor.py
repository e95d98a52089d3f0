"""The worker actor: loads the engine once, then runs the shards the driver hands it."""

from __future__ import annotations

import os
import socket
from typing import Any

import ray

from jobrunner.driver.engine_factory import build_engine, describe_model
from jobrunner.driver.shards import Shard
from jobrunner.driver.worker import ShardResult, ShardRunner
from jobrunner.spec import JobSpec

# run_shard x2 (the running shard and the prefetched one) + progress/stats polls.
MAX_CONCURRENCY = 6


class WorkerActor:
    """One engine per actor; the driver keeps up to two shards queued on it (see driver/worker.py)."""

    def __init__(self, spec_dict: dict[str, Any], worker_id: str, job_start_s: float) -> None:
        spec = JobSpec.model_validate(spec_dict)
        engine = build_engine(spec)
        gpu_ids = ray.get_gpu_ids()
        device = str(getattr(engine, "device", "") or (f"cuda:{gpu_ids[0]}" if gpu_ids else "cpu"))
        info = {"node": socket.gethostname(), "node_ip": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(), "device": device}
        self.model = describe_model(engine, spec)
        self.runner = ShardRunner(engine, spec, worker_id, job_start_s, info)

    def ready(self) -> dict[str, Any]:
        """Called once the engine is loaded: the model as loaded and the worker's stats."""
        return {"model": self.model, "stats": self.runner.stats()}

    def run_shard(self, shard: Shard) -> ShardResult:
        """Generate one shard and commit its part."""
        return self.runner.run_shard(shard)

    def progress(self) -> dict[str, tuple[int, int]]:
        """Rows and output tokens finished so far per running shard."""
        return self.runner.progress()

    def finish(self) -> dict[str, Any]:
        """Stop the engine loop and return the final worker stats."""
        stats = self.runner.stats()
        self.runner.stop()
        return stats


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
