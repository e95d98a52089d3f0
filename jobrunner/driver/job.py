"""The job loop: hand out shards to the worker pool, publish finished ones, retry failures, keep books.

The driver is the only owner of shard state and the only party that publishes a part: a worker writes an
attempt to `_temporary/<attempt>/`, and the driver moves the attempt it assigned to `parts/` (fenced commits:
a zombie attempt finishing late is never published). Each ready worker holds at most two tasks (the one
decoding and the next, whose rows join the engine before the first drains). Blame for failures and
bisection of crashing shards are described in driver/tasks.py; the pool's deadlines in driver/pool.py.
Every event costs O(1) in the number of shards: tasks wait in a heap-backed queue, counts are running
totals, and a commit writes one small record (driver/manifest.py). Shard state lives in one compact table
(driver/shards.py: columns, ~120 bytes a shard); a Task exists only for a shard handed out.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from jobrunner.driver import manifest as mf
from jobrunner.driver.isolation import IsolationCost
from jobrunner.driver.metrics import JobMetrics
from jobrunner.driver.output import open_output, read_previous_output
from jobrunner.driver.output_files import finish_job_files
from jobrunner.driver.plan import JobPlan, plan_job, with_absolute_output
from jobrunner.driver.pool import Worker, WorkerPool
from jobrunner.driver.prefix_dealing import fresh_tasks
from jobrunner.driver.prefix_rows import merge_pieces
from jobrunner.driver.prefix_stats import add_chains, publish_prefix_plan, record_summary
from jobrunner.driver.progress import Progress
from jobrunner.driver.progress_text import describe_placing, describe_ray_start, describe_ready
from jobrunner.driver.ray_holder import note_ray_driver
from jobrunner.driver.result import JobResult
from jobrunner.driver.session import ray_session
from jobrunner.driver.shards import ShardTable
from jobrunner.driver.tasks import ShardWork, Task, TaskQueue
from jobrunner.driver.worker import EngineFailed, ShardResult
from jobrunner.io.commits import write_commit_record
from jobrunner.io.layout import TEMP_DIR, part_key
from jobrunner.io.lease import Lease
from jobrunner.io.manifest import mark_success
from jobrunner.io.parts import commit_parts, list_parts
from jobrunner.io.storage import Storage
from jobrunner.redaction import redact_text, redacting_logger
from jobrunner.spec import JobSpec

log = redacting_logger(__name__)
SHARDS_PER_WORKER = 2
PUBLISH_THREADS = 8  # publishes (server-side copies + records) in flight at once: object stores are slow
ALONE_DEATHS_TO_BISECT = 2  # deaths of a whole shard running alone before it is split (pieces, crashes, stalls: 1)


def run_job(spec: JobSpec, address: str | None = None, show_progress: bool = True) -> JobResult:
    """Run a job to the end (validating input and output before any worker starts)."""
    spec = with_absolute_output(spec)
    previous = read_previous_output(spec)  # the old manifest, read once: planning and opening both use it
    plan = plan_job(spec, previous.header)
    storage, manifest, lease = open_output(spec, plan, previous)
    try:
        publish_prefix_plan(storage, manifest, plan.prefix)  # the grouped shards' row order, before any worker
        loop = _JobLoop(spec, plan, storage, manifest, lease, show_progress)
        if not len(loop.queue):  # everything already committed: no need for Ray
            return loop.run()
        loop.progress.stage(describe_ray_start(spec, address))
        with ray_session(spec, address) as joined:
            note_ray_driver(lease, local=not joined)  # a rerun can then ask the cluster whether this job ended
            return loop.run()
    finally:
        lease.release()


class _JobLoop:
    def __init__(self, spec: JobSpec, plan: JobPlan, storage: Storage, manifest: dict[str, Any], lease: Lease,
                 show_progress: bool) -> None:
        self.spec, self.storage, self.manifest, self.lease = spec, storage, manifest, lease
        self.shards: ShardTable = plan.shards
        self.queue = TaskQueue(fresh=fresh_tasks(self.shards.todo(), self._fresh_task, spec.cluster.num_workers,
                                                 plan.prefix is not None and plan.prefix.shares_prefixes))
        self.chains: dict[str, tuple] = {}  # shard id -> its prompts' KV block chains, until committed
        self.work: dict[str, ShardWork] = {}  # shards handed out and not yet committed
        self.failed: dict[str, str] = {}
        self.error: str | None = None
        self.in_flight: dict[Any, tuple[Worker, Task]] = {}
        self.run_index = int(manifest.get("run_count") or 0)
        manifest["run_count"] = self.run_index + 1
        self.started_at, self.t0, self.wall_t0 = mf.now_iso(), time.monotonic(), time.time()
        self.pool = WorkerPool(spec, self.run_index, self.wall_t0, uuid.uuid4().hex[:8])
        self.book = mf.JobBook(storage, manifest, self.shards)
        mf.mark_run_start(manifest, self.started_at)  # for `jobrunner status` while this run goes
        self.run_tokens = 0
        # Output rows: n per input row (per-row overrides of n make this an estimate).
        self.progress = Progress(plan.num_rows * spec.sampling.n, self.book.committed_rows, enabled=show_progress)
        self.metrics = JobMetrics(spec.name, plan.num_rows * spec.sampling.n)  # Ray dashboard / Prometheus
        self.stats = {"commits": 0, "first_commit_s": None}
        self.isolation = IsolationCost()  # what isolating crashing rows cost this run (driver/isolation.py)
        self.publisher = ThreadPoolExecutor(PUBLISH_THREADS, thread_name_prefix="publish")
        self.publishing: dict[Future, tuple[str, dict]] = {}  # publish in flight -> shard id, its record
        self.next_show = 0.0

    # ---- top level ----------------------------------------------------------------------------------
    def run(self) -> JobResult:
        self.book.compact(drop_all_records=True)  # the run's starting manifest holds every record
        try:
            if len(self.queue):
                count = min(self.spec.cluster.num_workers, len(self.queue))
                self.progress.stage(describe_placing(self.spec, count))
                self.pool.start(count)
                self._loop()
        except BaseException:
            # LeaseLost (or any abort): queued publishes never start; one in flight meets the fence
            self.publisher.shutdown(wait=True, cancel_futures=True)
            self.progress.close()
            raise
        finally:
            self.publisher.shutdown(wait=True)
            self._stop_workers()
        self._collect_published()
        rows, tokens = self._progress_counts()
        self.progress.close(rows, tokens)
        return self._finish()

    def _loop(self) -> None:
        while (len(self.queue) or self.in_flight or self.publishing) and self.error is None:
            self._keep_lease()
            self.pool.top_up(min(self.spec.cluster.num_workers, len(self.queue) + len(self.in_flight)))
            self._assign()
            self._wait_and_handle()
            self._collect_published()
            self.pool.poll()
            for worker, why, engine_stalled in self.pool.stalled():
                self._worker_lost(worker, why, stalled=engine_stalled)
            self.error = self.error or self.pool.start_problem()
            self._show_progress()

    def _wait_and_handle(self) -> None:
        start_refs = self.pool.start_refs()
        waiting = list(self.in_flight) + list(start_refs)
        wait_s = 0.02 if self.publishing else 1.0
        if not waiting:
            due = self.queue.next_due_in()
            time.sleep(max(0.02, min(wait_s, due if due is not None else wait_s)))
            return
        done, rest = ray.wait(waiting, num_returns=1, timeout=wait_s)
        if done and rest:  # take everything else that is ready too: one pass per batch, not per result
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            done += more
        for ref in done:
            if ref in self.in_flight:
                self._on_task_done(ref)
            elif ref in start_refs:
                self._on_start_ref(ref, start_refs[ref])

    def _keep_lease(self) -> None:
        self.lease.check()  # the heartbeat thread renews; LeaseLost once it could not (io/lease.py)

    # ---- workers ------------------------------------------------------------------------------------
    def _on_start_ref(self, ref: Any, worker: Worker) -> None:
        if worker not in self.pool.workers:
            return
        try:
            info = ray.get(ref)
        except (RayActorError, RayTaskError) as exc:
            self.pool.on_start_failed(worker, _short(exc))
            return
        if ref == worker.ping_ref:
            self.pool.on_placed(worker)
            self.progress.stage(f"worker {worker.worker_id} placed; loading model {self.spec.model.source}")
            return
        self.pool.on_ready(worker)
        self.progress.stage(describe_ready(worker.worker_id, info))
        self.manifest["model"].update(info["model"])
        self.book.record_worker(worker.worker_id, info["stats"])

    def _worker_lost(self, worker: Worker, error: str, stalled: bool = False, crash: str | None = None) -> None:
        """Requeue a lost worker's tasks without charging them (see driver/tasks.py) and drop the worker."""
        log.warning("worker %s lost: %s", worker.worker_id, redact_text(error))
        ran_alone = len(worker.tasks) == 1
        self.pool.remove(worker, error)
        for ref, task in list(worker.tasks.items()):
            self.in_flight.pop(ref, None)
            if task.shard_id in self.failed:
                continue
            work = self.work[task.shard_id]
            if crash is None:
                task.infra_failures += 1
                work.infra_failures += 1
            if not ran_alone:
                task.alone = True
                self.queue.put(task)
                continue
            task.alone_crashes += 1
            self._count_restart(work)
            # An engine crash or a stall alone is surely the task's rows; a death may be the node's (unless the
            # rows are already suspects: a piece).
            limit = 1 if crash is not None or stalled or task.is_piece else ALONE_DEATHS_TO_BISECT
            if task.alone_crashes < limit:
                task.alone = True
                self.queue.put(task)
            else:
                self._isolate(task, crash or f"worker {worker.worker_id}: {error}")
        worker.tasks.clear()

    def _count_restart(self, work: ShardWork) -> None:
        """A worker died (or hung) running a shard's rows alone: one more model load spent isolating them."""
        work.isolation.model_loads += 1
        self.isolation.model_loads += 1
        if work.isolating_since is None:
            work.isolating_since = time.monotonic()

    def _isolate(self, task: Task, reason: str) -> None:
        """A task that fails alone: split it, or (one row, or past the restart caps) make its rows error rows."""
        c, work = self.spec.cluster, self.work[task.shard_id]
        capped = (f"cluster.max_isolation_restarts_per_shard={c.max_isolation_restarts_per_shard}"
                  if work.isolation.model_loads >= c.max_isolation_restarts_per_shard else
                  f"cluster.max_isolation_restarts={c.max_isolation_restarts}"
                  if self.isolation.model_loads >= c.max_isolation_restarts else None)
        if task.num_rows <= 1 or capped:
            log.warning("shard %s rows %d-%d crash their worker: %s", task.shard_id, task.row_start, task.row_end,
                        redact_text(reason))
            task.error_text = (f"engine crashed on this row: {reason}" if task.num_rows <= 1 else
                               f"engine crashed on one of rows {task.row_start}-{task.row_end}, not isolated "
                               f"further ({capped} reached): {reason}")
            task.alone = False
            self.queue.put(task)
            return
        self.work[task.shard_id].num_pieces += 1
        for half in task.halves():
            self.queue.put(half)

    def _stop_workers(self) -> None:
        ready = [w for w in self.pool.workers if w.is_ready]
        refs = {w.actor.finish.remote(): w for w in ready}
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=30) if refs else ([], [])
        for ref in done:
            try:
                self.book.record_worker(refs[ref].worker_id, ray.get(ref))
            except (RayActorError, RayTaskError):
                pass
        for w in list(self.pool.workers):
            self.pool.remove(w, "job finished")

    # ---- tasks --------------------------------------------------------------------------------------
    def _fresh_task(self, row: int) -> Task:
        return Task(self.shards.id_of(row), *self.shards.rows_of(row))

    def _assign(self) -> None:
        for worker in self.pool.workers:
            while worker.is_ready and len(worker.tasks) < SHARDS_PER_WORKER and not _has_alone(worker):
                task = self.queue.take(worker_is_empty=not worker.tasks, owner=worker.worker_id)
                if task is None:
                    break
                if task.shard_id not in self.failed:  # a piece of a shard that failed meanwhile is dropped
                    self._start_task(worker, task)

    def _start_task(self, worker: Worker, task: Task) -> None:
        self.lease.check()  # a driver that lost the output starts no attempt (not even a temporary part)
        task.attempts += 1
        self.work.setdefault(task.shard_id, ShardWork()).attempts += 1
        piece = self.shards.shard(self.shards.index_of(task.shard_id), task.row_start, task.row_end)
        attempt_id = f"{task.shard_id}-r{task.row_start}-{uuid.uuid4().hex[:8]}"
        ref = worker.actor.run_shard.remote(piece, attempt_id, task.error_text)
        if not worker.tasks:
            worker.last_heard = time.monotonic()  # idle time is not silence
        worker.tasks[ref] = task
        self.in_flight[ref] = (worker, task)

    def _on_task_done(self, ref: Any) -> None:
        worker, task = self.in_flight[ref]
        try:
            result = ray.get(ref)
        except RayActorError as exc:
            self._worker_lost(worker, _short(exc))
            return
        except RayTaskError as exc:
            if isinstance(exc.cause, EngineFailed):
                self._worker_lost(worker, _short(exc), crash=exc.cause.reason)
            else:
                self._drop(ref, worker)
                self._charge(task, _short(exc))
            return
        self._drop(ref, worker)
        worker.last_heard = time.monotonic()
        worker.live.pop((task.shard_id, task.row_start), None)
        self.book.record_worker(worker.worker_id, result.worker_stats)
        if task.shard_id in self.failed:
            return
        work = self.work[task.shard_id]
        work.results.append(result)
        self._count_isolation(task, work, result)
        if work.is_done:
            self._commit(task.shard_id, work)

    def _count_isolation(self, task: Task, work: ShardWork, result: ShardResult) -> None:
        """Add a finished attempt's isolation cost (in-process rebuilds, rows made error rows) to its shard's
        and the run's; a shard's restart-isolation wall time ends with its last piece."""
        cost = IsolationCost()
        cost.add(result.isolation)
        cost.rows_isolated += task.num_rows if task.error_text else 0
        if work.is_done and work.isolating_since is not None:
            cost.seconds += time.monotonic() - work.isolating_since
        work.isolation.add(cost)
        self.isolation.add(cost)

    def _drop(self, ref: Any, worker: Worker) -> None:
        del self.in_flight[ref]
        worker.tasks.pop(ref, None)

    def _charge(self, task: Task, error: str) -> None:
        """A failure that is the task's own (not infrastructure, not an engine crash): an attempt."""
        task.failures += 1
        work = self.work[task.shard_id]
        work.failures += 1
        give_up = task.failures >= self.spec.cluster.max_shard_attempts
        self.book.fail(task.shard_id, error, work.attempts, failed=give_up)
        if give_up:
            self.failed[task.shard_id] = error
            log.error("shard %s failed after %d attempt(s): %s", task.shard_id, task.failures, redact_text(error))
            return
        task.alone = True
        self.queue.put(task, self.spec.cluster.retry_backoff_s * 2 ** (task.failures - 1))

    def _commit(self, shard_id: str, work: ShardWork) -> None:
        """Publish the shard's attempt parts (fenced: only attempts this driver assigned), in the background."""
        self.lease.check()  # LeaseLost if another run took the output over: never publish then
        results: list[ShardResult] = sorted(work.results, key=lambda r: r.row_start)
        entry, kinds = _shard_entry(results, work)
        record = self.book.record_for(shard_id, entry, kinds)
        self.chains[shard_id] = merge_pieces([r.prefix_chains for r in results if r.prefix_chains[1] is not None])
        self.publishing[self.publisher.submit(self._publish, shard_id, results, record)] = (shard_id, record)
        del self.work[shard_id]

    def _publish(self, shard_id: str, results: list[ShardResult], record: dict[str, Any]) -> int:
        """Move the attempts to their final keys, then write the commit record (a publisher thread)."""
        # each part's size goes into the record: a resume checks the parts against it before trusting them
        record["part_bytes"] = commit_parts(self.storage, [r.part for r in results], record["parts"])
        return write_commit_record(self.storage, shard_id, record, epoch=self.lease.generation)

    def _collect_published(self) -> None:
        for future in [f for f in self.publishing if f.done()]:
            shard_id, record = self.publishing.pop(future)
            try:
                record_bytes = future.result()
            except Exception as exc:  # noqa: BLE001 - storage failed after its retries: the shard fails
                self.failed[shard_id] = f"publishing failed: {exc}"
                self.chains.pop(shard_id, None)
                self.book.fail(shard_id, self.failed[shard_id], record["attempts"], failed=True)
                continue
            self._committed(shard_id, record, record_bytes)

    def _committed(self, shard_id: str, record: dict[str, Any], record_bytes: int) -> None:
        self.book.mark_committed(shard_id, record, record_bytes)
        add_chains(self.manifest, self.chains.pop(shard_id, (0, None)), self.spec.engine.block_size)
        self.run_tokens += record["num_output_tokens"]
        self.stats["commits"] += 1
        if self.stats["first_commit_s"] is None:
            self.stats["first_commit_s"] = time.monotonic() - self.t0

    # ---- progress, end ------------------------------------------------------------------------------
    def _show_progress(self) -> None:
        if time.monotonic() < self.next_show:
            return
        self.next_show = time.monotonic() + 0.2
        rows, tokens = self._progress_counts()
        self.progress.update(rows, tokens)
        self.metrics.update(rows, self.book.num_errors, tokens, len(self.pool.workers))

    def _progress_counts(self) -> tuple[int, int]:
        """Rows done (committed, being published, finished pieces, finished inside running shards) and output
        tokens of this run (the larger of what finished rows hold and what the engines report produced)."""
        live_rows, live_tokens = self.pool.live_rows_tokens()
        publishing = sum(int(record["rows"]) for _, record in self.publishing.values())
        pieces = sum(r.rows for work in self.work.values() for r in work.results)
        rows = self.book.committed_rows + publishing + pieces + live_rows
        return rows, max(self.run_tokens + live_tokens, self.pool.tokens_produced())

    def _finish(self) -> JobResult:
        self.lease.verify()  # LeaseLost (write nothing) if the output was taken over while workers stopped
        finished = not self.failed and not len(self.queue) and not self.in_flight and self.error is None
        never_started = self.queue.drain_fresh()
        if self.error is not None:
            self.shards.mark_not_run(never_started, f"not run: {self.error}")
        for task in self.queue.drain():
            if self.error is not None and task.shard_id not in self.failed:
                self.book.fail(task.shard_id, f"not run: {self.error}", task.attempts, failed=False)
        mf.finalize(self.manifest, self.started_at, time.monotonic() - self.t0, finished)
        self.book.wait()  # a compaction in flight counts in this run's figures
        first = self.stats["first_commit_s"]
        self.manifest["runs"][-1].update(
            shards_committed=self.stats["commits"], first_commit_s=None if first is None else round(first, 3),
            commit_records=self.book.num_records, compactions=self.book.num_compactions + 1,
            bookkeeping_bytes=self.book.bytes_written,  # before this last compaction
            isolation=self.isolation.to_dict())
        record_summary(self.manifest, self.shards.totals())  # prefix-cache hits achieved vs the ideal
        self.book.compact()
        result = JobResult(output_url=self.spec.output.url, manifest=self.manifest, failed=dict(self.failed),
                           error=self.error, max_error_rate=self.spec.output.max_error_rate,
                           top_errors=self.book.top_error_kinds())
        if finished:  # the OpenAI result files whatever the error budget: they say which requests failed
            finish_job_files(self.spec, self.storage, self.shards.committed_parts())
        if finished and not result.over_error_budget:
            self.storage.delete_many(mf.orphan_parts(self.shards, list_parts(self.storage)))  # stray parts
            mark_success(self.storage)
        self.storage.delete(TEMP_DIR, recursive=True)
        return result


def _shard_entry(results: list[ShardResult], work: ShardWork) -> tuple[dict[str, Any], dict[str, int]]:
    """A committed shard's manifest entry from its pieces' results, and its error kinds."""
    shard_id = results[0].shard_id
    single = len(results) == 1
    parts = [part_key(shard_id) if single else part_key(shard_id, r.row_start) for r in results]
    kinds: dict[str, int] = {}
    for r in results:
        for kind, n in r.error_kinds.items():
            kinds[kind] = kinds.get(kind, 0) + n
    entry: dict[str, Any] = {key: sum(getattr(r, key) for r in results) for key in
                             ("rows", "num_errors", "num_prompt_tokens", "num_cached_tokens", "num_output_tokens")}
    entry.update(worker_id=results[-1].worker_id, attempts=work.attempts, failures=work.failures,
                 infra_failures=work.infra_failures, seconds=round(sum(r.seconds for r in results), 3),
                 part=parts[0], parts=parts)
    if not work.isolation.is_empty:
        entry["isolation"] = work.isolation.to_dict()
    return entry, kinds


def _has_alone(worker: Worker) -> bool:
    return any(t.alone for t in worker.tasks.values())


def _short(exc: BaseException) -> str:
    """The useful last line of a Ray error."""
    cause = getattr(exc, "cause", None)
    if cause is not None and not isinstance(cause, RayTaskError):
        return f"{type(cause).__name__}: {cause}"
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1][:500] if lines else type(exc).__name__
