/* One 16-lane block of prompt-chunk attention for CPUs with AVX-512 BF16 and no AMX: the bf16_attention build
   of attention/amx_attention.c (-DJR_TILE_AVX512) includes this after its Args, LANES, KB and lazy_softmax_step
   (the softmax step it shares with the D = 64 tile block), and runs it in place of the tile blocks. Same layouts (Q^T [D / 32][16 dimension pairs][16 lanes], the staged
   V^T tiles, S^T and P^T keys by lanes), same arithmetic as the D = 64 tile block (scores in base 2, the lazy
   maximum, P rounded to bf16, the output accumulated in float32 in key order): for D = 64 the same bits.

   Why: on emulated tiles each product copied both operands into tile memory, zeroed, loaded and stored its C
   tile, and the scores made one more round trip; here Q^T, V^T and P^T are read in place, a key's dimension
   pair broadcast from its row (16 K rows gathered into one local block first: 16 addresses from one base, not
   16 pointers), and the scores of 16 keys and the output of 16 dimensions stay in registers through their
   products. Measured (2-core Zen 4, one row of 1,254 new tokens after 728 cached, 9 heads / 3 kv heads, D 64,
   /work/bench/pa.py in the session's note): 16.7 -> 12.4 ms a call, 49% -> ~67% of the cores' vdpbf16ps rate;
   D 128 35.6 -> ~26 ms. Tried: prefetching the next step's K rows and V^T to L1 (slower, 13.5 ms). Every
   D % 32 == 0 up to MAX_D; the caller instantiates D = 64 and 128 so the loops unroll. */
#ifndef JR_PROMPT_AVX512_H
#define JR_PROMPT_AVX512_H

/* S^T of 16 keys (rows kr, kr + stride, ... of the cache: words of 2 bf16) against Q^T (qt) into s [16 keys][16
   lanes]: per dimension pair, 16 vdpbf16ps (the key's pair broadcast, Q^T's row c), in the tile's order */
static inline __attribute__((always_inline)) void native_scores16(const int32_t *kr, int64_t stride,
                                                                  const uint32_t *qt, float *s, const int64_t D) {
  __m512 acc[16];
  int32_t kb[16 * D / 2] __attribute__((aligned(64)));
  for (int m = 0; m < 16; m++)
    for (int64_t c = 0; c < D / 2; c += 16)
      _mm512_store_si512((void *)(kb + m * D / 2 + c), _mm512_loadu_si512((const void *)(kr + m * stride + c)));
  for (int m = 0; m < 16; m++) acc[m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < D / 2; c++) {  /* dimension pair c: Q^T's row c, each key's word c */
    const __m512bh qv = (__m512bh)_mm512_load_si512((const void *)(qt + c * LANES));
    for (int m = 0; m < 16; m++)
      acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_set1_epi32(kb[m * D / 2 + c]), qv);
  }
  for (int m = 0; m < 16; m++) _mm512_store_ps(s + m * LANES, acc[m]);
}

/* acc [D][16 lanes] += V^T P^T for one 32-key step (vb: its staged V^T tiles [D / 16][16 dims][32 keys]; pt: P^T
   [16 key pairs][16 lanes][2]), 16 dimensions at a time in registers, key pairs in order */
static inline __attribute__((always_inline)) void native_values(const uint16_t *vb, const uint16_t *pt, float *acc,
                                                                const int64_t D) {
  const int32_t *v = (const int32_t *)vb;
  for (int64_t j = 0; j < D / 16; j++) {
    __m512 o[16];
    float *at = acc + j * 16 * LANES;
    for (int i = 0; i < 16; i++) o[i] = _mm512_load_ps(at + i * LANES);
    for (int p = 0; p < 16; p++) {
      const __m512bh pv = (__m512bh)_mm512_load_si512((const void *)(pt + p * 2 * LANES));
      for (int i = 0; i < 16; i++)
        o[i] = _mm512_dpbf16_ps(o[i], (__m512bh)_mm512_set1_epi32(v[j * 256 + i * 16 + p]), pv);
    }
    for (int i = 0; i < 16; i++) _mm512_store_ps(at + i * LANES, o[i]);
  }
}

/* One block of 16 lanes (the arguments of attend_block_d64): writes O^T (unnormalised) to acc [D][16 lanes] and
   the softmax sums to *l_out */
static inline __attribute__((always_inline)) void attend_block_native(
    const Args *a, const int64_t *table, int64_t kvh, int64_t seq, const uint16_t *vt, const uint32_t *qt,
    __m512i posv, int64_t last, int64_t lowest, float *acc, __m512 *l_out, const int64_t D) {
  const __m512 cv = _mm512_set1_ps(a->scale * 1.44269504089f);
  const int64_t bs = a->bs, stride = a->Hkv * D / 2;
  float s[KB * LANES] __attribute__((aligned(64)));
  uint16_t pt[KB * LANES] __attribute__((aligned(64)));
  __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
  memset(acc, 0, sizeof(float) * D * LANES);
  for (int64_t k0 = 0; k0 <= last; k0 += KB) {
    for (int64_t half = 0; half < 2; half++) {
      const int64_t key = k0 + 16 * half;
      if (key >= seq) {  /* past the row's keys (and its block table): masked below */
        memset(s + half * 16 * LANES, 0, sizeof(float) * 16 * LANES);
        continue;
      }
      const int32_t *kr = (const int32_t *)(a->k + ((table[key / bs] * bs + key % bs) * a->Hkv + kvh) * D);
      native_scores16(kr, stride, qt, s + half * 16 * LANES, D);
    }
    int rescale = 0;
    const __m512 alpha = lazy_softmax_step(s, posv, k0, lowest, cv, &m, &l, pt, &rescale);
    if (rescale)  /* the output of the lanes whose maximum moved */
      for (int64_t d = 0; d < D; d++)
        _mm512_store_ps(acc + d * LANES, _mm512_mul_ps(_mm512_load_ps(acc + d * LANES), alpha));
    native_values(vt + (k0 / KB) * KB * D, pt, acc, D);
  }
  *l_out = l;
}

#endif
