"""One W8A8 layer per SmolLM2-135M shape against bf16, microseconds per call at ``M`` rows (CPU).

Each shape has several distinct layers run in turn (their weights partly cold, as in the engine); per shape:
bf16 ``F.linear``, the whole ``W8A8Linear`` call, oneDNN's GEMM alone (u8 input prepared beforehand), the row
quantization in torch ops and in the C loop, and int8 weight-only (what ``down_proj`` ran before smoothing).

    python scripts/cpu_w8a8_layers.py --threads 2 --rows 64
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


def best_us(fns: list[Callable[[], object]], repeats: int = 15) -> float:
    """Best time of one pass over ``fns``, per call, in microseconds (after one warm-up pass)."""
    for fn in fns:
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for fn in fns:
            fn()
        best = min(best, time.perf_counter() - start)
    return best / len(fns) * 1e6


def main() -> None:
    """Command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8, help="distinct layers per shape (2 for lm_head)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from jobrunner.quant.dispatch import dispatch_for
    from jobrunner.quant.int8 import Int8WeightOnlyLinear
    from jobrunner.quant.w8a8 import W8A8Linear
    from jobrunner.quant.w8a8_native import w8a8_native

    torch.manual_seed(0)
    native, dispatch = w8a8_native(), dispatch_for(torch.device("cpu"))
    for name, (n, k) in SHAPES.items():
        lins = [torch.nn.Linear(k, n, bias=False) for _ in range(2 if name == "lm_head" else args.layers)]
        x = (torch.randn(args.rows, k) * 0.5).bfloat16()
        row = _row(lins, x, native, Int8WeightOnlyLinear, W8A8Linear, dispatch)
        print(f"M={args.rows} {name:8s} " + " ".join(f"{key} {value:.0f}" for key, value in row.items()), flush=True)


def _row(lins: list[torch.nn.Linear], x: torch.Tensor, native, int8_cls, w8a8_cls, dispatch) -> dict[str, float]:
    from jobrunner.quant.w8a8 import ZERO_POINT, quantize_rows_u8

    bf16 = [lin.weight.detach().bfloat16() for lin in lins]
    w8a8 = [w8a8_cls.from_linear(lin, "onednn") for lin in lins]
    int8 = [int8_cls.from_linear(lin.bfloat16(), dispatch) for lin in lins]
    u8, _ = quantize_rows_u8(x)
    return {
        "bf16": best_us([lambda w=w: torch.nn.functional.linear(x, w) for w in bf16]),
        "w8a8": best_us([lambda m=m: m(x) for m in w8a8]),
        "gemm_only": best_us([lambda m=m: torch.ops.onednn.qlinear_pointwise(
            u8, 1.0, ZERO_POINT, m._packed, m.scales, m._zero_points, None, 1.0, 0, torch.float32, "none", [], "")
            for m in w8a8]),
        "quant_torch": best_us([lambda: quantize_rows_u8(x)]),
        "quant_c": best_us([lambda: native.quantize(x)]) if native is not None else float("nan"),
        "int8_weight_only": best_us([lambda m=m: m(x) for m in int8]),
    }


if __name__ == "__main__":
    main()
