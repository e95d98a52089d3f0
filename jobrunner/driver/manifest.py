"""The job manifest as the driver keeps it: shard statuses, worker stats, totals (docs/contracts.md).

`JobBook` is the bookkeeping of one run, O(1) per event: a committed shard updates its entry and the running
totals in memory and writes one small commit record; the whole manifest is written only by `compact()`,
which runs when the records not yet folded reach an eighth of the shards (so the bytes written over a job
stay linear in its shards) and at the end.
"""

from __future__ import annotations

import platform
from collections import Counter
from datetime import datetime, timezone
from typing import Any

from jobrunner import __version__
from jobrunner.driver.shards import Shard
from jobrunner.io.commits import delete_commit_records, write_commit_record
from jobrunner.io.layout import COMMITS_DIR, MANIFEST_FORMAT_VERSION
from jobrunner.io.manifest import write_manifest
from jobrunner.io.storage import Storage
from jobrunner.redaction import redact_text
from jobrunner.spec import JobSpec

_TOTAL_KEYS = ("rows", "num_errors", "num_prompt_tokens", "num_cached_tokens", "num_output_tokens")
COMPACT_MIN_RECORDS = 500  # never compact more often than this many commits
MAX_ERROR_KINDS = 50
# Sections that must match for a resume to be safe (the same rows with the same settings).
RESUME_SECTIONS = ("model", "sampling")
RESUME_INPUT_KEYS = ("url", "prompt_column", "messages_column", "id_column", "sampling_column")


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


def pending_entry(shard: Shard) -> dict[str, Any]:
    """A shard's manifest entry before it runs."""
    return {"status": "pending", "file": shard.file_url, "row_start": shard.row_start,
            "row_end": shard.row_end, "rows": 0, "num_errors": 0, "num_prompt_tokens": 0,
            "num_cached_tokens": 0, "num_output_tokens": 0,
            "worker_id": None, "attempts": 0, "seconds": None, "error": None, "part": None}


def parts_of(entry: dict[str, Any]) -> list[str]:
    """The part keys of a committed shard (several when it was bisected)."""
    parts = entry.get("parts")
    if isinstance(parts, list) and parts:
        return [str(p) for p in parts]
    return [entry["part"]] if entry.get("part") else []


def new_manifest(spec: JobSpec, shards: list[Shard]) -> dict[str, Any]:
    """A fresh manifest with every shard pending."""
    return {
        "format_version": MANIFEST_FORMAT_VERSION, "jobrunner_version": __version__, "job_name": spec.name,
        "spec": spec.redacted(), "model": {"source": spec.model.source, "dtype": spec.model.dtype,
                                           "quantization": spec.model.quantization},
        "versions": versions(), "cost": {"worker_hour_usd": spec.cost.worker_hour_usd},
        "started_at": now_iso(), "finished_at": None, "wall_s": 0.0, "runs": [],
        "shards": {s.shard_id: pending_entry(s) for s in shards}, "workers": {}, "totals": {},
    }


def check_resumable(old: dict[str, Any], spec: JobSpec, shards: list[Shard]) -> None:
    """Raise ResumeError when the old manifest was written for other rows or other settings."""
    old_spec = old.get("spec") or {}
    new_spec = spec.redacted()
    differ = [s for s in RESUME_SECTIONS if old_spec.get(s) != new_spec[s]]
    differ += [f"input.{k}" for k in RESUME_INPUT_KEYS
               if (old_spec.get("input") or {}).get(k) != new_spec["input"][k]]
    if differ:
        raise ResumeError(f"the existing output was written with different {', '.join(differ)}; "
                          "use output.mode=overwrite (or another output.url)")
    if set(old.get("shards") or {}) != {s.shard_id for s in shards}:
        raise ResumeError("the existing output was cut into different shards (input files or rows_per_shard "
                          "changed); use output.mode=overwrite (or another output.url)")


def resume_manifest(old: dict[str, Any], spec: JobSpec, committed_parts: set[str]) -> dict[str, Any]:
    """The old manifest (commit records folded in), ready for another run:

    committed shards whose parts all exist stay; the rest are pending."""
    manifest = dict(old)
    manifest.update(spec=spec.redacted(), versions=versions(), finished_at=None,
                    format_version=MANIFEST_FORMAT_VERSION, cost={"worker_hour_usd": spec.cost.worker_hour_usd})
    for entry in manifest["shards"].values():
        parts = parts_of(entry)
        if entry["status"] != "committed" or not parts or not set(parts) <= committed_parts:
            pending = pending_entry(Shard("", entry["file"], "", entry["row_start"], entry["row_end"]))
            entry.clear()
            entry.update(pending)
    return manifest


def orphan_parts(manifest: dict[str, Any], present: list[str]) -> list[str]:
    """Parts present in storage that no committed shard names (left by a run that died between publishing
    a part and writing its record): they must go before the shard runs again, or rows would repeat."""
    named = {p for e in manifest["shards"].values() if e["status"] == "committed" for p in parts_of(e)}
    return [p for p in present if p not in named]


def record_worker(manifest: dict[str, Any], worker_id: str, stats: dict[str, Any]) -> None:
    """Store a worker's latest stats."""
    manifest["workers"][worker_id] = {k: v for k, v in stats.items() if _is_plain(v)}


def _is_plain(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def finalize(manifest: dict[str, Any], run_started_at: str, run_wall_s: float, finished: bool) -> None:
    """Fill totals and timing at the end of a run."""
    manifest["runs"] = list(manifest.get("runs") or []) + [
        {"started_at": run_started_at, "finished_at": now_iso(), "wall_s": round(run_wall_s, 3)}]
    manifest["wall_s"] = round(sum(r["wall_s"] for r in manifest["runs"]), 3)
    manifest["finished_at"] = now_iso() if finished else None
    update_totals(manifest)


def update_totals(manifest: dict[str, Any]) -> None:
    """Recompute job totals from committed shards and worker stats (O(shards): compaction only)."""
    shards = manifest["shards"].values()
    committed = [s for s in shards if s["status"] == "committed"]
    totals: dict[str, Any] = {k: sum(int(s.get(k) or 0) for s in committed) for k in _TOTAL_KEYS}
    workers = manifest["workers"].values()
    startup = sum(float(w.get("startup_s") or 0) for w in workers)
    totals["worker_seconds"] = round(sum(float(w.get("alive_s") or 0) for w in workers) + startup, 3)
    totals["startup_seconds"] = round(startup, 3)
    totals["shards_committed"] = len(committed)
    totals["shards_failed"] = sum(s["status"] == "failed" for s in shards)
    totals["shards_total"] = len(manifest["shards"])
    totals["error_rate"] = round(totals["num_errors"] / totals["rows"], 6) if totals["rows"] else 0.0
    kinds: Counter = Counter()
    for s in committed:
        kinds.update(s.get("error_kinds") or {})
    totals["error_kinds"] = dict(kinds.most_common(MAX_ERROR_KINDS))
    manifest["totals"] = totals


class JobBook:
    """One run's bookkeeping over the manifest dict: O(1) per commit or failure, compaction now and then."""

    def __init__(self, storage: Storage, manifest: dict[str, Any]) -> None:
        self.storage, self.manifest = storage, manifest
        update_totals(manifest)  # once per run: O(shards)
        self.committed_rows = manifest["totals"]["rows"]
        self.num_errors = manifest["totals"]["num_errors"]
        self.error_kinds: Counter = Counter(manifest["totals"]["error_kinds"])
        self.unfolded: list[str] = []  # shards whose records the written manifest does not hold yet
        self.compact_every = max(COMPACT_MIN_RECORDS, len(manifest["shards"]) // 8)
        self.bytes_written = 0
        self.num_records = 0
        self.num_compactions = 0

    def commit(self, shard_id: str, entry: dict[str, Any], error_kinds: dict[str, int]) -> None:
        """Mark a shard committed (its parts are published): write its record, then `mark_committed`."""
        record = self.record_for(shard_id, entry, error_kinds)
        self.mark_committed(shard_id, record, write_commit_record(self.storage, shard_id, record))

    def record_for(self, shard_id: str, entry: dict[str, Any], error_kinds: dict[str, int]) -> dict[str, Any]:
        """A shard's commit record (its manifest entry, committed)."""
        return {**self.manifest["shards"][shard_id], **entry, "status": "committed", "error": None,
                "error_kinds": error_kinds}

    def mark_committed(self, shard_id: str, record: dict[str, Any], record_bytes: int) -> None:
        """Take a written record into the manifest and the running totals (the driver's thread only)."""
        self.bytes_written += record_bytes
        self.manifest["shards"][shard_id] = record
        self.num_records += 1
        self.committed_rows += int(record["rows"])
        self.num_errors += int(record["num_errors"])
        self.error_kinds.update(record.get("error_kinds") or {})
        self.unfolded.append(shard_id)
        if len(self.unfolded) >= self.compact_every:
            self.compact()

    def fail(self, shard_id: str, error: str, attempts: int, failed: bool) -> None:
        """Record a failed attempt in memory; `failed` marks the shard failed for good."""
        self.manifest["shards"][shard_id].update(attempts=attempts, error=redact_text(error),
                                                 status="failed" if failed else "pending")

    def record_worker(self, worker_id: str, stats: dict[str, Any]) -> None:
        """A worker's latest stats."""
        record_worker(self.manifest, worker_id, stats)

    def compact(self, drop_all_records: bool = False) -> None:
        """Write the whole manifest, then drop the records it now holds (all of `_commits/` at a run's
        start, where the manifest was built from the records of earlier runs)."""
        update_totals(self.manifest)
        self.bytes_written += write_manifest(self.storage, self.manifest)
        self.num_compactions += 1
        if drop_all_records:
            self.storage.delete(COMMITS_DIR, recursive=True)
        else:
            delete_commit_records(self.storage, self.unfolded)
        self.unfolded = []

    def top_error_kinds(self, n: int = 5) -> list[tuple[str, int]]:
        """The most frequent error kinds among committed rows."""
        return self.error_kinds.most_common(n)


def mark_run_start(manifest: dict[str, Any], started_at: str) -> None:
    """Note where this run started (time, committed rows and output tokens so far), so that `jobrunner status`
    can tell this run's rate and ETA from earlier runs' work while the run is going."""
    totals = manifest.get("totals") or {}
    manifest["current_run"] = {"run_index": int(manifest.get("run_count") or 1) - 1, "started_at": started_at,
                               "rows_at_start": int(totals.get("rows") or 0),
                               "output_tokens_at_start": int(totals.get("num_output_tokens") or 0)}
