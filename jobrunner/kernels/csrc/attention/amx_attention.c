/* Prompt-chunk attention on the AMX matrix units, bf16, reading the paged KV cache (jobrunner/attention/
   amx_prefill.py calls it via ctypes; built only for CPUs with amx_bf16, with -mamx-tile -mamx-bf16).

   Rows are prompt chunks: query tokens t = 0 .. ql - 1 of a row sit at positions seq - ql + t and see keys
   0 .. their own position (a cached prefix, then the chunk causally). Grouped-query attention is folded: a
   row's work for one kv head is a list of "lanes" (query token t, query head r of that kv head's group),
   lane = t * n_rep + r, cut into blocks of 16 lanes.

   Everything is computed transposed, keys by lanes, so that one AVX-512 register holds one key's value for
   the 16 lanes of a block and the online softmax needs no horizontal reduction:
   - S^T = K Q^T on the tiles: 16 keys straight from a cache block (A operand, rows of D bf16 at the cache's
     row stride) against the block's queries, transposed once per block into the B operand layout (16
     dimension pairs x 16 lanes);
   - the online softmax in float32 over 32 keys at a time (running max and sum per lane, masked by position);
     P^T rounded to bf16 and its key pairs interleaved into the B operand layout;
   - O^T = V^T P^T on the tiles, V^T staged once per (row, kv head) in the caller's workspace (A operand:
     16 dimensions x 32 keys, zero past the row's last key), accumulated in float32 with the rescale;
   - the output divided by the softmax sum and rounded to bf16 once.
   Work: phase 1 stages V^T per (row, kv head); phase 2 runs (row, kv head, span of lane blocks) units, both
   spread over the threads. The arithmetic is that of torch's CPU flash attention for bf16 (float32 scores and
   softmax, P in bf16 into the second product), not the exact kernel's fixed order: outside deterministic mode
   only, and not batch-invariant (a block's last lane decides where its key loop ends).

   Built with -DJR_TILE_AVX512 (library bf16_attention, CPUs with AVX-512 BF16 and no AMX) the same layouts,
   softmax and work split run without tiles: a prompt block is include/jr_prompt_avx512.h's (for D = 64 the
   bits of the tile block here), a decode include/jr_decode_avx512.h's; only the no-op tile set-up of
   include/jr_tile_avx512.h is left of the tiles.
*/
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "jr_amx.h"
#include "jr_kernels.h"

#define LANES 16      /* query lanes per tile */
#define KB 32         /* keys per step: two 16-key score tiles, one 32-key P tile */
#define MAX_D 256
#define SPAN 4        /* lane blocks per phase-2 work unit */

/* tiles (jr_amx.h: all 16 rows x 64 bytes); operands: Q^T (16 dimension pairs x 16 lanes), K (16 keys x 32
   dims), S^T (16 keys x 16 lanes, float32), P^T (16 key pairs x 16 lanes), V^T (16 dims x 32 keys), O^T (16 dims
   x 16 lanes, float32); which tile holds which is in score_tiles / value_tiles */

typedef struct {
  const uint16_t *q, *k, *v;
  uint16_t *out;
  const int64_t *qstart, *qlen, *seq, *tables;
  int64_t max_blocks, H, Hkv, D, bs;
  float scale;
  uint16_t *work;        /* phase-1 V^T tiles of every (row, kv head) */
  const int64_t *base;   /* [rows]: offset of a row's tiles in work (elements) */
} Args;

static inline int64_t padded(int64_t n) { return (n + KB - 1) / KB * KB; }

/* values 0 .. seq - 1 of (row, kvh) as V^T tiles [32-key block][D / 16][16 dims][32 keys], zero past seq */
static void stage_values(const Args *a, int64_t row, int64_t kvh) {
  const int64_t D = a->D, n = a->seq[row], np = padded(n), bs = a->bs;
  const int64_t *table = a->tables + row * a->max_blocks;
  uint16_t *vt = a->work + a->base[row] + kvh * np * D;
  for (int64_t p = 0; p < np; p++) {
    uint16_t *dst = vt + (p / KB) * KB * D + p % KB;
    if (p < n) {
      const uint16_t *src = a->v + ((table[p / bs] * bs + p % bs) * a->Hkv + kvh) * D;
      for (int64_t d = 0; d < D; d++) dst[(d / 16) * 512 + (d % 16) * KB] = src[d];
    } else {
      for (int64_t d = 0; d < D; d++) dst[(d / 16) * 512 + (d % 16) * KB] = 0;
    }
  }
}

#ifndef JR_TILE_AVX512  /* the tile blocks (without AMX: jr_prompt_avx512.h's block instead) */
/* exp(x) for x <= 0 lane-wise (clamped at -87, where it is ~1.6e-38): 2^n * p(r) */
static inline __m512 exp_le0(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.3981999507e-3f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

/* S^T of keys k0 .. k0 + 31 against the lane block's Q^T (qt, [D / 32] B tiles) into s [32 keys][16 lanes]:
   two 16-key tiles, each one cache block's rows (block_size % 16 == 0); tmm2 K, tmm4 Q^T, tmm3 S^T */
static inline void score_tiles(const Args *a, const int64_t *table, int64_t kvh, int64_t seq, int64_t k0,
                               const uint32_t *qt, float *s) {
  const int64_t bs = a->bs, D = a->D, stride = a->Hkv * D * 2;
  for (int64_t half = 0; half < 2; half++) {
    const int64_t key = k0 + 16 * half;
    if (key >= seq) {  /* past the row's keys (and its block table): masked anyway */
      memset(s + half * 16 * LANES, 0, sizeof(float) * 16 * LANES);
      continue;
    }
    const uint16_t *kr = a->k + ((table[key / bs] * bs + key % bs) * a->Hkv + kvh) * D;
    _tile_zero(3);
    for (int64_t c = 0; c < D / 32; c++) {
      _tile_loadd(2, kr + c * 32, stride);
      _tile_loadd(4, qt + c * 256, 64);
      _tile_dpbf16ps(3, 2, 4);
    }
    _tile_stored(3, s + half * 16 * LANES, 64);
  }
}

/* V^T P^T of one 32-key block (vb: its staged V^T tiles; pt: P^T in the B layout) into pv [D][16 lanes]:
   tmm5 P^T, tmm6 V^T, tmm7 the product */
static inline void value_tiles(const uint16_t *vb, const uint16_t *pt, int64_t D, float *pv) {
  _tile_loadd(5, pt, 64);
  for (int64_t j = 0; j < D / 16; j++) {
    _tile_zero(7);
    _tile_loadd(6, vb + j * 512, KB * 2);
    _tile_dpbf16ps(7, 6, 5);
    _tile_stored(7, pv + j * 16 * LANES, 64);
  }
}

/* acc [D][16 lanes] = acc * alpha + pv */
static inline void add_partials(float *acc, const float *pv, __m512 alpha, int64_t D) {
  for (int64_t d = 0; d < D; d++)
    _mm512_store_ps(acc + d * LANES, _mm512_fmadd_ps(_mm512_load_ps(acc + d * LANES), alpha,
                                                     _mm512_load_ps(pv + d * LANES)));
}

#endif

/* 2^x lane-wise where keep, 0 elsewhere (x <= 8 in kept lanes: the lazy maximum below; -inf, +inf or NaN
   only in dropped lanes); Taylor degree 4 on [-1/2, 1/2], relative error < 5e-5 (P is rounded to bf16, 4e-3) */
static inline __m512 exp2_kept(__mmask16 keep, __m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(9.6181291e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

/* lane i's query (D bf16 = D / 2 words at src) into column i of Q^T ([D / 32][16 pairs][16 lanes] words) */
static inline void scatter_query(uint32_t *qt, const uint16_t *src, int64_t i, int64_t D) {
  const __m512i idx = _mm512_add_epi32(_mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64,
                                                        48, 32, 16, 0), _mm512_set1_epi32((int32_t)i));
  for (int64_t c = 0; c < D / 32; c++)
    _mm512_i32scatter_epi32(qt + c * 256, idx, _mm512_loadu_si512((const void *)(src + c * 32)), 4);
}

#define LAZY 8.0f  /* the running maximum moves only when a score passes it by 2^8 (so P <= 256) */

/* The online softmax of one 32-key step of a 16-lane block (the tile block for D = 64 and the blocks without
   tiles): s holds the raw scores [32 keys][16 lanes]; keys past a lane's position are masked once the step
   reaches past the block's lowest position. Scores in base 2 (cv = scale * log2 e), the lazy running maximum *m
   and sum *l updated, P^T rounded to bf16 with its key pairs interleaved into pt ([16 key pairs][16 lanes][2],
   the B operand layout). Returns the factor by which each lane's output so far must be multiplied before this
   step's P V (1 where its maximum did not move); *rescale says whether any lane's must. */
static inline __m512 lazy_softmax_step(const float *s, __m512i posv, int64_t k0, int64_t lowest, __m512 cv,
                                       __m512 *m, __m512 *l, uint16_t *pt, int *rescale) {
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const int masked = k0 + KB - 1 > lowest;
  __mmask16 valid[KB];
  __m512 mx = ninf, alpha = _mm512_set1_ps(1.0f);
  for (int64_t j = 0; j < KB; j++) {
    valid[j] = masked ? _mm512_cmp_epi32_mask(posv, _mm512_set1_epi32((int32_t)(k0 + j)), _MM_CMPINT_NLT)
                      : (__mmask16)0xffff;
    mx = _mm512_mask_max_ps(mx, valid[j], mx, _mm512_load_ps(s + j * LANES));
  }
  const __m512 cand = _mm512_mul_ps(mx, cv);
  const __mmask16 grow = _mm512_cmp_ps_mask(cand, _mm512_add_ps(*m, _mm512_set1_ps(LAZY)), _CMP_GT_OQ);
  *rescale = 0;
  if (grow) {
    const __mmask16 had = _mm512_cmp_ps_mask(*m, ninf, _CMP_NEQ_OQ);
    const __m512 moved = _mm512_mask_mov_ps(*m, grow, cand);
    if (grow & had) {  /* lanes that had keys: their sum now, their output by the caller */
      alpha = _mm512_mask_mov_ps(alpha, grow & had, exp2_kept(grow & had, _mm512_sub_ps(*m, moved)));
      *l = _mm512_mul_ps(*l, alpha);
      *rescale = 1;
    }
    *m = moved;
  }
  const __m512 negm = _mm512_sub_ps(_mm512_setzero_ps(), *m);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < KB; j += 2) {
    const __m512 p0 = exp2_kept(valid[j], _mm512_fmadd_ps(_mm512_load_ps(s + j * LANES), cv, negm));
    const __m512 p1 = exp2_kept(valid[j + 1], _mm512_fmadd_ps(_mm512_load_ps(s + (j + 1) * LANES), cv, negm));
    sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  /* [p0 lanes | p1 lanes] */
    _mm512_store_si512((__m512i *)(pt + j * LANES), _mm512_permutexvar_epi16(interleave, both));
  }
  *l = _mm512_add_ps(*l, sum);
  return alpha;
}

#ifndef JR_TILE_AVX512
/* D = 64: S^T of keys k0 .. k0 + 31 (those below `end`; the rest zero, masked by the caller) against Q^T (qt)
   into s [32 keys][16 lanes], 16 keys (one cache block's rows) at a time in tmm2 (tmm0 Q^T, tmm1 K) */
static inline void scores_d64(const Args *a, const int64_t *table, int64_t kvh, int64_t end, int64_t k0,
                              const uint32_t *qt, float *s) {
  const int64_t bs = a->bs, stride = a->Hkv * 64 * 2;
  for (int64_t half = 0; half < 2; half++) {
    const int64_t key = k0 + 16 * half;
    if (key >= end) {  /* past the row's keys (and its block table) */
      memset(s + half * 16 * LANES, 0, sizeof(float) * 16 * LANES);
      continue;
    }
    const uint16_t *kr = a->k + ((table[key / bs] * bs + key % bs) * a->Hkv + kvh) * 64;
    _tile_zero(2);
    _tile_loadd(0, qt, 64);
    _tile_loadd(1, kr, stride);
    _tile_dpbf16ps(2, 1, 0);
    _tile_loadd(0, qt + 256, 64);
    _tile_loadd(1, kr + 32, stride);
    _tile_dpbf16ps(2, 1, 0);
    _tile_stored(2, s + half * 16 * LANES, 64);
  }
}

/* One block of 16 lanes for D = 64 with the output kept in four tiles (tmm4-7) for the whole key loop:
   scores in base 2 (scale * log2 e folded in), the running maximum moved lazily (LAZY), so the tiles are
   rescaled (stored, multiplied, reloaded) only when it moves for a lane that has seen keys: a few times per
   block. Writes O^T (unnormalised) to acc [64][16 lanes] and the softmax sums to *l_out. */
static void attend_block_d64(const Args *a, const int64_t *table, int64_t kvh, int64_t seq, const uint16_t *vt,
                             const uint32_t *qt, __m512i posv, int64_t last, int64_t lowest, float *acc,
                             __m512 *l_out) {
  const __m512 cv = _mm512_set1_ps(a->scale * 1.44269504089f);
  float s[KB * LANES] __attribute__((aligned(64)));
  uint16_t pt[KB * LANES] __attribute__((aligned(64)));
  __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t k0 = 0; k0 <= last; k0 += KB) {
    scores_d64(a, table, kvh, seq, k0, qt, s);
    int rescale = 0;
    const __m512 alpha = lazy_softmax_step(s, posv, k0, lowest, cv, &m, &l, pt, &rescale);
    if (rescale) {  /* the output tiles of the lanes whose maximum moved */
      _tile_stored(4, acc, 64);
      _tile_stored(5, acc + 256, 64);
      _tile_stored(6, acc + 512, 64);
      _tile_stored(7, acc + 768, 64);
      for (int64_t d = 0; d < 64; d++)
        _mm512_store_ps(acc + d * LANES, _mm512_mul_ps(_mm512_load_ps(acc + d * LANES), alpha));
      _tile_loadd(4, acc, 64);
      _tile_loadd(5, acc + 256, 64);
      _tile_loadd(6, acc + 512, 64);
      _tile_loadd(7, acc + 768, 64);
    }
    const uint16_t *vb = vt + (k0 / KB) * KB * 64;  /* O^T += V^T P^T, 16 dimensions per tile */
    _tile_loadd(2, pt, 64);
    _tile_loadd(3, vb, KB * 2);
    _tile_dpbf16ps(4, 3, 2);
    _tile_loadd(3, vb + 512, KB * 2);
    _tile_dpbf16ps(5, 3, 2);
    _tile_loadd(3, vb + 1024, KB * 2);
    _tile_dpbf16ps(6, 3, 2);
    _tile_loadd(3, vb + 1536, KB * 2);
    _tile_dpbf16ps(7, 3, 2);
  }
  _tile_stored(4, acc, 64);
  _tile_stored(5, acc + 256, 64);
  _tile_stored(6, acc + 512, 64);
  _tile_stored(7, acc + 768, 64);
  *l_out = l;
}

/* One block of 16 lanes, any D % 32 == 0 (the output accumulated in float32 memory, S^T and P V partial
   sums through memory): writes O^T (unnormalised) to acc [D][16 lanes] and the softmax sums to *l_out. */
static void attend_block(const Args *a, const int64_t *table, int64_t kvh, int64_t seq, const uint16_t *vt,
                         const uint32_t *qt, __m512i posv, int64_t last, int64_t lowest, float *acc, __m512 *l_out) {
  const int64_t D = a->D;
  uint16_t pt[KB * LANES] __attribute__((aligned(64)));          /* P^T: [16 key pairs][16 lanes][2] */
  float s[2 * KB * LANES] __attribute__((aligned(64)));          /* S^T: 2 x [32 keys][16 lanes] */
  float pv[MAX_D * LANES] __attribute__((aligned(64)));          /* one step's V^T P^T [D][16 lanes] */
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512 ninf = _mm512_set1_ps(-INFINITY), scale = _mm512_set1_ps(a->scale);
  __m512 l;
  memset(acc, 0, sizeof(float) * D * LANES);
  __m512 m = ninf;
  l = _mm512_setzero_ps();
  /* Software-pipelined: S^T of the next 32 keys is computed (and stored) before the softmax of these,
     and the P V partial sums of these are added to the accumulator one step later, so no vector load
     waits on the tile store just before it. */
  score_tiles(a, table, kvh, seq, 0, qt, s);
  int have_pv = 0;
  __m512 alpha_pv = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 <= last; k0 += KB) {
    float *sc = s + ((k0 / KB) % 2) * KB * LANES;
    if (k0 + KB <= last) score_tiles(a, table, kvh, seq, k0 + KB, qt, s + (((k0 / KB) + 1) % 2) * KB * LANES);
    /* online softmax over the 32 keys, 16 lanes per register */
    const int masked = k0 + KB - 1 > lowest;
    __mmask16 valid[KB];
    __m512 mx = m;
    for (int64_t j = 0; j < KB; j++) {
      __m512 sj = _mm512_mul_ps(_mm512_load_ps(sc + j * LANES), scale);
      valid[j] = masked ? _mm512_cmp_epi32_mask(posv, _mm512_set1_epi32((int32_t)(k0 + j)), _MM_CMPINT_NLT)
                        : (__mmask16)0xffff;
      sj = _mm512_mask_blend_ps(valid[j], ninf, sj);
      _mm512_store_ps(sc + j * LANES, sj);
      mx = _mm512_max_ps(mx, sj);
    }
    const __mmask16 had = _mm512_cmp_ps_mask(m, ninf, _CMP_NEQ_OQ);   /* lanes that saw a key before */
    const __mmask16 has = _mm512_cmp_ps_mask(mx, ninf, _CMP_NEQ_OQ);  /* ... by now */
    const __m512 safe = _mm512_maskz_mov_ps(has, mx);                /* no NaN from -inf - -inf */
    __m512 alpha = _mm512_maskz_mov_ps(had, exp_le0(_mm512_sub_ps(_mm512_maskz_mov_ps(had, m), safe)));
    alpha = _mm512_mask_blend_ps(has, _mm512_set1_ps(1.0f), alpha);  /* nothing seen yet: acc stays 0 */
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < KB; j += 2) {
      const __m512 p0 = _mm512_maskz_mov_ps(valid[j], exp_le0(_mm512_sub_ps(_mm512_load_ps(sc + j * LANES), safe)));
      const __m512 p1 = _mm512_maskz_mov_ps(valid[j + 1],
                                            exp_le0(_mm512_sub_ps(_mm512_load_ps(sc + (j + 1) * LANES), safe)));
      sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);     /* [p0 lanes | p1 lanes] */
      _mm512_store_si512((__m512i *)(pt + j * LANES), _mm512_permutexvar_epi16(interleave, both));
    }
    l = _mm512_fmadd_ps(l, alpha, sum);
    m = mx;
    /* the previous step's P V into the accumulator (acc = acc * its alpha + its P V), then this step's
       alpha for everything before it: acc * alpha_prev * alpha, in that order */
    if (have_pv) add_partials(acc, pv, alpha_pv, D);
    alpha_pv = alpha;
    have_pv = 1;
    value_tiles(vt + (k0 / KB) * KB * D, pt, D, pv);
  }
  if (have_pv) add_partials(acc, pv, alpha_pv, D);
  *l_out = l;
}

#else
#include "jr_prompt_avx512.h"  /* no tiles: the products read K, Q^T, V^T and P^T in place */
#endif

/* lane blocks b0 .. b1 - 1 of (row, kvh) */
static void attend_span(const Args *a, int64_t row, int64_t kvh, int64_t b0, int64_t b1) {
  const int64_t D = a->D, H = a->H, n_rep = H / a->Hkv, ql = a->qlen[row], seq = a->seq[row];
  const int64_t first = seq - ql, np = padded(seq), lanes = ql * n_rep;
  const int64_t *table = a->tables + row * a->max_blocks;
  const uint16_t *vt = a->work + a->base[row] + kvh * np * D;
  uint32_t qt[MAX_D / 2 * LANES] __attribute__((aligned(64)));   /* Q^T: [D / 32][16 pairs][16 lanes] */
  float acc[MAX_D * LANES] __attribute__((aligned(64)));         /* O^T: [D][16 lanes] */
  int32_t pos[LANES] __attribute__((aligned(64)));
  for (int64_t b = b0; b < b1; b++) {
    const int64_t l0 = b * LANES, nl = lanes - l0 < LANES ? lanes - l0 : LANES;
    if (nl < LANES) memset(qt, 0, sizeof(uint32_t) * D / 2 * LANES);   /* padding lanes: zero queries */
    for (int64_t i = 0; i < LANES; i++) {
      const int64_t lane = l0 + i, t = lane / n_rep, h = kvh * n_rep + lane % n_rep;
      if (i < nl) scatter_query(qt, a->q + ((a->qstart[row] + t) * H + h) * D, i, D);
      pos[i] = i < nl ? (int32_t)(first + t) : -1;   /* a padding lane sees no key */
    }
    const __m512i posv = _mm512_load_si512((const __m512i *)pos);
    const int64_t last = pos[nl - 1], lowest = pos[0];  /* lanes are in position order */
    __m512 l;
#ifdef JR_TILE_AVX512
    if (D == 64) {
      attend_block_native(a, table, kvh, seq, vt, qt, posv, last, lowest, acc, &l, 64);
    } else if (D == 128) {
      attend_block_native(a, table, kvh, seq, vt, qt, posv, last, lowest, acc, &l, 128);
    } else {
      attend_block_native(a, table, kvh, seq, vt, qt, posv, last, lowest, acc, &l, D);
    }
#else
    if (D == 64) {
      attend_block_d64(a, table, kvh, seq, vt, qt, posv, last, lowest, acc, &l);
    } else {
      attend_block(a, table, kvh, seq, vt, qt, posv, last, lowest, acc, &l);
    }
#endif
    float inv[LANES];
    _mm512_storeu_ps(inv, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(l, _mm512_setzero_ps(), _CMP_GT_OQ),
                                               _mm512_set1_ps(1.0f), l));
    const __m512i column = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
    for (int64_t i = 0; i < nl; i++) {  /* lane i's column of acc, 32 dimensions at a time */
      const int64_t lane = l0 + i, t = lane / n_rep, h = kvh * n_rep + lane % n_rep;
      uint16_t *o = a->out + ((a->qstart[row] + t) * H + h) * D;
      const __m512 li = _mm512_set1_ps(inv[i]);
      for (int64_t d = 0; d < D; d += 32) {
        const __m512 lo = _mm512_mul_ps(_mm512_i32gather_ps(column, acc + d * LANES + i, 4), li);
        const __m512 hi = _mm512_mul_ps(_mm512_i32gather_ps(column, acc + (d + 16) * LANES + i, 4), li);
        _mm512_storeu_si512((void *)(o + d), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
    }
  }
}

/* Bytes of workspace a call needs for rows of these lengths. */
int64_t jr_amx_workspace_bytes(const int64_t *seq, int64_t num_rows, int64_t Hkv, int64_t D) {
  int64_t total = 0;
  for (int64_t r = 0; r < num_rows; r++) total += padded(seq[r]) * Hkv * D;
  return total * (int64_t)sizeof(uint16_t);
}

/* 1: AMX usable here (the process may use the tile registers) */
int jr_amx_ready(void) { return amx_permitted(); }

/* Returns 0; 1 bad shape; 3 AMX refused by the OS. q [T, H, D], out [T, H * D], caches
   [slots, Hkv, D], all bf16; rows: query_start / query_len / seq_len, tables [rows, max_blocks]. */
int jr_amx_prompt_attention(const void *q, const void *k_cache, const void *v_cache, void *out,
                            const int64_t *query_start, const int64_t *query_len, const int64_t *seq_len,
                            const int64_t *tables, int64_t max_blocks, int64_t num_rows, int64_t H, int64_t Hkv,
                            int64_t D, int64_t block_size, float scale, void *work, int64_t threads) {
  if (D % 32 || D > MAX_D || H % Hkv || block_size % 16) return 1;
  if (!amx_permitted()) return 3;
  int64_t base[num_rows > 0 ? num_rows : 1];
  int64_t at = 0, units = 0;
  for (int64_t r = 0; r < num_rows; r++) {
    base[r] = at;
    at += padded(seq_len[r]) * Hkv * D;
    units += Hkv * ((query_len[r] * (H / Hkv) + LANES * SPAN - 1) / (LANES * SPAN));
  }
  const Args a = {q, k_cache, v_cache, out, query_start, query_len, seq_len, tables, max_blocks, H, Hkv, D,
                  block_size, scale, work, base};
#pragma omp parallel num_threads(threads)
  {
    configure_tiles();
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_rows * Hkv; i++) stage_values(&a, i / Hkv, i % Hkv);
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; u++) {
      int64_t left = u;
      for (int64_t r = 0; r < num_rows; r++) {  /* unit u -> (row, kv head, span) */
        const int64_t blocks = (query_len[r] * (H / Hkv) + LANES - 1) / LANES;
        const int64_t spans = (blocks + SPAN - 1) / SPAN;
        if (left < Hkv * spans) {
          const int64_t kvh = left / spans, s0 = (left % spans) * SPAN;
          attend_span(&a, r, kvh, s0, s0 + SPAN < blocks ? s0 + SPAN : blocks);
          break;
        }
        left -= Hkv * spans;
      }
    }
    _tile_release();
  }
  return 0;
}


/* ---- Decodes (one query token per row), D = 64 ----
   A decode's work for one kv head is its n_rep query heads (lanes 0 .. R - 1 of one 16-lane block). Scores
   are computed keys x lanes as above (K straight from the cache, Q^T built once); the product with V runs
   the other way round, O = P V, so V needs no transposing: its rows are only paired (two keys' values
   interleaved, which permutes the output dimensions in a fixed way, undone when writing), and P's R rows are
   gathered from the score layout. The output stays in tmm4-7 with the lazy maximum. */

/* After the pairing (unpacklo / unpackhi of two keys' rows, within 128-bit lanes), column n (0 .. 15) of
   output tile t (0 .. 3) is dimension 32 (t / 2) + 8 (n / 4) + 4 (t % 2) + n % 4. */

/* head sizes the decode kernel takes: 64; without AMX (jr_decode_avx512.h) 64 and 128 */
#ifdef JR_TILE_AVX512
#define DECODE_MAX_D 128
#else
#define DECODE_MAX_D 64
#endif

/* An online-softmax state of up to 16 decode lanes: the output in the paired layout of tiles tmm4-7
   ([D / 16][16 lanes][16]; D = 128 has eight such "tiles"), the running maximum (base 2) and sum per lane */
typedef struct {
  float o[DECODE_MAX_D / 16 * LANES * 16] __attribute__((aligned(64)));
  float m[LANES], l[LANES];
} DecodeState;

static void fresh_state(DecodeState *st) {
  memset(st->o, 0, sizeof st->o);
  for (int64_t i = 0; i < LANES; i++) {
    st->m[i] = -INFINITY;
    st->l[i] = 0.0f;
  }
}

#ifdef JR_TILE_AVX512
#include "jr_decode_avx512.h"  /* no tiles: each lane's own arithmetic only */
#else
/* Keys k_lo .. k_hi - 1 (k_lo a multiple of 16; every key seen by every lane) of kv head kvh through `table`,
   for lanes 0 .. nl - 1 whose queries are at qrows[i], continuing the state st */
static void decode_keys(const Args *a, const int64_t *table, int64_t kvh, const uint16_t *const *qrows, int64_t nl,
                        int64_t k_lo, int64_t k_hi, DecodeState *st) {
  const int64_t pos = k_hi - 1, bs = a->bs;
  uint32_t qt[2 * 256] __attribute__((aligned(64)));     /* Q^T: 2 x [16 dimension pairs][16 lanes] */
  float s[KB * LANES] __attribute__((aligned(64)));      /* S^T, then P^T: [32 keys][16 lanes] */
  uint16_t pa[LANES * KB] __attribute__((aligned(64)));  /* P: [16 lanes][32 keys] (rows >= R zero) */
  uint16_t vb[4 * 16 * 32] __attribute__((aligned(64))); /* V paired: 4 x [16 key pairs][16 dims x 2] */
  float *o = st->o;
  memset(qt, 0, sizeof qt);
  memset(pa, 0, sizeof pa);
  for (int64_t r = 0; r < nl; r++) scatter_query(qt, qrows[r], r, 64);
  const __m512 cv = _mm512_set1_ps(a->scale * 1.44269504089f), ninf = _mm512_set1_ps(-INFINITY);
  const __m512i gather_idx = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
  __m512 m = _mm512_loadu_ps(st->m), l = _mm512_loadu_ps(st->l);
  _tile_loadd(4, o, 64);
  _tile_loadd(5, o + 256, 64);
  _tile_loadd(6, o + 512, 64);
  _tile_loadd(7, o + 768, 64);
  for (int64_t k0 = k_lo; k0 <= pos; k0 += KB) {
    const int64_t seen = pos + 1 - k0 < KB ? pos + 1 - k0 : KB;  /* keys of this step the query sees */
    for (int64_t key = k0 + KB; key < k0 + 2 * KB && key <= pos; key++) {  /* the next step's rows, on their way */
      const int64_t at = ((table[key / bs] * bs + key % bs) * a->Hkv + kvh) * 64;
      _mm_prefetch((const char *)(a->k + at), _MM_HINT_T0);
      _mm_prefetch((const char *)(a->k + at + 32), _MM_HINT_T0);
      _mm_prefetch((const char *)(a->v + at), _MM_HINT_T0);
      _mm_prefetch((const char *)(a->v + at + 32), _MM_HINT_T0);
    }
    scores_d64(a, table, kvh, pos + 1, k0, qt, s);
    /* V's rows in pairs (zero past the last key: P is 0 there, and 0 x a stale NaN would not be) */
    for (int64_t p = 0; p < 16; p++) {
      __m512i lo[2], hi[2];
      for (int64_t h = 0; h < 2; h++) {
        const int64_t key = k0 + 2 * p + h;
        if (key <= pos) {
          const uint16_t *vr = a->v + ((table[key / bs] * bs + key % bs) * a->Hkv + kvh) * 64;
          lo[h] = _mm512_loadu_si512((const void *)vr);
          hi[h] = _mm512_loadu_si512((const void *)(vr + 32));
        } else {
          lo[h] = hi[h] = _mm512_setzero_si512();
        }
      }
      _mm512_store_si512((__m512i *)(vb + 0 * 512 + p * 32), _mm512_unpacklo_epi16(lo[0], lo[1]));
      _mm512_store_si512((__m512i *)(vb + 1 * 512 + p * 32), _mm512_unpackhi_epi16(lo[0], lo[1]));
      _mm512_store_si512((__m512i *)(vb + 2 * 512 + p * 32), _mm512_unpacklo_epi16(hi[0], hi[1]));
      _mm512_store_si512((__m512i *)(vb + 3 * 512 + p * 32), _mm512_unpackhi_epi16(hi[0], hi[1]));
    }
    __m512 mx = ninf;
    for (int64_t j = 0; j < seen; j++) mx = _mm512_max_ps(mx, _mm512_load_ps(s + j * LANES));
    const __m512 cand = _mm512_mul_ps(mx, cv);
    const __mmask16 grow = _mm512_cmp_ps_mask(cand, _mm512_add_ps(m, _mm512_set1_ps(LAZY)), _CMP_GT_OQ);
    if (grow) {
      const __mmask16 had = _mm512_cmp_ps_mask(m, ninf, _CMP_NEQ_OQ);
      const __m512 moved = _mm512_mask_mov_ps(m, grow, cand);
      if (grow & had) {
        const __m512 alpha = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), grow & had,
                                                exp2_kept(grow & had, _mm512_sub_ps(m, moved)));
        l = _mm512_mul_ps(l, alpha);
        _tile_stored(4, o, 64);
        _tile_stored(5, o + 256, 64);
        _tile_stored(6, o + 512, 64);
        _tile_stored(7, o + 768, 64);
        /* o rows are lanes: scale lane r's row of each tile by alpha[r] */
        float al[LANES];
        _mm512_storeu_ps(al, alpha);
        for (int64_t t = 0; t < 4; t++)
          for (int64_t r = 0; r < LANES; r++) {
            float *orow = o + t * 256 + r * 16;
            _mm512_store_ps(orow, _mm512_mul_ps(_mm512_load_ps(orow), _mm512_set1_ps(al[r])));
          }
        _tile_loadd(4, o, 64);
        _tile_loadd(5, o + 256, 64);
        _tile_loadd(6, o + 512, 64);
        _tile_loadd(7, o + 768, 64);
      }
      m = moved;
    }
    const __m512 negm = _mm512_sub_ps(_mm512_setzero_ps(), m);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < KB; j++) {
      const __m512 p = exp2_kept(j < seen ? 0xffff : 0, _mm512_fmadd_ps(_mm512_load_ps(s + j * LANES), cv, negm));
      sum = _mm512_add_ps(sum, p);
      _mm512_store_ps(s + j * LANES, p);
    }
    l = _mm512_add_ps(l, sum);
    for (int64_t r = 0; r < nl; r++) {  /* P's rows: lane r's 32 probabilities */
      const __m512 p0 = _mm512_i32gather_ps(gather_idx, s + r, 4);
      const __m512 p1 = _mm512_i32gather_ps(gather_idx, s + 16 * LANES + r, 4);
      _mm512_store_si512((__m512i *)(pa + r * KB), (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    _tile_loadd(2, pa, 64);
    _tile_loadd(3, vb, 64);
    _tile_dpbf16ps(4, 2, 3);
    _tile_loadd(3, vb + 512, 64);
    _tile_dpbf16ps(5, 2, 3);
    _tile_loadd(3, vb + 1024, 64);
    _tile_dpbf16ps(6, 2, 3);
    _tile_loadd(3, vb + 1536, 64);
    _tile_dpbf16ps(7, 2, 3);
  }
  _tile_stored(4, o, 64);
  _tile_stored(5, o + 256, 64);
  _tile_stored(6, o + 512, 64);
  _tile_stored(7, o + 768, 64);
  _mm512_storeu_ps(st->m, m);
  _mm512_storeu_ps(st->l, l);
}
#endif

/* lanes 0 .. nl - 1 of st, normalised, to their output rows outs[i] (bf16, D dimensions) */
static void write_decode(const DecodeState *st, uint16_t *const *outs, int64_t nl, int64_t D) {
  const float *o = st->o;
  /* the pairing undone: dimensions 0-15 of a half are tile t's columns 0-3, t + 1's 0-3, t's 4-7, t + 1's 4-7 */
  const __m512i unpair_lo = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i unpair_hi = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  for (int64_t r = 0; r < nl; r++) {
    uint16_t *dst = outs[r];
    const __m512 inv = _mm512_set1_ps(st->l[r] > 0.0f ? 1.0f / st->l[r] : 0.0f);
    for (int64_t t = 0; t < D / 16; t += 2) {  /* tiles t, t + 1 hold dimensions 32 (t / 2) .. + 31, in fours */
      const __m512 x = _mm512_mul_ps(_mm512_load_ps(o + t * 256 + r * 16), inv);
      const __m512 y = _mm512_mul_ps(_mm512_load_ps(o + (t + 1) * 256 + r * 16), inv);
      const __m512 first = _mm512_permutex2var_ps(x, unpair_lo, y), second = _mm512_permutex2var_ps(x, unpair_hi, y);
      _mm512_storeu_si512((void *)(dst + 32 * (t / 2)), (__m512i)_mm512_cvtne2ps_pbh(second, first));
    }
  }
}

/* decode row `row` for kv head kvh: its R query heads as lanes, its keys from key_start (a group's shared
   keys already in `shared`, lanes laid out as [member][R]: this row is member `member`) or from 0 */
static void decode_row(const Args *a, int64_t row, int64_t kvh, int64_t key_start, const DecodeState *shared,
                       int64_t member) {
  const int64_t H = a->H, R = H / a->Hkv, D = a->D;
  const uint16_t *qrows[LANES];
  uint16_t *outs[LANES];
  for (int64_t r = 0; r < R; r++) {
    qrows[r] = a->q + (a->qstart[row] * H + kvh * R + r) * D;
    outs[r] = a->out + (a->qstart[row] * H + kvh * R + r) * D;
  }
  DecodeState st;
  fresh_state(&st);
  if (shared) {  /* this row's lanes of the group's state, as lanes 0 .. R - 1 */
    for (int64_t r = 0; r < R; r++) {
      const int64_t i = member * R + r;
      for (int64_t t = 0; t < D / 16; t++) memcpy(st.o + t * 256 + r * 16, shared->o + t * 256 + i * 16, 64);
      st.m[r] = shared->m[i];
      st.l[r] = shared->l[i];
    }
  }
  if (key_start < a->seq[row]) decode_keys(a, a->tables + row * a->max_blocks, kvh, qrows, R, key_start, a->seq[row], &st);
  write_decode(&st, outs, R, D);
}

/* Decode rows (query_len 1), R = H / Hkv query heads each. Groups of rows that share a cached prefix
   (group_off [G + 1] into group_rows, indices into the rows; group_len [G] shared keys, whole blocks) have
   those keys read once for the group: its rows' lanes 16 // R rows to a tile, the state handed to each row,
   which goes on with its own keys. Returns 0; 1 bad shape (D must be 64, or 128 in the build without AMX; at
   most 16 query heads per kv head, block_size % 16 == 0); 2 out of memory; 3 AMX refused by the OS. */
int jr_amx_decode_attention(const void *q, const void *k_cache, const void *v_cache, void *out,
                            const int64_t *query_start, const int64_t *seq_len, const int64_t *tables,
                            int64_t max_blocks, int64_t num_rows, int64_t H, int64_t Hkv, int64_t D,
                            int64_t block_size, float scale, int64_t threads, int64_t num_groups,
                            const int64_t *group_off, const int64_t *group_rows, const int64_t *group_len) {
  if ((D != 64 && D != DECODE_MAX_D) || H % Hkv || H / Hkv > LANES || block_size % 16) return 1;
  if (!amx_permitted()) return 3;
  const int64_t R = H / Hkv, per = LANES / R;  /* rows per tile of lanes */
  const Args a = {q, k_cache, v_cache, out, query_start, NULL, seq_len, tables, max_blocks, H, Hkv, D,
                  block_size, scale, NULL, NULL};
  int64_t group_of[num_rows > 0 ? num_rows : 1], member_of[num_rows > 0 ? num_rows : 1];
  int64_t block_base[num_groups + 1];
  for (int64_t r = 0; r < num_rows; r++) group_of[r] = -1;
  block_base[0] = 0;
  for (int64_t g = 0; g < num_groups; g++) {
    const int64_t n = group_off[g + 1] - group_off[g];
    for (int64_t m = 0; m < n; m++) {
      group_of[group_rows[group_off[g] + m]] = g;
      member_of[group_rows[group_off[g] + m]] = m;
    }
    block_base[g + 1] = block_base[g] + (n + per - 1) / per;
  }
  DecodeState *states = NULL;
  if (block_base[num_groups] > 0) {
    states = aligned_alloc(64, sizeof(DecodeState) * (size_t)(block_base[num_groups] * Hkv));
    if (!states) return 2;
  }
#pragma omp parallel num_threads(threads)
  {
    configure_tiles();
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < block_base[num_groups] * Hkv; u++) {  /* each group's shared keys, a tile of lanes */
      const int64_t blk = u / Hkv, kvh = u % Hkv;
      int64_t g = 0;
      while (block_base[g + 1] <= blk) g++;
      const int64_t n = group_off[g + 1] - group_off[g], m0 = (blk - block_base[g]) * per;
      const int64_t members = n - m0 < per ? n - m0 : per;
      const uint16_t *qrows[LANES];
      for (int64_t m = 0; m < members; m++)
        for (int64_t r = 0; r < R; r++)
          qrows[m * R + r] = (const uint16_t *)q + (query_start[group_rows[group_off[g] + m0 + m]] * H + kvh * R + r) * D;
      DecodeState *st = states + u;
      fresh_state(st);
      decode_keys(&a, tables + group_rows[group_off[g]] * max_blocks, kvh, qrows, members * R, 0, group_len[g], st);
    }
#pragma omp for schedule(dynamic, 2)
    for (int64_t i = 0; i < num_rows * Hkv; i++) {
      const int64_t row = i / Hkv, kvh = i % Hkv, g = group_of[row];
      if (g < 0) {
        decode_row(&a, row, kvh, 0, NULL, 0);
      } else {
        const int64_t m = member_of[row];
        decode_row(&a, row, kvh, group_len[g], states + (block_base[g] + m / per) * Hkv + kvh, m % per);
      }
    }
    _tile_release();
  }
  free(states);
  return 0;
}
