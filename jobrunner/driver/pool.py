"""The worker pool: start workers, know which are placed / ready / busy, replace the lost ones at a rate.

A worker is an actor that is first placed (its `ping` answers), then loads its engine (`load` returns).
The pool keeps `num_workers` workers whenever the cluster can host them: a lost worker is replaced at once
while fewer than `max_worker_restarts` replacements were started in the last `worker_restart_window_s`, and
later otherwise, so a few node preemptions never shrink the pool for good; an empty pool that may start no
replacement is reported by `refill_problem()` (the job then ends: nothing else could run its shards).
Deadlines: no worker ready within `worker_start_timeout_s` ends the job with the resources the cluster could
not give; a busy worker silent, or inside an engine call that has not returned, for `progress_timeout_s` is
reported by `stalled()` (the job loop replaces it; an engine that steps without progress is handled inside
the worker: driver/isolation.py). Silence is the age of the worker's oldest unanswered progress poll, and
replies are collected on every pass of the job loop (whose wait also wakes on them), so a worker is never
called silent because the driver had not looked yet; a poll goes out every POLL_INTERVAL_S. A hung engine is
reported by the worker itself (its poll thread answers while the engine call has not returned), after
`progress_timeout_s`; a worker that does not answer at all (stopped, frozen, unreachable: a crash Ray reports on
its own) is lost after `max(progress_timeout_s, MIN_SILENCE_S)`: on a starved machine a healthy worker's
reply was seen to take over 3 s, and each false death costs a model load.

The pool alone changes `Worker` fields: the job loop hands it a started task (`assign`), takes a returned
one back (`task_done`) and gets a lost worker's tasks from `remove`.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from jobrunner.driver.actor import start_worker, worker_resources
from jobrunner.driver.engine_factory import is_rank_group
from jobrunner.driver.group_start import start_group
from jobrunner.driver.progress_counts import ShardProgress
from jobrunner.driver.rank_group import (
    RankEnd,
    RankGroup,
    explain_engine_failure,
    make_placement,
    rank_placement,
    vllm_placement,
)
from jobrunner.driver.tasks import Task
from jobrunner.spec import PROGRESS_POLL_S, JobSpec

MAX_START_FAILURES = 3  # workers in a row that fail to load with none ready: the job cannot run
POLL_INTERVAL_S = PROGRESS_POLL_S  # progress_timeout_s must be several of these (spec.py refuses less)
MIN_SILENCE_S = 30.0  # a worker that answers no poll for this long (or progress_timeout_s, if longer) is lost


@dataclass(eq=False)
class Worker:
    """One worker actor as the driver sees it."""

    worker_id: str
    actor: Any
    ping_ref: Any
    load_ref: Any
    started_at: float = field(default_factory=time.monotonic)
    is_placed: bool = False
    is_ready: bool = False
    tasks: dict[Any, Task] = field(default_factory=dict)  # task ref -> task in flight
    poll_ref: Any = None  # the progress poll not answered yet
    poll_sent: float = 0.0  # when poll_ref was sent (monotonic): its age is the worker's silence
    stalled_s: float = 0.0  # how long its current engine call has not returned (from the last poll)
    stall: str = ""  # what it was doing then, naming its shards
    suspects: dict[tuple[str, int], list[int]] = field(default_factory=dict)  # a hung call's rows in the engine
    live: dict[tuple[str, int], ShardProgress] = field(default_factory=dict)  # (shard, row_start) -> its counts
    engine_tokens: int = 0  # output tokens its engine sampled so far (last poll)
    group: RankGroup | None = None  # a tensor-parallel worker's ranks and placement group (vLLM's placement)


class WorkerPool:
    """Workers of one run (ids w0, w1, ... in the first run; r<k>w0, ... in run k)."""

    def __init__(self, spec: JobSpec, run_index: int, wall_t0: float, run_token: str) -> None:
        self.spec, self.run_index, self.wall_t0, self.run_token = spec, run_index, wall_t0, run_token
        self.workers: list[Worker] = []
        self.num_started = 0
        self.restart_times: deque[float] = deque()
        self.start_failures = 0
        self.ever_ready = False
        self.last_error = ""
        self.removed_tokens = 0  # tokens sampled by workers of this run that are gone
        self.dropped: list[Any] = []  # task refs of removed workers, read once done (else Ray logs their errors)
        # each worker's start-up as the driver saw it: seconds from its actor request to placed / ready /
        # first output token (the first progress poll that reports one: within POLL_INTERVAL_S)
        self.startup: dict[str, dict[str, float]] = {}

    # ---- size ---------------------------------------------------------------------------------------
    def start(self, count: int) -> None:
        """Start `count` workers (the initial pool; not counted as restarts)."""
        for _ in range(count):
            self._start_one()

    def top_up(self, wanted: int) -> None:
        """Start replacements until `wanted` workers exist, within the restart rate."""
        self._forget_old_restarts()
        while len(self.workers) < wanted and len(self.restart_times) < self.spec.cluster.max_worker_restarts:
            self.restart_times.append(time.monotonic())
            self._start_one()

    def _forget_old_restarts(self) -> None:
        window, now = self.spec.cluster.worker_restart_window_s, time.monotonic()
        while self.restart_times and now - self.restart_times[0] > window:
            self.restart_times.popleft()

    def _start_one(self) -> None:
        prefix = f"r{self.run_index}" if self.run_index else ""
        worker_id = f"{prefix}w{self.num_started}"
        self.num_started += 1
        if is_rank_group(self.spec):  # N rank actors in one placement group (driver/rank_group.py)
            actor, ping_ref, ready_ref, group = start_group(self.spec, worker_id, self.wall_t0, self.run_token)
            self.workers.append(Worker(worker_id, actor, ping_ref, ready_ref, group=group))
            return
        group, placement = None, vllm_placement(self.spec)
        if placement is not None:  # vLLM over TP x PP ranks: one actor in a placement group of its own
            pg = make_placement(f"jobrunner:{self.spec.name}:{self.run_token}:{worker_id}", placement)
            actor = start_worker(self.spec, worker_id, self.wall_t0, self.run_token, placement=(pg, 0, placement.actor))
            group = RankGroup(pg, actor, [], {}, {})
        else:
            actor = start_worker(self.spec, worker_id, self.wall_t0, self.run_token)
        self.workers.append(Worker(worker_id, actor, actor.ping.remote(), actor.load.remote(), group=group))

    def remove(self, worker: Worker, error: str) -> list[tuple[Any, Task]]:
        """Forget a worker and kill its actor (a stopped or unreachable process included); the (ref, task)
        pairs it held."""
        self.last_error = f"worker {worker.worker_id}: {error}"
        if worker in self.workers:
            self.workers.remove(worker)
            self.removed_tokens += worker.engine_tokens
        if worker.group is not None:
            worker.group.kill()  # every rank's actor and the placement group
        else:
            try:
                ray.kill(worker.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        tasks = list(worker.tasks.items())
        self.dropped += [ref for ref, _ in tasks]
        worker.tasks.clear()
        worker.live.clear()
        return tasks

    def refill_problem(self) -> str | None:
        """Why an empty pool stays empty (None while it has workers or may start one): the restart rate."""
        if self.workers:
            return None
        c = self.spec.cluster
        self._forget_old_restarts()
        if len(self.restart_times) < c.max_worker_restarts:
            return None
        return (f"no worker left and none may be started: cluster.max_worker_restarts={c.max_worker_restarts} "
                f"replacement(s) already started in the last cluster.worker_restart_window_s="
                f"{c.worker_restart_window_s:g}s; last loss: {self.last_error}")

    # ---- tasks --------------------------------------------------------------------------------------
    def assign(self, worker: Worker, ref: Any, task: Task) -> None:
        """A task started on the worker (`ref`: its result)."""
        worker.tasks[ref] = task

    def task_done(self, ref: Any) -> tuple[Worker, Task] | None:
        """The worker and task of a returned task ref, forgotten by the worker (None: a removed worker's)."""
        for w in self.workers:
            task = w.tasks.pop(ref, None)
            if task is not None:
                w.live.pop((task.shard_id, task.row_start), None)
                return w, task
        return None

    def owner(self, ref: Any) -> Worker | None:
        return next((w for w in self.workers if ref in w.tasks), None)

    def task_refs(self) -> list[Any]:
        return [ref for w in self.workers for ref in w.tasks]

    @property
    def busy(self) -> bool:
        return any(w.tasks for w in self.workers)

    def stop_all(self, timeout_s: float = 30.0) -> dict[str, dict[str, Any]]:
        """Stop every worker: the final stats of the ready ones that answer within timeout_s, by worker id."""
        refs = {w.actor.finish.remote(): w for w in self.workers if w.is_ready}
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        stats = {}
        for ref in done:
            try:
                stats[refs[ref].worker_id] = ray.get(ref)
            except (RayActorError, RayTaskError):
                pass
        for w in list(self.workers):
            self.remove(w, "job finished")
        return stats

    # ---- start-up -----------------------------------------------------------------------------------
    def start_refs(self) -> dict[Any, Worker]:
        """Pending ping / load refs -> worker."""
        refs: dict[Any, Worker] = {}
        for w in self.workers:
            if not w.is_placed:
                refs[w.ping_ref] = w
            if not w.is_ready:
                refs[w.load_ref] = w
        return refs

    def on_placed(self, worker: Worker) -> None:
        worker.is_placed = True
        self._note_startup(worker, "placed_s")

    def on_ready(self, worker: Worker) -> None:
        worker.is_ready = worker.is_placed = True
        self._note_startup(worker, "ready_s")
        self.ever_ready = True
        self.start_failures = 0

    def on_start_failed(self, worker: Worker, error: str) -> None:
        self.start_failures += 1
        self.remove(worker, f"failed to start: {error}")

    def start_problem(self) -> str | None:
        """Why the job cannot get a worker (None while it still may): start-up deadline or load failures."""
        if any(w.is_ready for w in self.workers):
            return None
        if self.start_failures >= MAX_START_FAILURES and not self.ever_ready:
            return f"{self.start_failures} workers in a row failed to start; last: {self.last_error}"
        timeout = self.spec.cluster.worker_start_timeout_s
        waiting = [w for w in self.workers if time.monotonic() - w.started_at > timeout]
        if not waiting or len(waiting) < len(self.workers):
            return None
        unplaced = [w for w in waiting if not w.is_placed]
        if unplaced:
            return (f"no worker started within cluster.worker_start_timeout_s={timeout:g}s: the cluster could "
                    f"not give {self._asked()} x {len(unplaced)} ({_cluster_resources()})")
        return (f"no worker finished loading the model within cluster.worker_start_timeout_s={timeout:g}s "
                f"({len(waiting)} placed, still loading)")

    def _asked(self) -> str:
        """What one worker asks the cluster for: its resources, or its placement group."""
        placement = rank_placement(self.spec) if is_rank_group(self.spec) else vllm_placement(self.spec)
        return placement.describe() if placement is not None else json.dumps(worker_resources(self.spec))

    # ---- progress -----------------------------------------------------------------------------------
    def poll_refs(self) -> list[Any]:
        """Progress polls not answered yet, and the follower ranks' serve calls of tensor-parallel workers
        (they end only when a rank is lost): the job loop's wait wakes on them too."""
        polls = [w.poll_ref for w in self.workers if w.poll_ref is not None]
        return polls + [ref for w in self.workers if w.group is not None and w.is_ready for ref in w.group.wake_refs()]

    def lost(self) -> list[tuple[Worker, RankEnd]]:
        """Ready tensor-parallel workers whose follower rank stopped serving, with why (naming the rank, its node
        and pid; a crash when its engine raised on its rows); one still starting fails its start instead (its
        ready call fails with the rank's error)."""
        return [(w, end) for w in self.workers if w.group is not None and w.is_ready
                for end in [w.group.check()] if end is not None]

    def named_loss(self, worker: Worker, error: str) -> str:
        """A worker whose actor died (``error``): a tensor-parallel worker's names rank 0, its node and pid."""
        return worker.group.leader_lost(error) if worker.group is not None and worker.group.followers else error

    def explain_failure(self, worker: Worker, error: str, reason: str) -> RankEnd:
        """A worker's engine failed beyond repair (``reason``): a tensor-parallel worker's lost rank (not the
        rows' crash) when one went with it; otherwise the engine's crash."""
        if worker.group is None or not worker.group.followers:
            return RankEnd(error, reason)
        return explain_engine_failure(worker.group, reason)

    def poll(self) -> bool:
        """Collect every answered progress poll (each pass of the loop; never blocks) and send a new one to
        each ready worker whose last one went out POLL_INTERVAL_S ago and was answered. True when a reply
        showed progress (a row finished or a token produced since that worker's previous reply)."""
        self._drain_dropped()
        pending = self.poll_refs()
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=0) if pending else ([], [])
        done, now, progressed = set(done), time.monotonic(), False
        for w in self.workers:
            if w.poll_ref is not None and w.poll_ref in done:
                progressed = self._take_poll(w) or progressed
            if w.poll_ref is None and w.is_ready and now - w.poll_sent >= POLL_INTERVAL_S:
                w.poll_ref, w.poll_sent = w.actor.progress.remote(), now
        return progressed

    def _drain_dropped(self) -> None:
        """Read the removed workers' task results that came back (a group's rank 0 may fail its tasks after
        the group was removed for a lost rank): nothing uses them, and Ray logs an error nobody read."""
        if not self.dropped:
            return
        done, self.dropped = ray.wait(self.dropped, num_returns=len(self.dropped), timeout=0)
        for ref in done:
            try:
                ray.get(ref, timeout=0)
            except Exception:  # noqa: BLE001 - a lost worker's result: already handled as its loss
                pass

    def _take_poll(self, worker: Worker) -> bool:
        ref, worker.poll_ref = worker.poll_ref, None
        try:
            reply = ray.get(ref, timeout=0)
        except (RayActorError, RayTaskError, GetTimeoutError):
            return False
        before = (worker.engine_tokens, sum(p.rows for p in worker.live.values()))
        worker.stalled_s = float(reply.get("stalled_s") or 0.0)
        worker.stall = str(reply.get("stall") or "")
        worker.suspects = {tuple(key): list(rows) for key, rows in (reply.get("suspects") or {}).items()}
        worker.live = {key: ShardProgress(*value) for key, value in (reply.get("shards") or {}).items()}
        worker.engine_tokens = max(worker.engine_tokens, int(reply.get("engine_tokens") or 0))
        if worker.engine_tokens:
            self._note_startup(worker, "first_token_s")
        return (worker.engine_tokens, sum(p.rows for p in worker.live.values())) > before

    def stalled(self) -> list[tuple[Worker, str, bool]]:
        """Busy workers past the progress deadline, with why and whether the engine itself reported the
        stall (True) or the worker did not answer its oldest unanswered poll in time (False: stopped,
        unreachable)."""
        limit = self.spec.cluster.progress_timeout_s
        silence_limit = max(limit, MIN_SILENCE_S)
        now = time.monotonic()
        out = []
        for w in self.workers:
            if not w.tasks:
                continue
            silent = silence(w, now)
            if silent > silence_limit:
                out.append((w, f"no answer for {silent:.0f}s (the most is max(cluster.progress_timeout_s={limit:g}, "
                               f"{MIN_SILENCE_S:g}))", False))
            elif w.stalled_s > limit:
                what = w.stall or f"no token produced and no row finished for {w.stalled_s:.0f} s"
                frozen = w.group.frozen_rank(what) if w.group is not None and w.group.followers else None
                if frozen is not None:  # rank 0 waits on a rank that does not answer: not the rows' hang
                    out.append((w, frozen.error, False))
                    continue
                out.append((w, f"{what}; cluster.progress_timeout_s={limit:g}", True))
        return out

    def live_progress(self) -> ShardProgress:
        """Rows, prompts, samples and tokens finished inside shards still running (from the last polls; a poll
        answered before a shard returned no longer counts it, so a returned shard is never counted twice)."""
        total = ShardProgress()
        for w in self.workers:
            running = {(t.shard_id, t.row_start) for t in w.tasks.values()}
            for key, done in w.live.items():
                if tuple(key) in running:
                    total = total.plus(done)
        return total

    def tokens_produced(self) -> int:
        """Output tokens the engines of this run sampled so far, as they were produced (0 with engines that do
        not count them)."""
        return self.removed_tokens + sum(w.engine_tokens for w in self.workers)

    def _note_startup(self, worker: Worker, stage: str) -> None:
        seen = self.startup.setdefault(worker.worker_id, {})
        seen.setdefault(stage, round(time.monotonic() - worker.started_at, 3))


def silence(worker: Worker, now: float) -> float:
    """Seconds the worker has left its oldest progress poll unanswered (0 with none outstanding)."""
    return now - worker.poll_sent if worker.poll_ref is not None else 0.0


def _cluster_resources() -> str:
    try:
        total = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
        free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        return f"cluster total {json.dumps(total)}, available {json.dumps(free)}"
    except Exception:  # noqa: BLE001 - the message is still useful without it
        return "cluster resources unknown"
