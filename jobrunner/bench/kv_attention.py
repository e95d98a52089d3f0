"""Decode attention over a long context per KV-cache dtype and CPU route (``jobrunner bench --kv-attention``).

Each case attends ``rows`` decode rows of ``context`` keys each (their own blocks, shuffled through the pool as
after some churn) with SmolLM2-135M's head shape (9 query heads, 3 kv heads, head_dim 64). ``layers`` caches are
attended one after the other, as a step's layers are (one layer's cache alone can sit in a large last-level
cache; a model's do not); times are per layer, the best of ``rounds`` passes, the cases taking turns round after
round (a busy machine slows them all alike, and only adds time). Routes: ``cpu_paged`` (the native kernel),
``cpu_paged+amx`` (its AMX decode kernel, the default for bf16 caches on AMX CPUs; bf16 caches only) and
``torch`` (gather + SDPA). Cache dtypes: the model's (``auto``) and the fp8 formats of ``engine.kv_cache_dtype``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from jobrunner.attention import StepLayout, StepUpload, make_backend
from jobrunner.attention.kv_quant import FP8_DTYPES, cache_dtype, row_width, write_fp8_kv

CPU = torch.device("cpu")
ROUTES = ("cpu_paged+amx", "cpu_paged", "torch")
KV_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class KVShape:
    """The attention shape measured: heads, kv heads, head size, block size, layers attended in turn."""

    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16
    layers: int = 24


def decode_layout(seq_lens: Sequence[int], block_size: int, num_blocks: int, rng: random.Random
                  ) -> tuple[StepLayout, list[int]]:
    """One decode row per sequence length (its last position), each over its own blocks drawn from a pool of
    ``num_blocks`` shuffled by ``rng`` (as after some churn); the layout and the new tokens' cache slots."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    layout = StepLayout([], [], [], [], 0, block_size)
    slots = []
    for seq_len in seq_lens:
        table = [free.pop() for _ in range(-(-seq_len // block_size))]
        layout.query_starts.append(layout.num_tokens)
        layout.query_lens.append(1)
        layout.seq_lens.append(seq_len)
        layout.block_tables.append(table)
        layout.num_tokens += 1
        position = seq_len - 1
        slots.append(table[position // block_size] * block_size + position % block_size)
    return layout, slots


def _layout(rows: int, context: int, block_size: int, seed: int = 0) -> tuple[StepLayout, list[int], int]:
    """``rows`` decodes at position ``context - 1``; their slots; the pool's block count."""
    num_blocks = rows * -(-context // block_size) + 1
    layout, slots = decode_layout([context] * rows, block_size, num_blocks, random.Random(seed))
    return layout, slots, num_blocks


def _cache(num_slots: int, shape: KVShape, model_dtype: torch.dtype, kv: str, seed: int) -> torch.Tensor:
    """``[2, slots, kv_heads, width]`` filled with random keys and values (quantized for fp8)."""
    dtype = cache_dtype(kv, model_dtype)
    cache = torch.empty(2, num_slots, shape.kv_heads, row_width(shape.head_dim, dtype), dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    chunk = 1 << 16
    for start in range(0, num_slots, chunk):
        rows = torch.randn(2, min(chunk, num_slots - start), shape.kv_heads, shape.head_dim, generator=gen)
        every = torch.arange(start, start + rows.shape[1])
        if kv in FP8_DTYPES:
            write_fp8_kv(rows[0], rows[1], cache[0], cache[1], every)
        else:
            cache[:, start:start + rows.shape[1]] = rows.to(dtype)
    return cache


class KVCase:
    """One (route, cache dtype, row count): its backend, step metadata, inputs and caches, built once."""

    def __init__(self, route: str, kv: str, rows: int, context: int, model_dtype: torch.dtype,
                 shape: KVShape) -> None:
        self.route, self.kv, self.rows, self.context = route, kv, rows, context
        self.scale = shape.head_dim ** -0.5
        layout, slots, num_blocks = _layout(rows, context, shape.block_size)
        name = route.split("+")[0]
        self.backend = make_backend(name, shape.heads, shape.kv_heads, shape.block_size, CPU,
                                    head_dim=shape.head_dim, dtype=model_dtype,
                                    cache_dtype=cache_dtype(kv, model_dtype))
        if name == "cpu_paged" and "+amx" not in route:
            self.backend.amx, self.backend.amx_decode = None, ""  # the native kernel itself, whatever the CPU
        self.skipped = ("no AMX decode route on this CPU" if "+amx" in route and not self.backend.amx_decode
                        else None)
        self.caches = [] if self.skipped else [
            _cache(num_blocks * shape.block_size, shape, model_dtype, kv, seed=layer) for layer in range(shape.layers)]
        gen = torch.Generator().manual_seed(1)
        self.q = torch.randn(rows, shape.heads, shape.head_dim, generator=gen).to(model_dtype)
        self.k, self.v = (torch.randn(rows, shape.kv_heads, shape.head_dim, generator=gen).to(model_dtype)
                          for _ in range(2))
        upload = StepUpload(CPU)
        upload.add("slot_mapping", slots)
        self.meta = self.backend.build(layout, upload)
        self.best_s = float("inf")
        dtype = cache_dtype(kv, model_dtype)
        self.kv_bytes = 2 * rows * context * shape.kv_heads * row_width(shape.head_dim, dtype) * dtype.itemsize

    def time_pass(self) -> None:
        """One step's worth: every layer's attention in turn; keeps the best per-layer time."""
        start = time.perf_counter()
        for cache in self.caches:
            self.backend.forward(self.q, self.k, self.v, cache[0], cache[1], self.meta, self.scale)
        self.best_s = min(self.best_s, (time.perf_counter() - start) / len(self.caches))

    def record(self) -> dict:
        """The case's result: microseconds per layer, MiB of K/V read per layer and the rate, or why it was
        skipped."""
        base = {"route": self.route, "kv_cache_dtype": self.kv, "rows": self.rows, "context": self.context}
        if self.skipped:
            return {**base, "skipped": self.skipped}
        return {**base, "us": round(self.best_s * 1e6, 1), "kv_mib_read": round(self.kv_bytes / 2**20, 1),
                "gib_per_s": round(self.kv_bytes / self.best_s / 2**30, 2)}


def kv_attention_table(context: int, row_counts: Sequence[int], model_dtype: torch.dtype = torch.bfloat16,
                       routes: Sequence[str] = ROUTES, kv_dtypes: Sequence[str] = KV_DTYPES,
                       shape: KVShape = KVShape(), rounds: int = 5) -> list[dict]:
    """One record per (row count, route, cache dtype); the AMX route only over the model dtype's cache."""
    records = []
    for rows in row_counts:
        cases = [KVCase(route, kv, rows, context, model_dtype, shape) for route in routes for kv in kv_dtypes
                 if "+amx" not in route or kv == "auto"]
        for _ in range(rounds):
            for case in cases:
                if not case.skipped:
                    case.time_pass()
        records += [case.record() for case in cases]
        del cases  # one row count's caches at a time
    return records


def render_kv_attention(records: list[dict], model_dtype: torch.dtype, shape: KVShape) -> list[str]:
    """A header line and one line per record."""
    lines = [f"decode attention per layer: {str(model_dtype).removeprefix('torch.')} model, {shape.heads} heads / "
             f"{shape.kv_heads} kv heads x {shape.head_dim}, {shape.layers} layers' caches in turn, threads "
             f"{torch.get_num_threads()}; best of N"]
    for r in records:
        head = f"rows {r['rows']:4d} x {r['context']} keys  {r['route']:14s} {r['kv_cache_dtype']:9s}"
        if "skipped" in r:
            lines.append(f"{head} skipped: {r['skipped']}")
        else:
            lines.append(f"{head} {r['us']:9.1f} us  {r['kv_mib_read']:8.1f} MiB  {r['gib_per_s']:6.2f} GiB/s")
    return lines
