/* Every entry point of jobrunner's native libraries, declared once. Each kernel source includes this header (so
   the compiler checks its definitions against these prototypes), layer_loop.c takes its function-pointer types
   from it, and jobrunner/kernels/signatures.py reads it to declare the ctypes argtypes / restype of every
   function (one "library NAME" comment opens each library's block; one prototype per declaration, types among
   void, int, int64_t, float, double and pointers). The libraries' own docs sit in their sources. */
#ifndef JR_KERNELS_H
#define JR_KERNELS_H
#include <stdint.h>

/* library paged_attention: attention/paged_attention.c */
int jr_paged_attention(const void *q, const void *k_cache, const void *v_cache, void *out, const int64_t *query_start,
                       const int64_t *query_len, const int64_t *seq_len, const int64_t *tables, int64_t max_blocks,
                       int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t block_size, int64_t window, int64_t bf16, float scale, int64_t threads,
                       int64_t fast_min_query, int64_t num_groups, const int64_t *group_off,
                       const int64_t *group_rows, const int64_t *group_len, const int64_t *key_start,
                       int64_t kv_fp8);
int jr_fast_lanes(void);
int jr_write_kv(const void *k, const void *v, int64_t ks, int64_t vs, void *k_cache, void *v_cache,
                const int64_t *slots, int64_t n, int64_t row, int64_t size);

/* library amx_attention: attention/amx_attention.c */
int64_t jr_amx_workspace_bytes(const int64_t *seq, int64_t num_rows, int64_t Hkv, int64_t D);
int jr_amx_ready(void);
int jr_amx_prompt_attention(const void *q, const void *k_cache, const void *v_cache, void *out,
                            const int64_t *query_start, const int64_t *query_len, const int64_t *seq_len,
                            const int64_t *tables, int64_t max_blocks, int64_t num_rows, int64_t H, int64_t Hkv,
                            int64_t D, int64_t block_size, float scale, void *work, int64_t threads);
int jr_amx_decode_attention(const void *q, const void *k_cache, const void *v_cache, void *out,
                            const int64_t *query_start, const int64_t *seq_len, const int64_t *tables,
                            int64_t max_blocks, int64_t num_rows, int64_t H, int64_t Hkv, int64_t D,
                            int64_t block_size, float scale, int64_t threads, int64_t num_groups,
                            const int64_t *group_off, const int64_t *group_rows, const int64_t *group_len);

/* library packed_gemm: gemm/packed_gemm.c */
int jr_gemm_panel_width(void);
int jr_gemm_packed(const float *x, int64_t M, int64_t K, int64_t ldx, const float *packed, int64_t N,
                   const float *bias, float *y, int64_t ldy, int64_t num_threads);

/* library amx_gemm: gemm/amx_gemm.c */
int jr_amx_gemm_ready(void);
int jr_amx_pack(const uint16_t *w, uint16_t *packed, int64_t N, int64_t K);
int jr_amx_linear(const uint16_t *x, int64_t ldx, const uint16_t *packed, const uint16_t *bias, uint16_t *out,
                  int64_t ldo, int64_t M, int64_t N, int64_t K, int64_t threads);

/* library bf16_gemm: gemm/bf16_gemm.c */
int jr_bf16_gemm_ready(void);
int jr_bf16_pack(const uint16_t *w, uint16_t *packed, int64_t N, int64_t K);
int jr_bf16_linear(const uint16_t *x, int64_t ldx, const uint16_t *packed, const uint16_t *bias, uint16_t *out,
                   int64_t ldo, int64_t M, int64_t N, int64_t K, int64_t threads);

/* An int4 layer for jr_i4_linear: its CPU int4 blocks (packed, bf16 scale / zero pairs, 1 / row scale) and the
   expansion that reads them (jr_int4_to_int8_t), the int8 W^T and packed-tile scratch it writes (shared by a
   model's int4 layers), the column offsets and scales copied after the tiles (trailer, 8 N bytes) */
typedef struct {
  void *expand;
  const void *packed, *pairs, *inv, *trailer;
  void *wt, *tiles;
  int64_t block_n, split, group, pair_stride;
} JrInt4Linear;

/* library i8_gemm: gemm/i8_gemm.c */
int jr_i8_gemm_ready(void);
int jr_i8_pack(const int8_t *w, const float *scales, uint8_t *packed, int64_t N, int64_t K);
int jr_i8_linear(const uint16_t *x, int64_t ldx, const uint8_t *packed, const uint16_t *bias, uint16_t *out,
                 int64_t ldo, int64_t M, int64_t N, int64_t K, int64_t threads);
int jr_i8_linear_asym(const uint16_t *x, int64_t ldx, const uint8_t *packed, const uint16_t *bias, uint16_t *out,
                      int64_t ldo, int64_t M, int64_t N, int64_t K, int64_t threads);
int jr_i8_pack_t(const int8_t *wt, int64_t ldw, uint8_t *packed, int64_t N, int64_t K, int64_t threads);
int jr_i4_linear(const uint16_t *x, int64_t ldx, const JrInt4Linear *w, const uint16_t *bias, uint16_t *out,
                 int64_t ldo, int64_t M, int64_t N, int64_t K, int64_t threads);

/* library fused_ops: rowops/fused_ops.c */
int jr_rms_norm(const void *x, const void *add, void *sum_out, void *out, const void *weight, int64_t rows,
                int64_t n, float eps, int64_t bf16, int64_t threads);
int jr_rotary(void *q, void *k, const void *cos_, const void *sin_, int64_t rows, int64_t hq, int64_t hk,
              int64_t D, int64_t qs, int64_t ks, int64_t bf16, int64_t threads);
int jr_silu_mul(const void *gate_up, void *out, int64_t rows, int64_t I, int64_t bf16, int64_t threads);

/* library row_argmax: rowops/row_argmax.c */
int jr_row_argmax(const void *x, int64_t *out, int64_t rows, int64_t cols, int64_t row_stride, int64_t bf16,
                  int64_t threads);

/* library int4_unpack: quant/int4_unpack.c */
void jr_int4_unpack_t(const uint8_t *packed, const float *scale, const float *offset, float *out, int64_t K,
                      int64_t nb, int64_t block_n, int64_t split, int64_t group, int64_t ld, int64_t threads);
void jr_int4_unpack_t_bf16(const uint8_t *packed, const float *scale, const float *offset, uint16_t *out, int64_t K,
                           int64_t nb, int64_t block_n, int64_t split, int64_t group, int64_t ld, int64_t threads);
int jr_int4_to_int8_t(const uint8_t *packed, const uint16_t *pairs, const float *inv, int8_t *out, int64_t K,
                      int64_t nb, int64_t block_n, int64_t split, int64_t group, int64_t ld, int64_t pair_stride,
                      int64_t threads);

/* library w8a8: quant/w8a8.c */
void jr_w8a8_quant_bf16(const uint16_t *x, uint8_t *q, float *scale, int64_t M, int64_t K, int64_t zp,
                        int64_t threads);
void jr_w8a8_quant_f32(const uint32_t *x, uint8_t *q, float *scale, int64_t M, int64_t K, int64_t zp,
                       int64_t threads);
void jr_w8a8_rowscale_bf16(const float *y, const float *s, uint16_t *out, int64_t M, int64_t N, int64_t threads);
void jr_w8a8_rowscale_f32(float *y, const float *s, int64_t M, int64_t N, int64_t threads);
void jr_i32_scale_bf16(const int32_t *acc, const float *sm, const float *sn, uint16_t *out, int64_t M, int64_t N,
                       int64_t ldo, int64_t threads);
void jr_i32_scale_f32(const int32_t *acc, const float *sm, const float *sn, float *out, int64_t M, int64_t N,
                      int64_t ldo, int64_t threads);

/* library layer_loop: layer_loop.c (the structs are mirrored by signatures.py's ctypes structures) */

/* The model: kernels (function pointers of the types below) and shapes (fixed once built) */
typedef struct {
  void *norm, *rotary, *silu, *write_kv, *decode, *native, *chunk;
  int64_t hidden, heads, kv_heads, head_dim, inter, layers;
  float eps, scale;
} JrLoopModel;

/* One layer's weights (packed projections, each with the linear kernel that reads its packing: the packed bf16
   GEMM or the W8A8 one, same signature; bf16 norms) and its KV cache views */
typedef struct {
  const void *in_norm, *post_norm, *qkv, *qkv_bias, *o, *gate_up, *down;
  void *qkv_fn, *o_fn, *gate_up_fn, *down_fn;
  void *k_cache, *v_cache;
} JrLoopLayer;

/* Rows of one attention kernel: query starts, query lengths (not for decodes), sequence lengths, block tables
   [num_rows * max_blocks]; groups sharing cached blocks (offsets, members, shared keys; the native kernel's
   also each row's first own key) */
typedef struct {
  int64_t num_rows, max_blocks, num_groups;
  const int64_t *start, *len, *seq, *tables, *group_off, *group_rows, *group_len, *key_start;
} JrLoopRows;

/* One step: rows, buffers (bf16, row-major, rows x the named width), rotary tables, slots, and its rows on each
   attention kernel: AMX decodes, the native kernel (short chunks), the AMX prompt kernel (chunks) */
typedef struct {
  int64_t rows, threads;
  const void *x;          /* the embeddings [rows, hidden] (read only) */
  void *x0, *x1;          /* the residual stream, ping-pong [rows, hidden] */
  void *h, *qkv, *q, *attn, *o, *gate_up, *act, *down, *out;
  const void *cos, *sin;  /* [rows, head_dim] */
  const int64_t *slots;
  int64_t block_size, fast_min_query;
  JrLoopRows decodes, natives, chunks;
  void *workspace;        /* the AMX prompt kernel's (sized by the caller) */
  const void *final_norm;
} JrLoopStep;

int jr_layer_loop(const JrLoopModel *m, const JrLoopLayer *layers, const JrLoopStep *s, double *seconds);
int64_t jr_loop_struct_sizes(int64_t *sizes);

#endif
