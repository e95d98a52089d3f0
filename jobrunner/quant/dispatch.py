"""Which kernel a quantized layer runs, decided once per process from what this machine computes fast.

A weight-only kernel (int8 / int4 packed) reads 1 or 0.5 byte per weight instead of 4, so it wins where the
GEMM is memory-bound: few tokens. Its cost grows with the token count, so above a crossover the layer
dequantizes its weight (tile by tile, into a reused buffer) to the *compute dtype* and runs one dense GEMM,
which is at least as fast as the float model. The compute dtype is the one this machine multiplies fast:

* CPU with bf16 hardware (``avx512_bf16`` or AMX): ``bfloat16``;
* any other CPU (e.g. an AVX2-only AMD EPYC: float32 GEMM ~67 GFLOP/s, bf16 ~10): ``float32``;
* CUDA: the activation dtype (bf16 / fp16; float32 activations use float32).

The capability comes from ``torch.backends.cpu.get_cpu_capability()`` plus torch's bf16/AMX probes, or is
forced with ``JOBRUNNER_CPU_CAPABILITY`` (``avx2`` | ``avx512`` | ``avx512_vnni`` | ``avx512_bf16`` | ``amx`` |
``default``) or a ``capability=`` argument, so the AVX2 decisions are testable on any machine. The decision is a
pure function of the capability, never of a start-up timing: a timing on a loaded machine flapped between
processes (one spec ran at two speeds, with different rows). ``calibrate_gemm`` stays as an explicit tool
(``jobrunner bench --calibrate-dtype``) for checking a new kind of machine. Decisions are cached per process
and recorded in the model info the engine reports (manifest ``model.quant_dispatch`` / ``model.dtype_choice``).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

import torch

# the capability lives below this module, in the kernels package (which compiles for it); named here too
from jobrunner.kernels import CAPABILITY_ENV, CPU_CAPABILITIES, detect_cpu_capability, setting  # noqa: F401
from jobrunner.quant.i8_gemm import amx_choice, vnni_choice
from jobrunner.quant.int4_native import int4_unpack_fn

# "int8=8,int4=64": override the crossovers below (for tuning with bench.quant_dispatch; recorded when set)
CROSSOVER_ENV = "JOBRUNNER_QUANT_KERNEL_TOKENS"
BF16_CAPABILITIES = ("avx512_bf16", "amx")
# int8 dot-product hardware (AVX512-VNNI ``vpdpbusd``; AMX-INT8): oneDNN's u8 x s8 GEMM accumulates exactly in
# int32 there. Without it oneDNN goes through ``vpmaddubsw``, whose int16 pair sums can saturate, and runs ~at
# the speed of the weight-only kernels: W8A8 then falls back to int8 weight-only (see jobrunner.quant.w8a8).
# Every CPU with avx512_bf16 (Cooper Lake, Sapphire Rapids, Zen 4) also has VNNI.
INT8_DOT_CAPABILITIES = ("avx512_vnni", "avx512_bf16", "amx")
# `jobrunner bench --calibrate-dtype` calls bf16 "fast" here when it beats float32 by this factor in the GEMM
# below (AMX / avx512_bf16 measure 2-10x on a quiet machine; emulated bf16 is slower than float32).
BF16_MIN_SPEEDUP = 1.25
CALIBRATION_SHAPE = (64, 512, 1024)  # (tokens, in, out): ~67 MFLOP, about a millisecond in float32

# Crossovers in tokens (rows of the GEMM): at or below, the packed weight-only kernel; above, dequantize.
# Measured in the engine on SmolLM2 (2-core Zen 4 with avx512_bf16; AVX2 forced for the other row;
# `JOBRUNNER_QUANT_KERNEL_TOKENS` to move them, numbers in docs/quantization.md):
# * fast bf16: int8 dequantized to bf16 beats its packed kernel at batch 64 (189.5 vs 149.9 tok/s); int4's
#   packed kernel wins at 64 (170.6 vs 127.9) but not at 128 (decode 11.1 s vs 9.8 s dequantized).
# * other CPUs (AVX2; AVX512 without bf16): the packed kernels beat dequantize + float32 GEMM well past batch
#   64: decode at batch 128, int8 packed 15.2 s vs dequantized 16.7 s, int4 14.8 s vs 22.5 s (float32
#   12.7 s). Dequantizing wins for prefill in 2048-token chunks: int8 9.1 s vs 12.4 s all-packed, int4 9.6 s
#   vs 13.6 s (float32 9.9 s).
CPU_CROSSOVERS = {True: {"int8": 8, "int4": 64}, False: {"int8": 256, "int4": 256}}  # key: fast bf16
# The packed int8 kernel re-reads its weight for every few rows; a weight beyond the caches then streams from
# memory each time. SmolLM2's lm_head (49152 x 576 = 28 M int8 weights), forced AVX2, 2 threads, ms, packed /
# dequantized float32 tiles: 15.7 / 16.3 at 16 rows, 31.4 / 22.0 at 32, 59.3 / 33.5 at 64 (float32 GEMM 33.9).
CPU_LARGE_INT8_WEIGHTS = 1 << 23
CPU_LARGE_INT8_TOKENS = 16
# w8a8 (where it has a kernel): the int8 weight-only kernel up to 1 token (SmolLM2 decode at batch 1 on Zen 4:
# 40.9 tok/s vs 32.3 with oneDNN's int8 GEMM for every size), the W8A8 GEMM above (batch 8: 156.8 vs 124.9).
W8A8_CROSSOVER = {"w8a8": 1}
# the VNNI kernel (jobrunner.quant.i8_gemm) is ~2x the bf16 GEMM at 1 row too: no weight-only rows
W8A8_VNNI_CROSSOVER = {"w8a8": 0}
# int4 on CPUs with int8 dot-product hardware: up to 16 tokens the packed kernel, above it (no upper limit) int4
# tiles expanded to int8 and an int8 GEMM with per-token int8 activations (W4A8, jobrunner.quant.int4_int8).
# SmolLM2-135M on a 2-core Zen 4, µs per call at 16 / 64 / 2048 rows (docs/quantization.md): gate_up packed 452
# / 1545 / 44083, W4A8 387 / 521 / 10368, bf16 236 / 664 / 18594; engine at batch 64: 1.20x bf16 (the packed
# kernel up to 64 tokens and bf16 tiles above: 0.86x). JOBRUNNER_QUANT_KERNEL_TOKENS="int4_int8=0" turns it
# off (int4 then stays weight-only: bf16 tiles above the packed kernel's crossover).
NO_LIMIT = 1 << 30
INT4_INT8_CROSSOVER = {"int4": 16, "int4_int8": NO_LIMIT}
# where W8A8 runs on our GEMM (vnni; amx opt-in), the W4A8 call expands each thread's column blocks into its own
# buffer (jr_i4_linear, no N x K round trip): it passes the packed kernel from 8 rows. SmolLM2-135M's four layer
# shapes summed, µs per call, packed / one call (2-core Zen 4, /work/bench/i4x.py in the 2026-12-06 late note):
# 1 row 244 / 399, 4 rows 330 / 404, 8 rows 549 / 451, 16 rows 966 / 485.
INT4_INT8_OWN_GEMM_CROSSOVER = {"int4": 4, "int4_int8": NO_LIMIT}
# CUDA: tinygemm (int4) and the int8 GEMV kernel are built for a few rows (m16 tiles); cuBLAS on a
# dequantized bf16 copy wins once the weight is re-read for several row tiles. fp8 runs _scaled_mm for all.
CUDA_CROSSOVERS = {"int8": 16, "int4": 32}
# Dequantize at most this many weights at a time: on CPU a tile stays in cache between the dequantize
# pass and the GEMM that reads it (1 MB in float32). Single-thread AVX2 runs on SmolLM2's lm_head (49152 x 576,
# 64 tokens; loaded machine): int8 103 / 119 / 148 / 207 ms with 2^18 / 2^19 / 2^21 / whole-layer tiles,
# float32 127 ms. On CUDA tiles only bound the scratch buffer.
CPU_TILE_WEIGHTS = 1 << 18
# With bf16 GEMM hardware the tile is bf16 and the GEMM fast, so per-tile overhead dominates small tiles: int8
# weight-only at 64 rows, 2 threads, Zen 4 (µs; bf16 GEMM 11882 / 714): lm_head 17639 / 14611 / 14857 / 12622
# and gate_up 1264 / 1649 / 895 / 900 with tiles of 2^18 / 2^20 / 2^21 / 2^22 weights (4 MB of bf16 at 2^21).
CPU_TILE_WEIGHTS_FAST_BF16 = 1 << 21
CUDA_TILE_WEIGHTS = 1 << 26


@dataclass(frozen=True)
class CpuProfile:
    """What this CPU computes fast: its capability and whether it has bf16 GEMM hardware (AMX, avx512_bf16).

    ``calibration`` is always None for the profile the engine uses (kept in the manifest's shape for old
    readers); ``jobrunner bench --calibrate-dtype`` measures it on request."""

    capability: str
    forced: bool
    fast_bf16: bool
    calibration: dict[str, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (for the manifest)."""
        return {"capability": self.capability, "forced": self.forced, "fast_bf16": self.fast_bf16,
                "calibration": self.calibration}


@dataclass(frozen=True)
class QuantDispatch:
    """The paths quantized layers take on one device type (see the module docstring)."""

    device_type: str
    capability: str
    compute_dtype: torch.dtype | None  # None on CUDA: the activation dtype
    max_kernel_tokens: dict[str, int]
    tile_weights: int
    fp8_native: bool = False
    int4_unpack: str = "torch"  # "c": the one-pass native unpack (CPU tiles), see quant.int4_native
    # opt-in Triton kernels at batch ($JOBRUNNER_TRITON_QUANT): {"requested", "enabled", "reasons"}, see
    # quant.triton_quant; None when not asked for
    triton_quant: dict[str, Any] | None = None

    def uses_triton(self, scheme: str) -> bool:
        """Whether ``scheme``'s layers run the Triton kernel at batch (opt-in, probed at load)."""
        return self.triton_quant is not None and scheme in self.triton_quant["enabled"]
    w8a8_kernel: str | None = None  # CPU W8A8 GEMM ("vnni", "onednn"), None: scheme w8a8 runs int8 weight-only

    def kernel_tokens(self, scheme: str) -> int:
        """Largest token count for which ``scheme`` runs its weight-only kernel."""
        return self.max_kernel_tokens.get(scheme, 0)

    def kernel_tokens_for(self, scheme: str, weights: int) -> int:
        """:meth:`kernel_tokens` for a layer of ``weights`` weights: on CPU an int8 layer too large for the caches
        (:data:`CPU_LARGE_INT8_WEIGHTS`) leaves its packed kernel sooner."""
        limit = self.kernel_tokens(scheme)
        if scheme == "int8" and self.device_type == "cpu" and weights > CPU_LARGE_INT8_WEIGHTS:
            return min(limit, CPU_LARGE_INT8_TOKENS)
        return limit

    def compute_dtype_for(self, x_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the dequantized weight for activations of ``x_dtype``."""
        return self.compute_dtype or x_dtype

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (for the manifest)."""
        dtype = None if self.compute_dtype is None else str(self.compute_dtype).removeprefix("torch.")
        return {"device": self.device_type, "capability": self.capability,
                "dequant_dtype": dtype or "activation dtype", "max_kernel_tokens": dict(self.max_kernel_tokens),
                "tile_weights": self.tile_weights, "fp8_native": self.fp8_native, "int4_unpack": self.int4_unpack,
                "triton_quant": self.triton_quant, "w8a8_kernel": self.w8a8_kernel}


def cpu_profile(capability: str | None = None) -> CpuProfile:
    """This CPU's profile (cached per process and per forced capability, argument or environment)."""
    return _cpu_profile(*detect_cpu_capability(capability))


@functools.cache
def _cpu_profile(cap: str, forced: bool) -> CpuProfile:
    return CpuProfile(cap, forced, fast_bf16=cap in BF16_CAPABILITIES)


def calibrate_dtype(repeats: int = 20) -> dict[str, Any]:
    """An explicit check of a machine (never run by ``dtype: auto``): the GEMM GFLOP/s in float32 and bfloat16,
    what the measurement would suggest, and what ``auto`` chooses from the capability."""
    calibration = calibrate_gemm(repeats=repeats)
    dtype, why = choose_cpu_dtype()
    measured = "bfloat16" if calibration["bfloat16_gflops"] >= BF16_MIN_SPEEDUP * calibration["float32_gflops"] \
        else "float32"
    return {"calibration": calibration, "measured_choice": measured, "auto": why["chosen"],
            "reason": why["reason"], "capability": why["capability"], "forced": why["forced"],
            "agrees": measured == why["chosen"]}


def calibrate_gemm(shape: tuple[int, int, int] = CALIBRATION_SHAPE, repeats: int = 3) -> dict[str, float]:
    """GFLOP/s of one small GEMM in float32 and in bfloat16 on this CPU (best of ``repeats``, ~10 ms)."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        xd, wd = x.to(dtype), w.to(dtype)
        torch.nn.functional.linear(xd, wd)  # warm-up: oneDNN picks and JIT-compiles its kernel here
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            torch.nn.functional.linear(xd, wd)
            best = min(best, time.perf_counter() - start)
        out[f"{str(dtype).removeprefix('torch.')}_gflops"] = round(2 * m * k * n / max(best, 1e-9) / 1e9, 2)
    return out


def dispatch_for(device: torch.device | str, capability: str | None = None) -> QuantDispatch:
    """The quantized-layer dispatch for ``device`` (CPU: from :func:`cpu_profile`)."""
    device = torch.device(device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        fp8_native = cuda_fp8_supported(device)
        return QuantDispatch("cuda", _cuda_capability(device), None, crossovers(CUDA_CROSSOVERS),
                             CUDA_TILE_WEIGHTS, fp8_native=fp8_native, triton_quant=_triton(device, fp8_native))
    profile = cpu_profile(capability)
    dtype = torch.bfloat16 if profile.fast_bf16 else torch.float32
    unpack = "c" if int4_unpack_fn(dtype) is not None else "torch"
    w8a8 = w8a8_kernel_for(profile.capability)
    w8a8_limits = W8A8_VNNI_CROSSOVER if w8a8 in ("vnni", "amx") else W8A8_CROSSOVER
    int4_limits = INT4_INT8_OWN_GEMM_CROSSOVER if w8a8 in ("vnni", "amx") else INT4_INT8_CROSSOVER
    limits = {**CPU_CROSSOVERS[profile.fast_bf16], **(w8a8_limits if w8a8 else {}), **(int4_limits if w8a8 else {})}
    tile = CPU_TILE_WEIGHTS_FAST_BF16 if profile.fast_bf16 else CPU_TILE_WEIGHTS
    return QuantDispatch("cpu", profile.capability, dtype, crossovers(limits), tile,
                         int4_unpack=unpack, w8a8_kernel=w8a8, triton_quant=_triton(torch.device("cpu"), False))


def _triton(device: torch.device, fp8_native: bool) -> dict[str, Any] | None:
    """The opt-in Triton kernels' choice (``$JOBRUNNER_TRITON_QUANT``), None when not asked for."""
    from jobrunner.quant.triton_quant import requested_schemes, triton_quant_choice

    return triton_quant_choice(device, fp8_native) if requested_schemes() else None


def w8a8_kernel_for(capability: str) -> str | None:
    """The CPU W8A8 GEMM for ``capability``: with int8 dot-product hardware ``"amx"`` where our AMX-INT8 kernel
    is asked for and runs (opt-in), ``"vnni"`` where the AVX-512 VNNI kernel is chosen and runs
    (:mod:`jobrunner.quant.i8_gemm`: ``avx512_bf16``), else ``"onednn"``; None without such hardware."""
    if capability not in INT8_DOT_CAPABILITIES:
        return None
    if amx_choice(capability)[0]:
        return "amx"
    return "vnni" if vnni_choice(capability)[0] else "onednn"


def crossovers(defaults: dict[str, int]) -> dict[str, int]:
    """``defaults`` with ``$JOBRUNNER_QUANT_KERNEL_TOKENS`` (``"int8=8,int4=64"``) applied."""
    out = dict(defaults)
    for item in filter(None, (part.strip() for part in setting(CROSSOVER_ENV).split(","))):
        scheme, _, value = item.partition("=")
        if scheme not in out or not value.strip().isdigit():
            raise ValueError(f"{CROSSOVER_ENV}: bad item {item!r}; expected e.g. 'int8=8,int4=64'")
        out[scheme] = int(value)
    return out


def choose_cpu_dtype(capability: str | None = None) -> tuple[torch.dtype, dict[str, Any]]:
    """``dtype: auto`` on CPU: bfloat16 on AMX / avx512_bf16, float32 elsewhere; and why (from the capability
    alone, so the same spec on the same kind of machine always gets the same dtype)."""
    profile = cpu_profile(capability)
    dtype = torch.bfloat16 if profile.fast_bf16 else torch.float32
    has = "bf16 GEMM hardware" if profile.fast_bf16 else "no bf16 GEMM hardware (AMX / avx512_bf16)"
    reason = f"{profile.capability}: {has}"
    return dtype, {"chosen": str(dtype).removeprefix("torch."), "reason": reason, **profile.to_dict()}


def _cuda_capability(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


@functools.cache
def cuda_fp8_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs e4m3 GEMMs on ``device`` (sm89+; one tiny probe, cached)."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    if torch.cuda.get_device_capability(device) < (8, 9):
        return False
    try:
        a = torch.ones(16, 32, device=device).to(torch.float8_e4m3fn)
        b = torch.ones(16, 32, device=device).to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        y = torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        return bool(torch.all(y.float() == 32.0))
    except (RuntimeError, NotImplementedError):
        return False
