/* The AMX tile operations the tile kernels use, carried out with AVX-512 BF16 instructions, for CPUs with
   avx512_bf16 and no AMX (AMD Zen 4 / Zen 5, Cooper Lake). jr_amx.h includes it in a build with
   -DJR_TILE_AVX512 (kernels/build.py: library i8_tile_emulated, the W8A8 tile GEMM tested on such a CPU; the
   bf16_attention build of amx_attention.c, whose prompt and decode blocks have their own tile-free code and use
   only the no-op set-up here), so one source serves both kinds of CPU.

   A tile is 16 rows x 64 bytes of this thread's memory (no tile registers): _tile_loadd / _tile_stored copy
   rows in and out at the given stride, _tile_zero clears one, and _tile_dpbf16ps(c, a, b) adds
   C[m][n] += sum over p of A[m][2p] B[p][2n] + A[m][2p + 1] B[p][2n + 1] (float32 C, bf16 pairs in A and B),
   for each row m one vdpbf16ps per pair p with A's pair broadcast to the 16 lanes: what the tile instruction
   computes, pair after pair in the same order; _tile_dpbusd (int8, gemm/i8_gemm.c's tile build) likewise on
   vpdpbusd (a build that uses it adds -mavx512vnni). The configuration calls are no-ops; "permitted" is whether
   the CPU has AVX-512 BF16. */
#ifndef JR_TILE_AVX512_H
#define JR_TILE_AVX512_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#undef _tile_dpbusd
#undef _tile_release

/* this thread's eight tiles */
static __thread uint8_t jr_tiles[8][1024] __attribute__((aligned(64)));

static int amx_permitted(void) { return __builtin_cpu_supports("avx512bf16") ? 1 : 0; }

static inline void configure_tiles(void) {}

static inline __attribute__((always_inline)) void jr_tile_loadd(int t, const void *base, int64_t stride) {
  uint8_t *dst = jr_tiles[t];
  const uint8_t *src = (const uint8_t *)base;
  for (int r = 0; r < 16; r++) _mm512_store_si512((void *)(dst + 64 * r), _mm512_loadu_si512(src + r * stride));
}

static inline __attribute__((always_inline)) void jr_tile_stored(int t, void *base, int64_t stride) {
  const uint8_t *src = jr_tiles[t];
  uint8_t *dst = (uint8_t *)base;
  for (int r = 0; r < 16; r++) _mm512_storeu_si512(dst + r * stride, _mm512_load_si512((const void *)(src + 64 * r)));
}

static inline __attribute__((always_inline)) void jr_tile_zero(int t) {
  for (int r = 0; r < 16; r++) _mm512_store_si512((void *)(jr_tiles[t] + 64 * r), _mm512_setzero_si512());
}

static inline __attribute__((always_inline)) void jr_tile_dpbf16ps(int c, int a, int b) {
  float *C = (float *)jr_tiles[c];
  const int32_t *A = (const int32_t *)jr_tiles[a];
  const uint8_t *B = jr_tiles[b];
  __m512 acc[16];
  for (int m = 0; m < 16; m++) acc[m] = _mm512_load_ps(C + 16 * m);
  for (int p = 0; p < 16; p++) {
    const __m512bh bv = (__m512bh)_mm512_load_si512((const void *)(B + 64 * p));
    for (int m = 0; m < 16; m++) acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_set1_epi32(A[16 * m + p]), bv);
  }
  for (int m = 0; m < 16; m++) _mm512_store_ps(C + 16 * m, acc[m]);
}

/* C[m][n] (int32) += sum over p of the four products A[m][4p + i] (u8) x B[p][4n + i] (s8): tdpbusd, one vpdpbusd
   per quad p (exact integer sums: the order does not matter) */
#ifdef __AVX512VNNI__
static inline __attribute__((always_inline)) void jr_tile_dpbusd(int c, int a, int b) {
  int32_t *C = (int32_t *)jr_tiles[c];
  const int32_t *A = (const int32_t *)jr_tiles[a];
  const uint8_t *B = jr_tiles[b];
  __m512i acc[16];
  for (int m = 0; m < 16; m++) acc[m] = _mm512_load_si512((const void *)(C + 16 * m));
  for (int p = 0; p < 16; p++) {
    const __m512i bv = _mm512_load_si512((const void *)(B + 64 * p));
    for (int m = 0; m < 16; m++) acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_set1_epi32(A[16 * m + p]), bv);
  }
  for (int m = 0; m < 16; m++) _mm512_store_si512((void *)(C + 16 * m), acc[m]);
}
#endif

#define _tile_loadd(t, base, stride) jr_tile_loadd((t), (base), (stride))
#define _tile_stored(t, base, stride) jr_tile_stored((t), (base), (stride))
#define _tile_zero(t) jr_tile_zero(t)
#define _tile_dpbf16ps(c, a, b) jr_tile_dpbf16ps((c), (a), (b))
#define _tile_dpbusd(c, a, b) jr_tile_dpbusd((c), (a), (b))
#define _tile_release() ((void)0)

#endif
