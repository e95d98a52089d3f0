"""The worker's engine loop: shards in, committed parts out, with no drain bubble between shards.

One engine per worker, driven by one background thread (the only thread that calls the engine, and never
while holding the lock that `progress` and `stats` take). Callers (`run_shard`, one Ray actor thread per
shard) read the shard's rows, queue them, and wait. The loop keeps about 2 x max_num_seqs requests in the
engine, taking rows from the oldest queued shard first, so the next shard's rows join while the previous
shard's last requests are still decoding. When a shard's last request finishes, its caller writes the Parquet
part to an attempt-scoped temporary key (off the engine thread) and returns a summary; only the driver
publishes it (fenced commits: a zombie attempt can never publish a part).

Deadlines: reading the input and writing the part have `cluster.io_timeout_s` (driver/deadlines.py). The
engine must make progress (a token computed or a row finished) within `cluster.progress_timeout_s`: steps
that return without progress are treated like an engine exception, and either one is isolated in-process
(driver/isolation.py); an engine call that does not return at all shows in `progress()` and the driver
replaces the worker. Every deadline error names the shard and what it was doing.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from jobrunner.driver.deadlines import call_with_deadline
from jobrunner.driver.dedupe import DuplicateRows
from jobrunner.driver.engine_factory import rebuild_engine
from jobrunner.driver.isolation import IsolationCost, Isolator, Suspect
from jobrunner.driver.part_build import part_table, unbuildable_row
from jobrunner.driver.pooled import job_pooling
from jobrunner.driver.prefix_rows import PrefixChains, admission_order, read_shard_rows
from jobrunner.driver.progress_counts import ShardProgress
from jobrunner.driver.reasoning import choose_parser
from jobrunner.driver.row_images import bytes_image_column, image_context, image_prints
from jobrunner.driver.rows import (
    RowRequest,
    error_row,
    id_column,
    job_sampling,
    output_row,
    prompt_tokens_once,
    request_columns,
    row_fingerprints,
    to_request,
)
from jobrunner.driver.shards import Shard
from jobrunner.driver.suspects import SUSPECTS_AFTER_S, in_flight
from jobrunner.driver.tool_calls import choose_tool_parser
from jobrunner.engine.contract import EngineStopped
from jobrunner.io.decode import row_id_or_none, rows_or_errors
from jobrunner.io.image_parts import arrow_cells
from jobrunner.io.image_prints import ImagePrints
from jobrunner.io.images import FETCH_THREADS, ImageContext, ImageFetcher, image_error_kind
from jobrunner.io.parts import write_attempt_part
from jobrunner.io.reader import ROW_INDEX
from jobrunner.io.storage import Storage
from jobrunner.redaction import redact_text
from jobrunner.spec import JobSpec


class EngineFailed(RuntimeError):
    """The engine failed and could not be recovered in-process; this worker must be replaced. `reason` is the
    engine's exception."""

    def __init__(self, message: str, reason: str = "") -> None:
        # redacted: Ray logs a failed task's exception (driver and worker logs) before jobrunner sees it
        super().__init__(redact_text(message))
        self.reason = redact_text(reason or message)

    def __reduce__(self):  # keep `reason` across Ray's pickling
        return (EngineFailed, (str(self), self.reason))


MAX_ERROR_KINDS = 20  # distinct error kinds a shard reports (most frequent first)
PREFETCH_ROWS = 2 * FETCH_THREADS  # rows whose images are fetched ahead of the engine (io/images.py)
_GAUGES = ("kv_num_blocks", "kv_block_size", "kv_blocks_used", "prefix_cache_hit_rate")  # not summed over engines


@dataclass(eq=False)
class _ShardState:
    """A shard inside the worker: what it is doing, requests not yet added, requests in flight, finished rows."""

    shard: Shard
    to_add: deque[RowRequest] = field(default_factory=deque)
    in_flight: int = 0  # taken from to_add, not yet complete
    rows: list[dict[str, Any]] = field(default_factory=list)
    num_output_tokens: int = 0
    num_prompts: int = 0  # input rows done (progress_view.py: the unit of progress)
    num_samples: int = 0  # samples done: a row's n, also when it ended as one error row
    num_prompt_tokens: int = 0  # prompt tokens of the rows done (embed / score progress counts these)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    phase: str = "reading"
    cost: IsolationCost = field(default_factory=IsolationCost)
    chains: PrefixChains = field(default_factory=PrefixChains)  # its prompts' KV block chains
    fingerprints: dict[int, int] = field(default_factory=dict)  # row -> request fingerprint (output column)
    one_at_a_time: bool = False  # a hang's suspects: one row in the engine at a time (driver/suspects.py)
    positions: dict[int, int] | None = None  # row -> position in the shard (None: the same number)
    images: ImageContext | None = None  # how its rows' images are read (None: the job's rows carry none)
    prints: ImagePrints | None = None  # referenced images' digests for the fingerprints (io/image_prints.py)

    @property
    def is_complete(self) -> bool:
        return not self.to_add and self.in_flight == 0


@dataclass
class ShardResult:
    """What the driver records for a committed shard."""

    shard_id: str
    worker_id: str
    part: str  # the attempt's temporary key; the driver commits it
    rows: int
    num_errors: int
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    seconds: float
    worker_stats: dict[str, Any]
    attempt_id: str = ""
    row_start: int = 0
    row_end: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)  # error kind -> rows
    isolation: dict[str, Any] = field(default_factory=dict)  # IsolationCost.to_dict() of this attempt
    prefix_chains: tuple = (0, None)  # (cacheable KV blocks, distinct block chains): driver/prefix_rows.py
    finish_reasons: dict[str, int] = field(default_factory=dict)  # finish reason -> rows (samples)
    json_invalid: int = 0  # rows whose text is not valid JSON for their schema (json_valid false)
    samples: int = 0  # samples done: an error row counts as its n (0 from an older worker: its rows)


class ShardRunner:
    """Runs shards through one engine; thread-safe `run_shard`, `progress`, `stats`."""

    def __init__(self, engine: Any, spec: JobSpec, worker_id: str, job_start_s: float, info: dict) -> None:
        self.engine, self.spec, self.worker_id = engine, spec, worker_id
        # built once; each row's overrides are applied to it (an embed / score job: its prefill-only parameters)
        self.sampling = job_pooling(spec, engine.model_info) or job_sampling(spec)
        # the reasoning parser the job names (auto: the one the model's chat template implies), built once
        self.reasoning = choose_parser(spec.output.reasoning_parser, engine.tokenizer,
                                       spec.input.chat_template)
        self.tool_parser = choose_tool_parser(spec.output.tool_call_parser, engine.tokenizer,
                                              spec.input.chat_template)
        self.job_start_s = job_start_s  # wall-clock (time.time) start of the job, for finish_time_s
        self.info = info  # node, device
        self.loaded_at = time.monotonic()
        self.target_in_engine = 2 * spec.engine.max_num_seqs
        self.cost = IsolationCost()  # this worker's engine rebuilds (and model loads, for custom engines)
        self._cond = threading.Condition()
        self._active: dict[int, _ShardState] = {}  # every shard between run_shard's start and return
        self._queue: deque[_ShardState] = deque()  # shards with rows to add
        self._by_request: dict[str, Suspect] = {}  # request id -> (shard, row): what the engine holds
        self._samples: dict[str, list[dict[str, Any]]] = {}  # finished samples of requests not yet complete
        self._isolator = Isolator(spec.cluster.max_engine_rebuilds_per_shard, self.target_in_engine)
        self._broken: BaseException | None = None
        self._stopped = False
        self._call: tuple[str, float] | None = None  # the engine call running now (name, since)
        self._last_progress = time.monotonic()  # last token computed or row finished (or idle engine)
        self._stats_base: dict[str, Any] = {}  # stats of engines replaced by rebuilds
        self._stats = self._merged_stats()
        self._tokens = self._num_tokens()
        self._output = Storage(spec.output.url, spec.output.storage_options)
        self._duplicates = DuplicateRows(spec, self._output)  # output.dedupe prompts (driver/dedupe.py)
        self._images = ImageFetcher()  # rows' images, fetched on the engine thread's behalf just ahead of it
        threading.Thread(target=self._loop, name=f"engine-{worker_id}", daemon=True).start()

    # ---- caller side ---------------------------------------------------------------------------------
    def run_shard(self, shard: Shard, attempt_id: str = "a0", error_text: str | None = None,
                  one_at_a_time: bool = False) -> ShardResult:
        """Read and generate one shard (or a piece of one: its row range), write the rows to the attempt's
        temporary key and return the summary; blocks until then.

        error_text: the rows are known to crash the worker (isolated by the driver); they become error rows
        with this text and never reach the engine. one_at_a_time: the rows are suspects of a hang (the
        driver runs them alone): they enter the engine one by one, in position order (driver/suspects.py)."""
        state = _ShardState(shard=shard, one_at_a_time=one_at_a_time)
        with self._cond:
            self._active[id(state)] = state
        try:
            return self._run(state, attempt_id, error_text)
        finally:
            with self._cond:
                self._active.pop(id(state), None)

    def _run(self, state: _ShardState, attempt_id: str, error_text: str | None) -> ShardResult:
        started, shard, limit = time.monotonic(), state.shard, self.spec.cluster.io_timeout_s
        where = f"shard {shard.shard_id}: reading input rows {shard.row_start}-{shard.row_end} of " \
                f"{redact_text(shard.file_url)}"
        table, keep, state.positions = call_with_deadline(lambda: read_shard_rows(self.spec, shard, self._output),
                                                          limit, where)
        requests = self._requests(shard, table)
        state.prints = image_prints(self.spec)
        # None for a shard without an image row: its rows are added with no image bookkeeping at all
        state.images = image_context(self.spec, shard.file_url, state.prints) \
            if any(r.num_images for r in requests) else None
        for req in requests if error_text is not None else ():
            req.error = req.error or error_text
        state.to_add = deque(admission_order(self.spec, [r for r in requests if r.error is None])
                             if not state.one_at_a_time else sorted((r for r in requests if r.error is None),
                                                                    key=lambda r: _position(state, r)))
        for req in requests:
            if req.error is not None:
                self._count_done(state, [error_row(req)], req)
        state.phase = "generating"
        self._enqueue(state)
        state.done.wait()
        if state.error is not None:
            raise state.error
        state.phase = "writing"
        # after generating: the digests of the images fetched for the engine are known (io/image_prints.py)
        state.fingerprints = call_with_deadline(
            lambda: row_fingerprints(self.spec, table, shard.file_url, state.prints), limit,
            f"shard {shard.shard_id}: hashing its rows' requests")
        kept = table.select(keep + [ROW_INDEX]) if keep else None
        out = part_table(self.spec, self._finish_rows(state), kept, state.cost)
        part = call_with_deadline(
            lambda: write_attempt_part(self._output, attempt_id, shard.shard_id, shard.row_start, out), limit,
            f"shard {shard.shard_id}: writing part ({out.num_rows} rows)")
        result = self._result(state, part, time.monotonic() - started)
        result.attempt_id = attempt_id
        return result

    def _requests(self, shard: Shard, table: Any) -> list[RowRequest]:
        """Requests of the rows (only request columns become Python rows; kept columns stay in Arrow); a row
        whose bytes do not decode becomes an error request."""
        image_bytes = bytes_image_column(self.spec, table)  # its bytes stay in Arrow until fetched
        columns = [c for c in self._request_columns() if c != image_bytes]
        rows, undecodable = rows_or_errors(table.select(columns + [ROW_INDEX]))
        if image_bytes is not None:
            cells = dict(zip(table.column(ROW_INDEX).to_pylist(), arrow_cells(table, image_bytes), strict=True))
            for row in rows:
                row[image_bytes] = cells[row[ROW_INDEX]]
        requests = [to_request(self.spec, shard.file_stem, r, self.sampling) for r in rows]
        for row_index, error in undecodable.items():
            rid = row_id_or_none(table, id_column(self.spec), row_index) or f"{shard.file_stem}:{row_index}"
            requests.append(RowRequest(row_id=rid, row_index=row_index, error=error))
        return self._duplicates.mark(shard.file_url, requests)  # output.dedupe prompts: not generated

    def _request_columns(self) -> list[str]:
        return request_columns(self.spec)  # the OpenAI batch columns for input.format openai_batch

    def _enqueue(self, state: _ShardState) -> None:
        with self._cond:
            if isinstance(self._broken, EngineStopped):
                raise self._broken  # a limit the user set: the driver ends the run, resumable
            if self._broken is not None:
                raise EngineFailed(f"worker {self.worker_id}: engine failed earlier: {self._broken}")
            if state.is_complete:
                state.done.set()
                return
            if not self._queue and not self._by_request:
                self._last_progress = time.monotonic()  # an idle engine is not a stalled one
            self._queue.append(state)
            self._cond.notify()

    def _finish_rows(self, state: _ShardState) -> list[dict[str, Any]]:
        for row in state.rows:
            row["shard_id"], row["worker_id"] = state.shard.shard_id, self.worker_id
            row["request_fingerprint"] = state.fingerprints.get(row.get(ROW_INDEX))
            row.setdefault("finish_time_s", time.time() - self.job_start_s)
        return state.rows

    def _result(self, state: _ShardState, part: str, seconds: float) -> ShardResult:
        rows = state.rows

        def total(key: str) -> int:
            return sum(int(r.get(key) or 0) for r in rows)

        return ShardResult(
            shard_id=state.shard.shard_id, worker_id=self.worker_id, part=part, rows=len(rows),
            num_errors=sum(r["error"] is not None for r in rows),
            num_prompt_tokens=prompt_tokens_once(rows),
            num_cached_tokens=prompt_tokens_once(rows, "num_cached_tokens"),
            num_output_tokens=total("num_output_tokens"),
            seconds=seconds, worker_stats=self.stats(), row_start=state.shard.row_start,
            row_end=state.shard.row_end, error_kinds=error_kinds(rows),
            isolation={} if state.cost.is_empty else state.cost.to_dict(), prefix_chains=state.chains.summary(),
            finish_reasons=dict(Counter(str(r.get("finish_reason")) for r in rows)),
            json_invalid=sum(r.get("json_valid") is False for r in rows), samples=state.num_samples)

    def progress(self) -> dict[str, Any]:
        """{"shards": {(shard_id, row_start): ShardProgress (rows, tokens, prompts, samples)} for shards not
        yet returned,
        "stalled_s": seconds the current engine call has not returned (0 when none runs), "stall": what the
        worker was doing then, naming its shards, "engine_tokens": output tokens the engines sampled since
        this worker loaded, finished rows or not (None when the engine does not count them)}. Never waits for
        the engine: the driver's tokens/s counts tokens as they are produced."""
        with self._cond:
            shards = {(s.shard.shard_id, s.shard.row_start): ShardProgress(
                len(s.rows), s.num_output_tokens, s.num_prompts, s.num_samples, s.num_prompt_tokens)
                for s in self._active.values()}
            call = self._call
            stalled_s = time.monotonic() - call[1] if call is not None else 0.0
            stall = self._engine_doing(f"engine {call[0]} has not returned for {stalled_s:.0f} s") if call else ""
            tokens = self._stats.get("num_sampled_tokens")
            # a hung call: the rows in the engine are the suspects (driver/suspects.py)
            suspects = in_flight(self._by_request.values()) if stalled_s >= SUSPECTS_AFTER_S else {}
            return {"shards": shards, "stalled_s": stalled_s, "stall": stall, "suspects": suspects,
                    "engine_tokens": tokens if isinstance(tokens, int) else None}

    def _engine_doing(self, what: str) -> str:
        """"shard A, B: no token produced and no row finished for N s while decoding K rows (<what>)"."""
        shard_ids = sorted({state.shard.shard_id for state, _ in self._by_request.values()})
        idle_s = time.monotonic() - self._last_progress
        return (f"shard {', '.join(shard_ids) or '-'}: no token produced and no row finished for {idle_s:.0f} s "
                f"while decoding {len(self._by_request)} rows ({what})")

    def stats(self) -> dict[str, Any]:
        """Engine stats (summed over the engines this worker rebuilt) plus alive_s, node, device and the
        rebuild count; never waits for the engine."""
        with self._cond:
            engine_stats = dict(self._stats)
        return {**self.info, "alive_s": time.monotonic() - self.loaded_at, **engine_stats,
                "engine_rebuilds": self.cost.engine_rebuilds}

    def stop(self) -> None:
        """Stop the engine thread."""
        with self._cond:
            self._stopped = True
            self._cond.notify()

    # ---- engine thread ------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while self._iterate():
                pass
        except Exception as exc:  # noqa: BLE001 - an engine beyond repair fails the shards in it, never hangs them
            self._fail_all(exc)
            self._images.clear()
            return
        self._images.close()
        self.engine.close()  # stopped: nothing uses the engine after this thread

    def _iterate(self) -> bool:
        """Add rows, then one engine step (no lock held across engine calls); False once stopped."""
        adds = self._next_adds()
        if adds is None:
            return False
        for state, req in adds:
            self._add(state, req)
        try:
            outputs = self._engine_call("step", self.engine.step)
        except EngineStopped as exc:  # a limit the user set (cost.max_usd): its shards go back uncharged
            self._stop_all(exc)
            return False
        except Exception as exc:  # noqa: BLE001 - isolated in-process (driver/isolation.py)
            self._on_engine_failure(f"{type(exc).__name__}: {exc}")
            return True
        self._after_step(outputs)
        stall = self._stall()
        if stall is not None:
            self._on_engine_failure(stall)
        return True

    def _engine_call(self, name: str, fn: Any) -> Any:
        self._call = (name, time.monotonic())  # read by progress(): an engine call that never returns
        try:
            return fn()
        finally:
            self._call = None

    def _next_adds(self) -> list[Suspect] | None:
        """What to add to the engine now (a suspect group while isolating, else rows up to the target);
        waits while there is nothing to do; None once stopped."""
        with self._cond:
            while not (self._stopped or self._queue or self._by_request or self._isolator.is_active):
                self._cond.wait(timeout=1.0)
            if self._stopped:
                return None
            if self._isolator.is_active:
                if self._by_request:
                    return []  # the group alone in the engine is still running
                group = self._isolator.next_group()
                if group is not None:
                    for state, req in group:
                        self._by_request[_request_id(state, req)] = (state, req)
                    return group
            return self._fill()

    def _fill(self) -> list[Suspect]:
        """Rows (oldest shard first) until the engine holds target_in_engine requests."""
        adds = []
        while self._queue and len(self._by_request) < self.target_in_engine:
            state = self._queue[0]
            if not state.to_add:
                self._queue.popleft()
                continue
            if state.one_at_a_time and state.in_flight:
                break  # its next row waits for this one
            if not self._images_ready(state):
                break  # the next row's images are still being fetched: the engine steps on what it holds
            req = state.to_add.popleft()
            state.in_flight += 1
            self._by_request[_request_id(state, req)] = (state, req)
            adds.append((state, req))
        return adds

    def _images_ready(self, state: _ShardState) -> bool:
        """Start fetching the images of the shard's next PREFETCH_ROWS rows; whether the next row may enter the
        engine now (its images are there, or the engine holds nothing else to step on)."""
        if state.images is None:
            return True
        head = state.to_add[0]
        for req in islice(state.to_add, PREFETCH_ROWS):
            if req.num_images:
                self._images.prefetch(_request_id(state, req), req.prompt, req.row_id, state.images)
        return not self._by_request or self._images.is_ready(_request_id(state, head), head.prompt)

    def _add(self, state: _ShardState, req: RowRequest) -> None:
        request_id = _request_id(state, req)
        try:
            prompt = req.prompt if state.images is None or not req.num_images else \
                self._images.take(request_id, req.prompt, req.row_id, state.images)
        except Exception as exc:  # noqa: BLE001 - a bad image is its row's error (io/images.py names row and image)
            self._reject(state, request_id, req, str(exc) if isinstance(exc, ValueError) else
                         f"row {req.row_id}: images: {type(exc).__name__}: {exc}")
            return
        if prompt is not req.prompt:  # images arrived: progress (a slow fetch into an idle engine is no stall)
            with self._cond:
                self._last_progress = time.monotonic()
        try:
            self._engine_call("add_request", lambda: self.engine.add_request(
                request_id, prompt, req.params, chat_template_kwargs=req.chat_template_kwargs or None,
                adapter=req.adapter or None))
        except Exception as exc:  # noqa: BLE001 - one bad row never fails a shard
            self._reject(state, request_id, req, f"engine rejected the request: {exc}")

    def _reject(self, state: _ShardState, request_id: str, req: RowRequest, error: str) -> None:
        """A row that could not enter the engine becomes its error row."""
        with self._cond:
            if self._by_request.pop(request_id, None) is not None:
                req.error = error
                self._complete(state, [error_row(req)], req)

    def _after_step(self, outputs: list[Any]) -> None:
        """Take the finished samples; a token computed or a row finished is progress."""
        stats = self._merged_stats()
        with self._cond:
            self._stats = stats
            for out in outputs:
                self._finish(out)
            tokens = self._num_tokens()
            if outputs or tokens != self._tokens:
                self._last_progress, self._tokens = time.monotonic(), tokens
            if outputs:
                self._isolator.on_progress()

    def _stall(self) -> str | None:
        """Why the engine counts as failed although its steps return: no progress within the deadline."""
        limit = self.spec.cluster.progress_timeout_s
        with self._cond:
            if not self._by_request or time.monotonic() - self._last_progress <= limit:
                return None
            return self._engine_doing(f"engine steps return; cluster.progress_timeout_s={limit:g}")

    def _finish(self, out: Any) -> None:
        """One finished sample; the row's request is done when all its n samples are."""
        entry = self._by_request.get(out.request_id)
        if entry is None:
            return
        state, req = entry
        try:
            row = output_row(self.spec, req, out, self.reasoning, self.tool_parser)
        except Exception as exc:  # noqa: BLE001 - a sample that cannot become a row is that row's error
            sample = {"id": req.row_id, ROW_INDEX: req.row_index, "sample_index": getattr(out, "sample_index", 0)}
            row = unbuildable_row(sample, exc)
            state.cost.rows_isolated += 1
        row["finish_time_s"] = time.time() - self.job_start_s
        if not getattr(out, "sample_index", 0) and row.get("error") is None:
            state.chains.add(getattr(out, "prompt_token_ids", None), self.engine.block_size,
                             req.adapter)
        samples = self._samples.setdefault(out.request_id, [])
        samples.append(row)
        req.num_finished += 1
        if req.num_finished < (getattr(out, "num_samples", None) or req.params.n):
            return
        del self._by_request[out.request_id], self._samples[out.request_id]
        self._complete(state, samples, req)

    def _complete(self, state: _ShardState, rows: list[dict[str, Any]], req: RowRequest) -> None:
        """A row's request is complete (its output rows, or its error row)."""
        self._count_done(state, rows, req)
        state.in_flight -= 1
        if state.is_complete:
            if state in self._queue:
                self._queue.remove(state)
            state.done.set()

    def _count_done(self, state: _ShardState, rows: list[dict[str, Any]], req: RowRequest) -> None:
        """A done row's output rows into its shard, counted: one prompt, its n samples (an error row too)."""
        state.rows.extend(rows)
        state.num_output_tokens += sum(int(r.get("num_output_tokens") or 0) for r in rows)
        state.num_prompt_tokens += prompt_tokens_once(rows)
        state.num_prompts += 1
        asked = getattr(req.params, "n", None) or getattr(self.sampling, "n", None) or 1
        state.num_samples += max(len(rows), int(asked))

    # ---- in-process isolation -----------------------------------------------------------------------
    def _on_engine_failure(self, reason: str) -> None:
        """The engine raised (or stopped making progress) with the suspects in it: blame or regroup them
        (driver/isolation.py), then rebuild the engine from the weights this worker holds."""
        with self._cond:
            failed = list(self._by_request.values())
            self._by_request.clear()
            for state, req in failed:
                self._samples.pop(_request_id(state, req), None)  # its samples run again, all of them
                req.num_finished = 0
            for (state, req), text in self._isolator.on_failure(failed, reason) if failed else ():
                req.error = text
                self._complete(state, [error_row(req)], req)
            if self._isolator.is_broken:
                raise RuntimeError(f"the engine failed {self._isolator.failures_in_a_row} times in a row with "
                                   f"no row finishing in between; last: {reason}")
        self._rebuild()

    def _rebuild(self) -> None:
        stats = self._merged_stats()
        engine, loaded = self._engine_call("rebuild", lambda: rebuild_engine(self.engine, self.spec))
        with self._cond:
            self.engine, self._stats_base = engine, stats
            self.cost.engine_rebuilds += 1
            self.cost.model_loads += int(loaded)
            self._stats, self._tokens = self._merged_stats(), self._num_tokens()
            self._last_progress = time.monotonic()

    def _merged_stats(self) -> dict[str, Any]:
        """This engine's stats over those of the engines it replaced (counters summed, gauges current)."""
        current = dict(self.engine.stats().to_dict())
        for key, value in self._stats_base.items():
            if key in _GAUGES or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            now = current.get(key)
            if key == "kv_peak_blocks_used":
                current[key] = max(value, now or 0)
            elif isinstance(now, (int, float)):
                current[key] = now + value
        if self._stats_base and current.get("num_prompt_tokens"):
            current["prefix_cache_hit_rate"] = current.get("num_cached_tokens", 0) / current["num_prompt_tokens"]
        return current

    def _num_tokens(self) -> int:
        return int(self._stats.get("num_prefill_tokens") or 0) + int(self._stats.get("num_decode_tokens") or 0)

    def _stop_all(self, exc: EngineStopped) -> None:
        """The engine takes no more requests (a limit the user set): every shard still generating ends with
        `exc` (no part written), which the driver reads as the end of the run, resumable."""
        with self._cond:
            self._broken = exc
            for state in self._active.values():
                if state.phase == "generating" and not state.done.is_set():
                    state.error = exc
                    state.done.set()
            self._queue.clear()
            self._by_request.clear()

    def _fail_all(self, exc: BaseException) -> None:
        """The engine is beyond in-process repair: fail every shard that was generating; the driver replaces
        this worker."""
        with self._cond:
            self._broken = exc
            reason = f"{type(exc).__name__}: {exc}"
            for state in self._active.values():
                if state.phase == "generating" and not state.done.is_set():
                    state.error = EngineFailed(f"worker {self.worker_id}: engine failed: {reason}", reason)
                    state.done.set()
            self._queue.clear()
            self._by_request.clear()


def _position(state: _ShardState, req: RowRequest) -> int:
    return req.row_index if state.positions is None else state.positions.get(req.row_index, req.row_index)


def _request_id(state: _ShardState, req: RowRequest) -> str:
    return f"{state.shard.shard_id}/{req.row_index}"  # unique even if row ids repeat


def error_kind(error: str) -> str:
    """An error's kind for summaries: its text up to the first detail (row ids, numbers, quoted values); an
    HTTP status stays (`HTTP 401`: the kind a user acts on)."""
    head = image_error_kind(error) or error.split(" (row ", 1)[0]  # an image error: its row and image left out
    return re.sub(r"(?<!HTTP )(?<!\d)\d+", "N", head)[:160]


def error_kinds(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Error kind -> rows, the MAX_ERROR_KINDS most frequent; redacted (they go into commit records, the
    manifest and the run's summary)."""
    counts: dict[str, int] = {}
    for row in rows:
        if row.get("error") is not None:
            kind = error_kind(redact_text(str(row["error"])))
            counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:MAX_ERROR_KINDS])
