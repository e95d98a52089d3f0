/* Paged attention over the KV cache in place, for CPU (jobrunner/attention/cpu_paged.py calls it via ctypes).

   Cache of one layer: [num_slots, num_kv_heads, D], slot = block_id * block_size + offset; q: [T, H, D];
   out: [T, H * D]. Row i owns tokens query_start[i] .. + query_len[i] - 1 at positions seq_len[i] - query_len[i]
   .. seq_len[i] - 1 and attends to keys 0 .. its own position (and, with a window w, only to the last w).

   The reduction order of one query vector (one token x one query head) is fixed by absolute key positions
   alone, so its result never depends on the other rows of the step, on how its prompt was chunked, on the
   block size or on the thread count (engine.deterministic relies on this):
   - keys are cut into partitions of PART positions (aligned to 0), each partition into tiles of TILE;
   - inside a partition an online softmax runs over its tiles in order, from a fresh state, over exactly the
     keys the query may see (attend_tile);
   - the partitions' states are folded left to right (merge_state), then normalised (finish).
   Work items are (row, kv head, a few query tokens, partitions): the n_rep query heads of a kv head share every
   K/V tile read, and so do the query tokens of a prompt-chunk item (flash-style tiles, causal by position).
   When a step has fewer decode (row, kv head) pairs than threads, long decodes are split into one item per
   partition (split-K) whose states are folded afterwards in the same left-to-right order.
   Arithmetic in float32; bf16 inputs are widened on load and the output rounded to nearest even, as torch
   rounds. An fp8 cache (kv_fp8 1: e4m3fn, 2: e5m2; jobrunner/attention/kv_quant.py) has rows of D codes and
   a float32 scale (D + 4 bytes per slot and kv head); load_tile, the one place that reads the cache, widens a
   tile's codes times their row's scale into float32 (every path below then runs as for bf16). The loops are written so that the compiler vectorizes them for the -march of the build. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "jr_kernels.h"
#include "jr_numerics.h"
#include "jr_simd.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define TILE 16   /* keys per tile (aligned to absolute position) */
#define PART 512  /* keys per partition, the split-K unit (aligned to absolute position) */
#define QTILE 8   /* query tokens per prompt-chunk work item */

typedef struct {
  const void *q, *k_cache, *v_cache;
  void *out;
  const int64_t *query_start, *query_len, *seq_len, *tables;
  int64_t max_blocks, num_heads, num_kv_heads, head_dim, block_size, window, bf16;
  int64_t kv_fp8;  /* 0: the cache holds q's dtype; 1 / 2: fp8 e4m3fn / e5m2 codes with per-row scales */
  float scale;
  int64_t fast_min_query;  /* rows with at least this many query tokens take the fast path (0: none do) */
  /* decode rows sharing cached prefix blocks (may be 0 groups): group g's rows are group_rows[group_off[g] ..
     group_off[g + 1] - 1], its first group_len[g] keys are shared; key_start[row] is where a row's own keys
     start (0 outside groups) */
  int64_t num_groups;
  const int64_t *group_off, *group_rows, *group_len, *key_start;
  float *shared_states, *suffix_states;  /* [num_rows * num_heads * (D + 2)] each, for grouped rows */
} Args;

/* partial >= 0: a split decode's partition; -1: write the output; FAST: a fast prompt-chunk item (lanes t0..t1) */
typedef struct { int64_t row, kvh, t0, t1, c0, c1, partial; } Item;
#define FAST (-2)
#define GROUPED (-3)  /* a grouped decode's own keys: its state waits for the merge with the shared part */
#define SHARED (-4)   /* a group's shared keys against its rows' queries (row = the group, lanes t0..t1) */



/* q . k for 4 keys at once (head_dim % 16 == 0). The order is fixed and the same on every path: 16 partial
   sums per key (lane i takes d = i, i + 16, ...; lanes 0-7 and 8-15 are two vector accumulators), then
   a[i] = p[i] + p[i + 8] and ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)), which is what the AVX2
   horizontal adds below compute for 4 keys together. */
#if defined(__AVX512F__)
/* the same sums as the AVX2 version below: lane i of one zmm accumulator is the AVX2 lo (i < 8) or hi (i >= 8)
   lane, fused multiply-adds over d in the same order; then lo + hi and the same horizontal adds */
static inline void dot4(const float *restrict q, const float *const k[4], int64_t D, float *out) {
  __m512 acc[4];
  for (int j = 0; j < 4; j++) acc[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 qv = _mm512_loadu_ps(q + d);
    for (int j = 0; j < 4; j++) acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[j] + d), acc[j]);
  }
  __m256 lo[4];
  for (int j = 0; j < 4; j++)
    lo[j] = _mm256_add_ps(_mm512_castps512_ps256(acc[j]),
                          _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[j]), 1)));
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(lo[0], lo[1]), _mm256_hadd_ps(lo[2], lo[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline void dot4(const float *restrict q, const float *const k[4], int64_t D, float *out) {
  __m256 lo[4], hi[4];
  for (int j = 0; j < 4; j++) lo[j] = hi[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m256 ql = _mm256_loadu_ps(q + d), qh = _mm256_loadu_ps(q + d + 8);
    for (int j = 0; j < 4; j++) {
      lo[j] = _mm256_fmadd_ps(ql, _mm256_loadu_ps(k[j] + d), lo[j]);
      hi[j] = _mm256_fmadd_ps(qh, _mm256_loadu_ps(k[j] + d + 8), hi[j]);
    }
  }
  for (int j = 0; j < 4; j++) lo[j] = _mm256_add_ps(lo[j], hi[j]);
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(lo[0], lo[1]), _mm256_hadd_ps(lo[2], lo[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
#else
static inline void dot4(const float *restrict q, const float *const k[4], int64_t D, float *out) {
  for (int j = 0; j < 4; j++) {
    float p[16] = {0}, a[8];
    for (int64_t d = 0; d < D; d += 16)
      for (int i = 0; i < 16; i++) p[i] += q[d + i] * k[j][d + i];
    for (int i = 0; i < 8; i++) a[i] = p[i] + p[i + 8];
    out[j] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
  }
}
#endif


/* Vectors of VL lanes (vf, vi: jr_simd.h), shared by the decode tile's softmax and the fast path below; a fast
   item holds NV registers of query lanes. */
#if defined(__AVX512F__)
#define NV 2
#else
#define NV 1
#endif
#define ITEM_LANES (VL * NV)

static inline vf ldv(const float *p) { vf v; __builtin_memcpy(&v, p, sizeof v); return v; }
static inline void stv(float *p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
static inline vf splat(float x) { return (vf){0} + x; }
static inline vf vselect(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }
static inline vf vmax(vf a, vf b) { return vselect(a > b, a, b); }

/* exp(x) lane-wise for x <= 0 (exp_neg's reduction and polynomial, jr_simd.h). Lanes are clamped with vmax,
   so a NaN lane (a score minus a max of -inf) counts as JR_EXP_MIN, where exp_neg would keep the NaN. */
static inline vf vexp_neg(vf x) { return vexp_negv_reduced(vmax(x, splat(JR_EXP_MIN))); }

/* One query vector against keys lo .. hi - 1 of a tile (lo < hi). st: [acc[D], max, sum]. Not inlined: the
   decode and the prompt paths must run the very same instructions for a query. */
__attribute__((noinline)) static void attend_tile(const float *restrict q, const float *restrict k, int64_t ks,
                                                  const float *restrict v, int64_t vs, int lo, int hi, float scale,
                                                  float *restrict st, int64_t D) {
  float s[TILE];
  float mx = st[D];
  for (int j = lo; j < hi; j += 4) {  /* past hi, key hi - 1 stands in (its score is dropped) */
    const float *kj[4];
    float dots[4];
    for (int i = 0; i < 4; i++) kj[i] = k + (j + i < hi ? j + i : hi - 1) * ks;
    dot4(q, kj, D, dots);
    for (int i = 0; i < 4 && j + i < hi; i++) s[j + i] = dots[i] * scale;
  }
#if defined(__AVX512F__)
  {  /* the tile's keys in the lanes of one register: max exactly, then the same exp_neg lane by lane */
    const __mmask16 m = (__mmask16)(((1u << (hi - lo)) - 1u) << lo);
    const __m512 sv = _mm512_maskz_loadu_ps(m, s);
    const float tmax = _mm512_mask_reduce_max_ps(m, sv);
    mx = tmax > mx ? tmax : mx;
    _mm512_mask_storeu_ps(s, m, (__m512)vexp_neg((vf)_mm512_sub_ps(sv, _mm512_set1_ps(mx))));
  }
  const float alpha = exp_neg(st[D] - mx);
#else
  for (int j = lo; j < hi; j++) mx = s[j] > mx ? s[j] : mx;
  const float alpha = exp_neg(st[D] - mx);
  for (int j = lo; j < hi; j++) s[j] = exp_neg(s[j] - mx);
#endif
  float sum = 0.0f;
  for (int j = lo; j < hi; j++) sum += s[j];
  st[D] = mx;
  st[D + 1] = st[D + 1] * alpha + sum;
  /* acc = acc * alpha + sum_j p_j v_j (per lane: one multiply, then one fused multiply-add per key in order),
     16 lanes at a time kept in registers across the tile's keys (AVX-512: 64 lanes, four zmm registers, each
     key's weight broadcast once for them) */
#if defined(__AVX512F__)
  if (D % 64 == 0) {
    const __m512 a = _mm512_set1_ps(alpha);
    for (int64_t d = 0; d < D; d += 64) {
      __m512 r0 = _mm512_mul_ps(_mm512_loadu_ps(st + d), a), r1 = _mm512_mul_ps(_mm512_loadu_ps(st + d + 16), a);
      __m512 r2 = _mm512_mul_ps(_mm512_loadu_ps(st + d + 32), a), r3 = _mm512_mul_ps(_mm512_loadu_ps(st + d + 48), a);
      for (int j = lo; j < hi; j++) {
        const __m512 pj = _mm512_set1_ps(s[j]);
        const float *vj = v + j * vs + d;
        r0 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vj), r0);
        r1 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vj + 16), r1);
        r2 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vj + 32), r2);
        r3 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vj + 48), r3);
      }
      _mm512_storeu_ps(st + d, r0);
      _mm512_storeu_ps(st + d + 16, r1);
      _mm512_storeu_ps(st + d + 32, r2);
      _mm512_storeu_ps(st + d + 48, r3);
    }
    return;
  }
#endif
  for (int64_t d = 0; d < D; d += 16) {
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 a = _mm256_set1_ps(alpha);
    __m256 lo8 = _mm256_mul_ps(_mm256_loadu_ps(st + d), a), hi8 = _mm256_mul_ps(_mm256_loadu_ps(st + d + 8), a);
    for (int j = lo; j < hi; j++) {
      const __m256 pj = _mm256_set1_ps(s[j]);
      lo8 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + j * vs + d), lo8);
      hi8 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + j * vs + d + 8), hi8);
    }
    _mm256_storeu_ps(st + d, lo8);
    _mm256_storeu_ps(st + d + 8, hi8);
#else
    float acc[16];
    for (int i = 0; i < 16; i++) acc[i] = st[d + i] * alpha;
    for (int j = lo; j < hi; j++)
      for (int i = 0; i < 16; i++) acc[i] += s[j] * v[j * vs + d + i];
    for (int i = 0; i < 16; i++) st[d + i] = acc[i];
#endif
  }
}

/* the next tile's K and V rows (n rows of D floats, stride rs) on their way to the cache */
static inline void prefetch_rows(const float *k, const float *v, int64_t n, int64_t rs, int64_t D) {
  for (int64_t j = 0; j < n; j++)
    for (int64_t d = 0; d < D; d += 16) {
      __builtin_prefetch(k + j * rs + d);
      __builtin_prefetch(v + j * rs + d);
    }
}

/* into = into (+) part, two online-softmax states over disjoint keys (into came first) */
__attribute__((noinline)) static void merge_state(float *restrict into, const float *restrict part, int64_t D) {
  const float mx = into[D] > part[D] ? into[D] : part[D];
  const float a = exp_neg(into[D] - mx), b = exp_neg(part[D] - mx);
  for (int64_t d = 0; d < D; d++) into[d] = into[d] * a + part[d] * b;
  into[D + 1] = into[D + 1] * a + part[D + 1] * b;
  into[D] = mx;
}

__attribute__((noinline)) static void finish(const float *restrict st, void *out, int64_t index, int64_t D,
                                             int64_t bf16) {
  const float inv = 1.0f / st[D + 1];
  if (bf16) {
    uint16_t *o = (uint16_t *)out + index;
    for (int64_t d = 0; d < D; d++) o[d] = to_bf16(st[d] * inv);
  } else {
    float *o = (float *)out + index;
    for (int64_t d = 0; d < D; d++) o[d] = st[d] * inv;
  }
}

static inline void reset(float *st, int64_t n, int64_t D) {
  for (int64_t i = 0; i < n; i++) {
    memset(st + i * (D + 2), 0, sizeof(float) * D);
    st[i * (D + 2) + D] = -INFINITY;
    st[i * (D + 2) + D + 1] = 0.0f;
  }
}

/* first key a query at position pos may see */
static inline int64_t first_key(const Args *a, int64_t pos) {
  return a->window > 0 && pos - a->window + 1 > 0 ? pos - a->window + 1 : 0;
}

/* D bf16 values widened to float32 (exact: a shift into the high half) */
static inline void widen_bf16(const uint16_t *restrict src, float *restrict dst, int64_t D) {
  int64_t d = 0;
#if defined(__AVX512F__)
  for (; d + 16 <= D; d += 16) _mm512_storeu_ps(dst + d, widen_bf16x16(_mm256_loadu_si256((const __m256i *)(src + d))));
#elif defined(__AVX2__)
  for (; d + 8 <= D; d += 8) _mm256_storeu_ps(dst + d, widen_bf16x8(_mm_loadu_si128((const __m128i *)(src + d))));
#endif
  for (; d < D; d++) dst[d] = from_bf16(src[d]);
}

/* fp8 code -> the fp16 bits of the same value. e5m2: exactly its top byte. e4m3fn: the code's bits one place
   lower, sign kept (an arithmetic shift of code << 8, then bit 14 cleared): exponent bias 7 instead of 15, so
   the half is 2^-8 times the value and the caller's scale carries the 2^8. Subnormal codes land on subnormal
   halves, exactly. Codes never hold NaN: writes clamp (kv_quant.py). */
static inline uint16_t fp8_half_bits(uint16_t x, int64_t fmt) {
  const int16_t top = (int16_t)(uint16_t)(x << 8);
  return fmt == 2 ? (uint16_t)top : (uint16_t)((uint16_t)(top >> 1) & 0xbfffu);
}

static inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  union { uint32_t u; float f; } v;
  if (e == 0) {  /* zero or subnormal: m * 2^-24 */
    v.f = (float)m * 5.9604644775390625e-8f;
    v.u |= sign;
  } else {
    v.u = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
  }
  return v.f;
}

/* D fp8 codes of one row times the row's scale (the float32 after its codes), widened to float32; F16C
   converts 16 (AVX-512) or 8 (AVX2) halves per instruction */
static inline void widen_fp8(const uint8_t *restrict src, int64_t fmt, float *restrict dst, int64_t D) {
  float scale;
  memcpy(&scale, src + D, sizeof scale);
  if (fmt == 1) scale *= 256.0f;
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 sv = _mm512_set1_ps(scale);
  for (; d + 16 <= D; d += 16) {
    __m256i w = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + d))), 8);
    if (fmt == 1) w = _mm256_and_si256(_mm256_srai_epi16(w, 1), _mm256_set1_epi16((short)0xbfff));
    _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_cvtph_ps(w), sv));
  }
#elif defined(__AVX2__) && defined(__F16C__)
  const __m256 sv = _mm256_set1_ps(scale);
  for (; d + 8 <= D; d += 8) {
    __m128i w = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(src + d))), 8);
    if (fmt == 1) w = _mm_and_si128(_mm_srai_epi16(w, 1), _mm_set1_epi16((short)0xbfff));
    _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtph_ps(w), sv));
  }
#endif
  for (; d < D; d++) dst[d] = half_to_float(fp8_half_bits(src[d], fmt)) * scale;
}

/* Keys k0 .. k0 + n - 1 of kv head kvh of a row: pointers into the cache when they are contiguous float32
   rows of one block, else widened / gathered into buf ([2][TILE][D]). Returns the row stride. */
static int64_t load_tile(const Args *a, const int64_t *table, int64_t kvh, int64_t k0, int64_t n, float *buf,
                         const float **k, const float **v) {
  const int64_t D = a->head_dim, bs = a->block_size, row = a->num_kv_heads * D;
  if (a->kv_fp8) {  /* rows of D codes + 4 scale bytes */
    const int64_t rb = a->num_kv_heads * (D + 4);
    for (int64_t j = 0; j < n; j++) {
      const int64_t p = k0 + j, at = (table[p / bs] * bs + p % bs) * rb + kvh * (D + 4);
      widen_fp8((const uint8_t *)a->k_cache + at, a->kv_fp8, buf + j * D, D);
      widen_fp8((const uint8_t *)a->v_cache + at, a->kv_fp8, buf + (TILE + j) * D, D);
    }
    *k = buf;
    *v = buf + TILE * D;
    return D;
  }
  if (!a->bf16 && (k0 % bs) + n <= bs) {
    const int64_t slot = table[k0 / bs] * bs + k0 % bs;
    *k = (const float *)a->k_cache + slot * row + kvh * D;
    *v = (const float *)a->v_cache + slot * row + kvh * D;
    return row;
  }
  if (a->bf16 && (k0 % bs) + n <= bs) {  /* one block: its rows are evenly spaced */
    const int64_t at = (table[k0 / bs] * bs + k0 % bs) * row + kvh * D;
    const uint16_t *ks = (const uint16_t *)a->k_cache + at, *vs = (const uint16_t *)a->v_cache + at;
    for (int64_t j = 0; j < n; j++) {
      widen_bf16(ks + j * row, buf + j * D, D);
      widen_bf16(vs + j * row, buf + (TILE + j) * D, D);
    }
    *k = buf;
    *v = buf + TILE * D;
    return D;
  }
  for (int64_t j = 0; j < n; j++) {
    const int64_t p = k0 + j, at = (table[p / bs] * bs + p % bs) * row + kvh * D;
    float *kd = buf + j * D, *vd = buf + (TILE + j) * D;
    if (a->bf16) {
      widen_bf16((const uint16_t *)a->k_cache + at, kd, D);
      widen_bf16((const uint16_t *)a->v_cache + at, vd, D);
    } else {
      memcpy(kd, (const float *)a->k_cache + at, sizeof(float) * D);
      memcpy(vd, (const float *)a->v_cache + at, sizeof(float) * D);
    }
  }
  *k = buf;
  *v = buf + TILE * D;
  return D;
}

static void load_queries(const Args *a, const Item *it, int64_t n_rep, float *qb) {
  const int64_t D = a->head_dim, H = a->num_heads, start = a->query_start[it->row];
  for (int64_t t = it->t0; t < it->t1; t++)
    for (int64_t r = 0; r < n_rep; r++) {
      const int64_t at = ((start + t) * H + it->kvh * n_rep + r) * D;
      float *dst = qb + ((t - it->t0) * n_rep + r) * D;
      if (a->bf16)
        for (int64_t d = 0; d < D; d++) dst[d] = from_bf16(((const uint16_t *)a->q)[at + d]);
      else
        memcpy(dst, (const float *)a->q + at, sizeof(float) * D);
    }
}

/* One partition of an item: every tile of keys in it against the item's query vectors (fresh states in part);
   seen[t] is set for tokens that saw at least one key */
static void run_partition(const Args *a, const Item *it, int64_t c, int64_t n_rep, const float *qb, float *part,
                          float *buf, char *seen) {
  const int64_t D = a->head_dim, row = it->row, nt = it->t1 - it->t0;
  const int64_t first_pos = a->seq_len[row] - a->query_len[row] + it->t0, last_pos = first_pos + nt - 1;
  const int64_t *table = a->tables + row * a->max_blocks;
  const int64_t own = a->key_start ? a->key_start[row] : 0;  /* a grouped decode's keys start after the shared */
  int64_t lo = first_key(a, first_pos), hi = last_pos + 1;
  lo = own > lo ? own : lo;
  lo = lo > c * PART ? lo : c * PART;
  hi = hi < (c + 1) * PART ? hi : (c + 1) * PART;
  for (int64_t k0 = lo - lo % TILE; k0 < hi; k0 += TILE) {
    const int64_t n = hi - k0 < TILE ? hi - k0 : TILE;
    const float *k, *v;
    const int64_t stride = load_tile(a, table, it->kvh, k0, n, buf, &k, &v);
    if (k0 + TILE < hi && (k0 + TILE) % a->block_size == 0) {  /* next tile starts a new block */
      const int64_t next = k0 + TILE, rows = hi - next < TILE ? hi - next : TILE, bs = a->block_size;
      const int64_t at = ((table[next / bs] * bs) * a->num_kv_heads + it->kvh) * D;
      if (a->kv_fp8)  /* rows of D + 4 bytes (a multiple of 4): offset and strides in floats */
        prefetch_rows((const float *)a->k_cache + at / D * (D + 4) / 4, (const float *)a->v_cache + at / D * (D + 4) / 4,
                      rows, a->num_kv_heads * (D + 4) / 4, (D + 4) / 4);
      else if (a->bf16)  /* bf16 rows are half as long: prefetch_rows steps 16 floats = 32 bf16 at a time */
        prefetch_rows((const float *)((const uint16_t *)a->k_cache + at),
                      (const float *)((const uint16_t *)a->v_cache + at), rows, a->num_kv_heads * D / 2, D / 2);
      else
        prefetch_rows((const float *)a->k_cache + at, (const float *)a->v_cache + at, rows, a->num_kv_heads * D, D);
    }
    for (int64_t t = 0; t < nt; t++) {
      const int64_t pos = first_pos + t, fk = first_key(a, pos), f = own > fk ? own : fk;
      const int64_t j0 = f > k0 ? f - k0 : 0, j1 = pos + 1 - k0 < n ? pos + 1 - k0 : n;
      if (j0 >= j1) continue;
      seen[t] = 1;
      for (int64_t r = 0; r < n_rep; r++)
        attend_tile(qb + (t * n_rep + r) * D, k, stride, v, stride, (int)j0, (int)j1, a->scale,
                    part + (t * n_rep + r) * (D + 2), D);
    }
  }
}

static void run_item(const Args *a, const Item *it, float *work, float *partials) {
  const int64_t D = a->head_dim, n_rep = a->num_heads / a->num_kv_heads, nt = it->t1 - it->t0;
  const int64_t nv = nt * n_rep, sd = D + 2;
  float *qb = work, *run = qb + nv * D, *part = run + nv * sd, *buf = part + nv * sd;
  char seen[QTILE], have[QTILE] = {0};
  load_queries(a, it, n_rep, qb);
  for (int64_t c = it->c0; c <= it->c1; c++) {
    reset(part, nv, D);
    memset(seen, 0, sizeof seen);
    run_partition(a, it, c, n_rep, qb, part, buf, seen);
    for (int64_t t = 0; t < nt; t++) {
      if (!seen[t]) continue;
      float *rt = run + t * n_rep * sd, *pt = part + t * n_rep * sd;
      if (!have[t]) memcpy(rt, pt, sizeof(float) * n_rep * sd);
      else for (int64_t r = 0; r < n_rep; r++) merge_state(rt + r * sd, pt + r * sd, D);
      have[t] = 1;
    }
  }
  if (it->partial >= 0 || it->partial == GROUPED) {  /* a split decode's partition, or a grouped decode's own keys */
    float *dst = it->partial >= 0 ? partials + it->partial * n_rep * sd
                                  : a->suffix_states + (it->row * a->num_kv_heads + it->kvh) * n_rep * sd;
    if (have[0]) memcpy(dst, run, sizeof(float) * n_rep * sd);
    else reset(dst, n_rep, D);
    return;
  }
  const int64_t start = a->query_start[it->row];
  for (int64_t t = 0; t < nt; t++)
    for (int64_t r = 0; r < n_rep; r++)
      finish(run + (t * n_rep + r) * sd, a->out, ((start + it->t0 + t) * a->num_heads + it->kvh * n_rep + r) * D,
             D, a->bf16);
}

/* Fold the split partitions of one (decode row, kv head), left to right, and write its output */
static void fold_split(const Args *a, const Item *first, int64_t num_parts, const float *partials, float *work) {
  const int64_t D = a->head_dim, n_rep = a->num_heads / a->num_kv_heads, sd = D + 2;
  int have = 0;
  for (int64_t p = 0; p < num_parts; p++) {
    const float *st = partials + (first->partial + p) * n_rep * sd;
    if (st[D + 1] == 0.0f && st[D] == -INFINITY) continue;  /* no key of this partition visible */
    if (!have) memcpy(work, st, sizeof(float) * n_rep * sd);
    else for (int64_t r = 0; r < n_rep; r++) merge_state(work + r * sd, st + r * sd, D);
    have = 1;
  }
  const int64_t start = a->query_start[first->row];
  for (int64_t r = 0; r < n_rep; r++)
    finish(work + r * sd, a->out, (start * a->num_heads + first->kvh * n_rep + r) * D, D, a->bf16);
}


/* ---- The fast prompt-chunk path (rows with query_len >= fast_min_query; not batch-invariant) ----
   Query vectors in vector lanes: a work item is ITEM_LANES consecutive (token, query head) pairs of one row
   and kv head, NV registers of VL floats each (AVX-512: 2 x 16, AVX2: 1 x 8, otherwise 1 x 4: as many as the
   register file holds the accumulators of), its queries transposed once into qt[D][ITEM_LANES] (pre-scaled).
   Per tile of 16 keys the scores of all lanes come from D x 16 x NV fused multiply-adds, each key element
   broadcast once for the NV registers; the online softmax runs lane-wise (no horizontal reduction anywhere);
   the output is kept transposed, acc[D][ITEM_LANES], and updated with each value element broadcast: every
   arithmetic instruction works on a full register of query vectors. */
/* one tile of n (<= TILE) keys, rows k / v with stride rs, against the item's lanes. mask: some lane's
   position or window hides some key of the tile (else every key is visible to every lane) */
static void fast_tile(const float *restrict qt, const float *restrict k, const float *restrict v, int64_t rs,
                      int64_t n, int64_t k0, const int32_t *pos, const int32_t *fk, int mask, float *restrict acc,
                      float *restrict m, float *restrict l, int64_t D) {
  vf s[TILE][NV];
  for (int jb = 0; jb < TILE; jb += 8) {
    const float *kr[8];
    for (int jj = 0; jj < 8; jj++) kr[jj] = k + (jb + jj < n ? jb + jj : n - 1) * rs;
    vf a[8][NV];
    for (int jj = 0; jj < 8; jj++)
      for (int w = 0; w < NV; w++) a[jj][w] = splat(0.0f);
    for (int64_t d = 0; d < D; d++) {
      vf qd[NV];
      for (int w = 0; w < NV; w++) qd[w] = ldv(qt + d * ITEM_LANES + w * VL);
      for (int jj = 0; jj < 8; jj++) {
        const float kd = kr[jj][d];
        for (int w = 0; w < NV; w++) a[jj][w] += qd[w] * kd;
      }
    }
    for (int jj = 0; jj < 8; jj++)
      for (int w = 0; w < NV; w++) s[jb + jj][w] = a[jj][w];
  }
  for (int w = 0; w < NV; w++) {
    vi vis[TILE];
    if (mask) {
      vi p, f;
      __builtin_memcpy(&p, pos + w * VL, sizeof p);
      __builtin_memcpy(&f, fk + w * VL, sizeof f);
      for (int j = 0; j < TILE; j++) {
        const int32_t key = (int32_t)(k0 + j);
        vis[j] = (key <= p) & (key >= f) & (j < n ? -1 : 0);
        s[j][w] = vselect(vis[j], s[j][w], splat(-INFINITY));
      }
    }
    const vf m_old = ldv(m + w * VL);
    vf m_new = m_old;
    for (int j = 0; j < TILE; j++) m_new = vmax(m_new, s[j][w]);
    const vf alpha = vexp_neg(m_old - m_new);
    vf sum = splat(0.0f);
    for (int j = 0; j < TILE; j++) {
      s[j][w] = vexp_neg(s[j][w] - m_new);
      if (mask) s[j][w] = vselect(vis[j], s[j][w], splat(0.0f));
      sum += s[j][w];
    }
    stv(m + w * VL, m_new);
    stv(l + w * VL, ldv(l + w * VL) * alpha + sum);
    for (int64_t d = 0; d < D; d++) stv(acc + d * ITEM_LANES + w * VL, ldv(acc + d * ITEM_LANES + w * VL) * alpha);
  }
  for (int64_t d0 = 0; d0 < D; d0 += 8) {
    vf a[8][NV];
    for (int dd = 0; dd < 8; dd++)
      for (int w = 0; w < NV; w++) a[dd][w] = ldv(acc + (d0 + dd) * ITEM_LANES + w * VL);
    for (int j = 0; j < TILE; j++) {
      const float *vr = v + (j < n ? j : n - 1) * rs + d0;
      for (int dd = 0; dd < 8; dd++) {
        const float vd = vr[dd];
        for (int w = 0; w < NV; w++) a[dd][w] += s[j][w] * vd;
      }
    }
    for (int dd = 0; dd < 8; dd++)
      for (int w = 0; w < NV; w++) stv(acc + (d0 + dd) * ITEM_LANES + w * VL, a[dd][w]);
  }
}

/* A fast item's working memory, carved from its thread's work buffer: qt[D*IL], acc[D*IL], m[IL], l[IL],
   buf[2*TILE*D] (IL = ITEM_LANES), and each lane's position and first visible key. */
typedef struct {
  float *qt, *acc, *m, *l, *buf;
  int32_t pos[ITEM_LANES], fk[ITEM_LANES];
} Lanes;

static void lanes_init(Lanes *ln, float *work, int64_t D) {
  ln->qt = work;
  ln->acc = ln->qt + D * ITEM_LANES;
  ln->m = ln->acc + D * ITEM_LANES;
  ln->l = ln->m + ITEM_LANES;
  ln->buf = ln->l + ITEM_LANES;
  memset(ln->acc, 0, sizeof(float) * (size_t)(D * ITEM_LANES));
}

/* lane i: the query vector of flat token `token`, query head `head` (zero where !valid: a padding lane),
   pre-scaled, seeing keys fk .. pos; its softmax state reset */
static void lane_query(const Args *a, Lanes *ln, int64_t i, int valid, int64_t token, int64_t head, int64_t pos,
                       int64_t fk) {
  const int64_t D = a->head_dim, at = (token * a->num_heads + head) * D;
  ln->pos[i] = (int32_t)pos;
  ln->fk[i] = (int32_t)fk;
  for (int64_t d = 0; d < D; d++) {
    const float x = !valid ? 0.0f : a->bf16 ? from_bf16(((const uint16_t *)a->q)[at + d]) : ((const float *)a->q)[at + d];
    ln->qt[d * ITEM_LANES + i] = x * a->scale;
  }
  ln->m[i] = -1e30f;
  ln->l[i] = 0.0f;
}

/* keys lo .. hi - 1 of kv head kvh (through a row's block table) against every lane, tile by tile */
static void lanes_attend(const Args *a, Lanes *ln, const int64_t *table, int64_t kvh, int64_t lo, int64_t hi) {
  int64_t fk_max = 0;
  for (int64_t i = 0; i < ITEM_LANES; i++) fk_max = ln->fk[i] > fk_max ? ln->fk[i] : fk_max;
  for (int64_t k0 = lo - lo % TILE; k0 < hi; k0 += TILE) {
    const int64_t n = hi - k0 < TILE ? hi - k0 : TILE;
    const float *k, *v;
    const int64_t stride = load_tile(a, table, kvh, k0, n, ln->buf, &k, &v);
    const int mask = n < TILE || k0 < fk_max || k0 + n - 1 > ln->pos[0];
    fast_tile(ln->qt, k, v, stride, n, k0, ln->pos, ln->fk, mask, ln->acc, ln->m, ln->l, a->head_dim);
  }
}

/* a prompt-chunk item: lanes t0 .. t1 - 1 of the row (lane = token * n_rep + r), written out normalised */
static void run_fast_item(const Args *a, const Item *it, float *work) {
  const int64_t D = a->head_dim, H = a->num_heads, n_rep = H / a->num_kv_heads, row = it->row;
  const int64_t nl = it->t1 - it->t0, start = a->query_start[row], p0 = a->seq_len[row] - a->query_len[row];
  Lanes ln;
  lanes_init(&ln, work, D);
  for (int64_t i = 0; i < ITEM_LANES; i++) {  /* lanes past the item's last repeat its position, with q = 0 */
    const int64_t lane = it->t0 + (i < nl ? i : nl - 1), t = lane / n_rep;
    lane_query(a, &ln, i, i < nl, start + t, it->kvh * n_rep + lane % n_rep, p0 + t, first_key(a, p0 + t));
  }
  lanes_attend(a, &ln, a->tables + row * a->max_blocks, it->kvh, ln.fk[0], ln.pos[ITEM_LANES - 1] + 1);
  for (int64_t i = 0; i < nl; i++) {
    const int64_t lane = it->t0 + i, t = lane / n_rep, head = it->kvh * n_rep + lane % n_rep;
    const int64_t index = ((start + t) * H + head) * D;
    const float inv = 1.0f / ln.l[i];
    if (a->bf16)
      for (int64_t d = 0; d < D; d++) ((uint16_t *)a->out)[index + d] = to_bf16(ln.acc[d * ITEM_LANES + i] * inv);
    else
      for (int64_t d = 0; d < D; d++) ((float *)a->out)[index + d] = ln.acc[d * ITEM_LANES + i] * inv;
  }
}

/* A group's shared keys 0 .. group_len - 1 (every one visible to every member's decode query) against the
   queries of its members: lanes t0 .. t1 - 1 are (member, query head) pairs. Each lane's state (unnormalised
   output, max, sum) goes to shared_states for the merge with the member's own keys. */
static void run_shared_item(const Args *a, const Item *it, float *work) {
  const int64_t D = a->head_dim, n_rep = a->num_heads / a->num_kv_heads, g = it->row, sd = D + 2;
  const int64_t nl = it->t1 - it->t0, *rows = a->group_rows + a->group_off[g], len = a->group_len[g];
  Lanes ln;
  lanes_init(&ln, work, D);
  for (int64_t i = 0; i < ITEM_LANES; i++) {
    const int64_t lane = it->t0 + (i < nl ? i : nl - 1);
    lane_query(a, &ln, i, i < nl, a->query_start[rows[lane / n_rep]], it->kvh * n_rep + lane % n_rep, len - 1, 0);
  }
  /* the shared blocks are the same in every member's table */
  lanes_attend(a, &ln, a->tables + rows[0] * a->max_blocks, it->kvh, 0, len);
  for (int64_t i = 0; i < nl; i++) {
    const int64_t lane = it->t0 + i, row = rows[lane / n_rep], r = lane % n_rep;
    float *st = a->shared_states + ((row * a->num_kv_heads + it->kvh) * n_rep + r) * sd;
    for (int64_t d = 0; d < D; d++) st[d] = ln.acc[d * ITEM_LANES + i];
    st[D] = ln.m[i];
    st[D + 1] = ln.l[i];
  }
}

/* a grouped decode row: its shared state, then its own keys' state, folded in that order and written out */
static void merge_grouped(const Args *a, int64_t row, int64_t kvh, float *work) {
  const int64_t D = a->head_dim, n_rep = a->num_heads / a->num_kv_heads, sd = D + 2;
  const int64_t at = (row * a->num_kv_heads + kvh) * n_rep * sd;
  memcpy(work, a->shared_states + at, sizeof(float) * (size_t)(n_rep * sd));
  for (int64_t r = 0; r < n_rep; r++) {
    const float *own = a->suffix_states + at + r * sd;
    if (!(own[D + 1] == 0.0f && own[D] == -INFINITY)) merge_state(work + r * sd, own, D);
    finish(work + r * sd, a->out, (a->query_start[row] * a->num_heads + kvh * n_rep + r) * D, D, a->bf16);
  }
}

static inline int is_fast(const Args *a, int64_t ql) { return a->fast_min_query > 0 && ql >= a->fast_min_query; }
static inline int is_grouped(const Args *a, int64_t row) { return a->key_start && a->key_start[row] > 0; }

static int64_t num_items(const Args *a, int64_t num_rows, int split) {
  int64_t n = 0;
  const int64_t n_rep = a->num_heads / a->num_kv_heads;
  for (int64_t i = 0; i < num_rows; i++) {
    const int64_t ql = a->query_len[i], last = a->seq_len[i] - 1;
    if (is_fast(a, ql)) n += (ql * n_rep + ITEM_LANES - 1) / ITEM_LANES;
    else if (ql == 1) n += split && !is_grouped(a, i) ? last / PART - first_key(a, last) / PART + 1 : 1;
    else n += (ql + QTILE - 1) / QTILE;
  }
  for (int64_t g = 0; g < a->num_groups; g++)
    n += ((a->group_off[g + 1] - a->group_off[g]) * n_rep + ITEM_LANES - 1) / ITEM_LANES;
  return n * a->num_kv_heads;
}

/* The step's work items; split decodes get consecutive partial slots. Returns the number of partial states. */
static int64_t make_items(const Args *a, int64_t num_rows, int split, Item *items, int64_t *num_out) {
  int64_t n = 0, partial = 0;
  for (int64_t i = 0; i < num_rows; i++) {
    const int64_t ql = a->query_len[i], pos = a->seq_len[i] - 1;
    const int64_t own = is_grouped(a, i) ? a->key_start[i] : 0, fk0 = first_key(a, pos - ql + 1);
    const int64_t c0 = (own > fk0 ? own : fk0) / PART, c1 = pos / PART;
    for (int64_t h = 0; h < a->num_kv_heads; h++) {
      if (ql == 1 && own) {
        items[n++] = (Item){i, h, 0, 1, c0, c1, GROUPED};
      } else if (is_fast(a, ql)) {
        const int64_t lanes = ql * (a->num_heads / a->num_kv_heads);
        for (int64_t l0 = 0; l0 < lanes; l0 += ITEM_LANES)
          items[n++] = (Item){i, h, l0, l0 + ITEM_LANES < lanes ? l0 + ITEM_LANES : lanes, 0, 0, FAST};
      } else if (ql == 1 && split) {
        for (int64_t c = c0; c <= c1; c++) items[n++] = (Item){i, h, 0, 1, c, c, partial++};
      } else if (ql == 1) {
        items[n++] = (Item){i, h, 0, 1, c0, c1, -1};
      } else {
        for (int64_t t = 0; t < ql; t += QTILE) {
          const int64_t t1 = t + QTILE < ql ? t + QTILE : ql;
          const int64_t first = first_key(a, pos - ql + 1 + t) / PART, last = (pos - ql + t1) / PART;
          items[n++] = (Item){i, h, t, t1, first, last, -1};
        }
      }
    }
  }
  const int64_t n_rep = a->num_heads / a->num_kv_heads;
  for (int64_t g = 0; g < a->num_groups; g++) {
    const int64_t lanes = (a->group_off[g + 1] - a->group_off[g]) * n_rep;
    for (int64_t h = 0; h < a->num_kv_heads; h++)
      for (int64_t l0 = 0; l0 < lanes; l0 += ITEM_LANES)
        items[n++] = (Item){g, h, l0, l0 + ITEM_LANES < lanes ? l0 + ITEM_LANES : lanes, 0, 0, SHARED};
  }
  *num_out = n;
  return partial;
}

int jr_paged_attention(const void *q, const void *k_cache, const void *v_cache, void *out, const int64_t *query_start,
                       const int64_t *query_len, const int64_t *seq_len, const int64_t *tables, int64_t max_blocks,
                       int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t block_size, int64_t window, int64_t bf16, float scale, int64_t threads,
                       int64_t fast_min_query, int64_t num_groups, const int64_t *group_off,
                       const int64_t *group_rows, const int64_t *group_len, const int64_t *key_start,
                       int64_t kv_fp8) {
  float *states = NULL;
  if (num_groups > 0) {
    states = malloc(sizeof(float) * (size_t)(2 * num_rows * num_heads * (head_dim + 2)));
    if (!states) return 2;
  }
  const Args a = {q, k_cache, v_cache, out, query_start, query_len, seq_len, tables, max_blocks, num_heads,
                  num_kv_heads, head_dim, block_size, window, bf16, kv_fp8, scale, fast_min_query, num_groups, group_off,
                  group_rows, group_len, num_groups > 0 ? key_start : NULL, states,
                  states ? states + num_rows * num_heads * (head_dim + 2) : NULL};
  if (head_dim % 16 || num_heads % num_kv_heads) {
    free(states);
    return 1;
  }
  int64_t decodes = 0;
  for (int64_t i = 0; i < num_rows; i++) decodes += query_len[i] == 1 && !is_fast(&a, 1);
  const int split = decodes * num_kv_heads < threads;
  Item *items = malloc(sizeof(Item) * (size_t)(num_items(&a, num_rows, split) + 1));
  if (!items) return 2;
  int64_t n = 0;
  const int64_t num_partials = make_items(&a, num_rows, split, items, &n);
  const int64_t n_rep = num_heads / num_kv_heads, sd = head_dim + 2, nv = QTILE * n_rep;
  const int64_t exact_len = nv * head_dim + 2 * nv * sd + 2 * TILE * head_dim;
  const int64_t fast_len = 2 * ITEM_LANES * head_dim + 2 * ITEM_LANES + 2 * TILE * head_dim;
  const int64_t work_len = exact_len > fast_len ? exact_len : fast_len;
  float *partials = malloc(sizeof(float) * (size_t)(num_partials * n_rep * sd + 1));
  int failed = partials == NULL;
#pragma omp parallel num_threads(threads) if (n > 1)
  {
    /* every thread reaches both loops (a worksharing loop must be met by all); without memory it only skips */
    float *work = failed ? NULL : malloc(sizeof(float) * (size_t)work_len);
    if (!work) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; i++)
      if (work && items[i].partial == FAST) run_fast_item(&a, &items[i], work);
      else if (work && items[i].partial == SHARED) run_shared_item(&a, &items[i], work);
      else if (work) run_item(&a, &items[i], work, partials);
    if (num_groups > 0) {  /* after the loop's barrier: every shared and own state is there */
      const int64_t grouped = group_off[num_groups];
#pragma omp for schedule(dynamic, 4)
      for (int64_t i = 0; i < grouped * num_kv_heads; i++)
        if (work) merge_grouped(&a, group_rows[i / num_kv_heads], i % num_kv_heads, work);
    }
    if (num_partials) {  /* a split row's items are consecutive: the first partition's item starts each fold */
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < n; i++) {
        if (!work || items[i].partial < 0 || (i > 0 && items[i - 1].partial >= 0 && items[i - 1].row == items[i].row &&
                                              items[i - 1].kvh == items[i].kvh))
          continue;
        int64_t parts = 1;
        while (i + parts < n && items[i + parts].partial >= 0 && items[i + parts].row == items[i].row &&
               items[i + parts].kvh == items[i].kvh)
          parts++;
        fold_split(&a, &items[i], parts, partials, work);
      }
    }
    free(work);
  }
  free(partials);
  free(items);
  free(states);
  return failed ? 2 : 0;
}

/* the build's vector width in floats (16 AVX-512, 8 AVX2, 4 otherwise) */
int jr_fast_lanes(void) { return VL; }

/* This step's keys and values into their cache slots: row t of k / v (row stride ks / vs elements, each row
   `row` contiguous elements of `size` bytes: a view of the fused qkv projection) to slot slots[t] of k_cache /
   v_cache (`row` elements per slot). A plain copy, for the one torch index_copy_ per tensor it replaces (a
   kernel launch's worth of overhead each, twice per layer). */
int jr_write_kv(const void *k, const void *v, int64_t ks, int64_t vs, void *k_cache, void *v_cache,
                const int64_t *slots, int64_t n, int64_t row, int64_t size) {
  const char *kb = (const char *)k, *vb = (const char *)v;
  char *kc = (char *)k_cache, *vc = (char *)v_cache;
  const size_t bytes = (size_t)(row * size);
  for (int64_t t = 0; t < n; t++) {
    if (slots[t] < 0) return 1;
    memcpy(kc + slots[t] * row * size, kb + t * ks * size, bytes);
    memcpy(vc + slots[t] * row * size, vb + t * vs * size, bytes);
  }
  return 0;
}
