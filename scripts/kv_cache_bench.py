"""Decode attention of one layer over a long context, per KV-cache dtype and attention route, on this CPU.

Each configuration attends ``--rows`` decode rows of ``--context`` keys each (their own blocks, shuffled through
the pool, as after some churn) with the SmolLM2-135M head shape (9 query heads, 3 kv heads, head_dim 64) by
default. ``--layers`` caches are attended one after the other, as a step's layers are (one layer's cache alone
can sit in a large last-level cache; a model's do not), and the best of ``--repeats`` such passes is kept (a busy
machine only adds time; the cases take turns, round after round); times are per layer. Routes: ``cpu_paged`` (the
native kernel; bf16 on AMX CPUs also as ``cpu_paged+amx``, its default there), ``torch`` (gather + SDPA).
Cache dtypes: the model dtype (``auto``) and the fp8 formats of ``engine.kv_cache_dtype``.

    PYTHONPATH=. python scripts/kv_cache_bench.py --threads 2 --context 2048 --rows 32 --layers 30
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from jobrunner.attention import StepLayout, StepUpload, make_backend
from jobrunner.attention.kv_quant import FP8_DTYPES, cache_dtype, row_width, write_fp8_kv

CPU = torch.device("cpu")


def _layout(rows: int, context: int, block_size: int, seed: int = 0) -> tuple[StepLayout, list[int], int]:
    """``rows`` decodes at position ``context - 1`` over shuffled blocks; their slots; the pool's block count."""
    per_row = -(-context // block_size)
    num_blocks = rows * per_row + 1
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    layout = StepLayout([], [], [], [], 0, block_size)
    slots = []
    for i in range(rows):
        table = [free.pop() for _ in range(per_row)]
        layout.query_starts.append(i)
        layout.query_lens.append(1)
        layout.seq_lens.append(context)
        layout.block_tables.append(table)
        layout.num_tokens += 1
        p = context - 1
        slots.append(table[p // block_size] * block_size + p % block_size)
    return layout, slots, num_blocks


def _cache(num_slots: int, kv_heads: int, head_dim: int, model_dtype: torch.dtype, kv: str) -> torch.Tensor:
    """``[2, slots, kv_heads, width]`` filled with random keys and values (quantized for fp8)."""
    dtype = cache_dtype(kv, model_dtype)
    cache = torch.empty(2, num_slots, kv_heads, row_width(head_dim, dtype), dtype=dtype)
    chunk = 1 << 16
    for start in range(0, num_slots, chunk):
        rows = torch.randn(2, min(chunk, num_slots - start), kv_heads, head_dim)
        every = torch.arange(start, start + rows.shape[1])
        if kv in FP8_DTYPES:
            write_fp8_kv(rows[0], rows[1], cache[0], cache[1], every)
        else:
            cache[:, start:start + rows.shape[1]] = rows.to(dtype)
    return cache


def _backend(route: str, heads: int, kv_heads: int, head_dim: int, block_size: int, model_dtype, kv: str):
    name = route.split("+")[0]
    backend = make_backend(name, heads, kv_heads, block_size, CPU, head_dim=head_dim, dtype=model_dtype,
                           cache_dtype=cache_dtype(kv, model_dtype))
    if name == "cpu_paged" and "+amx" not in route:
        backend.amx, backend.amx_decode = None, ""  # the native kernel itself, whatever the CPU
    return backend


class Case:
    """One (route, cache dtype): its backend, step metadata, inputs and ``--layers`` caches, built once."""

    def __init__(self, route: str, kv: str, args: argparse.Namespace) -> None:
        model_dtype = getattr(torch, args.dtype)
        layout, slots, num_blocks = _layout(args.rows, args.context, args.block_size)
        self.route, self.kv, self.scale = route, kv, args.head_dim ** -0.5
        self.backend = _backend(route, args.heads, args.kv_heads, args.head_dim, args.block_size, model_dtype, kv)
        self.skipped = "+amx" in route and not self.backend.amx_decode
        self.caches = [] if self.skipped else [
            _cache(num_blocks * args.block_size, args.kv_heads, args.head_dim, model_dtype, kv)
            for _ in range(args.layers)]
        gen = torch.Generator().manual_seed(1)
        self.q = torch.randn(args.rows, args.heads, args.head_dim, generator=gen).to(model_dtype)
        self.k, self.v = (torch.randn(args.rows, args.kv_heads, args.head_dim, generator=gen).to(model_dtype)
                          for _ in range(2))
        upload = StepUpload(CPU)
        upload.add("slot_mapping", slots)
        self.meta = self.backend.build(layout, upload)
        self.best = float("inf")
        width = row_width(args.head_dim, cache_dtype(kv, model_dtype))
        self.kv_bytes = 2 * args.rows * args.context * args.kv_heads * width * cache_dtype(kv, model_dtype).itemsize

    def time_pass(self) -> None:
        """One step's worth: every layer's attention in turn; keeps the best per-layer time."""
        start = time.perf_counter()
        for cache in self.caches:
            self.backend.forward(self.q, self.k, self.v, cache[0], cache[1], self.meta, self.scale)
        self.best = min(self.best, (time.perf_counter() - start) / len(self.caches))

    def result(self) -> dict:
        if self.skipped:
            return {"route": self.route, "kv_cache_dtype": self.kv, "skipped": "no AMX decode route on this CPU"}
        return {"route": self.route, "kv_cache_dtype": self.kv, "ms": round(self.best * 1e3, 3),
                "kv_mib_read": round(self.kv_bytes / 2**20, 1),
                "gib_per_s": round(self.kv_bytes / self.best / 2**30, 2)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layers", type=int, default=16, help="caches attended in turn (their total past the LLC)")
    p.add_argument("--routes", default="cpu_paged+amx,cpu_paged,torch")
    p.add_argument("--kv", default="auto,fp8_e4m3,fp8_e5m2", help="comma list of engine.kv_cache_dtype values")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cases = [Case(route, kv, args) for route in args.routes.split(",") for kv in args.kv.split(",")
             if "+amx" not in route or kv == "auto"]  # the AMX kernels read bf16 caches only
    for _ in range(args.repeats):  # rounds over every case in turn: a noisy neighbour slows them all alike
        for case in cases:
            if not case.skipped:
                case.time_pass()
    for case in cases:
        print(json.dumps(case.result()), flush=True)


if __name__ == "__main__":
    main()
