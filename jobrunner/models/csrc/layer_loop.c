/* A decode step's decoder layers in one native call (jobrunner/models/layer_loop.py calls it via ctypes).

   Why: on a 2-core CPU a decode step of a small model runs ~11 native kernels per layer (norms, the four
   projections on the AMX GEMM, rotary, the KV write, the AMX decode attention, SiLU * up), each called from
   Python through nn.Module, checks and ctypes; sampled on SmolLM2-135M (64 rows, bf16) about a quarter of the
   main thread's time was that Python, while the second core waited at the next parallel region. Here the same
   kernels run back to back from C, with the same arguments, so the results are the Python path's bits.

   The kernels are the ones the Python path calls, reached through function pointers taken from their own
   libraries (amx_gemm.c, fused_ops.c, paged_attention.c, amx_attention.c): this file has no arithmetic of its
   own but the copy of q out of the fused qkv rows (the decode kernel reads q contiguous).

   Per layer (x: the residual stream, bf16 [rows, hidden]):
     h = norm(x) (layer 0), else x = x + down, h = norm(x)       jr_rms_norm (with the add: sum written aside)
     qkv = h Wqkv^T (+ bias); rotary on q, k in place            jr_amx_linear, jr_rotary
     k, v -> cache slots; attn = attention(q)                    jr_write_kv, then per kind of row:
                                                                 jr_paged_attention (short chunks),
                                                                 jr_amx_prompt_attention (chunks),
                                                                 jr_amx_decode_attention (decodes)
     x = x + attn Wo^T, h = norm(x)                              jr_amx_linear, jr_rms_norm
     down = silu(gate) * up of h Wgu^T, times Wd^T               jr_amx_linear, jr_silu_mul, jr_amx_linear
   and after the last layer out = final_norm(x + down). The residual adds fold into the next norm (as the
   Python path's post-attention add does); torch's bf16 add and the kernel's both round float32 sums to nearest
   even, so the bits agree.

   Returns 0, or 100 * (layer + 1) + stage with stage 1 .. 10 the failing call in the order above (rc lost; the Python path says
   why when it reruns the step). `seconds` (NULL: not timed): attention, GEMM and other seconds added. */
#include <stdint.h>
#include <string.h>
#include <time.h>

typedef int (*linear_fn)(const void *x, int64_t ldx, const void *packed, const void *bias, void *out, int64_t ldo,
                         int64_t M, int64_t N, int64_t K, int64_t threads);
typedef int (*norm_fn)(const void *x, const void *add, void *sum_out, void *out, const void *weight, int64_t rows,
                       int64_t n, float eps, int64_t bf16, int64_t threads);
typedef int (*rotary_fn)(void *q, void *k, const void *cos_, const void *sin_, int64_t rows, int64_t hq, int64_t hk,
                         int64_t D, int64_t qs, int64_t ks, int64_t bf16, int64_t threads);
typedef int (*silu_fn)(const void *gate_up, void *out, int64_t rows, int64_t I, int64_t bf16, int64_t threads);
typedef int (*write_kv_fn)(const void *k, const void *v, int64_t ks, int64_t vs, void *k_cache, void *v_cache,
                           const int64_t *slots, int64_t n, int64_t row, int64_t size);
typedef int (*decode_fn)(const void *q, const void *k_cache, const void *v_cache, void *out,
                         const int64_t *query_start, const int64_t *seq_len, const int64_t *tables, int64_t max_blocks,
                         int64_t num_rows, int64_t H, int64_t Hkv, int64_t D, int64_t block_size, float scale,
                         int64_t threads, int64_t num_groups, const int64_t *group_off, const int64_t *group_rows,
                         const int64_t *group_len);

typedef int (*native_fn)(const void *q, const void *k_cache, const void *v_cache, void *out, const int64_t *query_start,
                         const int64_t *query_len, const int64_t *seq_len, const int64_t *tables, int64_t max_blocks,
                         int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t block_size, int64_t window, int64_t bf16, float scale, int64_t threads,
                         int64_t fast_min_query, int64_t num_groups, const int64_t *group_off,
                         const int64_t *group_rows, const int64_t *group_len, const int64_t *key_start,
                         int64_t kv_fp8);
typedef int (*chunk_fn)(const void *q, const void *k_cache, const void *v_cache, void *out, const int64_t *query_start,
                        const int64_t *query_len, const int64_t *seq_len, const int64_t *tables, int64_t max_blocks,
                        int64_t num_rows, int64_t H, int64_t Hkv, int64_t D, int64_t block_size, float scale,
                        void *workspace, int64_t threads);

/* The model: kernels and shapes (fixed once built) */
typedef struct {
  void *linear, *norm, *rotary, *silu, *write_kv, *decode, *native, *chunk;
  int64_t hidden, heads, kv_heads, head_dim, inter, layers;
  float eps, scale;
} JrLoopModel;

/* One layer's weights (AMX-packed projections; bf16 norms) and its KV cache views */
typedef struct {
  const void *in_norm, *post_norm, *qkv, *qkv_bias, *o, *gate_up, *down;
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

/* this layer's attention of every row into s->attn (each kernel writes its own rows); 0 or the failing kernel's rc */
static int attend(const JrLoopModel *m, const JrLoopLayer *L, const JrLoopStep *s) {
  const int64_t D = m->head_dim, th = s->threads;
  const JrLoopRows *n = &s->natives, *c = &s->chunks, *d = &s->decodes;
  if (n->num_rows && ((native_fn)m->native)(s->q, L->k_cache, L->v_cache, s->attn, n->start, n->len, n->seq,
                                             n->tables, n->max_blocks, n->num_rows, m->heads, m->kv_heads, D,
                                             s->block_size, 0, 1, m->scale, th, s->fast_min_query, n->num_groups,
                                             n->group_off, n->group_rows, n->group_len, n->key_start, 0))
    return 1;
  if (c->num_rows && ((chunk_fn)m->chunk)(s->q, L->k_cache, L->v_cache, s->attn, c->start, c->len, c->seq,
                                           c->tables, c->max_blocks, c->num_rows, m->heads, m->kv_heads, D,
                                           s->block_size, m->scale, s->workspace, th))
    return 1;
  if (d->num_rows && ((decode_fn)m->decode)(s->q, L->k_cache, L->v_cache, s->attn, d->start, d->seq, d->tables,
                                             d->max_blocks, d->num_rows, m->heads, m->kv_heads, D, s->block_size,
                                             m->scale, th, d->num_groups, d->group_off, d->group_rows, d->group_len))
    return 1;
  return 0;
}

static inline double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* charge the time since *mark to seconds[part] (when timing) */
static inline void lap(double *seconds, int part, double *mark) {
  if (!seconds) return;
  const double t = now();
  seconds[part] += t - *mark;
  *mark = t;
}

enum { ATTENTION = 0, GEMM = 1, OTHER = 2 };

int jr_layer_loop(const JrLoopModel *m, const JrLoopLayer *layers, const JrLoopStep *s, double *seconds) {
  const linear_fn linear = (linear_fn)m->linear;
  const norm_fn norm = (norm_fn)m->norm;
  const rotary_fn rotary = (rotary_fn)m->rotary;
  const silu_fn silu = (silu_fn)m->silu;
  const write_kv_fn write_kv = (write_kv_fn)m->write_kv;
  const int64_t T = s->rows, th = s->threads, H = m->hidden, D = m->head_dim;
  const int64_t qn = m->heads * D, kvn = m->kv_heads * D, qkvn = qn + 2 * kvn, I = m->inter;
  double mark = seconds ? now() : 0.0;
  const void *x = s->x;
  for (int64_t i = 0; i < m->layers; i++) {
    const JrLoopLayer *L = layers + i;
    const int64_t err = 100 * (i + 1);
    void *next = x == s->x0 ? s->x1 : s->x0;
    if (i == 0) {
      if (norm(x, NULL, NULL, s->h, L->in_norm, T, H, m->eps, 1, th)) return err + 1;
    } else {
      if (norm(x, s->down, next, s->h, L->in_norm, T, H, m->eps, 1, th)) return err + 1;
      x = next;
      next = x == s->x0 ? s->x1 : s->x0;
    }
    lap(seconds, OTHER, &mark);
    if (linear(s->h, H, L->qkv, L->qkv_bias, s->qkv, qkvn, T, qkvn, H, th)) return err + 2;
    lap(seconds, GEMM, &mark);
    uint16_t *qkv = (uint16_t *)s->qkv;
    if (rotary(qkv, qkv + qn, s->cos, s->sin, T, m->heads, m->kv_heads, D, qkvn, qkvn, 1, th)) return err + 3;
    lap(seconds, OTHER, &mark);
    if (write_kv(qkv + qn, qkv + qn + kvn, qkvn, qkvn, L->k_cache, L->v_cache, s->slots, T, kvn, 2)) return err + 4;
    for (int64_t t = 0; t < T; t++) memcpy((uint16_t *)s->q + t * qn, qkv + t * qkvn, (size_t)qn * 2);
    if (attend(m, L, s)) return err + 5;
    lap(seconds, ATTENTION, &mark);
    if (linear(s->attn, qn, L->o, NULL, s->o, H, T, H, qn, th)) return err + 6;
    lap(seconds, GEMM, &mark);
    if (norm(x, s->o, next, s->h, L->post_norm, T, H, m->eps, 1, th)) return err + 7;
    x = next;
    lap(seconds, OTHER, &mark);
    if (linear(s->h, H, L->gate_up, NULL, s->gate_up, 2 * I, T, 2 * I, H, th)) return err + 8;
    lap(seconds, GEMM, &mark);
    if (silu(s->gate_up, s->act, T, I, 1, th)) return err + 9;
    lap(seconds, OTHER, &mark);
    if (linear(s->act, I, L->down, NULL, s->down, H, T, H, I, th)) return err + 10;
    lap(seconds, GEMM, &mark);
  }
  void *last = x == s->x0 ? s->x1 : s->x0;
  if (norm(x, s->down, last, s->out, s->final_norm, T, H, m->eps, 1, th)) return 100 * (m->layers + 1) + 1;
  lap(seconds, OTHER, &mark);
  return 0;
}
