/* jobrunner.quant.w8a8_native: W8A8's row quantization and output scaling, one pass each (the same numbers as the
   torch ops in jobrunner.quant.primitives). Built by jobrunner.kernels.load, called through ctypes. */
#include <stdint.h>
#include <math.h>
#include "jr_kernels.h"
#include "jr_numerics.h"
static inline float bits_f32(uint32_t u) { union { uint32_t u; float f; } v = {u}; return v.f; }
static inline float as_f32(float x) { return x; }
/* Per row: s = max|x| / 127 (1 for a zero row), then the bytes rint(x / s) + zp. |x| of a finite float orders
   like its bits with the sign cleared: an integer max, which vectorizes. zp 128 gives oneDNN's u8 input, zp 0
   the int8 codes themselves (two's complement). One function per input type (bits T, sign-clear MASK). */
#define QUANT(NAME, T, MASK, TO_F32)                                                                          \
  void NAME(const T* x, uint8_t* q, float* scale, int64_t M, int64_t K, int64_t zp, int64_t threads) {      \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if(M * K >= 262144)")                    \
    for (int64_t m = 0; m < M; m++) {                                                                        \
      const T* r = x + m * K;                                                                                \
      T top = 0;                                                                                             \
      for (int64_t k = 0; k < K; k++) { T a = r[k] & MASK; top = a > top ? a : top; }                        \
      float amax = TO_F32(top), s = amax > 0.f ? amax / 127.f : 1.f;                                         \
      scale[m] = s;                                                                                          \
      uint8_t* o = q + m * K;                                                                                \
      for (int64_t k = 0; k < K; k++) o[k] = (uint8_t)((int32_t)rintf(TO_F32(r[k]) / s) + (int32_t)zp);     \
    }                                                                                                        \
  }
QUANT(jr_w8a8_quant_bf16, uint16_t, 0x7fffu, from_bf16)
QUANT(jr_w8a8_quant_f32, uint32_t, 0x7fffffffu, bits_f32)
void jr_w8a8_rowscale_bf16(const float* y, const float* s, uint16_t* out, int64_t M, int64_t N, int64_t threads) {
  _Pragma("omp parallel for num_threads(threads) schedule(static) if(M * N >= 262144)")
  for (int64_t m = 0; m < M; m++)
    for (int64_t n = 0; n < N; n++) out[m * N + n] = to_bf16_finite(y[m * N + n] * s[m]);
}
void jr_w8a8_rowscale_f32(float* y, const float* s, int64_t M, int64_t N, int64_t threads) {
  _Pragma("omp parallel for num_threads(threads) schedule(static) if(M * N >= 262144)")
  for (int64_t m = 0; m < M; m++)
    for (int64_t n = 0; n < N; n++) y[m * N + n] *= s[m];
}
/* an int32 GEMM result to its value: out[m, n] = acc[m, n] * sn[n] * sm[m] (float32 products in this order);
   out has rows of ldo elements (a column slice of a wider output) */
#define I32_SCALE(NAME, OUT_T, STORE)                                                                         \
  void NAME(const int32_t* acc, const float* sm, const float* sn, OUT_T* out, int64_t M, int64_t N,          \
            int64_t ldo, int64_t threads) {                                                                  \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if(M * N >= 262144)")                    \
    for (int64_t m = 0; m < M; m++)                                                                          \
      for (int64_t n = 0; n < N; n++) out[m * ldo + n] = STORE((float)acc[m * N + n] * sn[n] * sm[m]);       \
  }
I32_SCALE(jr_i32_scale_bf16, uint16_t, to_bf16_finite)
I32_SCALE(jr_i32_scale_f32, float, as_f32)
