"""Per-shape CPU GEMM rates of each linear path torch offers, for SmolLM2-135M's layer shapes.

Paths (float32): ``F.linear`` (MKL sgemm through addmm), ``mkl_packed`` (``torch.ops.mkl._mkl_linear`` on a
weight packed by ``_mkl_reorder_linear_weight``), ``onednn_packed`` (``torch.ops.mkldnn._linear_pointwise`` on
a weight reordered by ``mkldnn._reorder_linear_weight``); bf16: ``F.linear`` only where the CPU lacks
avx512bw/avx_ne_convert (oneDNN refuses to pack bf16 weights there). Calls of every path are interleaved one
by one and the best of N is kept: on a loaded machine the minimum is the least disturbed call.

    python scripts/gemm_paths.py [--threads 2] [--rows 1,16,64,256,2048] [--shapes qkv,o,gate_up,down,lm_head]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def paths(w: torch.Tensor, rows: int) -> dict:
    """name -> fn(x) for the float32 paths over weight ``w`` [out, in]."""
    mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
    dnn = torch.ops.mkldnn._reorder_linear_weight(w, rows)
    wb = w.bfloat16()
    out = {"F.linear": lambda x: F.linear(x, w),
           "mkl_packed": lambda x: torch.ops.mkl._mkl_linear(x, mkl, w, None, rows),
           "onednn_packed": lambda x: torch.ops.mkldnn._linear_pointwise(x, dnn, None, "none", [], ""),
           "bf16 F.linear": lambda x: F.linear(x.bfloat16(), wb)}
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        dnn_b = torch.ops.mkldnn._reorder_linear_weight(wb, rows)
        out["bf16 onednn_packed"] = lambda x: torch.ops.mkldnn._linear_pointwise(x.bfloat16(), dnn_b, None, "none",
                                                                                  [], "")
    return out


def measure(n: int, k: int, rows: int, budget_flop: float) -> dict[str, tuple[float, float]]:
    """name -> (best seconds, max relative error vs F.linear)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) * 0.05
    x = torch.randn(rows, k, generator=gen)
    fns = paths(w, rows)
    ref = F.linear(x, w)
    errors = {p: ((fn(x).float() - ref).abs().max() / ref.abs().max()).item() for p, fn in fns.items()}
    reps = int(max(7, min(400, budget_flop / (2 * rows * n * k))))
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(reps):
        for p, fn in fns.items():
            start = time.perf_counter()
            fn(x)
            best[p] = min(best[p], time.perf_counter() - start)
    return {p: (best[p], errors[p]) for p in fns}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,16,64,256,2048")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--budget-gflop", type=float, default=20.0, help="work per shape and path (sets repeats)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, capability {torch.backends.cpu.get_cpu_capability()}; best-of-N us "
          "(GFLOP/s), x = F.linear time / path time, err = max |diff| / max |ref|")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        for rows in (int(r) for r in args.rows.split(",")):
            res = measure(n, k, rows, args.budget_gflop * 1e9)
            base = res["F.linear"][0]
            flop = 2 * rows * n * k
            cells = [f"{p} {s * 1e6:.0f} ({flop / s / 1e9:.0f}) x{base / s:.2f} err {e:.0e}"
                     for p, (s, e) in res.items()]
            print(f"{name} {n}x{k} rows {rows}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
