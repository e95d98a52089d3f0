/* decode_keys for CPUs with AVX-512 BF16 and no AMX: the bf16_attention build of attention/amx_attention.c
   (-DJR_TILE_AVX512) includes this in place of its tile version, after its Args, DecodeState, LANES, KB, LAZY and
   exp2_kept. Same state (the output in DecodeState's paired layout, the lazy base-2 maximum, the sums), same
   arithmetic (float32 scores, P rounded to bf16 into the second product); no tiles.

   Why: the tile version, on emulated tiles, spends one vdpbf16ps per key, query lane and dimension pair for all
   16 lanes of a tile, while a decode of a model with 3 query heads per kv head fills 3 of them (and the output
   product the same, its 13 empty rows included): ~5x the arithmetic needed. Here each lane costs only its own:
   - scores: per lane, D / 32 vdpbf16ps per key into one vector of 16 partial sums; the 16 keys' vectors are
     reduced to one vector of 16 scores by a fixed transposing tree (shuffles and adds, 45 instructions);
   - P V: two keys' value rows paired (unpacklo / unpackhi: the layout write_decode undoes) and one vdpbf16ps per
     16 output dimensions, lane and key pair, with the lane's two probabilities broadcast; the output of up to
     4 lanes (D = 64) or 2 (D = 128) at a time (16 registers), kept in DecodeState between 32-key steps. D = 64 or
   128 (DECODE_MAX_D of the caller's build): one body, instantiated per D so its loops unroll. */
#ifndef JR_DECODE_AVX512_H
#define JR_DECODE_AVX512_H

#define PREFETCH (2 * KB)  /* keys ahead of a step's first that are on their way */

/* lane i of the result: the sum of the 16 lanes of v[(i % 4) * 4 + i / 4] (callers store key j's vector at
   that index, so lane j holds key j's score) */
static inline __m512 sum16_transposed(const __m512 v[16]) {
  __m512 w[8], x[4], y[2];
  for (int j = 0; j < 8; j++)  /* 128-bit lanes: [a 0+2, a 1+3, b 0+2, b 1+3] */
    w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
  for (int j = 0; j < 4; j++)  /* 128-bit lane q: four partial sums of v[4j + q] */
    x[j] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0xDD));
  for (int j = 0; j < 2; j++)  /* lane q: [a 0+2, b 0+2, a 1+3, b 1+3] of v[8j + q], v[8j + 4 + q] */
    y[j] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * j], x[2 * j + 1]), _mm512_unpackhi_ps(x[2 * j], x[2 * j + 1]));
  /* lane q: the sums of v[q], v[4 + q], v[8 + q], v[12 + q] */
  return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x44), _mm512_shuffle_ps(y[0], y[1], 0xEE));
}

/* raw scores of keys krow[0 .. 15] (D = 32 nc bf16 each) against one query (q: its nc 32-dimension chunks) */
static inline __attribute__((always_inline)) __m512 scores16(const uint16_t *const *krow, const __m512bh *q,
                                                             const int nc) {
  __m512 v[16];
  for (int j = 0; j < 16; j++) {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < nc; c++)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const void *)(krow[j] + 32 * c)), q[c]);
    v[(j % 4) * 4 + j / 4] = acc;
  }
  return sum16_transposed(v);
}

static const uint16_t jr_zero_row[DECODE_MAX_D] __attribute__((aligned(64)));  /* keys past the last: K = V = 0 */

/* Keys k_lo .. k_hi - 1 (k_lo a multiple of 16; every key seen by every lane) of kv head kvh through `table`,
   for lanes 0 .. nl - 1 whose queries are at qrows[i], continuing the state st; D = 32 nc */
static inline __attribute__((always_inline)) void decode_keys_d(const Args *a, const int64_t *table, int64_t kvh,
                                                                const uint16_t *const *qrows, int64_t nl,
                                                                int64_t k_lo, int64_t k_hi, DecodeState *st,
                                                                const int nc) {
  const int64_t pos = k_hi - 1, bs = a->bs, D = 32 * nc;
  const int nt = 2 * nc, group = 16 / nt;  /* output vectors per lane; lanes whose outputs fit 16 registers */
  const __m512 cv = _mm512_set1_ps(a->scale * 1.44269504089f);
  const uint16_t *krow[KB], *vrow[KB];
  uint32_t pp[LANES][KB / 2] __attribute__((aligned(64)));  /* lane r's P as bf16 pairs of keys (2i, 2i + 1) */
  for (int64_t k0 = k_lo; k0 <= pos; k0 += KB) {
    const int64_t seen = pos + 1 - k0 < KB ? pos + 1 - k0 : KB;  /* keys of this step the query sees */
    for (int64_t j = 0; j < KB; j++) {
      const int64_t key = k0 + j;
      if (j < seen) {
        const int64_t at = ((table[key / bs] * bs + key % bs) * a->Hkv + kvh) * D;
        krow[j] = a->k + at;
        vrow[j] = a->v + at;
      } else {
        krow[j] = vrow[j] = jr_zero_row;
      }
    }
    /* this step's rows (the first step) and the next step's on their way to L2 (T0 measured slower) */
    for (int64_t key = k0 == k_lo ? k0 : k0 + KB; key < k0 + PREFETCH && key <= pos; key++) {
      const int64_t at = ((table[key / bs] * bs + key % bs) * a->Hkv + kvh) * D;
      for (int c = 0; c < nc; c++) {
        _mm_prefetch((const char *)(a->k + at + 32 * c), _MM_HINT_T1);
        _mm_prefetch((const char *)(a->v + at + 32 * c), _MM_HINT_T1);
      }
    }
    const __mmask16 keep0 = seen >= 16 ? 0xffff : (__mmask16)((1u << seen) - 1);
    const __mmask16 keep1 = seen <= 16 ? 0 : seen >= 32 ? 0xffff : (__mmask16)((1u << (seen - 16)) - 1);
    for (int64_t r = 0; r < nl; r++) {  /* scores, the lane's softmax step, its P as pairs */
      __m512bh q[DECODE_MAX_D / 32];
      for (int c = 0; c < nc; c++) q[c] = (__m512bh)_mm512_loadu_si512((const void *)(qrows[r] + 32 * c));
      const __m512 s0 = _mm512_mul_ps(scores16(krow, q, nc), cv);
      const __m512 s1 = keep1 ? _mm512_mul_ps(scores16(krow + 16, q, nc), cv) : _mm512_setzero_ps();
      const __m512 ninf = _mm512_set1_ps(-INFINITY);
      const float cand = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_mov_ps(ninf, keep0, s0),
                                                            _mm512_mask_mov_ps(ninf, keep1, s1)));
      if (cand > st->m[r] + LAZY) {
        if (st->m[r] != -INFINITY) {  /* rescale what the lane has: its sum and its output */
          const float alpha = exp2f(st->m[r] - cand);
          st->l[r] *= alpha;
          for (int t = 0; t < nt; t++) {
            float *o = st->o + t * 256 + r * 16;
            _mm512_store_ps(o, _mm512_mul_ps(_mm512_load_ps(o), _mm512_set1_ps(alpha)));
          }
        }
        st->m[r] = cand;
      }
      const __m512 negm = _mm512_set1_ps(-st->m[r]);
      const __m512 p0 = exp2_kept(keep0, _mm512_add_ps(s0, negm));
      const __m512 p1 = exp2_kept(keep1, _mm512_add_ps(s1, negm));
      st->l[r] += _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
      _mm512_store_si512((__m512i *)pp[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    const int64_t pairs = (seen + 1) / 2;
    for (int64_t c0 = 0; c0 < nl; c0 += group) {  /* O += P V, `group` lanes' outputs in registers */
      const int64_t cn = nl - c0 < group ? nl - c0 : group;
      __m512 acc[4][4 * DECODE_MAX_D / 64];
      for (int64_t r = 0; r < cn; r++)
        for (int t = 0; t < nt; t++) acc[r][t] = _mm512_load_ps(st->o + t * 256 + (c0 + r) * 16);
      for (int64_t p = 0; p < pairs; p++) {
        __m512bh vp[DECODE_MAX_D / 16];  /* chunk c of the two rows: its unpacklo, then its unpackhi */
        for (int c = 0; c < nc; c++) {
          const __m512i x = _mm512_loadu_si512((const void *)(vrow[2 * p] + 32 * c));
          const __m512i y = _mm512_loadu_si512((const void *)(vrow[2 * p + 1] + 32 * c));
          vp[2 * c] = (__m512bh)_mm512_unpacklo_epi16(x, y);
          vp[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(x, y);
        }
        for (int64_t r = 0; r < cn; r++) {
          const __m512bh pr = (__m512bh)_mm512_set1_epi32((int32_t)pp[c0 + r][p]);
          for (int t = 0; t < nt; t++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], vp[t], pr);
        }
      }
      for (int64_t r = 0; r < cn; r++)
        for (int t = 0; t < nt; t++) _mm512_store_ps(st->o + t * 256 + (c0 + r) * 16, acc[r][t]);
    }
  }
}

static void decode_keys(const Args *a, const int64_t *table, int64_t kvh, const uint16_t *const *qrows, int64_t nl,
                        int64_t k_lo, int64_t k_hi, DecodeState *st) {
  if (a->D == 128)
    decode_keys_d(a, table, kvh, qrows, nl, k_lo, k_hi, st, 4);
  else
    decode_keys_d(a, table, kvh, qrows, nl, k_lo, k_hi, st, 2);
}

#endif
