"""The job loop: start worker actors, hand out shards, commit results to the manifest, retry failures.

The driver is the only owner of shard state. Each ready worker holds at most two shards (the one decoding
and the next one, whose rows join the engine before the first drains). A finished shard is recorded in the
manifest (written atomically) as soon as its part is committed. A worker that dies has all its shards
requeued (bounded attempts, exponential backoff) and is replaced while the restart budget lasts; a shard
that keeps failing is marked failed and the rest of the job carries on.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from jobrunner.driver import manifest as mf
from jobrunner.driver.actor import start_worker
from jobrunner.driver.output_files import finish_job_files
from jobrunner.driver.plan import JobPlan, open_output, plan_job, with_absolute_output
from jobrunner.driver.progress import Progress
from jobrunner.driver.session import ray_session
from jobrunner.driver.worker import EngineFailed, ShardResult
from jobrunner.io.layout import TEMP_DIR
from jobrunner.io.manifest import mark_success, write_manifest
from jobrunner.io.storage import Storage
from jobrunner.spec import JobSpec

log = logging.getLogger(__name__)
SHARDS_PER_WORKER = 2
MAX_LISTED_FAILURES = 20


@dataclass
class JobResult:
    """How a run ended."""

    output_url: str
    manifest: dict[str, Any]
    failed: dict[str, str]  # shard_id -> error

    @property
    def ok(self) -> bool:
        return not self.failed

    def summary(self) -> str:
        """A short human summary (names failed shards)."""
        t = self.manifest["totals"]
        text = (f"{self.manifest['job_name']}: {t['shards_committed']}/{t['shards_total']} shards committed, "
                f"{t['rows']} rows ({t['num_errors']} row errors), {t['num_output_tokens']} output tokens, "
                f"wall {self.manifest['wall_s']:.1f}s -> {self.output_url}")
        failed = sorted(self.failed.items())
        for shard_id, error in failed[:MAX_LISTED_FAILURES]:
            text += f"\n  FAILED shard {shard_id}: {error}"
        if len(failed) > MAX_LISTED_FAILURES:
            text += f"\n  ... and {len(failed) - MAX_LISTED_FAILURES} more failed shards (see _manifest.json)"
        return text


@dataclass(eq=False)
class _Worker:
    worker_id: str
    actor: Any
    ready_ref: Any
    is_ready: bool = False
    shard_refs: set = field(default_factory=set)


def run_job(spec: JobSpec, address: str | None = None, show_progress: bool = True) -> JobResult:
    """Run a job to the end (validating input and output before any worker starts)."""
    spec = with_absolute_output(spec)
    plan = plan_job(spec)
    storage, manifest = open_output(spec, plan)
    loop = _JobLoop(spec, plan, storage, manifest, show_progress)
    if not loop.queue:  # everything already committed: no need for Ray
        return loop.run()
    with ray_session(spec, address):
        return loop.run()


class _JobLoop:
    def __init__(self, spec: JobSpec, plan: JobPlan, storage: Storage, manifest: dict[str, Any],
                 show_progress: bool) -> None:
        self.spec, self.plan, self.storage, self.manifest = spec, plan, storage, manifest
        self.shards = {s.shard_id: s for s in plan.shards}
        status = manifest["shards"]
        todo = [s.shard_id for s in plan.shards if status[s.shard_id]["status"] != "committed"]
        self.queue: deque[str] = deque(todo)
        self.not_before: dict[str, float] = {}
        self.attempts: dict[str, int] = {}
        self.failed: dict[str, str] = {}
        self.in_flight: dict[Any, tuple[_Worker, str]] = {}
        self.workers: list[_Worker] = []
        self.restarts_left = spec.cluster.max_worker_restarts
        self.num_started = 0
        self.run_token = uuid.uuid4().hex[:8]
        self.last_worker_error = ""
        self.run_index = int(manifest.get("run_count") or 0)
        manifest["run_count"] = self.run_index + 1
        self.started_at, self.t0, self.wall_t0 = mf.now_iso(), time.monotonic(), time.time()
        self.live_progress: dict[str, tuple[int, int]] = {}
        self.run_tokens = 0
        # Output rows: n per input row (per-row overrides of n make this an estimate).
        self.progress = Progress(plan.num_rows * spec.sampling.n, self._committed_rows(), enabled=show_progress)
        self.next_poll = 0.0

    # ---- top level ----------------------------------------------------------------------------------
    def run(self) -> JobResult:
        write_manifest(self.storage, self.manifest)
        try:
            if self.queue:
                self._start_workers(min(self.spec.cluster.num_workers, len(self.queue)))
                self._loop()
        finally:
            self._stop_workers()
            self.progress.close()
        return self._finish()

    def _loop(self) -> None:
        while self.queue or self.in_flight:
            self._assign()
            waiting = list(self.in_flight) + [w.ready_ref for w in self.workers if not w.is_ready]
            if not waiting:
                if not self.workers:
                    self._fail_remaining(f"no worker left to run it ({self.last_worker_error or 'all died'})")
                    return
                time.sleep(max(0.05, min(1.0, min(self.not_before.values(), default=0) - time.monotonic())))
                continue
            done, _ = ray.wait(waiting, num_returns=1, timeout=1.0)
            for ref in done:
                self._handle(ref)
            self._poll_progress()

    # ---- workers ------------------------------------------------------------------------------------
    def _start_workers(self, count: int) -> None:
        for _ in range(count):
            self._start_one()

    def _start_one(self) -> None:
        # w0, w1, ... in the first run; r1w0, ... in a resumed run, so ids never clash across runs.
        prefix = f"r{self.run_index}" if self.run_index else ""
        worker_id = f"{prefix}w{self.num_started}"
        self.num_started += 1
        actor = start_worker(self.spec, worker_id, self.wall_t0, self.run_token)
        self.workers.append(_Worker(worker_id, actor, actor.ready.remote()))

    def _worker_died(self, worker: _Worker, error: str) -> None:
        """Requeue the dead worker's shards and start a replacement while the budget lasts."""
        log.warning("worker %s died: %s", worker.worker_id, error)
        self.last_worker_error = f"worker {worker.worker_id}: {error}"
        if worker in self.workers:
            self.workers.remove(worker)
        ray.kill(worker.actor, no_restart=True)
        for ref in list(worker.shard_refs):
            _, shard_id = self.in_flight.pop(ref)
            self._attempt_failed(shard_id, f"worker {worker.worker_id} died: {error}")
        if self.restarts_left > 0 and (self.queue or self.in_flight):
            self.restarts_left -= 1
            self._start_one()

    def _stop_workers(self) -> None:
        refs = {w.actor.finish.remote(): w for w in self.workers if w.is_ready}
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=30) if refs else ([], [])
        for ref in done:
            try:
                mf.record_worker(self.manifest, refs[ref].worker_id, ray.get(ref))
            except (RayActorError, RayTaskError):
                pass
        for w in self.workers:
            ray.kill(w.actor, no_restart=True)
        self.workers.clear()

    # ---- shards -------------------------------------------------------------------------------------
    def _assign(self) -> None:
        for worker in self.workers:
            while self._can_take(worker):
                shard_id = self._next_shard(alone=not worker.shard_refs)
                if shard_id is None:
                    break
                self.attempts[shard_id] = self.attempts.get(shard_id, 0) + 1
                ref = worker.actor.run_shard.remote(self.shards[shard_id])
                worker.shard_refs.add(ref)
                self.in_flight[ref] = (worker, shard_id)

    def _can_take(self, worker: _Worker) -> bool:
        busy = len(worker.shard_refs) >= SHARDS_PER_WORKER or self._has_retried(worker)
        return worker.is_ready and not busy

    def _has_retried(self, worker: _Worker) -> bool:
        return any(self.attempts.get(self.in_flight[ref][1], 0) > 1 for ref in worker.shard_refs)

    def _next_shard(self, alone: bool) -> str | None:
        """The next runnable shard. A retried shard runs alone on its worker (nothing queued beside it), so
        a shard that kills its worker cannot use up the attempts of healthy shards."""
        now = time.monotonic()
        for shard_id in self.queue:
            retried = self.attempts.get(shard_id, 0) > 0
            if self.not_before.get(shard_id, 0.0) <= now and (alone or not retried):
                self.queue.remove(shard_id)
                self.not_before.pop(shard_id, None)
                return shard_id
        return None

    def _handle(self, ref: Any) -> None:
        if ref not in self.in_flight:
            self._handle_ready(ref)
            return
        worker, shard_id = self.in_flight[ref]
        try:
            result = ray.get(ref)
        except RayActorError as exc:
            self._worker_died(worker, _short(exc))
            return
        except RayTaskError as exc:
            self._task_failed(ref, worker, shard_id, exc)
            return
        del self.in_flight[ref]
        worker.shard_refs.discard(ref)
        self._committed(result)

    def _handle_ready(self, ref: Any) -> None:
        worker = next(w for w in self.workers if w.ready_ref == ref)
        try:
            info = ray.get(ref)
        except (RayActorError, RayTaskError) as exc:
            self._worker_died(worker, f"failed to start: {_short(exc)}")
            return
        worker.is_ready = True
        self.manifest["model"].update(info["model"])
        mf.record_worker(self.manifest, worker.worker_id, info["stats"])

    def _task_failed(self, ref: Any, worker: _Worker, shard_id: str, exc: RayTaskError) -> None:
        if isinstance(exc.cause, EngineFailed):
            self._worker_died(worker, _short(exc))
            return
        del self.in_flight[ref]
        worker.shard_refs.discard(ref)
        self._attempt_failed(shard_id, _short(exc))

    def _attempt_failed(self, shard_id: str, error: str) -> None:
        attempts = self.attempts.get(shard_id, 1)
        give_up = attempts >= self.spec.cluster.max_shard_attempts
        mf.record_failure(self.manifest, shard_id, error, attempts, failed=give_up)
        self.live_progress.pop(shard_id, None)
        if give_up:
            self.failed[shard_id] = error
            log.error("shard %s failed after %d attempt(s): %s", shard_id, attempts, error)
        else:
            backoff = self.spec.cluster.retry_backoff_s * 2 ** (attempts - 1)
            self.not_before[shard_id] = time.monotonic() + backoff
            self.queue.append(shard_id)
        self._save()

    def _committed(self, result: ShardResult) -> None:
        mf.record_commit(self.manifest, result, self.attempts.get(result.shard_id, 1))
        self.live_progress.pop(result.shard_id, None)
        self.run_tokens += result.num_output_tokens
        self._save()
        self._show_progress()

    def _fail_remaining(self, error: str) -> None:
        for shard_id in list(self.queue):
            mf.record_failure(self.manifest, shard_id, error, self.attempts.get(shard_id, 0), failed=True)
            self.failed[shard_id] = error
        self.queue.clear()
        self._save()

    # ---- manifest, progress -------------------------------------------------------------------------
    def _save(self) -> None:
        mf.update_totals(self.manifest)
        write_manifest(self.storage, self.manifest)

    def _poll_progress(self) -> None:
        if time.monotonic() < self.next_poll:
            return
        self.next_poll = time.monotonic() + 1.0
        refs = [w.actor.progress.remote() for w in self.workers if w.is_ready]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0.5) if refs else ([], [])
        live: dict[str, tuple[int, int]] = {}
        for ref in done:
            try:
                live.update(ray.get(ref, timeout=0))
            except (RayActorError, RayTaskError, GetTimeoutError):
                pass
        self.live_progress = {k: v for k, v in live.items() if k in self.shards
                              and self.manifest["shards"][k]["status"] != "committed"}
        self._show_progress()

    def _committed_rows(self) -> int:
        return sum(e["rows"] for e in self.manifest["shards"].values() if e["status"] == "committed")

    def _show_progress(self) -> None:
        rows = self._committed_rows() + sum(r for r, _ in self.live_progress.values())
        self.progress.update(rows, self.run_tokens + sum(t for _, t in self.live_progress.values()))

    def _finish(self) -> JobResult:
        finished = not self.failed and not self.queue
        mf.finalize(self.manifest, self.started_at, time.monotonic() - self.t0, finished)
        write_manifest(self.storage, self.manifest)
        if finished:
            shards = self.manifest["shards"]
            finish_job_files(self.spec, self.storage, [shards[s]["part"] for s in sorted(shards)])
            mark_success(self.storage)
        self.storage.delete(TEMP_DIR, recursive=True)
        return JobResult(output_url=self.spec.output.url, manifest=self.manifest, failed=dict(self.failed))


def _short(exc: BaseException) -> str:
    """The useful last line of a Ray error."""
    cause = getattr(exc, "cause", None)
    if cause is not None and not isinstance(cause, RayTaskError):
        return f"{type(cause).__name__}: {cause}"
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1][:500] if lines else type(exc).__name__
