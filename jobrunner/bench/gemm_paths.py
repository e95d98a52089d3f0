"""Per-shape GEMM rates of each CPU path (``jobrunner bench --gemm-paths``), for SmolLM2-135M's layers.

Paths: ``F.linear`` (torch: MKL's sgemm through addmm in float32, oneDNN in bfloat16), ``packed`` (ours, float32
only, :mod:`jobrunner.models.packed_linear`, built for this CPU whether or not its capability chooses it),
``onednn`` (``torch.ops.mkldnn._linear_pointwise`` on a weight reordered once by ``mkldnn._reorder_linear_weight``;
in bfloat16 on CPUs where oneDNN has bf16 kernels: avx512_bf16 / AMX), ``amx`` (ours, bf16 on AMX CPUs,
:mod:`jobrunner.models.amx_linear`; the engine takes it up to 128 rows). The calls of every path are interleaved one by
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
    """name -> fn(x) computing ``x @ weight.T`` for each path available here for ``weight``'s dtype."""
    from jobrunner.models.packed_linear import PackedLinear, packed_library

    paths: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"F.linear": lambda x: F.linear(x, weight)}
    lib = packed_library() if weight.dtype == torch.float32 else "float32 only"
    if not isinstance(lib, str):
        layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        layer.weight.data = weight
        paths["packed"] = PackedLinear(layer, lib)
    bf16_ok = weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if torch.backends.mkldnn.is_available() and bf16_ok:
        reordered = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        paths["onednn"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, reordered, None, "none", [], "")
    amx = _amx_path(weight)
    if amx is not None:
        paths["amx"] = amx
    return paths


def _amx_path(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Our AMX GEMM (:mod:`jobrunner.models.amx_linear`) for a bf16 weight, where this CPU runs it."""
    from jobrunner.models import amx_linear

    if weight.dtype != torch.bfloat16 or not amx_linear.amx_packable(*weight.shape):
        return None
    if torch.backends.cpu.get_cpu_capability().lower() != "avx512" or not torch.cpu._is_amx_tile_supported():
        return None
    if isinstance(amx_linear._library(), str):
        return None
    packed = amx_linear.amx_pack(weight)
    return lambda x: amx_linear.amx_linear(x, packed, None)


@torch.no_grad()
def measure_shape(out_features: int, in_features: int, rows: int, budget_flop: float = 3e9,
                  dtype: torch.dtype = torch.float32) -> dict[str, tuple[float, float]]:
    """name -> (best seconds per call, max |diff| / max |F.linear|) for one shape and row count."""
    gen = torch.Generator().manual_seed(rows + out_features)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(dtype)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    paths = gemm_paths(weight, rows)
    want = F.linear(x, weight).float()
    scale = want.abs().max().clamp_min(1e-30)
    errors = {name: ((fn(x).float() - want).abs().max() / scale).item() for name, fn in paths.items()}
    repeats = int(max(5, min(200, budget_flop / (2 * rows * out_features * in_features))))
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(repeats):
        for name, fn in paths.items():
            start = time.perf_counter()
            fn(x)
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: (best[name], errors[name]) for name in paths}


def gemm_table(row_counts: Sequence[int], shapes: Sequence[str] = tuple(SMOLLM2_SHAPES),
               dtype: torch.dtype = torch.float32) -> list[dict]:
    """One record per (shape, row count): each path's microseconds, GFLOP/s, speed-up over F.linear, error."""
    records = []
    for name in shapes:
        out_features, in_features = SMOLLM2_SHAPES[name]
        for rows in row_counts:
            flop = 2 * rows * out_features * in_features
            results = measure_shape(out_features, in_features, rows, dtype=dtype)
            base = results["F.linear"][0]
            records.append({"shape": name, "dtype": str(dtype).removeprefix("torch."), "out_features": out_features,
                            "in_features": in_features, "rows": rows,
                            "paths": {p: {"us": round(s * 1e6, 1), "gflop_s": round(flop / s / 1e9, 1),
                                          "speedup": round(base / s, 2), "rel_error": err}
                                      for p, (s, err) in results.items()}})
    return records


def render_gemm_table(records: list[dict]) -> list[str]:
    """A header line and one line per record."""
    from jobrunner.models.onednn_linear import onednn_bf16_choice
    from jobrunner.models.packed_linear import packed_gemm_choice

    dtype = records[0].get("dtype", "float32") if records else "float32"
    choice = onednn_bf16_choice() if dtype == "bfloat16" else packed_gemm_choice()
    lines = [f"{dtype}: torch {torch.__version__}, threads {torch.get_num_threads()}, cpu capability "
             f"{torch.backends.cpu.get_cpu_capability()}, engine: {choice[1]}; best-of-N us "
             "(GFLOP/s) x speed-up over F.linear"]
    for r in records:
        cells = " | ".join(f"{p} {v['us']:.0f} ({v['gflop_s']:.0f}) x{v['speedup']:.2f}" for p, v in r["paths"].items())
        lines.append(f"{r['shape']:13s} [{r['out_features']}x{r['in_features']}] rows {r['rows']:5d}: {cells}")
    return lines
