/* Scalar numerics shared by jobrunner's native kernels: bf16 conversion that rounds as torch does, the exp used by
   every online softmax and activation (its constants also serve the vector form in jr_simd.h), and the x86
   widening of bf16 to float32. Included by the kernels' C files; kernels/build.py passes this directory with -I
   and hashes these headers into the build key. */
#ifndef JR_NUMERICS_H
#define JR_NUMERICS_H
#include <stdint.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* bf16 -> float32: exact, the 16 bits into the high half */
static inline float from_bf16(uint16_t h) { union { uint32_t u; float f; } v = {(uint32_t)h << 16}; return v.f; }

/* float32 -> bf16, round to nearest even as torch rounds, for values known not to be NaN (dequantized weights,
   scaled integer sums): a NaN here may come out as an inf or with its sign flipped */
static inline uint16_t to_bf16_finite(float x) {
  union { float f; uint32_t u; } v = {x};
  return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* round to nearest even, as torch rounds; NaN stays NaN (quieted) */
static inline uint16_t to_bf16(float x) {
  union { float f; uint32_t u; } v = {x};
  if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 64u);
  return to_bf16_finite(x);
}

static inline float round_bf16(float x) { return from_bf16(to_bf16(x)); }

/* exp(x) for x <= 0 (Cody-Waite reduction, degree-6 polynomial, ~2 ulp); branch-free so it vectorizes. The
   constants are shared with the lane-wise form (jr_simd.h), which runs the very same operations. */
#define JR_EXP_MIN -87.0f
#define JR_EXP_LOG2E 1.44269504089f
#define JR_EXP_ROUND 12582912.0f /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
#define JR_EXP_LN2_HI 0.693145751953125f
#define JR_EXP_LN2_LO 1.428606765330187e-06f
#define JR_EXP_P6 1.3981999507e-3f
#define JR_EXP_P5 8.3334519073e-3f
#define JR_EXP_P4 4.1665795894e-2f
#define JR_EXP_P3 1.6666665459e-1f
#define JR_EXP_P2 5.0000001201e-1f

static inline float exp_neg(float x) {
  x = x < JR_EXP_MIN ? JR_EXP_MIN : x;
  const float n = (x * JR_EXP_LOG2E + JR_EXP_ROUND) - JR_EXP_ROUND;  /* round(x / ln 2) */
  const float r = (x - n * JR_EXP_LN2_HI) - n * JR_EXP_LN2_LO;
  float p = JR_EXP_P6;
  p = p * r + JR_EXP_P5;
  p = p * r + JR_EXP_P4;
  p = p * r + JR_EXP_P3;
  p = p * r + JR_EXP_P2;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  union { uint32_t u; float f; } two_n = {(uint32_t)((int32_t)n + 127) << 23};
  return p * two_n.f;
}

/* bf16 -> float32 widening of a whole register (exact): 16 values on AVX-512, 8 on AVX2 */
#if defined(__AVX512F__)
static inline __m512 widen_bf16x16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
#endif
#if defined(__AVX2__)
static inline __m256 widen_bf16x8(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
#endif
#endif
