"""Run records: what each run of a job paid for, kept even when the run never wrote its end.

The manifest is written whole only now and then (driver/manifest.py), so a run stopped by Ctrl-C, `kill -9`, a
lost machine or a takeover of its lease would leave no trace of the worker time it paid for, while the rows
it committed still count. So each run also keeps one small record, `_runs/run-<index>.json`, rewritten every
few seconds while it runs and once at its end: its status, its workers (startup_s, alive_s: each worker's
seconds, estimated up to the write for a worker still running) and what it produced (output tokens the engines
sampled, output tokens and rows committed). Whoever reads the manifest (the next run, `report`, `status`)
folds the records in: a run the manifest lacks is added to `runs`, a worker's newer figures replace older
ones, and the totals are summed again over every run (`cost_totals`).

Work paid for and later redone or lost: a run's busy worker-seconds (start-up excluded) times the share of
its sampled output tokens that it did not commit (rows in flight when it stopped, attempts retried); 0 while
the run is still going.
"""

from __future__ import annotations

import json
from typing import Any

from jobrunner.io.layout import RUNS_DIR
from jobrunner.io.storage import Storage

RUNNING = "running"
# the status a later run gives a record still saying "running": the run ended without writing its end
KILLED = "killed"
WORKER_KEYS = ("startup_s", "alive_s")


def run_record_key(run_index: int) -> str:
    """Key of run `run_index`'s record (zero-padded: listed in run order)."""
    return f"{RUNS_DIR}/run-{run_index:06d}.json"


def write_run_record(storage: Storage, record: dict[str, Any]) -> int:
    """Write (replace) a run's record; returns the bytes written."""
    data = json.dumps(record, separators=(",", ":"), default=str).encode()
    storage.write_atomic(run_record_key(int(record["run_index"])), data)
    return len(data)


def read_run_records(storage: Storage) -> list[dict[str, Any]]:
    """Every readable run record under the output, in run order (an unreadable one is skipped)."""
    try:
        keys = [k for k in storage.listdir(RUNS_DIR) if k.endswith(".json")]
    except (FileNotFoundError, OSError):
        return []
    blobs = []
    for key in keys:
        try:
            blobs.append(storage.read_bytes(key))
        except (FileNotFoundError, OSError):
            continue
    return parse_run_records(blobs)


def parse_run_records(blobs: list[bytes]) -> list[dict[str, Any]]:
    """The records among `blobs` that parse as run records, in run order."""
    records = []
    for blob in blobs:
        try:
            record = json.loads(blob)
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(record, dict) and isinstance(record.get("run_index"), int):
            records.append(record)
    return sorted(records, key=lambda r: r["run_index"])


def fold_run_records(manifest: dict[str, Any], records: list[dict[str, Any]]) -> int:
    """Fold run records into a manifest header: runs it lacks are added, workers' newer figures taken; the
    cost totals are summed again. Returns how many runs were added."""
    runs = manifest.get("runs") if isinstance(manifest.get("runs"), list) else []
    manifest["runs"] = runs
    known = {r.get("run_index") for r in runs if isinstance(r, dict)}
    added = 0
    for record in records:
        merge_workers(manifest, record.get("workers"))
        if record["run_index"] not in known:
            runs.append(run_entry(record))
            known.add(record["run_index"])
            added += 1
    if records:
        manifest["wall_s"] = round(sum(_num(r, "wall_s") for r in runs if isinstance(r, dict)), 3)
        manifest.setdefault("totals", {}).update(cost_totals(manifest))
    return added


def run_entry(record: dict[str, Any]) -> dict[str, Any]:
    """A run's entry in the manifest's `runs` (the record without its workers, which go to `workers`)."""
    entry = {k: v for k, v in record.items() if k != "workers"}
    entry["worker_ids"] = sorted((record.get("workers") or {}).keys())
    entry["lost_worker_seconds"] = lost_worker_seconds(entry)
    return entry


def merge_workers(manifest: dict[str, Any], workers: Any) -> None:
    """Take a record's workers into the manifest's, keeping for each the figures with the longer life."""
    if not isinstance(workers, dict):
        return
    known = manifest.get("workers") if isinstance(manifest.get("workers"), dict) else {}
    manifest["workers"] = known
    for worker_id, stats in workers.items():
        if not isinstance(stats, dict):
            continue
        old = known.get(worker_id)
        if not isinstance(old, dict) or worker_seconds_of(stats) > worker_seconds_of(old):
            known[worker_id] = stats


def worker_seconds_of(stats: dict[str, Any]) -> float:
    """A worker's paid seconds: its start-up plus its life after loading."""
    return sum(_num(stats, k) for k in WORKER_KEYS)


def lost_worker_seconds(run: dict[str, Any]) -> float:
    """Busy worker-seconds of an ended run spent on output it did not commit (0 while it runs, or when its
    engines counted no sampled token: then nothing says what was lost)."""
    if run.get("status") == RUNNING:
        return 0.0
    busy = max(0.0, _num(run, "worker_seconds") - _num(run, "startup_seconds"))
    sampled, committed = _num(run, "output_tokens_sampled"), _num(run, "output_tokens_committed")
    if sampled <= 0:
        return busy if run.get("status") != "finished" and not _num(run, "rows_committed") else 0.0
    return round(busy * max(0.0, sampled - committed) / sampled, 3)


def cost_totals(manifest: dict[str, Any]) -> dict[str, Any]:
    """worker_seconds and startup_seconds over every worker of every run, lost_worker_seconds over every
    run, and the number of runs (the totals a report prices)."""
    workers = manifest.get("workers") if isinstance(manifest.get("workers"), dict) else {}
    records = [w for w in workers.values() if isinstance(w, dict)]
    startup = sum(_num(w, "startup_s") for w in records)
    runs = [r for r in manifest.get("runs") or [] if isinstance(r, dict)]
    return {"worker_seconds": round(sum(worker_seconds_of(w) for w in records), 3),
            "startup_seconds": round(startup, 3),
            "lost_worker_seconds": round(sum(lost_worker_seconds(r) for r in runs), 3),
            "num_runs": len(runs)}


def _num(mapping: dict[str, Any], key: str) -> float:
    value = mapping.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0
