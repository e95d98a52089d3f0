"""Micro-benchmark: one linear layer in float vs each int8/int4 path, at several token counts.

``jobrunner bench --quant-kernels`` prints microseconds (best of ``repeats``) for the SmolLM2 shapes:
``float`` (F.linear in float32), ``float_bf16``, ``packed`` (the torch weight-only kernel, bfloat16 activations),
``dequant`` (tiled dequantize into the machine's compute dtype + GEMM) and ``layer`` (our module, which picks
one). Prefix it with the variables of ``jobrunner.bench.quant_dispatch.AVX2_ENV`` to see the AVX2 kernels and decisions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from jobrunner.quant.dispatch import dispatch_for
from jobrunner.quant.fp8 import Fp8Linear
from jobrunner.quant.int4 import Int4WeightOnlyLinear
from jobrunner.quant.int8 import Int8WeightOnlyLinear
from jobrunner.quant.kernels import int4_mm

SMOLLM2_SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576),
                  "down_proj": (576, 1536), "lm_head": (49152, 576)}


def best_us(fn: Callable[[], object], repeats: int = 7) -> float:
    """Best wall time of ``fn`` in microseconds over ``repeats`` runs (after one warm-up)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


@torch.no_grad()
def time_shape(out_features: int, in_features: int, num_tokens: int, group_size: int = 32,
               device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Microseconds per call of every path for one weight shape and token count.

    ``*_packed``: the weight-only kernel; ``*_dequant``: our tiled dequantize + GEMM path in this machine's
    compute dtype; ``*_layer``: the layer as dispatched (whichever of the two it picks for ``num_tokens``).
    """
    lin = torch.nn.Linear(in_features, out_features, bias=False, device=device, dtype=dtype)
    x = torch.randn(num_tokens, in_features, device=device, dtype=dtype)
    xb = x.to(torch.bfloat16)
    q8 = Int8WeightOnlyLinear.from_linear(lin)
    q4 = Int4WeightOnlyLinear.from_linear(lin, group_size)
    f8 = Fp8Linear.from_linear(lin)
    s8 = q8.scales_bf16
    times = {
        "float": best_us(lambda: lin(x)),
        "float_bf16": best_us(lambda: F.linear(xb, lin.weight.to(torch.bfloat16))),
        "int8_packed": best_us(lambda: torch.ops.aten._weight_int8pack_mm(xb, q8.weight_int8, s8)),
        "int8_layer": best_us(lambda: q8(x)),
        "int4_packed": best_us(lambda: int4_mm(xb, q4.weight_int4pack, group_size, q4.scales_and_zeros)),
        "int4_layer": best_us(lambda: q4(x)),
        "fp8_layer": best_us(lambda: f8(x)),
    }
    q8.small_batch_max_tokens = q4.small_batch_max_tokens = 0  # force the dequantize path
    times["int8_dequant"] = best_us(lambda: q8(x))
    times["int4_dequant"] = best_us(lambda: q4(x))
    return times


def kernel_table(token_counts: Sequence[int] = (1, 8, 64),
                 shapes: Sequence[str] = tuple(SMOLLM2_SHAPES)) -> list[str]:
    """A header line and one line per (shape, token count)."""
    dispatch = dispatch_for("cpu")
    lines = [f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
             f"cpu capability {torch.backends.cpu.get_cpu_capability()}, dispatch {dispatch.to_dict()}; "
             "microseconds, best of 7"]
    for name in shapes:
        out_features, in_features = SMOLLM2_SHAPES[name]
        for num_tokens in token_counts:
            times = time_shape(out_features, in_features, num_tokens)
            cells = " ".join(f"{k}={v:.0f}" for k, v in times.items())
            lines.append(f"{name:13s} [{out_features}x{in_features}] tokens={num_tokens:3d} {cells}")
    return lines
