"""One-pass int4 unpack for CPU: a 20-line C loop built with the system C compiler on first use.

Why: the large-batch int4 path must undo the CPU kernel's block layout ([blocks, K, block_n / 2] bytes) into
W^T [K, N]. With torch ops that takes two strided uint8 -> float copies plus a multiply and an add (~1 ms per
1.8 M weights on one AVX2 core, a third of the float32 GEMM it feeds at 64 tokens). This loop reads each byte
once and writes each float once, with the scale and offset applied on the way (vectorized by the compiler
for this CPU, ``-march=native``; OpenMP over K).

It is plain C called through ctypes (no torch headers, so it builds in about a second), cached under
``~/.cache/jobrunner`` per source, compiler, flags and CPU. The instruction set follows the dispatch's CPU
capability: ``-march=native``, or, where the capability is forced (``JOBRUNNER_CPU_CAPABILITY=avx2``), that
ISA (``-march=haswell`` for avx2), so a forced-AVX2 run measures the code an AVX2-only CPU would run.
No compiler, a failed build, or ``JOBRUNNER_QUANT_NATIVE=0``: :func:`int4_unpack_fn` returns ``None`` and the
torch path runs.
The library links ``libgomp.so.1``; where torch's own OpenMP runtime has that name (this venv) the loader
reuses it, so there is one thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from jobrunner.quant.capability import detect_cpu_capability

NATIVE_ENV = "JOBRUNNER_QUANT_NATIVE"

_SOURCE = r"""
#include <stdint.h>
/* W^T[k, n] = code(n, k) * scale[k / group, n] + offset[k / group, n] for whole blocks of the CPU int4
   layout: packed is [nb][K][half] bytes; split: rows j and j + half of a block share byte j (low, high);
   interleaved: rows 2j and 2j + 1. out, scale and offset have rows of ld >= nb * block_n elements.
   Two outputs: float32, and bfloat16 (rounded to nearest even, as torch's float -> bfloat16 conversion). */
static inline float as_f32(float x) { return x; }
static inline uint16_t as_bf16(float x) {
  union { float f; uint32_t u; } v = {x};
  return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}
/* half is a compile-time constant in the common cases so that the compiler emits whole-vector code */
#define SPLIT_BLOCK(NAME, HALF_EXPR, OUT_T, STORE)                                                       \
  static void NAME(const uint8_t* restrict p, const float* restrict s, const float* restrict z,         \
                   OUT_T* restrict o, int64_t half_arg) {                                                  \
    const int64_t half = HALF_EXPR;                                                                        \
    for (int64_t j = 0; j < half; j++) o[j] = STORE((float)(p[j] & 15) * s[j] + z[j]);                   \
    for (int64_t j = 0; j < half; j++) o[half + j] = STORE((float)(p[j] >> 4) * s[half + j] + z[half + j]); \
  }
#define UNPACK(NAME, OUT_T, STORE)                                                                        \
  SPLIT_BLOCK(NAME##_split16, 16, OUT_T, STORE)                                                           \
  SPLIT_BLOCK(NAME##_split32, 32, OUT_T, STORE)                                                           \
  SPLIT_BLOCK(NAME##_split, half_arg, OUT_T, STORE)                                                       \
  void NAME(const uint8_t* packed, const float* scale, const float* offset, OUT_T* out, int64_t K,         \
            int64_t nb, int64_t block_n, int64_t split, int64_t group, int64_t ld, int64_t threads) {      \
    const int64_t half = block_n / 2, rows = ld;                                                           \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                                      \
    for (int64_t k = 0; k < K; k++) {                                                                      \
      const float* s = scale + (k / group) * rows;                                                         \
      const float* z = offset + (k / group) * rows;                                                        \
      OUT_T* o = out + k * rows;                                                                           \
      for (int64_t b = 0; b < nb; b++) {                                                                   \
        const uint8_t* p = packed + (b * K + k) * half;                                                    \
        const int64_t c = b * block_n;                                                                     \
        if (split) {                                                                                       \
          if (half == 16) NAME##_split16(p, s + c, z + c, o + c, half);                                    \
          else if (half == 32) NAME##_split32(p, s + c, z + c, o + c, half);                               \
          else NAME##_split(p, s + c, z + c, o + c, half);                                                 \
        } else {                                                                                           \
          for (int64_t j = 0; j < half; j++) {                                                             \
            o[c + 2 * j] = STORE((float)(p[j] & 15) * s[c + 2 * j] + z[c + 2 * j]);                        \
            o[c + 2 * j + 1] = STORE((float)(p[j] >> 4) * s[c + 2 * j + 1] + z[c + 2 * j + 1]);            \
          }                                                                                                \
        }                                                                                                  \
      }                                                                                                    \
    }                                                                                                      \
  }
UNPACK(jr_int4_unpack_t, float, as_f32)
UNPACK(jr_int4_unpack_t_bf16, uint16_t, as_bf16)

/* int4 -> int8 per output row (the int4 path's int8 GEMM): W8^T[k, c] = rint(((code - 8) * s + z) * inv[c]),
   clamped to [-127, 127], for whole blocks of block_n <= 64 rows. s, z: the bfloat16 pairs
   [groups][pair_stride][2] of these rows; inv: 1 / row scale. OpenMP over blocks: a block's factors for one
   group (a = s * inv, b = (z - 8 s) * inv) are computed once on the stack and used for the group's rows of K;
   each (k, block) writes one run of block_n bytes. The scalar rounding adds and subtracts 1.5 * 2^23 (round
   half to even, as the vector conversion and rint do). */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
/* 16 codes (bytes 0..15) -> 16 int8: rint(code * a + b) clamped to [-127, 127] (the MXCSR default rounds half
   to even, like rint); written out explicitly because char stores alias the factor arrays for the compiler */
static inline void expand16(__m128i codes, const float* a, const float* b, int8_t* o) {
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes));
  __m512i i = _mm512_cvtps_epi32(_mm512_fmadd_ps(f, _mm512_loadu_ps(a), _mm512_loadu_ps(b)));
  i = _mm512_max_epi32(_mm512_min_epi32(i, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
  _mm_storeu_si128((__m128i*)o, _mm512_cvtepi32_epi8(i));
}
#endif
static inline float from_bf16(uint16_t h) { union { uint32_t u; float f; } v = {(uint32_t)h << 16}; return v.f; }
static inline int8_t to_i8(float v) {
  v = (v + 12582912.0f) - 12582912.0f;
  v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
  return (int8_t)v;
}
static void expand_row(const uint8_t* restrict p, const float* restrict a, const float* restrict b,
                       int8_t* restrict o, int64_t half, int64_t split) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (split && half % 16 == 0) {  /* 16 bytes: 16 low-nibble rows and the 16 rows half further on */
    for (int64_t j = 0; j < half; j += 16) {
      const __m128i bytes = _mm_loadu_si128((const __m128i*)(p + j));
      expand16(_mm_and_si128(bytes, _mm_set1_epi8(15)), a + j, b + j, o + j);
      expand16(_mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(15)), a + half + j, b + half + j, o + half + j);
    }
    return;
  }
#endif
  if (split) {
    for (int64_t j = 0; j < half; j++) o[j] = to_i8((float)(p[j] & 15) * a[j] + b[j]);
    for (int64_t j = 0; j < half; j++) o[half + j] = to_i8((float)(p[j] >> 4) * a[half + j] + b[half + j]);
  } else {
    for (int64_t j = 0; j < half; j++) {
      o[2 * j] = to_i8((float)(p[j] & 15) * a[2 * j] + b[2 * j]);
      o[2 * j + 1] = to_i8((float)(p[j] >> 4) * a[2 * j + 1] + b[2 * j + 1]);
    }
  }
}
int jr_int4_to_int8_t(const uint8_t* packed, const uint16_t* pairs, const float* inv, int8_t* out, int64_t K,
                      int64_t nb, int64_t block_n, int64_t split, int64_t group, int64_t ld, int64_t pair_stride,
                      int64_t threads) {
  const int64_t half = block_n / 2, groups = K / group;
  if (block_n > 64 || block_n % 2) return 1;
  _Pragma("omp parallel for num_threads(threads) schedule(static)")
  for (int64_t blk = 0; blk < nb; blk++) {
    float a[64], b[64];
    const int64_t c0 = blk * block_n;
    for (int64_t g = 0; g < groups; g++) {
      for (int64_t j = 0; j < block_n; j++) {
        const uint16_t* sz = pairs + 2 * (g * pair_stride + c0 + j);
        const float s = from_bf16(sz[0]), z = from_bf16(sz[1]);
        a[j] = s * inv[c0 + j];
        b[j] = (z - 8.0f * s) * inv[c0 + j];
      }
      for (int64_t k = g * group; k < (g + 1) * group; k++)
        expand_row(packed + (blk * K + k) * half, a, b, out + k * ld + c0, half, split);
    }
  }
  return 0;
}
"""

Unpack = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, bool, int], None]


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get(NATIVE_ENV, "1").strip() == "0":
        return None
    try:
        return ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError) as exc:
        warnings.warn(f"jobrunner.quant: native int4 unpack unavailable ({exc}); using torch ops", stacklevel=2)
        return None


UNPACK_SYMBOLS = {torch.float32: "jr_int4_unpack_t", torch.bfloat16: "jr_int4_unpack_t_bf16"}


@functools.cache
def int4_unpack_fn(dtype: torch.dtype = torch.float32) -> Unpack | None:
    """The compiled unpack writing ``dtype`` (float32 or bfloat16) as ``fn(packed_blocks, scale, offset, out,
    block_n, split, group)``, or ``None`` (no such variant, or no native code here)."""
    lib = _library() if dtype in UNPACK_SYMBOLS else None
    if lib is None:
        return None
    fn = getattr(lib, UNPACK_SYMBOLS[dtype])
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 7

    def unpack(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, out: torch.Tensor,
               block_n: int, split: bool, group: int) -> None:
        # packed: uint8 [nb, K, block_n / 2]; scale, offset: float32 [K / group, ld]; out: dtype [K, ld],
        # of which the first nb * block_n columns are written
        nb, k, _ = packed.shape
        if out.shape[1] < nb * block_n or scale.shape[1] != out.shape[1] or offset.shape != scale.shape:
            raise ValueError("native int4 unpack: out / scale / offset widths do not match")
        for t, want in ((packed, torch.uint8), (scale, torch.float32), (offset, torch.float32), (out, dtype)):
            if t.dtype != want or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"native int4 unpack: expected a contiguous CPU {want} tensor, got {t.dtype}")
        fn(packed.data_ptr(), scale.data_ptr(), offset.data_ptr(), out.data_ptr(), k, nb, block_n, int(split),
           group, out.shape[1], torch.get_num_threads())

    return unpack


# fn(packed_blocks uint8 [nb, K, block_n / 2], pairs bf16 [groups, >= nb * block_n, 2] (a column slice of the
# layer's scales_and_zeros), inv_row_scale float32 [nb * block_n], out int8 [K, ld], block_n, split, group)
ToInt8 = Callable[..., None]


@functools.cache
def int4_to_int8_fn() -> ToInt8 | None:
    """The compiled int4 -> int8 expansion (the int4 layer's int8-GEMM path), or ``None`` without native code.

    Row ``c`` of the packed blocks becomes ``rint(((code - 8) * scale + zero) / row_scale[c])`` in [-127, 127],
    written transposed (``out[k, c]``), the ``B`` operand of ``torch._int_mm``."""
    lib = _library()
    if lib is None:
        return None
    fn = lib.jr_int4_to_int8_t
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 8

    def expand(packed: torch.Tensor, pairs: torch.Tensor, inv_row_scale: torch.Tensor, out: torch.Tensor,
               block_n: int, split: bool, group: int) -> None:
        nb, k, _ = packed.shape
        cols = nb * block_n
        if out.shape[0] != k or out.shape[1] < cols or inv_row_scale.numel() < cols or pairs.shape[1] < cols:
            raise ValueError("native int4 -> int8: out / pairs / row scale widths do not match")
        checks = ((packed, torch.uint8), (inv_row_scale, torch.float32), (out, torch.int8), (pairs, torch.bfloat16))
        for t, want in checks:
            if t.dtype != want or t.device.type != "cpu" or (t is not pairs and not t.is_contiguous()):
                raise ValueError(f"native int4 -> int8: expected a contiguous CPU {want} tensor, got {t.dtype}")
        if pairs.stride(2) != 1 or pairs.stride(1) != 2:
            raise ValueError("native int4 -> int8: pairs must be [groups, rows, 2] with contiguous rows")
        if block_n > 64 or block_n % 2:
            raise ValueError(f"native int4 -> int8: blocks of {block_n} rows (at most 64, even)")
        fn(packed.data_ptr(), pairs.data_ptr(), inv_row_scale.data_ptr(), out.data_ptr(), k, nb, block_n,
           int(split), group, out.stride(0), pairs.stride(0) // 2, torch.get_num_threads())

    return expand


def _build() -> Path:
    return build_library(_SOURCE, "int4_unpack")


def build_library(source: str, name: str, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile ``source`` for this CPU into a cached shared library ``<cache>/jobrunner/<name>_<key>.so`` (the key
    covers the source, compiler, flags and CPU); OSError without a compiler, CalledProcessError on a failed build."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler on PATH")
    flags = ["-O3", march_flag(), "-fopenmp", *extra_flags, "-shared", "-fPIC"]
    key = hashlib.sha256("\0".join([source, compiler, *flags, _cpu_id()]).encode()).hexdigest()[:16]
    target = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jobrunner" / f"{name}_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, lib = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
        src.write_text(source, encoding="utf-8")
        subprocess.run([compiler, *flags, str(src), "-o", str(lib)], check=True, capture_output=True, timeout=120)
        os.replace(lib, target)  # atomic: concurrent workers build the same file
    return target


# -march for a forced capability (what that CPU class has; the tuning stays generic)
FORCED_MARCH = {"default": "-march=x86-64", "avx2": "-march=haswell", "avx512": "-march=skylake-avx512",
                "avx512_vnni": "-march=cascadelake",
                "avx512_bf16": "-march=cooperlake", "amx": "-march=sapphirerapids"}


def march_flag() -> str:
    """``-march=native``, or the ISA of a forced capability (see :mod:`jobrunner.quant.capability`)."""
    capability, forced = detect_cpu_capability()
    return FORCED_MARCH[capability] if forced else "-march=native"


def _cpu_id() -> str:
    """What ``-march=native`` depends on (the .so is rebuilt on another CPU sharing the cache directory)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability()
