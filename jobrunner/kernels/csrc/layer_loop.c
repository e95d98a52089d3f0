/* A decode step's decoder layers in one native call (jobrunner/models/layer_loop.py calls it via ctypes;
   the structs and the kernels' prototypes are in jr_kernels.h).

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
                                                                 (each projection: the packed bf16 GEMM,
                                                                 jr_amx_linear / jr_bf16_linear, or the
                                                                 W8A8 one, jr_i8_linear, per the layer)
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

#include "jr_kernels.h"

/* the kernels' types, from their prototypes (jr_kernels.h): the structs hold them as void * */
typedef __typeof__(&jr_bf16_linear) linear_fn; /* jr_amx_linear and jr_i8_linear: the same parameters */
typedef __typeof__(&jr_rms_norm) norm_fn;
typedef __typeof__(&jr_rotary) rotary_fn;
typedef __typeof__(&jr_silu_mul) silu_fn;
typedef __typeof__(&jr_write_kv) write_kv_fn;
typedef __typeof__(&jr_amx_decode_attention) decode_fn;
typedef __typeof__(&jr_paged_attention) native_fn;
typedef __typeof__(&jr_amx_prompt_attention) chunk_fn;

/* sizeof of the four structs, for the ctypes mirrors' check (tests/kernels) */
int64_t jr_loop_struct_sizes(int64_t *sizes) {
  sizes[0] = sizeof(JrLoopModel);
  sizes[1] = sizeof(JrLoopLayer);
  sizes[2] = sizeof(JrLoopRows);
  sizes[3] = sizeof(JrLoopStep);
  return 4;
}

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
    if (((linear_fn)L->qkv_fn)(s->h, H, L->qkv, L->qkv_bias, s->qkv, qkvn, T, qkvn, H, th)) return err + 2;
    lap(seconds, GEMM, &mark);
    uint16_t *qkv = (uint16_t *)s->qkv;
    if (rotary(qkv, qkv + qn, s->cos, s->sin, T, m->heads, m->kv_heads, D, qkvn, qkvn, 1, th)) return err + 3;
    lap(seconds, OTHER, &mark);
    if (write_kv(qkv + qn, qkv + qn + kvn, qkvn, qkvn, L->k_cache, L->v_cache, s->slots, T, kvn, 2)) return err + 4;
    for (int64_t t = 0; t < T; t++) memcpy((uint16_t *)s->q + t * qn, qkv + t * qkvn, (size_t)qn * 2);
    if (attend(m, L, s)) return err + 5;
    lap(seconds, ATTENTION, &mark);
    if (((linear_fn)L->o_fn)(s->attn, qn, L->o, NULL, s->o, H, T, H, qn, th)) return err + 6;
    lap(seconds, GEMM, &mark);
    if (norm(x, s->o, next, s->h, L->post_norm, T, H, m->eps, 1, th)) return err + 7;
    x = next;
    lap(seconds, OTHER, &mark);
    if (((linear_fn)L->gate_up_fn)(s->h, H, L->gate_up, NULL, s->gate_up, 2 * I, T, 2 * I, H, th)) return err + 8;
    lap(seconds, GEMM, &mark);
    if (silu(s->gate_up, s->act, T, I, 1, th)) return err + 9;
    lap(seconds, OTHER, &mark);
    if (((linear_fn)L->down_fn)(s->act, I, L->down, NULL, s->down, H, T, H, I, th)) return err + 10;
    lap(seconds, GEMM, &mark);
  }
  void *last = x == s->x0 ? s->x1 : s->x0;
  if (norm(x, s->down, last, s->out, s->final_norm, T, H, m->eps, 1, th)) return 100 * (m->layers + 1) + 1;
  lap(seconds, OTHER, &mark);
  return 0;
}
