"""Starting a tensor-parallel worker's ranks (driver/rank_group.py says how a group works)."""

from __future__ import annotations

from typing import Any

import ray

from jobrunner.driver.actor import RAY_NICENESS_ENV, start_worker
from jobrunner.driver.rank_group import (
    RANK_CONCURRENCY,
    RankActor,
    RankGroup,
    in_bundle,
    make_placement,
    rank_placement,
)
from jobrunner.redaction import known_secret_values
from jobrunner.spec import JobSpec


def start_group(spec: JobSpec, worker_id: str, job_start_s: float, run_token: str) -> tuple[Any, Any, Any,
                                                                                             RankGroup]:
    """Create a worker's placement group and its N rank actors, and wire their start-up (nothing waited for).
    Returns (rank 0's WorkerActor, its ping ref, the ref that answers once every rank has loaded, the group)."""
    world = spec.engine.tensor_parallel_size
    placement = rank_placement(spec)
    bundle = placement.actor
    pg = make_placement(f"jobrunner:{spec.name}:{run_token}:{worker_id}", placement)
    leader = start_worker(spec, worker_id, job_start_s, run_token, placement=(pg, 0, bundle))
    ping_ref, init_ref = leader.ping.remote(), leader.rendezvous.remote()
    followers = [_start_rank(spec, worker_id, run_token, pg, rank, bundle) for rank in range(1, world)]
    serve_refs = {f.serve.remote(init_ref): rank for rank, f in enumerate(followers, start=1)}
    loaded = [f.loaded_record.remote() for f in followers]
    ready_ref = leader.join_ranks.remote(leader.load.remote(init_ref), *loaded)
    pings = {ping_ref: 0, **{f.ping.remote(): rank for rank, f in enumerate(followers, start=1)}}
    return leader, ping_ref, ready_ref, RankGroup(pg, leader, followers, pings, serve_refs)


def _start_rank(spec: JobSpec, worker_id: str, run_token: str, pg: Any, rank: int, bundle: dict[str, float]) -> Any:
    options: dict[str, Any] = dict(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=0,
                                   max_task_retries=0, max_concurrency=RANK_CONCURRENCY,
                                   name=f"jobrunner:{spec.name}:{run_token}:{worker_id}:rank{rank}",
                                   scheduling_strategy=in_bundle(pg, rank),
                                   runtime_env={"env_vars": {RAY_NICENESS_ENV: str(spec.cluster.worker_niceness)}})
    return ray.remote(RankActor).options(**options).remote(spec.model_dump(mode="json"), worker_id, rank,
                                                           tuple(known_secret_values()))
