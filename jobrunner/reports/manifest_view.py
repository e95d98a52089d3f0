"""Read the figures a report needs out of a `_manifest.json` dict, tolerating missing or odd fields."""

from __future__ import annotations

import math
from typing import Any


def number(mapping: Any, *keys: str) -> float | None:
    """mapping[k1][k2]... as a finite float, or None if absent, not a number, or not finite."""
    value = mapping
    for key in keys:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def workers(manifest: dict | None) -> dict[str, dict]:
    """The manifest's workers that are dicts (worker_id -> record)."""
    found = (manifest or {}).get("workers")
    if not isinstance(found, dict):
        return {}
    return {str(k): v for k, v in found.items() if isinstance(v, dict)}


def worker_seconds(manifest: dict | None) -> float | None:
    """totals.worker_seconds (start-up included), else the sum of workers' startup_s + alive_s; None when
    neither is recorded."""
    total = number(manifest, "totals", "worker_seconds")
    if total is not None and total > 0:
        return total
    records = workers(manifest).values()
    alive = sum((number(w, "alive_s") or 0.0) + (number(w, "startup_s") or 0.0) for w in records)
    return alive if alive > 0 else None


def startup_seconds(manifest: dict | None) -> float | None:
    """Worker-seconds spent starting actors and loading models (part of worker_seconds); None if unknown."""
    total = number(manifest, "totals", "startup_seconds")
    if total is not None:
        return total
    values = [number(w, "startup_s") for w in workers(manifest).values()]
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def num_runs(manifest: dict | None) -> int | None:
    """How many runs the manifest records (interrupted and killed ones included); None without runs."""
    runs = (manifest or {}).get("runs")
    return len(runs) if isinstance(runs, list) and runs else None


def run_costs(manifest: dict | None) -> list[dict]:
    """Per run: index, status, wall time, worker-seconds, of which start-up and work later redone or lost
    (runs written before run records say nothing of their workers: None there)."""
    runs = (manifest or {}).get("runs")
    keys = ("wall_s", "worker_seconds", "startup_seconds", "lost_worker_seconds")
    return [{"run_index": r.get("run_index", i), "status": text(r, "status"), "started_at": text(r, "started_at"),
             **{k: number(r, k) for k in keys}}
            for i, r in enumerate(runs if isinstance(runs, list) else []) if isinstance(r, dict)]


def engine_seconds(manifest: dict | None) -> tuple[float, float]:
    """(sum of workers' prefill_s, sum of decode_s) from the engine's own per-step accounting."""
    records = workers(manifest).values()
    prefill = sum(number(w, "prefill_s") or 0.0 for w in records)
    decode = sum(number(w, "decode_s") or 0.0 for w in records)
    return prefill, decode


def spec_section(manifest: dict | None, name: str) -> dict:
    """The manifest's spec section ``name`` (e.g. "sampling"), or {}."""
    spec = manifest.get("spec") if isinstance(manifest, dict) else None
    section = spec.get(name) if isinstance(spec, dict) else None
    return section if isinstance(section, dict) else {}


def spent_usd(manifest: dict | None) -> float | None:
    """What the workers counted at the token prices (their `cost_usd`: engine.backend openai), summed; None
    when no worker counted it."""
    values = [number(w, "cost_usd") for w in workers(manifest).values()]
    values = [v for v in values if v is not None]
    return sum(values) if values else None


def spec_cost(manifest: dict | None) -> dict:
    """`spec.cost` of the job spec as recorded in the manifest ({} if absent)."""
    spec = (manifest or {}).get("spec")
    cost = spec.get("cost") if isinstance(spec, dict) else None
    return cost if isinstance(cost, dict) else {}


def price_and_source(manifest: dict | None, cli_price: float | None) -> tuple[float | None, str]:
    """Worker-hour price: the command line first, then the spec's cost, then the manifest's cost block.

    A price of 0 is the spec's "not set" default, so it counts as no price (no "$0.00 per M tokens")."""
    candidates = ((cli_price, "command line"), (number(spec_cost(manifest), "worker_hour_usd"), "job spec"),
                  (number(manifest, "cost", "worker_hour_usd"), "manifest"))
    for price, source in candidates:
        if price is not None and price > 0:
            return price, source
    return None, "none"


def model_info(manifest: dict | None) -> dict:
    """source, dtype (and why: dtype_reason), quantization, architecture of the model (None where unknown), and
    the engine that ran it: ``engine`` 'jobrunner' (outputs written before other backends say nothing) or
    'vllm 0.32.0'."""
    model = (manifest or {}).get("model")
    model = model if isinstance(model, dict) else {}
    info = {key: text(model, key) for key in ("source", "dtype", "dtype_reason", "quantization", "architecture")}
    backend = text(model, "backend") or "jobrunner"
    version = text(model, "vllm_version") if backend == "vllm" else None
    info["engine"] = f"{backend} {version}" if version else backend
    return info


def task_info(manifest: dict | None) -> dict:
    """The job's task (generate for outputs written before embed / score jobs), its pooling and embedding size
    or label names (the manifest's model section, driver/pooled.py)."""
    manifest = manifest or {}
    model = manifest.get("model") if isinstance(manifest.get("model"), dict) else {}
    labels = model.get("labels")
    return {"task": text(manifest, "task") or "generate", "kind": text(model, "task"),
            "pooling": text(model, "pooling"), "normalize": model.get("normalize") if model.get("task") else None,
            "embedding_dim": number(model, "embedding_dim"),
            "labels": [str(x) for x in labels] if isinstance(labels, list) else None}


def text(mapping: Any, key: str) -> str | None:
    """mapping[key] if it is a non-empty string, else None."""
    value = mapping.get(key) if isinstance(mapping, dict) else None
    return value if isinstance(value, str) and value else None


def shard_counts(manifest: dict | None) -> dict[str, int]:
    """status -> number of shards (format 3: the shard table's counts, which the report reader refreshes
    with the commit records; formats 1-2: counted over the manifest's shard entries)."""
    table = (manifest or {}).get("shard_table")
    if isinstance(table, dict) and isinstance(table.get("status_counts"), dict):
        return {str(k): int(v) for k, v in table["status_counts"].items() if isinstance(v, int) and v > 0}
    shards = (manifest or {}).get("shards")
    counts: dict[str, int] = {}
    for shard in (shards.values() if isinstance(shards, dict) else []):
        status = shard.get("status", "unknown") if isinstance(shard, dict) else "unknown"
        counts[str(status)] = counts.get(str(status), 0) + 1
    return counts


def hardware(manifest: dict | None) -> dict:
    """What the workers ran on (from their manifest entries): CPU model(s), GPU name -> count, totals.

    GPUs are counted once per (node, device) a worker used; CPU-only workers count no GPU."""
    records = workers(manifest).values()
    cpus = sorted({w["cpu_model"] for w in records if text(w, "cpu_model")})
    gpu_to_count: dict[str, int] = {}
    seen = set()
    for w in records:
        name, device = text(w, "gpu_name"), str(w.get("device") or "")
        key = (w.get("node_id") or w.get("node"), device)
        if name and device.startswith("cuda") and key not in seen:
            seen.add(key)
            gpu_to_count[name] = gpu_to_count.get(name, 0) + 1
    devices = sorted({str(w.get("device")) for w in records if w.get("device")})
    return {"cpu_models": cpus, "gpus": gpu_to_count, "num_gpus": sum(gpu_to_count.values()),
            "devices": devices, "summary": _hardware_summary(cpus, gpu_to_count, devices)}


def _hardware_summary(cpus: list[str], gpus: dict[str, int], devices: list[str]) -> str | None:
    if gpus:
        return ", ".join(f"{n} x {name}" for name, n in sorted(gpus.items()))
    if cpus:
        return " + ".join(cpus) + " (CPU)"
    return ", ".join(devices) or None
