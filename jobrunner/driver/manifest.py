"""The job manifest as the driver keeps it: shard statuses, worker stats, totals (docs/contracts.md)."""

from __future__ import annotations

import platform
from datetime import datetime, timezone
from typing import Any

from jobrunner import __version__
from jobrunner.driver.shards import Shard
from jobrunner.driver.worker import ShardResult
from jobrunner.io.layout import MANIFEST_FORMAT_VERSION
from jobrunner.spec import JobSpec

_TOTAL_KEYS = ("rows", "num_errors", "num_prompt_tokens", "num_cached_tokens", "num_output_tokens")
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
    """The old manifest, ready for another run:

    committed shards whose part exists stay; the rest are pending."""
    manifest = dict(old)
    manifest.update(spec=spec.redacted(), versions=versions(), finished_at=None,
                    cost={"worker_hour_usd": spec.cost.worker_hour_usd})
    for entry in manifest["shards"].values():
        if entry["status"] != "committed" or entry.get("part") not in committed_parts:
            pending = pending_entry(Shard("", entry["file"], "", entry["row_start"], entry["row_end"]))
            entry.clear()
            entry.update(pending)
    return manifest


def record_commit(manifest: dict[str, Any], result: ShardResult, attempts: int) -> None:
    """Mark a shard committed with its counts."""
    entry = manifest["shards"][result.shard_id]
    entry.update(status="committed", rows=result.rows, num_errors=result.num_errors,
                 num_prompt_tokens=result.num_prompt_tokens, num_cached_tokens=result.num_cached_tokens,
                 num_output_tokens=result.num_output_tokens, worker_id=result.worker_id, attempts=attempts,
                 seconds=round(result.seconds, 3), error=None, part=result.part)
    record_worker(manifest, result.worker_id, result.worker_stats)


def record_failure(manifest: dict[str, Any], shard_id: str, error: str, attempts: int, failed: bool) -> None:
    """Record a failed attempt; `failed` marks the shard failed for good."""
    entry = manifest["shards"][shard_id]
    entry.update(attempts=attempts, error=error, status="failed" if failed else "pending")


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
    """Recompute job totals from committed shards and worker stats."""
    shards = manifest["shards"].values()
    committed = [s for s in shards if s["status"] == "committed"]
    totals = {k: sum(int(s.get(k) or 0) for s in committed) for k in _TOTAL_KEYS}
    alive = [float(w.get("alive_s") or 0) for w in manifest["workers"].values()]
    totals["worker_seconds"] = round(sum(alive), 3)
    totals["shards_committed"] = len(committed)
    totals["shards_failed"] = sum(s["status"] == "failed" for s in shards)
    totals["shards_total"] = len(manifest["shards"])
    manifest["totals"] = totals
