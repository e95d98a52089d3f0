/* bf16 linear layers on AVX-512 BF16 dot products (vdpbf16ps), for CPUs with avx512_bf16 and no AMX (AMD Zen 4 /
   Zen 5, Cooper Lake): out[M, N] = x[M, K] W[N, K]^T (+ bias), float32 accumulation, rounded to bf16 once (round
   to nearest even). jobrunner/models/amx_linear.py calls it via ctypes, in place of amx_gemm.c, where the CPU has
   no tiles; built with -mavx512bf16.

   Why: at a decode step's row counts (a few to ~128 rows) oneDNN's bf16 matmul on avx512_core_bf16 spends much
   of a small layer's time around the product; a decode step streams every weight once, so a kernel that keeps
   an MR x 64 block of the output in registers and reads each weight byte once per MR rows from L2 is what the
   step needs.

   Layout of the packed weight: the AMX GEMM's (jr_amx_pack), so one packing serves both kernels: N / 16 column
   blocks, each K / 32 chunks of 1 KB, block-major; chunk (nb, kb), row r holds the 16 pairs
   (W[16 nb + c, 32 kb + 2 r], W[16 nb + c, 32 kb + 2 r + 1]), c = 0 .. 15: exactly the 64-byte B operand of one
   vdpbf16ps, whose A operand is the pair (x[m, 32 kb + 2 r], x[m, 32 kb + 2 r + 1]) broadcast to every lane.

   Work: threads own contiguous ranges of column blocks, in groups of NB = 4; for each group a thread walks the
   rows MR = 6 at a time, 24 accumulators, and for each K pair loads the group's four B vectors and broadcasts
   each row's pair (the group's weights, K * 128 bytes, stay in L2 while the rows pass). Each output element
   is one chain of vdpbf16ps over the K pairs in order, whatever M, N, the thread count or the row's place in
   the batch: a row's result does not depend on the other rows (batch-invariant). */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "jr_kernels.h"
#include "jr_tile_pack.h"

#define NB 4 /* column blocks of 16 per micro-tile */
#define MR 6 /* rows per micro-tile */

static inline __m512 bias_of(const uint16_t *bias, int64_t n0) {
  if (!bias) return _mm512_setzero_ps();
  const __m256i b = _mm256_loadu_si256((const __m256i *)(bias + n0));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

/* rows m .. m + mr - 1, column blocks nb .. nb + nbk - 1 (mr <= MR, nbk <= NB: constants where it is inlined) */
static inline __attribute__((always_inline)) void micro(const uint16_t *x, int64_t ldx, const uint16_t *packed,
                                                       const uint16_t *bias, uint16_t *out, int64_t ldo,
                                                       int64_t m, int64_t nb, int64_t K, const int mr,
                                                       const int nbk) {
  const int64_t kt = K / 32, pairs = K / 2;
  __m512 acc[MR][NB];
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nbk; j++) acc[i][j] = _mm512_setzero_ps();
  const uint16_t *b = packed + nb * kt * 512;     /* block nb's first chunk; block nb + j at + j * kt * 512 */
  const uint16_t *a[MR];
  for (int i = 0; i < mr; i++) a[i] = x + (m + i) * ldx;
  for (int64_t p = 0; p < pairs; p++) {
    /* pair p: chunk p / 16, its row p % 16; chunks of a block are contiguous, so that is b + p * 32 */
    __m512bh w[NB];
    for (int j = 0; j < nbk; j++) w[j] = (__m512bh)_mm512_loadu_si512((const void *)(b + j * kt * 512 + p * 32));
    for (int i = 0; i < mr; i++) {
      int32_t pair; /* (x[m + i, 2 p], x[m + i, 2 p + 1]) */
      memcpy(&pair, a[i] + 2 * p, 4);
      const __m512bh v = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < nbk; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], v, w[j]);
    }
  }
  for (int j = 0; j < nbk; j++) {
    const __m512 bj = bias_of(bias, (nb + j) * 16);
    for (int i = 0; i < mr; i++) {
      const __m512 s = _mm512_add_ps(acc[i][j], bj);
      _mm256_storeu_si256((__m256i *)(out + (m + i) * ldo + (nb + j) * 16), (__m256i)_mm512_cvtneps_pbh(s));
    }
  }
}

#define ROWS_CASE(R, NBK) \
  case R: micro(x, ldx, packed, bias, out, ldo, m, nb, K, R, NBK); break;

/* every row, column blocks nb .. nb + nbk - 1 (nbk <= NB) */
#define GROUP(NBK)                                                         \
  static void group_##NBK(const uint16_t *x, int64_t ldx, const uint16_t *packed, const uint16_t *bias, \
                          uint16_t *out, int64_t ldo, int64_t M, int64_t nb, int64_t K) {             \
    for (int64_t m = 0; m < M; m += MR) {                                  \
      switch (M - m < MR ? M - m : MR) {                                   \
        ROWS_CASE(1, NBK) ROWS_CASE(2, NBK) ROWS_CASE(3, NBK)              \
        ROWS_CASE(4, NBK) ROWS_CASE(5, NBK) default: micro(x, ldx, packed, bias, out, ldo, m, nb, K, MR, NBK); \
      }                                                                    \
    }                                                                      \
  }
GROUP(1)
GROUP(2)
GROUP(3)
GROUP(4)

int jr_bf16_gemm_ready(void) {
  return __builtin_cpu_supports("avx512bf16") ? 1 : 0;
}

/* W [N, K] bf16 row-major -> the packed layout above (the AMX GEMM's); N % 16 == 0 and K % 32 == 0 (else 1) */
int jr_bf16_pack(const uint16_t *w, uint16_t *packed, int64_t N, int64_t K) {
  return jr_pack_tiles(w, packed, N, K); /* include/jr_tile_pack.h */
}

/* out[M, N] (row stride ldo) = x[M, K] (row stride ldx) W^T + bias (bf16 [N] or NULL); packed by jr_bf16_pack.
   Returns 0, or 1 for a shape it does not take (N % 16, K % 32). */
int jr_bf16_linear(const uint16_t *x, int64_t ldx, const uint16_t *packed, const uint16_t *bias, uint16_t *out,
                   int64_t ldo, int64_t M, int64_t N, int64_t K, int64_t threads) {
  if (M == 0) return 0;
  if (N % 16 || K % 32 || M < 0 || N <= 0) return 1;
  const int64_t blocks = N / 16;
  if (threads < 1) threads = 1;
  if (threads > blocks) threads = blocks;
#pragma omp parallel num_threads(threads)
  {
    /* contiguous, even shares of the column blocks, walked NB at a time (the last group of a share shorter) */
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t b0 = blocks * t / n, b1 = blocks * (t + 1) / n;
    for (int64_t nb = b0; nb < b1; nb += NB) {
      const int64_t nbk = b1 - nb < NB ? b1 - nb : NB;
      switch (nbk) {
        case 1: group_1(x, ldx, packed, bias, out, ldo, M, nb, K); break;
        case 2: group_2(x, ldx, packed, bias, out, ldo, M, nb, K); break;
        case 3: group_3(x, ldx, packed, bias, out, ldo, M, nb, K); break;
        default: group_4(x, ldx, packed, bias, out, ldo, M, nb, K); break;
      }
    }
  }
  return 0;
}
