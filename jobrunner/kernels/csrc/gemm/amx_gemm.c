/* bf16 linear layers on the AMX matrix units: out[M, N] = x[M, K] W[N, K]^T (+ bias), float32 accumulation,
   rounded to bf16 once (round to nearest even), as oneDNN's bf16 matmul does. jobrunner/models/amx_linear.py
   calls it via ctypes; built only for CPUs with amx_bf16 (-mamx-tile -mamx-bf16 -mavx512bf16).

   Why: at decode row counts (a few to ~128 rows) oneDNN's reordered-weight matmul reaches ~0.5 TFLOP/s a core
   on SmolLM2's shapes (K = 576: few K steps per output tile, so its tile set-up and stores dominate); a step's
   GEMMs were half of a decode step. Here the weight is packed once into the tiles' B layout and every output
   tile pair streams it straight through the tile registers.

   Layout of the packed weight: N / 16 column blocks, each K / 32 tiles of 1 KB, block-major (a block's tiles
   are contiguous, so a thread streams its blocks' weights linearly). Tile (nb, kb), row r, column c holds the
   pair (W[16 nb + c, 32 kb + 2 r], W[16 nb + c, 32 kb + 2 r + 1]): the B operand of tdpbf16ps.

   Work: threads own contiguous ranges of column blocks; a thread walks its blocks two at a time and, for each
   pair, the rows 32 at a time (two 16-row A tiles): four C tiles (tmm0-3), two A tiles (tmm4-5), two B tiles
   (tmm6-7), four products per K step. Rows past M: the last A tile reads a zero-padded copy of the tail rows.
   Rows are walked in blocks of ROW_BLOCK so that a block's activations stay in the core's L2 while the
   weights stream. Each output element's sum runs over K in the same order whatever M, N, the thread count or
   the row's position in the batch (a row's result does not depend on the other rows).
*/
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "jr_amx.h"
#include "jr_kernels.h"
#include "jr_tile_pack.h"

#define ROW_BLOCK 256
#ifndef PREFETCH
#define PREFETCH 4 /* K tiles ahead (0: none) */
#endif

int jr_amx_gemm_ready(void) { return amx_permitted(); }

/* W [N, K] bf16 row-major -> the packed layout above; N % 16 == 0 and K % 32 == 0 (else 1) */
int jr_amx_pack(const uint16_t *w, uint16_t *packed, int64_t N, int64_t K) {
  return jr_pack_tiles(w, packed, N, K); /* include/jr_tile_pack.h */
}

/* rows m0 .. m0 + rows - 1 (rows <= 16) of a float32 C tile (16 x 16 at c) into out's columns n0 .. n0 + 15,
   plus the bias, rounded to bf16 */
static inline void store_rows(const float *c, int64_t rows, uint16_t *out, int64_t ldo, int64_t m0, int64_t n0,
                              __m512 bias) {
  for (int64_t r = 0; r < rows; r++) {
    const __m512 v = _mm512_add_ps(_mm512_load_ps(c + r * 16), bias);
    _mm256_storeu_si256((__m256i *)(out + (m0 + r) * ldo + n0), (__m256i)_mm512_cvtneps_pbh(v));
  }
}

static inline __m512 bias_of(const uint16_t *bias, int64_t n0) {
  if (!bias) return _mm512_setzero_ps();
  const __m256i b = _mm256_loadu_si256((const __m256i *)(bias + n0));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

/* A tile row pointer of 16-row tile starting at row m (the padded tail copy when fewer than 16 rows remain) */
static inline const uint16_t *a_rows(const uint16_t *x, int64_t ldx, const uint16_t *tail, int64_t tail_row,
                                     int64_t m) {
  return m >= tail_row ? tail : x + m * ldx;
}

/* One thread's share: column blocks nb0 .. nb1 - 1, every row */
static void gemm_blocks(const uint16_t *x, int64_t ldx, const uint16_t *tail, int64_t tail_row,
                        const uint16_t *packed, const uint16_t *bias, uint16_t *out, int64_t ldo, int64_t M,
                        int64_t K, int64_t nb0, int64_t nb1) {
  const int64_t kt = K / 32, tile_bytes = 1024;
  float c[4][256] __attribute__((aligned(64)));
  for (int64_t r0 = 0; r0 < M; r0 += ROW_BLOCK) {
    const int64_t r1 = r0 + ROW_BLOCK < M ? r0 + ROW_BLOCK : M;
    for (int64_t nb = nb0; nb < nb1; nb += 2) {
      const int two_n = nb + 1 < nb1;
      const uint8_t *b0 = (const uint8_t *)(packed + nb * kt * 512);
      const uint8_t *b1 = b0 + kt * tile_bytes;
      for (int64_t m = r0; m < r1; m += 32) {
        const int two_m = m + 16 < r1;
        const uint16_t *a0 = a_rows(x, ldx, tail, tail_row, m);
        const uint16_t *a1 = two_m ? a_rows(x, ldx, tail, tail_row, m + 16) : a0;
        const int64_t lda0 = m >= tail_row ? K * 2 : ldx * 2, lda1 = m + 16 >= tail_row ? K * 2 : ldx * 2;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < kt; kb++) {  /* the branches are the same every step: predicted */
          if (PREFETCH && m == r0) { /* the first row pair streams the weights from memory: ask ahead */
            for (int64_t line = 0; line < 1024; line += 64) {
              _mm_prefetch((const char *)b0 + (kb + PREFETCH) * tile_bytes + line, _MM_HINT_T0);
              if (two_n) _mm_prefetch((const char *)b1 + (kb + PREFETCH) * tile_bytes + line, _MM_HINT_T0);
            }
          }
          _tile_loadd(4, a0 + kb * 32, lda0);
          _tile_loadd(6, b0 + kb * tile_bytes, 64);
          _tile_dpbf16ps(0, 4, 6);
          if (two_n) {
            _tile_loadd(7, b1 + kb * tile_bytes, 64);
            _tile_dpbf16ps(1, 4, 7);
          }
          if (two_m) {
            _tile_loadd(5, a1 + kb * 32, lda1);
            _tile_dpbf16ps(2, 5, 6);
            if (two_n) _tile_dpbf16ps(3, 5, 7);
          }
        }
        const int64_t rows0 = r1 - m < 16 ? r1 - m : 16, rows1 = two_m ? (r1 - m - 16 < 16 ? r1 - m - 16 : 16) : 0;
        const __m512 bias0 = bias_of(bias, nb * 16), bias1 = two_n ? bias_of(bias, nb * 16 + 16) : bias0;
        _tile_stored(0, c[0], 64);
        store_rows(c[0], rows0, out, ldo, m, nb * 16, bias0);
        if (two_n) {
          _tile_stored(1, c[1], 64);
          store_rows(c[1], rows0, out, ldo, m, nb * 16 + 16, bias1);
        }
        if (two_m) {
          _tile_stored(2, c[2], 64);
          store_rows(c[2], rows1, out, ldo, m + 16, nb * 16, bias0);
          if (two_n) {
            _tile_stored(3, c[3], 64);
            store_rows(c[3], rows1, out, ldo, m + 16, nb * 16 + 16, bias1);
          }
        }
      }
    }
  }
}

/* out[M, N] (row stride ldo) = x[M, K] (row stride ldx) W^T + bias (bf16 [N] or NULL); packed by jr_amx_pack.
   Returns 0, or 1 for a shape it does not take (N % 16, K % 32), 2 when the OS refused the tile state. */
int jr_amx_linear(const uint16_t *x, int64_t ldx, const uint16_t *packed, const uint16_t *bias, uint16_t *out,
                  int64_t ldo, int64_t M, int64_t N, int64_t K, int64_t threads) {
  if (N % 16 || K % 32 || M <= 0 || N <= 0) return M == 0 ? 0 : 1;
  if (!amx_permitted()) return 2;
  /* rows of the last, partial 16-row tile, zero-padded (the tiles always load 16 rows) */
  const int64_t tail_row = M / 16 * 16;
  uint16_t *tail = NULL;
  if (tail_row < M) {
    tail = (uint16_t *)aligned_alloc(64, (size_t)16 * K * 2);
    if (!tail) return 3;
    memset(tail, 0, (size_t)16 * K * 2);
    for (int64_t r = tail_row; r < M; r++) memcpy(tail + (r - tail_row) * K, x + r * ldx, (size_t)K * 2);
  }
  const int64_t blocks = N / 16;
  if (threads < 1) threads = 1;
  if (threads > blocks / 2) threads = blocks / 2 > 0 ? blocks / 2 : 1;
#pragma omp parallel num_threads(threads)
  {
    configure_tiles();
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    /* contiguous, even-sized shares of the column blocks (pairs stay whole) */
    const int64_t pairs = (blocks + 1) / 2, p0 = pairs * t / n, p1 = pairs * (t + 1) / n;
    const int64_t nb0 = 2 * p0, nb1 = 2 * p1 < blocks ? 2 * p1 : blocks;
    if (nb0 < nb1) gemm_blocks(x, ldx, tail, tail_row, packed, bias, out, ldo, M, K, nb0, nb1);
    _tile_release();
  }
  free(tail);
  return 0;
}
