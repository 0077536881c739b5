/* IQ2_XXS / IQ2_XS / IQ2_S (ggml-common.h block layouts): scalar dequantizers, AVX2 and
 * AVX-512 VNNI vec-dots against Q8_256 (ggml's Q8_K), and the AVX2 unpackers to mf_kblk that
 * feed the K-quant prefill kernels (kblk on avx2, kgemm on avx512vnni).
 *
 * Every 8 weights are one lattice point (grid values 8/25/43, read as a uint64 of 8 bytes
 * from mf_grid_*) with 8 sign bits; a scale ls (4 bits) per 32 (XXS) or per 16 (XS, S) gives
 * w = d * (0.5 + ls) / 4 * grid * sign = d/8 * (2 ls + 1) * grid * sign. The vec-dots, as
 * ggml's, sum grid * (sign * x8) in int32 per sub-block times (2 ls + 1), then one float
 * FMA per block with d * dx, and 1/8 at the end. */
#include "quant_common.h"
#include "simd_x86.h"

#include <immintrin.h>
#include <string.h>

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,avx2,fma,f16c")))

/* ---------------- scalar dequantizers: gguf-py's f32 operations in its order ----------------
 * db = d * (0.5 + ls) * 0.25, then db * grid * (+-1): the sign flip is exact. */

static inline void put8(float db, const int8_t *g, uint8_t signs, float *y) {
    for (int j = 0; j < 8; j++) {
        float v = db * (float)g[j];
        y[j] = (signs >> j) & 1 ? -v : v;
    }
}

void mf_dq_iq2_xxs(const uint8_t *b, float *y) {
    float d = mf_f16(b);
    for (int ib = 0; ib < 8; ib++, y += 32) {
        const uint8_t *q = b + 2 + 8 * ib; /* 4 grid indices, then u32 signs (4 x 7 bits) | ls << 28 */
        uint32_t a;
        memcpy(&a, q + 4, 4);
        float db = d * (0.5f + (float)(a >> 28)) * 0.25f;
        for (int l = 0; l < 4; l++) put8(db, mf_grid_iq2xxs + 8 * q[l], mf_ksigns_iq2xs[(a >> (7 * l)) & 127], y + 8 * l);
    }
}

void mf_dq_iq2_xs(const uint8_t *b, float *y) {
    float d = mf_f16(b);
    const uint8_t *sc = b + 66;
    for (int l = 0; l < 32; l++) { /* u16: 9-bit grid index | 7-bit sign index << 9 */
        uint16_t q = (uint16_t)(b[2 + 2 * l] | (b[3 + 2 * l] << 8));
        float db = d * (0.5f + (float)((sc[l / 4] >> (4 * ((l / 2) & 1))) & 0xF)) * 0.25f;
        put8(db, mf_grid_iq2xs + 8 * (q & 511), mf_ksigns_iq2xs[q >> 9], y + 8 * l);
    }
}

void mf_dq_iq2_s(const uint8_t *b, float *y) {
    float d = mf_f16(b);
    const uint8_t *qs = b + 2, *sg = b + 34, *qh = b + 66, *sc = b + 74;
    for (int l = 0; l < 32; l++) { /* grid index qs[l] | 2 bits of qh << 8; one sign byte per 8 */
        int idx = qs[l] | (((qh[l / 4] >> (2 * (l % 4))) & 3) << 8);
        float db = d * (0.5f + (float)((sc[l / 4] >> (4 * ((l / 2) & 1))) & 0xF)) * 0.25f;
        put8(db, mf_grid_iq2s + 8 * idx, sg[l], y + 8 * l);
    }
}

/* ---------------- AVX2 ---------------- */

static inline uint64_t grid8(const int8_t *grid, int i) {
    uint64_t g;
    memcpy(&g, grid + 8 * i, 8);
    return g;
}
AVX2 static inline float f16c(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
/* 4 sign bytes (element 8k+j negative when bit j of byte k is set) -> +-1 per byte */
AVX2 static inline __m256i sign_pm1(uint32_t s) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                           0x0101010101010101, 0x0000000000000000);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)s), shuf);
    b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_or_si256(_mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(1));
}
AVX2 static inline __m256i grid32(const int8_t *grid, int i0, int i1, int i2, int i3) {
    return _mm256_set_epi64x((long long)grid8(grid, i3), (long long)grid8(grid, i2), (long long)grid8(grid, i1),
                             (long long)grid8(grid, i0));
}
static inline uint32_t ksigns4(uint32_t a) { /* 4 x 7-bit sign indices -> 4 sign bytes */
    const uint8_t *k = mf_ksigns_iq2xs;
    return (uint32_t)k[a & 127] | (uint32_t)k[(a >> 7) & 127] << 8 | (uint32_t)k[(a >> 14) & 127] << 16 |
           (uint32_t)k[(a >> 21) & 127] << 24;
}
/* grid (u8, <= 43) x signed x: 16 int16 pair sums, then times the lane scales into int32 */
AVX2 static inline __m256i sdot32(__m256i g, uint32_t signs, const int8_t *x, __m256i sc) {
    __m256i y = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)x), sign_pm1(signs));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(g, y), sc);
}

/* The vec-dot bodies, instantiated for AVX2 (sdot32) and AVX-512VL (sdot32m, below) */
#define VD_IQ2_XXS(NAME, ATTR, SDOT)                                                                   \
    ATTR float NAME(const uint8_t *w, const void *xv, int64_t nb) {                                    \
        const mf_q8_256 *x = xv;                                                                       \
        __m256 acc = _mm256_setzero_ps();                                                              \
        for (int64_t b = 0; b < nb; b++, w += 66) {                                                    \
            __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();                          \
            for (int ib = 0; ib < 8; ib += 2) {                                                        \
                uint32_t a[4];                                                                         \
                memcpy(a, w + 2 + 8 * ib, 16);                                                         \
                const uint8_t *i0 = (const uint8_t *)&a[0], *i1 = (const uint8_t *)&a[2];              \
                __m256i g0 = grid32(mf_grid_iq2xxs, i0[0], i0[1], i0[2], i0[3]);                       \
                __m256i g1 = grid32(mf_grid_iq2xxs, i1[0], i1[1], i1[2], i1[3]);                       \
                s0 = _mm256_add_epi32(s0, SDOT(g0, ksigns4(a[1]), x[b].qs + 32 * ib,                   \
                                               _mm256_set1_epi16((short)(2 * (a[1] >> 28) + 1))));     \
                s1 = _mm256_add_epi32(s1, SDOT(g1, ksigns4(a[3]), x[b].qs + 32 * ib + 32,              \
                                               _mm256_set1_epi16((short)(2 * (a[3] >> 28) + 1))));     \
            }                                                                                          \
            acc = _mm256_fmadd_ps(_mm256_set1_ps(f16c(w) * x[b].d), _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), acc); \
        }                                                                                              \
        return 0.125f * hsum_ps(acc);                                                                  \
    }

/* 2 ls + 1 for the two 16-element halves of a 32-element sub-block (scale byte s) */
AVX2 static inline __m256i xs_scales(uint8_t s) {
    return _mm256_set_m128i(_mm_set1_epi16((short)(2 * (s >> 4) + 1)), _mm_set1_epi16((short)(2 * (s & 0xF) + 1)));
}
static inline uint32_t xs_signs4(const uint16_t *a) { /* sign bytes of 4 XS groups */
    const uint8_t *k = mf_ksigns_iq2xs;
    return (uint32_t)k[a[0] >> 9] | (uint32_t)k[a[1] >> 9] << 8 | (uint32_t)k[a[2] >> 9] << 16 | (uint32_t)k[a[3] >> 9] << 24;
}

#define VD_IQ2_XS(NAME, ATTR, SDOT)                                                                    \
    ATTR float NAME(const uint8_t *w, const void *xv, int64_t nb) {                                    \
        const mf_q8_256 *x = xv;                                                                       \
        __m256 acc = _mm256_setzero_ps();                                                              \
        for (int64_t b = 0; b < nb; b++, w += 74) {                                                    \
            __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();                          \
            uint16_t q[32];                                                                            \
            memcpy(q, w + 2, 64);                                                                      \
            for (int ib = 0; ib < 8; ib += 2) {                                                        \
                const uint16_t *a = q + 4 * ib;                                                        \
                __m256i g0 = grid32(mf_grid_iq2xs, a[0] & 511, a[1] & 511, a[2] & 511, a[3] & 511);    \
                __m256i g1 = grid32(mf_grid_iq2xs, a[4] & 511, a[5] & 511, a[6] & 511, a[7] & 511);    \
                s0 = _mm256_add_epi32(s0, SDOT(g0, xs_signs4(a), x[b].qs + 32 * ib, xs_scales(w[66 + ib]))); \
                s1 = _mm256_add_epi32(s1, SDOT(g1, xs_signs4(a + 4), x[b].qs + 32 * ib + 32, xs_scales(w[67 + ib]))); \
            }                                                                                          \
            acc = _mm256_fmadd_ps(_mm256_set1_ps(f16c(w) * x[b].d), _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), acc); \
        }                                                                                              \
        return 0.125f * hsum_ps(acc);                                                                  \
    }

static inline int iq2s_idx(const uint8_t *w, int l) { return w[2 + l] | (((w[66 + l / 4] >> (2 * (l % 4))) & 3) << 8); }

#define VD_IQ2_S(NAME, ATTR, SDOT)                                                                     \
    ATTR float NAME(const uint8_t *w, const void *xv, int64_t nb) {                                    \
        const mf_q8_256 *x = xv;                                                                       \
        __m256 acc = _mm256_setzero_ps();                                                              \
        for (int64_t b = 0; b < nb; b++, w += 82) {                                                    \
            __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();                          \
            for (int ib = 0; ib < 8; ib += 2) {                                                        \
                const int l = 4 * ib;                                                                  \
                __m256i g0 = grid32(mf_grid_iq2s, iq2s_idx(w, l), iq2s_idx(w, l + 1), iq2s_idx(w, l + 2), iq2s_idx(w, l + 3)); \
                __m256i g1 = grid32(mf_grid_iq2s, iq2s_idx(w, l + 4), iq2s_idx(w, l + 5), iq2s_idx(w, l + 6), iq2s_idx(w, l + 7)); \
                uint32_t sg[2];                                                                        \
                memcpy(sg, w + 34 + l, 8);                                                             \
                s0 = _mm256_add_epi32(s0, SDOT(g0, sg[0], x[b].qs + 32 * ib, xs_scales(w[74 + ib])));  \
                s1 = _mm256_add_epi32(s1, SDOT(g1, sg[1], x[b].qs + 32 * ib + 32, xs_scales(w[75 + ib]))); \
            }                                                                                          \
            acc = _mm256_fmadd_ps(_mm256_set1_ps(f16c(w) * x[b].d), _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), acc); \
        }                                                                                              \
        return 0.125f * hsum_ps(acc);                                                                  \
    }

VD_IQ2_XXS(mf_vd_iq2_xxs_avx2, AVX2, sdot32)
VD_IQ2_XS(mf_vd_iq2_xs_avx2, AVX2, sdot32)
VD_IQ2_S(mf_vd_iq2_s_avx2, AVX2, sdot32)

/* ---------------- prefill unpack (mf_kblk) ----------------
 * q = grid * sign + 43 (0..86, u8 for maddubs/vpdpbusd; pair sums stay under 2^15), sv the
 * (2 ls + 1) per 16, cc = -43 (2 ls + 1) against bsums, d = dc = d/8. */
AVX2 static inline void kblk32(__m256i g, uint32_t signs, uint8_t *q) {
    __m256i v = _mm256_add_epi8(_mm256_sign_epi8(g, sign_pm1(signs)), _mm256_set1_epi8(43));
    _mm256_storeu_si256((__m256i *)q, v);
}
static inline void kblk_scales(mf_kblk *o, int c, int lo, int hi) { /* ls per 16: halves of chunk c */
    for (int i = 0; i < 8; i++) { o->sv[c][i] = (int16_t)lo; o->sv[c][8 + i] = (int16_t)hi; }
    o->cc[2 * c] = (int16_t)(-43 * lo);
    o->cc[2 * c + 1] = (int16_t)(-43 * hi);
}

AVX2 void mf_up_iq2_xxs(const uint8_t *w, mf_kblk *o) {
    o->d = o->dc = f16c(w) * 0.125f;
    for (int ib = 0; ib < 8; ib++) {
        uint32_t a[2];
        memcpy(a, w + 2 + 8 * ib, 8);
        const uint8_t *i = (const uint8_t *)&a[0];
        kblk32(grid32(mf_grid_iq2xxs, i[0], i[1], i[2], i[3]), ksigns4(a[1]), o->q + 32 * ib);
        int ls = (int)(2 * (a[1] >> 28) + 1);
        kblk_scales(o, ib, ls, ls);
    }
}

AVX2 void mf_up_iq2_xs(const uint8_t *w, mf_kblk *o) {
    o->d = o->dc = f16c(w) * 0.125f;
    uint16_t q[32];
    memcpy(q, w + 2, 64);
    for (int ib = 0; ib < 8; ib++) {
        const uint16_t *a = q + 4 * ib;
        kblk32(grid32(mf_grid_iq2xs, a[0] & 511, a[1] & 511, a[2] & 511, a[3] & 511), xs_signs4(a), o->q + 32 * ib);
        kblk_scales(o, ib, 2 * (w[66 + ib] & 0xF) + 1, 2 * (w[66 + ib] >> 4) + 1);
    }
}

AVX2 void mf_up_iq2_s(const uint8_t *w, mf_kblk *o) {
    o->d = o->dc = f16c(w) * 0.125f;
    for (int ib = 0; ib < 8; ib++) {
        const int l = 4 * ib;
        uint32_t sg;
        memcpy(&sg, w + 34 + l, 4);
        kblk32(grid32(mf_grid_iq2s, iq2s_idx(w, l), iq2s_idx(w, l + 1), iq2s_idx(w, l + 2), iq2s_idx(w, l + 3)), sg, o->q + 32 * ib);
        kblk_scales(o, ib, 2 * (w[74 + ib] & 0xF) + 1, 2 * (w[74 + ib] >> 4) + 1);
    }
}

/* ---------------- AVX-512 VNNI path: the same kernels on ymm, signs as a mask ----------------
 * The 32 sign bits negate x under a mask (vpsubb {k}) instead of building a +-1 vector (5
 * ops). 1 thread, L2-resident 1024x4096, CPU time (docs/NOTES.md): XXS +12%; 64-weight zmm
 * steps (8 lattice loads + inserts, vpdpwssd) measured 8-15% slower than AVX2, vpgatherqq
 * slower still. */
VNNI static inline __m256i sdot32m(__m256i g, uint32_t signs, const int8_t *x, __m256i sc) {
    const __m256i y = _mm256_loadu_si256((const __m256i *)x);
    const __m256i ys = _mm256_mask_sub_epi8(y, (__mmask32)signs, _mm256_setzero_si256(), y);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(g, ys), sc);
}
VD_IQ2_XXS(mf_vd_iq2_xxs_avx512, VNNI, sdot32m)
VD_IQ2_XS(mf_vd_iq2_xs_avx512, VNNI, sdot32m)
VD_IQ2_S(mf_vd_iq2_s_avx512, VNNI, sdot32m)
