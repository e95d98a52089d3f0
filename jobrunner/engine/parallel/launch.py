"""Starting a group's ranks: one rank's engine in this process (:func:`build_rank_engine`, what a Ray actor of
the driver calls), or a whole group on this machine with the followers as local processes (:func:`spawn_local`,
for notebooks, ``jobrunner bench`` and tests).

``build`` makes a rank's ``LLMEngine`` from its ``TensorParallel`` (its shard of the model, its KV cache). For
:func:`spawn_local` it must pickle (a module-level function, a ``functools.partial`` of one, or a
``jobrunner.engine.llm_engine.EngineFromSource``). No orphans: a follower process watches its parent and exits
when it is gone (its next collective fails after ``timeout_s`` anyway); the leader's ``close`` joins, then
kills, them.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from jobrunner.engine.parallel.follower import Follower
from jobrunner.engine.parallel.group import RankSpec, free_port, join_group, leave_group
from jobrunner.engine.parallel.leader import ParallelEngine

if TYPE_CHECKING:
    from jobrunner.models.parallel import TensorParallel

Build = Callable[["TensorParallel"], Any]  # -> the rank's LLMEngine (jobrunner.engine.llm_engine)


def build_rank_engine(build: Build, rank: RankSpec) -> ParallelEngine | Follower:
    """Join the group as ``rank`` and build its engine: a :class:`ParallelEngine` on rank 0, a
    :class:`Follower` (call ``serve()``) on the others. Every rank of the group must call it at about the same
    time (the KV block count is agreed by a collective while the engines are built)."""
    tp = join_group(rank)
    try:
        engine = build(tp)
    except BaseException:
        leave_group()
        raise
    if rank.is_leader:
        return ParallelEngine(engine, tp, rank.timeout_s)
    return Follower(engine, tp)


def split_cores(world: int, cores: Sequence[int] | None = None) -> list[tuple[int, ...]]:
    """This process's allowed cores split into ``world`` contiguous groups (fewer cores than ranks: ranks
    share them round-robin, one core each)."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if len(cores) < world:
        return [(cores[r % len(cores)],) for r in range(world)]
    size, extra = divmod(len(cores), world)
    groups, start = [], 0
    for r in range(world):
        end = start + size + (r < extra)
        groups.append(tuple(cores[start:end]))
        start = end
    return groups


def spawn_local(build: Build, world: int, *, timeout_s: float = 120.0, backend: str = "auto",
                cpu_cores: Sequence[Sequence[int]] | None = None, pin: bool = True) -> ParallelEngine:
    """A group of ``world`` ranks on this machine: followers as spawned processes, the leader in this process.

    ``cpu_cores``: each rank's cores (default: this process's allowed cores split across ranks, when ``pin``);
    on CUDA rank r takes device r. Returns the leader's :class:`ParallelEngine`; its ``close`` stops the
    followers (joined, then killed after a short wait). A follower that fails to start makes this raise (the
    leader's join or first collective fails within ``timeout_s``) and the others are stopped.
    """
    import torch

    if world < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world}")
    cuda = backend != "gloo" and torch.cuda.is_available() and torch.cuda.device_count() >= world
    groups = [tuple(g) for g in cpu_cores] if cpu_cores is not None else split_cores(world) if pin else None
    if groups is not None and len(groups) != world:
        raise ValueError(f"spawn_local: {len(groups)} core groups for {world} ranks")
    init = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    specs = [RankSpec(r, world, init, backend, timeout_s, () if cuda or groups is None else groups[r],
                      r if cuda else None) for r in range(world)]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_follower_main, args=(build, spec, os.getpid()), daemon=True,
                         name=f"jobrunner-tp-rank{spec.rank}") for spec in specs[1:]]
    for p in procs:
        p.start()
    try:
        leader = build_rank_engine(build, specs[0])
    except BaseException as exc:
        dead = [f"rank {i + 1} exited with code {p.exitcode}" for i, p in enumerate(procs) if p.exitcode]
        _stop(procs, 0.0)
        if dead and isinstance(exc, Exception):
            raise RuntimeError(f"a local tensor-parallel group of {world} did not start: {'; '.join(dead)} "
                               f"(its error is above in this process's stderr); rank 0: {exc}") from exc
        raise
    leader._on_close = lambda: _stop(procs, 30.0)
    leader.processes = procs
    return leader


def _follower_main(build: Build, spec: RankSpec, parent_pid: int) -> None:
    """A spawned follower: exit when the parent is gone; serve until the leader closes."""
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    follower = build_rank_engine(build, spec)
    assert isinstance(follower, Follower)
    follower.serve()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(3)  # the leader's process is gone: no one to serve


def _stop(procs: list[Any], wait_s: float) -> None:
    """Join the follower processes within ``wait_s`` (they return on ``close``), then kill what is left."""
    deadline = time.monotonic() + wait_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5.0)
