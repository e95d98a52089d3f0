"""One run's record of what it paid for (io/run_records.py): kept by the driver while the run goes, so that a
run stopped by Ctrl-C, `kill -9`, a lost machine or a takeover still counts its workers' seconds.

A worker's stats (startup_s, alive_s) arrive when it is ready, with each shard it returns and when it is
stopped; between those, the ledger counts a running worker's life on from the moment its last stats arrived
(its reported alive_s plus the seconds since), and a worker still loading by its seconds since it was asked
for. The record is written at most every RECORD_EVERY_S while the run goes (one small object) and once at the
end; a killed run loses at most that many seconds per worker. Running records are written on a thread of their
own (the loop never waits on storage for them); the final one waits for any still in flight, so it is the last
word.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

from jobrunner.io.run_records import RUNNING, lost_worker_seconds, worker_seconds_of, write_run_record
from jobrunner.io.storage import Storage
from jobrunner.redaction import redacting_logger

log = redacting_logger(__name__)
RECORD_EVERY_S = 1.0


class RunLedger:
    """The figures of one run, written as its run record."""

    def __init__(self, storage: Storage, run_index: int, started_at: str, rows_at_start: int) -> None:
        self.storage, self.run_index, self.started_at = storage, run_index, started_at
        self.t0 = time.monotonic()
        self.rows_at_start = rows_at_start
        self.seen: dict[str, float] = {}  # worker id -> when its last stats arrived (monotonic)
        self.estimates: dict[str, dict[str, float]] = {}  # worker id -> its seconds as last counted on
        self.sampled_tokens = 0  # output tokens this run's engines sampled (the pool's count, never down)
        self.next_write = 0.0
        self.failed = False
        self._writer: ThreadPoolExecutor | None = None
        self._writing: Future | None = None

    def saw_worker(self, worker_id: str) -> None:
        """A worker's stats just arrived (they hold its seconds up to now)."""
        self.seen[worker_id] = time.monotonic()

    def count_on(self, workers: dict[str, dict[str, Any]], pool: Any) -> None:
        """Count on the seconds of this run's workers still in `pool` (the manifest's `workers` hold their last
        stats), and note the output tokens the pool's engines sampled."""
        now = time.monotonic()
        for worker in getattr(pool, "workers", []):
            stats = workers.get(worker.worker_id)
            if isinstance(stats, dict) and worker.worker_id in self.seen:
                alive = float(stats.get("alive_s") or 0.0) + now - self.seen[worker.worker_id]
                estimate = {"startup_s": float(stats.get("startup_s") or 0.0), "alive_s": alive}
            else:  # not ready yet: all of its time so far is start-up
                estimate = {"startup_s": now - worker.started_at, "alive_s": 0.0}
            self.estimates[worker.worker_id] = {k: round(v, 3) for k, v in estimate.items()}
        produced = getattr(pool, "tokens_produced", None)
        if produced is not None:
            self.sampled_tokens = max(self.sampled_tokens, int(produced()))

    def workers(self, workers: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """This run's workers: each one's stats, or the ledger's count when that is longer (a worker whose
        final stats never came: stopped by the interrupt, or lost)."""
        prefix = f"r{self.run_index}w" if self.run_index else "w"
        out = {k: dict(v) for k, v in workers.items() if _of_run(k, prefix) and isinstance(v, dict)}
        for worker_id, estimate in self.estimates.items():
            stats = out.get(worker_id)
            if stats is None or worker_seconds_of(estimate) > worker_seconds_of(stats) + 0.5:
                out[worker_id] = {**(stats or {}), **estimate, "estimated": True}
        return out

    def record(self, status: str, workers: dict[str, dict[str, Any]], rows_committed: int,
               output_tokens_committed: int) -> dict[str, Any]:
        """The run record now (`rows_committed`: the output's rows, earlier runs' too)."""
        mine = self.workers(workers)
        startup = sum(float(w.get("startup_s") or 0.0) for w in mine.values())
        # the engines' own count in the workers' stats (final at a worker's stop), or the polls' if later
        sampled = max(self.sampled_tokens, sum(int(w.get("num_sampled_tokens") or 0) for w in mine.values()))
        record = {"run_index": self.run_index, "status": status, "started_at": self.started_at,
                  "updated_at": _now_iso(), "wall_s": round(time.monotonic() - self.t0, 3),
                  "worker_seconds": round(sum(worker_seconds_of(w) for w in mine.values()), 3),
                  "startup_seconds": round(startup, 3),
                  "rows_committed": max(0, rows_committed - self.rows_at_start),
                  "output_tokens_committed": output_tokens_committed,
                  "output_tokens_sampled": sampled}
        record["lost_worker_seconds"] = lost_worker_seconds(record)
        return {**record, "workers": mine}

    def write_soon(self, record: dict[str, Any]) -> None:
        """Write a running record on the ledger's thread (skipped while the previous one is still going)."""
        if self._writing is not None and not self._writing.done():
            return
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="run-record")
        self._writing = self._writer.submit(self._write, record)

    def write(self, record: dict[str, Any]) -> None:
        """Write the run record now, after any still in flight (the final record is the last word)."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer, self._writing = None, None
        self._write(record)

    def _write(self, record: dict[str, Any]) -> None:
        """A failure is logged once and never stops the run (the manifest still holds what its compactions
        wrote)."""
        try:
            write_run_record(self.storage, record)
        except Exception as exc:  # noqa: BLE001 - bookkeeping never fails a job; LeaseLost included
            if not self.failed:
                log.warning("run record %d not written: %s", self.run_index, exc)
            self.failed = True

    def is_due(self) -> bool:
        """Whether the running record should be written again (RECORD_EVERY_S since the last)."""
        now = time.monotonic()
        if now < self.next_write:
            return False
        self.next_write = now + RECORD_EVERY_S
        return True


def status_of(finished: bool, stopped_by: BaseException | None = None) -> str:
    """A run's status: finished, interrupted (Ctrl-C / SIGTERM), failed (an error ended it or shards failed)."""
    if stopped_by is not None:
        return "interrupted" if isinstance(stopped_by, (KeyboardInterrupt, SystemExit)) else "failed"
    return "finished" if finished else "failed"


def _of_run(worker_id: str, prefix: str) -> bool:
    """Whether `worker_id` is one of this run's ("w3" in the first run, "r2w0" in run 2)."""
    return worker_id.startswith(prefix) and worker_id[len(prefix):].isdigit()


def _now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


__all__ = ["RECORD_EVERY_S", "RUNNING", "RunLedger", "status_of"]
