/* Vectors through GCC's vector extensions, shared by the kernels that compute lane-wise (paged_attention.c,
   fused_ops.c): the vector types, exp_neg lane by lane (the scalar form's constants and operations, from
   jr_numerics.h) and the bf16 loads, stores and rounding of 16 lanes, each lane giving the scalar code's bits. */
#ifndef JR_SIMD_H
#define JR_SIMD_H
#include <stdint.h>
#include <string.h>
#include "jr_numerics.h"
#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

/* The build's register: VL float lanes (AVX-512: 16, AVX2: 8, otherwise 4) */
#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX2__)
#define VL 8
#else
#define VL 4
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));

/* 16 lanes whatever the build (AVX-512: one zmm; AVX2: two ymm) */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

/* exp_neg lane by lane for a vector type V (VI: its int32 lanes): NAME clamps below JR_EXP_MIN as exp_neg does
   (a NaN lane stays NaN); NAME##_reduced takes lanes already in [JR_EXP_MIN, 0] */
#define JR_DEFINE_VEXP_NEG(NAME, V, VI)                                                                      \
  static inline V NAME##_reduced(V x) {                                                                      \
    const V n = (x * JR_EXP_LOG2E + JR_EXP_ROUND) - JR_EXP_ROUND;                                            \
    const V r = (x - n * JR_EXP_LN2_HI) - n * JR_EXP_LN2_LO;                                                 \
    V p = (V){0} + JR_EXP_P6;                                                                                \
    p = p * r + JR_EXP_P5;                                                                                   \
    p = p * r + JR_EXP_P4;                                                                                   \
    p = p * r + JR_EXP_P3;                                                                                   \
    p = p * r + JR_EXP_P2;                                                                                   \
    p = p * r + 1.0f;                                                                                        \
    p = p * r + 1.0f;                                                                                        \
    const VI e = (__builtin_convertvector(n, VI) + 127) << 23;                                               \
    return p * (V)e;                                                                                         \
  }                                                                                                          \
  static inline V NAME##_select(VI m, V a, V b) { return (V)(((VI)a & m) | ((VI)b & ~m)); }                 \
  static inline V NAME(V x) {                                                                                \
    x = NAME##_select(x < JR_EXP_MIN, (V){0} + JR_EXP_MIN, x);                                               \
    return NAME##_reduced(x);                                                                                \
  }

JR_DEFINE_VEXP_NEG(vexp_neg16, v16f, v16i)
JR_DEFINE_VEXP_NEG(vexp_negv, vf, vi)

/* 16 bf16 -> float32 (exact) */
#if defined(__AVX512BW__)
/* by one vpermw: word k (+ 16 for the high half) of h to the upper half of 32-bit lane k, the lower half zeroed
   by the mask */
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
#endif
