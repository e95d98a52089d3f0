"""Per-shape float32 GEMM rates of each CPU path (``jobrunner bench --gemm-paths``), for SmolLM2-135M's layers.

Paths: ``F.linear`` (torch: MKL's sgemm through addmm), ``packed`` (ours, :mod:`jobrunner.models.packed_linear`,
built for this CPU whether or not its capability chooses it), ``onednn`` (``torch.ops.mkldnn._linear_pointwise``
on a weight reordered once by ``mkldnn._reorder_linear_weight``). The calls of every path are interleaved one by
one and the best of N is kept: on a loaded machine the minimum is the least disturbed call. The relative
error against F.linear is reported too. What the engine runs is :func:`packed_gemm_choice`'s answer, from the
capability alone: this table is how that rule was checked on a machine, not an input to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from jobrunner.bench.quant_kernels import SMOLLM2_SHAPES


def gemm_paths(weight: torch.Tensor, rows: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """name -> fn(x) computing ``x @ weight.T`` for each float32 path available here."""
    from jobrunner.models.packed_linear import PackedLinear, packed_library

    paths: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"F.linear": lambda x: F.linear(x, weight)}
    lib = packed_library()
    if not isinstance(lib, str):
        layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        layer.weight.data = weight
        paths["packed"] = PackedLinear(layer, lib)
    if torch.backends.mkldnn.is_available():
        reordered = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        paths["onednn"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, reordered, None, "none", [], "")
    return paths


@torch.no_grad()
def measure_shape(out_features: int, in_features: int, rows: int, budget_flop: float = 3e9
                  ) -> dict[str, tuple[float, float]]:
    """name -> (best seconds per call, max |diff| / max |F.linear|) for one shape and row count."""
    gen = torch.Generator().manual_seed(rows + out_features)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    x = torch.randn(rows, in_features, generator=gen)
    paths = gemm_paths(weight, rows)
    want = F.linear(x, weight)
    scale = want.abs().max().clamp_min(1e-30)
    errors = {name: ((fn(x) - want).abs().max() / scale).item() for name, fn in paths.items()}
    repeats = int(max(5, min(200, budget_flop / (2 * rows * out_features * in_features))))
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(repeats):
        for name, fn in paths.items():
            start = time.perf_counter()
            fn(x)
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: (best[name], errors[name]) for name in paths}


def gemm_table(row_counts: Sequence[int], shapes: Sequence[str] = tuple(SMOLLM2_SHAPES)) -> list[dict]:
    """One record per (shape, row count): each path's microseconds, GFLOP/s, speed-up over F.linear, error."""
    records = []
    for name in shapes:
        out_features, in_features = SMOLLM2_SHAPES[name]
        for rows in row_counts:
            flop = 2 * rows * out_features * in_features
            results = measure_shape(out_features, in_features, rows)
            base = results["F.linear"][0]
            records.append({"shape": name, "out_features": out_features, "in_features": in_features, "rows": rows,
                            "paths": {p: {"us": round(s * 1e6, 1), "gflop_s": round(flop / s / 1e9, 1),
                                          "speedup": round(base / s, 2), "rel_error": err}
                                      for p, (s, err) in results.items()}})
    return records


def render_gemm_table(records: list[dict]) -> list[str]:
    """A header line and one line per record."""
    from jobrunner.models.packed_linear import packed_gemm_choice

    lines = [f"torch {torch.__version__}, threads {torch.get_num_threads()}, cpu capability "
             f"{torch.backends.cpu.get_cpu_capability()}, engine: {packed_gemm_choice()[1]}; best-of-N us "
             "(GFLOP/s) x speed-up over F.linear"]
    for r in records:
        cells = " | ".join(f"{p} {v['us']:.0f} ({v['gflop_s']:.0f}) x{v['speedup']:.2f}" for p, v in r["paths"].items())
        lines.append(f"{r['shape']:13s} [{r['out_features']}x{r['in_features']}] rows {r['rows']:5d}: {cells}")
    return lines
