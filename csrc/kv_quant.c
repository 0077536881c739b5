/* Quantized K/V cache rows and the attention that reads them (see kv_quant.h).
 * The numerics are llama.cpp's on this CPU: rows quantized as ggml's set_rows does (x86
 * quantize_row_q8_0, quantize_row_q4_0_ref), q converted to q8_0 for a quantized K, and the
 * q8_0 / q4_0 x q8_0 dot products with ggml's AVX2 order: integer sums of 4 products in 8
 * lanes, one fma per block and lane with d_k * d_q, then ggml's hsum_float_8. The scalar and
 * AVX2 paths give identical bits (exact integer sums, fmaf). */
#include "memfit.h"
#include "ops.h"
#include "kv_quant.h"
#include "quant_common.h" /* mf_f16_table */

#include <assert.h>
#include <math.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#define MF_X86 1
#include <immintrin.h>
#define MF_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

#define Q8_BYTES 34
#define Q4_BYTES 18

int64_t mf_kvq_row_bytes(int type, int64_t n) {
    switch (type) {
    case MF_KVT_F32: return 4 * n;
    case MF_KVT_F16: return 2 * n;
    case MF_KVT_Q8_0: return n / MF_KV_QK * Q8_BYTES;
    case MF_KVT_Q4_0: return n / MF_KV_QK * Q4_BYTES;
    default: return 0;
    }
}

static inline uint16_t f16_bits(float f) {
    uint16_t h;
    mf_f32_to_f16(&f, &h, 1);
    return h;
}

static inline float ld_f16(const uint8_t *p) { return mf_f16_table[p[0] | (p[1] << 8)]; }

/* ---- quantize / dequantize ---------------------------------------------------------------- */

/* ggml x86 quantize_row_q8_0 (AVX2 branch): d = amax / 127 stored as f16; q = x * (127 / amax)
 * rounded to nearest, ties to even (_mm256_round_ps). Also the q side of the dot products. */
static void q8_0_row(const float *x, uint8_t *y, int64_t n) {
    for (int64_t b = 0; b < n / MF_KV_QK; b++, x += MF_KV_QK, y += Q8_BYTES) {
        float amax = 0.0f;
        for (int j = 0; j < MF_KV_QK; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.f, id = amax != 0.0f ? 127.f / amax : 0.0f;
        const uint16_t h = f16_bits(d);
        memcpy(y, &h, 2);
        for (int j = 0; j < MF_KV_QK; j++) y[2 + j] = (uint8_t)(int8_t)nearbyintf(x[j] * id);
    }
}

/* ggml quantize_row_q4_0_ref: d = (value of largest magnitude, the first one) / -8;
 * q = min(15, (int8)(x / d + 8.5)); element j in the low nibble of byte j, j+16 in the high. */
static void q4_0_row(const float *x, uint8_t *y, int64_t n) {
    for (int64_t b = 0; b < n / MF_KV_QK; b++, x += MF_KV_QK, y += Q4_BYTES) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < MF_KV_QK; j++)
            if (amax < fabsf(x[j])) {
                amax = fabsf(x[j]);
                max = x[j];
            }
        const float d = max / -8, id = d != 0.0f ? 1.0f / d : 0.0f;
        const uint16_t h = f16_bits(d);
        memcpy(y, &h, 2);
        for (int j = 0; j < MF_KV_QK / 2; j++) {
            const float x0 = x[j] * id, x1 = x[MF_KV_QK / 2 + j] * id;
            const int8_t a = (int8_t)(x0 + 8.5f), c = (int8_t)(x1 + 8.5f);
            const uint8_t q0 = a < 15 ? (uint8_t)a : 15, q1 = c < 15 ? (uint8_t)c : 15;
            y[2 + j] = (uint8_t)(q0 | (q1 << 4));
        }
    }
}

static void quantize_row(int type, const float *x, uint8_t *y, int64_t n) {
    switch (type) {
    case MF_KVT_F32: memcpy(y, x, (size_t)n * 4); break;
    case MF_KVT_F16: mf_f32_to_f16(x, (uint16_t *)(void *)y, n); break;
    case MF_KVT_Q8_0: q8_0_row(x, y, n); break;
    case MF_KVT_Q4_0: q4_0_row(x, y, n); break;
    default: assert(0 && "unknown kv type");
    }
}

static void dequantize_row(int type, const uint8_t *x, float *y, int64_t n) {
    switch (type) {
    case MF_KVT_F32: memcpy(y, x, (size_t)n * 4); break;
    case MF_KVT_F16:
        for (int64_t j = 0; j < n; j++) y[j] = ld_f16(x + 2 * j);
        break;
    case MF_KVT_Q8_0:
        for (int64_t b = 0; b < n / MF_KV_QK; b++, x += Q8_BYTES, y += MF_KV_QK) {
            const float d = ld_f16(x);
            for (int j = 0; j < MF_KV_QK; j++) y[j] = (float)(int8_t)x[2 + j] * d;
        }
        break;
    case MF_KVT_Q4_0:
        for (int64_t b = 0; b < n / MF_KV_QK; b++, x += Q4_BYTES, y += MF_KV_QK) {
            const float d = ld_f16(x);
            for (int j = 0; j < MF_KV_QK / 2; j++) {
                y[j] = (float)((x[2 + j] & 0x0F) - 8) * d;
                y[j + MF_KV_QK / 2] = (float)((x[2 + j] >> 4) - 8) * d;
            }
        }
        break;
    default: assert(0 && "unknown kv type");
    }
}

void mf_kv_quantize(int type, const float *x, void *dst, int64_t rows, int64_t n) {
    const int64_t rb = mf_kvq_row_bytes(type, n);
    for (int64_t r = 0; r < rows; r++) quantize_row(type, x + r * n, (uint8_t *)dst + r * rb, n);
}

void mf_kv_dequantize(int type, const void *src, float *y, int64_t rows, int64_t n) {
    const int64_t rb = mf_kvq_row_bytes(type, n);
    for (int64_t r = 0; r < rows; r++) dequantize_row(type, (const uint8_t *)src + r * rb, y + r * n, n);
}

/* ---- dot products: K row (q8_0 or q4_0) x q (q8_0) ---------------------------------------- */

/* ggml's hsum_float_8: (hi + lo), then lanes 0+2, 1+3, then those two */
static inline float hsum8(const float a[8]) {
    const float r0 = a[0] + a[4], r1 = a[1] + a[5], r2 = a[2] + a[6], r3 = a[3] + a[7];
    return (r0 + r2) + (r1 + r3);
}

static float dot_q_scalar(int tk, const uint8_t *k, const uint8_t *q, int64_t D) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const int64_t kb = tk == MF_KVT_Q8_0 ? Q8_BYTES : Q4_BYTES;
    for (int64_t b = 0; b < D / MF_KV_QK; b++, k += kb, q += Q8_BYTES) {
        int8_t kv[MF_KV_QK];
        if (tk == MF_KVT_Q8_0) {
            memcpy(kv, k + 2, MF_KV_QK);
        } else {
            for (int j = 0; j < 16; j++) {
                kv[j] = (int8_t)((k[2 + j] & 0x0F) - 8);
                kv[j + 16] = (int8_t)((k[2 + j] >> 4) - 8);
            }
        }
        const float d = ld_f16(k) * ld_f16(q);
        const int8_t *qv = (const int8_t *)(q + 2);
        for (int l = 0; l < 8; l++) {
            int s = 0;
            for (int j = 4 * l; j < 4 * l + 4; j++) s += kv[j] * qv[j];
            acc[l] = fmaf(d, (float)s, acc[l]);
        }
    }
    return hsum8(acc);
}

#ifdef MF_X86
MF_AVX2 static float dot_q_avx2(int tk, const uint8_t *k, const uint8_t *q, int64_t D) {
    __m256 acc = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1), lo4 = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
    const int64_t kb = tk == MF_KVT_Q8_0 ? Q8_BYTES : Q4_BYTES;
    for (int64_t b = 0; b < D / MF_KV_QK; b++, k += kb, q += Q8_BYTES) {
        __m256i kx;
        if (tk == MF_KVT_Q8_0) {
            kx = _mm256_loadu_si256((const __m256i *)(k + 2));
        } else { /* low nibbles -> bytes 0..15, high nibbles -> 16..31, minus 8 */
            const __m128i t = _mm_loadu_si128((const __m128i *)(k + 2));
            kx = _mm256_insertf128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
            kx = _mm256_sub_epi8(_mm256_and_si256(kx, lo4), eight);
        }
        const __m256i qy = _mm256_loadu_si256((const __m256i *)(q + 2));
        /* |k| * sign(q, k): pairs in int16 (no saturation: |k|, |q| <= 128/127), 4 per int32 */
        const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(kx, kx), _mm256_sign_epi8(qy, kx));
        const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(ld_f16(k) * ld_f16(q)), s, acc);
    }
    float a[8];
    _mm256_storeu_ps(a, acc);
    return hsum8(a);
}
#endif

static float dot_f16(const uint16_t *k, const float *q, int64_t D) {
    float s = 0.0f;
    for (int64_t j = 0; j < D; j++) s += q[j] * mf_f16_table[k[j]];
    return s;
}

/* ---- attention ---------------------------------------------------------------------------- */

static inline const uint8_t *row_at(const mf_attnq_args *a, const void *base, const int32_t *tab,
                                    int64_t t, int64_t g, int64_t rb) {
    const int64_t r = tab ? (int64_t)tab[t / a->bs] * a->bs + t % a->bs : t;
    return (const uint8_t *)base + (r * a->Hkv + g) * rb;
}

/* One (query row, q head): the body is compiled twice, with AVX2+FMA (fmaf and the V loops
 * become vector fma) and portable; both give the same bits. */
static inline __attribute__((always_inline)) void attnq_body(const mf_attnq_args *a, int64_t task, int avx2) {
    const int64_t i = task / a->Hq, h = task % a->Hq, g = h / (a->Hq / a->Hkv), qp = a->q_pos[i];
    const int64_t D = a->D, Dv = a->Dv;
    const int64_t rbk = mf_kvq_row_bytes(a->type_k, D), rbv = mf_kvq_row_bytes(a->type_v, Dv);
    const float *q = a->q + (i * a->Hq + h) * D;
    float *o = a->out + (i * a->Hq + h) * Dv;
    float acc[MF_ATTN_MAX_DIM], vr[MF_ATTN_MAX_DIM], qf[MF_ATTN_MAX_DIM];
    uint8_t qq[MF_ATTN_MAX_DIM / MF_KV_QK * Q8_BYTES];
    const int kq = a->type_k == MF_KVT_Q8_0 || a->type_k == MF_KVT_Q4_0;
    if (kq) q8_0_row(q, qq, D);
    else if (a->type_k == MF_KVT_F16) mf_round_f16_f32(q, qf, D); /* q as f16, like llama.cpp */
    else memcpy(qf, q, (size_t)D * sizeof(float));
    /* softcap folded into the scale first, as ggml does */
    const float scale = a->softcap > 0.0f ? a->scale / a->softcap : a->scale;
    float M = -INFINITY, S = 0.0f;
    memset(acc, 0, (size_t)Dv * sizeof(float));
    /* paged: logical keys t0..qp of this row's sequence; contiguous: all T, masked by kv_pos */
    const int32_t *tab = a->tables ? a->tables + (a->q_tab ? a->q_tab[i] : 0) : NULL;
    const int64_t t0 = tab && a->window > 0 && qp - a->window + 1 > 0 ? qp - a->window + 1 : 0;
    const int64_t t1 = tab ? qp + 1 : a->T;
    for (int64_t t = t0; t < t1; t++) {
        if (!tab) {
            const int64_t kp = a->kv_pos[t];
            if (kp > qp || (a->window > 0 && qp - kp >= a->window)) continue;
        }
        const uint8_t *kr = row_at(a, a->k, tab, t, g, rbk);
        float s;
        if (kq) {
#ifdef MF_X86
            s = avx2 ? dot_q_avx2(a->type_k, kr, qq, D) : dot_q_scalar(a->type_k, kr, qq, D);
#else
            (void)avx2;
            s = dot_q_scalar(a->type_k, kr, qq, D);
#endif
        } else if (a->type_k == MF_KVT_F16) {
            s = dot_f16((const uint16_t *)(const void *)kr, qf, D);
        } else {
            const float *kf = (const float *)(const void *)kr;
            s = 0.0f;
            for (int64_t j = 0; j < D; j++) s += qf[j] * kf[j];
        }
        s *= scale;
        if (a->softcap > 0.0f) s = a->softcap * tanhf(s);
        float ms = 1.0f, vs = 1.0f;
        if (s > M) { /* new maximum: rescale what is accumulated */
            const float Mold = M;
            M = s;
            ms = expf(Mold - M);
            for (int64_t j = 0; j < Dv; j++) acc[j] *= ms;
        } else {
            vs = expf(s - M);
        }
        /* V inside K (v NULL): the first Dv values of the K row, in K's type */
        dequantize_row(a->type_v, a->v ? row_at(a, a->v, tab, t, g, rbv) : kr, vr, Dv);
        for (int64_t j = 0; j < Dv; j++) acc[j] = fmaf(vr[j], vs, acc[j]);
        S = S * ms + vs;
    }
    if (a->sinks) { /* after the keys, as ggml: one more term of the sum, no value row */
        const float sk = a->sinks[h];
        float ms = 1.0f, vs = 1.0f;
        if (sk > M) {
            ms = expf(M - sk); /* 0 when no key was visible */
            for (int64_t j = 0; j < Dv; j++) acc[j] *= ms;
        } else {
            vs = expf(sk - M);
        }
        S = S * ms + vs;
    }
    const float inv = S == 0.0f ? 0.0f : 1.0f / S;
    for (int64_t j = 0; j < Dv; j++) o[j] = acc[j] * inv;
}

#ifdef MF_X86
MF_AVX2 static void attnq_task_avx2(const mf_attnq_args *a, int64_t task) { attnq_body(a, task, 1); }
#endif
static void attnq_task_scalar(const mf_attnq_args *a, int64_t task) { attnq_body(a, task, 0); }

static void attnq_task(void *p, int64_t task) {
#ifdef MF_X86
    if (mf_isa >= MF_ISA_AVX2) {
        attnq_task_avx2(p, task);
        return;
    }
#endif
    attnq_task_scalar(p, task);
}

void mf_attention_kvq(const mf_attnq_args *a) {
    const int64_t tasks = a->n * a->Hq;
    int64_t T = a->T;
    if (a->tables)
        for (int64_t i = 0; i < a->n; i++) T = a->q_pos[i] + 1 > T ? a->q_pos[i] + 1 : T;
    if (tasks > 1 && tasks * T * (a->D + a->Dv) >= 65536)
        mf_parallel_for(tasks, attnq_task, (void *)a);
    else
        for (int64_t t = 0; t < tasks; t++) attnq_task((void *)a, t);
}
