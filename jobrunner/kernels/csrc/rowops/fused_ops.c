/* Fused row-wise ops of the Llama-family decoder for CPU (jobrunner/models/fused_ops.py calls them via ctypes).

   Each replaces a chain of 4-10 torch kernels (each a pass over the activations and an allocation) by one pass:
   - jr_rms_norm: optional residual add (written back), then weight * (r * rsqrt(mean(r^2) + eps)), with the
     roundings to the model dtype where torch has them (after the add, before the weight, after the weight);
   - jr_rotary: q and k rotated in place (x * cos + rotate_half(x) * sin, rounding each product and the sum);
   - jr_silu_mul: silu(gate) * up of a fused gate|up projection.
   Tensors are float32 or bfloat16 (bf16 = 1), rows contiguous (row strides given where views are allowed);
   outputs do not overlap inputs (but for rotary's, in place).
   Arithmetic is float32; a row's result depends on that row alone (batch-invariant). Built without floating-
   point contraction so products round as torch's do. All three run 16 lanes at a time with the scalar code's
   operations: bit-identical to it, NaN / inf / denormals included (tested against the scalar tail, a numpy model
   and the torch ops), except for which of two NaNs meeting in one product or sum comes out (the compiler orders
   the operands of a commutative operation; that was never fixed and differs between -march builds).

   bf16 rounding: the exact path rounds in integer operations (to_bf16 of jr_numerics.h, lane by lane). Where
   the build targets AVX512_BF16, a fast path rounds 32 lanes per vcvtne2ps2bf16, which gives to_bf16's bits
   for every input but a denormal (flushed to zero); it makes sure no value it rounds is denormal (or NaN / inf)
   and otherwise redoes the row (rotary: the token) on the exact path, so the results are the exact path's.
   Threads only where the work pays for an OpenMP region (PARALLEL). bf16, 64 rows, 2-core Xeon with
   AVX512_BF16, 2 threads, called from C: rms_norm + add of 576 26 -> 6.3 us, SiLU*up of 1,536 46 -> 27 us,
   rotary of 12 heads x 64 14 -> 5.7 us (2,048 rows: 418 -> 200, 1,509 -> 908, 418 -> 181 us). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "jr_kernels.h"
#include "jr_numerics.h"
#include "jr_simd.h"

#if defined(__AVX512BW__)
#include <immintrin.h>
#endif


/* 16 lanes through GCC vector extensions (v16f ...: jr_simd.h; AVX-512: one zmm; AVX2: two ymm): each lane runs
   the scalar code's very operations (no contraction in this file), so the vector and scalar paths give the same
   bits (exp_neg lane by lane: vexp_neg16). */
static inline v16f vload_f32(const float *p) { v16f v; memcpy(&v, p, sizeof v); return v; }

static inline void vstore_f32(float *p, v16f v) { memcpy(p, &v, sizeof v); }

static inline v16f vsplat(float x) { return (v16f){0} + x; }

static inline v16f vselect(v16i m, v16f a, v16f b) { return (v16f)(((v16i)a & m) | ((v16i)b & ~m)); }

static inline v16f vsilu(v16f g) {
  const v16f ag = (v16f)((v16i)g & 0x7fffffff);  /* fabsf */
  const v16f e = vexp_neg16(-ag);
  return vselect(g >= 0.0f, g, g * e) / (1.0f + e);
}

static inline float silu(float g) {
  const float e = exp_neg(-fabsf(g));
  return (g >= 0.0f ? g : g * e) / (1.0f + e);
}


#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define JR_NATIVE_BF16 1
/* The fast path. vcvtne2ps2bf16 rounds 32 floats (lo: elements 0-15, hi: 16-31) as to_bf16 does (nearest even
   by the same integer add, inf kept, NaN quieted by the same bit: Intel SDM convert_fp32_to_bfloat16), except
   that a denormal input becomes a signed zero. Checked in bulk, not per vector: low keeps the lane-wise minimum
   of |bits| - 1 (zero wraps to the top) over the values rounded, high the maximum of |bits| where asked; a
   kernel returns 1 when a value it rounded was denormal (or under a larger bound it needs) or when a NaN or an
   inf came up, and its outputs are then redone on the exact path (NaN payloads stay the exact path's too). */
static inline __m512i cvt2_bf16(v16f lo, v16f hi) { return (__m512i)_mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo); }

static inline __m256i cvt_bf16(v16f x) { return (__m256i)_mm512_cvtneps_pbh((__m512)x); }

static inline v16u track_low(v16u low, v16f x) {
  return (v16u)_mm512_min_epu32((__m512i)(((v16u)x & 0x7fffffffu) - 1u), (__m512i)low);
}

static inline v16u track_high(v16u high, v16f x) {
  return (v16u)_mm512_max_epu32((__m512i)((v16u)x & 0x7fffffffu), (__m512i)high);
}

/* whether a tracked nonzero value was under the magnitude with these float32 bits */
static inline int below(v16u low, uint32_t magnitude_bits) {
  return _mm512_cmplt_epu32_mask((__m512i)low, _mm512_set1_epi32((int)(magnitude_bits - 1u))) != 0;
}

static inline int not_finite(v16u high) {
  return _mm512_cmpge_epu32_mask((__m512i)high, _mm512_set1_epi32(0x7f800000)) != 0;
}

/* Whether every bf16 of p[0..n) is zero or of a magnitude (bits) in lo .. hi */
static inline __attribute__((always_inline)) int bf16_tame(const uint16_t *p, int64_t n, int lo, int hi) {
  const __m512i one = _mm512_set1_epi16(1), magnitude = _mm512_set1_epi16(0x7fff);
  __m512i low = _mm512_set1_epi16(-1), high = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512i a = _mm512_and_si512(_mm512_loadu_si512(p + i), magnitude);
    low = _mm512_min_epu16(low, _mm512_sub_epi16(a, one));  /* zero wraps to the top */
    high = _mm512_max_epu16(high, a);
  }
  if (i < n) {  /* the last lanes; those past the end read as zero */
    const __m512i a = _mm512_and_si512(_mm512_maskz_loadu_epi16((1u << (n - i)) - 1u, p + i), magnitude);
    low = _mm512_min_epu16(low, _mm512_sub_epi16(a, one));
    high = _mm512_max_epu16(high, a);
  }
  return !_mm512_cmplt_epu16_mask(low, _mm512_set1_epi16((short)(lo - 1)))
         && !_mm512_cmpgt_epu16_mask(high, _mm512_set1_epi16((short)hi));
}

#define LOW_NONE ((v16u){0} + 0xffffffffu)
#define MIN_NORMAL 0x00800000u  /* FLT_MIN's bits: below it, denormal */
#define TWO_M60 0x21800000u     /* 2^-60: a product of two values of at least it is normal (or zero, or inf) */
#endif


/* ---- RMSNorm ---- */

/* float32 row: pass 1 r = x (+ add, written to sum_out), r^2 summed in 16 partial sums, lane j taking the
   elements i % 16 == j, then the 16 in order (a fixed order, the same in every build); pass 2 w * (r * inv). */
static void norm_row_f32(const float *restrict x, const float *restrict add, float *restrict sum_out,
                         float *restrict out, const float *restrict w, int64_t n, float eps) {
  const float *r = add ? sum_out : x;
  v16f part = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    v16f v = vload_f32(x + i);
    if (add) {
      v = v + vload_f32(add + i);
      vstore_f32(sum_out + i, v);
    }
    part += v * v;
  }
  for (int j = 0; i < n; i++, j++) {
    float v = x[i];
    if (add) sum_out[i] = v = v + add[i];
    part[j] += v * v;
  }
  float ss = 0.0f;
  for (int j = 0; j < 16; j++) ss += part[j];
  const float inv = 1.0f / sqrtf(ss / (float)n + eps);
  for (i = 0; i + 16 <= n; i += 16) vstore_f32(out + i, vload_f32(w + i) * (vload_f32(r + i) * inv));
  for (; i < n; i++) out[i] = w[i] * (r[i] * inv);
}

/* bf16 row, exact path: as norm_row_f32, the sum rounded to bf16 (and written to sum_out), then
   round(w * round(r * inv)). r: a float32 row of scratch (the row as rounded); wf: the weight in float32. */
static void norm_row_bf16(const uint16_t *restrict x, const uint16_t *restrict add, uint16_t *restrict sum_out,
                          uint16_t *restrict out, const float *restrict wf, int64_t n, float eps, float *restrict r) {
  v16f part = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    v16f v = vload_bf16(x + i);
    if (add) {
      v = vround_bf16(v + vload_bf16(add + i));
      vstore_bf16(sum_out + i, v);
    }
    vstore_f32(r + i, v);
    part += v * v;
  }
  for (int j = 0; i < n; i++, j++) {
    r[i] = from_bf16(x[i]);
    if (add) {
      sum_out[i] = to_bf16(r[i] + from_bf16(add[i]));
      r[i] = from_bf16(sum_out[i]);
    }
    part[j] += r[i] * r[i];
  }
  float ss = 0.0f;
  for (int j = 0; j < 16; j++) ss += part[j];
  const float inv = 1.0f / sqrtf(ss / (float)n + eps);
  for (i = 0; i + 16 <= n; i += 16) vstore_bf16(out + i, vload_f32(wf + i) * vround_bf16(vload_f32(r + i) * inv));
  for (; i < n; i++) out[i] = to_bf16(wf[i] * round_bf16(r[i] * inv));
}

/* Threads only for calls with enough work: an OpenMP region costs ~1.5 us with 2 warm threads (and ~0.3 us even
   on one thread, so none is entered below the bar), a row of these ops 0.1-0.4 us at 576 wide. */
#define PARALLEL(threads, work) ((threads) > 1 && (work) > 16384)

struct norm_args {
  const void *x, *add;
  void *sum_out, *out;
  const void *w;  /* float32: the weight as given; bf16: the weight widened */
  int64_t n;
  float eps;
  int fast;
};

#ifdef JR_NATIVE_BF16
/* norm_row_bf16 of rows t .. t + R - 1 on the fast path, 32 lanes a step, R = 2: two rows in lockstep (a row's
   sum of squares and rsqrt are a long dependent chain); 1 where the rows must be redone. The weight must be finite
   with no nonzero value under 2^-60: then w * round(t) is normal wherever t = r * inv is at least 2^-60, and a NaN
   or an inf anywhere in a row (x, add, their sum, inv) shows up in t. */
static inline __attribute__((always_inline)) int norm_rows_bf16_native(const struct norm_args *a, int64_t t,
                                                                       const int R, float *const r[2]) {
  const int64_t n = a->n;
  const float *wf = a->w;
  const uint16_t *x[2], *add[2];
  uint16_t *sum_out[2], *out[2];
  for (int k = 0; k < R; k++) {
    x[k] = (const uint16_t *)a->x + (t + k) * n;
    add[k] = a->add ? (const uint16_t *)a->add + (t + k) * n : NULL;
    sum_out[k] = a->add ? (uint16_t *)a->sum_out + (t + k) * n : NULL;
    out[k] = (uint16_t *)a->out + (t + k) * n;
  }
  v16u low_sum = LOW_NONE, low_t = LOW_NONE, high_t = {0};
  v16f part[2] = {{0}, {0}};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int k = 0; k < R; k++) {
      v16f v0 = vload_bf16(x[k] + i), v1 = vload_bf16(x[k] + i + 16);
      if (a->add) {
        v0 = v0 + vload_bf16(add[k] + i);
        v1 = v1 + vload_bf16(add[k] + i + 16);
        low_sum = track_low(track_low(low_sum, v0), v1);
        const __m512i h = cvt2_bf16(v0, v1);
        _mm512_storeu_si512(sum_out[k] + i, h);
        v0 = widen_lo(h);
        v1 = widen_hi(h);
      }
      vstore_f32(r[k] + i, v0);
      vstore_f32(r[k] + i + 16, v1);
      part[k] += v0 * v0;
      part[k] += v1 * v1;
    }
  }
  const int64_t vec = i + 16 <= n ? i + 16 : i;  /* a last 16 lanes, then the scalar tail */
  float inv[2];
  for (int k = 0; k < R; k++) {
    if (vec > i) {
      v16f v = vload_bf16(x[k] + i);
      if (a->add) {
        v = v + vload_bf16(add[k] + i);
        low_sum = track_low(low_sum, v);
        const __m256i h = cvt_bf16(v);
        _mm256_storeu_si256((__m256i *)(sum_out[k] + i), h);
        v = widen_lo(_mm512_castsi256_si512(h));
      }
      vstore_f32(r[k] + i, v);
      part[k] += v * v;
    }
    for (int64_t j = vec; j < n; j++) {  /* exact */
      r[k][j] = from_bf16(x[k][j]);
      if (a->add) {
        sum_out[k][j] = to_bf16(r[k][j] + from_bf16(add[k][j]));
        r[k][j] = from_bf16(sum_out[k][j]);
      }
      part[k][j - vec] += r[k][j] * r[k][j];
    }
    float ss = 0.0f;
    for (int j = 0; j < 16; j++) ss += part[k][j];
    inv[k] = 1.0f / sqrtf(ss / (float)n + a->eps);
  }
  for (i = 0; i + 32 <= n; i += 32) {
    for (int k = 0; k < R; k++) {
      const v16f t0 = vload_f32(r[k] + i) * inv[k], t1 = vload_f32(r[k] + i + 16) * inv[k];
      low_t = track_low(track_low(low_t, t0), t1);
      high_t = track_high(track_high(high_t, t0), t1);
      const __m512i h = cvt2_bf16(t0, t1);
      _mm512_storeu_si512(out[k] + i,
                          cvt2_bf16(vload_f32(wf + i) * widen_lo(h), vload_f32(wf + i + 16) * widen_hi(h)));
    }
  }
  int redo = 0;
  for (int k = 0; k < R; k++) {
    if (vec > i) {
      const v16f t = vload_f32(r[k] + i) * inv[k];
      low_t = track_low(low_t, t);
      high_t = track_high(high_t, t);
      const v16f o = vload_f32(wf + i) * widen_lo(_mm512_castsi256_si512(cvt_bf16(t)));
      _mm256_storeu_si256((__m256i *)(out[k] + i), cvt_bf16(o));
    }
    for (int64_t j = vec; j < n; j++) out[k][j] = to_bf16(wf[j] * round_bf16(r[k][j] * inv[k]));
    redo |= !isfinite(inv[k]);
  }
  return redo || below(low_sum, MIN_NORMAL) || below(low_t, TWO_M60) || not_finite(high_t);
}
#endif

/* rows 2p and 2p + 1 (if there is one) */
static void norm_pair(const struct norm_args *a, int bf16, int64_t p, int64_t rows) {
  const int64_t n = a->n, t = 2 * p, nr = t + 1 < rows ? 2 : 1;
  if (!bf16) {
    for (int64_t k = 0; k < nr; k++) {
      const int64_t at = (t + k) * n;
      norm_row_f32((const float *)a->x + at, a->add ? (const float *)a->add + at : NULL,
                   a->add ? (float *)a->sum_out + at : NULL, (float *)a->out + at, a->w, n, a->eps);
    }
    return;
  }
  float r0[n], r1[n];  /* the rows as rounded */
  float *const r[2] = {r0, r1};
#ifdef JR_NATIVE_BF16
  if (a->fast && (nr == 2 ? !norm_rows_bf16_native(a, t, 2, r) : !norm_rows_bf16_native(a, t, 1, r))) return;
#endif
  (void)r;
  for (int64_t k = 0; k < nr; k++) {
    const int64_t at = (t + k) * n;
    norm_row_bf16((const uint16_t *)a->x + at, a->add ? (const uint16_t *)a->add + at : NULL,
                  a->add ? (uint16_t *)a->sum_out + at : NULL, (uint16_t *)a->out + at, a->w, n, a->eps, r0);
  }
}

/* out = norm(x (+ add)); with add, x + add is also written to sum_out. n <= 32768. */
int jr_rms_norm(const void *x, const void *add, void *sum_out, void *out, const void *weight, int64_t rows,
                int64_t n, float eps, int64_t bf16, int64_t threads) {
  if (n > 32768) return 1;
  float wf[bf16 ? n : 1];  /* bf16: the weight in float32, once */
  struct norm_args a = {x, add, sum_out, out, weight, n, eps, 0};
  if (bf16) {
    const uint16_t *w = weight;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) vstore_f32(wf + i, vload_bf16(w + i));
    for (; i < n; i++) wf[i] = from_bf16(w[i]);
    a.w = wf;
#ifdef JR_NATIVE_BF16
    a.fast = bf16_tame(w, n, 0x2180, 0x7f7f);  /* finite, nothing nonzero under 2^-60 (norm_rows_bf16_native) */
#endif
  }
  const int64_t pairs = (rows + 1) / 2;
  if (PARALLEL(threads, rows * n)) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < pairs; p++) norm_pair(&a, (int)bf16, p, rows);
  } else {
    for (int64_t p = 0; p < pairs; p++) norm_pair(&a, (int)bf16, p, rows);
  }
  return 0;
}


/* ---- rotary ---- */

/* One head of one token rotated in place, 16 lane pairs at a time: first half x1 * c1 - x2 * s1, second half
   x2 * c2 + x1 * s2 (c, s: the token's cos / sin, half = D / 2); in bf16 each product and each sum rounded. */
static void rotate_head_f32(float *restrict x, const float *restrict c, const float *restrict s, int64_t half) {
  int64_t i = 0;
  for (; i + 16 <= half; i += 16) {
    const v16f x1 = vload_f32(x + i), x2 = vload_f32(x + half + i);
    const v16f a = x1 * vload_f32(c + i), b = -x2 * vload_f32(s + i);
    const v16f p = x2 * vload_f32(c + half + i), r = x1 * vload_f32(s + half + i);
    vstore_f32(x + i, a + b);
    vstore_f32(x + half + i, p + r);
  }
  for (; i < half; i++) {
    const float x1 = x[i], x2 = x[i + half];
    const float a = x1 * c[i], b = -x2 * s[i], p = x2 * c[i + half], r = x1 * s[i + half];
    x[i] = a + b;
    x[i + half] = p + r;
  }
}

static inline void rotate_tail_bf16(uint16_t *restrict x, const float *restrict c, const float *restrict s,
                                    int64_t i, int64_t half) {
  for (; i < half; i++) {
    const float x1 = from_bf16(x[i]), x2 = from_bf16(x[i + half]);
    const float a = round_bf16(x1 * c[i]), b = round_bf16(-x2 * s[i]);
    const float p = round_bf16(x2 * c[i + half]), r = round_bf16(x1 * s[i + half]);
    x[i] = to_bf16(a + b);
    x[i + half] = to_bf16(p + r);
  }
}

static void rotate_head_bf16(uint16_t *restrict x, const float *restrict c, const float *restrict s, int64_t half) {
  int64_t i = 0;
  for (; i + 16 <= half; i += 16) {
    const v16f x1 = vload_bf16(x + i), x2 = vload_bf16(x + half + i);
    const v16f a = vround_bf16(x1 * vload_f32(c + i)), b = vround_bf16(-x2 * vload_f32(s + i));
    const v16f p = vround_bf16(x2 * vload_f32(c + half + i)), r = vround_bf16(x1 * vload_f32(s + half + i));
    vstore_bf16(x + i, a + b);
    vstore_bf16(x + half + i, p + r);
  }
  rotate_tail_bf16(x, c, s, i, half);
}

#ifdef JR_NATIVE_BF16
/* rotate_head_bf16 on the fast path (its inputs checked by bf16_tame) */
static inline __attribute__((always_inline)) void rotate_head_bf16_native(uint16_t *restrict x,
                                                                         const float *restrict c,
                                                                         const float *restrict s, int64_t half) {
  int64_t i = 0;
  for (; i + 16 <= half; i += 16) {
    const v16f x1 = vload_bf16(x + i), x2 = vload_bf16(x + half + i);
    const __m512i ab = cvt2_bf16(x1 * vload_f32(c + i), -x2 * vload_f32(s + i));
    const __m512i pr = cvt2_bf16(x2 * vload_f32(c + half + i), x1 * vload_f32(s + half + i));
    const __m512i o = cvt2_bf16(widen_lo(ab) + widen_hi(ab), widen_lo(pr) + widen_hi(pr));
    _mm256_storeu_si256((__m256i *)(x + i), _mm512_castsi512_si256(o));
    _mm256_storeu_si256((__m256i *)(x + half + i), _mm512_extracti64x4_epi64(o, 1));
  }
  rotate_tail_bf16(x, c, s, i, half);
}
#endif

struct rotary_args {
  void *q, *k;
  const void *cos, *sin;
  int64_t hq, hk, D, qs, ks;
  int cs_tame;
};

static void rotate_token(const struct rotary_args *a, int bf16, int64_t t) {
  const int64_t D = a->D, half = D / 2;
  if (!bf16) {
    const float *c = (const float *)a->cos + t * D, *s = (const float *)a->sin + t * D;
    for (int64_t h = 0; h < a->hq; h++) rotate_head_f32((float *)a->q + t * a->qs + h * D, c, s, half);
    for (int64_t h = 0; h < a->hk; h++) rotate_head_f32((float *)a->k + t * a->ks + h * D, c, s, half);
    return;
  }
  float c[D], s[D];  /* the token's cos / sin widened once for all its heads */
  const uint16_t *cb = (const uint16_t *)a->cos + t * D, *sb = (const uint16_t *)a->sin + t * D;
  uint16_t *q = (uint16_t *)a->q + t * a->qs, *k = (uint16_t *)a->k + t * a->ks;
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) {
    vstore_f32(c + i, vload_bf16(cb + i));
    vstore_f32(s + i, vload_bf16(sb + i));
  }
  for (; i < D; i++) {
    c[i] = from_bf16(cb[i]);
    s[i] = from_bf16(sb[i]);
  }
#ifdef JR_NATIVE_BF16
  if (a->cs_tame && bf16_tame(q, a->hq * D, 0x2680, 0x5d80) && bf16_tame(k, a->hk * D, 0x2680, 0x5d80)) {
    for (int64_t h = 0; h < a->hq; h++) rotate_head_bf16_native(q + h * D, c, s, half);
    for (int64_t h = 0; h < a->hk; h++) rotate_head_bf16_native(k + h * D, c, s, half);
    return;
  }
#endif
  for (int64_t h = 0; h < a->hq; h++) rotate_head_bf16(q + h * D, c, s, half);
  for (int64_t h = 0; h < a->hk; h++) rotate_head_bf16(k + h * D, c, s, half);
}

/* q [T, hq, D] and k [T, hk, D] in place (row strides qs, ks elements; a row's heads contiguous);
   cos / sin [T, D] contiguous. D even, <= 4096. */
int jr_rotary(void *q, void *k, const void *cos_, const void *sin_, int64_t rows, int64_t hq, int64_t hk,
              int64_t D, int64_t qs, int64_t ks, int64_t bf16, int64_t threads) {
  if (D % 2 || D > 4096) return 1;
  struct rotary_args a = {q, k, cos_, sin_, hq, hk, D, qs, ks, 0};
#ifdef JR_NATIVE_BF16
  /* The fast path needs every value of cos, sin and the token's q, k zero or 2^-50 .. 2^60: then every product
     rotary rounds is zero or 2^-100 .. 2^120, a sum of two rounded products zero or a multiple of 2^-107 under
     2^121: nothing it rounds is denormal, no inf or NaN comes up. cos / sin checked here, q / k per token. */
  a.cs_tame = bf16 && bf16_tame(cos_, rows * D, 0x2680, 0x5d80) && bf16_tame(sin_, rows * D, 0x2680, 0x5d80);
#endif
  if (PARALLEL(threads, rows * (hq + hk) * D)) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < rows; t++) rotate_token(&a, (int)bf16, t);
  } else {
    for (int64_t t = 0; t < rows; t++) rotate_token(&a, (int)bf16, t);
  }
  return 0;
}


/* ---- SiLU * up ---- */

static void silu_row_bf16(const uint16_t *restrict g, const uint16_t *restrict u, uint16_t *restrict o, int64_t I) {
  int64_t i = 0;
  for (; i + 16 <= I; i += 16) vstore_bf16(o + i, vround_bf16(vsilu(vload_bf16(g + i))) * vload_bf16(u + i));
  for (; i < I; i++) o[i] = to_bf16(round_bf16(silu(from_bf16(g[i]))) * from_bf16(u[i]));
}

#ifdef JR_NATIVE_BF16
/* vsilu on 4 vectors, each step across all four (one vector's steps are a chain of ~25 dependent operations, too
   long for the out-of-order window alone); the same operations lane by lane, with AVX-512 forms of the selects
   (max(-87, x) is x < -87 ? -87 : x; -|g| sets the sign bit) */
static inline void vsilu4(v16f s[4], const v16f g[4]) {
  v16f x[4], n[4], r[4], p[4], e[4];
  for (int k = 0; k < 4; k++) x[k] = _mm512_max_ps(vsplat(-87.0f), (v16f)((v16i)g[k] | (int32_t)0x80000000));
  for (int k = 0; k < 4; k++) n[k] = (x[k] * 1.44269504089f + 12582912.0f) - 12582912.0f;
  for (int k = 0; k < 4; k++) r[k] = (x[k] - n[k] * 0.693145751953125f) - n[k] * 1.428606765330187e-06f;
  for (int k = 0; k < 4; k++) p[k] = vsplat(1.3981999507e-3f) * r[k] + 8.3334519073e-3f;
  for (int k = 0; k < 4; k++) p[k] = p[k] * r[k] + 4.1665795894e-2f;
  for (int k = 0; k < 4; k++) p[k] = p[k] * r[k] + 1.6666665459e-1f;
  for (int k = 0; k < 4; k++) p[k] = p[k] * r[k] + 5.0000001201e-1f;
  for (int k = 0; k < 4; k++) p[k] = p[k] * r[k] + 1.0f;
  for (int k = 0; k < 4; k++) p[k] = p[k] * r[k] + 1.0f;
  for (int k = 0; k < 4; k++) e[k] = p[k] * (v16f)((__builtin_convertvector(n[k], v16i) + 127) << 23);
  for (int k = 0; k < 4; k++)
    s[k] = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g[k], vsplat(0.0f), _CMP_GE_OQ), g[k] * e[k], g[k]) / (1.0f + e[k]);
}

/* round(silu(g)) * u of 32 lanes (two vectors each) rounded into o; the rounded values tracked */
static inline void silu_mul32(uint16_t *o, v16f s0, v16f s1, const uint16_t *u, v16u *low, v16u *high) {
  const __m512i h = cvt2_bf16(s0, s1);
  const v16f o0 = widen_lo(h) * vload_bf16(u), o1 = widen_hi(h) * vload_bf16(u + 16);
  *low = track_low(track_low(track_low(track_low(*low, s0), s1), o0), o1);
  *high = track_high(track_high(*high, o0), o1);
  _mm512_storeu_si512(o, cvt2_bf16(o0, o1));
}

/* silu_row_bf16 on the fast path, 64 lanes a step; 1 where the row must be redone (silu of a finite gate is
   finite: a NaN or an inf from gate or up shows up in the product) */
static int silu_row_bf16_native(const uint16_t *restrict g, const uint16_t *restrict u, uint16_t *restrict o,
                                int64_t I) {
  v16u low = LOW_NONE, high = {0};
  int64_t i = 0;
  for (; i + 64 <= I; i += 64) {
    v16f gv[4], sv[4];
    for (int k = 0; k < 4; k++) gv[k] = vload_bf16(g + i + 16 * k);
    vsilu4(sv, gv);
    silu_mul32(o + i, sv[0], sv[1], u + i, &low, &high);
    silu_mul32(o + i + 32, sv[2], sv[3], u + i + 32, &low, &high);
  }
  for (; i + 32 <= I; i += 32)
    silu_mul32(o + i, vsilu(vload_bf16(g + i)), vsilu(vload_bf16(g + i + 16)), u + i, &low, &high);
  if (i + 16 <= I) {
    const v16f s = vsilu(vload_bf16(g + i));
    const v16f p = widen_lo(_mm512_castsi256_si512(cvt_bf16(s))) * vload_bf16(u + i);
    low = track_low(track_low(low, s), p);
    high = track_high(high, p);
    _mm256_storeu_si256((__m256i *)(o + i), cvt_bf16(p));
    i += 16;
  }
  for (; i < I; i++) o[i] = to_bf16(round_bf16(silu(from_bf16(g[i]))) * from_bf16(u[i]));
  return below(low, MIN_NORMAL) || not_finite(high);
}
#endif

static void silu_mul_row(const void *gate_up, void *out, int64_t I, int bf16, int64_t t) {
  if (bf16) {
    const uint16_t *g = (const uint16_t *)gate_up + t * 2 * I;
    uint16_t *o = (uint16_t *)out + t * I;
#ifdef JR_NATIVE_BF16
    if (!silu_row_bf16_native(g, g + I, o, I)) return;
#endif
    silu_row_bf16(g, g + I, o, I);
  } else {
    const float *g = (const float *)gate_up + t * 2 * I, *u = g + I;
    float *o = (float *)out + t * I;
    int64_t i = 0;
    for (; i + 16 <= I; i += 16) vstore_f32(o + i, vsilu(vload_f32(g + i)) * vload_f32(u + i));
    for (; i < I; i++) o[i] = silu(g[i]) * u[i];
  }
}

/* out [T, I] = silu(gate) * up, gate_up [T, 2I] (gate first); silu(g) = g / (1 + exp(-g)), from exp(-|g|) */
int jr_silu_mul(const void *gate_up, void *out, int64_t rows, int64_t I, int64_t bf16, int64_t threads) {
  if (I > 32768) return 1;
  if (PARALLEL(threads, 2 * rows * I)) {  /* ~2x the work of a norm per element */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < rows; t++) silu_mul_row(gate_up, out, I, (int)bf16, t);
  } else {
    for (int64_t t = 0; t < rows; t++) silu_mul_row(gate_up, out, I, (int)bf16, t);
  }
  return 0;
}
