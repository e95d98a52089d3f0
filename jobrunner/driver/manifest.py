"""The job manifest as the driver keeps it: a header dict (spec, model, versions, runs, workers, totals) and
the shard table (driver/shards.py: columns, not an object per shard); docs/contracts.md.

`JobBook` is the bookkeeping of one run and the only code of a run that changes the manifest (run count,
model, workers, prefix chains, the run's figures), O(1) per event: a committed shard updates its row of the table and
the running totals and writes one small commit record; the whole manifest (header + shard table) is written
only by a compaction, when the records not yet folded reach an eighth of the shards (so the bytes written
over a job stay linear in its shards) and at the end. Compactions during the run work on a thread, from a
snapshot of the table, so the loop keeps handing out work while the table is encoded and written.
"""

from __future__ import annotations

import copy
import platform
from array import array
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

import numpy as np

from jobrunner import __version__
from jobrunner.driver.prefix_stats import add_chains, record_summary
from jobrunner.driver.run_ledger import RunLedger, status_of
from jobrunner.driver.shards import ShardTable
from jobrunner.io.commits import delete_commit_records, write_commit_record
from jobrunner.io.layout import COMMITS_DIR, MANIFEST_FORMAT_VERSION, PARTS_DIR
from jobrunner.io.manifest import write_manifest
from jobrunner.io.run_records import KILLED, RUNNING, cost_totals, lost_worker_seconds, merge_workers, run_entry
from jobrunner.io.shard_file import COMMITTED, COUNT_COLUMNS, FAILED, ShardColumns
from jobrunner.io.storage import Storage
from jobrunner.redaction import redact_text
from jobrunner.spec import JobSpec

COMPACT_MIN_RECORDS = 500  # never compact more often than this many commits
MAX_ERROR_KINDS = 50
# Sections that must match for a resume to be safe (the same rows with the same settings).
RESUME_SECTIONS = ("model", "sampling")
RESUME_INPUT_KEYS = ("url", "prompt_column", "messages_column", "id_column", "sampling_column", "adapter_column",
                     "limit",
                     "system_prompt", "system_prompt_column", "chat_template_kwargs_column", "tools",
                     "tools_column", "tool_choice", "completion_column", "image_column")


class ResumeError(ValueError):
    """The existing output cannot be resumed with this spec; the message says what differs."""


def now_iso() -> str:
    """Current UTC time, ISO-8601."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def versions() -> dict[str, str]:
    """Versions of the packages that shape the outputs."""
    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "ray", "pyarrow"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - a missing package is just not recorded
            out[name] = "unknown"
    return out


def parts_of(entry: dict[str, Any]) -> list[str]:
    """The part keys of a committed shard's entry (several when it was bisected)."""
    parts = entry.get("parts")
    if isinstance(parts, list) and parts:
        return [str(p) for p in parts]
    return [entry["part"]] if entry.get("part") else []


def new_manifest(spec: JobSpec, shards: ShardTable) -> dict[str, Any]:
    """A fresh manifest header for a job whose shards are all pending (the shards live in `shards`)."""
    return {
        "format_version": MANIFEST_FORMAT_VERSION, "jobrunner_version": __version__, "job_name": spec.name,
        "task": spec.task, "logical_date": spec.logical_date,
        "spec": spec.redacted(), "model": _model_section(spec),
        "versions": versions(), "cost": {"worker_hour_usd": spec.cost.worker_hour_usd},
        "started_at": now_iso(), "finished_at": None, "wall_s": 0.0, "runs": [], "workers": {}, "totals": {},
    }


def _model_section(spec: JobSpec) -> dict[str, Any]:
    """The model as the spec names it (workers add what they loaded: Manifest.note_model)."""
    model = {"source": redact_text(spec.model.source), "dtype": spec.model.dtype,
             "quantization": spec.model.quantization}
    if spec.model.adapters:
        model["adapters"] = [{"name": n, "source": redact_text(s)} for n, s in spec.model.adapters.items()]
    return model


def resume_manifest(old: dict[str, Any], spec: JobSpec, old_shards: ShardColumns, shards: ShardTable,
                    present_parts: list[str]) -> dict[str, Any]:
    """The old manifest ready for another run; `shards` takes the old table's state: committed shards whose
    parts all exist stay, the rest become pending (as if never run: failed ones run again)."""
    manifest = continued_header(old, spec)
    shards.adopt(old_shards)
    columns = shards.columns
    committed = np.flatnonzero(columns.status == COMMITTED)
    present = _as_bytes(present_parts)
    missing = committed[~np.isin(_default_parts(columns, committed), present)]
    missing = [i for i in missing.tolist() if i not in columns.parts]
    present_set = set(present_parts) if columns.parts else set()
    missing += [i for i, parts in columns.parts.items() if not set(parts) <= present_set]
    not_committed = np.flatnonzero(columns.status != COMMITTED)
    columns.reset(np.union1d(not_committed, np.array(missing, np.int64)).astype(np.int64))
    return manifest


def continued_header(old: dict[str, Any], spec: JobSpec) -> dict[str, Any]:
    """An earlier run's manifest header, ready for another run with `spec` (its shards live in the table)."""
    manifest = {k: v for k, v in old.items() if k not in ("shards", "shard_table")}
    manifest.update(spec=spec.redacted(), versions=versions(), finished_at=None, logical_date=spec.logical_date,
                    format_version=MANIFEST_FORMAT_VERSION, cost={"worker_hour_usd": spec.cost.worker_hour_usd})
    return manifest


def orphan_parts(shards: ShardTable, present: list[str]) -> list[str]:
    """Parts present in storage that no committed shard names (left by a run that died between publishing
    a part and writing its record): they must go before the shard runs again, or rows would repeat."""
    columns = shards.columns
    committed = np.flatnonzero(columns.status == COMMITTED)
    named = _default_parts(columns, committed)
    extra = _as_bytes([p for parts in columns.parts.values() for p in parts])
    stray = ~np.isin(_as_bytes(present), np.concatenate([named, extra]) if len(extra) else named)
    return [p for p, is_stray in zip(present, stray.tolist(), strict=True) if is_stray]


def _default_parts(columns: ShardColumns, indices: np.ndarray) -> np.ndarray:
    """`parts/part-<shard_id>.parquet` of these shards, as bytes (vectorized)."""
    return np.char.add(np.char.add(f"{PARTS_DIR}/part-".encode(), columns.shard_id[indices]), b".parquet")


def _as_bytes(keys: list[str]) -> np.ndarray:
    return np.array([k.encode() for k in keys], dtype=bytes) if keys else np.zeros(0, "S1")


def record_worker(manifest: dict[str, Any], worker_id: str, stats: dict[str, Any]) -> None:
    """Store a worker's latest stats."""
    record = {k: v for k, v in stats.items() if _is_plain(v)}
    stages = stats.get("startup_stages_s")
    if isinstance(stages, dict):  # the worker's start-up by stage (driver/actor.startup_stages)
        record["startup_stages_s"] = {str(k): v for k, v in stages.items() if isinstance(v, (int, float))}
    ranks = stats.get("ranks")
    if isinstance(ranks, list):  # a tensor-parallel worker's ranks (driver/rank_group.py)
        record["ranks"] = [{k: v for k, v in r.items() if _is_plain(v) or k == "cores"} for r in ranks
                           if isinstance(r, dict)]
    lost = (manifest["workers"].get(worker_id) or {}).get("lost")
    if lost is not None:
        record["lost"] = lost
    manifest["workers"][worker_id] = record


def _is_plain(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def finalize(manifest: dict[str, Any], run_started_at: str, run_wall_s: float, finished: bool) -> None:
    """Fill timing at the end of a run (totals are filled by the compaction that writes it)."""
    manifest["runs"] = list(manifest.get("runs") or []) + [
        {"started_at": run_started_at, "finished_at": now_iso(), "wall_s": round(run_wall_s, 3)}]
    manifest["wall_s"] = round(sum(r["wall_s"] for r in manifest["runs"]), 3)
    manifest["finished_at"] = now_iso() if finished else None


def update_totals(manifest: dict[str, Any], shards: ShardTable) -> None:
    """Recompute job totals from the shard table and worker stats (O(shards) in numpy: compaction only); the
    worker-seconds are over every worker of every run (io/run_records.cost_totals)."""
    totals = shards.totals()
    totals.update(cost_totals(manifest))
    totals["error_rate"] = round(totals["num_errors"] / totals["rows"], 6) if totals["rows"] else 0.0
    totals["error_kinds"] = dict(list(totals["error_kinds"].items())[:MAX_ERROR_KINDS])
    manifest["totals"] = totals


class JobBook:
    """One run's bookkeeping over the manifest header and the shard table: O(1) per commit or failure,
    compaction now and then (on a thread while the run goes on)."""

    def __init__(self, storage: Storage, manifest: dict[str, Any], shards: ShardTable,
                 background: bool = True) -> None:
        self.storage, self.manifest, self.shards = storage, manifest, shards
        self.background = background  # compactions during the run on a thread (False: in the caller)
        update_totals(manifest, shards)  # once per run: O(shards)
        self.committed_rows = manifest["totals"]["rows"]
        self.num_errors = manifest["totals"]["num_errors"]
        self.error_kinds: Counter = Counter(shards.columns.error_kinds.totals(shards.columns.status == COMMITTED))
        self.unfolded = array("q")  # rows of the shards whose records the written manifest does not hold yet
        self.compact_every = max(COMPACT_MIN_RECORDS, len(shards) // 8)
        self.bytes_written = 0
        self.num_records = 0
        self.num_compactions = 0
        self._compactor: ThreadPoolExecutor | None = None
        self._compacting: Future | None = None
        self.ledger: RunLedger | None = None  # this run's record (begin_run)
        self.run_output_tokens = 0  # output tokens of the shards this run committed
        self.final_record: dict[str, Any] | None = None

    # ---- the run ------------------------------------------------------------------------------------
    def begin_run(self, started_at: str) -> int:
        """Count this run and note where it starts (for `jobrunner status`); its index (0 = the first run)."""
        run_index = int(self.manifest.get("run_count") or 0)
        self.manifest["run_count"] = run_index + 1
        mark_run_start(self.manifest, started_at)
        end_older_runs(self.manifest, self.shards)
        self.ledger = RunLedger(self.storage, run_index, started_at, self.committed_rows)
        return run_index

    def note_lost(self, worker_id: str, error: str) -> None:
        """Why a worker was lost (a tensor-parallel worker's: the rank, its node and pid), in its entry."""
        self.manifest["workers"].setdefault(worker_id, {})["lost"] = redact_text(error)

    def note_model(self, model: dict[str, Any]) -> None:
        """What a worker reports of the model it loaded."""
        self.manifest["model"].update(model)

    def add_chains(self, chains: tuple[int, Any], block_size: int, record: dict[str, Any] | None = None) -> None:
        """A committed shard's prompt KV chains (and its tokens: `record`), into the job's ideal prefix-cache
        hits."""
        add_chains(self.manifest, chains, block_size, record)

    def finish_run(self, started_at: str, wall_s: float, finished: bool, figures: dict[str, Any],
                   pool: Any = None, stopped_by: BaseException | None = None) -> None:
        """The run's timing and figures (`figures`: commits, isolation cost...), its workers' seconds and
        status (`stopped_by`: the exception that ended it early), then the prefix summary."""
        finalize(self.manifest, started_at, wall_s, finished)
        self.wait()  # a compaction in flight counts in this run's figures
        record = self._run_record(status_of(finished, stopped_by), pool)
        merge_workers(self.manifest, record["workers"])  # a worker whose final stats never came: its count
        self.final_record = record
        self.manifest["runs"][-1].update(
            **figures, commit_records=self.num_records, compactions=self.num_compactions + 1,
            bookkeeping_bytes=self.bytes_written)  # before this last compaction
        self.manifest["runs"][-1].update(run_entry(record))
        record_summary(self.manifest, self.shards.totals())  # prefix-cache hits achieved vs the ideal

    def keep_run_record(self, pool: Any) -> None:
        """Count on this run's workers' seconds; write its record when due (driver/run_ledger.py)."""
        if self.ledger is None:
            return
        self.ledger.count_on(self.manifest["workers"], pool)
        if self.ledger.is_due():
            self.ledger.write_soon(self._run_record(RUNNING, None))

    def write_run_record(self) -> None:
        """The run's final record (after the compaction that wrote the manifest with its entry)."""
        if self.ledger is not None and self.final_record is not None:
            self.ledger.write(self.final_record)

    def _run_record(self, status: str, pool: Any) -> dict[str, Any]:
        assert self.ledger is not None, "begin_run first"
        if pool is not None:
            self.ledger.count_on(self.manifest["workers"], pool)
        return self.ledger.record(status, self.manifest["workers"], self.committed_rows, self.run_output_tokens)

    # ---- shards ---------------------------------------------------------------------------------------
    def commit(self, shard_id: str, entry: dict[str, Any], error_kinds: dict[str, int]) -> None:
        """Mark a shard committed (its parts are published): write its record, then `mark_committed` (tools
        and tests; the job loop publishes on threads and calls the steps itself)."""
        row = self.shards.index_of(shard_id)
        record = self.record_for(row, entry, error_kinds)
        self.mark_committed(row, record, write_commit_record(self.storage, shard_id, record))

    def record_for(self, row: int, entry: dict[str, Any], error_kinds: dict[str, int]) -> dict[str, Any]:
        """The commit record of the shard in table row `row` (its manifest entry, committed)."""
        return {**self.shards.columns.entry(row), **entry, "status": "committed", "error": None,
                "error_kinds": error_kinds}

    def mark_committed(self, row: int, record: dict[str, Any], record_bytes: int) -> None:
        """Take a written record into the table and the running totals (the driver's thread only)."""
        index = row
        self.bytes_written += record_bytes
        self.shards.commit(index, record)
        self.num_records += 1
        self.committed_rows += int(record["rows"])
        self.run_output_tokens += int(record.get("num_output_tokens") or 0)
        self.num_errors += int(record["num_errors"])
        self.error_kinds.update(record.get("error_kinds") or {})
        self.unfolded.append(index)
        self._collect_compaction()
        if len(self.unfolded) >= self.compact_every and self._compacting is None:
            self._compact_in_background() if self.background else self.compact()

    def fail(self, row: int, error: str, attempts: int, failed: bool) -> None:
        """Record a failed attempt of the shard in table row `row`; `failed` marks it failed for good."""
        self.shards.fail(row, error, attempts, failed)

    def failed_shards(self) -> dict[str, str]:
        """Shard id -> error of the shards failed for good in this run (a resume makes failed ones pending)."""
        columns = self.shards.columns
        return {self.shards.id_of(i): str(columns.error.get(i)) for i in np.flatnonzero(columns.status == FAILED)}

    def record_worker(self, worker_id: str, stats: dict[str, Any]) -> None:
        """A worker's latest stats."""
        record_worker(self.manifest, worker_id, stats)
        if self.ledger is not None:
            self.ledger.saw_worker(worker_id)

    def compact(self, drop_all_records: bool = False) -> None:
        """Write the whole manifest now, then drop the records it holds (all of `_commits/` at a run's start,
        where the manifest was built from the records of earlier runs)."""
        self.wait()
        update_totals(self.manifest, self.shards)
        self.bytes_written += write_manifest(self.storage, self.manifest, self.shards.columns)
        self.num_compactions += 1
        if drop_all_records:
            self.storage.delete(COMMITS_DIR, recursive=True)
        else:
            delete_commit_records(self.storage, self._ids(self.unfolded))
        self.unfolded = array("q")

    def wait(self) -> None:
        """Wait for a compaction in flight (raising its error) and stop the compaction thread."""
        if self._compacting is not None:
            self._compacting.result()
            self._collect_compaction()
        if self._compactor is not None:
            self._compactor.shutdown(wait=True)
            self._compactor = None

    def _compact_in_background(self) -> None:
        """Snapshot the table (a copy of its state arrays: milliseconds) and write it on the compaction thread."""
        header, columns = copy.deepcopy(self.manifest), self.shards.columns.copy()
        folded, self.unfolded = self.unfolded, array("q")
        if self._compactor is None:
            self._compactor = ThreadPoolExecutor(1, thread_name_prefix="compact")
        self._compacting = self._compactor.submit(self._write_snapshot, header, columns, folded)

    def _write_snapshot(self, header: dict[str, Any], columns: ShardColumns, folded: array) -> int:
        update_totals(header, ShardTable(columns, self.shards.file_stems))
        written = write_manifest(self.storage, header, columns)
        delete_commit_records(self.storage, self._ids(folded))  # ids never change: safe to read here
        return written

    def _collect_compaction(self) -> None:
        """Account a finished background compaction; re-raise its error here, on the driver's thread."""
        if self._compacting is None or not self._compacting.done():
            return
        future, self._compacting = self._compacting, None
        self.bytes_written += future.result()
        self.num_compactions += 1

    def _ids(self, rows: array) -> list[str]:
        return [self.shards.id_of(i) for i in rows]

    def top_error_kinds(self, n: int = 5) -> list[tuple[str, int]]:
        """The most frequent error kinds among committed rows."""
        return self.error_kinds.most_common(n)


def mark_run_start(manifest: dict[str, Any], started_at: str) -> None:
    """Note where this run started (time, committed rows and output tokens so far), so that `jobrunner status`
    can tell this run's rate and ETA from earlier runs' work while the run is going."""
    totals = manifest.get("totals") or {}
    manifest["current_run"] = {"run_index": int(manifest.get("run_count") or 1) - 1, "started_at": started_at,
                               "rows_at_start": int(totals.get("rows") or 0),
                               "output_tokens_at_start": int(totals.get("num_output_tokens") or 0),
                               "prompt_tokens_at_start": int(totals.get("num_prompt_tokens") or 0)}


def end_older_runs(manifest: dict[str, Any], shards: ShardTable) -> None:
    """Runs that a new run finds still "running" (folded from their records) ended without writing their end:
    killed, their machine lost, or their lease taken over. Their paid work in flight was lost. What they
    committed is taken from the shard table (their workers' shards): their last record may predate a commit."""
    committed = committed_by_run(shards)
    for run in manifest.get("runs") or []:
        if isinstance(run, dict) and run.get("status") == RUNNING:
            run["status"] = KILLED
            rows, tokens = committed.get(run.get("run_index"), (0, 0))
            run["rows_committed"] = max(int(run.get("rows_committed") or 0), rows)
            run["output_tokens_committed"] = max(int(run.get("output_tokens_committed") or 0), tokens)
            run["lost_worker_seconds"] = lost_worker_seconds(run)


def committed_by_run(shards: ShardTable) -> dict[int, tuple[int, int]]:
    """Run index -> (rows, output tokens) of the committed shards its workers finished (worker ids "w<i>"
    in the first run, "r<k>w<i>" in run k)."""
    columns = shards.columns
    is_committed = columns.status == COMMITTED
    rows_at, tokens_at = COUNT_COLUMNS.index("rows"), COUNT_COLUMNS.index("num_output_tokens")
    out: dict[int, tuple[int, int]] = {}
    for code, worker_id in enumerate(columns.worker_id.values):
        run_index = _run_of_worker(worker_id)
        mask = is_committed & (columns.worker_id.codes == code)
        if run_index is None or not mask.any():
            continue
        rows, tokens = out.get(run_index, (0, 0))
        out[run_index] = (rows + int(columns.counts[mask, rows_at].sum()),
                          tokens + int(columns.counts[mask, tokens_at].sum()))
    return out


def _run_of_worker(worker_id: str) -> int | None:
    """0 for "w3", 2 for "r2w0", None for an id of another form."""
    head, sep, tail = worker_id.rpartition("w")
    if not sep or not tail.isdigit():
        return None
    if not head:
        return 0
    return int(head[1:]) if head.startswith("r") and head[1:].isdigit() else None
