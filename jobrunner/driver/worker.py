"""The worker's engine loop: shards in, committed parts out, with no drain bubble between shards.

One engine per worker, driven by one background thread (the only thread that calls the engine). Callers
(`run_shard`, one Ray actor thread per shard) read the shard's rows, queue them, and wait. The loop keeps
about 2 x max_num_seqs requests in the engine, taking rows from the oldest queued shard first, so the next
shard's rows join while the previous shard's last requests are still decoding. When a shard's last request
finishes, its caller writes the Parquet part to an attempt-scoped temporary key (off the engine thread) and
returns a summary; only the driver publishes it (fenced commits: a zombie attempt can never publish a part).
"""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from jobrunner.driver.output_files import rows_table
from jobrunner.driver.rows import (
    RowRequest,
    error_row,
    id_column,
    output_row,
    prompt_tokens_once,
    read_shard_input,
    request_columns,
    to_request,
)
from jobrunner.driver.shards import Shard
from jobrunner.io.decode import row_id_or_none, rows_or_errors
from jobrunner.io.parts import write_attempt_part
from jobrunner.io.reader import ROW_INDEX
from jobrunner.io.storage import Storage
from jobrunner.redaction import redact_text
from jobrunner.spec import JobSpec


class EngineFailed(RuntimeError):
    """The engine raised inside step(); this worker must be replaced. `reason` is the engine's exception."""

    def __init__(self, message: str, reason: str = "") -> None:
        # redacted: Ray logs a failed task's exception (driver and worker logs) before jobrunner sees it
        super().__init__(redact_text(message))
        self.reason = redact_text(reason or message)

    def __reduce__(self):  # keep `reason` across Ray's pickling
        return (EngineFailed, (str(self), self.reason))


MAX_ERROR_KINDS = 20  # distinct error kinds a shard reports (most frequent first)


@dataclass(eq=False)
class _ShardState:
    """A shard inside the worker: requests not yet added, requests in flight, finished rows."""

    shard: Shard
    to_add: deque[RowRequest]
    in_flight: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)
    num_output_tokens: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

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


class ShardRunner:
    """Runs shards through one engine; thread-safe `run_shard`, `progress`, `stats`."""

    def __init__(self, engine: Any, spec: JobSpec, worker_id: str, job_start_s: float, info: dict) -> None:
        self.engine, self.spec, self.worker_id = engine, spec, worker_id
        self.job_start_s = job_start_s  # wall-clock (time.time) start of the job, for finish_time_s
        self.info = info  # node, device
        self.loaded_at = time.monotonic()
        self.target_in_engine = 2 * spec.engine.max_num_seqs
        self._cond = threading.Condition()
        self._queue: deque[_ShardState] = deque()
        self._by_request: dict[str, tuple[_ShardState, RowRequest]] = {}
        self._broken: BaseException | None = None
        self._stopped = False
        self._last_step = time.monotonic()  # last finished engine step (or work arriving at an idle engine)
        self._output = Storage(spec.output.url, spec.output.storage_options)
        threading.Thread(target=self._loop, name=f"engine-{worker_id}", daemon=True).start()

    # ---- caller side ---------------------------------------------------------------------------------
    def run_shard(self, shard: Shard, attempt_id: str = "a0", error_text: str | None = None) -> ShardResult:
        """Read and generate one shard (or a piece of one: its row range), write the rows to the attempt's
        temporary key and return the summary; blocks until then.

        error_text: the rows are known to crash the engine (isolated by bisection); they become error
        rows with this text and never reach the engine."""
        started = time.monotonic()
        table, keep = read_shard_input(self.spec, shard.file_url, shard.row_start, shard.row_end)
        requests = self._requests(shard, table)
        if error_text is not None:
            for req in requests:
                req.error = req.error or f"engine crashed on this row: {error_text}"
        state = _ShardState(shard=shard, to_add=deque(r for r in requests if r.error is None))
        state.rows = [error_row(r) for r in requests if r.error is not None]
        self._enqueue(state)
        state.done.wait()
        if state.error is not None:
            raise state.error
        kept = table.select(keep + [ROW_INDEX]) if keep else None
        out = rows_table(self.spec, self._finish_rows(state), kept)
        part = write_attempt_part(self._output, attempt_id, shard.shard_id, shard.row_start, out)
        result = self._result(state, part, time.monotonic() - started)
        result.attempt_id = attempt_id
        return result

    def _requests(self, shard: Shard, table: Any) -> list[RowRequest]:
        """Requests of the rows (only request columns become Python rows; kept columns stay in Arrow); a row
        whose bytes do not decode becomes an error request."""
        rows, undecodable = rows_or_errors(table.select(self._request_columns() + [ROW_INDEX]))
        requests = [to_request(self.spec, shard.file_stem, r) for r in rows]
        for row_index, error in undecodable.items():
            rid = row_id_or_none(table, id_column(self.spec), row_index) or f"{shard.file_stem}:{row_index}"
            requests.append(RowRequest(row_id=rid, row_index=row_index, error=error))
        return requests

    def _request_columns(self) -> list[str]:
        return request_columns(self.spec)  # the OpenAI batch columns for input.format openai_batch

    def _enqueue(self, state: _ShardState) -> None:
        with self._cond:
            if self._broken is not None:
                raise EngineFailed(f"worker {self.worker_id}: engine failed earlier: {self._broken}")
            if state.is_complete:
                state.done.set()
                return
            if not self._queue and not self._by_request:
                self._last_step = time.monotonic()  # an idle engine is not a stalled one
            self._queue.append(state)
            self._cond.notify()

    def _finish_rows(self, state: _ShardState) -> list[dict[str, Any]]:
        for row in state.rows:
            row["shard_id"], row["worker_id"] = state.shard.shard_id, self.worker_id
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
            row_end=state.shard.row_end, error_kinds=error_kinds(rows))

    def progress(self) -> dict[str, Any]:
        """{"shards": {(shard_id, row_start): (rows finished, output tokens)} for shards not yet returned,
        "stalled_s": seconds since the engine last finished a step while it had work (0 when idle)}."""
        with self._cond:
            states = {id(s): s for s, _ in self._by_request.values()}
            states.update({id(s): s for s in self._queue})
            busy = bool(states)
            return {"shards": {(s.shard.shard_id, s.shard.row_start): (len(s.rows), s.num_output_tokens)
                               for s in states.values()},
                    "stalled_s": time.monotonic() - self._last_step if busy else 0.0}

    def stats(self) -> dict[str, Any]:
        """Engine stats (engine.stats().to_dict()) plus alive_s, node and device."""
        with self._cond:
            engine_stats = dict(self.engine.stats().to_dict())
        return {**self.info, "alive_s": time.monotonic() - self.loaded_at, **engine_stats}

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
        except Exception as exc:  # noqa: BLE001 - an engine failure fails the shards in it, never hangs them
            self._fail_all(exc)

    def _iterate(self) -> bool:
        """One engine step (after topping up the engine); False once stopped."""
        with self._cond:
            while not self._stopped and not self._queue and not self.engine.has_unfinished_requests():
                self._cond.wait(timeout=1.0)
            if self._stopped:
                return False
            self._fill()
        outputs = self.engine.step()
        with self._cond:
            self._last_step = time.monotonic()
            for out in outputs:
                self._finish(out)
        return True

    def _fill(self) -> None:
        """Add rows (oldest shard first) until the engine holds target_in_engine requests."""
        while self._queue and self.engine.num_unfinished_requests < self.target_in_engine:
            state = self._queue[0]
            if not state.to_add:
                self._queue.popleft()
                continue
            self._add(state, state.to_add.popleft())

    def _add(self, state: _ShardState, req: RowRequest) -> None:
        request_id = f"{state.shard.shard_id}/{req.row_index}"  # unique even if row ids repeat
        try:
            kwargs = {"chat_template_kwargs": req.chat_template_kwargs} if req.chat_template_kwargs else {}
            self.engine.add_request(request_id, req.prompt, req.params, **kwargs)
        except Exception as exc:  # noqa: BLE001 - one bad row never fails a shard
            req.error = f"engine rejected the request: {exc}"
            state.rows.append(error_row(req))
            self._maybe_done(state)
            return
        state.in_flight += 1
        self._by_request[request_id] = (state, req)

    def _finish(self, out: Any) -> None:
        """One finished sample; the row's request is done when all its n samples are."""
        entry = self._by_request.get(out.request_id)
        if entry is None:
            return
        state, req = entry
        row = output_row(self.spec, req, out)
        row["finish_time_s"] = time.time() - self.job_start_s
        state.rows.append(row)
        state.num_output_tokens += row["num_output_tokens"]
        req.num_finished += 1
        if req.num_finished < (getattr(out, "num_samples", None) or req.params.n):
            return
        del self._by_request[out.request_id]
        state.in_flight -= 1
        self._maybe_done(state)

    def _maybe_done(self, state: _ShardState) -> None:
        if state.is_complete:
            if state in self._queue:
                self._queue.remove(state)
            state.done.set()

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            self._broken = exc
            states = {id(s): s for s, _ in self._by_request.values()}
            states.update({id(s): s for s in self._queue})
            reason = f"{type(exc).__name__}: {exc}"
            for state in states.values():
                state.error = EngineFailed(f"worker {self.worker_id}: engine step failed: {reason}", reason)
                state.done.set()
            self._queue.clear()
            self._by_request.clear()


def error_kind(error: str) -> str:
    """An error's kind for summaries: its text up to the first detail (row ids, numbers, quoted values)."""
    head = error.split(" (row ", 1)[0]
    return re.sub(r"\d+", "N", head)[:120]


def error_kinds(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Error kind -> rows, the MAX_ERROR_KINDS most frequent; redacted (they go into commit records, the
    manifest and the run's summary)."""
    counts: dict[str, int] = {}
    for row in rows:
        if row.get("error") is not None:
            kind = error_kind(redact_text(str(row["error"])))
            counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:MAX_ERROR_KINDS])
