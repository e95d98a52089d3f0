/* W8A8 linear layers on AVX-512 VNNI dot products (vpdpbusd), for CPUs with VNNI and bf16 activations (AMD Zen 4
   / Zen 5, Cooper Lake; Ice Lake and later Xeons): out[M, N] = bf16(q(x)[M, K] W[N, K]^T * s_x * s_w) (+ bias),
   in one call: the per-token quantization of x, the exact int32 GEMM and the scaling. jobrunner/quant/w8a8.py
   calls it via ctypes (kernel "vnni"), and the layer loop (layer_loop.c) through the same signature as the bf16
   GEMMs; built with -mavx512vnni.

   Why: a vpdpbusd multiplies 64 byte pairs where vdpbf16ps multiplies 32 bf16 pairs, at the same rate; at a
   decode step's row counts on a small model the GEMM is bound by those instructions, so an int8 product does the
   step's GEMMs in about half the instructions of the bf16 one, and reads half the weight bytes.

   Numbers (the same as jobrunner.quant.primitives.quantize_rows_int8 then torch._int_mm, which the tests check
   bit for bit): per row s_x = max|x| / 127 (1 for a zero row), q = rint(x / s_x) clamped to +-127 (float32
   division, round half to even); acc = sum_k q W exactly in int32 (|acc| < 2^31 for K < 66,000); y =
   (float(acc) * s_w) * s_x rounded to bf16 once (nearest even): oneDNN's order, so its W8A8 GEMM gives the same
   bits; with a bias, y + bias in float rounded again (a bf16 add, as the torch path adds it). vpdpbusd takes unsigned x bytes, so the rows are stored as q + 128 and
   128 sum_k W[n, k] (kept with the packed weight) is taken off each sum. A row's result does not depend on the
   other rows, the thread count or M (batch-invariant).

   Packed weight (jr_i8_pack), N * K + 8 N bytes: N / 16 column blocks, each K / 64 chunks of 1 KB, block-major;
   chunk (nb, kb), row r holds the 16 quads (W[16 nb + c, 64 kb + 4 r .. 4 r + 3]), c = 0 .. 15: the 64-byte B
   operand of one vpdpbusd (and the AMX-INT8 tile layout); then the N int32 offsets 128 sum_k W[n, k], then the N
   float32 weight scales.

   Work: the rows are quantized into a per-thread workspace (threads over rows), then threads own contiguous
   ranges of column blocks, NB = 4 at a time, and walk the rows MR = 6 at a time with 24 int32 accumulators.

   Built with -DJR_W8A8_TILES (libraries amx_i8_gemm and i8_tile_emulated, kernels/build.py) the product runs on
   AMX-INT8 tiles instead (tdpbusd: a 16-row x 64-byte tile of the quantized rows times a 1 KB chunk of the
   packed weight, which is the B tile layout already): as the AMX bf16 GEMM (amx_gemm.c), a thread walks its
   column blocks two at a time and the rows 32 at a time, four C tiles, two A and two B tiles. Integer sums are
   exact, so the tiles give the VNNI build's bits (tested with the tile operations emulated on vpdpbusd,
   include/jr_tile_avx512.h, on CPUs without AMX). */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "jr_kernels.h"
#include "jr_numerics.h" /* widen_bf16x16 */
#ifdef JR_W8A8_TILES
#include "jr_amx.h" /* the AMX tile set-up, or the tile operations on AVX-512 (-DJR_TILE_AVX512) */
#endif

#define NB 4 /* column blocks of 16 per micro-tile */
#define MR 6 /* rows per micro-tile */

int jr_i8_gemm_ready(void) {
  const int simd = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512bf16");
#ifdef JR_W8A8_TILES
  return simd && amx_permitted() ? 1 : 0;
#else
  return simd ? 1 : 0;
#endif
}

/* W [N, K] int8 row-major and its scales [N] -> the packed layout above; N % 16 == 0 and K % 64 == 0 (else 1) */
int jr_i8_pack(const int8_t *w, const float *scales, uint8_t *packed, int64_t N, int64_t K) {
  if (N % 16 || K % 64 || N <= 0 || K <= 0 || K >= 66000) return 1;
  const int64_t kt = K / 64;
  int32_t *offset = (int32_t *)(packed + N * K);
  float *scale = (float *)(offset + N);
#pragma omp parallel for schedule(static)
  for (int64_t nb = 0; nb < N / 16; nb++) {
    for (int64_t kb = 0; kb < kt; kb++) {
      uint8_t *chunk = packed + (nb * kt + kb) * 1024;
      for (int64_t r = 0; r < 16; r++)
        for (int64_t c = 0; c < 16; c++) memcpy(chunk + r * 64 + c * 4, w + (nb * 16 + c) * K + kb * 64 + 4 * r, 4);
    }
    for (int64_t c = 0; c < 16; c++) {
      const int8_t *row = w + (nb * 16 + c) * K;
      int32_t sum = 0;
      for (int64_t k = 0; k < K; k++) sum += row[k];
      offset[nb * 16 + c] = 128 * sum;
      scale[nb * 16 + c] = scales[nb * 16 + c];
    }
  }
  return 0;
}

/* W^T [K, N] int8 (row stride ldw) -> the packed tiles above (no trailer: the caller writes the column offsets
   and scales after them). Four rows of 16 columns interleave into one 64-byte operand (unpack bytes, then
   words). The int4 layer's path: its expansion writes W^T (kernels/csrc/quant/int4_unpack.c). */
int jr_i8_pack_t(const int8_t *wt, int64_t ldw, uint8_t *packed, int64_t N, int64_t K, int64_t threads) {
  if (N % 16 || K % 64 || N <= 0 || K <= 0 || ldw < N) return 1;
  const int64_t kt = K / 64;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t nb = 0; nb < N / 16; nb++)
    for (int64_t kb = 0; kb < kt; kb++) {
      uint8_t *chunk = packed + (nb * kt + kb) * 1024;
      for (int64_t r = 0; r < 16; r++) {
        const int8_t *src = wt + (kb * 64 + 4 * r) * ldw + nb * 16;
        const __m128i a0 = _mm_loadu_si128((const __m128i *)src), a1 = _mm_loadu_si128((const __m128i *)(src + ldw));
        const __m128i a2 = _mm_loadu_si128((const __m128i *)(src + 2 * ldw));
        const __m128i a3 = _mm_loadu_si128((const __m128i *)(src + 3 * ldw));
        const __m128i t0 = _mm_unpacklo_epi8(a0, a1), t1 = _mm_unpackhi_epi8(a0, a1);
        const __m128i t2 = _mm_unpacklo_epi8(a2, a3), t3 = _mm_unpackhi_epi8(a2, a3);
        __m128i *dst = (__m128i *)(chunk + r * 64);
        _mm_storeu_si128(dst, _mm_unpacklo_epi16(t0, t2));
        _mm_storeu_si128(dst + 1, _mm_unpackhi_epi16(t0, t2));
        _mm_storeu_si128(dst + 2, _mm_unpacklo_epi16(t1, t3));
        _mm_storeu_si128(dst + 3, _mm_unpackhi_epi16(t1, t3));
      }
    }
  return 0;
}

/* row x (bf16, K % 32 == 0) -> bytes q + 128 and its scale */
static void quantize_row(const uint16_t *x, int64_t K, uint8_t *q, float *scale) {
  __m512i top = _mm512_setzero_si512();
  const __m512i mask = _mm512_set1_epi16(0x7fff);
  for (int64_t k = 0; k < K; k += 32)
    top = _mm512_max_epu16(top, _mm512_and_si512(_mm512_loadu_si512((const void *)(x + k)), mask));
  uint16_t lanes[32], t = 0;
  _mm512_storeu_si512((void *)lanes, top);
  for (int i = 0; i < 32; i++) t = lanes[i] > t ? lanes[i] : t;
  union { uint32_t u; float f; } amax = {(uint32_t)t << 16};
  const float s = amax.f > 0.f ? amax.f / 127.f : 1.f;
  *scale = s;
  const __m512 vs = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  const __m512i zp = _mm512_set1_epi32(128);
  for (int64_t k = 0; k < K; k += 16) {
    const __m512 v = widen_bf16x16(_mm256_loadu_si256((const __m256i *)(x + k)));
    __m512 r = _mm512_roundscale_ps(_mm512_div_ps(v, vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
    _mm_storeu_si128((__m128i *)(q + k), _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(r), zp)));
  }
}

/* row x (bf16, K % 32 == 0) -> asymmetric codes u in 0 .. 255, its scale and zero point (jr_i8_linear_asym):
   lo = min(x, 0), hi = max(x, 0), s = (hi - lo) / 255 (1 for a zero row), z = rint(-lo / s), u = rint(x / s) + z
   clamped to 0 .. 255 (float32 division, round half to even): a row whose values are mostly of one sign, or whose
   largest value sits on one side, gets up to twice the resolution of the symmetric codes */
static void quantize_row_asym(const uint16_t *x, int64_t K, uint8_t *q, float *scale, int32_t *zero) {
  __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __m512 v = widen_bf16x16(_mm256_loadu_si256((const __m256i *)(x + k)));
    lo = _mm512_min_ps(lo, v);
    hi = _mm512_max_ps(hi, v);
  }
  const float mn = _mm512_reduce_min_ps(lo), mx = _mm512_reduce_max_ps(hi);
  const float s = mx - mn > 0.f ? (mx - mn) / 255.f : 1.f;
  float zf = nearbyintf(-mn / s);
  zf = zf < 0.f ? 0.f : zf > 255.f ? 255.f : zf;
  *scale = s;
  *zero = (int32_t)zf;
  const __m512 vs = _mm512_set1_ps(s), vz = _mm512_set1_ps(zf), top = _mm512_set1_ps(255.f);
  for (int64_t k = 0; k < K; k += 16) {
    const __m512 v = widen_bf16x16(_mm256_loadu_si256((const __m256i *)(x + k)));
    __m512 r = _mm512_add_ps(_mm512_roundscale_ps(_mm512_div_ps(v, vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                             vz);
    r = _mm512_min_ps(_mm512_max_ps(r, _mm512_setzero_ps()), top);
    _mm_storeu_si128((__m128i *)(q + k), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r)));
  }
}

/* a block of int32 sums (row i, column block j at sums + i * stride + j * 16) to bf16 outputs; a function of its
   own: with this code after the loop GCC 12 spilled the accumulators inside it */
static __attribute__((noinline)) void finish(const int32_t *sums, int64_t stride, const float *sx, const int32_t *zx,
                                             const int32_t *offset, const float *sw, const uint16_t *bias,
                                             uint16_t *out, int64_t ldo, int64_t m, int64_t nb, int mr, int nbk) {
  for (int j = 0; j < nbk; j++) {
    const int64_t n0 = (nb + j) * 16;
    const __m512i off128 = _mm512_loadu_si512((const void *)(offset + n0));
    const __m512i colsum = _mm512_srai_epi32(off128, 7);  /* offsets are 128 sum_k W: exact */
    const __m512 s = _mm512_loadu_ps(sw + n0);
    __m512 bj = _mm512_setzero_ps();
    if (bias)
      bj = widen_bf16x16(_mm256_loadu_si256((const __m256i *)(bias + n0)));
    for (int i = 0; i < mr; i++) {
      const __m512i acc = _mm512_load_si512((const void *)(sums + i * stride + j * 16));
      /* rows stored as q + 128 (symmetric) or q + z (zx: each row's zero point) */
      const __m512i off = zx ? _mm512_mullo_epi32(colsum, _mm512_set1_epi32(zx[m + i])) : off128;
      const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, off));
      __m256i y = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_mul_ps(v, s), _mm512_set1_ps(sx[m + i])));
      if (bias) {
        const __m512 yf = widen_bf16x16(y);
        y = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(yf, bj));
      }
      _mm256_storeu_si256((__m256i *)(out + (m + i) * ldo + n0), y);
    }
  }
}

#ifndef JR_W8A8_TILES /* the VNNI product: MR rows x NB column blocks in registers */
/* rows m .. m + mr - 1 (bytes of row i at a + i * K, scales sx), column blocks nb .. nb + nbk - 1, whose packed
   chunks start at b (block nb + j at b + j * kt * 1024) */
static inline __attribute__((always_inline)) void micro(const uint8_t *a, const float *sx, const int32_t *zx,
                                                       const uint8_t *b,
                                                       const int32_t *offset, const float *sw, const uint16_t *bias,
                                                       uint16_t *out, int64_t ldo, int64_t m, int64_t nb, int64_t K,
                                                       const int mr, const int nbk) {
  const int64_t kt = K / 64, quads = K / 4;
  __m512i acc[MR][NB];
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nbk; j++) acc[i][j] = _mm512_setzero_si512();
  const uint8_t *r[MR];
  for (int i = 0; i < mr; i++) r[i] = a + (m + i) * K;
  for (int64_t p = 0; p < quads; p++) {
    __m512i w[NB];
    for (int j = 0; j < nbk; j++) w[j] = _mm512_loadu_si512((const void *)(b + j * kt * 1024 + p * 64));
    for (int i = 0; i < mr; i++) {
      int32_t quad;
      memcpy(&quad, r[i] + 4 * p, 4);
      const __m512i v = _mm512_set1_epi32(quad);
      for (int j = 0; j < nbk; j++) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], v, w[j]);
    }
  }
  int32_t sums[MR * NB * 16] __attribute__((aligned(64)));
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nbk; j++) _mm512_store_si512((void *)(sums + (i * NB + j) * 16), acc[i][j]);
  finish(sums, NB * 16, sx, zx, offset, sw, bias, out, ldo, m, nb, mr, nbk);
}

#define ROWS_CASE(R, NBK) \
  case R: micro(a, sx, zx, b, offset, sw, bias, out, ldo, m, nb, K, R, NBK); break;

/* every row, column blocks nb .. nb + nbk - 1 (nbk <= NB; their packed chunks from b) */
#define GROUP(NBK)                                                                                            \
  static void group_##NBK(const uint8_t *a, const float *sx, const int32_t *zx, const uint8_t *b,              \
                          const int32_t *offset,                                                               \
                          const float *sw, const uint16_t *bias, uint16_t *out, int64_t ldo, int64_t M,       \
                          int64_t nb, int64_t K) {                                                             \
    for (int64_t m = 0; m < M; m += MR) {                                                                      \
      switch (M - m < MR ? M - m : MR) {                                                                       \
        ROWS_CASE(1, NBK) ROWS_CASE(2, NBK) ROWS_CASE(3, NBK) ROWS_CASE(4, NBK) ROWS_CASE(5, NBK)              \
        default: micro(a, sx, zx, b, offset, sw, bias, out, ldo, m, nb, K, MR, NBK);                          \
      }                                                                                                        \
    }                                                                                                          \
  }
GROUP(1)
GROUP(2)
GROUP(3)
GROUP(4)

static void run_group(const uint8_t *a, const float *sx, const int32_t *zx, const uint8_t *b, const int32_t *offset,
                      const float *sw, const uint16_t *bias, uint16_t *out, int64_t ldo, int64_t M, int64_t nb,
                      int64_t nbk, int64_t K) {
  switch (nbk) {
    case 1: group_1(a, sx, zx, b, offset, sw, bias, out, ldo, M, nb, K); break;
    case 2: group_2(a, sx, zx, b, offset, sw, bias, out, ldo, M, nb, K); break;
    case 3: group_3(a, sx, zx, b, offset, sw, bias, out, ldo, M, nb, K); break;
    default: group_4(a, sx, zx, b, offset, sw, bias, out, ldo, M, nb, K); break;
  }
}
#endif

#ifdef JR_W8A8_TILES
/* One thread's share on the tiles: column blocks nb0 .. nb1 - 1, every row (the workspace holds whole 32-row
   tiles: rows past M are read, never written out) */
static void tile_blocks(const uint8_t *a, const float *sx, const int32_t *zx, const uint8_t *packed,
                        const int32_t *offset,
                        const float *sw, const uint16_t *bias, uint16_t *out, int64_t ldo, int64_t M, int64_t K,
                        int64_t nb0, int64_t nb1) {
  const int64_t kt = K / 64;
  int32_t c[4][256] __attribute__((aligned(64)));
  for (int64_t nb = nb0; nb < nb1; nb += 2) {
    const int two_n = nb + 1 < nb1;
    const uint8_t *b0 = packed + nb * kt * 1024, *b1 = b0 + kt * 1024;
    for (int64_t m = 0; m < M; m += 32) {
      const int two_m = m + 16 < M;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kb = 0; kb < kt; kb++) {
        _tile_loadd(4, a + m * K + kb * 64, K);
        _tile_loadd(6, b0 + kb * 1024, 64);
        _tile_dpbusd(0, 4, 6);
        if (two_n) {
          _tile_loadd(7, b1 + kb * 1024, 64);
          _tile_dpbusd(1, 4, 7);
        }
        if (two_m) {
          _tile_loadd(5, a + (m + 16) * K + kb * 64, K);
          _tile_dpbusd(2, 5, 6);
          if (two_n) _tile_dpbusd(3, 5, 7);
        }
      }
      const int rows0 = M - m < 16 ? (int)(M - m) : 16, rows1 = two_m ? (M - m - 16 < 16 ? (int)(M - m - 16) : 16) : 0;
      _tile_stored(0, c[0], 64);
      finish(c[0], 16, sx, zx, offset, sw, bias, out, ldo, m, nb, rows0, 1);
      if (two_n) {
        _tile_stored(1, c[1], 64);
        finish(c[1], 16, sx, zx, offset, sw, bias, out, ldo, m, nb + 1, rows0, 1);
      }
      if (two_m) {
        _tile_stored(2, c[2], 64);
        finish(c[2], 16, sx, zx, offset, sw, bias, out, ldo, m + 16, nb, rows1, 1);
        if (two_n) {
          _tile_stored(3, c[3], 64);
          finish(c[3], 16, sx, zx, offset, sw, bias, out, ldo, m + 16, nb + 1, rows1, 1);
        }
      }
    }
  }
}
#endif

/* the calling thread's workspace for the quantized rows, grown on demand (one per thread: engines in several
   threads of one process do not share it) */
static __thread uint8_t *workspace;
static __thread size_t workspace_bytes;

static uint8_t *workspace_for(size_t bytes) {
  if (bytes > workspace_bytes) {
    free(workspace);
    workspace = NULL;
    workspace_bytes = 0;
    if (posix_memalign((void **)&workspace, 64, bytes)) return NULL;
    workspace_bytes = bytes;
  }
  return workspace;
}

#ifndef JR_W8A8_TILES /* int4 layers expanded per column block (jr_i4_linear's first way): the VNNI build */
/* 16 int4 codes of columns c0 .. c0 + 15 at input k (the split CPU layout: block_n columns a block, [K][block_n
   / 2] bytes, low nibbles the block's first half of the columns, high nibbles its second half) */
static inline __m128i int4_codes16(const JrInt4Linear *w, int64_t K, int64_t k, int64_t c0) {
  const int64_t half = w->block_n / 2, j = c0 % w->block_n;
  const uint8_t *row = (const uint8_t *)w->packed + (c0 / w->block_n * K + k) * half;
  const __m128i low = _mm_set1_epi8(15);
  if (j < half) return _mm_and_si128(_mm_loadu_si128((const __m128i *)(row + j)), low);
  return _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)(row + j - half)), 4), low);
}

/* 16 codes -> int8 rint(code a + b) clamped to +-127: int4_unpack.c's expand16, the same instructions */
static inline __m128i expand_codes16(__m128i codes, __m512 a, __m512 b) {
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes));
  __m512i i = _mm512_cvtps_epi32(_mm512_fmadd_ps(f, a, b));
  i = _mm512_max_epi32(_mm512_min_epi32(i, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
  return _mm512_cvtepi32_epi8(i);
}

/* columns c0 .. c0 + 15 of the int4 layer expanded to int8 into one column block of jr_i8_pack's layout (dst:
   K / 64 chunks of 1 KB); per group, the factors a = s * inv, b = (z - 8 s) * inv of jr_int4_to_int8_t */
static void expand_block(const JrInt4Linear *w, int64_t K, int64_t c0, uint8_t *dst) {
  const float *inv = (const float *)w->inv;
  const uint16_t *pairs = (const uint16_t *)w->pairs;
  for (int64_t g = 0; g < K / w->group; g++) {
    float fa[16], fb[16];
    for (int64_t j = 0; j < 16; j++) {
      const uint16_t *sz = pairs + 2 * (g * w->pair_stride + c0 + j);
      union { uint32_t u; float f; } s = {(uint32_t)sz[0] << 16}, z = {(uint32_t)sz[1] << 16};
      fa[j] = s.f * inv[c0 + j];
      fb[j] = (z.f - 8.0f * s.f) * inv[c0 + j];
    }
    const __m512 a = _mm512_loadu_ps(fa), b = _mm512_loadu_ps(fb);
    for (int64_t k = g * w->group; k < (g + 1) * w->group; k += 4) {
      const __m128i e0 = expand_codes16(int4_codes16(w, K, k, c0), a, b);
      const __m128i e1 = expand_codes16(int4_codes16(w, K, k + 1, c0), a, b);
      const __m128i e2 = expand_codes16(int4_codes16(w, K, k + 2, c0), a, b);
      const __m128i e3 = expand_codes16(int4_codes16(w, K, k + 3, c0), a, b);
      const __m128i t0 = _mm_unpacklo_epi8(e0, e1), t1 = _mm_unpackhi_epi8(e0, e1);
      const __m128i t2 = _mm_unpacklo_epi8(e2, e3), t3 = _mm_unpackhi_epi8(e2, e3);
      __m128i *row = (__m128i *)(dst + (k / 64) * 1024 + (k % 64) / 4 * 64);  /* jr_i8_pack_t's interleave */
      _mm_storeu_si128(row, _mm_unpacklo_epi16(t0, t2));
      _mm_storeu_si128(row + 1, _mm_unpackhi_epi16(t0, t2));
      _mm_storeu_si128(row + 2, _mm_unpacklo_epi16(t1, t3));
      _mm_storeu_si128(row + 3, _mm_unpackhi_epi16(t1, t3));
    }
  }
}

/* each thread's buffer of expanded column blocks, grown on demand */
static __thread uint8_t *expanded;
static __thread size_t expanded_bytes;

static uint8_t *expanded_for(size_t bytes) {
  if (bytes > expanded_bytes) {
    free(expanded);
    expanded = NULL;
    expanded_bytes = 0;
    if (posix_memalign((void **)&expanded, 64, bytes)) return NULL;
    expanded_bytes = bytes;
  }
  return expanded;
}
#endif

/* out[M, N] (row stride ldo, bf16) = the W8A8 product of x[M, K] (row stride ldx, bf16) and the weight packed by
   jr_i8_pack (+ bias, bf16 [N] or NULL); rows quantized symmetrically or (asym) with a zero point each. With w4
   (VNNI build only) the weight is that int4 layer instead, each thread's column blocks expanded into its buffer
   right before their product, the offsets and scales from its trailer. Returns 0, 1 for a shape it does not take
   (N % 16, K % 64), 2 when a workspace cannot be allocated, 3 (tile build) when the OS refused the AMX tile
   state. */
static int i8_linear(const uint16_t *x, int64_t ldx, const uint8_t *packed, const uint16_t *bias, uint16_t *out,
                     int64_t ldo, int64_t M, int64_t N, int64_t K, int64_t threads, int asym, const JrInt4Linear *w4) {
  if (M == 0) return 0;
  if (N % 16 || K % 64 || M < 0 || N <= 0 || K >= 66000) return 1;
  const int64_t padded = (M + 31) / 32 * 32; /* the tile build reads whole 32-row tiles */
  uint8_t *a = workspace_for((size_t)padded * (size_t)K + (size_t)M * (sizeof(float) + sizeof(int32_t)) + 64);
  if (!a) return 2;
  float *sx = (float *)(a + padded * K); /* K % 64 == 0: aligned */
  int32_t *zero = (int32_t *)(sx + M), *zx = asym ? zero : NULL;
  const int32_t *offset = (const int32_t *)(w4 ? (const uint8_t *)w4->trailer : packed + N * K);
  const float *sw = (const float *)(offset + N);
  const int64_t blocks = N / 16;
  if (threads < 1) threads = 1;
#ifdef JR_W8A8_TILES
  if (!amx_permitted()) return 3;
  if (threads > blocks / 2) threads = blocks / 2 > 0 ? blocks / 2 : 1;
#pragma omp parallel num_threads(threads)
  {
    configure_tiles();
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
      if (asym) quantize_row_asym(x + m * ldx, K, a + m * K, sx + m, zero + m);
      else quantize_row(x + m * ldx, K, a + m * K, sx + m);
    }
    /* contiguous, even shares of the column blocks, in pairs */
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t pairs = (blocks + 1) / 2, p0 = pairs * t / n, p1 = pairs * (t + 1) / n;
    const int64_t nb0 = 2 * p0, nb1 = 2 * p1 < blocks ? 2 * p1 : blocks;
    if (nb0 < nb1) tile_blocks(a, sx, zx, packed, offset, sw, bias, out, ldo, M, K, nb0, nb1);
    _tile_release();
  }
  (void)w4; /* the tile build takes packed weights only */
  return 0;
#else
  const int64_t kt = K / 64;
  int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
  {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
      if (asym) quantize_row_asym(x + m * ldx, K, a + m * K, sx + m, zero + m);
      else quantize_row(x + m * ldx, K, a + m * K, sx + m);
    }
    /* contiguous, even shares of the column blocks, walked NB at a time (the last group of a share shorter); an
       int4 layer's blocks expanded into this thread's buffer first */
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t b0 = blocks * t / n, b1 = blocks * (t + 1) / n;
    uint8_t *buf = w4 ? expanded_for((size_t)NB * (size_t)kt * 1024) : NULL;
    if (w4 && !buf) failed = 1;
    for (int64_t nb = b0; nb < b1 && !(w4 && !buf); nb += NB) {
      const int64_t nbk = b1 - nb < NB ? b1 - nb : NB;
      if (w4)
        for (int64_t j = 0; j < nbk; j++) expand_block(w4, K, (nb + j) * 16, buf + j * kt * 1024);
      run_group(a, sx, zx, w4 ? buf : packed + nb * kt * 1024, offset, sw, bias, out, ldo, M, nb, nbk, K);
    }
  }
  return failed ? 2 : 0;
#endif
}

/* jr_i8_linear with the rows quantized symmetrically (q + 128, quantize_rows_int8) or asymmetrically (q + z per
   row, quantize_row_asym; W8A8 layers and int4's W4A8 in jr_i4_linear): two entry points of one signature, so
   the layer loop calls either through its layer's pointer */
int jr_i8_linear(const uint16_t *x, int64_t ldx, const uint8_t *packed, const uint16_t *bias, uint16_t *out,
                 int64_t ldo, int64_t M, int64_t N, int64_t K, int64_t threads) {
  return i8_linear(x, ldx, packed, bias, out, ldo, M, N, K, threads, 0, NULL);
}

int jr_i8_linear_asym(const uint16_t *x, int64_t ldx, const uint8_t *packed, const uint16_t *bias, uint16_t *out,
                      int64_t ldo, int64_t M, int64_t N, int64_t K, int64_t threads) {
  return i8_linear(x, ldx, packed, bias, out, ldo, M, N, K, threads, 1, NULL);
}

/* An int4 layer's W4A8 call (jobrunner/quant/int4_int8.py): its int4 codes expanded to int8 per output row
   (w8 = rint(((code - 8) s_g + z_g) / S_n), clamped to +-127), the column offsets and scales of the layer (the
   trailer, computed once in Python), then the W8A8 product with asymmetric rows. The same signature as the
   other linears (w in place of the packed weight), so the layer loop calls it too. Returns jr_i8_linear's codes,
   or 4 when the expansion or the packing refuses the shape.

   Two ways to the same bits: with the int4 layout of AVX-512 builds (blocks of a multiple of 32 columns, low and
   high nibbles holding the block's two halves) each thread expands its own column blocks, NB at a time, straight
   into the packed operand layout in a buffer of its own (NB * K * 16 bytes: L2), right before the product reads
   them (expand_block, inside i8_linear's loop over column blocks); otherwise, and in the tile build, the whole layer is expanded to int8 W^T by the int4
   library's jr_int4_to_int8_t (w->expand) into the shared scratch, packed (jr_i8_pack_t), then multiplied. The
   first writes no N x K intermediate: at a 48-row decode step on SmolLM2-135M the second spent more time moving
   the expanded weight through memory (W^T out and back, the tiles out and back) than multiplying it. */

typedef __typeof__(&jr_int4_to_int8_t) expand_fn;
int jr_i4_linear(const uint16_t *x, int64_t ldx, const JrInt4Linear *w, const uint16_t *bias, uint16_t *out,
                 int64_t ldo, int64_t M, int64_t N, int64_t K, int64_t threads) {
  if (M == 0) return 0;
  if (N % 16 || K % 64 || M < 0 || N <= 0 || K >= 66000) return 1;
#ifndef JR_W8A8_TILES
  if (w->split && w->block_n % 32 == 0 && w->block_n <= 64 && w->group % 4 == 0 && K % w->group == 0)
    return i8_linear(x, ldx, NULL, bias, out, ldo, M, N, K, threads, 1, w);
#endif
  if (!w->wt || !w->tiles) return 4;
  if (((expand_fn)w->expand)(w->packed, w->pairs, w->inv, w->wt, K, N / w->block_n, w->block_n, w->split,
                             w->group, N, w->pair_stride, threads))
    return 4;
  if (jr_i8_pack_t(w->wt, N, w->tiles, N, K, threads)) return 4;
  memcpy(w->tiles + N * K, w->trailer, (size_t)N * 8);
  return jr_i8_linear_asym(x, ldx, w->tiles, bias, out, ldo, M, N, K, threads);
}
