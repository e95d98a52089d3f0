"""Which int8 GEMM torch reaches fastest on this CPU: one linear layer per SmolLM2-135M shape, microseconds.

Candidates (each includes its own activation handling, so the numbers compare whole layer calls):

* ``f32`` / ``bf16``: dense ``F.linear`` (the float baselines);
* ``w8a16_pack``: ``aten._weight_int8pack_mm`` (weight-only int8, bf16 activations; what int8 runs today);
* ``w8a8_int_mm``: per-token int8 activations, ``torch._int_mm`` (int32 out), scaled afterwards;
* ``w8a8_onednn``: per-token int8 activations, ``onednn.qlinear_pointwise`` on a prepacked weight with
  ``x_scale=1`` (the kernel applies the weight's per-channel scales, the per-token scales are applied to its
  float output: exact, since the output is linear in each row);
* ``dyn_fbgemm`` / ``dyn_onednn`` / ``dyn_x86``: ``quantized.linear_dynamic`` (per-tensor dynamic activations);
* ``w4a16_pack``: ``_weight_int4pack_mm_for_cpu`` (int4 weight-only, group 32, bf16 activations);
* ``w8a8_compiled``: ``w8a8_onednn`` with the activation quantization compiled (``--compile``; slow to build).

``python scripts/cpu_int8_gemm_bench.py --tokens 1,8,64,256 --threads 2`` (prefix the AVX2 caps of
``jobrunner.quant.bench_dispatch.AVX2_ENV`` to see AVX2's kernels).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


def best_us(fn: Callable[[], object], repeats: int, budget_s: float = 1.0) -> float:
    """Best wall time of ``fn`` in microseconds (after two warm-up calls)."""
    fn()
    fn()
    best, start = float("inf"), time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return best * 1e6


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-token int8 codes and scales of ``x`` [M, K]."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
    return torch.round(xf / scale).clamp_(-127, 127).to(torch.int8), scale


def candidates(n: int, k: int, m: int, compile_quant: bool) -> dict[str, Callable[[], object]]:
    """Each candidate as a closure over its prepared weight and a fresh [m, k] input."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) * 0.05
    x = torch.randn(m, k, generator=gen)
    sw = w.abs().amax(1) / 127
    qw = torch.round(w / sw[:, None]).clamp(-127, 127).to(torch.int8)
    wb, xb = w.bfloat16(), x.bfloat16()
    qw_t = qw.t().contiguous()
    packed = torch.ops.onednn.qlinear_prepack(qw, [m, k])
    zps = torch.zeros(n, dtype=torch.int64)
    swb = sw.bfloat16()

    def onednn(xq: torch.Tensor, sx: torch.Tensor) -> torch.Tensor:
        y = torch.ops.onednn.qlinear_pointwise(xq, 1.0, 0, packed, sw, zps, None, 1.0, 0, torch.float32,
                                               "none", [], "")
        return y.mul_(sx)

    out = {
        "f32": lambda: torch.nn.functional.linear(x, w),
        "bf16": lambda: torch.nn.functional.linear(xb, wb),
        "w8a16_pack": lambda: torch.ops.aten._weight_int8pack_mm(xb, qw, swb),
        "w8a8_int_mm": lambda: _int_mm_path(x, qw_t, sw),
        "w8a8_onednn": lambda: onednn(*quant_rows(x)),
        "w8a8_onednn_bf16in": lambda: onednn(*quant_rows(xb)),
    }
    for engine in ("fbgemm", "onednn", "x86"):
        out[f"dyn_{engine}"] = _dynamic(engine, w, x)
    if n % 16 == 0:
        out["w4a16_pack"] = _int4(w, xb)
    if compile_quant:
        qfn = torch.compile(quant_rows, dynamic=False)
        out["w8a8_compiled"] = lambda: onednn(*qfn(x))
    return out


def _int_mm_path(x: torch.Tensor, qw_t: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    xq, sx = quant_rows(x)
    return torch._int_mm(xq, qw_t).float().mul_(sx).mul_(sw)


def _dynamic(engine: str, w: torch.Tensor, x: torch.Tensor) -> Callable[[], object]:
    torch.backends.quantized.engine = engine
    sw = w.abs().amax(1) / 127
    qw = torch.quantize_per_channel(w, sw.double(), torch.zeros(w.shape[0], dtype=torch.int64), 0, torch.qint8)
    pack = torch.ops.quantized.linear_prepack(qw, None)

    def run() -> torch.Tensor:
        torch.backends.quantized.engine = engine
        return torch.ops.quantized.linear_dynamic(x, pack, False)

    return run


def _int4(w: torch.Tensor, xb: torch.Tensor) -> Callable[[], object]:
    n, k = w.shape
    g = w.reshape(n, k // 32, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).reshape(n, k).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    sz = torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous().bfloat16()
    return lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, 32, sz)


def main() -> None:
    """Command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8,64,256")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--compile", action="store_true", help="add the torch.compile'd activation quant")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        for m in (int(t) for t in args.tokens.split(",")):
            times = {name: round(best_us(fn, args.repeats), 1)
                     for name, fn in candidates(n, k, m, args.compile).items()}
            rows.append({"shape": shape, "n": n, "k": k, "tokens": m, "us": times})
            base = min(times["f32"], times["bf16"])
            print(f"{shape:8s} m={m:4d} " + " ".join(f"{a}={b:.0f}({base / b:.2f}x)" for a, b in times.items()),
                  flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
                       "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
