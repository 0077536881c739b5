/* IQ3_XXS, IQ3_S, IQ1_S, IQ1_M (ggml-common.h block layouts): scalar dequantizers, bit-exact
 * with gguf-py (the same float32 operations in the same order), and AVX2 vec-dots against Q8_K
 * activations (mf_q8_256), ggml's vec_dot_type for these types. The vec-dots sum each block in
 * exact integers and scale once per block, as ggml's do. */
#include "quant_common.h"
#include "simd_x86.h"

#include <immintrin.h>
#include <string.h>

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define BMI2 __attribute__((target("avx2,fma,f16c,bmi2")))

static inline unsigned rd16(const uint8_t *p) { return (unsigned)(p[0] | (p[1] << 8)); }
/* IQ1_M's f16 d: the top nibbles of its four u16 scale words (bytes 48..55) */
static inline unsigned iq1m_d16(const uint8_t *b) {
    return (rd16(b + 48) >> 12) | ((rd16(b + 50) >> 8) & 0x00F0) | ((rd16(b + 52) >> 4) & 0x0F00) | (rd16(b + 54) & 0xF000);
}
/* the 8 sign bits of IQ3_XXS's group l (of 8 values) in a sub-block's u32 */
static inline unsigned iq3xxs_signs(uint32_t aux, int l) { return mf_ksigns_iq2xs[(aux >> (7 * l)) & 127]; }

/* ---------------- dequantize, one block ---------------- */

/* 98 B: d f16 | qs[64] grid indexes (4 values each) | 8 u32, one per 32 values: 4 x 7-bit
 * ksigns indexes (8 values each), the scale ls in bits 28..31; x = d*(0.5+ls)*0.5*grid*sign */
void mf_dq_iq3_xxs(const uint8_t *b, float *y) {
    const float d = mf_f16(b);
    const uint8_t *qs = b + 2;
    for (int ib = 0; ib < 8; ib++) {
        const uint32_t aux = rd32(b + 66 + 4 * ib);
        const float db = d * (0.5f + (float)(aux >> 28)) * 0.5f;
        for (int k = 0; k < 32; k++) {
            const float v = db * (float)mf_grid_iq3xxs[4 * qs[8 * ib + k / 4] + k % 4];
            y[32 * ib + k] = (iq3xxs_signs(aux, k / 8) >> (k % 8)) & 1 ? -v : v;
        }
    }
}

/* 110 B: d f16 | qs[64] low 8 bits of the 9-bit grid indexes | qh[8] (bit k of qh[i]: index
 * 8i+k's 9th bit) | signs[32] (one bit per value) | scales[4] (a nibble per 32 values);
 * x = d*(1+2*sc)*grid*sign */
void mf_dq_iq3_s(const uint8_t *b, float *y) {
    const float d = mf_f16(b);
    for (int ib = 0; ib < 8; ib++) {
        const float db = d * (float)(1 + 2 * ((b[106 + ib / 2] >> (4 * (ib % 2))) & 0xF));
        const unsigned qh = b[66 + ib];
        const uint32_t sg = rd32(b + 74 + 4 * ib);
        for (int k = 0; k < 32; k++) {
            const int i = k / 4, idx = b[2 + 8 * ib + i] | (((qh >> i) & 1) << 8);
            const float v = db * (float)mf_grid_iq3s[4 * idx + k % 4];
            y[32 * ib + k] = (sg >> k) & 1 ? -v : v;
        }
    }
}

/* 50 B: d f16 | qs[32] low 8 bits of the 11-bit grid indexes (8 values each) | qh[8] u16, one
 * per 32 values: 3 high index bits per group of 8, the scale s in bits 12..14, the delta's sign
 * in bit 15; x = d*(2s+1) * (grid + delta), delta = +-1/8 */
void mf_dq_iq1_s(const uint8_t *b, float *y) {
    const float d = mf_f16(b);
    for (int ib = 0; ib < 8; ib++) {
        const unsigned qh = rd16(b + 34 + 2 * ib);
        const float dl = d * (float)(2 * ((qh >> 12) & 7) + 1), delta = qh & 0x8000 ? -0.125f : 0.125f;
        for (int l = 0; l < 4; l++) {
            const int8_t *g = mf_grid_iq1s + 8 * (b[2 + 4 * ib + l] | (((qh >> (3 * l)) & 7) << 8));
            for (int j = 0; j < 8; j++) y[32 * ib + 8 * l + j] = dl * ((float)g[j] + delta);
        }
    }
}

/* 56 B: qs[32] as IQ1_S | qh[16] (per nibble, one group of 8: 3 high index bits, bit 3 the
 * delta's sign) | scales: 4 u16 of 4 x 3-bit scales (one per 16 values), d f16 in their top
 * nibbles; x = d*(2s+1) * (grid + delta) */
void mf_dq_iq1_m(const uint8_t *b, float *y) {
    const float d = mf_f16_table[iq1m_d16(b)];
    for (int g8 = 0; g8 < 32; g8++) { /* groups of 8 values */
        const unsigned h = (b[32 + g8 / 2] >> (4 * (g8 % 2))) & 0xF, k = (unsigned)g8 / 2; /* k: scale */
        const unsigned s = (rd16(b + 48 + 2 * (k / 4)) >> (3 * (k % 4))) & 7;
        const float dl = d * (float)(2 * s + 1), delta = h & 8 ? -0.125f : 0.125f;
        const int8_t *g = mf_grid_iq1s + 8 * (b[g8] | ((h & 7) << 8));
        for (int j = 0; j < 8; j++) y[8 * g8 + j] = dl * ((float)g[j] + delta);
    }
}

/* ---------------- AVX2 vec-dots x Q8_K ---------------- */

AVX2 static inline float f16s(const uint8_t *p) { return _cvtsh_ss((unsigned short)rd16(p)); }
/* 32 bits -> 32 bytes, -1 where the bit is set, else +1 (for sign_epi8) */
AVX2 static inline __m256i sign32(uint32_t bits) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                           0x0101010101010101, 0x0000000000000000);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuf);
    b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_or_si256(_mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(1));
}
/* IQ3_XXS: 8 grid rows of 4 values from 8 byte indices, gathered, or loaded one by one where
 * gathers are slow (Zen 3: 1.19x; IQ1_S/IQ1_M's AVX2 kernels load their rows, iq1_rows8; their
 * AVX-512 8-lane form, g1x8, loads them where gathers are slow) */
AVX2 static inline __m256i g3x8(const uint8_t *qs) {
    const uint32_t *G = (const uint32_t *)(const void *)mf_grid_iq3xxs;
    if (mf_slow_gather)
        return _mm256_setr_epi32((int)G[qs[0]], (int)G[qs[1]], (int)G[qs[2]], (int)G[qs[3]],
                                 (int)G[qs[4]], (int)G[qs[5]], (int)G[qs[6]], (int)G[qs[7]]);
    return _mm256_i32gather_epi32((const int *)G, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs)), 4);
}

/* sum over sub-blocks of (2 ls + 1) * (unsigned grid . signed q8) in int32 lanes; x 0.25 d dx */
AVX2 float mf_vd_iq3_xxs_avx2(const uint8_t *w, const void *xv, int64_t nb) {
    const mf_q8_256 *x = xv;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 98) {
        const uint8_t *qs = w + 2;
        __m256i sumi = _mm256_setzero_si256();
        uint32_t sgs[8]; /* the 8 sub-blocks' sign bytes, decoded with vector ops (simd_x86.h) */
        _mm256_storeu_si256((__m256i *)sgs, iq_signs4x7(_mm256_loadu_si256((const __m256i *)(w + 66))));
        for (int ib = 0; ib < 8; ib++, qs += 8) {
            const uint32_t aux = rd32(w + 66 + 4 * ib);
            const __m256i g = g3x8(qs);
            const __m256i y = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(x[b].qs + 32 * ib)), sign32(sgs[ib]));
            const __m256i p = _mm256_maddubs_epi16(g, y); /* grid <= 62: pair sums < 2^15 */
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, _mm256_set1_epi16((short)(2 * (aux >> 28) + 1))));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16s(w) * x[b].d * 0.25f), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum_ps(acc);
}

/* IQ3_S's 8 grid rows of sub-block ib, index qs[k] | bit k of qh << 8: gathered, or (where
 * pdep is fast, mf_tune.pdep) the indexes built as the u16 lanes of two u64 by pdep and the rows
 * loaded one by one. One thread from L1/L2 on Zen 3: 39 -> 33-38 ns a block (rows loaded at
 * indexes built by shifts and masks: 39, as the gathers). The same rows: the same bits. */
AVX2 static inline __m256i g3s8_gather(const uint8_t *qs, unsigned qh) {
    const __m256i hi = _mm256_and_si256(_mm256_sllv_epi32(_mm256_set1_epi32((int)qh), _mm256_setr_epi32(8, 7, 6, 5, 4, 3, 2, 1)), _mm256_set1_epi32(256));
    const __m256i idx = _mm256_or_si256(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs)), hi);
    return _mm256_i32gather_epi32((const int *)(const void *)mf_grid_iq3s, idx, 4);
}
BMI2 static inline __m256i g3s8_pdep(const uint8_t *qs, unsigned qh) {
    const uint32_t *G = (const uint32_t *)(const void *)mf_grid_iq3s;
    uint64_t q;
    memcpy(&q, qs, 8);
    const uint64_t lo = _pdep_u64(q, 0x00FF00FF00FF00FFull) | _pdep_u64(qh, 0x0100010001000100ull);
    const uint64_t hi = _pdep_u64(q >> 32, 0x00FF00FF00FF00FFull) | _pdep_u64(qh >> 4, 0x0100010001000100ull);
    return _mm256_setr_epi32((int)G[(uint16_t)lo], (int)G[(uint16_t)(lo >> 16)], (int)G[(uint16_t)(lo >> 32)], (int)G[lo >> 48],
                             (int)G[(uint16_t)hi], (int)G[(uint16_t)(hi >> 16)], (int)G[(uint16_t)(hi >> 32)], (int)G[hi >> 48]);
}

#define VD_IQ3_S(NAME, ATTR, ROWS)                                                                     \
    ATTR static float NAME(const uint8_t *w, const void *xv, int64_t nb) {                             \
        const mf_q8_256 *x = xv;                                                                       \
        __m256 acc = _mm256_setzero_ps();                                                              \
        for (int64_t b = 0; b < nb; b++, w += 110) {                                                   \
            __m256i sumi = _mm256_setzero_si256();                                                     \
            for (int ib = 0; ib < 8; ib++) {                                                           \
                const __m256i g = ROWS(w + 2 + 8 * ib, w[66 + ib]);                                    \
                const __m256i y = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(x[b].qs + 32 * ib)), sign32(rd32(w + 74 + 4 * ib))); \
                const __m256i p = _mm256_maddubs_epi16(g, y);                                          \
                const int sc = 1 + 2 * ((w[106 + ib / 2] >> (4 * (ib % 2))) & 0xF);                    \
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, _mm256_set1_epi16((short)sc)));     \
            }                                                                                          \
            acc = _mm256_fmadd_ps(_mm256_set1_ps(f16s(w) * x[b].d), _mm256_cvtepi32_ps(sumi), acc);    \
        }                                                                                              \
        return hsum_ps(acc);                                                                           \
    }
VD_IQ3_S(vd_iq3_s_gather, AVX2, g3s8_gather)
VD_IQ3_S(vd_iq3_s_pdep, BMI2, g3s8_pdep)
AVX2 float mf_vd_iq3_s_avx2(const uint8_t *w, const void *xv, int64_t nb) {
    return mf_tune.pdep ? vd_iq3_s_pdep(w, xv, nb) : vd_iq3_s_gather(w, xv, nb);
}

/* IQ1_S / IQ1_M: each group of 8 values as one 64-bit row of mf_iq1_u, u = 8 (grid + delta) + 9
 * (0..18), looked up by scalar loads at an index built in general registers (q | n << 8, n the
 * group's high index bits and delta sign), so maddubs takes u unsigned; the 9 comes off once per
 * block as 9 sum (scale . bsums). AMD Zen 3 (BENCHMARKS.md section 31), one thread from L1/L2:
 * IQ1_M 31 -> 20 ns a block against the former form (4-row gathers of the signed grid, the delta
 * folded in with sign ops); gathering the same u rows measured 27-44 ns. Sums stay exact int32. */
AVX2 static inline void iq1_rows8(const uint8_t *qs, uint64_t n8, __m256i *u0, __m256i *u1) {
    uint64_t q;
    memcpy(&q, qs, 8);
    uint64_t r[8];
    for (int g = 0; g < 8; g++) r[g] = mf_iq1_u[((q >> (8 * g)) & 0xFF) | (((n8 >> (4 * g)) & 0xF) << 8)];
    *u0 = _mm256_set_epi64x((long long)r[3], (long long)r[2], (long long)r[1], (long long)r[0]);
    *u1 = _mm256_set_epi64x((long long)r[7], (long long)r[6], (long long)r[5], (long long)r[4]);
}

/* IQ1_S's 8 rows of sub-blocks 2j, 2j+1: index bits from each sub-block's u16 qh (3 per group,
 * the delta's sign in bit 15 for all four) */
AVX2 static inline void iq1s_rows8(const uint8_t *w, int j, __m256i *u0, __m256i *u1) {
    uint64_t q;
    memcpy(&q, w + 2 + 8 * j, 8);
    const unsigned h0 = rd16(w + 34 + 4 * j), h1 = rd16(w + 36 + 4 * j);
    const unsigned s0 = (h0 >> 4) & 0x800, s1 = (h1 >> 4) & 0x800;
    uint64_t r[8];
    for (int l = 0; l < 4; l++) r[l] = mf_iq1_u[((q >> (8 * l)) & 0xFF) | (((h0 >> (3 * l)) & 7) << 8) | s0];
    for (int l = 0; l < 4; l++) r[4 + l] = mf_iq1_u[((q >> (32 + 8 * l)) & 0xFF) | (((h1 >> (3 * l)) & 7) << 8) | s1];
    *u0 = _mm256_set_epi64x((long long)r[3], (long long)r[2], (long long)r[1], (long long)r[0]);
    *u1 = _mm256_set_epi64x((long long)r[7], (long long)r[6], (long long)r[5], (long long)r[4]);
}

/* The same rows with the 4 indexes of 4 groups built at once by pdep (BMI2): the group bytes to
 * bits 16g..16g+7, the high bits to 16g+8.., the delta sign to bit 16g+11 (IQ1_S). On Zen 3
 * (one thread, L1/L2) IQ1_S 26.1 -> 17.0 ns a block. Only where pdep is fast (mf_tune.pdep:
 * BMI2 and not AMD Zen 1/2, whose pdep is microcoded). The same rows: the same bits. */
BMI2 static inline __m256i iq1_u4(uint64_t i) {
    return _mm256_set_epi64x((long long)mf_iq1_u[i >> 48], (long long)mf_iq1_u[(i >> 32) & 0xFFFF],
                             (long long)mf_iq1_u[(i >> 16) & 0xFFFF], (long long)mf_iq1_u[i & 0xFFFF]);
}
BMI2 static inline void iq1_rows8_pdep(const uint8_t *qs, uint64_t n8, __m256i *u0, __m256i *u1) {
    const uint64_t lo = 0x00FF00FF00FF00FFull, hi = 0x0F000F000F000F00ull;
    *u0 = iq1_u4(_pdep_u64(rd32(qs), lo) | _pdep_u64(n8 & 0xFFFF, hi));
    *u1 = iq1_u4(_pdep_u64(rd32(qs + 4), lo) | _pdep_u64((n8 >> 16) & 0xFFFF, hi));
}
BMI2 static inline uint64_t iq1s_idx4(uint32_t q, unsigned h) {
    return _pdep_u64(q, 0x00FF00FF00FF00FFull) | _pdep_u64(h & 0xFFF, 0x0700070007000700ull) |
           (uint64_t)(h >> 15) * 0x0800080008000800ull;
}
BMI2 static inline void iq1s_rows8_pdep(const uint8_t *w, int j, __m256i *u0, __m256i *u1) {
    *u0 = iq1_u4(iq1s_idx4(rd32(w + 2 + 8 * j), rd16(w + 34 + 4 * j)));
    *u1 = iq1_u4(iq1s_idx4(rd32(w + 6 + 8 * j), rd16(w + 36 + 4 * j)));
}

/* scale 2s+1 per 32 values (int16 lane ib of ls), the 9 off as 9 sum (scale . bsums) per 16
 * values; x d dx / 8. One thread from L1/L2 on Zen 3: 30.5 -> 25.5 ns a block. */
#define VD_IQ1_S(NAME, ATTR, ROWS) \
ATTR static float NAME(const uint8_t *w, const void *xv, int64_t nb) {                                                                                  \
    const mf_q8_256 *x = xv;                                                                                                                            \
    __m256 acc = _mm256_setzero_ps();                                                                                                                   \
    /* int16 lane k of ls to lanes 2k, 2k+1: the scale per 16 values, as the bsums */                                                                   \
    const __m256i dup16 = _mm256_setr_epi8(0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7, 6, 7, 8, 9, 8, 9, 10, 11, 10, 11, 12, 13, 12, 13, 14, 15, 14, 15); \
    for (int64_t b = 0; b < nb; b++, w += 50) {                                                                                                         \
        const __m128i qh = _mm_loadu_si128((const __m128i *)(w + 34));                                                                                  \
        const __m128i ls = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(qh, 12), _mm_set1_epi16(7)), 1), _mm_set1_epi16(1));                \
        const __m256i ls2 = _mm256_broadcastsi128_si256(ls);                                                                                            \
        const __m256i cs = _mm256_madd_epi16(_mm256_shuffle_epi8(ls2, dup16), _mm256_loadu_si256((const __m256i *)x[b].bsums));                         \
        __m256i sumi = _mm256_setzero_si256();                                                                                                          \
        for (int j = 0; j < 4; j++) {                                                                                                                   \
            __m256i u0, u1;                                                                                                                             \
            ROWS(w, j, &u0, &u1);                                                                                                                       \
            const __m256i y0 = _mm256_loadu_si256((const __m256i *)(x[b].qs + 64 * j));                                                                 \
            const __m256i y1 = _mm256_loadu_si256((const __m256i *)(x[b].qs + 64 * j + 32));                                                            \
            const __m256i sv0 = _mm256_shuffle_epi8(ls2, _mm256_set1_epi16((short)(0x0100 * (4 * j + 1) + 4 * j)));                                     \
            const __m256i sv1 = _mm256_shuffle_epi8(ls2, _mm256_set1_epi16((short)(0x0100 * (4 * j + 3) + 4 * j + 2)));                                 \
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(u0, y0), sv0));                                                        \
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(u1, y1), sv1));                                                        \
        }                                                                                                                                               \
        sumi = _mm256_sub_epi32(sumi, _mm256_add_epi32(_mm256_slli_epi32(cs, 3), cs));                                                                  \
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16s(w) * x[b].d * 0.125f), _mm256_cvtepi32_ps(sumi), acc);                                                \
    }                                                                                                                                                   \
    return hsum_ps(acc);                                                                                                                                \
}
/* scales per 16 values, as the bsums; x d dx / 8 */
#define VD_IQ1_M(NAME, ATTR, ROWS) \
ATTR static float NAME(const uint8_t *w, const void *xv, int64_t nb) {                                                                    \
    const mf_q8_256 *x = xv;                                                                                                              \
    __m256 acc = _mm256_setzero_ps();                                                                                                     \
    /* int16 lane k of the block's scale vector: u16 word k/4 (bytes 2(k/4), +1) */                                                       \
    const __m256i sc_shuf = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3,                                              \
                                             4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6, 7, 6, 7);                                             \
    const __m256i sc_mul = _mm256_setr_epi16(1 << 13, 1 << 10, 1 << 7, 1 << 4, 1 << 13, 1 << 10, 1 << 7, 1 << 4,                          \
                                             1 << 13, 1 << 10, 1 << 7, 1 << 4, 1 << 13, 1 << 10, 1 << 7, 1 << 4);                         \
    /* per sub-block ib (within 4): low 128 lane the word of scale 2ib, high lane of 2ib+1 */                                             \
    const __m256i pick = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,                                                 \
                                          2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);                                                \
    for (int64_t b = 0; b < nb; b++, w += 56) {                                                                                           \
        uint64_t sc;                                                                                                                      \
        memcpy(&sc, w + 48, 8);                                                                                                           \
        /* 16 scales 2s+1 as int16, lane k = 2 ib + half: (word >> 3 (k%4)) & 7 via << (13 - 3 (k%4)), >> 13 */                           \
        __m256i s16 = _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(_mm256_set1_epi64x((long long)sc), sc_shuf), sc_mul), 13); \
        s16 = _mm256_or_si256(_mm256_add_epi16(s16, s16), _mm256_set1_epi16(1));                                                          \
        const __m256i cs = _mm256_madd_epi16(s16, _mm256_loadu_si256((const __m256i *)x[b].bsums));                                       \
        const __m256i slo = _mm256_permute2x128_si256(s16, s16, 0x00), shi = _mm256_permute2x128_si256(s16, s16, 0x11);                   \
        __m256i sumi = _mm256_setzero_si256();                                                                                            \
        for (int j = 0; j < 4; j++) {                                                                                                     \
            __m256i u0, u1;                                                                                                               \
            ROWS(w + 8 * j, rd32(w + 32 + 4 * j), &u0, &u1);                                                                              \
            const __m256i y0 = _mm256_loadu_si256((const __m256i *)(x[b].qs + 64 * j));                                                   \
            const __m256i y1 = _mm256_loadu_si256((const __m256i *)(x[b].qs + 64 * j + 32));                                              \
            const __m256i ss = j < 2 ? slo : shi;                                                                                         \
            const __m256i sv0 = _mm256_shuffle_epi8(ss, _mm256_add_epi8(pick, _mm256_set1_epi8((char)(8 * (j % 2)))));                    \
            const __m256i sv1 = _mm256_shuffle_epi8(ss, _mm256_add_epi8(pick, _mm256_set1_epi8((char)(8 * (j % 2) + 4))));                \
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(u0, y0), sv0));                                          \
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(u1, y1), sv1));                                          \
        }                                                                                                                                 \
        sumi = _mm256_sub_epi32(sumi, _mm256_add_epi32(_mm256_slli_epi32(cs, 3), cs));                                                    \
        const float d = mf_f16_table[iq1m_d16(w)];                                                                                        \
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d * x[b].d * 0.125f), _mm256_cvtepi32_ps(sumi), acc);                                        \
    }                                                                                                                                     \
    return hsum_ps(acc);                                                                                                                  \
}
VD_IQ1_S(vd_iq1_s_gpr, AVX2, iq1s_rows8)
VD_IQ1_S(vd_iq1_s_pdep, BMI2, iq1s_rows8_pdep)
VD_IQ1_M(vd_iq1_m_gpr, AVX2, iq1_rows8)
VD_IQ1_M(vd_iq1_m_pdep, BMI2, iq1_rows8_pdep)
AVX2 float mf_vd_iq1_s_avx2(const uint8_t *w, const void *x, int64_t nb) {
    return mf_tune.pdep ? vd_iq1_s_pdep(w, x, nb) : vd_iq1_s_gpr(w, x, nb);
}
AVX2 float mf_vd_iq1_m_avx2(const uint8_t *w, const void *x, int64_t nb) {
    return mf_tune.pdep ? vd_iq1_m_pdep(w, x, nb) : vd_iq1_m_gpr(w, x, nb);
}

/* ---------------- prefill: blocks unpacked for the K-quant GEMMs (mf_kblk) ----------------
 * Signed codes become unsigned by an offset folded into cc . bsums: IQ3_XXS q = grid*sign + 64
 * (2..126: maddubs pair sums stay below 2^15), IQ3_S + 16, IQ1_S/IQ1_M q = 8 grid +- 1 + 9 (0..18)
 * with d / 8. sv: the sub-block scales per 16 values, cc = -offset * scale. */
AVX2 static inline void put_scales(mf_kblk *o, const int16_t s16[16], int off) {
    for (int c = 0; c < 8; c++)
        _mm256_storeu_si256((__m256i *)o->sv[c], _mm256_set_m128i(_mm_set1_epi16(s16[2 * c + 1]), _mm_set1_epi16(s16[2 * c])));
    for (int i = 0; i < 16; i++) o->cc[i] = (int16_t)(-off * s16[i]);
}

AVX2 void mf_up_iq3_xxs(const uint8_t *w, mf_kblk *o) {
    int16_t s16[16];
    const __m256i off = _mm256_set1_epi8(64);
    uint32_t sgs[8];
    _mm256_storeu_si256((__m256i *)sgs, iq_signs4x7(_mm256_loadu_si256((const __m256i *)(w + 66))));
    for (int ib = 0; ib < 8; ib++) {
        const uint32_t aux = rd32(w + 66 + 4 * ib);
        s16[2 * ib] = s16[2 * ib + 1] = (int16_t)(2 * (aux >> 28) + 1);
        const __m256i g = g3x8(w + 2 + 8 * ib);
        _mm256_storeu_si256((__m256i *)(o->q + 32 * ib), _mm256_add_epi8(_mm256_sign_epi8(g, sign32(sgs[ib])), off));
    }
    put_scales(o, s16, 64);
    o->d = o->dc = f16s(w) * 0.25f;
}

AVX2 void mf_up_iq3_s(const uint8_t *w, mf_kblk *o) {
    int16_t s16[16];
    const __m256i off = _mm256_set1_epi8(16);
    for (int ib = 0; ib < 8; ib++) {
        s16[2 * ib] = s16[2 * ib + 1] = (int16_t)(1 + 2 * ((w[106 + ib / 2] >> (4 * (ib % 2))) & 0xF));
        const unsigned qh = w[66 + ib];
        const __m256i hi = _mm256_and_si256(_mm256_sllv_epi32(_mm256_set1_epi32((int)qh), _mm256_setr_epi32(8, 7, 6, 5, 4, 3, 2, 1)), _mm256_set1_epi32(256));
        const __m256i idx = _mm256_or_si256(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + 2 + 8 * ib))), hi);
        const __m256i g = _mm256_i32gather_epi32((const int *)(const void *)mf_grid_iq3s, idx, 4);
        _mm256_storeu_si256((__m256i *)(o->q + 32 * ib), _mm256_add_epi8(_mm256_sign_epi8(g, sign32(rd32(w + 74 + 4 * ib))), off));
    }
    put_scales(o, s16, 16);
    o->d = o->dc = f16s(w);
}

/* the rows of mf_iq1_u are already 8 grid +- 1 + 9 */
AVX2 void mf_up_iq1_s(const uint8_t *w, mf_kblk *o) {
    int16_t s16[16];
    for (int j = 0; j < 4; j++) {
        s16[4 * j] = s16[4 * j + 1] = (int16_t)(2 * ((rd16(w + 34 + 4 * j) >> 12) & 7) + 1);
        s16[4 * j + 2] = s16[4 * j + 3] = (int16_t)(2 * ((rd16(w + 36 + 4 * j) >> 12) & 7) + 1);
        __m256i u0, u1;
        iq1s_rows8(w, j, &u0, &u1);
        _mm256_storeu_si256((__m256i *)(o->q + 64 * j), u0);
        _mm256_storeu_si256((__m256i *)(o->q + 64 * j + 32), u1);
    }
    put_scales(o, s16, 9);
    o->d = o->dc = f16s(w) * 0.125f;
}

AVX2 void mf_up_iq1_m(const uint8_t *w, mf_kblk *o) {
    int16_t s16[16];
    for (int k = 0; k < 16; k++) s16[k] = (int16_t)(2 * ((rd16(w + 48 + 2 * (k / 4)) >> (3 * (k % 4))) & 7) + 1);
    for (int j = 0; j < 4; j++) {
        __m256i u0, u1;
        iq1_rows8(w + 8 * j, rd32(w + 32 + 4 * j), &u0, &u1);
        _mm256_storeu_si256((__m256i *)(o->q + 64 * j), u0);
        _mm256_storeu_si256((__m256i *)(o->q + 64 * j + 32), u1);
    }
    put_scales(o, s16, 9);
    o->d = o->dc = mf_f16_table[iq1m_d16(w)] * 0.125f;
}

/* ---------------- AVX-512 VNNI vec-dots x Q8_K: two sub-blocks (64 values) per zmm ---------
 * grid rows by byte lookups (IQ3) or 8-lane gathers (IQ1), signs as a 64-bit mask (negate y
 * where set), sub-block scales as int16 by vpdpwssd: the same exact integer block sums as the
 * AVX2 kernels */
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx512dq,avx2,fma,f16c")))

/* 16 rows r of group j (values 64j..64j+63) as qword pairs [n01[r], n23[r], n01[r+1],
 * n23[r+1]] of the two lookups' results (bytes 4..7 of each qword unused), so that
 * vpmultishiftqb takes nibble k of a qword's low 4 bytes to its byte k */
#define IQ3_SEL2(j, r) 16 * (j) + (r), 64 + 16 * (j) + (r), 16 * (j) + (r) + 1, 64 + 16 * (j) + (r) + 1, 0, 0, 0, 0
#define IQ3_SEL(j) {IQ3_SEL2(j, 0), IQ3_SEL2(j, 2), IQ3_SEL2(j, 4), IQ3_SEL2(j, 6), IQ3_SEL2(j, 8), IQ3_SEL2(j, 10), IQ3_SEL2(j, 12), IQ3_SEL2(j, 14)}
static _Alignas(64) const uint8_t iq3_sel[4][64] = {IQ3_SEL(0), IQ3_SEL(1), IQ3_SEL(2), IQ3_SEL(3)};

/* IQ3_XXS as IQ3_S below (one 256-entry table pair per value pair, bit 7 choosing the pair),
 * the nibbles being value codes that one vpshufb turns into values; the signs of all 256
 * values from the 7-bit ksigns fields (iq_signs4x7_vbmi), a 64-bit mask per 64 values */
VNNI float mf_vd_iq3_xxs_avx512(const uint8_t *w, const void *xv, int64_t nb) {
    const mf_q8_256 *x = xv;
    __m512 acc = _mm512_setzero_ps();
    __m512i t01[4], t23[4], sel[4];
    for (int k = 0; k < 4; k++) {
        t01[k] = _mm512_load_si512((const void *)(mf_iq3xxs_n01 + 64 * k));
        t23[k] = _mm512_load_si512((const void *)(mf_iq3xxs_n23 + 64 * k));
        sel[k] = _mm512_load_si512((const void *)iq3_sel[k]);
    }
    const __m512i nsh = _mm512_set1_epi64(0x1C1814100C080400LL), m4 = _mm512_set1_epi8(15);
    const __m512i vals = _mm512_broadcast_i32x4(_mm_setr_epi8(4, 12, 20, 28, 36, 44, 52, 62, 0, 0, 0, 0, 0, 0, 0, 0));
    const __m512i ks0 = _mm512_loadu_si512((const void *)mf_ksigns_iq2xs), ks1 = _mm512_loadu_si512((const void *)(mf_ksigns_iq2xs + 64));
    const int64_t pfd = mf_tune.pf_dist;
    for (int64_t b = 0; b < nb; b++, w += 98) {
        MF_PF_STEP(w, pfd, 98);
        const __m256i aux = _mm256_loadu_si256((const __m256i *)(w + 66));
        const __m256i ls = _mm256_add_epi32(_mm256_slli_epi32(_mm256_srli_epi32(aux, 28), 1), _mm256_set1_epi32(1));
        const __m512i s8 = _mm512_castsi256_si512(ls);
        _Alignas(32) uint64_t sgs[4];
        _mm256_store_si256((__m256i *)sgs, iq_signs4x7_vbmi(aux, ks0, ks1));
        const __m512i q = _mm512_loadu_si512((const void *)(w + 2));
        const __mmask64 b7 = _mm512_movepi8_mask(q);
        const __m512i v01 = _mm512_mask_blend_epi8(b7, _mm512_permutex2var_epi8(t01[0], q, t01[1]), _mm512_permutex2var_epi8(t01[2], q, t01[3]));
        const __m512i v23 = _mm512_mask_blend_epi8(b7, _mm512_permutex2var_epi8(t23[0], q, t23[1]), _mm512_permutex2var_epi8(t23[2], q, t23[3]));
        __m512i sumi = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            const __m512i c = _mm512_and_si512(_mm512_multishift_epi64_epi8(nsh, _mm512_permutex2var_epi8(v01, sel[j], v23)), m4);
            const __m512i g = _mm512_shuffle_epi8(vals, c);
            __m512i y = _mm512_loadu_si512((const void *)(x[b].qs + 64 * j));
            y = _mm512_mask_sub_epi8(y, (__mmask64)sgs[j], _mm512_setzero_si512(), y);
            sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(g, y), iq_pair_scales(s8, j));
        }
        acc = _mm512_fmadd_ps(_mm512_set1_ps(f16s(w) * x[b].d * 0.25f), _mm512_cvtepi32_ps(sumi), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* IQ3_S's 64 grid rows of a block by byte lookups instead of gathers (VBMI, which this ISA
 * level has): the 9-bit index's low 7 bits pick a byte of a 128-entry table pair
 * (vpermi2b), bit 7 and bit 8 (qh as a 64-bit mask, bit l for row l) choose among the four
 * pairs. The tables hold two grid values per byte (mf_iq3s_n01/n23), so two sets of lookups
 * give all four values of each row; per 16 rows one byte permute interleaves them as
 * row-major [n01, n23] pairs and vpmultishiftqb + and spread the nibbles to bytes. The same
 * integers as the gather form. Zen 4, bench --kernels 4096x4096, 2 threads: see
 * BENCHMARKS.md section 28. */
VNNI static inline __m512i iq3s_lookup(const __m512i t[8], __m512i q, __mmask64 b7, __mmask64 b8) {
    const __m512i lo = _mm512_mask_blend_epi8(b7, _mm512_permutex2var_epi8(t[0], q, t[1]), _mm512_permutex2var_epi8(t[2], q, t[3]));
    const __m512i hi = _mm512_mask_blend_epi8(b7, _mm512_permutex2var_epi8(t[4], q, t[5]), _mm512_permutex2var_epi8(t[6], q, t[7]));
    return _mm512_mask_blend_epi8(b8, lo, hi);
}

VNNI float mf_vd_iq3_s_avx512(const uint8_t *w, const void *xv, int64_t nb) {
    const mf_q8_256 *x = xv;
    __m512 acc = _mm512_setzero_ps();
    __m512i t01[8], t23[8];
    for (int k = 0; k < 8; k++) {
        t01[k] = _mm512_load_si512((const void *)(mf_iq3s_n01 + 64 * k));
        t23[k] = _mm512_load_si512((const void *)(mf_iq3s_n23 + 64 * k));
    }
    __m512i sel[4];
    for (int j = 0; j < 4; j++) sel[j] = _mm512_load_si512((const void *)iq3_sel[j]);
    const __m512i nsh = _mm512_set1_epi64(0x1C1814100C080400LL), m4 = _mm512_set1_epi8(15);
    const int64_t pfd = mf_tune.pf_dist;
    for (int64_t b = 0; b < nb; b++, w += 110) {
        MF_PF_STEP(w, pfd, 110);
        const __m256i sn = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)rd32(w + 106)), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)), _mm256_set1_epi32(15));
        const __m512i s8 = _mm512_castsi256_si512(_mm256_add_epi32(_mm256_add_epi32(sn, sn), _mm256_set1_epi32(1)));
        const __m512i q = _mm512_loadu_si512((const void *)(w + 2));
        uint64_t h;
        memcpy(&h, w + 66, 8);
        const __mmask64 b7 = _mm512_movepi8_mask(q);
        const __m512i v01 = iq3s_lookup(t01, q, b7, (__mmask64)h), v23 = iq3s_lookup(t23, q, b7, (__mmask64)h);
        __m512i sumi = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            const __m512i g = _mm512_and_si512(_mm512_multishift_epi64_epi8(nsh, _mm512_permutex2var_epi8(v01, sel[j], v23)), m4);
            uint64_t sg;
            memcpy(&sg, w + 74 + 8 * j, 8);
            __m512i y = _mm512_loadu_si512((const void *)(x[b].qs + 64 * j));
            y = _mm512_mask_sub_epi8(y, (__mmask64)sg, _mm512_setzero_si512(), y);
            sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(g, y), iq_pair_scales(s8, j));
        }
        acc = _mm512_fmadd_ps(_mm512_set1_ps(f16s(w) * x[b].d), _mm512_cvtepi32_ps(sumi), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* IQ1_S/IQ1_M: 8 grid rows (two sub-blocks) by one 8-lane 64-bit gather */
VNNI static inline __m512i g1x8(const uint8_t *q8b, __m256i hi) {
    const __m256i idx = _mm256_or_si256(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q8b)), hi);
    if (!mf_slow_gather) return _mm512_i32gather_epi64(idx, (const void *)mf_grid_iq1s, 8);
    /* where gathers are slow (pool.c): the 8 rows by scalar loads, the same values */
    const uint64_t *G = (const uint64_t *)(const void *)mf_grid_iq1s;
    _Alignas(32) uint32_t ix[8];
    _mm256_store_si256((__m256i *)ix, idx);
    __m512i r = _mm512_castsi128_si512(_mm_set_epi64x((long long)G[ix[1]], (long long)G[ix[0]]));
    r = _mm512_inserti64x2(r, _mm_set_epi64x((long long)G[ix[3]], (long long)G[ix[2]]), 1);
    r = _mm512_inserti64x2(r, _mm_set_epi64x((long long)G[ix[5]], (long long)G[ix[4]]), 2);
    return _mm512_inserti64x2(r, _mm_set_epi64x((long long)G[ix[7]], (long long)G[ix[6]]), 3);
}

/* unsigned grid+1 (0..2) . q8 by maddubs; grid . q8 = that - sum(q8), the delta +-sum(q8)/8:
 * 8 * sum ls (grid+1).q8 + sum ls S (+-1 - 8), S from bsums; x d dx / 8 */
VNNI float mf_vd_iq1_s_avx512(const uint8_t *w, const void *xv, int64_t nb) {
    const mf_q8_256 *x = xv;
    __m512 acc = _mm512_setzero_ps();
    const __m512i one8 = _mm512_set1_epi8(1);
    const int64_t pfd = mf_tune.pf_dist;
    for (int64_t b = 0; b < nb; b++, w += 50) {
        MF_PF_STEP(w, pfd, 50);
        const __m256i qh = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + 34)));
        const __m256i ls = _mm256_add_epi32(_mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(qh, 12), _mm256_set1_epi32(7)), 1), _mm256_set1_epi32(1));
        const __m512i s8 = _mm512_castsi256_si512(ls);
        __m512i sumi = _mm512_setzero_si512();
        int corr = 0;
        for (int j = 0; j < 4; j++) {
            const uint32_t h2 = rd32(w + 34 + 4 * j); /* qh of sub-blocks 2j (low half), 2j+1 */
            const __m256i src = _mm256_sllv_epi32(_mm256_set1_epi32((int)h2), _mm256_setr_epi32(8, 8, 8, 8, 0, 0, 0, 0));
            const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(src, _mm256_setr_epi32(0, 3, 6, 9, 8, 11, 14, 17)), _mm256_set1_epi32(0x700));
            const __m512i g = _mm512_add_epi8(g1x8(w + 2 + 8 * j, hi), one8);
            const __m512i y = _mm512_loadu_si512((const void *)(x[b].qs + 64 * j));
            sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(g, y), iq_pair_scales(s8, j));
            for (int k = 0; k < 2; k++) {
                const unsigned q = (h2 >> (16 * k)) & 0xFFFF;
                const int ib = 2 * j + k, l = (int)(2 * ((q >> 12) & 7) + 1), S = x[b].bsums[2 * ib] + x[b].bsums[2 * ib + 1];
                corr += l * S * (-7 - (int)((q >> 14) & 2));
            }
        }
        sumi = _mm512_add_epi32(_mm512_slli_epi32(sumi, 3), _mm512_zextsi128_si512(_mm_cvtsi32_si128(corr)));
        acc = _mm512_fmadd_ps(_mm512_set1_ps(f16s(w) * x[b].d * 0.125f), _mm512_cvtepi32_ps(sumi), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* u = 8 (grid+1) + (delta > 0 ? 2 : 0) = a + 9 with a = 8 grid +- 1 (IQ1_M's AVX2 form):
 * sum sc u.q8 - 9 sum sc bsums, scales per 16 values as the bsums; x d dx / 8 */
VNNI float mf_vd_iq1_m_avx512(const uint8_t *w, const void *xv, int64_t nb) {
    const mf_q8_256 *x = xv;
    __m512 acc = _mm512_setzero_ps();
    const __m512i one8 = _mm512_set1_epi8(1), two8 = _mm512_set1_epi8(2);
    const __m256i sc_shuf = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3,
                                             4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6, 7, 6, 7);
    const __m256i sc_mul = _mm256_setr_epi16(1 << 13, 1 << 10, 1 << 7, 1 << 4, 1 << 13, 1 << 10, 1 << 7, 1 << 4,
                                             1 << 13, 1 << 10, 1 << 7, 1 << 4, 1 << 13, 1 << 10, 1 << 7, 1 << 4);
    /* lanes of the pair's scale vector: 16-value group 4j + lane/8 */
    const __m512i qsel = _mm512_set_epi64(3 * 0x0001000100010001LL, 3 * 0x0001000100010001LL, 2 * 0x0001000100010001LL, 2 * 0x0001000100010001LL,
                                          0x0001000100010001LL, 0x0001000100010001LL, 0, 0);
    const int64_t pfd = mf_tune.pf_dist;
    for (int64_t b = 0; b < nb; b++, w += 56) {
        MF_PF_STEP(w, pfd, 56);
        uint64_t sc;
        memcpy(&sc, w + 48, 8);
        __m256i s16 = _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(_mm256_set1_epi64x((long long)sc), sc_shuf), sc_mul), 13);
        s16 = _mm256_or_si256(_mm256_add_epi16(s16, s16), _mm256_set1_epi16(1)); /* lane k: scale of values 16k.. */
        const __m512i s16z = _mm512_castsi256_si512(s16);
        const __m256i cs = _mm256_madd_epi16(s16, _mm256_loadu_si256((const __m256i *)x[b].bsums));
        __m512i sumi = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            const __m256i nib = _mm256_srlv_epi32(_mm256_set1_epi32((int)rd32(w + 32 + 4 * j)), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
            const __m256i hi = _mm256_slli_epi32(_mm256_and_si256(nib, _mm256_set1_epi32(7)), 8);
            const __mmask8 neg = _mm256_test_epi32_mask(nib, _mm256_set1_epi32(8));
            const __m512i g = _mm512_add_epi8(g1x8(w + 8 * j, hi), one8);
            const __m512i u = _mm512_add_epi8(_mm512_slli_epi16(g, 3), _mm512_maskz_mov_epi64((__mmask8)~neg, two8));
            const __m512i y = _mm512_loadu_si512((const void *)(x[b].qs + 64 * j));
            const __m512i sv = _mm512_permutexvar_epi16(_mm512_add_epi16(qsel, _mm512_set1_epi16((short)(4 * j))), s16z);
            sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(u, y), sv);
        }
        const __m256i c9 = _mm256_add_epi32(_mm256_slli_epi32(cs, 3), cs);
        sumi = _mm512_sub_epi32(sumi, _mm512_zextsi256_si512(c9));
        const float d = mf_f16_table[iq1m_d16(w)];
        acc = _mm512_fmadd_ps(_mm512_set1_ps(d * x[b].d * 0.125f), _mm512_cvtepi32_ps(sumi), acc);
    }
    return _mm512_reduce_add_ps(acc);
}
