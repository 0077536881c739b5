/* Forward-pass kernels besides matmul (csrc/ops.c). float32, C-contiguous buffers; all are
 * called without the GIL and may split work over the pool. `out` may alias the (first) input
 * for every op except attention. */
#ifndef MEMFIT_OPS_H
#define MEMFIT_OPS_H

#include <stdint.h>

#define MF_ROPE_MAX_ROT 2048 /* n_rot limit: cos/sin tables live on the stack */
#define MF_ATTN_MAX_DIM 1024 /* D and Dv limit: per-task q copy and accumulator on the stack */

/* out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w   (w may be NULL) */
void mf_rmsnorm_f32(const float *x, const float *w, float *out, int64_t rows, int64_t d, float eps);

/* x, out: [n, heads, head_dim]; pos: [n]. theta_i = pos * freq_scale * base^(-2i/n_rot) / ff[i]
 * (ff = freq_factors[n_rot/2] or NULL). Normal rotates (2i, 2i+1), neox (i, i + n_rot/2);
 * dims >= n_rot pass through. */
void mf_rope_f32(const float *x, float *out, const int32_t *pos, int64_t n, int64_t heads,
                 int64_t head_dim, int64_t n_rot, double base, double freq_scale, int neox,
                 const float *freq_factors);

/* mf_rope_f32 with YaRN (ggml's rope_yarn): theta_extrap = pos * base^(-2i/n_rot) / ff[i],
 * theta_interp = freq_scale * theta_extrap. ext_factor != 0: ramp = (1 - clamp((i - lo) /
 * max(0.001, hi - lo), 0, 1)) * ext_factor, theta = theta_interp (1 - ramp) + theta_extrap ramp,
 * mscale = attn_factor (1 + 0.1 ln(1 / freq_scale)); else theta = theta_interp, mscale =
 * attn_factor. cos and sin are times mscale. ext_factor 0, attn_factor 1 is mf_rope_f32 bit
 * for bit. */
void mf_rope_yarn_f32(const float *x, float *out, const int32_t *pos, int64_t n, int64_t heads,
                      int64_t head_dim, int64_t n_rot, double base, double freq_scale, int neox,
                      const float *freq_factors, double ext_factor, double attn_factor,
                      double corr_lo, double corr_hi);

/* Row-wise softmax over the last axis k (max-subtracted). */
void mf_softmax_f32(const float *x, float *out, int64_t rows, int64_t k);

/* out = 1 / (1 + expf(-x)) elementwise over n values (scalar expf on every ISA). */
void mf_sigmoid_f32(const float *x, float *out, int64_t n);

/* out = silu(g) * u  and  out = gelu_tanh(g) * u, elementwise over n values. */
void mf_silu_mul_f32(const float *g, const float *u, float *out, int64_t n);
void mf_fwht_f32(const float *x, float *out, int64_t rows, int64_t n, float scale);
void mf_gelu_mul_f32(const float *g, const float *u, float *out, int64_t n);
/* gpt-oss's clamped SwiGLU (ggml's swiglu_oai): x = min(g, limit), y = clamp(u, -limit, limit),
 * out = x / (1 + exp(-alpha x)) * (y + 1). */
void mf_swiglu_oai_f32(const float *g, const float *u, float *out, int64_t n, float alpha, float limit);
/* gpt-oss's alpha and limit (ggml's LLM_FFN_SWIGLU_OAI_MOE) */
#define MF_OAI_ALPHA 1.702f
#define MF_OAI_LIMIT 7.0f

/* out[i] = float16 bits of x[i] (round to nearest even, IEEE overflow/subnormals), as numpy's
 * x.astype(float16). */
void mf_f32_to_f16(const float *x, uint16_t *out, int64_t n);

/* out = float32(float16(x)) elementwise (round to nearest even, IEEE overflow/subnormals), as
 * numpy's x.astype(float16).astype(float32). */
void mf_round_f16_f32(const float *x, float *out, int64_t n);

/* q[n, Hq, D], k[T, Hkv, D], v[T, Hkv, Dv], out[n, Hq, Dv]; k and v are float32, or float16
 * with kv_f16 (converted exactly on load: the result equals that of the same values as f32).
 * Key t is visible to query i iff kv_pos[t] <= q_pos[i] and (window == 0 or q_pos[i] - kv_pos[t] < window). Score =
 * scale * q.k, then softcap * tanh(score / softcap) when softcap > 0. A query that sees no key
 * gets zeros. sinks (gpt-oss; NULL: none): one logit per q head that joins the softmax
 * denominator only, neither scaled nor capped: the online softmax starts from m = sinks[h],
 * l = 1 (exactly e^(sinks[h] - m) added to the sum) and no value row. */
typedef struct {
    const float *q;
    const void *k, *v; /* float32, or float16 bits (uint16) when kv_f16 */
    float *out;
    const int32_t *q_pos, *kv_pos;
    int64_t n, T;
    int64_t Hq, Hkv, D, Dv;
    float scale, softcap;
    int64_t window;
    int kv_f16;
    const float *sinks; /* [Hq] or NULL */
} mf_attn_args;
void mf_attention_f32(const mf_attn_args *a);

/* KV cache element types, numbered as GGML's type ids (the cache type enum of the paged
 * attention entry point; quantized types are added in the same kernel family). */
enum { MF_KV_F32 = 0, MF_KV_F16 = 1, MF_KV_Q4_0 = 2, MF_KV_Q8_0 = 8 };

/* Attention over a paged KV cache. k/v are pools of physical rows [rows, Hkv, D] / [rows, Hkv,
 * Dv] of kv_type elements. Query row i (position p = q_pos[i]) sees the logical keys 0..p of its
 * sequence (p-window+1..p with a window); logical key t is physical row
 * tables[q_tab[i] + t / bs] * bs + t % bs. q [n, Hq, D] is first rounded in place as llama.cpp
 * does for the cache type (f16: to f16). Same arithmetic and key blocking as mf_attention_f32,
 * so an identity table gives its result bit for bit. out [n, Hq, Dv].
 * v NULL: V inside K (MLA's latent): the value row of key t, kv head g, is the first Dv (<= D)
 * values of its K row, read through K's row stride (the same bits a V pool of those values
 * gives). */
typedef struct {
    float *q;
    const void *k, *v; /* v NULL: V inside K */
    float *out;
    const int32_t *q_pos, *q_tab, *tables;
    int64_t n, Hq, Hkv, D, Dv, bs;
    float scale, softcap;
    int64_t window;
    int kv_type;
    const float *sinks; /* [Hq] attention sinks (as mf_attn_args) or NULL */
} mf_paged_args;
/* 0, or -1 for a kv_type without a kernel. An f16 cache is attended in llama.cpp's CPU
 * flash-attention order with an f16 accumulator while mf_attn_ggml_fa (the default; ops.c),
 * else by the blocked f32-accumulating kernels (the same values as an f32 cache). */
int mf_attention_paged(const mf_paged_args *a);
extern int mf_attn_ggml_fa;

/* Bytes of one cache row of `elems` values (one token, all kv heads), 0 for an unknown type. */
int64_t mf_kv_row_bytes(int kv_type, int64_t elems);
/* Store x[n, elems] f32 into physical rows rows[i] of pool (converted to kv_type). 0 or -1. */
int mf_kv_store(int kv_type, void *pool, const int32_t *rows, const float *x, int64_t n,
                int64_t elems);

#endif
