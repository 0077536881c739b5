/* IQ3_XXS, IQ3_S, IQ1_S, IQ1_M (ggml-common.h block layouts): scalar dequantizers, bit-exact
 * with gguf-py (the same float32 operations in the same order), and AVX2 vec-dots against Q8_K
 * activations (mf_q8_256), ggml's vec_dot_type for these types. The vec-dots sum each block in
 * exact integers and scale once per block, as ggml's do. */
#include "quant_common.h"
#include "simd_x86.h"

#include <immintrin.h>
#include <string.h>

#define AVX2 __attribute__((target("avx2,fma,f16c")))

static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
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
static inline int g3x(const uint8_t *grid, unsigned i) { return (int)rd32(grid + 4 * i); }
static inline long long g1(unsigned i) { return (long long)rd64((const uint8_t *)mf_grid_iq1s + 8 * i); }

/* sum over sub-blocks of (2 ls + 1) * (unsigned grid . signed q8) in int32 lanes; x 0.25 d dx */
AVX2 float mf_vd_iq3_xxs_avx2(const uint8_t *w, const void *xv, int64_t nb) {
    const mf_q8_256 *x = xv;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 98) {
        const uint8_t *qs = w + 2;
        __m256i sumi = _mm256_setzero_si256();
        for (int ib = 0; ib < 8; ib++, qs += 8) {
            const uint32_t aux = rd32(w + 66 + 4 * ib);
            const __m256i g = _mm256_set_epi32(g3x(mf_grid_iq3xxs, qs[7]), g3x(mf_grid_iq3xxs, qs[6]),
                                               g3x(mf_grid_iq3xxs, qs[5]), g3x(mf_grid_iq3xxs, qs[4]),
                                               g3x(mf_grid_iq3xxs, qs[3]), g3x(mf_grid_iq3xxs, qs[2]),
                                               g3x(mf_grid_iq3xxs, qs[1]), g3x(mf_grid_iq3xxs, qs[0]));
            const uint32_t sg = iq3xxs_signs(aux, 0) | iq3xxs_signs(aux, 1) << 8 | iq3xxs_signs(aux, 2) << 16 |
                                (uint32_t)iq3xxs_signs(aux, 3) << 24;
            const __m256i y = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(x[b].qs + 32 * ib)), sign32(sg));
            const __m256i p = _mm256_maddubs_epi16(g, y); /* grid <= 62: pair sums < 2^15 */
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, _mm256_set1_epi16((short)(2 * (aux >> 28) + 1))));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16s(w) * x[b].d * 0.25f), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum_ps(acc);
}

AVX2 float mf_vd_iq3_s_avx2(const uint8_t *w, const void *xv, int64_t nb) {
    const mf_q8_256 *x = xv;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 110) {
        __m256i sumi = _mm256_setzero_si256();
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *qs = w + 2 + 8 * ib;
            const unsigned qh = w[66 + ib];
#define I3S(k) g3x(mf_grid_iq3s, qs[k] | (((qh >> (k)) & 1) << 8))
            const __m256i g = _mm256_set_epi32(I3S(7), I3S(6), I3S(5), I3S(4), I3S(3), I3S(2), I3S(1), I3S(0));
#undef I3S
            const __m256i y = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(x[b].qs + 32 * ib)), sign32(rd32(w + 74 + 4 * ib)));
            const __m256i p = _mm256_maddubs_epi16(g, y);
            const int sc = 1 + 2 * ((w[106 + ib / 2] >> (4 * (ib % 2))) & 0xF);
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, _mm256_set1_epi16((short)sc)));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16s(w) * x[b].d), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum_ps(acc);
}

/* grid . q8 via sign_epi8 (grid in -1/0/1); the delta per 32 values from bsums:
 * 8 * sum (2s+1) grid.q8 + sum (2s+1) (+-1) sum(q8) in int32, x d dx / 8 */
AVX2 float mf_vd_iq1_s_avx2(const uint8_t *w, const void *xv, int64_t nb) {
    const mf_q8_256 *x = xv;
    __m256 acc = _mm256_setzero_ps();
    const __m256i one8 = _mm256_set1_epi8(1);
    for (int64_t b = 0; b < nb; b++, w += 50) {
        const uint8_t *qs = w + 2;
        __m256i sumi = _mm256_setzero_si256();
        int sumd = 0;
        for (int ib = 0; ib < 8; ib++, qs += 4) {
            const unsigned qh = rd16(w + 34 + 2 * ib);
            const int ls = (int)(2 * ((qh >> 12) & 7) + 1);
            const __m256i g = _mm256_set_epi64x(g1(qs[3] | ((qh >> 1) & 0x700)), g1(qs[2] | ((qh << 2) & 0x700)),
                                                g1(qs[1] | ((qh << 5) & 0x700)), g1(qs[0] | ((qh << 8) & 0x700)));
            const __m256i y = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(x[b].qs + 32 * ib)), g);
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(one8, y), _mm256_set1_epi16((short)ls)));
            const int s = x[b].bsums[2 * ib] + x[b].bsums[2 * ib + 1];
            sumd += qh & 0x8000 ? -ls * s : ls * s;
        }
        const __m256i tot = _mm256_add_epi32(_mm256_slli_epi32(sumi, 3), _mm256_setr_epi32(sumd, 0, 0, 0, 0, 0, 0, 0));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16s(w) * x[b].d * 0.125f), _mm256_cvtepi32_ps(tot), acc);
    }
    return hsum_ps(acc);
}

/* the delta per 8 values: a = 8*grid +- 1 (|a| <= 9) dotted with q8, scales per 16 values;
 * x d dx / 8 */
AVX2 float mf_vd_iq1_m_avx2(const uint8_t *w, const void *xv, int64_t nb) {
    const mf_q8_256 *x = xv;
    __m256 acc = _mm256_setzero_ps();
    const __m256i eight = _mm256_set1_epi8(8);
    const long long dp = 0x0101010101010101LL, dm = -1LL;
    for (int64_t b = 0; b < nb; b++, w += 56) {
        const unsigned sc[4] = {rd16(w + 48), rd16(w + 50), rd16(w + 52), rd16(w + 54)};
        __m256i sumi = _mm256_setzero_si256();
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *qs = w + 4 * ib;
            const unsigned h0 = w[32 + 2 * ib], h1 = w[33 + 2 * ib];
            const __m256i g = _mm256_set_epi64x(g1(qs[3] | ((h1 << 4) & 0x700)), g1(qs[2] | ((h1 << 8) & 0x700)),
                                                g1(qs[1] | ((h0 << 4) & 0x700)), g1(qs[0] | ((h0 << 8) & 0x700)));
            const __m256i dl = _mm256_set_epi64x(h1 & 0x80 ? dm : dp, h1 & 0x08 ? dm : dp, h0 & 0x80 ? dm : dp, h0 & 0x08 ? dm : dp);
            const __m256i a = _mm256_add_epi8(_mm256_sign_epi8(eight, g), dl);
            const __m256i y = _mm256_loadu_si256((const __m256i *)(x[b].qs + 32 * ib));
            const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(a), _mm256_sign_epi8(y, a));
            const unsigned s = sc[ib / 2] >> (6 * (ib % 2));
            const __m256i sv = _mm256_set_m128i(_mm_set1_epi16((short)(2 * ((s >> 3) & 7) + 1)), _mm_set1_epi16((short)(2 * (s & 7) + 1)));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, sv));
        }
        const float d = mf_f16_table[iq1m_d16(w)];
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d * x[b].d * 0.125f), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum_ps(acc);
}
