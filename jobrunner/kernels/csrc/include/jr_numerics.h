/* Scalar numerics shared by jobrunner's native kernels (attention/csrc, models/csrc): bf16 conversion that
   rounds as torch does, and the exp used by every online softmax and activation. Included by the kernels'
   C files; quant/native.py passes this directory with -I and hashes these headers into the build key. */
#ifndef JR_NUMERICS_H
#define JR_NUMERICS_H
#include <stdint.h>

static inline float from_bf16(uint16_t h) { union { uint32_t u; float f; } v = {(uint32_t)h << 16}; return v.f; }

/* round to nearest even, as torch rounds; NaN stays NaN */
static inline uint16_t to_bf16(float x) {
  union { float f; uint32_t u; } v = {x};
  if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 64u);
  return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float x) { return from_bf16(to_bf16(x)); }

/* exp(x) for x <= 0 (Cody-Waite reduction, degree-6 polynomial, ~2 ulp); branch-free so it vectorizes */
static inline float exp_neg(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = (x * 1.44269504089f + 12582912.0f) - 12582912.0f;  /* round(x / ln 2) */
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  union { uint32_t u; float f; } two_n = {(uint32_t)((int32_t)n + 127) << 23};
  return p * two_n.f;
}
#endif
