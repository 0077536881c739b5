/* Portable quant code: f16 table, dequantize for every type (bit-exact with gguf-py: same
 * float32 operations in the same order; -std=c11 keeps -ffp-contract=off), the matmul and
 * get_rows drivers over the pool, and the scalar matmul path (dequantized row · f32 x). */
#include "quant_common.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

float mf_f16_table[65536];
const int8_t mf_kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                     1, 13, 25, 38, 53, 69, 89, 113};

const mf_qinfo mf_qtypes[T_MAX] = {
    [T_F32] = {1, 4, XF_F32}, [T_F16] = {1, 2, XF_F32}, [T_BF16] = {1, 2, XF_F32},
    [T_Q4_0] = {32, 18, XF_Q8_32}, [T_Q4_1] = {32, 20, XF_Q8_32}, [T_Q5_0] = {32, 22, XF_Q8_32},
    [T_Q5_1] = {32, 24, XF_Q8_32}, [T_Q8_0] = {32, 34, XF_Q8_32}, [T_IQ4_NL] = {32, 18, XF_Q8_32},
    [T_Q2_K] = {256, 84, XF_Q8_256}, [T_Q3_K] = {256, 110, XF_Q8_256},
    [T_Q4_K] = {256, 144, XF_Q8_256}, [T_Q5_K] = {256, 176, XF_Q8_256},
    [T_Q6_K] = {256, 210, XF_Q8_256}, [T_IQ4_XS] = {256, 136, XF_Q8_256},
    /* ggml's vec_dot_type: Q8_K for the IQ and ternary types, Q8_0 for MXFP4 and NVFP4 */
    [T_IQ2_XXS] = {256, 66, XF_Q8_256}, [T_IQ2_XS] = {256, 74, XF_Q8_256},
    [T_IQ2_S] = {256, 82, XF_Q8_256}, [T_IQ3_XXS] = {256, 98, XF_Q8_256},
    [T_IQ3_S] = {256, 110, XF_Q8_256}, [T_IQ1_S] = {256, 50, XF_Q8_256},
    [T_IQ1_M] = {256, 56, XF_Q8_256}, [T_TQ1_0] = {256, 54, XF_Q8_256},
    [T_TQ2_0] = {256, 66, XF_Q8_256}, [T_MXFP4] = {32, 17, XF_Q8_32},
    [T_NVFP4] = {64, 36, XF_Q8_32},
};

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else { /* subnormal: normalize */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
    else bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static void init_tables(void) {
    for (uint32_t i = 0; i < 65536; i++) mf_f16_table[i] = half_to_float((uint16_t)i);
}
void mf_quant_init(void) { pthread_once(&init_once, init_tables); }

void mf_get_scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) { *d = q[j] & 63; *m = q[j + 4] & 63; }
    else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* ---------------- dequantize, one block at a time ---------------- */

static void dq_q4_0(const uint8_t *b, float *y) {
    float d = mf_f16(b);
    for (int l = 0; l < 16; l++) {
        y[l] = d * (float)((int)(b[2 + l] & 0xF) - 8);
        y[l + 16] = d * (float)((int)(b[2 + l] >> 4) - 8);
    }
}
static void dq_q4_1(const uint8_t *b, float *y) {
    float d = mf_f16(b), m = mf_f16(b + 2);
    for (int l = 0; l < 16; l++) {
        y[l] = d * (float)(b[4 + l] & 0xF) + m;
        y[l + 16] = d * (float)(b[4 + l] >> 4) + m;
    }
}
static void dq_q5_0(const uint8_t *b, float *y) {
    float d = mf_f16(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    for (int l = 0; l < 16; l++) {
        int q0 = (b[6 + l] & 0xF) | (((qh >> l) & 1) << 4);
        int q1 = (b[6 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4);
        y[l] = d * (float)(q0 - 16);
        y[l + 16] = d * (float)(q1 - 16);
    }
}
static void dq_q5_1(const uint8_t *b, float *y) {
    float d = mf_f16(b), m = mf_f16(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    for (int l = 0; l < 16; l++) {
        int q0 = (b[8 + l] & 0xF) | (((qh >> l) & 1) << 4);
        int q1 = (b[8 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4);
        y[l] = d * (float)q0 + m;
        y[l + 16] = d * (float)q1 + m;
    }
}
static void dq_q8_0(const uint8_t *b, float *y) {
    float d = mf_f16(b);
    for (int l = 0; l < 32; l++) y[l] = (float)(int8_t)b[2 + l] * d;
}
static void dq_iq4_nl(const uint8_t *b, float *y) {
    float d = mf_f16(b);
    for (int l = 0; l < 16; l++) {
        y[l] = d * (float)mf_kvalues_iq4nl[b[2 + l] & 0xF];
        y[l + 16] = d * (float)mf_kvalues_iq4nl[b[2 + l] >> 4];
    }
}
static void dq_q2_k(const uint8_t *b, float *y) {
    const uint8_t *sc = b, *qs = b + 16;
    float d = mf_f16(b + 80), dmin = mf_f16(b + 82);
    for (int e = 0; e < 256; e++) {
        int s = sc[e / 16];
        float dl = d * (float)(s & 0xF), ml = dmin * (float)(s >> 4);
        int q = (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
        y[e] = dl * (float)q - ml;
    }
}
static void q3k_scales(const uint8_t *s, int8_t *out) {
    for (int i = 0; i < 16; i++) {
        int lo = (i < 8 ? s[i] : s[i - 8] >> 4) & 0xF;
        int hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        out[i] = (int8_t)((lo | (hi << 4)) - 32);
    }
}
static void dq_q3_k(const uint8_t *b, float *y) {
    const uint8_t *hm = b, *qs = b + 32;
    int8_t sc[16];
    q3k_scales(b + 96, sc);
    float d = mf_f16(b + 108);
    for (int e = 0; e < 256; e++) {
        float dl = d * (float)sc[e / 16];
        int l = e % 32, c = e / 128, s = (e % 128) / 32;
        int q = (qs[32 * c + l] >> (2 * s)) & 3;
        int h = (hm[l] >> (e / 32)) & 1;
        y[e] = dl * (float)(q - ((h ^ 1) << 2));
    }
}
static void dq_q4_k(const uint8_t *b, float *y) {
    float d = mf_f16(b), dmin = mf_f16(b + 2);
    const uint8_t *qs = b + 16;
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        mf_get_scale_min_k4(j, b + 4, &sc, &m);
        float dl = d * (float)sc, ml = dmin * (float)m;
        for (int l = 0; l < 32; l++) {
            int q = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0xF;
            y[32 * j + l] = dl * (float)q - ml;
        }
    }
}
static void dq_q5_k(const uint8_t *b, float *y) {
    float d = mf_f16(b), dmin = mf_f16(b + 2);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        mf_get_scale_min_k4(j, b + 4, &sc, &m);
        float dl = d * (float)sc, ml = dmin * (float)m;
        for (int l = 0; l < 32; l++) {
            int q = ((qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0xF) | (((qh[l] >> j) & 1) << 4);
            y[32 * j + l] = dl * (float)q - ml;
        }
    }
}
static void dq_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = mf_f16(b + 208);
    for (int e = 0; e < 256; e++) {
        int h = e / 128, r = e % 128, l = r % 32, k = r / 32; /* k: 0..3 quarter of the half */
        int lo = (ql[64 * h + l + 32 * (k & 1)] >> (4 * (k >> 1))) & 0xF;
        int hi = (qh[32 * h + l] >> (2 * k)) & 3;
        float dl = d * (float)sc[e / 16];
        y[e] = dl * (float)((lo | (hi << 4)) - 32);
    }
}
static void dq_iq4_xs(const uint8_t *b, float *y) {
    float d = mf_f16(b);
    uint16_t sh = (uint16_t)(b[2] | (b[3] << 8));
    const uint8_t *sl = b + 4, *qs = b + 8;
    for (int j = 0; j < 8; j++) {
        int ls = (((sl[j / 2] >> (4 * (j % 2))) & 0xF) | (((sh >> (2 * j)) & 3) << 4)) - 32;
        float dl = d * (float)ls;
        for (int l = 0; l < 16; l++) {
            y[32 * j + l] = dl * (float)mf_kvalues_iq4nl[qs[16 * j + l] & 0xF];
            y[32 * j + 16 + l] = dl * (float)mf_kvalues_iq4nl[qs[16 * j + l] >> 4];
        }
    }
}

typedef void (*dq_fn)(const uint8_t *, float *);
static const dq_fn dq_table[T_MAX] = {
    [T_Q4_0] = dq_q4_0, [T_Q4_1] = dq_q4_1, [T_Q5_0] = dq_q5_0, [T_Q5_1] = dq_q5_1,
    [T_Q8_0] = dq_q8_0, [T_IQ4_NL] = dq_iq4_nl, [T_Q2_K] = dq_q2_k, [T_Q3_K] = dq_q3_k,
    [T_Q4_K] = dq_q4_k, [T_Q5_K] = dq_q5_k, [T_Q6_K] = dq_q6_k, [T_IQ4_XS] = dq_iq4_xs,
    [T_IQ2_XXS] = mf_dq_iq2_xxs, [T_IQ2_XS] = mf_dq_iq2_xs, [T_IQ2_S] = mf_dq_iq2_s,
    [T_IQ3_XXS] = mf_dq_iq3_xxs, [T_IQ3_S] = mf_dq_iq3_s, [T_IQ1_S] = mf_dq_iq1_s, [T_IQ1_M] = mf_dq_iq1_m,
    [T_MXFP4] = mf_dq_mxfp4, [T_NVFP4] = mf_dq_nvfp4, [T_TQ1_0] = mf_dq_tq1_0, [T_TQ2_0] = mf_dq_tq2_0,
};

int mf_type_ok(int type) {
    if (type == T_F32 || type == T_F16 || type == T_BF16) return 1;
    return type >= 0 && type < T_MAX && mf_qtypes[type].block && dq_table[type] && mf_tables_ready(type);
}

/* n elements (a multiple of the block size) from src into dst; 0 on success. */
int mf_dequant_row(int type, const uint8_t *src, float *dst, int64_t n) {
    if (type == T_F32) { memcpy(dst, src, (size_t)n * 4); return 0; }
    if (type == T_F16) {
        for (int64_t i = 0; i < n; i++) dst[i] = mf_f16(src + 2 * i);
        return 0;
    }
    if (type == T_BF16) {
        for (int64_t i = 0; i < n; i++) {
            uint32_t bits = (uint32_t)(src[2 * i] | (src[2 * i + 1] << 8)) << 16;
            memcpy(dst + i, &bits, 4);
        }
        return 0;
    }
    if (!mf_type_ok(type)) return -1;
    const mf_qinfo *t = &mf_qtypes[type];
    for (int64_t b = 0; b < n / t->block; b++) dq_table[type](src + b * t->bytes, dst + b * t->block);
    return 0;
}
