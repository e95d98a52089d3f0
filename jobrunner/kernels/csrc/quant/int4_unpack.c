/* jobrunner.quant.int4_native: the CPU int4 layout read back as float32 / bfloat16 (the dequantize tiles) and as
   int8 (int4's W4A8 path). Built by jobrunner.kernels.load (cached per source, headers, flags and CPU) and called
   through ctypes; no torch headers. */
#include <stdint.h>
#include "jr_kernels.h"
#include "jr_numerics.h"
/* W^T[k, n] = code(n, k) * scale[k / group, n] + offset[k / group, n] for whole blocks of the CPU int4
   layout: packed is [nb][K][half] bytes; split: rows j and j + half of a block share byte j (low, high);
   interleaved: rows 2j and 2j + 1. out, scale and offset have rows of ld >= nb * block_n elements.
   Two outputs: float32, and bfloat16 (rounded to nearest even, as torch's float -> bfloat16 conversion: the
   values are finite, so to_bf16_finite). */
static inline float as_f32(float x) { return x; }
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
UNPACK(jr_int4_unpack_t_bf16, uint16_t, to_bf16_finite)

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
