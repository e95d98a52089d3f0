"""Where a run's start-up went, read from its manifest: planning and Ray's start (the driver), each worker's
placement, readiness and first output token (the driver's clock, from the worker's actor request), and the
stages of a worker's own load (driver/actor.startup_stages). Shared by the run summary and `report`."""

from __future__ import annotations

from typing import Any

# the worker's load stages in the order they happen, with the words a person reads
STAGE_NAMES = {
    "process": "process", "wait": "wait", "imports": "imports", "load": "load", "model_source": "model source",
    "config": "config", "build_model": "build", "load_weights": "weights", "quantize": "quantize",
    "pack_weights": "packing", "tokenizer": "tokenizer", "adapters": "adapters", "engine": "engine",
    "other": "other",
}
LOAD_MEMORY_KEYS = ("weights_bytes", "load_host_anon_rise_bytes", "load_device_peak_bytes")  # worker record
MIN_SHOWN_S = 0.05  # stages shorter than this are left out of the one-line summary


def last_startup(manifest: dict[str, Any] | None) -> dict[str, Any] | None:
    """The latest run's start-up: ``plan_s``, ``ray_start_s``, ``workers`` ({id: {placed_s, ready_s,
    first_token_s}}), plus ``first`` (the first worker to be ready) and its ``stages`` (seconds by load stage)
    from its worker record; None when no run recorded one."""
    runs = (manifest or {}).get("runs")
    if not isinstance(runs, list):
        return None
    found = next((r["startup"] for r in reversed(runs) if isinstance(r, dict) and isinstance(r.get("startup"),
                                                                                           dict)), None)
    if found is None:
        return None
    view = dict(found)
    seen = {k: v for k, v in (found.get("workers") or {}).items() if isinstance(v, dict)}
    ready = sorted((v["ready_s"], k) for k, v in seen.items() if isinstance(v.get("ready_s"), (int, float)))
    if ready:
        first = ready[0][1]
        record = ((manifest or {}).get("workers") or {}).get(first)
        stages = record.get("startup_stages_s") if isinstance(record, dict) else None
        view.update(first=first, stages=stages if isinstance(stages, dict) else {},
                    slowest_ready_s=ready[-1][0], num_ready=len(ready),
                    load_memory={k: v for k, v in (record or {}).items() if k in LOAD_MEMORY_KEYS})
    return view


def describe_load_memory(memory: dict[str, Any]) -> str:
    """'; weights 0.27 GB, load peak +0.26 GB host' (+ the device's peak on a GPU), or '' when not recorded."""
    if not isinstance(memory.get("weights_bytes"), int):
        return ""
    text = f"; weights {memory['weights_bytes'] / 1e9:.2f} GB"
    if isinstance(memory.get("load_host_anon_rise_bytes"), int):
        text += f", load peak +{memory['load_host_anon_rise_bytes'] / 1e9:.2f} GB host"
    if isinstance(memory.get("load_device_peak_bytes"), int):
        text += f", {memory['load_device_peak_bytes'] / 1e9:.2f} GB device"
    return text


def describe_stages(stages: dict[str, Any]) -> str:
    """'imports 4.1s, build 1.5s, weights 0.4s, ...' (stages under MIN_SHOWN_S left out)."""
    parts = [f"{STAGE_NAMES.get(k, k)} {v:.1f}s" for k, v in stages.items()
             if isinstance(v, (int, float)) and v >= MIN_SHOWN_S]
    return ", ".join(parts)


def describe_startup(view: dict[str, Any] | None) -> str | None:
    """One line: 'planning 0.7s, Ray start 5.6s; worker w0 placed 0.5s, ready 8.0s, first token 11.0s after it
    was asked for (imports 4.1s, ...)'; None when nothing was recorded (a run that started no worker)."""
    if not view:
        return None
    parts = [f"{label} {view[key]:.1f}s" for key, label in (("plan_s", "planning"), ("ray_start_s", "Ray start"))
             if isinstance(view.get(key), (int, float))]
    first = view.get("first")
    if first:
        seen = view["workers"][first]
        steps = [f"{label} {seen[key]:.1f}s" for key, label in
                 (("placed_s", "placed"), ("ready_s", "ready"), ("first_token_s", "first token"))
                 if isinstance(seen.get(key), (int, float))]
        text = f"worker {first} " + ", ".join(steps) + " after it was asked for"
        stages = describe_stages(view.get("stages") or {})
        text += f" (its load: {stages}{describe_load_memory(view.get('load_memory') or {})})" if stages else ""
        if view.get("num_ready", 1) > 1:
            text += f"; {view['num_ready']} workers ready, the last after {view['slowest_ready_s']:.1f}s"
        parts.append(text)
    return "; ".join(parts) or None
