/* The packed bf16 weight layout both packed GEMMs read (gemm/amx_gemm.c on the tiles, gemm/bf16_gemm.c on
   vdpbf16ps): N / 16 column blocks, each K / 32 chunks of 1 KB, block-major; chunk (nb, kb), row r holds the 16
   pairs (W[16 nb + c, 32 kb + 2 r], W[16 nb + c, 32 kb + 2 r + 1]), c = 0 .. 15. */
#ifndef JR_TILE_PACK_H
#define JR_TILE_PACK_H

#include <stdint.h>

/* W [N, K] bf16 row-major -> the layout above; N % 16 == 0 and K % 32 == 0 (else 1) */
static inline int jr_pack_tiles(const uint16_t *w, uint16_t *packed, int64_t N, int64_t K) {
  if (N % 16 || K % 32 || N <= 0 || K <= 0) return 1;
  const int64_t kt = K / 32;
#pragma omp parallel for schedule(static)
  for (int64_t nb = 0; nb < N / 16; nb++)
    for (int64_t kb = 0; kb < kt; kb++) {
      uint16_t *chunk = packed + (nb * kt + kb) * 512;
      for (int64_t r = 0; r < 16; r++)
        for (int64_t c = 0; c < 16; c++) {
          const uint16_t *src = w + (nb * 16 + c) * K + kb * 32 + 2 * r;
          chunk[r * 32 + c * 2] = src[0];
          chunk[r * 32 + c * 2 + 1] = src[1];
        }
    }
  return 0;
}

#endif
