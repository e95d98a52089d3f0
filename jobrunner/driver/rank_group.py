"""A tensor-parallel worker: N Ray actors of one worker in one placement group (issue 45, seam C).

To the pool (driver/pool.py) a group is one `Worker`: rank 0 is the `WorkerActor` it already knows (its `load`
builds a `ParallelEngine`, the engine every shard runs through), ranks 1..N-1 are `RankActor`s whose `serve`
call runs the follower loop for the whole life of the group. All N sit in one placement group (STRICT_PACK:
one node), one bundle each: `{GPU: 1, CPU: num_cpus_per_worker / N}` on GPU workers, `{CPU: num_cpus_per_worker
/ N}` on CPU workers, so a group is placed whole or not at all.

Start-up (driver/group_start.py), with no round trip through the driver: rank 0's `rendezvous` picks a free
port on its node and returns `tcp://<its ip>:<port>`; that reference is handed to rank 0's `load` and to every
follower's `serve` (Ray resolves it before the call runs), and all N join the group there. The group is ready
when rank 0's `join_ranks` returns: it runs once rank 0's load and every follower's load have succeeded (their
results are its arguments), adds the ranks (node, pid, device, cores, weights bytes) to the worker's record,
and answers like a single worker's `load`. Any rank failing to load fails that call, naming the rank.

A lost rank is a lost worker: a follower's `serve` ends while the group is wanted (its process died, or its
collectives failed: a peer gone or silent past the timeout), or rank 0's engine fails while a follower is
gone or with a collective's error. Then the whole group goes (every actor killed, the placement group
removed) and its shards are retried as any lost worker's, unblamed; the error names the rank, its node and
its pid. A rank whose engine raised on its rows is an engine crash (`RankEnd.crash`), blamed as any.

`engine.backend: vllm` with tensor x pipeline parallel > 1 stays one actor (vLLM starts its ranks inside it) in
a placement group of its own (`vllm_placement`).
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from jobrunner.driver.cores import CoreClaim, claim_cores, cores_per_rank
from jobrunner.driver.engine_factory import build_rank, load_memory
from jobrunner.driver.worker import ShardRunner
from jobrunner.redaction import redact_text, remember_secrets
from jobrunner.spec import JobSpec

RANK_CONCURRENCY = 3  # serve (the whole life) + loaded + ping
LOST_RANK_WAIT_S = 5.0  # how long an engine failure waits for Ray to report which rank died
FROZEN_WAIT_S = 5.0  # how long a follower may take to answer a ping while rank 0's engine call hangs


def bundle_of_rank(spec: JobSpec) -> dict[str, float]:
    """One rank's bundle: one GPU and its share of the worker's CPUs, or that share alone on CPU workers."""
    c, world = spec.cluster, spec.engine.tensor_parallel_size
    bundle = {"CPU": c.num_cpus_per_worker / world}
    if c.num_gpus_per_worker > 0:
        bundle["GPU"] = 1.0
    return bundle


@dataclass(frozen=True)
class Placement:
    """A worker's placement group: its bundles, Ray's strategy for them, and what rank 0's actor (the
    `WorkerActor`, in bundle 0) holds of bundle 0."""

    bundles: list[dict[str, float]]
    strategy: str = "STRICT_PACK"
    actor: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        """How the cluster was asked, for the start deadline's message."""
        where = "one node" if self.strategy == "STRICT_PACK" else "as few nodes as fit"
        first = self.bundles[0]
        shape = (f"{len(self.bundles)} x {json.dumps(first)}" if all(b == first for b in self.bundles)
                 else json.dumps(self.bundles))
        return f"a placement group ({self.strategy}: {where}) of {shape}"


def rank_placement(spec: JobSpec) -> Placement:
    """A tensor-parallel worker of our engine: one bundle per rank, on one node."""
    bundle = bundle_of_rank(spec)
    return Placement([dict(bundle) for _ in range(spec.engine.tensor_parallel_size)], "STRICT_PACK", bundle)


def vllm_placement(spec: JobSpec) -> Placement | None:
    """vLLM with TP x PP > 1 (None otherwise): the worker stays one actor and vLLM starts its ranks.

    - CPU workers, and GPU workers with pipeline_parallel_size 1: one bundle of the worker's CPUs and GPUs, on
      one node, that the actor holds whole (Ray places an actor within one bundle, so TP x PP one-GPU bundles
      could not hold it); vLLM's ranks are processes of that node over the GPUs the actor holds.
    - GPU workers with pipeline stages: TP x PP one-GPU bundles (the first also with the worker's CPUs), PACK
      (stages may land on other nodes); the actor holds the CPUs of bundle 0 and no GPU, and hands the group
      to vLLM, whose Ray executor puts one rank in each bundle (engine_factory.vllm_placement_here).
    """
    e, c = spec.engine, spec.cluster
    world = e.tensor_parallel_size * e.pipeline_parallel_size
    if e.backend != "vllm" or world <= 1:
        return None
    if c.num_gpus_per_worker <= 0:
        whole = {"CPU": c.num_cpus_per_worker}
        return Placement([whole], "STRICT_PACK", whole)
    if e.pipeline_parallel_size == 1:
        whole = {"CPU": c.num_cpus_per_worker, "GPU": float(world)}
        return Placement([whole], "STRICT_PACK", whole)
    bundles = [{"CPU": c.num_cpus_per_worker, "GPU": 1.0}] + [{"GPU": 1.0} for _ in range(world - 1)]
    return Placement(bundles, "PACK", {"CPU": c.num_cpus_per_worker})


def make_placement(name: str, placement: Placement) -> Any:
    """The worker's placement group (not waited for: its actors stay pending until it is placed)."""
    return placement_group(placement.bundles, strategy=placement.strategy, name=name)


def in_bundle(pg: Any, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


def rank_timeout_s(spec: JobSpec) -> float:
    """The collectives' limit: long enough for the slowest rank's load (the first collectives wait for it);
    a dead rank fails the others at once (its sockets close), a frozen one is the driver's hang to detect."""
    return max(spec.cluster.worker_start_timeout_s, spec.cluster.progress_timeout_s)


def here(rank: int) -> dict[str, Any]:
    """Who this rank is: rank, node, node ip, pid."""
    return {"rank": rank, "node": socket.gethostname(), "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid()}


def local_rank_spec(spec: JobSpec, rank: int, init_method: str) -> tuple[Any, CoreClaim, dict[str, Any]]:
    """This rank's RankSpec (its cores claimed on CPU workers, its GPU on GPU workers), the claim to hold for
    the process's life, and its record (node, pid, device, cores)."""
    from jobrunner.engine.parallel import RankSpec

    world = spec.engine.tensor_parallel_size
    claim, device_index, device = CoreClaim(), None, "cpu"
    if spec.cluster.num_gpus_per_worker > 0:
        device_index = 0  # Ray shows this actor its bundle's one GPU as cuda:0 (CUDA_VISIBLE_DEVICES)
        gpu_ids = ray.get_gpu_ids()
        device = f"cuda:{gpu_ids[0]}" if gpu_ids else "cuda:0"
    else:
        claim = claim_cores(cores_per_rank(spec.cluster.num_cpus_per_worker, world))
    rank_spec = RankSpec(rank=rank, world=world, init_method=init_method, timeout_s=rank_timeout_s(spec),
                         cpu_cores=claim.cores, device_index=device_index)
    return rank_spec, claim, {**here(rank), "device": device, "cores": list(claim.cores)}


def rank_weights(engine: Any) -> dict[str, int]:
    """The weights this rank holds and its load's peak memory (its engine's ``model_info``), for the worker's
    record."""
    return load_memory(getattr(engine, "model_info", None))


class RankActor:
    """Rank 1..N-1 of a tensor-parallel worker: loads its shard, then follows the leader's steps."""

    def __init__(self, spec_dict: dict[str, Any], worker_id: str, rank: int,
                 secret_values: tuple[str, ...] = ()) -> None:
        remember_secrets(secret_values)
        self.spec_dict, self.worker_id, self.rank = spec_dict, worker_id, rank
        self.loaded = threading.Event()
        self.record: dict[str, Any] = {}
        self.error: str | None = None
        self.claim = CoreClaim()

    def ping(self) -> dict[str, Any]:
        """Answers once placed: rank, node, node ip, pid."""
        return here(self.rank)

    def serve(self, init_method: str) -> str:
        """Join the group at ``init_method``, load this rank's shard, then run the leader's steps until it
        closes the group (returns) or a collective fails (raises). Load and serve share this thread: the
        cores it pins are those its compute threads start on. A failed load returns its error: `loaded_record`
        raises it (the group's start fails), and nobody waits on this call before the group is ready."""
        try:
            spec = JobSpec.model_validate(self.spec_dict)
            rank_spec, self.claim, record = local_rank_spec(spec, self.rank, init_method)
            follower = build_rank(spec, rank_spec)
            self.record = {**record, **rank_weights(getattr(follower, "engine", None))}
        except Exception as exc:  # noqa: BLE001 - named; `loaded_record` raises it
            self.error = redact_text(f"rank {self.rank} ({where(here(self.rank))}) failed to load: "
                                     f"{type(exc).__name__}: {exc}")
            return self.error
        finally:
            self.loaded.set()
        follower.serve()
        return "closed"

    def loaded_record(self) -> dict[str, Any]:
        """This rank's record once its shard is loaded (raises naming the rank if the load failed)."""
        self.loaded.wait()
        if self.error is not None:
            raise RuntimeError(self.error)
        return self.record


def where(record: dict[str, Any]) -> str:
    """'node <host>, pid <pid>' of a rank's record."""
    return f"node {record.get('node', '?')}, pid {record.get('pid', '?')}"


@dataclass(frozen=True)
class RankEnd:
    """Why a group ended: ``error`` names the rank, its node and pid; ``crash`` is the engine's own error when a
    rank's engine raised on its rows (the driver blames them, as for any engine crash), None for a lost rank
    (its process died, or its collectives failed: nobody's fault, the shards are retried as a lost worker's)."""

    error: str
    crash: str | None = None


@dataclass(eq=False)
class RankGroup:
    """The actors and placement group of one tensor-parallel worker, as the pool holds them."""

    pg: Any
    leader: Any
    followers: list[Any]
    ping_refs: dict[Any, int]  # ping -> rank (rank 0 too): who is where
    serve_refs: dict[Any, int]  # follower serve -> rank: ends only when the group is closed or broken
    known: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> node, pid (from its ping)
    ended: RankEnd | None = None  # why a follower's serve ended (set once)

    def wake_refs(self) -> list[Any]:
        """Refs whose answer the job loop waits on: the followers' serve calls."""
        return list(self.serve_refs)

    def check(self, wait_s: float = 0.0) -> RankEnd | None:
        """Why a follower stopped serving (None while every one serves): collects answered pings (who is
        where) and ended serve calls, waiting up to ``wait_s`` for one to end."""
        self._take_pings()
        if self.ended is None and self.serve_refs:
            done, _ = ray.wait(list(self.serve_refs), num_returns=1, timeout=wait_s)
            if done:
                self.ended = self._describe_end(done[0])
        return self.ended

    def _take_pings(self) -> None:
        done, _ = ray.wait(list(self.ping_refs), num_returns=len(self.ping_refs), timeout=0) if self.ping_refs \
            else ([], [])
        for ref in done:
            rank = self.ping_refs.pop(ref)
            try:
                self.known[rank] = ray.get(ref, timeout=0)
            except (RayActorError, RayTaskError, GetTimeoutError):
                self.known.setdefault(rank, {"rank": rank})

    def _describe_end(self, ref: Any) -> RankEnd:
        rank = self.serve_refs[ref]
        crash = None
        try:
            ray.get(ref, timeout=0)
            what = "its follower loop ended although the leader did not close the group"
        except RayActorError as exc:
            what = f"its process died ({_death(exc)})"
        except RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            what = f"{type(cause).__name__}: {cause}" if cause is not None else _last_line(exc)
            crash = None if is_collective_failure(what) else redact_text(what)
            dead = self.dead_rank() if crash is None else None  # the peer whose loss failed its collective
            if dead is not None and dead[0] != rank:
                return RankEnd(redact_text(f"{self._who(dead[0], 'lost')}: its process died ({dead[1]}); rank "
                                           f"{rank} saw: {what}"))
        return RankEnd(redact_text(f"{self._who(rank, 'failed' if crash is not None else 'lost')}: {what}"), crash)

    def _who(self, rank: int, verb: str) -> str:
        return f"rank {rank} of {len(self.followers) + 1} {verb} ({where(self.known.get(rank, {}))})"

    def dead_rank(self, wait_s: float = FROZEN_WAIT_S) -> tuple[int, str] | None:
        """The first rank whose actor Ray reports dead (rank, Ray's short word on it), asking each with a
        ping answered within ``wait_s``; None when every rank that answered is alive."""
        actors = {0: self.leader, **dict(enumerate(self.followers, start=1))}
        pings = {actor.ping.remote(): rank for rank, actor in actors.items()}
        done, _ = ray.wait(list(pings), num_returns=len(pings), timeout=wait_s)
        for ref in sorted(done, key=lambda r: pings[r]):
            try:
                ray.get(ref, timeout=0)
            except RayActorError as exc:
                return pings[ref], _death(exc)
            except (RayTaskError, GetTimeoutError):
                continue
        return None

    def leader_lost(self, error: str) -> str:
        """Rank 0's actor died (its calls failed with ``error``): named as a lost rank."""
        self._take_pings()
        died = re.search(r"exit type: \w+", error) is not None
        what = f"its process died ({_death(Exception(error))})" if died else error
        return redact_text(f"{self._who(0, 'lost')}: {what}")

    def frozen_rank(self, stall: str, wait_s: float = FROZEN_WAIT_S) -> RankEnd | None:
        """Rank 0's engine call hangs (``stall``): the first follower that does not answer a ping within
        ``wait_s`` (stopped, or its node unreachable: rank 0 waits on it in a collective), or None."""
        pings = {f.ping.remote(): rank for rank, f in enumerate(self.followers, start=1)}
        done, _ = ray.wait(list(pings), num_returns=len(pings), timeout=wait_s)
        silent = sorted(rank for ref, rank in pings.items() if ref not in done)
        if not silent:
            return None
        rank = silent[0]
        return RankEnd(redact_text(f"rank {rank} of {len(self.followers) + 1} lost ({where(self.known.get(rank, {}))}"
                                   f"): it does not answer within {wait_s:g} s (stopped, or its node unreachable) "
                                   f"while rank 0 waits: {stall}"))

    def kill(self) -> None:
        """Kill every rank's actor and remove the placement group (already-dead actors included)."""
        for actor in [self.leader, *self.followers]:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        try:
            remove_placement_group(self.pg)
        except Exception:  # noqa: BLE001 - already removed
            pass


# what torch.distributed says when a peer is gone or silent (gloo: "Connection closed by peer", timeouts; nccl)
_COLLECTIVE_WORDS = re.compile(r"gloo|nccl|Connection (closed|reset) by peer|Dist(Backend|Network|Store)Error|"
                               r"[Tt]imed out|tensor-parallel group is broken", re.IGNORECASE)


def is_collective_failure(text: str) -> bool:
    """Whether an error is a collective's failure (a peer lost, or silent past the timeout), not an engine's
    own error on its rows."""
    return bool(_COLLECTIVE_WORDS.search(text))


def explain_engine_failure(group: RankGroup, reason: str, wait_s: float = LOST_RANK_WAIT_S) -> RankEnd:
    """Rank 0's engine failed (``reason``): a rank lost with it (Ray reports a dead actor within seconds, so
    this waits up to ``wait_s`` for a follower's serve to end), a collective failure naming no rank, or the
    engine's own crash on its rows."""
    deadline = time.monotonic() + wait_s
    found = group.check()
    while found is None and group.followers and time.monotonic() < deadline:
        found = group.check(wait_s=min(0.5, max(0.0, deadline - time.monotonic())))
    if found is not None:
        return found
    if is_collective_failure(reason):
        return RankEnd(redact_text(f"rank 0 of {len(group.followers) + 1} ({where(group.known.get(0, {}))}) lost "
                                   f"its group: {reason}"))
    return RankEnd(redact_text(reason), reason)


class GroupShardRunner(ShardRunner):
    """Rank 0's shard runner. A failed step leaves the group broken (the ranks left their collective
    sequence), so its rows are not isolated in-process over a rebuilt engine: the worker fails at once, before
    any row is blamed, and the driver judges the loss (a lost rank: the shards are retried unblamed; the
    engine's own crash: its rows are isolated by worker restarts, driver/losses.py)."""

    def _on_engine_failure(self, reason: str) -> None:
        raise RuntimeError(f"rank 0's step failed: {reason}")


def _death(exc: BaseException) -> str:
    """Ray's word on a dead actor, short: its exit type and the first sentence of the detail."""
    text = str(exc)
    kind = re.search(r"exit type: (\w+)", text)
    detail = re.search(r"exit detail: ([^.]*\.)", text)
    if kind is None and detail is None:
        return _last_line(exc)
    return ", ".join(m.group(1) for m in (kind, detail) if m is not None)


def _last_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else type(exc).__name__
