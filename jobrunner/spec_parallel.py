"""The spec's rules for a worker split over ranks (engine.tensor_parallel_size x engine.pipeline_parallel_size),
checked when a spec loads (JobSpec's validator calls :func:`parallel_problem`).

- A GPU worker's ranks take one GPU each: ``cluster.num_gpus_per_worker`` equals TP x PP (a single rank may
  still run on a share of a card: ``num_gpus_per_worker`` below 1).
- Pipeline stages run on ``engine.backend: vllm`` only; our engine splits a model by tensor parallel alone.
- A CPU worker's ranks need a core each at least: ``cluster.num_cpus_per_worker`` >= TP x PP.

Whether the model's heads, KV heads, MLP and vocabulary divide is the model's question, answered from its
config.json by ``jobrunner validate`` (models/parallel/plan.py), not here.
"""

from __future__ import annotations

from typing import Any


def parallel_problem(spec: Any) -> str | None:
    """What is wrong with the spec's parallel shape, one line naming the keys, their numbers and the fix
    (None when it holds). A custom engine factory and an endpoint backend have no ranks to check."""
    e, c = spec.engine, spec.cluster
    if e.factory is not None or e.backend not in ("jobrunner", "vllm"):
        return None
    tp, pp = e.tensor_parallel_size, e.pipeline_parallel_size
    world = tp * pp
    shape = f"engine.tensor_parallel_size {tp} x engine.pipeline_parallel_size {pp} = {world}"
    if pp > 1 and e.backend != "vllm":
        return (f"engine.pipeline_parallel_size {pp}: pipeline stages run on engine.backend vllm only; our engine "
                "splits a model by engine.tensor_parallel_size (set pipeline_parallel_size: 1, or backend: vllm)")
    gpus = c.num_gpus_per_worker
    if gpus > 0 and world > 1 and gpus != world:
        return (f"cluster.num_gpus_per_worker {gpus:g} but {shape} ranks: each rank takes one GPU, so set "
                f"cluster.num_gpus_per_worker: {world} (or engine.tensor_parallel_size: {_tp_for(gpus, pp)})")
    if gpus > 1 and world == 1:
        return (f"cluster.num_gpus_per_worker {gpus:g} but engine.tensor_parallel_size 1: a worker's model runs on "
                f"one GPU unless it is split; set engine.tensor_parallel_size: {gpus:g} to split it over "
                f"{gpus:g} GPUs, or use 1 GPU per worker and more workers")
    if gpus == 0 and world > 1 and c.num_cpus_per_worker < world:
        return (f"cluster.num_cpus_per_worker {c.num_cpus_per_worker:g} but {shape} ranks: each CPU rank needs "
                f"a core at least; set cluster.num_cpus_per_worker: {world} or more")
    return None


def _tp_for(gpus: float, pp: int) -> str:
    """The tensor_parallel_size that fills ``gpus`` GPUs with ``pp`` stages, or a hint when none does."""
    whole = int(gpus)
    if whole == gpus and whole % pp == 0:
        return str(whole // pp)
    return f"a number that times pipeline_parallel_size {pp} gives the GPUs"
