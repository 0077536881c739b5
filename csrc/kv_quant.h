/* Quantized K/V cache rows (csrc/kv_quant.c): llama.cpp's -ctk/-ctv cache types.
 * A row is the head_dim values of one kv head at one position: f16 values, or head_dim/32
 * ggml blocks (q8_0: f16 d + 32 int8, 34 B; q4_0: f16 d + 16 nibble bytes, 18 B).
 * Type ids are GGML's. */
#ifndef MEMFIT_KV_QUANT_H
#define MEMFIT_KV_QUANT_H

#include <stdint.h>

/* the values of ops.h's MF_KV_* (GGML type ids), as macros so both headers can be included */
#define MF_KVT_F32 0
#define MF_KVT_F16 1
#define MF_KVT_Q4_0 2
#define MF_KVT_Q8_0 8
#define MF_KV_QK 32 /* values per q8_0 / q4_0 block */

/* bytes of one row of n values (n % 32 == 0 for the block types); 0 for an unknown type */
int64_t mf_kvq_row_bytes(int type, int64_t n);

/* rows x[rows, n] -> dst rows of mf_kv_row_bytes(type, n) bytes, as llama.cpp stores them:
 * f16 round to nearest even; q8_0 as ggml's x86 quantize_row_q8_0 (d = amax/127,
 * x * (127/amax) rounded half to even); q4_0 as quantize_row_q4_0_ref. */
void mf_kv_quantize(int type, const float *x, void *dst, int64_t rows, int64_t n);
void mf_kv_dequantize(int type, const void *src, float *y, int64_t rows, int64_t n);

/* Attention over a K/V cache of any cache type pair, llama.cpp's CPU flash-attention loop
 * (ggml_compute_forward_flash_attn_ext_f16_one_chunk): q is converted to K's dot type
 * (f16 for f16 K, q8_0 blocks for q8_0/q4_0 K), score = vec_dot(k, q) * scale (softcap),
 * one online-softmax step per visible key, V rows converted to f32 and accumulated in f32.
 * K rows: key t of kv head g at k + (row(t) * Hkv + g) * row_bytes_k; V rows likewise with
 * row_bytes_v, or, with v NULL (V inside K, MLA), the first Dv values of the K row (type_v must
 * be type_k; for block types Dv is whole blocks).
 * Contiguous (tables NULL): keys t = 0..T-1 at row(t) = t, visible to query i when
 * kv_pos[t] <= q_pos[i] (and q_pos[i] - kv_pos[t] < window when window > 0).
 * Paged (as ops.h mf_paged_args): query i sees logical keys 0..q_pos[i] of its sequence (the
 * last `window` of them with a window), row(t) = tables[q_tab[i] + t / bs] * bs + t % bs.
 * sinks [Hq] (or NULL): per q head a logit in the softmax sum only, applied after the keys as
 * ggml's flash attention does (its M, S and accumulator corrected once). */
typedef struct {
    const float *q;            /* [n, Hq, D] */
    const void *k, *v;         /* rows as above; v NULL: V inside K */
    float *out;                /* [n, Hq, Dv] */
    const int32_t *q_pos, *kv_pos; /* [n]; [T] (contiguous) */
    const int32_t *q_tab, *tables; /* paged: [n], block ids; NULL: contiguous */
    int64_t bs;                /* paged: rows per block */
    int64_t n, T, Hq, Hkv, D, Dv;
    float scale, softcap;
    int64_t window;
    int type_k, type_v;
    const float *sinks;        /* [Hq] or NULL */
} mf_attnq_args;
void mf_attention_kvq(const mf_attnq_args *a);

#endif
