"""Opt-in Triton kernels for quantized layers at batch: which schemes use them here, and the fallback.

``JOBRUNNER_TRITON_QUANT`` (read when a model is quantized) asks for them: ``1`` / ``all`` = fp8, int8 and
int4; or a list such as ``fp8,int4``; unset / ``0`` = off (the default until they are measured on a GPU).
What they replace (see :mod:`jobrunner.quant.triton_fp8`, :mod:`jobrunner.quant.triton_mixed`):

* ``fp8``: the ~7 torch kernels that quantize a linear's input per token -> one Triton kernel, then
  ``torch._scaled_mm`` with row-wise scales (CUDA sm89+ where ``_scaled_mm`` takes them);
* ``int8`` / ``int4`` above their crossover (16 / 32 tokens on CUDA): dequantizing the whole weight to bf16
  per call -> a mixed-input GEMM that reads the stored weight (int8 needs ``in_features % 64 == 0``; int4
  needs a weight whose tinygemm layout reads back, ``cuda_readable``).

A scheme is enabled only on CUDA (or under ``TRITON_INTERPRET=1``), with triton importable, and after a
load-time probe: each kernel runs once per M bucket on a small problem and must match torch's answer, so the
JIT compiles before any timing or CUDA-graph capture and a kernel this GPU rejects is caught at load. Otherwise
the scheme keeps today's torch path and :func:`triton_quant_choice` says why; the choice is recorded in
``QuantDispatch`` (manifest ``model.quant_dispatch.triton_quant``). A kernel that fails later, in a forward,
logs one warning, switches that layer back to the torch path for good and is counted in :func:`failures`.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from jobrunner.kernels import setting
from jobrunner.quant.kernels import pack_int4_cuda_reference, rowwise_scaled_mm
from jobrunner.quant.primitives import (
    dequantize_int4,
    dequantize_int8,
    fp8_w8a8_reference,
    quantize_fp8_per_channel,
    quantize_int4_groupwise,
    quantize_int8_per_channel,
)

TRITON_QUANT_ENV = "JOBRUNNER_TRITON_QUANT"
TRITON_SCHEMES = ("fp8", "int8", "int4")
PROBE_TOKENS = (17, 40, 100, 200)   # one M per bucket of triton_mixed.CONFIGS (the JIT compiles each once)

log = logging.getLogger(__name__)
_failures: dict[str, str] = {}


def requested_schemes() -> tuple[str, ...]:
    """The schemes ``$JOBRUNNER_TRITON_QUANT`` asks for (``ValueError`` naming the variable on a bad value)."""
    raw = setting(TRITON_QUANT_ENV).lower()
    if raw in ("", "0", "off", "false", "no"):
        return ()
    if raw in ("1", "all", "on", "true", "yes"):
        return TRITON_SCHEMES
    schemes = tuple(s.strip() for s in raw.split(",") if s.strip())
    bad = [s for s in schemes if s not in TRITON_SCHEMES]
    if bad:
        raise ValueError(f"{TRITON_QUANT_ENV}={raw!r}: unknown scheme(s) {bad}; expected 1, 0 or a list of "
                         f"{'|'.join(TRITON_SCHEMES)}")
    return schemes


def unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton quant kernels cannot run on ``device`` (None when they can)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"needs CUDA (or TRITON_INTERPRET=1), not {device.type}"
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton is not importable ({exc})"
    return None


def triton_quant_choice(device: torch.device | str, fp8_native: bool = False) -> dict[str, Any]:
    """``{"requested": [...], "enabled": [...], "reasons": {scheme: why not}}`` for ``device``.

    ``fp8_native``: whether fp8 layers run W8A8 there (CUDA sm89+); the fused path also needs
    ``torch._scaled_mm`` to take row-wise scales."""
    device = torch.device(device)
    requested = requested_schemes()
    reasons: dict[str, str] = {}
    if requested:
        common = unavailable_reason(device)
        for scheme in requested:
            if common is not None:
                reasons[scheme] = common
            elif scheme == "fp8" and not fp8_native:
                reasons[scheme] = "fp8 runs weight-only here (W8A8 needs CUDA sm89+)"
            elif scheme == "fp8" and not rowwise_scaled_mm(device):
                reasons[scheme] = "torch._scaled_mm takes no row-wise scales in this build"
            else:
                problem = probe(scheme, device)
                if problem is not None:
                    reasons[scheme] = problem
    enabled = [s for s in requested if s not in reasons]
    return {"requested": list(requested), "enabled": enabled, "reasons": reasons}


@functools.cache
def probe(scheme: str, device: torch.device) -> str | None:
    """Run ``scheme``'s kernel once per M bucket against torch (cached per process); None when all match."""
    try:
        for m in PROBE_TOKENS if scheme != "fp8" else PROBE_TOKENS[:1]:
            error = _PROBES[scheme](m, device)
            if error > 2e-2:
                return f"probe at {m} tokens: relative error {error:.3g} against torch"
    except Exception as exc:  # noqa: BLE001 - any failure means: keep the torch path
        return f"probe failed: {type(exc).__name__}: {str(exc)[:300]}"
    return None


def fused_fp8_fn() -> Callable[..., torch.Tensor]:
    """:func:`~jobrunner.quant.triton_fp8.fp8_linear_fused` (imported here: triton is optional)."""
    from jobrunner.quant.triton_fp8 import fp8_linear_fused

    return fp8_linear_fused


def int8_triton_fn(enabled: bool, out_features: int, in_features: int) -> Callable[..., torch.Tensor] | None:
    """:func:`~jobrunner.quant.triton_mixed.int8_matmul` where the layer's dispatch ``enabled`` it and the shape
    fits."""
    if not enabled:
        return None
    from jobrunner.quant.triton_mixed import int8_matmul, int8_shape_problem

    return int8_matmul if int8_shape_problem(out_features, in_features) is None else None


def int4_triton_fn(enabled: bool) -> Callable[..., torch.Tensor] | None:
    """:func:`~jobrunner.quant.triton_mixed.int4_matmul` where the layer's dispatch ``enabled`` it (the layer
    checks that its packed weight reads back in tinygemm's layout)."""
    if not enabled:
        return None
    from jobrunner.quant.triton_mixed import int4_matmul

    return int4_matmul


def record_failure(scheme: str, exc: BaseException) -> None:
    """A kernel raised in a forward: warn once per scheme and remember it (the layer falls back)."""
    if scheme not in _failures:
        log.warning("triton %s kernel failed; this layer uses the torch path from now on: %s", scheme, exc)
    _failures[scheme] = f"{type(exc).__name__}: {str(exc)[:300]}"


def failures() -> dict[str, str]:
    """Schemes whose kernel failed in a forward in this process, with the last error."""
    return dict(_failures)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-12)).item()


def _probe_inputs(m: int, k: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(m)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    return x, torch.randn(n, k, generator=gen).to(device)


def _probe_fp8(m: int, device: torch.device) -> float:
    from jobrunner.quant.triton_fp8 import fp8_linear_fused

    x, w = _probe_inputs(m, 256, 64, device)
    wq, scales = quantize_fp8_per_channel(w)
    return _rel(fp8_linear_fused(x, wq, scales), fp8_w8a8_reference(x, wq, scales))


def _probe_int8(m: int, device: torch.device) -> float:
    from jobrunner.quant.triton_mixed import int8_matmul

    x, w = _probe_inputs(m, 256, 64, device)
    q, scales = quantize_int8_per_channel(w)
    return _rel(int8_matmul(x, q, scales), x.float() @ dequantize_int8(q, scales, torch.float32).t())


def _probe_int4(m: int, device: torch.device) -> float:
    from jobrunner.quant.triton_mixed import int4_matmul

    x, w = _probe_inputs(m, 256, 64, device)
    q, sz = quantize_int4_groupwise(w, 32)
    sz = sz.to(torch.bfloat16)
    ref = x.float() @ dequantize_int4(q, sz.float(), 32, torch.float32).t()
    return _rel(int4_matmul(x, pack_int4_cuda_reference(q, 8), sz, 32), ref)


_PROBES = {"fp8": _probe_fp8, "int8": _probe_int8, "int4": _probe_int4}
