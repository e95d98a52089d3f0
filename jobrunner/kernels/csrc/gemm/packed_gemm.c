/* float32 y = x @ W^T (+ bias) on a weight packed once into column panels (jobrunner/models/packed_linear.py).

   Packed weight: [num_panels, K, NR] floats, panel p holding output columns p*NR .. p*NR + NR - 1 (zero padded
   past N), so the inner loop reads NR consecutive floats per k. The micro-kernel keeps an MR x NR tile of y in
   vector registers (MR rows x two vectors), and for each k broadcasts one x element per row and multiplies it
   into both weight vectors (fused multiply-add): MR * 2 accumulators, two weight loads, MR broadcasts. Each
   thread takes a contiguous range of panels and sweeps it once per block of MB rows of x, so the block
   (MB x K) stays in L2 while the panels stream past it.

   Every y element is one fused multiply-add chain over k = 0 .. K - 1 in order, whatever M, the row's place in
   the batch, or the thread count: a row's result is batch-invariant (bit-equal however the step was batched).
   Written with GCC vector extensions: 8 lanes on AVX2 builds (MR 6), 16 on AVX-512 builds (MR 12), 4 lanes
   otherwise (MR 6). */
#include <stdint.h>
#include <string.h>

#include "jr_kernels.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VL 16
#define MR 12
#elif defined(__AVX2__)
#define VL 8
#define MR 6
#else
#define VL 4
#define MR 6
#endif
#define NR (2 * VL)
#define MB 96 /* rows of x per work item (a multiple of MR) */

typedef float vf __attribute__((vector_size(VL * sizeof(float))));
typedef float vf_u __attribute__((vector_size(VL * sizeof(float)), aligned(4)));  /* unaligned access */

/* one float in every lane, loaded straight into the register (vbroadcastss from memory: no arithmetic uop) */
static inline __attribute__((always_inline)) vf splat(const float *p) {
#if defined(__AVX512F__)
  return (vf)_mm512_set1_ps(*p);
#elif defined(__AVX2__)
  return (vf)_mm256_broadcast_ss(p);
#else
  const float v = *p;
  return (vf){v, v, v, v};
#endif
}

int jr_gemm_panel_width(void) { return NR; }

/* rows [0, mr) of a tile: y[i, n0 .. n0 + nr) = x[i, :] . panel (+ bias) */
static inline __attribute__((always_inline)) void tile(const int mr, const float *restrict x, int64_t ldx,
                                                       const float *restrict panel, int64_t K,
                                                       const float *restrict bias, float *restrict y,
                                                       int64_t ldy, int64_t nr) {
  vf acc[MR][2];
#pragma GCC unroll 12
  for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = (vf){0};
  for (int64_t k = 0; k < K; k++) {
    const vf b0 = *(const vf_u *)(panel + k * NR), b1 = *(const vf_u *)(panel + k * NR + VL);
#pragma GCC unroll 12
    for (int i = 0; i < MR; i++) {
      if (i < mr) {
        const vf a = splat(x + i * ldx + k);
        acc[i][0] += a * b0;
        acc[i][1] += a * b1;
      }
    }
  }
#pragma GCC unroll 12
  for (int i = 0; i < MR; i++) {
    if (i >= mr) break;
    vf lo = acc[i][0], hi = acc[i][1];
    if (nr == NR) {
      if (bias) {
        lo += *(const vf_u *)bias;
        hi += *(const vf_u *)(bias + VL);
      }
      *(vf_u *)(y + i * ldy) = lo;
      *(vf_u *)(y + i * ldy + VL) = hi;
    } else {  /* the last panel's valid columns only */
      float row[NR];
      *(vf_u *)row = lo;
      *(vf_u *)(row + VL) = hi;
      for (int j = 0; j < nr; j++) y[i * ldy + j] = row[j] + (bias ? bias[j] : 0.0f);
    }
  }
}

/* one tile of mr (1 .. MR) rows: a constant mr per call so the compiler drops the unused accumulators */
static void tile_rows(int mr, const float *x, int64_t ldx, const float *panel, int64_t K, const float *bias,
                      float *y, int64_t ldy, int64_t nr) {
  switch (mr) {
#define CASE(r) case r: tile(r, x, ldx, panel, K, bias, y, ldy, nr); break;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)
#if MR > 6
    CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)
#endif
#undef CASE
    default: break;
  }
}

/* x: [M, K] (row stride ldx), packed: [ceil(N / NR), K, NR], bias: [N] or NULL, y: [M, N] (row stride ldy).
   Returns 0, or 1 for a bad shape. */
int jr_gemm_packed(const float *x, int64_t M, int64_t K, int64_t ldx, const float *packed, int64_t N,
                   const float *bias, float *y, int64_t ldy, int64_t num_threads) {
  if (M < 0 || K <= 0 || N <= 0 || ldx < K || ldy < N) return 1;
  const int64_t num_panels = (N + NR - 1) / NR;
  int threads = (int)(num_threads < 1 ? 1 : num_threads);
  if (threads > num_panels) threads = (int)num_panels;
  /* each thread takes a contiguous range of panels and sweeps it once per block of MB rows */
#pragma omp parallel num_threads(threads)
  {
#ifdef _OPENMP
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int64_t t = 0, nt = 1;
#endif
    const int64_t p0 = num_panels * t / nt, p1 = num_panels * (t + 1) / nt;
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int64_t m_end = m0 + MB < M ? m0 + MB : M;
      for (int64_t p = p0; p < p1; p++) {
        const int64_t n0 = p * NR, nr = N - n0 < NR ? N - n0 : NR;
        const float *panel = packed + p * K * NR;
        for (int64_t m = m0; m < m_end; m += MR) {
          const int mr = (int)(m_end - m < MR ? m_end - m : MR);
          tile_rows(mr, x + m * ldx, ldx, panel, K, bias ? bias + n0 : 0, y + m * ldy + n0, ldy, nr);
        }
      }
    }
  }
  return 0;
}
