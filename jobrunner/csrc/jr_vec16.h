/* 16-lane float helpers shared by the row-wise kernels (models/csrc/fused_ops.c) and the AMX GEMM's fused
   epilogues (models/csrc/amx_gemm.c): bf16 loads and torch's rounding, exp and SiLU, each lane running the
   scalar code's very operations. Build the including file without floating-point contraction
   (-ffp-contract=off) so that products round as torch's do and the two kernels agree bit for bit. */
#ifndef JR_VEC16_H
#define JR_VEC16_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "jr_numerics.h"

#if defined(__AVX512BW__)
#include <immintrin.h>
#endif


/* 16 lanes through GCC vector extensions (AVX-512: one zmm; AVX2: two ymm): each lane runs the scalar code's
   very operations (no contraction in this file), so the vector and scalar paths give the same bits. */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

#if defined(__AVX512BW__)
/* bf16 -> float32 by one vpermw: word k (+ 16 for the high half) of h to the upper half of 32-bit lane k, the
   lower half zeroed by the mask */
static inline v16f widen_lo(__m512i h) {
  const v16u at = (v16u){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} << 16;
  return (v16f)_mm512_maskz_permutexvar_epi16(0xaaaaaaaau, (__m512i)at, h);
}

static inline v16f widen_hi(__m512i h) {
  const v16u at = ((v16u){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} + 16) << 16;
  return (v16f)_mm512_maskz_permutexvar_epi16(0xaaaaaaaau, (__m512i)at, h);
}

static inline v16f vload_bf16(const uint16_t *p) {
  return widen_lo(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)));
}
#else
static inline v16f vload_bf16(const uint16_t *p) {
  v16h h;
  memcpy(&h, p, sizeof h);
  return (v16f)(__builtin_convertvector(h, v16u) << 16);
}
#endif

static inline v16f vload_f32(const float *p) { v16f v; memcpy(&v, p, sizeof v); return v; }

static inline void vstore_f32(float *p, v16f v) { memcpy(p, &v, sizeof v); }

/* to_bf16 lane by lane: round to nearest even, NaN kept quiet */
static inline void vstore_bf16(uint16_t *p, v16f x) {
  const v16u u = (v16u)x;
  const v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const v16i nan = (v16i)((u & 0x7fffffffu) > 0x7f800000u);
  const v16u bits = (v16u)(((v16i)((u >> 16) | 64u) & nan) | ((v16i)rounded & ~nan));
  const v16h h = __builtin_convertvector(bits, v16h);
  memcpy(p, &h, sizeof h);
}

/* round_bf16 lane by lane, kept in 32-bit lanes */
static inline v16f vround_bf16(v16f x) {
  const v16u u = (v16u)x;
  const v16u rounded = ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) << 16;
  const v16i nan = (v16i)((u & 0x7fffffffu) > 0x7f800000u);
  return (v16f)(((v16i)(((u >> 16) | 64u) << 16) & nan) | ((v16i)rounded & ~nan));
}

static inline v16f vsplat(float x) { return (v16f){0} + x; }

static inline v16f vselect(v16i m, v16f a, v16f b) { return (v16f)(((v16i)a & m) | ((v16i)b & ~m)); }

/* exp_neg (jr_numerics.h) lane by lane */
static inline v16f vexp_neg(v16f x) {
  x = vselect(x < -87.0f, vsplat(-87.0f), x);
  const v16f n = (x * 1.44269504089f + 12582912.0f) - 12582912.0f;
  const v16f r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  v16f p = vsplat(1.3981999507e-3f);
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
  return p * (v16f)e;
}

static inline v16f vsilu(v16f g) {
  const v16f ag = (v16f)((v16i)g & 0x7fffffff);  /* fabsf */
  const v16f e = vexp_neg(-ag);
  return vselect(g >= 0.0f, g, g * e) / (1.0f + e);
}

static inline float silu(float g) {
  const float e = exp_neg(-fabsf(g));
  return (g >= 0.0f ? g : g * e) / (1.0f + e);
}

#endif
