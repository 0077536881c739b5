/* MXFP4, NVFP4, TQ1_0, TQ2_0 (ggml's block layouts): scalar dequantizers bit-exact with
 * gguf-py (every value is a product of two exact f32 factors, as there), AVX2 integer
 * vec-dots, AVX-512 VNNI vec-dots of the ternary types (the FP4 types' measured no faster than
 * AVX2's, docs/NOTES.md) and the unpacks that feed the existing prefill GEMMs.
 *
 * MXFP4 (17 B / 32): e8m0 e | qs[16]; x = 2^(e-128) * kv[nibble] (ggml_e8m0_to_fp32_half,
 *   kv = kvalues_mxfp4 = 2 * E2M1); element j low nibble of qs[j], j+16 high. x Q8_0.
 * NVFP4 (36 B / 64): d[4] UE4M3 (one per 16, x 0.5) | qs[32]; sub-block s: low nibbles of
 *   qs[8s..8s+7] are elements 16s..16s+7, high nibbles 16s+8..16s+15. x Q8_0 (two per block).
 * TQ1_0 (54 B / 256): qs[48] | qh[4] | d f16; base-3 digits: trit n of byte q is
 *   ((uint8)(q * 3^n) * 3) >> 8; qs[m] (m < 32) -> elements 32n+m (n < 5), qs[32+m] (m < 16)
 *   -> 160+16n+m (n < 5), qh[m] -> 240+4n+m (n < 4); x = d * (trit - 1). x Q8_K.
 * TQ2_0 (66 B / 256): qs[64] | d f16; element 128j+32l+m = (qs[32j+m] >> 2l) & 3; x = d*(q-1). */
#include "quant_common.h"
#include "simd_x86.h"

#include <immintrin.h>
#include <string.h>

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx512dq,avx2,fma,f16c")))

static const int8_t kv_fp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* ggml_e8m0_to_fp32_half: 2^(e-128), subnormal for e < 2 */
static inline float e8m0_half(uint8_t e) {
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
/* ggml_ue4m3_to_fp32 (x 0.5, bit 7 ignored, 0x7F -> 0): the 7 bits placed as an f16's top
 * exponent/mantissa bits give 2^-7 of the value exactly (normal and subnormal alike) */
static inline float ue4m3_half(uint8_t x) {
    if (x == 0x7F) return 0.0f;
    return mf_f16_table[(uint32_t)(x & 0x7F) << 7] * 128.0f;
}

/* ---------------- dequantize one block ---------------- */

void mf_dq_mxfp4(const uint8_t *b, float *y) {
    const float d = e8m0_half(b[0]);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)kv_fp4[b[1 + j] & 0xF];
        y[j + 16] = d * (float)kv_fp4[b[1 + j] >> 4];
    }
}
void mf_dq_nvfp4(const uint8_t *b, float *y) {
    for (int s = 0; s < 4; s++) {
        const float d = ue4m3_half(b[s]);
        const uint8_t *q = b + 4 + 8 * s;
        for (int j = 0; j < 8; j++) {
            y[16 * s + j] = d * (float)kv_fp4[q[j] & 0xF];
            y[16 * s + 8 + j] = d * (float)kv_fp4[q[j] >> 4];
        }
    }
}
static inline int trit(uint8_t q, int n) {
    static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
    const uint8_t v = (uint8_t)(q * pow3[n]);
    return ((v * 3) >> 8) - 1;
}
void mf_dq_tq1_0(const uint8_t *b, float *y) {
    const float d = mf_f16(b + 52);
    for (int n = 0; n < 5; n++)
        for (int m = 0; m < 32; m++) y[32 * n + m] = d * (float)trit(b[m], n);
    for (int n = 0; n < 5; n++)
        for (int m = 0; m < 16; m++) y[160 + 16 * n + m] = d * (float)trit(b[32 + m], n);
    for (int n = 0; n < 4; n++)
        for (int m = 0; m < 4; m++) y[240 + 4 * n + m] = d * (float)trit(b[48 + m], n);
}
void mf_dq_tq2_0(const uint8_t *b, float *y) {
    const float d = mf_f16(b + 64);
    for (int j = 0; j < 2; j++)
        for (int l = 0; l < 4; l++)
            for (int m = 0; m < 32; m++) y[128 * j + 32 * l + m] = d * (float)(((b[32 * j + m] >> (2 * l)) & 3) - 1);
}

/* ---------------- AVX2 ---------------- */

AVX2 static inline __m256i kv_fp4_256(void) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kv_fp4));
}

static float e8m0_lut[256]; /* e8m0_half of every code (the scalar and vector kernels' scales) */
__attribute__((constructor)) static void e8m0_lut_init(void) {
    for (int e = 0; e < 256; e++) e8m0_lut[e] = e8m0_half((uint8_t)e);
}

/* MXFP4 x Q8_0, R = 1 or 4 rows. Per block the 8 int32 lanes of the 32-value dot (lane k: the
 * values 4k..4k+3, low nibbles first), times 2^(e-128) * dx in one FMA; even and odd blocks in
 * two accumulators per row (one FMA chain's latency bounded the loop), summed at the end. The
 * values enter maddubs unsigned, as kv + 12 (0..24), and 12 * y's pair sums (shared by the R
 * rows) come off in int16 (|pairs| <= 6144, no saturation): every int32 lane is the exact
 * sum of kv * y, as the avx512vnni kernels' (VDZ_MXFP4), so all of them give the same bits
 * whatever R or ISA. The nibbles: one 128-bit broadcast, a per-lane shift, a mask. */
#define VD_MXFP4_AVX2(NAME, R)                                                                      \
    AVX2 void NAME(const uint8_t *w, size_t rb, const void *xv, int64_t nb, float *out) {          \
        const mf_q8_32 *x = xv;                                                                     \
        __m256 a0[R], a1[R];                                                                        \
        for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps();                            \
        const __m256i m4 = _mm256_set1_epi8(0xF), sh = _mm256_set_epi64x(4, 4, 0, 0);              \
        const __m256i kvu = _mm256_add_epi8(kv_fp4_256(), _mm256_set1_epi8(12));                    \
        const __m256i ones = _mm256_set1_epi16(1), twelve = _mm256_set1_epi8(12);                   \
        const int64_t pfd = (R == 1 ? mf_tune.pf_dist : MF_PF_MULTI);                               \
        for (int64_t b = 0; b < nb; b += 2, w += 34) {                                              \
            MF_PF_ROWS(w, R, rb, b * 17, nb * 17, pfd, 34);                                         \
            for (int h = 0; h < 2 && b + h < nb; h++) {                                             \
                const __m256i y = _mm256_loadu_si256((const __m256i *)x[b + h].qs);                 \
                const __m256i c = _mm256_maddubs_epi16(twelve, y);                                  \
                const float dx = x[b + h].d;                                                        \
                for (int r = 0; r < R; r++) {                                                       \
                    const uint8_t *wr = w + r * rb + 17 * h;                                        \
                    __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(wr + 1))); \
                    q = _mm256_shuffle_epi8(kvu, _mm256_and_si256(_mm256_srlv_epi64(q, sh), m4));   \
                    const __m256i p = _mm256_madd_epi16(_mm256_sub_epi16(_mm256_maddubs_epi16(q, y), c), ones); \
                    const __m256 s = _mm256_set1_ps(e8m0_lut[wr[0]] * dx);                          \
                    if (h) a1[r] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(p), a1[r]);               \
                    else a0[r] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(p), a0[r]);                 \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < R; r++) out[r] = hsum_ps(_mm256_add_ps(a0[r], a1[r]));                  \
    }
VD_MXFP4_AVX2(mf_vd1_mxfp4_avx2, 1)
VD_MXFP4_AVX2(mf_vd4_mxfp4_avx2, 4)
/* the 1-row vec-dot signature over an R-row kernel's R = 1 instance */
#define VD_ONE_ROW_AVX2(NAME, VD1)                                                                  \
    AVX2 float NAME(const uint8_t *w, const void *x, int64_t nb) {                                  \
        float o;                                                                                    \
        VD1(w, 0, x, nb, &o);                                                                       \
        return o;                                                                                   \
    }
VD_ONE_ROW_AVX2(mf_vd_mxfp4_avx2, mf_vd1_mxfp4_avx2)

/* the 4 UE4M3 scales of an NVFP4 block (x 0.5) -> 4 floats (see ue4m3_half) */
AVX2 static inline __m128 ue4m3_4(const uint8_t *p) {
    uint32_t u;
    memcpy(&u, p, 4);
    const __m128i b = _mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)u));
    const __m128i h = _mm_slli_epi32(_mm_and_si128(b, _mm_set1_epi32(0x7F)), 7);
    const __m128 d = _mm_mul_ps(_mm_cvtph_ps(_mm_packus_epi32(h, h)), _mm_set1_ps(128.0f));
    return _mm_andnot_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(b, _mm_set1_epi32(0x7F))), d);
}

/* one NVFP4 block's 64 values as two 32-byte vectors in element order (the two Q8_0 blocks),
 * looked up in kv (the signed values, or kv + 12 for the unsigned form) */
AVX2 static inline void nvfp4_vals(const uint8_t *w, __m256i kv, __m256i *a, __m256i *b) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const __m256i q = _mm256_loadu_si256((const __m256i *)(w + 4));
    const __m256i lo = _mm256_shuffle_epi8(kv, _mm256_and_si256(q, m4));
    const __m256i hi = _mm256_shuffle_epi8(kv, _mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
    const __m256i v0 = _mm256_unpacklo_epi64(lo, hi), v1 = _mm256_unpackhi_epi64(lo, hi); /* [s0|s2], [s1|s3] */
    *a = _mm256_permute2x128_si256(v0, v1, 0x20);
    *b = _mm256_permute2x128_si256(v0, v1, 0x31);
}

/* NVFP4 x Q8_0, R = 1 or 4 rows. The values stay in the block's nibble order (sub-block s's
 * low nibbles are its values 0..7, the high ones 8..15) and y is put in that order instead,
 * once per block for the R rows: y_lo = 8-value pieces 0, 2, 4, 6 of the block's 64, y_hi =
 * 1, 3, 5, 7. The two 32-byte dots then sum in int16 and give, after one vpmaddwd, int32 lanes
 * [s0 s0 s1 s1 s2 s2 s3 s3], scaled by d_s * dx in one FMA a block. The values enter maddubs
 * unsigned, as kv + 12 (0..24), and 12 * y's pair sums (shared by the R rows) come off in int16
 * (|pairs| <= 12288): every int32 lane is an exact sum of kv * y, so R = 1 and R = 4 give the
 * same bits. */
#define VD_NVFP4_AVX2(NAME, R)                                                                      \
    AVX2 void NAME(const uint8_t *w, size_t rb, const void *xv, int64_t nb, float *out) {          \
        const mf_q8_32 *x = xv;                                                                     \
        __m256 acc[R];                                                                              \
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                                   \
        const __m256i ones = _mm256_set1_epi16(1), twelve = _mm256_set1_epi8(12), m4 = _mm256_set1_epi8(0xF); \
        const __m256i kvu = _mm256_add_epi8(kv_fp4_256(), twelve);                                  \
        const __m256i dup = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);                              \
        const int64_t pfd = (R == 1 ? mf_tune.pf_dist : MF_PF_MULTI);                               \
        for (int64_t b = 0; b < nb; b++, w += 36) {                                                 \
            MF_PF_ROWS(w, R, rb, b * 36, nb * 36, pfd, 36);                                         \
            const mf_q8_32 *y = x + 2 * b;                                                          \
            /* 8-value pieces [0 2 1 3] and [4 6 5 7], then the low and high halves of each */      \
            const __m256i ta = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)y[0].qs), 0xD8); \
            const __m256i tb = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)y[1].qs), 0xD8); \
            const __m256i ylo = _mm256_permute2x128_si256(ta, tb, 0x20), yhi = _mm256_permute2x128_si256(ta, tb, 0x31); \
            const __m256i c = _mm256_add_epi16(_mm256_maddubs_epi16(twelve, ylo), _mm256_maddubs_epi16(twelve, yhi)); \
            const __m256 dy = _mm256_setr_ps(y[0].d, y[0].d, y[0].d, y[0].d, y[1].d, y[1].d, y[1].d, y[1].d); \
            for (int r = 0; r < R; r++) {                                                           \
                const uint8_t *wr = w + r * rb;                                                     \
                const __m256 s = _mm256_mul_ps(_mm256_permutevar8x32_ps(_mm256_castps128_ps256(ue4m3_4(wr)), dup), dy); \
                const __m256i q = _mm256_loadu_si256((const __m256i *)(wr + 4));                    \
                const __m256i lo = _mm256_shuffle_epi8(kvu, _mm256_and_si256(q, m4));               \
                const __m256i hi = _mm256_shuffle_epi8(kvu, _mm256_and_si256(_mm256_srli_epi16(q, 4), m4)); \
                const __m256i p16 = _mm256_sub_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, ylo), _mm256_maddubs_epi16(hi, yhi)), c); \
                acc[r] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones)), acc[r]); \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < R; r++) out[r] = hsum_ps(acc[r]);                                       \
    }
VD_NVFP4_AVX2(mf_vd1_nvfp4_avx2, 1)
VD_NVFP4_AVX2(mf_vd4_nvfp4_avx2, 4)
VD_ONE_ROW_AVX2(mf_vd_nvfp4_avx2, mf_vd1_nvfp4_avx2)

/* the 256 activation values of a Q8_K block summed into 8 int32 lanes */
AVX2 static inline __m256i q8k_sum8(const mf_q8_256 *x) {
    return _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)x->bsums), _mm256_set1_epi16(1));
}
/* bytes q -> q * 3 (mod 256) */
AVX2 static inline __m256i mul3(__m256i q) { return _mm256_add_epi8(q, _mm256_add_epi8(q, q)); }
/* (q * 3) >> 8 = (q > 85) + (q > 170) for bytes q: the digit 0..2 */
AVX2 static inline __m256i trit_u8(__m256i q) {
    const __m256i one = _mm256_set1_epi8(1);
    const __m256i a = _mm256_min_epu8(_mm256_subs_epu8(q, _mm256_set1_epi8(85)), one);
    const __m256i b = _mm256_min_epu8(_mm256_subs_epu8(q, _mm256_set1_epi8((char)170)), one);
    return _mm256_add_epi8(a, b);
}
/* qs[32..47] and qh[0..3] as the 3 vectors of the last 96 values (elements 160..255), bytes
 * before the digit extraction: [q16, 3 q16], [9 q16, 27 q16], [81 q16, qh x 1,3,9,27 by 4] */
AVX2 static inline void tq1_tail(const uint8_t *w, __m256i *t) {
    const __m128i q = _mm_loadu_si128((const __m128i *)(w + 32));
    const __m128i q3 = _mm_add_epi8(q, _mm_add_epi8(q, q)), q9 = _mm_add_epi8(q3, _mm_add_epi8(q3, q3));
    const __m128i q27 = _mm_add_epi8(q9, _mm_add_epi8(q9, q9)), q81 = _mm_add_epi8(q27, _mm_add_epi8(q27, q27));
    uint32_t u;
    memcpy(&u, w + 48, 4);
    const __m128i h = _mm_set1_epi32((int)u);
    const __m128i h3 = _mm_add_epi8(h, _mm_add_epi8(h, h)), h9 = _mm_add_epi8(h3, _mm_add_epi8(h3, h3));
    const __m128i h27 = _mm_add_epi8(h9, _mm_add_epi8(h9, h9));
    const __m128i hh = _mm_blend_epi32(_mm_blend_epi32(_mm_blend_epi32(h, h3, 2), h9, 4), h27, 8);
    t[0] = _mm256_set_m128i(q3, q);
    t[1] = _mm256_set_m128i(q27, q9);
    t[2] = _mm256_set_m128i(hh, q81);
}

/* digits 0..2 against Q8_K: sum(digit * y) - sum(y) exact in int32, times d * dx */
AVX2 float mf_vd_tq1_0_avx2(const uint8_t *w, const void *xv, int64_t nb) {
    const mf_q8_256 *x = xv;
    __m256 acc = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++, w += 54) {
        const int8_t *y = x[b].qs;
        __m256i q = _mm256_loadu_si256((const __m256i *)w), s16 = _mm256_setzero_si256();
        for (int n = 0; n < 5; n++, q = mul3(q)) /* int16 pair sums: |8 x 2 x 2 x 128| < 2^15 */
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(trit_u8(q), _mm256_loadu_si256((const __m256i *)(y + 32 * n))));
        __m256i t[3];
        tq1_tail(w, t);
        for (int k = 0; k < 3; k++)
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(trit_u8(t[k]), _mm256_loadu_si256((const __m256i *)(y + 160 + 32 * k))));
        const __m256i tot = _mm256_sub_epi32(_mm256_madd_epi16(s16, ones), q8k_sum8(x + b));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(mf_f16(w + 52) * x[b].d), _mm256_cvtepi32_ps(tot), acc);
    }
    return hsum_ps(acc);
}
/* TQ2_0 x Q8_K for X = 1 or 4 activation rows (x rows xs bytes apart): each 2-bit digit
 * vector is extracted once and dotted with the X rows' bytes; per X row the int16 pair sums,
 * the int32 total less sum(y) and the FMA are those of one row alone, so every X row's result
 * has the same bits whichever form computed it (prefill runs 4 X rows at once, decode 1). */
#define VD_TQ2_0_AVX2(NAME, NX)                                                                     \
    AVX2 void NAME(const uint8_t *w, const void *xv, size_t xs, int64_t nb, float *out) {          \
        __m256 acc[NX];                                                                             \
        for (int i = 0; i < NX; i++) acc[i] = _mm256_setzero_ps();                                  \
        const __m256i ones = _mm256_set1_epi16(1), m2 = _mm256_set1_epi8(3);                        \
        for (int64_t b = 0; b < nb; b++, w += 66) {                                                 \
            __m256i s16[NX];                                                                        \
            for (int i = 0; i < NX; i++) s16[i] = _mm256_setzero_si256();                           \
            for (int j = 0; j < 2; j++) {                                                           \
                const __m256i q = _mm256_loadu_si256((const __m256i *)(w + 32 * j));                \
                for (int l = 0; l < 4; l++) {                                                       \
                    const __m256i v = _mm256_and_si256(_mm256_srli_epi16(q, 2 * l), m2);           \
                    for (int i = 0; i < NX; i++) {                                                  \
                        const mf_q8_256 *x = (const mf_q8_256 *)((const uint8_t *)xv + i * xs) + b; \
                        s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(v, _mm256_loadu_si256((const __m256i *)(x->qs + 128 * j + 32 * l)))); \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
            const float d = mf_f16(w + 64);                                                         \
            for (int i = 0; i < NX; i++) {                                                          \
                const mf_q8_256 *x = (const mf_q8_256 *)((const uint8_t *)xv + i * xs) + b;        \
                const __m256i tot = _mm256_sub_epi32(_mm256_madd_epi16(s16[i], ones), q8k_sum8(x)); \
                acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d * x->d), _mm256_cvtepi32_ps(tot), acc[i]); \
            }                                                                                       \
        }                                                                                           \
        for (int i = 0; i < NX; i++) out[i] = hsum_ps(acc[i]);                                      \
    }
VD_TQ2_0_AVX2(vd_tq2_0_x1, 1)
VD_TQ2_0_AVX2(mf_vdx4_tq2_0_avx2, 4)
AVX2 float mf_vd_tq2_0_avx2(const uint8_t *w, const void *xv, int64_t nb) {
    float o;
    vd_tq2_0_x1(w, xv, 0, nb, &o);
    return o;
}

/* ---------------- prefill unpacks (the existing batched kernels do the rest) ----------------
 * MXFP4 -> mf_b32 with the signed kvalues (q = kv, d = 2^(e-128), c = 0), as IQ4_NL.
 * NVFP4 -> signed values and 4 scales (mf_up_nvfp4_avx2) for the avx512vnni b32 GEMM, or two
 * half-scaled mf_b32 (mf_up_nvfp4_b32) for the AVX2 one.
 * TQ1_0 / TQ2_0 -> mf_kblk as a K-quant: q = digit 0..2 in element order, every sub-block
 * scale 1, correction -1 per 16 (cc . bsums = -sum(y)), d = dc = the block's d. */
AVX2 void mf_up_mxfp4_avx2(const uint8_t *w, mf_b32 *o) {
    const __m128i t = _mm_loadu_si128((const __m128i *)(w + 1));
    const __m256i n = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0xF));
    _mm256_storeu_si256((__m256i *)o->q, _mm256_shuffle_epi8(kv_fp4_256(), n));
    o->d = e8m0_half(w[0]);
    o->c = 0;
}
/* MXFP4 prefill on AVX2, 8 W rows at once (ggml's repacked 8x8 MXFP4 GEMM does the same
 * interleaving; here it is built per task from the file's blocks, so the store's bytes stay
 * as they are): chunk k of an mf_mx8 holds the values 4k..4k+3 of the 8 rows, so one
 * maddubs against y's 4 bytes 4k..4k+3 broadcast gives each row's two pair sums in its own
 * lanes, and the 8 chunks' sums (4 in int16 at most: |4 * 2 * 24 * 128| < 2^15) end in one
 * int32 lane per row: sum (kv + 12) y, less 12 sum y (sy, per X row and block), the exact
 * integer dot of the block. Per row and X row then one product (d * dx) and one FMA per
 * block, in block order: no lane crosses rows, so a row's bits do not depend on the rows or X
 * rows beside it. Rows past nr (the matrix end) repeat row nr - 1; their results are dropped. */
AVX2 void mf_up_mxfp4_x8(const uint8_t *w, size_t rb, int nr, int64_t nb, mf_mx8 *o) {
    const __m256i m4 = _mm256_set1_epi8(0xF), sh = _mm256_set_epi64x(4, 4, 0, 0);
    const __m256i kvu = _mm256_add_epi8(kv_fp4_256(), _mm256_set1_epi8(12));
    for (int r = 0; r < 8; r++) {
        const uint8_t *wr = w + (size_t)(r < nr ? r : nr - 1) * rb;
        for (int64_t b = 0; b < nb; b++, wr += 17) {
            __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(wr + 1)));
            q = _mm256_shuffle_epi8(kvu, _mm256_and_si256(_mm256_srlv_epi64(q, sh), m4));
            _Alignas(32) uint32_t t[8];
            _mm256_store_si256((__m256i *)t, q);
            for (int k = 0; k < 8; k++) memcpy(&o[b].u[k][4 * r], &t[k], 4);
            o[b].d[r] = e8m0_lut[wr[0]];
        }
    }
}
/* sy[i * nb + b] = 12 * (sum of X row i's block b) */
AVX2 void mf_mx8_ysum12_avx2(const uint8_t *xb, size_t xs, int64_t m, int64_t nb, int32_t *sy) {
    const __m256i one8 = _mm256_set1_epi8(1), ones = _mm256_set1_epi16(1);
    for (int64_t i = 0; i < m; i++) {
        const mf_q8_32 *x = (const mf_q8_32 *)(xb + (size_t)i * xs);
        for (int64_t b = 0; b < nb; b++) {
            const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(one8, _mm256_loadu_si256((const __m256i *)x[b].qs)), ones);
            __m128i v = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4e));
            v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0xb1));
            sy[i * nb + b] = 12 * _mm_cvtsi128_si32(v);
        }
    }
}
#define MX8_DOT(M)                                                                                  \
    AVX2 static void mx8_dot##M(const mf_mx8 *w, int64_t nb, const uint8_t *xb, size_t xs, const int32_t *sy, float *out) { \
        __m256 acc[M];                                                                              \
        for (int i = 0; i < M; i++) acc[i] = _mm256_setzero_ps();                                   \
        const __m256i ones = _mm256_set1_epi16(1);                                                  \
        for (int64_t b = 0; b < nb; b++) {                                                          \
            const mf_mx8 *wb = w + b;                                                               \
            const __m256 d8 = _mm256_loadu_ps(wb->d);                                               \
            for (int i = 0; i < M; i++) {                                                           \
                const mf_q8_32 *x = (const mf_q8_32 *)(xb + (size_t)i * xs) + b;                    \
                int32_t y4[8];                                                                      \
                memcpy(y4, x->qs, 32);                                                              \
                __m256i h[2];                                                                       \
                for (int g = 0; g < 2; g++) {                                                       \
                    const __m256i *u = (const __m256i *)wb->u[4 * g];                               \
                    const __m256i p0 = _mm256_maddubs_epi16(_mm256_load_si256(u), _mm256_set1_epi32(y4[4 * g])); \
                    const __m256i p1 = _mm256_maddubs_epi16(_mm256_load_si256(u + 1), _mm256_set1_epi32(y4[4 * g + 1])); \
                    const __m256i p2 = _mm256_maddubs_epi16(_mm256_load_si256(u + 2), _mm256_set1_epi32(y4[4 * g + 2])); \
                    const __m256i p3 = _mm256_maddubs_epi16(_mm256_load_si256(u + 3), _mm256_set1_epi32(y4[4 * g + 3])); \
                    h[g] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p0, p1), _mm256_add_epi16(p2, p3)), ones); \
                }                                                                                   \
                const __m256i s = _mm256_sub_epi32(_mm256_add_epi32(h[0], h[1]), _mm256_set1_epi32(sy[i * nb + b])); \
                acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(x->d)), _mm256_cvtepi32_ps(s), acc[i]); \
            }                                                                                       \
        }                                                                                           \
        for (int i = 0; i < M; i++) _mm256_storeu_ps(out + 8 * i, acc[i]);                          \
    }
MX8_DOT(4)
MX8_DOT(1)
/* X rows [0, m) against one 8-row group (nr of them real): y[i * ostride + r] */
AVX2 void mf_mx8_gemm_avx2(const mf_mx8 *w, int64_t nb, int nr, const uint8_t *xb, size_t xs, const int32_t *sy,
                           int64_t m, float *y, int64_t ostride) {
    float o[4 * 8];
    int64_t i = 0;
    for (; i < m; ) {
        const int M = i + 4 <= m ? 4 : 1;
        if (M == 4) mx8_dot4(w, nb, xb + (size_t)i * xs, xs, sy + i * nb, o);
        else mx8_dot1(w, nb, xb + (size_t)i * xs, xs, sy + i * nb, o);
        for (int k = 0; k < M; k++)
            for (int r = 0; r < nr; r++) y[(i + k) * ostride + r] = o[8 * k + r];
        i += M;
    }
}

/* NVFP4 -> its 64 signed values in element order and the 4 sub-block scales (x 0.5), for the
 * b32 GEMM's half-scaled blocks (quant_avx512.c) */
AVX2 void mf_up_nvfp4_avx2(const uint8_t *w, int8_t *q, float *d) {
    __m256i a, b;
    nvfp4_vals(w, kv_fp4_256(), &a, &b);
    _mm256_storeu_si256((__m256i *)q, a);
    _mm256_storeu_si256((__m256i *)(q + 32), b);
    _mm_storeu_ps(d, ue4m3_4(w));
}
/* NVFP4 -> two mf_b32 of 32 signed values, each with its two half scales as d and c (the
 * AVX2 b32 GEMM's half-scaled form, quant_avx2.c BDOT) */
AVX2 void mf_up_nvfp4_b32(const uint8_t *w, mf_b32 *o) {
    _Alignas(16) float d[4];
    __m256i a, b;
    nvfp4_vals(w, kv_fp4_256(), &a, &b);
    _mm256_storeu_si256((__m256i *)o[0].q, a);
    _mm256_storeu_si256((__m256i *)o[1].q, b);
    _mm_store_ps(d, ue4m3_4(w));
    o[0].d = d[0], o[0].c = d[1], o[1].d = d[2], o[1].c = d[3];
}
AVX2 static inline void tq_kblk_scales(float d, mf_kblk *o) {
    for (int c = 0; c < 8; c++) _mm256_storeu_si256((__m256i *)o->sv[c], _mm256_set1_epi16(1));
    for (int i = 0; i < 16; i++) o->cc[i] = -1;
    o->d = o->dc = d;
}
AVX2 void mf_up_tq1_0_avx2(const uint8_t *w, mf_kblk *o) {
    __m256i q = _mm256_loadu_si256((const __m256i *)w), t[3];
    for (int n = 0; n < 5; n++, q = mul3(q)) _mm256_storeu_si256((__m256i *)(o->q + 32 * n), trit_u8(q));
    tq1_tail(w, t);
    for (int k = 0; k < 3; k++) _mm256_storeu_si256((__m256i *)(o->q + 160 + 32 * k), trit_u8(t[k]));
    tq_kblk_scales(mf_f16(w + 52), o);
}
AVX2 void mf_up_tq2_0_avx2(const uint8_t *w, mf_kblk *o) {
    const __m256i m2 = _mm256_set1_epi8(3);
    for (int j = 0; j < 2; j++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(w + 32 * j));
        for (int l = 0; l < 4; l++)
            _mm256_storeu_si256((__m256i *)(o->q + 128 * j + 32 * l), _mm256_and_si256(_mm256_srli_epi16(q, 2 * l), m2));
    }
    tq_kblk_scales(mf_f16(w + 64), o);
}

/* ---------------- AVX-512 VNNI: 64 values per step, vpdpbusd into one int32 block sum -------
 * The block's -sum(y) enters the same accumulator by vpdpwssd of the bsums with -1, so one
 * exact int32 vector per block, then one float FMA (as the AVX2 kernels; the float lanes differ). */

VNNI static inline __m512i neg_ysum(const mf_q8_256 *x) {
    return _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)x->bsums)),
                               _mm512_set1_epi16(-1));
}

/* one block of one row: acc + d * dx * (the int32 sums from s = -sum(y)) */
VNNI static inline __m512 tq2_block(const uint8_t *w, const mf_q8_256 *x, __m512i s, __m512 acc) {
    const __m512i m2 = _mm512_set1_epi8(3);
    const __m512i sh01 = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0), sh23 = _mm512_set_epi64(6, 6, 6, 6, 4, 4, 4, 4);
    for (int j = 0; j < 2; j++) { /* 32 bytes in both halves: shifts 0|2, then 4|6 */
        const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(w + 32 * j)));
        s = _mm512_dpbusd_epi32(s, _mm512_and_si512(_mm512_srlv_epi64(q, sh01), m2), _mm512_load_si512(x->qs + 128 * j));
        s = _mm512_dpbusd_epi32(s, _mm512_and_si512(_mm512_srlv_epi64(q, sh23), m2), _mm512_load_si512(x->qs + 128 * j + 64));
    }
    return _mm512_fmadd_ps(_mm512_set1_ps(mf_f16(w + 64) * x->d), _mm512_cvtepi32_ps(s), acc);
}
VNNI float mf_vd_tq2_0_avx512(const uint8_t *w, const void *xv, int64_t nb) {
    const mf_q8_256 *x = xv;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) acc = tq2_block(w + 66 * b, x + b, neg_ysum(x + b), acc);
    return _mm512_reduce_add_ps(acc);
}

/* the base-3 digit (q * 3) >> 8 of every byte: 1 above 85, 2 above 170 */
VNNI static inline __m512i trit512(__m512i q) {
    const __m512i d1 = _mm512_maskz_mov_epi8(_mm512_cmpgt_epu8_mask(q, _mm512_set1_epi8(85)), _mm512_set1_epi8(1));
    return _mm512_mask_mov_epi8(d1, _mm512_cmpgt_epu8_mask(q, _mm512_set1_epi8((char)170)), _mm512_set1_epi8(2));
}
VNNI static inline __m512i mul3_512(__m512i q) { return _mm512_add_epi8(q, _mm512_add_epi8(q, q)); }

VNNI static inline __m512 tq1_block(const uint8_t *w, const mf_q8_256 *x, __m512i s, __m512 acc) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)w);
    const __m512i z01 = _mm512_inserti64x4(_mm512_castsi256_si512(q), mul3(q), 1); /* elements 0..63 */
    const __m512i z23 = mul3_512(mul3_512(z01));                                     /* 64..127 */
    __m256i t[3];
    tq1_tail(w, t);
    const __m512i z4 = _mm512_inserti64x4(_mm512_castsi256_si512(mul3(_mm512_extracti64x4_epi64(z23, 1))), t[0], 1);
    const __m512i z6 = _mm512_inserti64x4(_mm512_castsi256_si512(t[1]), t[2], 1);
    s = _mm512_dpbusd_epi32(s, trit512(z01), _mm512_load_si512(x->qs));
    s = _mm512_dpbusd_epi32(s, trit512(z23), _mm512_load_si512(x->qs + 64));
    s = _mm512_dpbusd_epi32(s, trit512(z4), _mm512_load_si512(x->qs + 128));
    s = _mm512_dpbusd_epi32(s, trit512(z6), _mm512_load_si512(x->qs + 192));
    return _mm512_fmadd_ps(_mm512_set1_ps(mf_f16(w + 52) * x->d), _mm512_cvtepi32_ps(s), acc);
}
VNNI float mf_vd_tq1_0_avx512(const uint8_t *w, const void *xv, int64_t nb) {
    const mf_q8_256 *x = xv;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) acc = tq1_block(w + 54 * b, x + b, neg_ysum(x + b), acc);
    return _mm512_reduce_add_ps(acc);
}

/* MXFP4, R = 1, 4 or 8 rows, two blocks per 512-bit step (lanes 0-7 the even block, 8-15 the
 * odd one): the nibbles by one broadcast, shift and mask per block pair, the values + 12 as
 * the u8 operand of vpdpbusd from the shifted table kv_fp4 + 12, the accumulator starting at
 * -12 * (each lane's 4 y), so every int32 lane is the AVX2 kernel's lane exactly (sum of 4 kv *
 * y); the scale 2^(e-128) (a table of the 256 codes) times dx, one FMA. Even blocks' lanes are
 * the AVX2 kernel's a0, odd blocks' its a1, summed the same way at the end: the same bits as
 * mf_vd_mxfp4_avx2 on every row, whatever R. The y vector and its correction are shared by
 * the R rows. */
/* the 1-row vec-dot of an R-row kernel (its R = 1 instance: the same bits) */
#define VDZ_ONE_ROW(NAME, KERNEL)                                                                   \
    VNNI float NAME(const uint8_t *w, const void *x, int64_t nb) {                                  \
        float o;                                                                                    \
        KERNEL(w, 0, x, nb, &o);                                                                    \
        return o;                                                                                   \
    }
#define VDZ_MXFP4(NAME, R)                                                                          \
    VNNI void NAME(const uint8_t *w, size_t rb, const void *xv, int64_t nb, float *out) {          \
        const mf_q8_32 *x = xv;                                                                     \
        __m512 a[R];                                                                                \
        for (int r = 0; r < R; r++) a[r] = _mm512_setzero_ps();                                     \
        const __m512i m4 = _mm512_set1_epi8(0xF), sh = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0);    \
        const __m512i kvu = _mm512_add_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)kv_fp4)), \
                                            _mm512_set1_epi8(12));                                  \
        const int64_t pfd = (R == 1 ? mf_tune.pf_dist : MF_PF_MULTI);                                                        \
        for (int64_t b = 0; b < nb; b += 2, w += 34) {                                              \
            MF_PF_ROWS(w, R, rb, b * 17, nb * 17, pfd, 34);                                         \
            const int two = b + 1 < nb;                                                             \
            const __m256i y0 = _mm256_loadu_si256((const __m256i *)x[b].qs);                        \
            const __m512i y = two ? _mm512_inserti64x4(_mm512_castsi256_si512(y0),                  \
                                        _mm256_loadu_si256((const __m256i *)x[b + 1].qs), 1)        \
                                  : _mm512_zextsi256_si512(y0);                                     \
            const __m512i c = _mm512_sub_epi32(_mm512_setzero_si512(),                              \
                                               _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(12), y)); \
            const float dx1 = two ? x[b + 1].d : 0.0f;                                              \
            /* R > 1: the rows' scales in one vector (lanes 0-7 the even block of rows 0-7, 8-15 \
             * the odd), e8m0_half by shifts (e8m0_lut's values), times dx: one permute a row */ \
            __m512 sv = _mm512_setzero_ps();                                                        \
            if (R > 1) {                                                                            \
                uint64_t ee = 0, eo = 0;                                                            \
                for (int r = 0; r < R; r++) {                                                       \
                    ee |= (uint64_t)w[r * rb] << (8 * r);                                           \
                    if (two) eo |= (uint64_t)w[r * rb + 17] << (8 * r);                             \
                }                                                                                   \
                const __m512i e = _mm512_cvtepu8_epi32(_mm_set_epi64x((int64_t)eo, (int64_t)ee));   \
                const __m512i eb = _mm512_mask_sllv_epi32(_mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23), \
                                                          _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)), \
                                                          _mm512_set1_epi32(0x00200000), e);        \
                sv = _mm512_mul_ps(_mm512_castsi512_ps(eb),                                         \
                                   _mm512_insertf32x8(_mm512_set1_ps(x[b].d), _mm256_set1_ps(dx1), 1)); \
            }                                                                                       \
            for (int r = 0; r < R; r++) {                                                           \
                const uint8_t *wr = w + r * rb;                                                     \
                const __m256i q0 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(wr + 1))); \
                const __m256i q1 = two ? _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(wr + 18))) \
                                       : _mm256_setzero_si256();                                    \
                __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1);                   \
                q = _mm512_shuffle_epi8(kvu, _mm512_and_si512(_mm512_srlv_epi64(q, sh), m4));       \
                if (!two) q = _mm512_zextsi256_si512(_mm512_castsi512_si256(q));                    \
                const __m512i p = _mm512_dpbusd_epi32(c, q, y);                                     \
                const __m512 s = R > 1 ? _mm512_permutexvar_ps(_mm512_set_epi32(8 + r, 8 + r, 8 + r, 8 + r, 8 + r, 8 + r, 8 + r, 8 + r, \
                                                                                r, r, r, r, r, r, r, r), sv) \
                                       : _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(e8m0_lut[wr[0]] * x[b].d)), \
                                                            _mm256_set1_ps(two ? e8m0_lut[wr[17]] * dx1 : 0.0f), 1); \
                a[r] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(p), a[r]);                             \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < R; r++)                                                                 \
            out[r] = hsum_ps(_mm256_add_ps(_mm512_castps512_ps256(a[r]), _mm512_extractf32x8_ps(a[r], 1))); \
    }
VDZ_MXFP4(mf_vd1_mxfp4_avx512, 1)
VDZ_MXFP4(mf_vd4_mxfp4_avx512, 4)
VDZ_MXFP4(mf_vd8_mxfp4_avx512, 8)
VDZ_ONE_ROW(mf_vd_mxfp4_avx512, mf_vd1_mxfp4_avx512)

/* NVFP4, R = 1, 4 or 8 rows, one 64-value block per 512-bit step: the 32 bytes broadcast to
 * both halves, low nibbles in lanes 0-7 and high nibbles in 8-15 by one shift and mask, the
 * values + 12 from the shifted table; y (the block's two Q8_0 blocks) permuted once per block
 * into that order (vpermb) with its -12 * (4 y) correction as the accumulator's start, so each
 * int32 lane is an exact sum of 4 kv * y of one sub-block: lane l (and 8 + l) of sub-block
 * l / 2. Scales: the 4 UE4M3 codes as in ue4m3_4 (an f16 of 2^-7 of the value) times 128 dx of
 * their Q8_0 block (the same product: 128 is exact), spread to the lanes; one FMA. The R rows
 * share y and its correction; every row's bits are the R = 1 kernel's (its own arithmetic,
 * not the AVX2 kernel's order of the two halves). */
static const uint8_t nv_perm[64] = {
    0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23,
    32, 33, 34, 35, 36, 37, 38, 39, 48, 49, 50, 51, 52, 53, 54, 55,
    8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31,
    40, 41, 42, 43, 44, 45, 46, 47, 56, 57, 58, 59, 60, 61, 62, 63};
#define VDZ_NVFP4(NAME, R)                                                                          \
    VNNI void NAME(const uint8_t *w, size_t rb, const void *xv, int64_t nb, float *out) {          \
        const mf_q8_32 *x = xv;                                                                     \
        __m512 a[R];                                                                                \
        for (int r = 0; r < R; r++) a[r] = _mm512_setzero_ps();                                     \
        const __m512i m4 = _mm512_set1_epi8(0xF), sh = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);    \
        const __m512i kvu = _mm512_add_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)kv_fp4)), \
                                            _mm512_set1_epi8(12));                                  \
        const __m512i perm = _mm512_loadu_si512((const void *)nv_perm);                             \
        const __m512i lanes = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 0, 0, 1, 1, 2, 2, 3, 3);    \
        const int64_t pfd = (R == 1 ? mf_tune.pf_dist : MF_PF_MULTI);                                                        \
        for (int64_t b = 0; b < nb; b++, w += 36) {                                                 \
            MF_PF_ROWS(w, R, rb, b * 36, nb * 36, pfd, 36);                                         \
            const mf_q8_32 *y0 = x + 2 * b;                                                         \
            const __m512i y = _mm512_permutexvar_epi8(perm, _mm512_inserti64x4(                     \
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)y0[0].qs)),              \
                _mm256_loadu_si256((const __m256i *)y0[1].qs), 1));                                 \
            const __m512i c = _mm512_sub_epi32(_mm512_setzero_si512(),                              \
                                               _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(12), y)); \
            const __m128 dx = _mm_mul_ps(_mm_setr_ps(y0[0].d, y0[0].d, y0[1].d, y0[1].d), _mm_set1_ps(128.0f)); \
            for (int r = 0; r < R; r++) {                                                           \
                const uint8_t *wr = w + r * rb;                                                     \
                const __m512i qb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(wr + 4))); \
                const __m512i q = _mm512_shuffle_epi8(kvu, _mm512_and_si512(_mm512_srlv_epi64(qb, sh), m4)); \
                const __m512i p = _mm512_dpbusd_epi32(c, q, y);                                     \
                uint32_t u;                                                                         \
                memcpy(&u, wr, 4);                                                                  \
                const __m128i e = _mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)u));                     \
                const __m128i h = _mm_slli_epi32(_mm_and_si128(e, _mm_set1_epi32(0x7F)), 7);        \
                __m128 d = _mm_mul_ps(_mm_cvtph_ps(_mm_packus_epi32(h, h)), dx);                     \
                d = _mm_andnot_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(e, _mm_set1_epi32(0x7F))), d);   \
                a[r] = _mm512_fmadd_ps(_mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(d)),     \
                                       _mm512_cvtepi32_ps(p), a[r]);                                \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < R; r++)                                                                 \
            out[r] = hsum_ps(_mm256_add_ps(_mm512_castps512_ps256(a[r]), _mm512_extractf32x8_ps(a[r], 1))); \
    }
VDZ_NVFP4(mf_vd1_nvfp4_avx512, 1)
VDZ_NVFP4(mf_vd4_nvfp4_avx512, 4)
VDZ_NVFP4(mf_vd8_nvfp4_avx512, 8)
VDZ_ONE_ROW(mf_vd_nvfp4_avx512, mf_vd1_nvfp4_avx512)

/* 4 rows block by block: per row exactly the 1-row kernel's operations (the same bits); the
 * X loads and -sum(y) shared. TQ2_0 only: 1 thread from DRAM at 7B shapes +3..17%; TQ1_0's
 * digit extraction dominates and its 4-row form measured -5..+10% (docs/NOTES.md) */
#define TQ_VD4(NAME, BLOCK, BYTES)                                                                 \
    VNNI void NAME(const uint8_t *w, size_t rb, const void *xv, int64_t nb, float *out) {          \
        const mf_q8_256 *x = xv;                                                                   \
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                \
        for (int64_t b = 0; b < nb; b++) {                                                         \
            const __m512i s = neg_ysum(x + b);                                                     \
            const uint8_t *p = w + BYTES * b;                                                      \
            a0 = BLOCK(p, x + b, s, a0);                                                           \
            a1 = BLOCK(p + rb, x + b, s, a1);                                                      \
            a2 = BLOCK(p + 2 * rb, x + b, s, a2);                                                  \
            a3 = BLOCK(p + 3 * rb, x + b, s, a3);                                                  \
        }                                                                                          \
        out[0] = _mm512_reduce_add_ps(a0);                                                         \
        out[1] = _mm512_reduce_add_ps(a1);                                                         \
        out[2] = _mm512_reduce_add_ps(a2);                                                         \
        out[3] = _mm512_reduce_add_ps(a3);                                                         \
    }
TQ_VD4(mf_vd4_tq2_0_avx512, tq2_block, 66)
