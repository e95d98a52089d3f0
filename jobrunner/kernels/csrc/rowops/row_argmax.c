/* Row argmax for the greedy sampler on CPU (jobrunner/engine/sampling/argmax.py calls it via ctypes).

   jr_row_argmax(x, out, rows, cols, row_stride, bf16, threads) writes out[r] = the index torch's
   x[r].max(dim=-1).indices gives: the FIRST index of the row's maximum, where NaN counts as the maximum (the
   first NaN wins) and -0 equals +0 (a row of -inf gives 0). x is float32 (bf16 = 0) or bfloat16 (bf16 = 1),
   each row contiguous, rows row_stride elements apart; bf16 is compared as the float32 it widens to (exact).

   How: a row is read in blocks of up to BLOCK elements. Per block a vector max (NaN-ignoring max plus a
   separate "any NaN" test: two vector ops per vector of input) and, only when the block's max beats the
   row's best so far (or the block holds a NaN), one more scan of that L1-hot block for the first index of its
   maximum (or of its first NaN, which ends the row). Later blocks that merely tie the best keep the earlier
   index, so the first maximum wins. One pass over memory; random logits rescan a handful of blocks per row.
   Exact at any thread count: rows are independent, and a row split into parts (fewer rows than threads)
   combines its parts in order (first part with a NaN, else the largest best, the earlier part on a tie).

   AVX-512 (16 lanes) and AVX2 (8 lanes) by intrinsics, picked by the build's -march; else plain C. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "jr_kernels.h"
#include "jr_numerics.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define BLOCK 1024
#define MIN_PART 4096     /* smallest piece of a row worth a thread of its own */
#define SERIAL_WORK 32768 /* rows * cols below this: no OpenMP team */

static inline float load1(const void *p, int64_t i, int bf16) {
  return bf16 ? from_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#if defined(__AVX512F__)
#define VL 16
typedef __m512 vf;
typedef __mmask16 vnan;
static inline vf vload(const void *p, int64_t i, int bf16) {
  if (bf16) return widen_bf16x16(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
  return _mm512_loadu_ps((const float *)p + i);
}
static inline vf vneg_inf(void) { return _mm512_set1_ps(-INFINITY); }
/* max(x, m): where x is NaN the result is m (the NaN is caught by vnan_or) */
static inline vf vmax(vf x, vf m) { return _mm512_max_ps(x, m); }
static inline vnan vnan_none(void) { return 0; }
static inline vnan vnan_or(vnan acc, vf a, vf b) { return acc | _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q); }
static inline int vnan_any(vnan acc) { return acc != 0; }
static inline float vhmax(vf m) { return _mm512_reduce_max_ps(m); }
static inline unsigned veq_bits(vf x, float m) { return _mm512_cmp_ps_mask(x, _mm512_set1_ps(m), _CMP_EQ_OQ); }
static inline unsigned vnan_bits(vf x) { return _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q); }
#elif defined(__AVX2__)
#define VL 8
typedef __m256 vf;
typedef __m256 vnan;
static inline vf vload(const void *p, int64_t i, int bf16) {
  if (bf16) return widen_bf16x8(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
  return _mm256_loadu_ps((const float *)p + i);
}
static inline vf vneg_inf(void) { return _mm256_set1_ps(-INFINITY); }
static inline vf vmax(vf x, vf m) { return _mm256_max_ps(x, m); }
static inline vnan vnan_none(void) { return _mm256_setzero_ps(); }
static inline vnan vnan_or(vnan acc, vf a, vf b) { return _mm256_or_ps(acc, _mm256_cmp_ps(a, b, _CMP_UNORD_Q)); }
static inline int vnan_any(vnan acc) { return _mm256_movemask_ps(acc) != 0; }
static inline float vhmax(vf m) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
static inline unsigned veq_bits(vf x, float m) {
  return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_set1_ps(m), _CMP_EQ_OQ));
}
static inline unsigned vnan_bits(vf x) { return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)); }
#else
#define VL 1  /* plain C: one "lane" of the same operations */
typedef float vf;
typedef int vnan;
static inline vf vload(const void *p, int64_t i, int bf16) { return load1(p, i, bf16); }
static inline vf vneg_inf(void) { return -INFINITY; }
static inline vf vmax(vf x, vf m) { return x > m ? x : m; }
static inline vnan vnan_none(void) { return 0; }
static inline vnan vnan_or(vnan acc, vf a, vf b) { return acc | (a != a) | (b != b); }
static inline int vnan_any(vnan acc) { return acc != 0; }
static inline float vhmax(vf m) { return m; }
static inline unsigned veq_bits(vf x, float m) { return x == m; }
static inline unsigned vnan_bits(vf x) { return x != x; }
#endif

#define STEP (4 * VL) /* elements per iteration of the block max: four independent accumulators */

/* max of x[at, at + n) (n a multiple of STEP), NaN ignored; *has_nan set when the block holds one */
static inline float block_max(const void *x, int64_t at, int64_t n, int bf16, int *has_nan) {
  vf m0 = vneg_inf(), m1 = m0, m2 = m0, m3 = m0;
  vnan nan = vnan_none();
  for (int64_t i = at; i < at + n; i += STEP) {
    const vf a = vload(x, i, bf16), b = vload(x, i + VL, bf16);
    const vf c = vload(x, i + 2 * VL, bf16), d = vload(x, i + 3 * VL, bf16);
    m0 = vmax(a, m0);
    m1 = vmax(b, m1);
    m2 = vmax(c, m2);
    m3 = vmax(d, m3);
    nan = vnan_or(nan, a, b);
    nan = vnan_or(nan, c, d);
  }
  *has_nan = vnan_any(nan);
  return vhmax(vmax(vmax(m0, m1), vmax(m2, m3)));
}

/* the first index in x[at, at + n) (n a multiple of VL) holding m (nan: holding a NaN); at + n if none */
static inline int64_t block_find(const void *x, int64_t at, int64_t n, int bf16, float m, int nan) {
  for (int64_t i = at; i < at + n; i += VL) {
    const vf v = vload(x, i, bf16);
    const unsigned bits = nan ? vnan_bits(v) : veq_bits(v, m);
    if (bits) return i + __builtin_ctz(bits);
  }
  return at + n;
}

typedef struct {
  float best;   /* the largest non-NaN value seen (-inf if none) */
  int64_t idx;  /* its first index, or the first NaN's */
  int nan;      /* a NaN was seen: idx is the first NaN's */
} part_t;

/* argmax of x[lo, hi) */
static part_t segment_argmax(const void *x, int64_t lo, int64_t hi, int bf16) {
  part_t p = {-INFINITY, lo, 0};
  int64_t i = lo;
  while (hi - i >= STEP) {
    int64_t n = hi - i < BLOCK ? hi - i : BLOCK;
    n -= n % STEP;
    int has_nan;
    const float m = block_max(x, i, n, bf16, &has_nan);
    if (has_nan) {
      p.idx = block_find(x, i, n, bf16, 0.0f, 1);
      p.nan = 1;
      return p;
    }
    if (m > p.best) {
      p.best = m;
      p.idx = block_find(x, i, n, bf16, m, 0);
    }
    i += n;
  }
  for (; i < hi; i++) {
    const float v = load1(x, i, bf16);
    if (v != v) {
      p.idx = i;
      p.nan = 1;
      return p;
    }
    if (v > p.best) {
      p.best = v;
      p.idx = i;
    }
  }
  return p;
}

static int64_t gcd64(int64_t a, int64_t b) {
  while (b) {
    const int64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

/* out[r] = argmax of row r (see the file's doc). 0 on success; 1 for an empty row, 2 out of memory. */
int jr_row_argmax(const void *x, int64_t *out, int64_t rows, int64_t cols, int64_t row_stride, int64_t bf16,
                  int64_t threads) {
  if (rows <= 0) return 0;
  if (cols <= 0) return 1;
  const size_t esize = bf16 ? 2 : 4;
  const int b = bf16 != 0;
  if (threads < 1) threads = 1;
  /* parts per row: 1 unless the rows do not share out evenly over the threads (few rows: a row split in up
     to `threads` parts of at least MIN_PART elements) */
  int64_t parts = 1;
  if (threads > 1 && rows < 4 * threads && rows * cols >= SERIAL_WORK) {
    parts = threads / gcd64(rows, threads);
    const int64_t most = cols / MIN_PART;
    if (parts > most) parts = most > 1 ? most : 1;
  }
  if (parts == 1) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows * cols >= SERIAL_WORK)
    for (int64_t r = 0; r < rows; r++)
      out[r] = segment_argmax((const char *)x + (size_t)(r * row_stride) * esize, 0, cols, b).idx;
    return 0;
  }
  part_t *res = (part_t *)malloc(sizeof(part_t) * (size_t)(rows * parts));
  if (!res) return 2;
  const int64_t chunk = (cols + parts - 1) / parts;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t item = 0; item < rows * parts; item++) {
    const int64_t r = item / parts, p = item % parts;
    const int64_t lo = p * chunk, hi = lo + chunk < cols ? lo + chunk : cols;
    res[item] = lo < hi ? segment_argmax((const char *)x + (size_t)(r * row_stride) * esize, lo, hi, b)
                        : (part_t){-INFINITY, lo, 0};
  }
  for (int64_t r = 0; r < rows; r++) {
    part_t best = res[r * parts];
    for (int64_t p = 1; p < parts && !best.nan; p++) {
      const part_t q = res[r * parts + p];
      if (q.nan || q.best > best.best) best = q;
    }
    out[r] = best.idx;
  }
  free(res);
  return 0;
}
