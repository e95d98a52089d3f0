"""Quantized linear layers on CUDA, microseconds per call: bf16 dense vs fp8 / int8 / int4, torch vs Triton paths.

Paths (each a real layer from ``jobrunner.quant``, built from the same random bf16 weight):

* ``bf16``: ``F.linear`` on the bf16 weight;
* ``fp8_torch`` / ``fp8_fused``: ``Fp8Linear`` W8A8 with the per-token quantization in torch ops (~7 kernels)
  or in one Triton kernel (``JOBRUNNER_TRITON_QUANT``), then ``torch._scaled_mm``;
* ``int8_torch`` / ``int8_triton``, ``int4_torch`` / ``int4_triton``: the weight-only layers; above the
  crossover (16 / 32 tokens) the torch path dequantizes the weight to bf16 per call, the Triton path runs the
  mixed-input GEMM on the stored weight. At or below it both run the same packed kernel.

Shapes are Llama-3-8B weights written ``out x in`` (``[N, K]``): ``4096x4096`` (o_proj), ``14336x4096``
(up_proj: 4096 in, 14336 out), ``4096x14336`` (down_proj). Batches (tokens per call): 1, 16, 64, 256. Each
timing is one CUDA graph of ``--calls`` calls (launch overhead removed, as the engine replays decode steps),
replayed ``--replays`` times between CUDA events after warm-up; the median replay / calls is reported.

The whole-model step is the linears of one Llama-3-8B decoder layer (qkv 6144x4096, o 4096x4096, gate_up
28672x4096, down 4096x14336) captured together and counted 32 times, plus lm_head 128256x4096: attention,
norms and sampling are not in it (the engine run is ``JOBRUNNER_TRITON_QUANT=1 python scripts/gpu_bench.py
--runs fp8:triton+graphs``). One layer's weights (>= 220 MB) exceed L2, so repeating it does not flatter it.

JSON written to ``--out`` (default ``$OUT/gpu_quant_bench.json``), all numbers plain floats:

* ``layers[shape][batch][path]``: microseconds per call (batch keys are strings: "1", "16", "64", "256");
* ``speedup_vs_bf16[shape][batch][path]``: bf16 time / path time (> 1 is faster than bf16);
* ``model_step_ms[batch][path]`` and ``model_step_speedup_vs_bf16[batch][path]``: the whole-model linears;
* ``paths[path][batch]``: which code path the layer took (``scaled_mm``, ``triton_scaled_mm``, ``packed``,
  ``dequant``, ``triton``, ...), so a "Triton" column that silently ran torch is visible;
* ``fp8_fused_vs_bf16_b256``: ``model_step_speedup_vs_bf16["256"]["fp8_fused"]`` (the issue's threshold is
  >= 1.3), null unless that layer really took the Triton path at 256 tokens (``paths``); likewise
  ``int8_triton_vs_bf16_b256``, ``int4_triton_vs_bf16_b256``;
* ``triton_quant``: the dispatch's choice (requested / enabled / reasons); ``errors[path]``: why a path did
  not run; ``environment``: device, torch, triton, seconds.

    PYTHONPATH=. python scripts/gpu_quant_bench.py                       # the H200 run (well under a minute)
    PYTHONPATH=. python scripts/gpu_quant_bench.py --device cpu --tiny   # smoke check anywhere (no graphs)

``gpu_bench.py --runs quant-kernels`` runs the same and nests it in its report.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch

BATCHES = (1, 16, 64, 256)
SHAPES = {"4096x4096": (4096, 4096), "14336x4096": (14336, 4096), "4096x14336": (4096, 14336)}
DECODER_LAYER = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LM_HEAD = (128256, 4096)
NUM_LAYERS = 32
TINY_SHAPES = {"64x128": (64, 128), "128x64": (128, 64)}
TINY_LAYER = {"qkv": (192, 64), "o": (64, 64), "gate_up": (256, 64), "down": (64, 128)}
TINY_HEAD = (256, 64)
PATHS = ("bf16", "fp8_torch", "fp8_fused", "int8_torch", "int8_triton", "int4_torch", "int4_triton")


@contextlib.contextmanager
def triton_env(on: bool) -> Iterator[None]:
    """``JOBRUNNER_TRITON_QUANT`` set to 1 or 0 while layers are built (the dispatch reads it then)."""
    old = os.environ.get("JOBRUNNER_TRITON_QUANT")
    os.environ["JOBRUNNER_TRITON_QUANT"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("JOBRUNNER_TRITON_QUANT", None)
        else:
            os.environ["JOBRUNNER_TRITON_QUANT"] = old


def make_layer(path: str, weight: torch.Tensor) -> torch.nn.Module:
    """The layer of ``path`` for a bf16 ``weight`` [N, K] (no bias)."""
    from jobrunner.quant import Fp8Linear, Int4WeightOnlyLinear, Int8WeightOnlyLinear, dispatch_for

    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
    if path == "bf16":
        return linear
    scheme, _, flavor = path.partition("_")
    with triton_env(flavor != "torch"):
        dispatch = dispatch_for(weight.device)
        if scheme == "fp8":
            return Fp8Linear.from_linear(linear, dispatch)
        if scheme == "int8":
            return Int8WeightOnlyLinear.from_linear(linear, dispatch)
        return Int4WeightOnlyLinear.from_linear(linear, 32, dispatch)


def random_weight(n: int, k: int, device: torch.device, seed: int, std: float = 0.02) -> torch.Tensor:
    """[n, k] bf16 ~ N(0, std) drawn on ``device`` (a CPU draw of lm_head's 525 M values takes seconds)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16).mul_(std)


def time_us(fn: Callable[[], Any], device: torch.device, calls: int, replays: int) -> float:
    """Median microseconds per call of ``fn``: a CUDA graph of ``calls`` calls (CPU: plain loop)."""
    with torch.no_grad():
        for _ in range(2):
            fn()                                   # compile / allocate outside the graph
        if device.type != "cuda":
            times = []
            for _ in range(replays):
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                times.append((time.perf_counter() - t0) / calls * 1e6)
            return statistics.median(times)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        for _ in range(3):
            graph.replay()
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / calls)
        return statistics.median(times)


def bench_layers(shapes: dict[str, tuple[int, int]], path: str, device: torch.device,
                 args: argparse.Namespace) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    """``({shape: {batch: us}}, {batch: code path})`` for one path."""
    out: dict[str, dict[str, float]] = {}
    taken: dict[str, str] = {}
    for name, (n, k) in shapes.items():
        layer = make_layer(path, random_weight(n, k, device, seed=n + k))
        out[name] = {}
        for batch in BATCHES:
            x = random_weight(batch, k, device, seed=batch, std=1.0)
            out[name][str(batch)] = round(time_us(partial(layer, x), device, args.calls, args.replays), 2)
            taken[str(batch)] = layer.path(batch) if hasattr(layer, "path") else "dense"
        layer = None  # noqa: F841 - free this shape's weights before the next is built
        _free(device)
    return out, taken


def _step(layers: list[torch.nn.Module], x: torch.Tensor, xi: torch.Tensor) -> None:
    """One decoder layer's linears: qkv, o and gate_up on ``x`` [B, hidden], down on ``xi`` [B, inter]."""
    for layer in layers[:-1]:
        layer(x)
    layers[-1](xi)


def bench_model_step(path: str, device: torch.device, args: argparse.Namespace) -> dict[str, float]:
    """Milliseconds of the linears of one model step per batch: one decoder layer x 32, plus lm_head."""
    shapes = TINY_LAYER if args.tiny else DECODER_LAYER
    layers = [make_layer(path, random_weight(n, k, device, seed=i)) for i, (n, k) in enumerate(shapes.values())]
    head = make_layer(path, random_weight(*(TINY_HEAD if args.tiny else LM_HEAD), device, seed=9))
    hidden, inter = shapes["o"][1], shapes["down"][1]
    out = {}
    for batch in BATCHES:
        x = random_weight(batch, hidden, device, seed=batch, std=1.0)
        xi = random_weight(batch, inter, device, seed=batch + 1, std=1.0)
        layer_us = time_us(partial(_step, layers, x, xi), device, max(1, args.calls // 4), args.replays)
        head_us = time_us(partial(head, x), device, max(1, args.calls // 4), args.replays)
        out[str(batch)] = round((NUM_LAYERS * layer_us + head_us) / 1e3, 3)
    return out


def ratios(times: dict[str, float], base: str = "bf16") -> dict[str, float]:
    """``times[base] / times[path]`` per path (missing paths left out)."""
    return {p: round(times[base] / t, 3) for p, t in times.items() if base in times and t}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark as one JSON-able dict (see the module docstring for its keys)."""
    device = torch.device(args.device)
    t_start = time.perf_counter()
    shapes = TINY_SHAPES if args.tiny else SHAPES
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    report: dict[str, Any] = {"environment": _environment(device), "batches": list(BATCHES), "layers": {},
                              "paths": {}, "model_step_ms": {}, "errors": {}}
    with triton_env(True):
        from jobrunner.quant import dispatch_for

        try:
            report["triton_quant"] = dispatch_for(device).triton_quant
        except Exception as exc:  # noqa: BLE001 - recorded; the torch paths still run
            report["errors"]["triton_quant"] = f"{type(exc).__name__}: {exc}"
    for path in paths:
        try:
            per_shape, taken = bench_layers(shapes, path, device, args)
            _free(device)
            step = bench_model_step(path, device, args) if args.model_step else {}
        except Exception as exc:  # noqa: BLE001 - one path's failure must not hide the others
            report["errors"][path] = f"{type(exc).__name__}: {str(exc)[:500]}"
            _free(device)
            continue
        for shape, by_batch in per_shape.items():
            for batch, us in by_batch.items():
                report["layers"].setdefault(shape, {}).setdefault(batch, {})[path] = us
        for batch, ms in step.items():
            report["model_step_ms"].setdefault(batch, {})[path] = ms
        report["paths"][path] = taken
        print(json.dumps({"path": path, "layers": per_shape, "model_step_ms": step, "took": taken}), flush=True)
    _derive(report)
    report["environment"]["seconds"] = round(time.perf_counter() - t_start, 1)
    return report


def _derive(report: dict[str, Any]) -> None:
    report["speedup_vs_bf16"] = {s: {b: ratios(t) for b, t in by_b.items()} for s, by_b in report["layers"].items()}
    report["model_step_speedup_vs_bf16"] = {b: ratios(t) for b, t in report["model_step_ms"].items()}
    at_256 = report["model_step_speedup_vs_bf16"].get("256", {})
    for path in ("fp8_fused", "int8_triton", "int4_triton"):   # null unless the Triton path really ran
        ran = report["paths"].get(path, {}).get("256") in ("triton", "triton_scaled_mm")
        report[f"{path}_vs_bf16_b256"] = at_256.get(path) if ran else None


def _environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"device": str(device), "torch": torch.__version__}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    return env


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (a smoke check on CPU)")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma list of {','.join(PATHS)}")
    p.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    p.add_argument("--replays", type=int, default=10, help="timed graph replays (median)")
    p.add_argument("--no-model-step", dest="model_step", action="store_false", help="skip the whole-model step")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_quant_bench.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}; fp8_fused_vs_bf16_b256={report['fp8_fused_vs_bf16_b256']}; "
          f"errors: {', '.join(report['errors']) or 'none'}", flush=True)
    return 1 if "bf16" in report["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
