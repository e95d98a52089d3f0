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
from jobrunner.progress_view import (
    Counts,
    counts_from_dict,
    counts_of,
    entry_prompts,
    entry_samples,
    eta_s,
    job_n,
    token_kind,
)
from jobrunner.reports import manifest_view as mv
from jobrunner.reports.parallel_view import rank_summary

TOP_ERROR_KINDS = 5
RATE_WINDOW_S = 30.0  # the driver's tokens/s window (driver/progress.py RATE_WINDOW_S)
LEASE_GENERATION_KEYS = ("generation", "epoch", "fence", "fencing_token")


def job_status(state: OutputState, now_s: float | None = None) -> dict[str, Any]:
    """The status of one output as a JSON-friendly dict (see docs/driver.md, `jobrunner status`)."""
    now_s = time.time() if now_s is None else now_s
    manifest = state.manifest or {}
    shards = [s for s in (manifest.get("shards") or {}).values() if isinstance(s, dict)]
    lease = lease_view(state.lease, now_s)
    phase = _phase(state, lease)
    tokens = _tokens(shards)
    live = _live(state.lease, now_s) if phase == "running" else None
    counts = _committed_counts(manifest, shards)
    if live is not None:  # the driver's own count (heartbeat): rows finished in running shards too
        # an older driver's heartbeat has output rows only: its prompts are rows / n
        counts = counts.at_least(live["counts"] or counts_of(live["rows_done"] // counts.n, counts.prompts_total,
                                                             live["rows_done"], counts.n))
        current = _current_run(manifest)
        tokens["output"] = max(tokens["output"], _int(current.get("output_tokens_at_start"))
                               + live["output_tokens_this_run"])
    rows = _rows(shards, counts)
    speed = _speed(manifest, counts, phase, now_s, live)
    return {"url": state.url, "job_name": mv.text(manifest, "job_name"), "state": phase,
            "phase": live["phase"] if live else None, "rows": rows, "counts": counts.to_dict(),
            "counts_basis": "the driver's count" if live else "committed",
            "live": live and {**live, "counts": live["counts"] and live["counts"].to_dict()},
            "shards": mv.shard_counts(manifest), "tokens": tokens, "speed": speed,
            "workers": _workers(manifest, phase, live), "lease": lease, "model": mv.model_info(manifest),
            "started_at": mv.text(manifest, "started_at"), "finished_at": mv.text(manifest, "finished_at"),
            "run_count": manifest.get("run_count"), "commit_records_pending": state.num_commit_records}


def _live(lease: dict | None, now_s: float) -> dict[str, Any] | None:
    """The running driver's progress from its last heartbeat (io/lease.py), None when the lease has none:
    the counts, tokens and ETA its log showed then (progress_view.py), and how long ago that was."""
    progress = (lease or {}).get("progress")
    if not isinstance(progress, dict):
        return None
    at_s = _epoch(progress.get("at"))
    kind = progress.get("tokens_kind") if progress.get("tokens_kind") in ("in", "out") else "out"
    tokens = progress.get("tokens_this_run", progress.get("output_tokens_this_run"))
    return {"phase": str(progress.get("phase") or "running"), "rows_done": _int(progress.get("rows_done")),
            "rows_total": _int(progress.get("rows_total")), "counts": counts_from_dict(progress.get("counts")),
            "output_tokens_this_run": _int(progress.get("output_tokens_this_run")),
            "tokens_this_run": _int(tokens), "tokens_kind": kind,
            "eta_s": mv.number(progress, "eta_s"), "tokens_per_s": mv.number(progress, "tokens_per_s"),
            "age_s": None if at_s is None else max(now_s - at_s, 0.0),
            "workers": _int(progress.get("workers")), "at": progress.get("at")}


def _current_run(manifest: dict) -> dict:
    return manifest.get("current_run") if isinstance(manifest.get("current_run"), dict) else {}


def _task(manifest: dict) -> str | None:
    spec = manifest.get("spec") if isinstance(manifest.get("spec"), dict) else {}
    task = spec.get("task") or manifest.get("task")
    return task if isinstance(task, str) else None


def _committed_counts(manifest: dict, shards: list[dict]) -> Counts:
    """Prompts and samples of the committed shards, out of every planned shard's prompts."""
    spec = manifest.get("spec") if isinstance(manifest.get("spec"), dict) else {}
    n = job_n(_task(manifest), _int((spec.get("sampling") or {}).get("n")))
    committed = [s for s in shards if s.get("status") == "committed"]
    return counts_of(sum(entry_prompts(s) for s in committed), sum(entry_prompts(s) for s in shards),
                     sum(entry_samples(s) for s in committed), n)


def _rows(shards: list[dict], counts: Counts) -> dict[str, Any]:
    """Output rows (samples: done counts an error row as its n) and the committed error rows and kinds."""
    committed = [s for s in shards if s.get("status") == "committed"]
    rows = sum(_int(s.get("rows")) for s in committed)
    errors = sum(_int(s.get("num_errors")) for s in committed)
    kinds: Counter = Counter()
    for shard in committed:
        kinds.update({str(k): _int(v) for k, v in (shard.get("error_kinds") or {}).items()})
    return {"done": counts.samples_done, "total": counts.samples_total, "errors": errors,
            "error_share": errors / rows if rows else None, "top_error_kinds": dict(kinds.most_common(TOP_ERROR_KINDS))}


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


def _speed(manifest: dict, counts: Counts, phase: str, now_s: float, live: dict | None = None) -> dict[str, Any]:
    """Tokens/s of the task's kind and prompts/s of this run while it runs (from the driver's heartbeat when
    it has one, measured to that heartbeat, with the ETA its log showed then, less the heartbeat's age; else
    from committed shards and this run's pace), else over the job's wall time."""
    current = _current_run(manifest)
    started_s = _epoch(current.get("started_at"))
    kind = live["tokens_kind"] if live else token_kind(_task(manifest))
    if phase == "running" and started_s is not None:
        until_s = (_epoch(live["at"]) if live else None) or now_s
        elapsed = max(until_s - started_s, 1e-6)
        prompts_now = counts.prompts_done - _prompts_at_start(manifest, counts)
        tokens_now = live["tokens_this_run"] if live else _tokens_total(manifest, kind) - _int(
            current.get("output_tokens_at_start" if kind == "out" else "prompt_tokens_at_start"))
        left = counts.prompts_total - counts.prompts_done
        if live and live["eta_s"] is not None:
            eta = max(live["eta_s"] - (live["age_s"] or 0.0), 0.0) if left > 0 else 0.0
        else:
            eta = eta_s(max(prompts_now, 0), left, elapsed)
        basis = "this run so far (the driver's count)" if live else "this run so far (committed shards)"
        # the driver's own tokens/s (its log's: over its last RATE_WINDOW_S) where its heartbeat has it
        window = live is not None and live["tokens_per_s"] is not None
        return {"basis": basis, "elapsed_s": round(elapsed, 1), "prompts_per_s": max(prompts_now, 0) / elapsed,
                "tokens_per_s": live["tokens_per_s"] if window else max(tokens_now, 0) / elapsed,
                "tokens_window_s": RATE_WINDOW_S if window else None, "tokens_kind": kind,
                "eta_s": None if eta is None else round(eta, 1)}
    wall = mv.number(manifest, "wall_s")
    if not wall:
        return {"basis": "unknown (no wall time recorded)", "elapsed_s": None, "prompts_per_s": None,
                "tokens_per_s": None, "tokens_window_s": None, "tokens_kind": kind, "eta_s": None}
    return {"basis": "whole job (its runs' wall time)", "elapsed_s": wall, "prompts_per_s": counts.prompts_done / wall,
            "tokens_per_s": _tokens_total(manifest, kind) / wall, "tokens_window_s": None, "tokens_kind": kind,
            "eta_s": 0.0 if counts.is_done else None}


def _prompts_at_start(manifest: dict, counts: Counts) -> int:
    """Prompts committed when this run started (`prompts_at_start`; from its rows at start, an older driver)."""
    current = _current_run(manifest)
    if "prompts_at_start" in current:
        return _int(current.get("prompts_at_start"))
    return _int(current.get("rows_at_start")) // max(counts.n, 1)


def _tokens_total(manifest: dict, kind: str = "out") -> int:
    """Committed output tokens ("out"), or prompt tokens ("in": embed / score)."""
    shards = [s for s in (manifest.get("shards") or {}).values() if isinstance(s, dict)]
    key = "num_output_tokens" if kind == "out" else "num_prompt_tokens"
    return sum(_int(s.get(key)) for s in shards if s.get("status") == "committed")


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
    ranks = {wid: found for wid, found in ((wid, rank_summary(w)) for wid, w in latest.items()) if found}
    return {"run_index": index, "count": max(len(ids), live_count or 0), "ids": ids, "live": live_count,
            "devices": dict(devices), "nodes": nodes, "recorded_all_runs": len(records), "ranks": ranks}


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
