/* Fused row-wise ops of the Llama-family decoder for CPU (jobrunner/models/fused_ops.py calls them via ctypes).

   Each replaces a chain of 4-10 torch kernels (each a pass over the activations and an allocation) by one pass:
   - jr_rms_norm: optional residual add (written back), then weight * (r * rsqrt(mean(r^2) + eps)), with the
     roundings to the model dtype where torch has them (after the add, before the weight, after the weight);
   - jr_rotary: q and k rotated in place (x * cos + rotate_half(x) * sin, rounding each product and the sum);
   - jr_silu_mul: silu(gate) * up of a fused gate|up projection.
   Tensors are float32 or bfloat16 (bf16 = 1), rows contiguous (row strides given where views are allowed).
   Arithmetic is float32; a row's result depends on that row alone (batch-invariant). Built without floating-
   point contraction so products round as torch's do. The bf16 norm and SiLU*up run 16 lanes at a time with the
   scalar code's operations (bit-identical, NaN / inf / denormals included: tested against the scalar build);
   SiLU*up of 64 x 1,536 bf16 went 70 -> 50 us on a 2-core Xeon (AVX-512). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "jr_numerics.h"


/* 16 lanes through GCC vector extensions (AVX-512: one zmm; AVX2: two ymm): each lane runs the scalar code's
   very operations (no contraction in this file), so the vector and scalar paths give the same bits. */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

static inline v16f vload_bf16(const uint16_t *p) {
  v16h h;
  memcpy(&h, p, sizeof h);
  return (v16f)(__builtin_convertvector(h, v16u) << 16);
}

static inline v16f vload_f32(const float *p) { v16f v; memcpy(&v, p, sizeof v); return v; }

/* to_bf16 lane by lane: round to nearest even, NaN kept quiet */
static inline void vstore_bf16(uint16_t *p, v16f x) {
  const v16u u = (v16u)x;
  const v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const v16i nan = (v16i)((u & 0x7fffffffu) > 0x7f800000u);
  const v16u bits = (v16u)(((v16i)((u >> 16) | 64u) & nan) | ((v16i)rounded & ~nan));
  const v16h h = __builtin_convertvector(bits, v16h);
  memcpy(p, &h, sizeof h);
}

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

static void load_row(const void *p, int64_t at, int64_t n, int bf16, float *dst) {
  if (bf16) {
    const uint16_t *s = (const uint16_t *)p + at;
    for (int64_t i = 0; i < n; i++) dst[i] = from_bf16(s[i]);
  } else {
    memcpy(dst, (const float *)p + at, sizeof(float) * (size_t)n);
  }
}

static void store_row(void *p, int64_t at, int64_t n, int bf16, const float *src) {
  if (bf16) {
    uint16_t *d = (uint16_t *)p + at;
    for (int64_t i = 0; i < n; i++) d[i] = to_bf16(src[i]);
  } else {
    memcpy((float *)p + at, src, sizeof(float) * (size_t)n);
  }
}

/* sum of squares in 16 partial sums (a fixed order that vectorizes) */
static inline float sum_squares(const float *restrict r, int64_t n) {
  float part[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; j++) part[j] += r[i + j] * r[i + j];
  for (; i < n; i++) part[i % 16] += r[i] * r[i];
  float ss = 0.0f;
  for (int j = 0; j < 16; j++) ss += part[j];
  return ss;
}

static void norm_row_f32(const float *restrict x, const float *restrict add, float *restrict sum_out,
                         float *restrict out, const float *restrict w, int64_t n, float eps) {
  const float *r = x;
  if (add) {
    for (int64_t i = 0; i < n; i++) sum_out[i] = x[i] + add[i];
    r = sum_out;
  }
  const float inv = 1.0f / sqrtf(sum_squares(r, n) / (float)n + eps);
  for (int64_t i = 0; i < n; i++) out[i] = w[i] * (r[i] * inv);
}

static void norm_row_bf16(const uint16_t *restrict x, const uint16_t *restrict add, uint16_t *restrict sum_out,
                          uint16_t *restrict out, const uint16_t *restrict w, int64_t n, float eps, float *restrict r) {
  int64_t i = 0;
  if (add) {
    for (; i + 16 <= n; i += 16) {
      const v16f s = vround_bf16(vload_bf16(x + i) + vload_bf16(add + i));
      vstore_bf16(sum_out + i, s);
      memcpy(r + i, &s, sizeof s);
    }
    for (; i < n; i++) {
      const uint16_t s = to_bf16(from_bf16(x[i]) + from_bf16(add[i]));
      sum_out[i] = s;
      r[i] = from_bf16(s);
    }
  } else {
    for (; i + 16 <= n; i += 16) {
      const v16f v = vload_bf16(x + i);
      memcpy(r + i, &v, sizeof v);
    }
    for (; i < n; i++) r[i] = from_bf16(x[i]);
  }
  const float inv = 1.0f / sqrtf(sum_squares(r, n) / (float)n + eps);
  for (i = 0; i + 16 <= n; i += 16)
    vstore_bf16(out + i, vload_bf16(w + i) * vround_bf16(vload_f32(r + i) * inv));
  for (; i < n; i++) out[i] = to_bf16(from_bf16(w[i]) * round_bf16(r[i] * inv));
}

/* out = norm(x (+ add)); with add, x + add is also written to sum_out. n <= 32768. */
int jr_rms_norm(const void *x, const void *add, void *sum_out, void *out, const void *weight, int64_t rows,
                int64_t n, float eps, int64_t bf16, int64_t threads) {
  if (n > 32768) return 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n > 65536)
  for (int64_t t = 0; t < rows; t++) {
    if (bf16) {
      float r[n];
      norm_row_bf16((const uint16_t *)x + t * n, add ? (const uint16_t *)add + t * n : NULL,
                    add ? (uint16_t *)sum_out + t * n : NULL, (uint16_t *)out + t * n, weight, n, eps, r);
    } else {
      norm_row_f32((const float *)x + t * n, add ? (const float *)add + t * n : NULL,
                   add ? (float *)sum_out + t * n : NULL, (float *)out + t * n, weight, n, eps);
    }
  }
  return 0;
}

/* x [heads, D] of one token rotated in place: first half x1 * c1 - x2 * s1, second x2 * c2 + x1 * s2 */
static void rotate_heads(void *x, int64_t at, int64_t heads, int64_t D, const float *c, const float *s, int bf16,
                         float *buf) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; h++) {
    load_row(x, at + h * D, D, bf16, buf);
    float o[D];
    for (int64_t i = 0; i < half; i++) {
      float a = buf[i] * c[i], b = -buf[i + half] * s[i];
      float p = buf[i + half] * c[i + half], r = buf[i] * s[i + half];
      if (bf16) {
        a = round_bf16(a); b = round_bf16(b); p = round_bf16(p); r = round_bf16(r);
      }
      o[i] = a + b;
      o[i + half] = p + r;
    }
    store_row(x, at + h * D, D, bf16, o);
  }
}

/* q [T, hq, D] and k [T, hk, D] in place (row strides qs, ks elements; a row's heads contiguous);
   cos / sin [T, D] contiguous. D even, <= 4096. */
int jr_rotary(void *q, void *k, const void *cos_, const void *sin_, int64_t rows, int64_t hq, int64_t hk,
              int64_t D, int64_t qs, int64_t ks, int64_t bf16, int64_t threads) {
  if (D % 2 || D > 4096) return 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * (hq + hk) * D > 32768)
  for (int64_t t = 0; t < rows; t++) {
    float c[D], s[D], buf[D];
    load_row(cos_, t * D, D, (int)bf16, c);
    load_row(sin_, t * D, D, (int)bf16, s);
    rotate_heads(q, t * qs, hq, D, c, s, (int)bf16, buf);
    rotate_heads(k, t * ks, hk, D, c, s, (int)bf16, buf);
  }
  return 0;
}


static inline float silu(float g) {
  const float e = exp_neg(-fabsf(g));
  return (g >= 0.0f ? g : g * e) / (1.0f + e);
}

/* out [T, I] = silu(gate) * up, gate_up [T, 2I] (gate first); silu(g) = g / (1 + exp(-g)), from exp(-|g|) */
int jr_silu_mul(const void *gate_up, void *out, int64_t rows, int64_t I, int64_t bf16, int64_t threads) {
  if (I > 32768) return 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * I > 65536)
  for (int64_t t = 0; t < rows; t++) {
    if (bf16) {
      const uint16_t *g = (const uint16_t *)gate_up + t * 2 * I, *u = g + I;
      uint16_t *o = (uint16_t *)out + t * I;
      int64_t i = 0;
      for (; i + 16 <= I; i += 16)
        vstore_bf16(o + i, vround_bf16(vsilu(vload_bf16(g + i))) * vload_bf16(u + i));
      for (; i < I; i++) o[i] = to_bf16(round_bf16(silu(from_bf16(g[i]))) * from_bf16(u[i]));
    } else {
      const float *g = (const float *)gate_up + t * 2 * I, *u = g + I;
      float *o = (float *)out + t * I;
      for (int64_t i = 0; i < I; i++) o[i] = silu(g[i]) * u[i];
    }
  }
  return 0;
}
