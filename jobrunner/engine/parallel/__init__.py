"""Tensor-parallel ranks of one engine (issue 45, docs/engine.md "Tensor parallel").

Every rank holds a whole :class:`~jobrunner.engine.llm_engine.LLMEngine` (scheduler, KV manager, sampler) over
its shard of the model and runs the same deterministic scheduler (SPMD). Rank 0, the *leader*, is the engine
the worker talks to (:class:`ParallelEngine`, a ``jobrunner.engine.WorkerEngine``); each step it broadcasts,
once, the commands received since the last step (new requests as token ids with their params, aborts, close,
rebuild) over a gloo group; every rank applies them and runs the same step. A per-step fingerprint of what was
scheduled is all-reduced (MIN and MAX): ranks that drift apart raise :class:`ParallelDivergence` on every
rank, never hang. Collectives carry a timeout, so a lost rank fails its group with an error.

The engine never imports ray: the driver starts ranks as actors and calls :func:`build_rank_engine` in each;
:func:`spawn_local` starts followers as local processes (notebooks, ``jobrunner bench``, tests).
"""

from __future__ import annotations

from jobrunner.engine.parallel.commands import ParallelDivergence
from jobrunner.engine.parallel.follower import Follower
from jobrunner.engine.parallel.group import RankSpec, free_port, join_group, leave_group
from jobrunner.engine.parallel.launch import build_rank_engine, spawn_local
from jobrunner.engine.parallel.leader import ParallelEngine

__all__ = ["Follower", "ParallelDivergence", "ParallelEngine", "RankSpec", "build_rank_engine", "free_port",
           "join_group", "leave_group", "spawn_local"]
