"""`jobrunner status`: where a job output stands, from its manifest, commit records and lease (no part read).

Works for a running output (the manifest lags; commit records fill the gap; the lease says who runs it and
when it last said so) and for a finished one. Every field is read defensively: an older or newer manifest or
lease format yields "n/a" for what it lacks, never an exception.
"""

from __future__ import annotations

import time
from collections import Counter
from datetime import datetime
from typing import Any

from jobrunner.io.report_reader import OutputState
from jobrunner.reports import manifest_view as mv

TOP_ERROR_KINDS = 5
LEASE_GENERATION_KEYS = ("generation", "epoch", "fence", "fencing_token")


def job_status(state: OutputState, now_s: float | None = None) -> dict[str, Any]:
    """The status of one output as a JSON-friendly dict (see docs/driver.md, `jobrunner status`)."""
    now_s = time.time() if now_s is None else now_s
    manifest = state.manifest or {}
    shards = [s for s in (manifest.get("shards") or {}).values() if isinstance(s, dict)]
    lease = lease_view(state.lease, now_s)
    rows = _rows(manifest, shards)
    phase = _phase(state, lease)
    tokens = _tokens(shards)
    live = _live(state.lease) if phase == "running" else None
    if live is not None:  # the driver's own count (heartbeat): rows finished in running shards too
        rows.update(done=max(rows["done"], live["rows_done"]), total=max(rows["total"], live["rows_total"]))
        current = _current_run(manifest)
        tokens["output"] = max(tokens["output"], _int(current.get("output_tokens_at_start"))
                               + live["output_tokens_this_run"])
    speed = _speed(manifest, rows, phase, now_s, live)
    return {"url": state.url, "job_name": mv.text(manifest, "job_name"), "state": phase,
            "phase": live["phase"] if live else None, "rows": rows, "live": live,
            "shards": mv.shard_counts(manifest), "tokens": tokens, "speed": speed,
            "workers": _workers(manifest, phase, live), "lease": lease, "model": mv.model_info(manifest),
            "started_at": mv.text(manifest, "started_at"), "finished_at": mv.text(manifest, "finished_at"),
            "run_count": manifest.get("run_count"), "commit_records_pending": state.num_commit_records}


def _live(lease: dict | None) -> dict[str, Any] | None:
    """The running driver's progress from its last heartbeat (io/lease.py), None when the lease has none."""
    progress = (lease or {}).get("progress")
    if not isinstance(progress, dict):
        return None
    return {"phase": str(progress.get("phase") or "running"), "rows_done": _int(progress.get("rows_done")),
            "rows_total": _int(progress.get("rows_total")),
            "output_tokens_this_run": _int(progress.get("output_tokens_this_run")),
            "workers": _int(progress.get("workers")), "at": progress.get("at")}


def _current_run(manifest: dict) -> dict:
    return manifest.get("current_run") if isinstance(manifest.get("current_run"), dict) else {}


def _rows(manifest: dict, shards: list[dict]) -> dict[str, Any]:
    committed = [s for s in shards if s.get("status") == "committed"]
    done = sum(_int(s.get("rows")) for s in committed)
    errors = sum(_int(s.get("num_errors")) for s in committed)
    spec = manifest.get("spec") if isinstance(manifest.get("spec"), dict) else {}
    n = _int((spec.get("sampling") or {}).get("n")) or 1
    planned = sum(max(_int(s.get("row_end")) - _int(s.get("row_start")), 0) for s in shards) * n
    kinds: Counter = Counter()
    for shard in committed:
        kinds.update({str(k): _int(v) for k, v in (shard.get("error_kinds") or {}).items()})
    return {"done": done, "total": max(planned, done), "errors": errors,
            "error_share": errors / done if done else None,
            "top_error_kinds": dict(kinds.most_common(TOP_ERROR_KINDS))}


def _tokens(shards: list[dict]) -> dict[str, int]:
    committed = [s for s in shards if s.get("status") == "committed"]
    return {key: sum(_int(s.get(f"num_{key}_tokens")) for s in committed) for key in ("prompt", "cached", "output")}


def lease_view(lease: dict | None, now_s: float) -> dict[str, Any] | None:
    """Holder, last heartbeat (and its age), expiry and generation of a lease; None without one."""
    if not lease:
        return None
    heartbeat_s = _epoch(lease.get("heartbeat_at"))
    ttl_s = mv.number(lease, "ttl_s")
    # The fenced lease (io/lease.py) has no expiry of its own: a run takes it over after seeing it unchanged
    # for ttl_s on its own clock. Here: the holder's last heartbeat plus ttl_s (its clock: an estimate).
    expires_s = mv.number(lease, "expires_at_s") or _epoch(lease.get("expires_at")) or (
        heartbeat_s + ttl_s if heartbeat_s is not None and ttl_s else None)
    generation = next((lease[k] for k in LEASE_GENERATION_KEYS if k in lease), None)
    released = lease.get("state") == "released"
    return {"run_id": lease.get("run_id"), "host": lease.get("host"), "pid": lease.get("pid"),
            "job_name": lease.get("job_name"), "heartbeat_at": lease.get("heartbeat_at"),
            "heartbeat_age_s": None if heartbeat_s is None else round(now_s - heartbeat_s, 1),
            "expires_at": lease.get("expires_at"),
            "expires_in_s": None if expires_s is None or released else round(expires_s - now_s, 1),
            "expired": released or expires_s is None or expires_s <= now_s, "generation": generation,
            "state": lease.get("state") or "held"}


def _phase(state: OutputState, lease: dict | None) -> str:
    """complete | running | stale (a lease nobody renews: its driver died) | incomplete (no run going)."""
    if state.is_complete:
        return "complete"
    if lease is not None and lease["state"] != "released":
        return "stale" if lease["expired"] else "running"
    return "incomplete"


def _speed(manifest: dict, rows: dict, phase: str, now_s: float, live: dict | None = None) -> dict[str, Any]:
    """Output tokens/s and rows/s of this run while it runs (ETA from its pace; from the driver's heartbeat
    when it has one, measured to that heartbeat), else over the job's wall time."""
    current = _current_run(manifest)
    started_s = _epoch(current.get("started_at"))
    if phase == "running" and started_s is not None:
        until_s = (_epoch(live["at"]) if live else None) or now_s
        elapsed = max(until_s - started_s, 1e-6)
        rows_now = rows["done"] - _int(current.get("rows_at_start"))
        tokens_now = live["output_tokens_this_run"] if live else (
            _tokens_total(manifest) - _int(current.get("output_tokens_at_start")))
        left = rows["total"] - rows["done"]
        eta = 0.0 if left <= 0 else (left * elapsed / rows_now if rows_now > 0 else None)
        basis = "this run so far (driver heartbeat)" if live else "this run so far (committed shards)"
        return {"basis": basis, "elapsed_s": round(elapsed, 1), "rows_per_s": max(rows_now, 0) / elapsed,
                "output_tokens_per_s": max(tokens_now, 0) / elapsed, "eta_s": None if eta is None else round(eta, 1)}
    wall = mv.number(manifest, "wall_s")
    if not wall:
        return {"basis": "unknown (no wall time recorded)", "elapsed_s": None, "rows_per_s": None,
                "output_tokens_per_s": None, "eta_s": None}
    return {"basis": "whole job (manifest wall_s)", "elapsed_s": wall, "rows_per_s": rows["done"] / wall,
            "output_tokens_per_s": _tokens_total(manifest) / wall,
            "eta_s": 0.0 if rows["done"] >= rows["total"] else None}


def _tokens_total(manifest: dict) -> int:
    shards = [s for s in (manifest.get("shards") or {}).values() if isinstance(s, dict)]
    return sum(_int(s.get("num_output_tokens")) for s in shards if s.get("status") == "committed")


def _workers(manifest: dict, phase: str, live: dict | None = None) -> dict[str, Any]:
    """Workers recorded for the latest run (ids `w<i>` in run 0, `r<k>w<i>` in run k); while a run is going, at
    least the number of workers its driver's last heartbeat counted (`live`: before any shard is committed the
    manifest names none)."""
    records = mv.workers(manifest)
    run_count = _int(manifest.get("run_count")) or 1
    current = manifest.get("current_run") if isinstance(manifest.get("current_run"), dict) else {}
    index = _int(current.get("run_index")) if phase == "running" and current else run_count - 1
    prefix = "w" if index == 0 else f"r{index}w"
    latest = {wid: w for wid, w in records.items() if _of_run(wid, prefix)}
    # A running job's manifest is compacted only now and then; its commit records name the workers too.
    shards = [s for s in (manifest.get("shards") or {}).values() if isinstance(s, dict)]
    committed_by = {str(s.get("worker_id")) for s in shards if s.get("status") == "committed"}
    committed_by = {wid for wid in committed_by if _of_run(wid, prefix)}
    devices = Counter(str(w.get("device") or "?") for w in latest.values())
    nodes = sorted({str(w.get("node") or w.get("node_ip") or "?") for w in latest.values()})
    ids = sorted(set(latest) | committed_by)
    live_count = live["workers"] if live else None
    return {"run_index": index, "count": max(len(ids), live_count or 0), "ids": ids, "live": live_count,
            "devices": dict(devices), "nodes": nodes, "recorded_all_runs": len(records)}


def _of_run(worker_id: str, prefix: str) -> bool:
    return worker_id.startswith(prefix) and worker_id[len(prefix):].isdigit()


def _epoch(value: Any) -> float | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _int(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0
