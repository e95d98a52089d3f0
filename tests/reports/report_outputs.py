"""Realistic job output dirs for report tests, written with pyarrow to docs/contracts.md (like the driver)."""

from __future__ import annotations

import json
import posixpath

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA = pa.schema([
    ("id", pa.string()), ("generated_text", pa.string()), ("finish_reason", pa.string()),
    ("error", pa.string()), ("num_prompt_tokens", pa.int64()), ("num_cached_tokens", pa.int64()),
    ("num_output_tokens", pa.int64()), ("ttft_s", pa.float64()), ("itl_mean_s", pa.float64()),
    ("e2e_s", pa.float64()), ("queue_s", pa.float64()), ("shard_id", pa.string()),
    ("worker_id", pa.string()), ("finish_time_s", pa.float64()), ("topic", pa.string()),
])


def make_rows(num_rows: int, shard_id: str, worker_id: str, seed: int = 0, speed: float = 1.0,
              error_every: int = 0, text_chars: int = 40) -> dict[str, list]:
    """Plausible engine rows: latencies scale with 1/speed, every `error_every`-th row failed."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(20, 200, num_rows)
    cached = np.minimum(prompt, rng.integers(0, 2, num_rows) * 16)
    output = rng.integers(8, 64, num_rows)
    queue = rng.exponential(0.05, num_rows) / speed
    ttft = queue + rng.gamma(2.0, 0.02, num_rows) / speed
    itl = rng.gamma(4.0, 0.005, num_rows) / speed
    e2e = ttft + itl * (output - 1)
    finish = np.cumsum(rng.exponential(0.02, num_rows) / speed) + e2e
    failed = np.zeros(num_rows, bool) if not error_every else (np.arange(num_rows) % error_every == 1)
    return {
        "id": [f"{shard_id}:{i}" for i in range(num_rows)],
        "generated_text": [None if f else "x" * text_chars for f in failed],
        "finish_reason": ["error" if f else ("length" if o == 63 else "stop")
                          for f, o in zip(failed, output, strict=True)],
        "error": [f"prompt too long: {p + 4000} > 2048 tokens" if f else None
                  for f, p in zip(failed, prompt, strict=True)],
        "num_prompt_tokens": prompt.tolist(),
        "num_cached_tokens": np.where(failed, 0, cached).tolist(),
        "num_output_tokens": np.where(failed, 0, output).tolist(),
        **{name: [None if f else float(v) for f, v in zip(failed, values, strict=True)]
           for name, values in (("ttft_s", ttft), ("itl_mean_s", itl), ("e2e_s", e2e), ("queue_s", queue))},
        "shard_id": [shard_id] * num_rows,
        "worker_id": [worker_id] * num_rows,
        "finish_time_s": finish.tolist(),
        "topic": ["math"] * num_rows,
    }


def make_manifest(shard_rows: dict[str, dict], wall_s: float, quantization: str = "none",
                  job_name: str = "example", worker_hour_usd: float | None = 0.10,
                  spec_cost: dict | None = None) -> dict:
    """A manifest per the contract for the given shard_id -> rows (one worker per shard)."""
    shards, workers = {}, {}
    for shard_id, rows in shard_rows.items():
        worker_id = rows["worker_id"][0]
        n = len(rows["id"])
        shards[shard_id] = {"status": "committed", "file": "prompts.parquet", "row_start": 0, "row_end": n,
                            "rows": n, "num_errors": sum(e is not None for e in rows["error"]),
                            "num_prompt_tokens": sum(rows["num_prompt_tokens"]),
                            "num_cached_tokens": sum(rows["num_cached_tokens"]),
                            "num_output_tokens": sum(rows["num_output_tokens"]), "worker_id": worker_id,
                            "attempts": 1, "seconds": wall_s * 0.9, "error": None,
                            "part": f"parts/part-{shard_id}.parquet"}
        workers[worker_id] = {"node": "node-1", "device": "cpu", "alive_s": wall_s, "prefill_s": wall_s * 0.3,
                              "decode_s": wall_s * 0.6, "steps": 100, "num_prefill_tokens": 0,
                              "num_decode_tokens": 0}
    keys = ("rows", "num_errors", "num_prompt_tokens", "num_cached_tokens", "num_output_tokens")
    totals = {key: sum(s[key] for s in shards.values()) for key in keys}
    totals.update(worker_seconds=wall_s * len(workers), shards_committed=len(shards), shards_failed=0)
    return {
        "format_version": 1, "jobrunner_version": "0.1.0", "job_name": job_name,
        "spec": {"name": job_name, **({"cost": spec_cost} if spec_cost else {})},
        "model": {"source": "smollm2-135m-instruct", "dtype": "float32", "quantization": quantization,
                  "architecture": "LlamaForCausalLM"},
        "versions": {"python": "3.11"}, "cost": {"worker_hour_usd": worker_hour_usd},
        "started_at": "2026-11-30T03:00:00+00:00", "finished_at": "2026-11-30T03:01:00+00:00",
        "wall_s": wall_s, "shards": shards, "workers": workers, "totals": totals,
    }


def write_outputs(url: str, shard_rows: dict[str, dict], manifest: dict | None,
                  storage_options: dict | None = None, row_group_rows: int = 10_000,
                  success: bool = True) -> str:
    """Write parts (+ manifest, + _SUCCESS) under `url` like the driver does; return `url`."""
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    fs.makedirs(posixpath.join(root, "parts"), exist_ok=True)
    for shard_id, rows in shard_rows.items():
        table = pa.Table.from_pydict(rows, schema=SCHEMA)
        with fs.open(posixpath.join(root, f"parts/part-{shard_id}.parquet"), "wb") as fh:
            pq.write_table(table, fh, row_group_size=row_group_rows)
    if manifest is not None:
        fs.pipe_file(posixpath.join(root, "_manifest.json"), json.dumps(manifest).encode())
    if success:
        fs.pipe_file(posixpath.join(root, "_SUCCESS"), b"")
    return url


def write_job(url: str, rows_per_shard: int = 500, shards: int = 2, speed: float = 1.0,
              quantization: str = "none", job_name: str = "example", error_every: int = 0,
              storage_options: dict | None = None, **manifest_kw) -> str:
    """A whole realistic job output under `url`."""
    shard_rows = {f"s{i:03d}": make_rows(rows_per_shard, f"s{i:03d}", f"w{i}", seed=i, speed=speed,
                                         error_every=error_every) for i in range(shards)}
    wall = max(max(r["finish_time_s"]) for r in shard_rows.values()) + 1.0
    manifest = make_manifest(shard_rows, wall, quantization, job_name, **manifest_kw)
    return write_outputs(url, shard_rows, manifest, storage_options)
