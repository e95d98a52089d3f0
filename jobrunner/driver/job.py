"""The job loop: hand out shards to the worker pool, publish finished ones, retry failures, keep books.

The driver is the only owner of shard state and the only party that publishes a part: a worker writes an
attempt to `_temporary/<attempt>/`, and the driver moves the attempt it assigned to `parts/` (fenced commits:
a zombie attempt finishing late is never published). Each ready worker holds at most two tasks (the one
decoding and the next, whose rows join the engine before the first drains). Blame for failures and
bisection of crashing shards are described in driver/tasks.py (applied in driver/losses.py); the pool's
deadlines in driver/pool.py.
Every event costs O(1) in the number of shards: tasks wait in a heap-backed queue, counts are running
totals, and a commit writes one small record (driver/manifest.py). Shard state lives in one compact table
(driver/shards.py: columns, ~120 bytes a shard) until a shard is handed out; from then until it is
committed or failed, in its one `ShardRun` (driver/shard_run.py: states queued, running, publishing),
keyed by its table row. The pool alone changes workers, the book alone changes the manifest. Every round
checks that the job can go on (driver/watchdog.py): a round where nothing is in flight, starting or due
while shards remain, an empty pool that may not be refilled, or no event for `cluster.job_stall_timeout_s`
ends the job with an error naming the shards' states; it never idles.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from jobrunner.driver import manifest as mf
from jobrunner.driver.dedupe import mark_duplicate_outputs, publish_duplicates
from jobrunner.driver.isolation import IsolationCost
from jobrunner.driver.losses import LossRules
from jobrunner.driver.metrics import JobMetrics
from jobrunner.driver.output import open_output, read_previous_output
from jobrunner.driver.output_files import finish_job_files
from jobrunner.driver.plan import JobPlan, plan_job, with_absolute_output
from jobrunner.driver.pool import Worker, WorkerPool
from jobrunner.driver.prefix_dealing import fresh_tasks
from jobrunner.driver.prefix_rows import merge_pieces
from jobrunner.driver.prefix_stats import publish_prefix_plan
from jobrunner.driver.progress import Progress
from jobrunner.driver.progress_counts import CommittedCounts, Snapshot, entry_progress, result_progress, snapshot
from jobrunner.driver.progress_text import (
    describe_loading,
    describe_placing,
    describe_ray_start,
    describe_ready,
)
from jobrunner.driver.ray_holder import note_ray_driver
from jobrunner.driver.result import JobResult
from jobrunner.driver.session import ray_session
from jobrunner.driver.shard_run import ShardRun, ShardRuns, ShardState
from jobrunner.driver.shards import ShardTable
from jobrunner.driver.stage_feed import StageHooks
from jobrunner.driver.tasks import Task, TaskQueue, retry_delay
from jobrunner.driver.watchdog import Watchdog, idle_problem
from jobrunner.driver.worker import EngineFailed, ShardResult
from jobrunner.engine.contract import EngineStopped
from jobrunner.io.commits import write_commit_record
from jobrunner.io.layout import TEMP_DIR, part_key
from jobrunner.io.lease import Lease, LeaseLost
from jobrunner.io.manifest import mark_success
from jobrunner.io.parts import commit_parts, list_parts
from jobrunner.io.storage import Storage
from jobrunner.progress_view import Counts, counts_of, job_n, token_kind
from jobrunner.redaction import redact_text, redacting_logger, remember_secrets
from jobrunner.spec import JobSpec

log = redacting_logger(__name__)
SHARDS_PER_WORKER = 2
PUBLISH_THREADS = 8  # publishes (server-side copies + records) in flight at once: object stores are slow


def run_job(spec: JobSpec, address: str | None = None, show_progress: bool = True,
            started_s: float | None = None, stage: StageHooks | None = None) -> JobResult:
    """Run a job to the end (validating input and output before any worker starts). `started_s`: when the
    command started (time.monotonic; default now), for the elapsed time the progress and the summary give.
    `stage`: a pipeline stage's hooks (driver/pipeline.py holds the Ray session; a later stage's shards come
    from its feed, driver/stage_feed.py)."""
    remember_secrets(spec.secret_values())  # cut by value from all the driver writes (load_spec did it for the CLI)
    spec = with_absolute_output(spec)
    planning = time.monotonic()
    started_s = planning if started_s is None else started_s
    previous = read_previous_output(spec)  # the old manifest, read once: planning and opening both use it
    feed = None if stage is None else stage.feed
    plan = plan_job(spec, previous.header) if feed is None else feed.plan()
    storage, manifest, lease = open_output(spec, plan, previous)
    try:
        publish_prefix_plan(storage, manifest, plan.prefix)  # the grouped shards' row order, before any worker
        publish_duplicates(spec, plan.files, storage, manifest)  # output.dedupe prompts, before any worker
        loop = _JobLoop(spec, plan, storage, manifest, lease, show_progress, started_s, stage)
        loop.startup["plan_s"] = round(time.monotonic() - planning, 3)
        if stage is not None:  # the pipeline holds the Ray session
            return loop.run()
        if not len(loop.queue):  # everything already committed: no need for Ray
            return loop.run()
        loop.progress.stage(describe_ray_start(spec, address))
        ray_start = time.monotonic()
        with ray_session(spec, address) as joined:
            loop.startup["ray_start_s"] = round(time.monotonic() - ray_start, 3)
            note_ray_driver(lease, local=not joined)  # a rerun can then ask the cluster whether this job ended
            return loop.run()
    finally:
        lease.release()


class _JobLoop:
    def __init__(self, spec: JobSpec, plan: JobPlan, storage: Storage, manifest: dict[str, Any], lease: Lease,
                 show_progress: bool, started_s: float, stage: StageHooks | None = None) -> None:
        self.spec, self.storage, self.lease, self.started_s = spec, storage, lease, started_s
        self.stage, self.feed = stage, None if stage is None else stage.feed
        self.shards: ShardTable = plan.shards
        self.runs = ShardRuns(self.shards)  # the shards handed out, until committed or failed
        self.queue = TaskQueue(fresh=fresh_tasks(self.shards.todo(), self.runs.hand_out, spec.cluster.num_workers,
                                                 plan.prefix is not None and plan.prefix.shares_prefixes))
        self.error: str | None = None
        self.stopping: str | None = None  # an engine stopped by a limit the user set: no new shard, then the end
        self.book = mf.JobBook(storage, manifest, self.shards)
        self.started_at, self.t0, self.wall_t0 = mf.now_iso(), time.monotonic(), time.time()
        self.run_index = self.book.begin_run(self.started_at)  # for `jobrunner status` while this run goes
        self.pool = WorkerPool(spec, self.run_index, self.wall_t0, uuid.uuid4().hex[:8])
        self.finish_reasons: Counter = Counter()  # this run's committed rows by finish reason
        self.json_invalid = 0  # this run's committed rows whose text is not schema-valid JSON
        # prompts (the shards' input rows, earlier runs' committed ones too) and samples: n per prompt
        self.counted = CommittedCounts(self.shards)
        self.n, self.kind = job_n(spec.task, spec.sampling.n), token_kind(spec.task)
        self.incremental = None if plan.incremental is None else plan.incremental.describe()
        counts = self._committed_counts()
        self.progress = Progress(counts, enabled=show_progress, started_s=started_s, kind=self.kind)
        if stage is not None:  # the pipeline's console view reads the stage's counts (driver/pipeline_view.py)
            stage.progress = self.progress
        self.metrics = JobMetrics(spec.name, counts.samples_total)  # Ray dashboard / Prometheus
        self.stats = {"commits": 0, "first_commit_s": None}
        self.isolation = IsolationCost()  # what isolating crashing rows cost this run (driver/isolation.py)
        self.losses = LossRules(spec, self.runs, self.queue, self.isolation, self._fail)
        self.publisher = ThreadPoolExecutor(PUBLISH_THREADS, thread_name_prefix="publish")
        self.watch = Watchdog(spec.cluster.job_stall_timeout_s)
        self.next_show = 0.0
        self.startup: dict[str, Any] = {}  # plan_s, ray_start_s (run_job) and the workers' (pool.startup)
        if self.feed is not None:
            self.feed.attach(storage, self.shards)

    # ---- top level ----------------------------------------------------------------------------------
    def run(self) -> JobResult:
        self.book.compact(drop_all_records=True)  # the run's starting manifest holds every record
        try:
            if len(self.queue) or self.feed is not None:
                self._start_workers()
                self._loop()
        except BaseException as exc:
            # LeaseLost (or any abort): queued publishes never start; one in flight meets the fence
            self.publisher.shutdown(wait=True, cancel_futures=True)
            self.progress.close(self._committed_counts(), stopped="interrupted" if isinstance(
                exc, KeyboardInterrupt) else type(exc).__name__)
            raise
        finally:
            self.publisher.shutdown(wait=True)
            for worker_id, stats in self.pool.stop_all().items():
                self.book.record_worker(worker_id, stats)
            if sys.exc_info()[1] is not None:  # the run ends early: what it paid for is still recorded
                self._record_stopped_run(sys.exc_info()[1])
        self._collect_published()
        final = self._snapshot()
        self.progress.close(final.counts, final.tokens)
        return self._finish()

    def _start_workers(self) -> None:
        count = min(self.spec.cluster.num_workers, len(self.queue))
        if not count:  # a pipeline stage whose feed has nothing yet: workers start with its first shards
            return
        self.progress.stage(describe_placing(self.spec, count))
        self._note_live("starting workers", Snapshot(self._committed_counts(), 0))
        self.pool.start(count)
        self.watch.event("the workers were started")

    def _loop(self) -> None:
        while (len(self.queue) or len(self.runs) or self.pool.busy or self._feed_open()) and self.error is None:
            self.lease.check()  # the heartbeat thread renews; LeaseLost once it could not (io/lease.py)
            self._take_fed()
            self.pool.top_up(min(self.spec.cluster.num_workers, len(self.queue) + len(self.pool.task_refs())))
            self._assign()
            if self.stopping and not self.pool.task_refs():  # the shards still running have ended
                self.error = self.stopping
                break
            self.error = self._why_stuck()
            if self.error is not None:
                log.error("%s", redact_text(self.error))
                break
            self._wait_and_handle()
            self._collect_published()
            if self.pool.poll():
                self.watch.event("a worker reported progress")
            for worker, why, engine_stalled in self.pool.stalled():
                self._worker_lost(worker, why, stalled=engine_stalled)
            for worker, end in self.pool.lost():  # a tensor-parallel worker's rank: the whole group goes
                self._worker_lost(worker, end.error, crash=end.crash)
            self._show_progress()

    def _feed_open(self) -> bool:
        return self.feed is not None and self.feed.is_open

    def _take_fed(self) -> None:
        """A pipeline stage: the shards its feed found (committed upstream since the last poll) join the table
        and the queue; the manifest is written first, so that no commit record names a shard it lacks. Every
        round: a stopped pipeline (Ctrl-C in its main thread) stops the stage as Ctrl-C stops a job."""
        if self.stage is not None and self.stage.stop.is_set():
            raise KeyboardInterrupt(f"the pipeline stopped stage {self.spec.name}")
        if self.feed is None:
            return
        fed = self.feed.poll()
        if not fed:
            if self.feed.is_open:
                self.watch.event("waiting for the previous stage's shards")
            return
        rows = self.shards.extend([f.shard_id for f in fed], [f.file_url for f in fed], [f.num_rows for f in fed])
        self.book.compact()
        for row in rows:
            self.queue.put(self.runs.hand_out(row))
        self.counted.prompts_total += sum(f.num_rows for f in fed)
        self.watch.event(f"{len(fed)} shard(s) from the previous stage")
        if not self.pool.workers and not self.pool.num_started:
            self._start_workers()

    def _why_stuck(self) -> str | None:
        """Why the job cannot go on, checked every round (None while it can): no worker may ever start, an
        empty pool that may not be refilled, nothing that could happen, or no event for too long."""
        return (self.pool.start_problem() or (self.pool.refill_problem() if len(self.queue) else None)
                or idle_problem(self.pool, self.queue, self.runs)
                or self.watch.problem(self.pool, self.queue, self.runs))

    def _wait_and_handle(self) -> None:
        start_refs = self.pool.start_refs()
        task_refs = self.pool.task_refs()
        # poll replies wake the wait too: pool.poll() collects them right after, on every pass
        waiting = task_refs + list(start_refs) + self.pool.poll_refs()
        wait_s = 0.02 if self.runs.publishing() else 1.0
        if not waiting:  # only a publish or a backed-off task can be next (_why_stuck made sure)
            due = self.queue.next_due_in()
            time.sleep(max(0.02, min(wait_s, due if due is not None else wait_s)))
            return
        done, rest = ray.wait(waiting, num_returns=1, timeout=wait_s)
        if done and rest:  # take everything else that is ready too: one pass per batch, not per result
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            done += more
        tasks = set(task_refs)
        for ref in done:
            if ref in tasks:
                self._on_task_done(ref)
            elif ref in start_refs:
                self._on_start_ref(ref, start_refs[ref])

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
            self.watch.event(f"worker {worker.worker_id} placed")
            self.progress.stage(describe_loading(worker.worker_id, self.spec))
            return
        self.pool.on_ready(worker)
        self.watch.event(f"worker {worker.worker_id} ready")
        self.progress.stage(describe_ready(worker.worker_id, info))
        self.book.note_model(info["model"])
        self.book.record_worker(worker.worker_id, info["stats"])

    def _worker_lost(self, worker: Worker, error: str, stalled: bool = False, crash: str | None = None) -> None:
        """Requeue a lost worker's tasks, blamed or not (driver/losses.py), and drop it."""
        log.warning("worker %s lost: %s", worker.worker_id, redact_text(error))
        suspects = worker.suspects if stalled and crash is None else {}  # a hung call: the rows in its engine
        held = self.pool.remove(worker, error)
        self.book.note_lost(worker.worker_id, error)
        self.losses.on_loss(worker.worker_id, held, error, stalled, crash, suspects)

    # ---- tasks --------------------------------------------------------------------------------------
    def _assign(self) -> None:
        if self.stopping:
            return
        for worker in self.pool.workers:
            while worker.is_ready and len(worker.tasks) < SHARDS_PER_WORKER and not _has_alone(worker):
                task = self.queue.take(worker_is_empty=not worker.tasks, owner=worker.worker_id)
                if task is None:
                    break
                if task.run.state is not ShardState.FAILED:  # a piece of a shard failed meanwhile is dropped
                    self._start_task(worker, task)

    def _start_task(self, worker: Worker, task: Task) -> None:
        self.lease.check()  # a driver that lost the output starts no attempt (not even a temporary part)
        piece = self.shards.shard(task.run.row, task.row_start, task.row_end)
        attempt_id = f"{task.shard_id}-r{task.row_start}-{uuid.uuid4().hex[:8]}"
        ref = worker.actor.run_shard.remote(piece, attempt_id, task.error_text, task.one_at_a_time)
        self.pool.assign(worker, ref, task)
        self.runs.started(task, ref)

    def _on_task_done(self, ref: Any) -> None:
        worker = self.pool.owner(ref)
        if worker is None:  # its worker was removed this pass: the task was requeued then
            return
        task = worker.tasks[ref]
        self.watch.event(f"a result of shard {task.shard_id}")
        try:
            result = ray.get(ref)
        except RayActorError as exc:
            self._worker_lost(worker, self.pool.named_loss(worker, _short(exc)))  # a group's: rank 0 named
            return
        except RayTaskError as exc:
            if isinstance(exc.cause, EngineStopped):  # a limit the user set (cost.max_usd): the run ends here
                self._returned(ref)
                self.stopping = self.stopping or f"{exc.cause}; the run stops, resumable: run it again to go on"
                return
            if isinstance(exc.cause, EngineFailed):  # a tensor-parallel worker's lost rank is not the rows' crash
                end = self.pool.explain_failure(worker, _short(exc), exc.cause.reason)
                self._worker_lost(worker, end.error, crash=end.crash)
            else:
                self._returned(ref)
                self._charge(task, _short(exc))
            return
        self._returned(ref)
        self.book.record_worker(worker.worker_id, result.worker_stats)
        run = task.run
        if run.state is ShardState.FAILED:
            return
        run.results.append(result)
        self._count_isolation(task, run, result)
        if run.is_done:
            self._commit(run)

    def _returned(self, ref: Any) -> None:
        found = self.pool.task_done(ref)
        if found is not None:
            self.runs.returned(found[1], ref)

    def _count_isolation(self, task: Task, run: ShardRun, result: ShardResult) -> None:
        """Add a finished attempt's isolation cost (in-process rebuilds, rows made error rows) to its shard's
        and the run's; a shard's restart-isolation wall time ends with its last piece."""
        cost = IsolationCost()
        cost.add(result.isolation)
        cost.rows_isolated += task.num_rows if task.error_text else 0
        if run.is_done and run.isolating_since is not None:
            cost.seconds += time.monotonic() - run.isolating_since
        run.isolation.add(cost)
        self.isolation.add(cost)

    def _charge(self, task: Task, error: str) -> None:
        """A failure that is the task's own (not infrastructure, not an engine crash): an attempt."""
        run = task.run
        run.failures += 1
        if run.failures >= self.spec.cluster.max_shard_attempts:
            self._fail(run, error)
            return
        self.book.fail(run.row, error, run.attempts, failed=False)
        task.alone = True
        self.queue.put(task, retry_delay(self.spec.cluster.retry_backoff_s, run.failures))

    def _fail(self, run: ShardRun, error: str) -> None:
        """The shard fails for good: the table says so, its queued pieces go, pieces still out are dropped."""
        log.error("shard %s failed after %d attempt(s): %s", run.shard_id, run.attempts, redact_text(error))
        self.book.fail(run.row, error, run.attempts, failed=True)
        self.runs.failed(run, error)
        self.queue.discard(lambda t: t.run is run)

    def _commit(self, run: ShardRun) -> None:
        """Publish the shard's attempt parts (fenced: only attempts this driver assigned), in the background."""
        self.lease.check()  # LeaseLost if another run took the output over: never publish then
        results: list[ShardResult] = sorted(run.results, key=lambda r: r.row_start)
        entry, kinds = _shard_entry(results, run)
        record = self.book.record_for(run.row, entry, kinds)
        chains = merge_pieces([r.prefix_chains for r in results if r.prefix_chains[1] is not None])
        future = self.publisher.submit(self._publish, run.shard_id, results, record)
        self.runs.publishing_started(run, record, chains, future)

    def _publish(self, shard_id: str, results: list[ShardResult], record: dict[str, Any]) -> int:
        """Move the attempts to their final keys, then write the commit record (a publisher thread)."""
        # each part's size goes into the record: a resume checks the parts against it before trusting them
        record["part_bytes"] = commit_parts(self.storage, [r.part for r in results], record["parts"])
        return write_commit_record(self.storage, shard_id, record, epoch=self.lease.generation)

    def _collect_published(self) -> None:
        for run in self.runs.publishing():
            if not run.publish.done():
                continue
            try:
                record_bytes = run.publish.result()
            except Exception as exc:  # noqa: BLE001 - storage failed after its retries: the shard fails
                self._fail(run, f"publishing failed: {exc}")
                continue
            self._committed(run, record_bytes)

    def _committed(self, run: ShardRun, record_bytes: int) -> None:
        self.book.mark_committed(run.row, run.record, record_bytes)
        self.book.add_chains(run.chains, self.spec.engine.block_size, run.record)
        self.runs.committed(run)
        self.watch.event(f"shard {run.shard_id} committed")
        self.counted.add(run.record)
        for result in run.results:
            self.finish_reasons.update(result.finish_reasons)
            self.json_invalid += result.json_invalid
        self.stats["commits"] += 1
        if self.stats["first_commit_s"] is None:
            self.stats["first_commit_s"] = time.monotonic() - self.t0

    # ---- progress, end ------------------------------------------------------------------------------
    def _show_progress(self) -> None:
        if time.monotonic() < self.next_show:
            return
        self.next_show = time.monotonic() + 0.2
        snap = self._snapshot()
        self.progress.update(snap.counts, snap.tokens, snap.in_flight)
        self.metrics.update(snap.counts.samples_done, self.book.num_errors, snap.tokens if self.kind == "out" else 0,
                            len(self.pool.workers))
        self._note_live("running", snap)
        self.book.keep_run_record(self.pool)  # a run killed now still counts its workers' seconds

    def _note_live(self, phase: str, snap: Snapshot) -> None:
        """This run's progress for the lease's next heartbeat (`jobrunner status` reads it mid-run): the
        counts, tokens and ETA the live log shows (progress_view.py), and the rows / output tokens that
        older readers take."""
        eta = self.progress.eta_s()
        self.lease.live = {"phase": phase, "run_index": self.run_index, "counts": snap.counts.to_dict(),
                           "tokens_this_run": snap.tokens, "tokens_kind": self.kind,
                           "tokens_per_s": round(self.progress.tokens_per_s(), 1),
                           "eta_s": None if eta is None else round(eta, 1),
                           "rows_done": snap.counts.samples_done, "rows_total": snap.counts.samples_total,
                           "output_tokens_this_run": snap.tokens if self.kind == "out" else 0,
                           "workers": len(self.pool.workers), "at": mf.now_iso()}

    def _committed_counts(self) -> Counts:
        """Prompts / samples committed, with the publishes that finished (their commit records are written:
        `jobrunner status` counts them, and a rerun keeps them)."""
        published = [entry_progress(run.record) for run in self.runs.publishing()
                     if run.publish.done() and not run.publish.cancelled() and run.publish.exception() is None]
        return counts_of(self.counted.prompts + sum(p.prompts for p in published), self.counted.prompts_total,
                         self.counted.samples + sum(p.samples for p in published), self.n)

    def _snapshot(self) -> Snapshot:
        """Counts now: committed, being published, finished pieces and rows finished inside running shards;
        tokens of this run (output: the larger of what finished rows hold and what the engines sampled)."""
        finished = self.pool.live_progress()
        for run in self.runs.publishing():
            finished = finished.plus(entry_progress(run.record))
        for run in self.runs.open():
            for result in run.results if run.state is not ShardState.PUBLISHING else ():
                finished = finished.plus(result_progress(result))
        expected = float((self.spec.sampling.max_tokens or 0) * self.n)
        return snapshot(self.counted, finished, self.n, self.kind, self.pool.tokens_produced(), expected)

    def _record_stopped_run(self, stopped_by: BaseException) -> None:
        """A run ended by Ctrl-C or an error still writes its `runs` entry, its workers' seconds and its run
        record (a run that lost its lease writes nothing: the run that took over counts it as killed)."""
        if isinstance(stopped_by, LeaseLost):
            return
        try:
            for run in self.runs.publishing():  # published while the run stopped: this run's commits
                if run.publish.done() and not run.publish.cancelled() and run.publish.exception() is None:
                    self._committed(run, run.publish.result())
            self.book.finish_run(self.started_at, time.monotonic() - self.t0, False, {
                "shards_committed": self.stats["commits"], "startup": {**self.startup, "workers": self.pool.startup}},
                stopped_by=stopped_by)
            self.book.compact()
        except Exception as exc:  # noqa: BLE001 - the error that stopped the run is the one to raise
            log.warning("the manifest was not updated after the run stopped: %s", redact_text(str(exc)))
        self.book.write_run_record()

    def _finish(self) -> JobResult:
        self.lease.verify()  # LeaseLost (write nothing) if the output was taken over while workers stopped
        failed = self.book.failed_shards()
        finished = not failed and not len(self.queue) and not len(self.runs) and self.error is None
        finished = finished and (self.feed is None or self.feed.upstream_ok)  # a stage: its input is complete
        if finished:  # output.dedupe outputs: the duplicate samples over every committed part (driver/dedupe.py)
            mark_duplicate_outputs(self.spec, self.storage, self.shards.committed_parts(), self.book.manifest)
        never_started = self.queue.drain_fresh()
        if self.error is not None:  # left pending, with the reason, for a resume
            self.shards.mark_not_run(never_started, f"not run: {self.error}")
            for run in self.runs.open():
                self.book.fail(run.row, f"not run: {self.error}", run.attempts, failed=False)
        self.queue.drain()
        first = self.stats["first_commit_s"]
        self.book.keep_run_record(self.pool)  # its workers' seconds up to now (final stats replace them)
        self.book.finish_run(self.started_at, time.monotonic() - self.t0, finished, {
            "shards_committed": self.stats["commits"], "first_commit_s": None if first is None else round(first, 3),
            "isolation": self.isolation.to_dict(), "startup": {**self.startup, "workers": self.pool.startup},
            **({"stopped": self.stopping} if self.stopping else {}),  # cost.max_usd: why the run ended early
            **({} if self.incremental is None else
                                                       {"incremental": self.incremental})})
        self.book.compact()
        self.book.write_run_record()
        result = JobResult(output_url=self.spec.output.url, manifest=self.book.manifest, failed=failed,
                           error=self.error, max_error_rate=self.spec.output.max_error_rate,
                           top_errors=self.book.top_error_kinds(), finish_reasons=dict(self.finish_reasons),
                           json_invalid=self.json_invalid, max_tokens=self.spec.sampling.max_tokens,
                           started_s=self.started_s, counts=self._committed_counts(), token_kind=self.kind)
        if finished:  # the OpenAI result files whatever the error budget: they say which requests failed
            finish_job_files(self.spec, self.storage, self.shards.committed_parts())
        if finished and not result.over_error_budget:
            self.storage.delete_many(mf.orphan_parts(self.shards, list_parts(self.storage)))  # stray parts
            mark_success(self.storage)
        self.storage.delete(TEMP_DIR, recursive=True)
        return result


def _shard_entry(results: list[ShardResult], run: ShardRun) -> tuple[dict[str, Any], dict[str, int]]:
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
    entry["num_samples"] = sum(r.samples or r.rows for r in results)  # an error row counts as its n
    entry.update(worker_id=results[-1].worker_id, attempts=run.attempts, failures=run.failures,
                 infra_failures=run.infra_failures, seconds=round(sum(r.seconds for r in results), 3),
                 part=parts[0], parts=parts)
    if not run.isolation.is_empty:
        entry["isolation"] = run.isolation.to_dict()
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
