"""The worker's engine loop: shards in, committed parts out, with no drain bubble between shards.

One engine per worker, driven by one background thread (the only thread that calls the engine). Callers
(`run_shard`, one Ray actor thread per shard) read the shard's rows, queue them, and wait. The loop keeps
about 2 x max_num_seqs requests in the engine, taking rows from the oldest queued shard first, so the next
shard's rows join while the previous shard's last requests are still decoding. When a shard's last request
finishes, its caller builds and commits the Parquet part (off the engine thread) and returns a summary.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from jobrunner.driver.output_files import rows_table
from jobrunner.driver.rows import (
    RowRequest,
    error_row,
    output_row,
    prompt_tokens_once,
    read_shard_input,
    request_columns,
    to_request,
)
from jobrunner.driver.shards import Shard
from jobrunner.io.parts import write_part
from jobrunner.io.reader import ROW_INDEX, table_to_rows
from jobrunner.io.storage import Storage
from jobrunner.spec import JobSpec


class EngineFailed(RuntimeError):
    """The engine raised inside step(); this worker must be replaced."""


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
    part: str
    rows: int
    num_errors: int
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    seconds: float
    worker_stats: dict[str, Any]


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
        self._output = Storage(spec.output.url, spec.output.storage_options)
        threading.Thread(target=self._loop, name=f"engine-{worker_id}", daemon=True).start()

    # ---- caller side ---------------------------------------------------------------------------------
    def run_shard(self, shard: Shard) -> ShardResult:
        """Read, generate and commit one shard; blocks until its part is committed."""
        started = time.monotonic()
        table, keep = read_shard_input(self.spec, shard.file_url, shard.row_start, shard.row_end)
        # Only the columns a request is built from become Python rows; kept columns stay in Arrow.
        rows = table_to_rows(table.select(self._request_columns() + [ROW_INDEX]))
        requests = [to_request(self.spec, shard.file_stem, r) for r in rows]
        state = _ShardState(shard=shard, to_add=deque(r for r in requests if r.error is None))
        state.rows = [error_row(r) for r in requests if r.error is not None]
        self._enqueue(state)
        state.done.wait()
        if state.error is not None:
            raise state.error
        kept = table.select(keep + [ROW_INDEX]) if keep else None
        part = write_part(self._output, shard.shard_id, rows_table(self.spec, self._finish_rows(state), kept))
        return self._result(state, part, time.monotonic() - started)

    def _request_columns(self) -> list[str]:
        return request_columns(self.spec)  # the OpenAI batch columns for input.format openai_batch

    def _enqueue(self, state: _ShardState) -> None:
        with self._cond:
            if self._broken is not None:
                raise EngineFailed(f"worker {self.worker_id}: engine failed earlier: {self._broken}")
            if state.is_complete:
                state.done.set()
                return
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
            seconds=seconds, worker_stats=self.stats())

    def progress(self) -> dict[str, tuple[int, int]]:
        """shard_id -> (rows finished, output tokens) for shards not yet returned."""
        with self._cond:
            states = [s for s, _ in self._by_request.values()] + list(self._queue)
            return {s.shard.shard_id: (len(s.rows), s.num_output_tokens) for s in states}

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
            for state in states.values():
                state.error = EngineFailed(f"worker {self.worker_id}: engine step failed: {exc!r}")
                state.done.set()
            self._queue.clear()
            self._by_request.clear()
