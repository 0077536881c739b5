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

/* row i of a lattice grid as one u64 (an unsigned index: the address is one scaled add) */
static inline uint64_t grid8(const int8_t *grid, unsigned i) {
    uint64_t g;
    memcpy(&g, grid + 8 * (size_t)i, 8);
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
AVX2 static inline __m256i grid32(const int8_t *grid, unsigned i0, unsigned i1, unsigned i2, unsigned i3) {
    return _mm256_set_epi64x((long long)grid8(grid, i3), (long long)grid8(grid, i2), (long long)grid8(grid, i1),
                             (long long)grid8(grid, i0));
}
/* grid (u8, <= 43) x signed x: 16 int16 pair sums, then times the lane scales into int32 */
AVX2 static inline __m256i sdot32(__m256i g, uint32_t signs, const int8_t *x, __m256i sc) {
    __m256i y = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)x), sign_pm1(signs));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(g, y), sc);
}

/* IQ2_XXS codes of one block with vector ops: the 8 (4 grid bytes, u32 4 x 7-bit sign
 * indices | ls << 28) pairs split into grid bytes gi[ib] and sign words; each 7-bit field
 * gets its parity bit (ggml's ksigns_iq2xs[i] = i | parity(i) << 7) from a nibble table, so
 * sg[ib] holds the 4 sign bytes of sub-block ib and ls[ib] = 2 ls + 1 (as int16). */
typedef struct { _Alignas(32) uint32_t gi[8]; uint32_t sg[8]; int16_t ls[8]; } iq2xxs_codes;

/* a block's 8 (4 grid bytes, u32 aux) pairs split into the 32 grid bytes *g and the 8 aux words *a */
AVX2 static inline void xxs_split(const uint8_t *w, __m256i *g, __m256i *a) {
    const __m256 lo = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(w + 2)));
    const __m256 hi = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(w + 34)));
    *g = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(lo, hi, 0x88)), 0xD8);
    *a = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(lo, hi, 0xDD)), 0xD8);
}

AVX2 static inline void xxs_codes(const uint8_t *w, iq2xxs_codes *c) {
    __m256i g, a;
    xxs_split(w, &g, &a);
    const __m256i sg = iq_signs4x7(a);
    _mm256_store_si256((__m256i *)c->gi, g);
    _mm256_storeu_si256((__m256i *)c->sg, sg);
    const __m256i ls = _mm256_add_epi32(_mm256_slli_epi32(_mm256_srli_epi32(a, 28), 1), _mm256_set1_epi32(1));
    _mm_storeu_si128((__m128i *)c->ls, _mm_packs_epi32(_mm256_castsi256_si128(ls), _mm256_extracti128_si256(ls, 1)));
}

/* The vec-dot bodies, instantiated for AVX2 (sdot32) and AVX-512VL (sdot32m, below) */
#define VD_IQ2_XXS(NAME, ATTR, SDOT)                                                                   \
    ATTR float NAME(const uint8_t *w, const void *xv, int64_t nb) {                                    \
        const mf_q8_256 *x = xv;                                                                       \
        __m256 acc = _mm256_setzero_ps();                                                              \
        iq2xxs_codes c;                                                                                \
        for (int64_t b = 0; b < nb; b++, w += 66) {                                                    \
            __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();                          \
            xxs_codes(w, &c);                                                                          \
            for (int ib = 0; ib < 8; ib += 2) {                                                        \
                const uint8_t *i0 = (const uint8_t *)&c.gi[ib], *i1 = (const uint8_t *)&c.gi[ib + 1];  \
                __m256i g0 = grid32(mf_grid_iq2xxs, i0[0], i0[1], i0[2], i0[3]);                       \
                __m256i g1 = grid32(mf_grid_iq2xxs, i1[0], i1[1], i1[2], i1[3]);                       \
                s0 = _mm256_add_epi32(s0, SDOT(g0, c.sg[ib], x[b].qs + 32 * ib, _mm256_set1_epi16(c.ls[ib]))); \
                s1 = _mm256_add_epi32(s1, SDOT(g1, c.sg[ib + 1], x[b].qs + 32 * ib + 32, _mm256_set1_epi16(c.ls[ib + 1]))); \
            }                                                                                          \
            acc = _mm256_fmadd_ps(_mm256_set1_ps(f16c(w) * x[b].d), _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), acc); \
        }                                                                                              \
        return 0.125f * hsum_ps(acc);                                                                  \
    }

/* IQ2_XS / IQ2_S codes of one block, decoded with vector ops (the scalar form spent ~12
 * table loads and shifts per 32 weights on the sign bytes and ~6 ops per lattice index):
 * idx[l] = lattice index of the l-th 8 weights, sg[k] = the 4 sign bytes of weights
 * 32k..32k+31, sc = (2 ls + 1) per 16 weights as bytes [lo0, hi0, lo1, hi1, ...] in both
 * 128-bit lanes (chunk_scale picks one chunk's pair). */
typedef struct { _Alignas(32) uint16_t idx[32]; uint32_t sg[8]; } iq2_codes;

AVX2 static inline __m256i iq2_scales(const uint8_t *s8) {
    const __m128i s = _mm_loadl_epi64((const __m128i *)s8), m = _mm_set1_epi8(0xF);
    __m128i v = _mm_unpacklo_epi8(_mm_and_si128(s, m), _mm_and_si128(_mm_srli_epi16(s, 4), m));
    v = _mm_add_epi8(_mm_add_epi8(v, v), _mm_set1_epi8(1));
    return _mm256_broadcastsi128_si256(v);
}
/* int16 (2 ls + 1) of chunk k: low 128-bit lane the first 16 weights', high lane the second's */
AVX2 static inline __m256i chunk_scale(__m256i sc, int k) {
    const __m256i base = _mm256_set_epi64x((long long)0x8001800180018001, (long long)0x8001800180018001,
                                           (long long)0x8000800080008000, (long long)0x8000800080008000);
    return _mm256_shuffle_epi8(sc, _mm256_add_epi16(base, _mm256_set1_epi16((short)(2 * k))));
}
/* IQ2_XS: 32 u16 codes = 9-bit index | 7-bit sign index << 9; the 8th sign bit is the parity
 * of the 7 (ggml's ksigns_iq2xs[i] = i | parity(i) << 7), from a 16-entry nibble table. */
AVX2 static inline void xs_codes(const uint8_t *w, iq2_codes *c) {
    const __m256i c0 = _mm256_loadu_si256((const __m256i *)(w + 2)), c1 = _mm256_loadu_si256((const __m256i *)(w + 34));
    const __m256i m9 = _mm256_set1_epi16(511);
    _mm256_store_si256((__m256i *)c->idx, _mm256_and_si256(c0, m9));
    _mm256_store_si256((__m256i *)(c->idx + 16), _mm256_and_si256(c1, m9));
    const __m256i f0 = iq_parity7(_mm256_srli_epi16(c0, 9)), f1 = iq_parity7(_mm256_srli_epi16(c1, 9));
    _mm256_storeu_si256((__m256i *)c->sg, _mm256_permute4x64_epi64(_mm256_packus_epi16(f0, f1), 0xD8));
}
/* IQ2_S: index = qs[l] | 2 bits of qh[l/4] << 8 (bits 2(l%4)), moved up by a multiply per
 * lane (AVX2 has no per-lane 16-bit shift); sign bytes are stored as they are. */
AVX2 static inline void s_codes(const uint8_t *w, iq2_codes *c) {
    const __m128i qh = _mm_loadl_epi64((const __m128i *)(w + 66));
    const __m256i rep = _mm256_set_epi64x((long long)0xFF03FF03FF03FF03, (long long)0xFF02FF02FF02FF02,
                                          (long long)0xFF01FF01FF01FF01, (long long)0xFF00FF00FF00FF00);
    const __m256i mul = _mm256_set_epi64x(0x0004001000400100, 0x0004001000400100, 0x0004001000400100, 0x0004001000400100);
    const __m256i m3 = _mm256_set1_epi16(0x300);
    const __m256i h0 = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(qh), rep);                       /* qh[0..3] */
    const __m256i h1 = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_srli_si128(qh, 4)), rep);  /* qh[4..7] */
    const __m256i l0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w + 2)));
    const __m256i l1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w + 18)));
    _mm256_store_si256((__m256i *)c->idx, _mm256_or_si256(l0, _mm256_and_si256(_mm256_mullo_epi16(h0, mul), m3)));
    _mm256_store_si256((__m256i *)(c->idx + 16), _mm256_or_si256(l1, _mm256_and_si256(_mm256_mullo_epi16(h1, mul), m3)));
    memcpy(c->sg, w + 34, 32);
}

/* IQ2_XS and IQ2_S share the body once their codes are decoded: 32-weight chunks, scales per 16 */
#define VD_IQ2_CODES(NAME, ATTR, SDOT, BLOCK, CODES, GRID, SC, PF)                                     \
    ATTR float NAME(const uint8_t *w, const void *xv, int64_t nb) {                                    \
        const mf_q8_256 *x = xv;                                                                       \
        __m256 acc = _mm256_setzero_ps();                                                              \
        iq2_codes cc[2];                                                                               \
        const int64_t pfd = PF ? mf_tune.pf_dist : 0;                                                  \
        if (nb > 0) CODES(w, &cc[0]);                                                                  \
        for (int64_t b = 0; b < nb; b++, w += BLOCK) {                                                 \
            MF_PF_STEP(w, pfd, BLOCK);                                                                 \
            /* the next block's codes first: their latency overlaps this block's dots */               \
            if (b + 1 < nb) CODES(w + BLOCK, &cc[(b + 1) & 1]);                                        \
            const iq2_codes *c = &cc[b & 1];                                                           \
            __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();                          \
            const __m256i sc = iq2_scales(w + SC);                                                     \
            for (int ib = 0; ib < 8; ib += 2) {                                                        \
                const uint16_t *a = c->idx + 4 * ib;                                                   \
                __m256i g0 = grid32(GRID, a[0], a[1], a[2], a[3]);                                     \
                __m256i g1 = grid32(GRID, a[4], a[5], a[6], a[7]);                                     \
                s0 = _mm256_add_epi32(s0, SDOT(g0, c->sg[ib], x[b].qs + 32 * ib, chunk_scale(sc, ib))); \
                s1 = _mm256_add_epi32(s1, SDOT(g1, c->sg[ib + 1], x[b].qs + 32 * ib + 32, chunk_scale(sc, ib + 1))); \
            }                                                                                          \
            acc = _mm256_fmadd_ps(_mm256_set1_ps(f16c(w) * x[b].d), _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), acc); \
        }                                                                                              \
        return 0.125f * hsum_ps(acc);                                                                  \
    }
#define VD_IQ2_XS(NAME, ATTR, SDOT, PF) VD_IQ2_CODES(NAME, ATTR, SDOT, 74, xs_codes, mf_grid_iq2xs, 66, PF)
#define VD_IQ2_S(NAME, ATTR, SDOT, PF) VD_IQ2_CODES(NAME, ATTR, SDOT, 82, s_codes, mf_grid_iq2s, 74, PF)

/* IQ2_XXS on AVX2 as ggml's AVX2 kernel forms it: per pair of sub-blocks the 8 grid rows and
 * the 8 sign patterns (mf_ksign_u64) by scalar loads; the vector form (VD_IQ2_XXS: signs
 * computed with shuffles and compares, codes split and stored) kept the shuffle ports busy and
 * ran ~25% slower on Zen 3. The grid rows' byte indexes are loaded from the block as bytes
 * (a load each instead of a shift and a mask), the 7-bit sign indexes taken by BMI1 bextr
 * where the CPU has it (one op instead of two): one thread from L2 on Zen 3, 22.6 -> 18.7 ns a
 * block (shifts and masks for the signs: 20.3). The same int32 lanes and float steps as
 * VD_IQ2_XXS: the same bits. */
#define BMI1 __attribute__((target("avx2,fma,f16c,bmi")))
#define SIDX_BEXTR(a, k) _bextr_u32((a), 7 * (k), 7)
#define SIDX_SHIFT(a, k) (((a) >> (7 * (k))) & 127)
#define VD_IQ2_XXS_LOADS(NAME, ATTR, SIDX)                                                             \
    ATTR float NAME(const uint8_t *w, const void *xv, int64_t nb) {                                    \
        const mf_q8_256 *x = xv;                                                                       \
        const uint64_t *S = mf_ksign_u64;                                                              \
        __m256 acc = _mm256_setzero_ps();                                                              \
        for (int64_t b = 0; b < nb; b++, w += 66) {                                                    \
            __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();                          \
            for (int ib = 0; ib < 8; ib += 2) {                                                        \
                const uint8_t *q = w + 2 + 8 * ib; /* 4 grid bytes, u32 signs | ls << 28, twice */     \
                const uint32_t a1 = rd32(q + 4), a3 = rd32(q + 12);                                    \
                const __m256i g0 = grid32(mf_grid_iq2xxs, q[0], q[1], q[2], q[3]);                     \
                const __m256i g1 = grid32(mf_grid_iq2xxs, q[8], q[9], q[10], q[11]);                   \
                const __m256i z0 = _mm256_set_epi64x((long long)S[SIDX(a1, 3)], (long long)S[SIDX(a1, 2)], \
                                                     (long long)S[SIDX(a1, 1)], (long long)S[a1 & 127]); \
                const __m256i z1 = _mm256_set_epi64x((long long)S[SIDX(a3, 3)], (long long)S[SIDX(a3, 2)], \
                                                     (long long)S[SIDX(a3, 1)], (long long)S[a3 & 127]); \
                const __m256i y0 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(x[b].qs + 32 * ib)), z0); \
                const __m256i y1 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(x[b].qs + 32 * ib + 32)), z1); \
                s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(g0, y0), _mm256_set1_epi16((short)(2 * (a1 >> 28) + 1)))); \
                s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(g1, y1), _mm256_set1_epi16((short)(2 * (a3 >> 28) + 1)))); \
            }                                                                                          \
            acc = _mm256_fmadd_ps(_mm256_set1_ps(f16c(w) * x[b].d), _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), acc); \
        }                                                                                              \
        return 0.125f * hsum_ps(acc);                                                                  \
    }
VD_IQ2_XXS_LOADS(vd_iq2_xxs_bmi1, BMI1, SIDX_BEXTR)
VD_IQ2_XXS_LOADS(vd_iq2_xxs_shift, AVX2, SIDX_SHIFT)
AVX2 float mf_vd_iq2_xxs_avx2(const uint8_t *w, const void *xv, int64_t nb) {
    return mf_has_bmi1 ? vd_iq2_xxs_bmi1(w, xv, nb) : vd_iq2_xxs_shift(w, xv, nb);
}
VD_IQ2_XS(mf_vd_iq2_xs_avx2, AVX2, sdot32, 0)
VD_IQ2_S(mf_vd_iq2_s_avx2, AVX2, sdot32, 0)

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
    iq2xxs_codes c;
    o->d = o->dc = f16c(w) * 0.125f;
    xxs_codes(w, &c);
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *i = (const uint8_t *)&c.gi[ib];
        kblk32(grid32(mf_grid_iq2xxs, i[0], i[1], i[2], i[3]), c.sg[ib], o->q + 32 * ib);
        kblk_scales(o, ib, c.ls[ib], c.ls[ib]);
    }
}

AVX2 static inline void up_codes(const iq2_codes *c, const int8_t *grid, const uint8_t *sc, mf_kblk *o) {
    for (int ib = 0; ib < 8; ib++) {
        const uint16_t *a = c->idx + 4 * ib;
        kblk32(grid32(grid, a[0], a[1], a[2], a[3]), c->sg[ib], o->q + 32 * ib);
        kblk_scales(o, ib, 2 * (sc[ib] & 0xF) + 1, 2 * (sc[ib] >> 4) + 1);
    }
}

AVX2 void mf_up_iq2_xs(const uint8_t *w, mf_kblk *o) {
    iq2_codes c;
    o->d = o->dc = f16c(w) * 0.125f;
    xs_codes(w, &c);
    up_codes(&c, mf_grid_iq2xs, w + 66, o);
}

AVX2 void mf_up_iq2_s(const uint8_t *w, mf_kblk *o) {
    iq2_codes c;
    o->d = o->dc = f16c(w) * 0.125f;
    s_codes(w, &c);
    up_codes(&c, mf_grid_iq2s, w + 74, o);
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

/* IQ2_XXS by byte lookups in registers (VBMI, part of this ISA path: pool.c): each grid row as
 * two bytes of 2-bit value codes (mf_iq2xxs_c03/c47, quant_tables.c), looked up for the block's
 * 32 indices by vpermi2b (low 7 bits) and a blend on bit 7; per 64 values one byte permute
 * places each row's two code bytes in its qword, vpmultishiftqb takes value k's code to byte k
 * and vpshufb turns codes into 8/25/43. Signs as a 64-bit mask (negate y where set), the
 * sub-block scales by vpdpwssd: the block's exact int32 sums in 16 lanes, folded to the AVX2
 * kernel's 8 (the same bits as it: tests/test_quant_iq2.py), one FMA per block. */
#define VBMI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx512dq,avx2,fma,f16c")))
#define IQ2_SEL1(j, i) 8 * (j) + (i), 64 + 8 * (j) + (i), 0, 0, 0, 0, 0, 0
#define IQ2_SEL(j) {IQ2_SEL1(j, 0), IQ2_SEL1(j, 1), IQ2_SEL1(j, 2), IQ2_SEL1(j, 3), IQ2_SEL1(j, 4), IQ2_SEL1(j, 5), IQ2_SEL1(j, 6), IQ2_SEL1(j, 7)}
static _Alignas(64) const uint8_t iq2_sel[4][64] = {IQ2_SEL(0), IQ2_SEL(1), IQ2_SEL(2), IQ2_SEL(3)};

VBMI float mf_vd_iq2_xxs_avx512(const uint8_t *w, const void *xv, int64_t nb) {
    const mf_q8_256 *x = xv;
    __m256 acc = _mm256_setzero_ps();
    __m512i t03[4], t47[4], sel[4];
    for (int k = 0; k < 4; k++) {
        t03[k] = _mm512_load_si512((const void *)(mf_iq2xxs_c03 + 64 * k));
        t47[k] = _mm512_load_si512((const void *)(mf_iq2xxs_c47 + 64 * k));
        sel[k] = _mm512_load_si512((const void *)iq2_sel[k]);
    }
    const __m512i csh = _mm512_set1_epi64(0x0E0C0A0806040200LL), m3 = _mm512_set1_epi8(3);
    const __m512i vals = _mm512_broadcast_i32x4(_mm_setr_epi8(8, 25, 43, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0));
    const __m512i ks0 = _mm512_loadu_si512((const void *)mf_ksigns_iq2xs), ks1 = _mm512_loadu_si512((const void *)(mf_ksigns_iq2xs + 64));
    const int64_t pfd = mf_tune.pf_dist;
    for (int64_t b = 0; b < nb; b++, w += 66) {
        MF_PF_STEP(w, pfd, 66);
        __m256i gi, a; /* index bytes; u32 signs | ls << 28 */
        xxs_split(w, &gi, &a);
        const __m512i s8 = _mm512_castsi256_si512(_mm256_add_epi32(_mm256_slli_epi32(_mm256_srli_epi32(a, 28), 1), _mm256_set1_epi32(1)));
        _Alignas(32) uint64_t sgs[4];
        _mm256_store_si256((__m256i *)sgs, iq_signs4x7_vbmi(a, ks0, ks1));
        const __m512i q = _mm512_castsi256_si512(gi); /* bytes 32..63 unused */
        const __mmask64 b7 = _mm512_movepi8_mask(q);
        const __m512i v03 = _mm512_mask_blend_epi8(b7, _mm512_permutex2var_epi8(t03[0], q, t03[1]), _mm512_permutex2var_epi8(t03[2], q, t03[3]));
        const __m512i v47 = _mm512_mask_blend_epi8(b7, _mm512_permutex2var_epi8(t47[0], q, t47[1]), _mm512_permutex2var_epi8(t47[2], q, t47[3]));
        __m512i sumi = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            const __m512i c = _mm512_and_si512(_mm512_multishift_epi64_epi8(csh, _mm512_permutex2var_epi8(v03, sel[j], v47)), m3);
            const __m512i g = _mm512_shuffle_epi8(vals, c);
            __m512i y = _mm512_loadu_si512((const void *)(x[b].qs + 64 * j));
            y = _mm512_mask_sub_epi8(y, (__mmask64)sgs[j], _mm512_setzero_si512(), y);
            sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(g, y), iq_pair_scales(s8, j));
        }
        /* lane L + lane 8 + L: the AVX2 kernel's 8 int32 lanes (s0 + s1), so its float steps and bits */
        const __m256i s = _mm256_add_epi32(_mm512_castsi512_si256(sumi), _mm512_extracti64x4_epi64(sumi, 1));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16c(w) * x[b].d), _mm256_cvtepi32_ps(s), acc);
    }
    return 0.125f * hsum_ps(acc);
}
VD_IQ2_XS(mf_vd_iq2_xs_avx512, VNNI, sdot32m, 1)
VD_IQ2_S(mf_vd_iq2_s_avx512, VNNI, sdot32m, 1)
