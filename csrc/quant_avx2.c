/* AVX2+FMA+F16C kernels: activation quantizers and integer vec-dots (maddubs/madd), one per
 * weight type. Weights stay unsigned where possible (q in 0..2^k-1) so maddubs(q, x8) applies
 * directly; the offset (e.g. -8 for Q4_0) is folded in with the precomputed sum of x. */
#include "quant_common.h"
#include "simd_x86.h"

#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <string.h>

#define AVX2 __attribute__((target("avx2,fma,f16c")))

/* 16 bytes of nibbles -> 32 bytes: low nibbles (elements 0..15), then high (16..31) */
AVX2 static inline __m256i nibbles32(const uint8_t *p) {
    __m128i t = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0xF));
}
/* 32 bits -> 32 bytes, 0xFF where the bit is set */
AVX2 static inline __m256i bits32(const uint8_t *p) {
    uint32_t x;
    memcpy(&x, p, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                           0x0101010101010101, 0x0000000000000000);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), shuf);
    b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1));
}
/* signed x signed bytes -> 16 int32 pair sums via |a| * sign(b, a) */
AVX2 static inline __m256i dot_ss(__m256i a, __m256i b) {
    return _mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
}
AVX2 static inline __m256i lane_scales(int a, int b) {
    return _mm256_set_m128i(_mm_set1_epi16((short)b), _mm_set1_epi16((short)a));
}
AVX2 static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* ---------------- activation quantizers ---------------- */

AVX2 static inline __m256i q8_round(__m256 v, __m256 id) {
    return _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
/* 32 floats -> 32 int8 (in element order) with scale id; returns the int8 vector */
AVX2 static inline __m256i q8_pack32(const float *x, __m256 id) {
    __m256i i0 = q8_round(_mm256_loadu_ps(x), id), i1 = q8_round(_mm256_loadu_ps(x + 8), id);
    __m256i i2 = q8_round(_mm256_loadu_ps(x + 16), id), i3 = q8_round(_mm256_loadu_ps(x + 24), id);
    __m256i p01 = _mm256_packs_epi32(i0, i1), p23 = _mm256_packs_epi32(i2, i3);
    __m256i p = _mm256_packs_epi16(p01, p23);
    return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
AVX2 static inline float amax32(const float *x) {
    const __m256 sgn = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_andnot_ps(sgn, _mm256_loadu_ps(x));
    for (int k = 8; k < 32; k += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sgn, _mm256_loadu_ps(x + k)));
    return hmax_ps(m);
}
AVX2 static inline int sum_i8(__m256i q) {
    __m256i s16 = _mm256_maddubs_epi16(_mm256_set1_epi8(1), q);
    return hsum_i32(_mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
}

AVX2 void mf_quantize_q8_32_avx2(const float *x, mf_q8_32 *y, int64_t n) {
    for (int64_t b = 0; b < n / 32; b++, x += 32) {
        /* as ggml's Q8_0/Q8_1: q from the f32 scale, the stored scale rounded to f16 */
        float amax = amax32(x), d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        __m256i q = q8_pack32(x, _mm256_set1_ps(id));
        _mm256_storeu_si256((__m256i *)y[b].qs, q);
        y[b].d = _cvtsh_ss(_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT));
        y[b].s = y[b].d * (float)sum_i8(q);
    }
}

AVX2 void mf_quantize_q8_256_avx2(const float *x, mf_q8_256 *y, int64_t n) {
    for (int64_t b = 0; b < n / 256; b++, x += 256) {
        float amax = 0;
        for (int k = 0; k < 256; k += 32) { float a = amax32(x + k); amax = a > amax ? a : amax; }
        /* as ggml's Q8_K: iscale = 127/amax, d = 1/iscale (f32) */
        float id = amax != 0.0f ? 127.0f / amax : 0.0f, d = amax != 0.0f ? 1.0f / id : 0.0f;
        __m256 idv = _mm256_set1_ps(id);
        for (int k = 0; k < 8; k++) {
            __m256i q = q8_pack32(x + 32 * k, idv);
            _mm256_storeu_si256((__m256i *)(y[b].qs + 32 * k), q);
            /* two sums of 16 */
            __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));
            __m128i lo = _mm256_castsi256_si128(s), hi = _mm256_extracti128_si256(s, 1);
            lo = _mm_add_epi32(lo, _mm_shuffle_epi32(lo, 0x4e)); lo = _mm_add_epi32(lo, _mm_shuffle_epi32(lo, 0xb1));
            hi = _mm_add_epi32(hi, _mm_shuffle_epi32(hi, 0x4e)); hi = _mm_add_epi32(hi, _mm_shuffle_epi32(hi, 0xb1));
            y[b].bsums[2 * k] = (int16_t)_mm_cvtsi128_si32(lo);
            y[b].bsums[2 * k + 1] = (int16_t)_mm_cvtsi128_si32(hi);
        }
        y[b].d = d;
    }
}

/* ---------------- 32-element block types x Q8_32 ---------------- */

AVX2 static float vd_q4_0(const uint8_t *w, const void *xv, int64_t nb) {
    const mf_q8_32 *x = xv;
    __m256 acc = _mm256_setzero_ps();
    float corr = 0;
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t pfd = mf_tune.pf_dist;
    for (int64_t b = 0; b < nb; b++, w += 18) {
        MF_PF_STEP(w, pfd, 18);
        float d = f16(w);
        __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(nibbles32(w + 2), _mm256_loadu_si256((const __m256i *)x[b].qs)), ones);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d * x[b].d), _mm256_cvtepi32_ps(p), acc);
        corr += d * x[b].s;
    }
    return hsum_ps(acc) - 8.0f * corr;
}
AVX2 static float vd_q4_1(const uint8_t *w, const void *xv, int64_t nb) {
    const mf_q8_32 *x = xv;
    __m256 acc = _mm256_setzero_ps();
    float corr = 0;
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t pfd = mf_tune.pf_dist;
    for (int64_t b = 0; b < nb; b++, w += 20) {
        MF_PF_STEP(w, pfd, 20);
        float d = f16(w), m = f16(w + 2);
        __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(nibbles32(w + 4), _mm256_loadu_si256((const __m256i *)x[b].qs)), ones);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d * x[b].d), _mm256_cvtepi32_ps(p), acc);
        corr += m * x[b].s;
    }
    return hsum_ps(acc) + corr;
}
AVX2 static float vd_q5_0(const uint8_t *w, const void *xv, int64_t nb) {
    const mf_q8_32 *x = xv;
    __m256 acc = _mm256_setzero_ps();
    float corr = 0;
    const __m256i ones = _mm256_set1_epi16(1), b4 = _mm256_set1_epi8(0x10);
    const int64_t pfd = mf_tune.pf_dist;
    for (int64_t b = 0; b < nb; b++, w += 22) {
        MF_PF_STEP(w, pfd, 22);
        float d = f16(w);
        __m256i q = _mm256_or_si256(nibbles32(w + 6), _mm256_and_si256(bits32(w + 2), b4));
        __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)x[b].qs)), ones);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d * x[b].d), _mm256_cvtepi32_ps(p), acc);
        corr += d * x[b].s;
    }
    return hsum_ps(acc) - 16.0f * corr;
}
AVX2 static float vd_q5_1(const uint8_t *w, const void *xv, int64_t nb) {
    const mf_q8_32 *x = xv;
    __m256 acc = _mm256_setzero_ps();
    float corr = 0;
    const __m256i ones = _mm256_set1_epi16(1), b4 = _mm256_set1_epi8(0x10);
    const int64_t pfd = mf_tune.pf_dist;
    for (int64_t b = 0; b < nb; b++, w += 24) {
        MF_PF_STEP(w, pfd, 24);
        float d = f16(w), m = f16(w + 2);
        __m256i q = _mm256_or_si256(nibbles32(w + 8), _mm256_and_si256(bits32(w + 4), b4));
        __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)x[b].qs)), ones);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d * x[b].d), _mm256_cvtepi32_ps(p), acc);
        corr += m * x[b].s;
    }
    return hsum_ps(acc) + corr;
}
AVX2 static float vd_q8_0(const uint8_t *w, const void *xv, int64_t nb) {
    const mf_q8_32 *x = xv;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t pfd = mf_tune.pf_dist;
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2, w += 68) {
        MF_PF_STEP(w, pfd, 68);
        __m256i p0 = _mm256_madd_epi16(dot_ss(_mm256_loadu_si256((const __m256i *)(w + 2)), _mm256_loadu_si256((const __m256i *)x[b].qs)), ones);
        __m256i p1 = _mm256_madd_epi16(dot_ss(_mm256_loadu_si256((const __m256i *)(w + 36)), _mm256_loadu_si256((const __m256i *)x[b + 1].qs)), ones);
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(f16(w) * x[b].d), _mm256_cvtepi32_ps(p0), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(f16(w + 34) * x[b + 1].d), _mm256_cvtepi32_ps(p1), acc1);
    }
    for (; b < nb; b++, w += 34) {
        __m256i p0 = _mm256_madd_epi16(dot_ss(_mm256_loadu_si256((const __m256i *)(w + 2)), _mm256_loadu_si256((const __m256i *)x[b].qs)), ones);
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(f16(w) * x[b].d), _mm256_cvtepi32_ps(p0), acc0);
    }
    return hsum_ps(_mm256_add_ps(acc0, acc1));
}
AVX2 static float vd_iq4_nl(const uint8_t *w, const void *xv, int64_t nb) {
    const mf_q8_32 *x = xv;
    __m256 acc = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i kv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)mf_kvalues_iq4nl));
    const int64_t pfd = mf_tune.pf_dist;
    for (int64_t b = 0; b < nb; b++, w += 18) {
        MF_PF_STEP(w, pfd, 18);
        __m256i q = _mm256_shuffle_epi8(kv, nibbles32(w + 2));
        __m256i p = _mm256_madd_epi16(dot_ss(q, _mm256_loadu_si256((const __m256i *)x[b].qs)), ones);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(w) * x[b].d), _mm256_cvtepi32_ps(p), acc);
    }
    return hsum_ps(acc);
}

/* Q4_K/Q5_K 12-byte scales -> sc[0..7] in bytes 0..7, mins in bytes 8..15 (ggml's packing) */
static inline void k4_scales(const uint8_t *q, uint32_t u[4]) {
    memcpy(u, q, 12);
    const uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
    u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
    uint32_t mins_lo = u[1] & k1;
    u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    u[2] = mins_lo;
    u[0] &= k1;
}
/* mins[j] * bsums[i] for i = 2j, 2j+1 summed in pairs: 8 int32 lanes, lane j = mins[j] * (bsums[2j] +
 * bsums[2j+1]) (mins = bytes 8..15 of u, each byte doubled then widened; one madd, no hadd) */
AVX2 static inline __m256i k4_mins(const uint32_t u[4], const int16_t *bsums) {
    const __m128i m8 = _mm_cvtsi64_si128((int64_t)((uint64_t)u[3] << 32 | u[2]));
    return _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8)), _mm256_loadu_si256((const __m256i *)bsums));
}
/* The 8 scales (bytes 0..7 of u) as 16-bit values in both lanes: scale j broadcast by one vpshufb. */
AVX2 static inline __m256i k4_sc16(uint32_t u0, uint32_t u1) {
    return _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((int64_t)((uint64_t)u1 << 32 | u0))));
}
#define K4_SHUF(j) _mm256_set1_epi16((short)(((2 * (j) + 1) << 8) | (2 * (j))))

/* ---------------- K-quants x Q8_256 ---------------- */

/* Q4_K (and Q5_K below): sumi lanes times d*dx and the mins' 8 lanes (k4_mins) times dmin*dx, each
 * into its own float accumulator, reduced once at the end (no horizontal sum per block); the
 * scales broadcast by vpshufb and d, dmin convert in one vcvtph2ps. */
/* Q4_K/Q5_K block end: sumi x d*dx into acc, the mins' lanes mm x dmin*dx into accm (d, dmin:
 * the block's first 4 bytes, converted in one vcvtph2ps) */
AVX2 static inline void k4_acc(const uint8_t *w, float dx, __m256i sumi, __m256i mm, __m256 *acc, __m256 *accm) {
    int32_t h;
    memcpy(&h, w, 4);
    const __m128 dm = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(h)), _mm_set1_ps(dx)); /* d*dx, dmin*dx */
    *acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(dm), _mm256_cvtepi32_ps(sumi), *acc);
    *accm = _mm256_fmadd_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dm)), _mm256_cvtepi32_ps(mm), *accm);
}
AVX2 static inline void q4_k_step(const uint8_t *w, const mf_q8_256 *x, __m256 *acc, __m256 *accm) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    uint32_t u[4];
    k4_scales(w + 4, u);
    const __m256i mm = k4_mins(u, x->bsums);
    const __m256i sc = k4_sc16(u[0], u[1]);
    const uint8_t *qs = w + 16;
    const int8_t *y = x->qs;
    __m256i sumi = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
        __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        __m256i p0 = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(y + 64 * j)));
        __m256i p1 = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(y + 64 * j + 32)));
        p0 = _mm256_madd_epi16(p0, _mm256_shuffle_epi8(sc, K4_SHUF(2 * j)));
        p1 = _mm256_madd_epi16(p1, _mm256_shuffle_epi8(sc, K4_SHUF(2 * j + 1)));
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
    }
    k4_acc(w, x->d, sumi, mm, acc, accm);
}
AVX2 static float vd_q4_k(const uint8_t *w, const void *xv, int64_t nb) {
    const mf_q8_256 *x = xv;
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    const int64_t pfd = mf_tune.pf_dist;
    for (int64_t b = 0; b < nb; b++, w += 144) {
        MF_PF_STEP(w, pfd, 144);
        q4_k_step(w, x + b, &acc, &accm);
    }
    return hsum_ps(acc) - hsum_ps(accm);
}
/* bit k of every byte of v moved to bit t (k, t < 8) by one 16-bit shift, for the K-quants' high
 * bits (Q5_K: t 4, Q3_K: t 2) instead of a mask, compare and mask: what a left shift carries
 * into the next byte lands below bit t - k <= t, what a right shift carries in lands at or
 * above bit 8 - (k - t) > t, so bit t of each byte is its own bit k (callers mask the rest) */
AVX2 static inline __m256i bit_to(__m256i v, int k, int t) {
    return k < t ? _mm256_slli_epi16(v, t - k) : _mm256_srli_epi16(v, k - t);
}
AVX2 static float vd_q5_k(const uint8_t *w, const void *xv, int64_t nb) {
    const mf_q8_256 *x = xv;
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0xF), b4 = _mm256_set1_epi8(0x10);
    const int64_t pfd = mf_tune.pf_dist;
    for (int64_t b = 0; b < nb; b++, w += 176) {
        MF_PF_STEP(w, pfd, 176);
        uint32_t u[4];
        k4_scales(w + 4, u);
        const __m256i mm = k4_mins(u, x[b].bsums);
        const __m256i sc = k4_sc16(u[0], u[1]);
        const uint8_t *qs = w + 48;
        __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 16));
        const int8_t *y = x[b].qs;
        __m256i sumi = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i hlo = _mm256_and_si256(bit_to(qh, 2 * j, 4), b4), hhi = _mm256_and_si256(bit_to(qh, 2 * j + 1, 4), b4);
            __m256i lo = _mm256_or_si256(_mm256_and_si256(q, m4), hlo);
            __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4), hhi);
            __m256i p0 = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(y + 64 * j)));
            __m256i p1 = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(y + 64 * j + 32)));
            p0 = _mm256_madd_epi16(p0, _mm256_shuffle_epi8(sc, K4_SHUF(2 * j)));
            p1 = _mm256_madd_epi16(p1, _mm256_shuffle_epi8(sc, K4_SHUF(2 * j + 1)));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
        }
        k4_acc(w, x[b].d, sumi, mm, &acc, &accm);
    }
    return hsum_ps(acc) - hsum_ps(accm);
}
/* Q6_K: the 16 scales widened once per block and picked per 32 values by vpshufb (two scalar
 * broadcasts and an insert each cost 24 shuffle-port ops a block); the high 2 bits moved to
 * bits 4-5 by 3 shifts of qh per half instead of 7 (16-bit shifts, the bits that cross into
 * the neighbouring byte masked off). The same integers: the same bits as before. */
AVX2 static inline __m256i q6_pick(int k) {
    return _mm256_set_m128i(_mm_set1_epi16((short)(((4 * k + 3) << 8) | (4 * k + 2))),
                            _mm_set1_epi16((short)(((4 * k + 1) << 8) | (4 * k))));
}
AVX2 static inline void q6_k_step(const uint8_t *w, const mf_q8_256 *x, __m256 *acc) {
    const __m256i m4 = _mm256_set1_epi8(0xF), m30 = _mm256_set1_epi8(0x30);
    const __m256i k0 = q6_pick(0), k1 = q6_pick(1), k2 = q6_pick(2), k3 = q6_pick(3);
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 192)));
    const __m256i cv = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)x->bsums));
    __m256i sumi = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = w + 64 * h, *qhp = w + 128 + 32 * h;
        const int8_t *y = x->qs + 128 * h;
        const __m256i sd = h ? _mm256_permute2x128_si256(sc16, sc16, 0x11) : _mm256_permute2x128_si256(sc16, sc16, 0x00);
        __m256i a = _mm256_loadu_si256((const __m256i *)ql), c = _mm256_loadu_si256((const __m256i *)(ql + 32));
        __m256i qh = _mm256_loadu_si256((const __m256i *)qhp);
        __m256i v0 = _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
        __m256i v1 = _mm256_or_si256(_mm256_and_si256(c, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
        __m256i v2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4), _mm256_and_si256(qh, m30));
        __m256i v3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), m4), _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
        __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(v0, _mm256_loadu_si256((const __m256i *)y)), _mm256_shuffle_epi8(sd, k0));
        __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(v1, _mm256_loadu_si256((const __m256i *)(y + 32))), _mm256_shuffle_epi8(sd, k1));
        __m256i p2 = _mm256_madd_epi16(_mm256_maddubs_epi16(v2, _mm256_loadu_si256((const __m256i *)(y + 64))), _mm256_shuffle_epi8(sd, k2));
        __m256i p3 = _mm256_madd_epi16(_mm256_maddubs_epi16(v3, _mm256_loadu_si256((const __m256i *)(y + 96))), _mm256_shuffle_epi8(sd, k3));
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(_mm256_add_epi32(p0, p1), _mm256_add_epi32(p2, p3)));
    }
    /* the -32 offset's correction (32 x scales . bsums) stays in the 8 lanes it was made in */
    const __m256i tot = _mm256_sub_epi32(sumi, _mm256_slli_epi32(cv, 5));
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(w + 208) * x->d), _mm256_cvtepi32_ps(tot), *acc);
}
AVX2 static float vd_q6_k(const uint8_t *w, const void *xv, int64_t nb) {
    const mf_q8_256 *x = xv;
    __m256 acc = _mm256_setzero_ps();
    const int64_t pfd = mf_tune.pf_dist;
    for (int64_t b = 0; b < nb; b++, w += 210) {
        MF_PF_STEP(w, pfd, 210);
        q6_k_step(w, x + b, &acc);
    }
    return hsum_ps(acc);
}
/* hsum_ps of 4 vectors at once, each lane in hsum_ps's order ((s0 + s2) + (s1 + s3), s = low +
 * high half): the 4-row kernels' rows get the 1-row kernels' bits */
AVX2 static inline __m128 hsum4_exact(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m128 s0 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 s1 = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
    __m128 s2 = _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));
    __m128 s3 = _mm_add_ps(_mm256_castps256_ps128(d), _mm256_extractf128_ps(d, 1));
    _MM_TRANSPOSE4_PS(s0, s1, s2, s3); /* s_j: lane j of each row */
    return _mm_add_ps(_mm_add_ps(s0, s2), _mm_add_ps(s1, s3));
}
/* 4 rows (rb bytes apart) in one call, one after another, each exactly as vd_q4_k / vd_q6_k
 * reads and sums it (the same bits, the same prefetch, the same memory order as four 1-row
 * calls), with one call and one 4-row reduction for the 4: the experts' 768-column rows are 3
 * blocks, where per-row overhead was a third of the 1-row kernel's time in L2 (tools/vd-harness.sh).
 * Interleaving the 4 rows block by block was faster in L2 but 30-40% slower from DRAM (Zen 3:
 * the 4 short streams a few hundred bytes apart defeat the prefetchers). */
#define VD4_SEQ(NAME, STEP, BYTES, MINS)                                                          \
    AVX2 static void NAME(const uint8_t *w, size_t rb, const void *xv, int64_t nb, float *out) {  \
        const mf_q8_256 *x = xv;                                                                  \
        __m256 a[4], m[4];                                                                        \
        const int64_t pfd = mf_tune.pf_dist;                                                      \
        for (int r = 0; r < 4; r++) {                                                             \
            __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();                         \
            const uint8_t *wr = w + r * rb;                                                       \
            for (int64_t b = 0; b < nb; b++, wr += BYTES) {                                       \
                MF_PF_STEP(wr, pfd, BYTES);                                                       \
                STEP;                                                                             \
            }                                                                                     \
            a[r] = acc, m[r] = accm;                                                              \
        }                                                                                         \
        __m128 s = hsum4_exact(a[0], a[1], a[2], a[3]);                                           \
        if (MINS) s = _mm_sub_ps(s, hsum4_exact(m[0], m[1], m[2], m[3]));                         \
        _mm_storeu_ps(out, s);                                                                    \
    }
VD4_SEQ(vd4_q4_k, q4_k_step(wr, x + b, &acc, &accm), 144, 1)
VD4_SEQ(vd4_q6_k, q6_k_step(wr, x + b, &acc), 210, 0)

/* Q3_K / Q2_K: 2-bit fields at shift 2s of qs[32c + l] for element 128c + 32s + l. The 16
 * scales decoded with vector ops, widened once and picked per 32 values by vpshufb (q6_pick),
 * the corrections (scales . bsums) by one vpmaddwd: the scalar decode and two scalar broadcasts
 * per 32 values held these kernels at 7-9 GB/s from L3 on Zen 3. The same integers as ggml's
 * decode (the same bits as the scalar form before). */
/* Q3_K's 12 scale bytes -> the 16 6-bit scales - 32 as int8 (ggml's kmask1/kmask2 unpacking:
 * bytes 0-3 low nibbles of s[0..3] | bits 0-1 of s[8..11], 4-7 of s[4..7] | bits 2-3, 8-11 high
 * nibbles of s[0..3] | bits 4-5, 12-15 of s[4..7] | bits 6-7) */
AVX2 static inline __m128i q3_scales(const uint8_t *s) {
    uint64_t lo8;
    uint32_t hi4;
    memcpy(&lo8, s, 8);
    memcpy(&hi4, s + 8, 4);
    const __m128i v = _mm_insert_epi32(_mm_cvtsi64_si128((long long)lo8), (int)hi4, 2);
    const __m128i a = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(v, 0x44), _mm_setr_epi32(0, 0, 4, 4)), _mm_set1_epi8(0xF));
    const __m128i t = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(v, 0xAA), _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
    return _mm_sub_epi8(_mm_or_si128(a, _mm_slli_epi32(t, 4)), _mm_set1_epi8(32));
}
AVX2 static float vd_q3_k(const uint8_t *w, const void *xv, int64_t nb) {
    const mf_q8_256 *x = xv;
    __m256 acc = _mm256_setzero_ps();
    const __m256i m2 = _mm256_set1_epi8(3), b2 = _mm256_set1_epi8(4);
    const __m256i pk[4] = {q6_pick(0), q6_pick(1), q6_pick(2), q6_pick(3)};
    const int64_t pfd = mf_tune.pf_dist;
    for (int64_t b = 0; b < nb; b++, w += 110) {
        MF_PF_STEP(w, pfd, 110);
        const __m256i sc16 = _mm256_cvtepi8_epi16(q3_scales(w + 96));
        const __m256i cv = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)x[b].bsums));
        __m256i hm = _mm256_loadu_si256((const __m256i *)w);
        __m256i sumi = _mm256_setzero_si256();
        for (int c = 0; c < 2; c++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(w + 32 + 32 * c));
            const __m256i sd = c ? _mm256_permute2x128_si256(sc16, sc16, 0x11) : _mm256_permute2x128_si256(sc16, sc16, 0x00);
            for (int s = 0; s < 4; s++) {
                int k = 4 * c + s;
                __m256i h = _mm256_and_si256(bit_to(hm, k, 2), b2);
                __m256i v = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2 * s), m2), h);
                __m256i p = _mm256_maddubs_epi16(v, _mm256_loadu_si256((const __m256i *)(x[b].qs + 32 * k)));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, _mm256_shuffle_epi8(sd, pk[s])));
            }
        }
        /* the -4 offset's correction (4 x scales . bsums) stays in its 8 lanes, as Q6_K's */
        __m256i tot = _mm256_sub_epi32(sumi, _mm256_slli_epi32(cv, 2));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(w + 108) * x[b].d), _mm256_cvtepi32_ps(tot), acc);
    }
    return hsum_ps(acc);
}
AVX2 static float vd_q2_k(const uint8_t *w, const void *xv, int64_t nb) {
    const mf_q8_256 *x = xv;
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    const __m256i m2 = _mm256_set1_epi8(3);
    const __m128i m4 = _mm_set1_epi8(0xF);
    const __m256i pk[4] = {q6_pick(0), q6_pick(1), q6_pick(2), q6_pick(3)};
    const int64_t pfd = mf_tune.pf_dist;
    for (int64_t b = 0; b < nb; b++, w += 84) {
        MF_PF_STEP(w, pfd, 84);
        const __m128i s8 = _mm_loadu_si128((const __m128i *)w);
        const __m256i sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(s8, m4));
        const __m256i mn16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s8, 4), m4));
        const __m256i mm = _mm256_madd_epi16(mn16, _mm256_loadu_si256((const __m256i *)x[b].bsums));
        __m256i sumi = _mm256_setzero_si256();
        for (int c = 0; c < 2; c++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * c));
            const __m256i sd = c ? _mm256_permute2x128_si256(sc16, sc16, 0x11) : _mm256_permute2x128_si256(sc16, sc16, 0x00);
            for (int s = 0; s < 4; s++) {
                int k = 4 * c + s;
                __m256i v = _mm256_and_si256(_mm256_srli_epi16(q, 2 * s), m2);
                __m256i p = _mm256_maddubs_epi16(v, _mm256_loadu_si256((const __m256i *)(x[b].qs + 32 * k)));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, _mm256_shuffle_epi8(sd, pk[s])));
            }
        }
        float dx = x[b].d;
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(w + 80) * dx), _mm256_cvtepi32_ps(sumi), acc);
        accm = _mm256_fmadd_ps(_mm256_set1_ps(f16(w + 82) * dx), _mm256_cvtepi32_ps(mm), accm);
    }
    return hsum_ps(acc) - hsum_ps(accm);
}
AVX2 static float vd_iq4_xs(const uint8_t *w, const void *xv, int64_t nb) {
    const mf_q8_256 *x = xv;
    __m256 acc = _mm256_setzero_ps();
    const __m256i kv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)mf_kvalues_iq4nl));
    const int64_t pfd = mf_tune.pf_dist;
    for (int64_t b = 0; b < nb; b++, w += 136) {
        MF_PF_STEP(w, pfd, 136);
        uint16_t sh = (uint16_t)(w[2] | (w[3] << 8));
        __m256i sumi = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            int ls = (((w[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((sh >> (2 * j)) & 3) << 4)) - 32;
            __m256i q = _mm256_shuffle_epi8(kv, nibbles32(w + 8 + 16 * j));
            __m256i p = dot_ss(q, _mm256_loadu_si256((const __m256i *)(x[b].qs + 32 * j)));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, _mm256_set1_epi16((short)ls)));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(w) * x[b].d), _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum_ps(acc);
}

/* ---------------- float weights x f32 activations ---------------- */

AVX2 static float vd_f32(const uint8_t *wb, const void *xv, int64_t n) {
    const float *w = (const float *)wb, *x = xv;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= n; k += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    for (; k + 8 <= n; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
    float s = hsum_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; k < n; k++) s += w[k] * x[k];
    return s;
}
AVX2 static inline __m256 ld_f16(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
AVX2 static inline __m256 ld_bf16(const uint8_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#define VD_HALF(NAME, LD, SCALAR)                                                                 \
    AVX2 static float NAME(const uint8_t *w, const void *xv, int64_t n) {                        \
        const float *x = xv;                                                                     \
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),     \
               a3 = _mm256_setzero_ps();                                                         \
        int64_t k = 0;                                                                           \
        for (; k + 32 <= n; k += 32) {                                                           \
            a0 = _mm256_fmadd_ps(LD(w + 2 * k), _mm256_loadu_ps(x + k), a0);                     \
            a1 = _mm256_fmadd_ps(LD(w + 2 * k + 16), _mm256_loadu_ps(x + k + 8), a1);            \
            a2 = _mm256_fmadd_ps(LD(w + 2 * k + 32), _mm256_loadu_ps(x + k + 16), a2);           \
            a3 = _mm256_fmadd_ps(LD(w + 2 * k + 48), _mm256_loadu_ps(x + k + 24), a3);           \
        }                                                                                        \
        for (; k + 8 <= n; k += 8) a0 = _mm256_fmadd_ps(LD(w + 2 * k), _mm256_loadu_ps(x + k), a0); \
        float s = hsum_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));          \
        for (; k < n; k++) s += SCALAR(w + 2 * k) * x[k];                                        \
        return s;                                                                                \
    }
static inline float bf16s(const uint8_t *p) {
    uint32_t bits = (uint32_t)(p[0] | (p[1] << 8)) << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
VD_HALF(vd_f16, ld_f16, mf_f16)
VD_HALF(vd_bf16, ld_bf16, bf16s)

mf_vecdot_fn mf_vecdot_avx2[T_MAX] = {
    [T_F32] = vd_f32, [T_F16] = vd_f16, [T_BF16] = vd_bf16,
    [T_Q4_0] = vd_q4_0, [T_Q4_1] = vd_q4_1, [T_Q5_0] = vd_q5_0, [T_Q5_1] = vd_q5_1,
    [T_Q8_0] = vd_q8_0, [T_IQ4_NL] = vd_iq4_nl, [T_Q2_K] = vd_q2_k, [T_Q3_K] = vd_q3_k,
    [T_Q4_K] = vd_q4_k, [T_Q5_K] = vd_q5_k, [T_Q6_K] = vd_q6_k, [T_IQ4_XS] = vd_iq4_xs,
    [T_IQ2_XXS] = mf_vd_iq2_xxs_avx2, [T_IQ2_XS] = mf_vd_iq2_xs_avx2, [T_IQ2_S] = mf_vd_iq2_s_avx2,
    [T_IQ3_XXS] = mf_vd_iq3_xxs_avx2, [T_IQ3_S] = mf_vd_iq3_s_avx2, [T_IQ1_S] = mf_vd_iq1_s_avx2, [T_IQ1_M] = mf_vd_iq1_m_avx2,
    [T_MXFP4] = mf_vd_mxfp4_avx2, [T_NVFP4] = mf_vd_nvfp4_avx2, [T_TQ1_0] = mf_vd_tq1_0_avx2, [T_TQ2_0] = mf_vd_tq2_0_avx2,
};

/* ---------------- prefill: K-quant rows unpacked once, dotted with 4 X rows at a time ------
 * Every K-quant block becomes: unsigned q[256] (0..63), an int16 scale vector per 32-chunk,
 * and a correction cc[16] · bsums(x) (mins or the -32/-4 offsets). Then
 * dot = sum_b dx_b * (d_b * sum_c madd(maddubs(q_c, y_c), sv_c) + dc_b * cc_b · bsums_b). */

/* the 256 codes of a Q4_K block (0..15), in value order */
AVX2 static inline void k4_codes(const uint8_t *w, uint8_t *q) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    for (int j = 0; j < 4; j++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * j));
        _mm256_storeu_si256((__m256i *)(q + 64 * j), _mm256_and_si256(v, m4));
        _mm256_storeu_si256((__m256i *)(q + 64 * j + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
    }
}
/* the 256 codes of a Q6_K block (0..63, before the -32), in value order */
AVX2 static inline void k6_codes(const uint8_t *w, uint8_t *q) {
    const __m256i m4 = _mm256_set1_epi8(0xF), m2 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = w + 64 * h;
        __m256i a = _mm256_loadu_si256((const __m256i *)ql), c = _mm256_loadu_si256((const __m256i *)(ql + 32));
        __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
        uint8_t *p = q + 128 * h;
        _mm256_storeu_si256((__m256i *)p, _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4)));
        _mm256_storeu_si256((__m256i *)(p + 32), _mm256_or_si256(_mm256_and_si256(c, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4)));
        _mm256_storeu_si256((__m256i *)(p + 64), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4)));
        _mm256_storeu_si256((__m256i *)(p + 96), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4)));
    }
}

AVX2 static void up_q4_k(const uint8_t *w, mf_kblk *o) {
    uint32_t u[4];
    k4_scales(w + 4, u);
    const uint8_t *sc = (const uint8_t *)u, *mn = sc + 8;
    o->d = f16(w);
    o->dc = -f16(w + 2);
    for (int i = 0; i < 16; i++) o->cc[i] = mn[i / 2];
    k4_codes(w, o->q);
    for (int c = 0; c < 8; c++) _mm256_storeu_si256((__m256i *)o->sv[c], _mm256_set1_epi16(sc[c]));
}
AVX2 static void up_q5_k(const uint8_t *w, mf_kblk *o) {
    uint32_t u[4];
    k4_scales(w + 4, u);
    const uint8_t *sc = (const uint8_t *)u, *mn = sc + 8;
    o->d = f16(w);
    o->dc = -f16(w + 2);
    for (int i = 0; i < 16; i++) o->cc[i] = mn[i / 2];
    const __m256i m4 = _mm256_set1_epi8(0xF), b4 = _mm256_set1_epi8(0x10);
    __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 16));
    for (int j = 0; j < 4; j++) {
        __m256i q = _mm256_loadu_si256((const __m256i *)(w + 48 + 32 * j));
        __m256i mlo = _mm256_set1_epi8((char)(1 << (2 * j))), mhi = _mm256_set1_epi8((char)(1 << (2 * j + 1)));
        __m256i hlo = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, mlo), mlo), b4);
        __m256i hhi = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, mhi), mhi), b4);
        _mm256_storeu_si256((__m256i *)(o->q + 64 * j), _mm256_or_si256(_mm256_and_si256(q, m4), hlo));
        _mm256_storeu_si256((__m256i *)(o->q + 64 * j + 32), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4), hhi));
    }
    for (int c = 0; c < 8; c++) _mm256_storeu_si256((__m256i *)o->sv[c], _mm256_set1_epi16(sc[c]));
}
AVX2 static void up_q6_k(const uint8_t *w, mf_kblk *o) {
    const int8_t *sc = (const int8_t *)(w + 192);
    o->d = o->dc = f16(w + 208);
    for (int i = 0; i < 16; i++) o->cc[i] = (int16_t)(-32 * sc[i]);
    k6_codes(w, o->q);
    for (int k = 0; k < 8; k++) _mm256_storeu_si256((__m256i *)o->sv[k], lane_scales(sc[2 * k], sc[2 * k + 1]));
}
AVX2 static void up_q3_k(const uint8_t *w, mf_kblk *o) {
    int8_t sc[16];
    for (int i = 0; i < 16; i++) {
        const uint8_t *s = w + 96;
        int lo = (i < 8 ? s[i] : s[i - 8] >> 4) & 0xF, hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        sc[i] = (int8_t)((lo | (hi << 4)) - 32);
    }
    o->d = o->dc = f16(w + 108);
    for (int i = 0; i < 16; i++) o->cc[i] = (int16_t)(-4 * sc[i]);
    const __m256i m2 = _mm256_set1_epi8(3), b2 = _mm256_set1_epi8(4);
    __m256i hm = _mm256_loadu_si256((const __m256i *)w);
    for (int c = 0; c < 2; c++) {
        __m256i q = _mm256_loadu_si256((const __m256i *)(w + 32 + 32 * c));
        for (int s = 0; s < 4; s++) {
            int k = 4 * c + s;
            __m256i mk = _mm256_set1_epi8((char)(1 << k));
            __m256i h = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hm, mk), mk), b2);
            _mm256_storeu_si256((__m256i *)(o->q + 32 * k), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2 * s), m2), h));
            _mm256_storeu_si256((__m256i *)o->sv[k], lane_scales(sc[2 * k], sc[2 * k + 1]));
        }
    }
}
AVX2 static void up_q2_k(const uint8_t *w, mf_kblk *o) {
    const uint8_t *sc = w;
    o->d = f16(w + 80);
    o->dc = -f16(w + 82);
    for (int i = 0; i < 16; i++) o->cc[i] = sc[i] >> 4;
    const __m256i m2 = _mm256_set1_epi8(3);
    for (int c = 0; c < 2; c++) {
        __m256i q = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * c));
        for (int s = 0; s < 4; s++) {
            int k = 4 * c + s;
            _mm256_storeu_si256((__m256i *)(o->q + 32 * k), _mm256_and_si256(_mm256_srli_epi16(q, 2 * s), m2));
            _mm256_storeu_si256((__m256i *)o->sv[k], lane_scales(sc[2 * k] & 0xF, sc[2 * k + 1] & 0xF));
        }
    }
}

/* Q4_K and Q6_K straight into the avx512vnni K-quant GEMM's layout: the bytes that
 * mf_kw_from_kblk makes of up_q4_k / up_q6_k, in one pass (the two passes were ~6% of a MoE
 * prefill, whose small expert groups unpack W for few X rows). */
AVX2 static void kw_q4_k(const uint8_t *w, mf_kw *o) {
    uint32_t u[4];
    k4_scales(w + 4, u);
    const uint8_t *sc = (const uint8_t *)u, *mn = sc + 8;
    const float d = f16(w);
    k4_codes(w, o->q);
    for (int g = 0; g < 16; g++) o->s[g] = g < 8 ? d * (float)(int16_t)sc[g] : 0.0f; /* groups of 32 */
    for (int p = 0; p < 8; p++) o->cc2[p] = p < 4 ? mf_pack16(mn[2 * p], mn[2 * p + 1]) : 0;
    o->dc = -f16(w + 2);
}

AVX2 static void kw_q6_k(const uint8_t *w, mf_kw *o) {
    const int8_t *sc = (const int8_t *)(w + 192);
    const float d = f16(w + 208);
    k6_codes(w, o->q);
    for (int g = 0; g < 16; g++) o->s[g] = d * (float)(int16_t)sc[g]; /* groups of 16 */
    for (int p = 0; p < 8; p++) o->cc2[p] = mf_pack16(-32 * sc[2 * p], -32 * sc[2 * p + 1]);
    o->dc = d;
}

mf_kwunpack_fn mf_kwunpack_avx2[T_MAX] = {[T_Q4_K] = kw_q4_k, [T_Q6_K] = kw_q6_k};

mf_kunpack_fn mf_kunpack_avx2[T_MAX] = {
    [T_Q2_K] = up_q2_k, [T_Q3_K] = up_q3_k, [T_Q4_K] = up_q4_k, [T_Q5_K] = up_q5_k, [T_Q6_K] = up_q6_k,
    [T_IQ2_XXS] = mf_up_iq2_xxs, [T_IQ2_XS] = mf_up_iq2_xs, [T_IQ2_S] = mf_up_iq2_s,
    [T_IQ3_XXS] = mf_up_iq3_xxs, [T_IQ3_S] = mf_up_iq3_s, [T_IQ1_S] = mf_up_iq1_s, [T_IQ1_M] = mf_up_iq1_m,
    [T_TQ1_0] = mf_up_tq1_0_avx2, [T_TQ2_0] = mf_up_tq2_0_avx2,
};

/* unpacked W row (nb blocks) x M prepared X rows (stride xs bytes) -> out[M] */
#define KDOT(M)                                                                                        \
    AVX2 static void kdot##M(const mf_kblk *w, int64_t nb, const uint8_t *xb, size_t xs, float *out) { \
        __m256 acc[M];                                                                                 \
        for (int i = 0; i < M; i++) acc[i] = _mm256_setzero_ps();                                      \
        for (int64_t b = 0; b < nb; b++) {                                                             \
            const mf_kblk *k = w + b;                                                                  \
            const mf_q8_256 *x[M];                                                                     \
            __m256i s[M];                                                                              \
            for (int i = 0; i < M; i++) {                                                              \
                x[i] = (const mf_q8_256 *)(xb + i * xs) + b;                                           \
                s[i] = _mm256_setzero_si256();                                                         \
            }                                                                                          \
            for (int c = 0; c < 8; c++) {                                                              \
                __m256i q = _mm256_loadu_si256((const __m256i *)(k->q + 32 * c));                      \
                __m256i sv = _mm256_loadu_si256((const __m256i *)k->sv[c]);                            \
                for (int i = 0; i < M; i++)                                                            \
                    s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(_mm256_maddubs_epi16(q,            \
                               _mm256_loadu_si256((const __m256i *)(x[i]->qs + 32 * c))), sv));        \
            }                                                                                          \
            __m256i cc = _mm256_loadu_si256((const __m256i *)k->cc);                                   \
            __m256 d = _mm256_set1_ps(k->d), dc = _mm256_set1_ps(k->dc);                               \
            for (int i = 0; i < M; i++) {                                                              \
                __m256i cr = _mm256_madd_epi16(cc, _mm256_loadu_si256((const __m256i *)x[i]->bsums));  \
                __m256 t = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s[i]), _mm256_mul_ps(dc, _mm256_cvtepi32_ps(cr))); \
                acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(x[i]->d), t, acc[i]);                          \
            }                                                                                          \
        }                                                                                              \
        for (int i = 0; i < M; i++) out[i] = hsum_ps(acc[i]);                                          \
    }
KDOT(4)
KDOT(1)

/* two unpacked W rows x 4 X rows -> out0[4], out1[4]: each X block load serves both W rows
 * (per 32 MACs: 0.5 B of loads instead of 0.75) */
AVX2 static void kdot2x4(const mf_kblk *w0, const mf_kblk *w1, int64_t nb, const uint8_t *xb, size_t xs,
                         float *out0, float *out1) {
    __m256 a0[4], a1[4];
    for (int i = 0; i < 4; i++) a0[i] = a1[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const mf_kblk *k0 = w0 + b, *k1 = w1 + b;
        const mf_q8_256 *x[4];
        __m256i s0[4], s1[4];
        for (int i = 0; i < 4; i++) {
            x[i] = (const mf_q8_256 *)(xb + i * xs) + b;
            s0[i] = s1[i] = _mm256_setzero_si256();
        }
        for (int c = 0; c < 8; c++) {
            const __m256i q0 = _mm256_loadu_si256((const __m256i *)(k0->q + 32 * c));
            const __m256i q1 = _mm256_loadu_si256((const __m256i *)(k1->q + 32 * c));
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)k0->sv[c]);
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)k1->sv[c]);
            for (int i = 0; i < 4; i++) {
                const __m256i y = _mm256_loadu_si256((const __m256i *)(x[i]->qs + 32 * c));
                s0[i] = _mm256_add_epi32(s0[i], _mm256_madd_epi16(_mm256_maddubs_epi16(q0, y), v0));
                s1[i] = _mm256_add_epi32(s1[i], _mm256_madd_epi16(_mm256_maddubs_epi16(q1, y), v1));
            }
        }
        const __m256i cc0 = _mm256_loadu_si256((const __m256i *)k0->cc), cc1 = _mm256_loadu_si256((const __m256i *)k1->cc);
        const __m256 d0 = _mm256_set1_ps(k0->d), dc0 = _mm256_set1_ps(k0->dc);
        const __m256 d1 = _mm256_set1_ps(k1->d), dc1 = _mm256_set1_ps(k1->dc);
        for (int i = 0; i < 4; i++) {
            const __m256i bs = _mm256_loadu_si256((const __m256i *)x[i]->bsums);
            const __m256 dx = _mm256_set1_ps(x[i]->d);
            __m256 t0 = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(s0[i]), _mm256_mul_ps(dc0, _mm256_cvtepi32_ps(_mm256_madd_epi16(cc0, bs))));
            __m256 t1 = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(s1[i]), _mm256_mul_ps(dc1, _mm256_cvtepi32_ps(_mm256_madd_epi16(cc1, bs))));
            a0[i] = _mm256_fmadd_ps(dx, t0, a0[i]);
            a1[i] = _mm256_fmadd_ps(dx, t1, a1[i]);
        }
    }
    for (int i = 0; i < 4; i++) {
        out0[i] = hsum_ps(a0[i]);
        out1[i] = hsum_ps(a1[i]);
    }
}

/* rows w0 and w1 (each nb blocks) x m X rows; out0/out1 with stride ostride. Same arithmetic
 * per (W row, X row) as mf_kdot_avx2, so results are bit-identical to two single-row calls. */
AVX2 void mf_kdot2_avx2(const mf_kblk *w0, const mf_kblk *w1, int64_t nb, const uint8_t *x, size_t xs,
                        int64_t m, float *out0, float *out1, int64_t ostride) {
    int64_t i = 0;
    float o0[4], o1[4];
    for (; i + 4 <= m; i += 4) {
        kdot2x4(w0, w1, nb, x + i * xs, xs, o0, o1);
        for (int k = 0; k < 4; k++) {
            out0[(i + k) * ostride] = o0[k];
            out1[(i + k) * ostride] = o1[k];
        }
    }
    if (i < m) {
        mf_kdot_avx2(w0, nb, x + i * xs, xs, m - i, out0 + i * ostride, ostride);
        mf_kdot_avx2(w1, nb, x + i * xs, xs, m - i, out1 + i * ostride, ostride);
    }
}

AVX2 void mf_kdot_avx2(const mf_kblk *w, int64_t nb, const uint8_t *x, size_t xs, int64_t m, float *out, int64_t ostride) {
    int64_t i = 0;
    float o[4];
    for (; i + 4 <= m; i += 4) {
        kdot4(w, nb, x + i * xs, xs, o);
        for (int k = 0; k < 4; k++) out[(i + k) * ostride] = o[k];
    }
    for (; i < m; i++) {
        kdot1(w, nb, x + i * xs, xs, o);
        out[i * ostride] = o[0];
    }
}

/* ---------------- prefill: 32-element block types ----------------
 * Block b of a row becomes q[32] (unsigned for Q4_0/Q4_1/Q5_0/Q5_1, signed for Q8_0/IQ4_NL),
 * its d, and c with w = d*q + c... folded as dot += d*dx*isum + c*s_x (s_x = dx*sum(x)). */

AVX2 static void up_q4_0(const uint8_t *w, mf_b32 *o) {
    o->d = f16(w); o->c = -8.0f * o->d;
    _mm256_storeu_si256((__m256i *)o->q, nibbles32(w + 2));
}
AVX2 static void up_q4_1(const uint8_t *w, mf_b32 *o) {
    o->d = f16(w); o->c = f16(w + 2);
    _mm256_storeu_si256((__m256i *)o->q, nibbles32(w + 4));
}
AVX2 static void up_q5_0(const uint8_t *w, mf_b32 *o) {
    o->d = f16(w); o->c = -16.0f * o->d;
    _mm256_storeu_si256((__m256i *)o->q, _mm256_or_si256(nibbles32(w + 6), _mm256_and_si256(bits32(w + 2), _mm256_set1_epi8(0x10))));
}
AVX2 static void up_q5_1(const uint8_t *w, mf_b32 *o) {
    o->d = f16(w); o->c = f16(w + 2);
    _mm256_storeu_si256((__m256i *)o->q, _mm256_or_si256(nibbles32(w + 8), _mm256_and_si256(bits32(w + 4), _mm256_set1_epi8(0x10))));
}
AVX2 static void up_q8_0(const uint8_t *w, mf_b32 *o) {
    o->d = f16(w); o->c = 0;
    memcpy(o->q, w + 2, 32);
}
AVX2 static void up_iq4_nl(const uint8_t *w, mf_b32 *o) {
    const __m256i kv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)mf_kvalues_iq4nl));
    o->d = f16(w); o->c = 0;
    _mm256_storeu_si256((__m256i *)o->q, _mm256_shuffle_epi8(kv, nibbles32(w + 2)));
}

mf_b32unpack_fn mf_b32unpack_avx2[T_MAX] = {
    [T_Q4_0] = up_q4_0, [T_Q4_1] = up_q4_1, [T_Q5_0] = up_q5_0, [T_Q5_1] = up_q5_1,
    [T_Q8_0] = up_q8_0, [T_IQ4_NL] = up_iq4_nl, [T_MXFP4] = mf_up_mxfp4_avx2,
};

/* The unsigned types' offset term c_b * s_{i,b} is summed per (W row, X row) outside the
 * integer kernel (mf_b32_corr_avx2, 8 X rows per vector), in the same order and rounding.
 * SIGNED 2: signed values whose halves have their own scales (NVFP4, mf_up_nvfp4_b32: d the
 * first 16 values', c the last 16's); the 8 int32 lanes of a block's products are 4 values
 * each, so lanes 0-3 take d and 4-7 c. */
#define BDOT(M, SIGNED)                                                                              \
    AVX2 static void bdot##M##_##SIGNED(const mf_b32 *w, int64_t nb, const uint8_t *xb, size_t xs, float *out) { \
        __m256 acc[M];                                                                               \
        const __m256i ones = _mm256_set1_epi16(1);                                                   \
        for (int i = 0; i < M; i++) acc[i] = _mm256_setzero_ps();                                    \
        for (int64_t b = 0; b < nb; b++) {                                                           \
            __m256i q = _mm256_loadu_si256((const __m256i *)w[b].q);                                 \
            __m256i aq = SIGNED ? _mm256_sign_epi8(q, q) : q;                                        \
            for (int i = 0; i < M; i++) {                                                            \
                const mf_q8_32 *x = (const mf_q8_32 *)(xb + i * xs) + b;                             \
                __m256i y = _mm256_loadu_si256((const __m256i *)x->qs);                              \
                if (SIGNED) y = _mm256_sign_epi8(y, q);                                              \
                __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, y), ones);                    \
                const __m256 dd = SIGNED == 2 ? _mm256_set_m128(_mm_set1_ps(w[b].c * x->d), _mm_set1_ps(w[b].d * x->d)) \
                                              : _mm256_set1_ps(w[b].d * x->d);                       \
                acc[i] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(p), acc[i]);                         \
            }                                                                                        \
        }                                                                                            \
        for (int i = 0; i < M; i++) out[i] = hsum_ps(acc[i]);                                        \
    }
/* 2 W rows x 4 X rows: each X block loaded once for both W rows, and the 8 scales d_w * d_x of
 * a block are two 4-lane products of the X rows' d (sd: the tile's d transposed, [block][row],
 * MF_BST a block) broadcast per X row by an in-lane shuffle; every (W row, X row) pair runs
 * BDOT's steps in BDOT's order on the same values (same bits as two BDOT calls) */
#define BDOT2(SIGNED)                                                                                \
    AVX2 static void bdot2x4_##SIGNED(const mf_b32 *w0, const mf_b32 *w1, int64_t nb, const uint8_t *xb, \
                                       size_t xs, const float *sd, float *out0, float *out1) {       \
        __m256 a0[4], a1[4];                                                                         \
        const __m256i ones = _mm256_set1_epi16(1);                                                   \
        for (int i = 0; i < 4; i++) a0[i] = a1[i] = _mm256_setzero_ps();                             \
        for (int64_t b = 0; b < nb; b++) {                                                           \
            const __m256i q0 = _mm256_loadu_si256((const __m256i *)w0[b].q);                         \
            const __m256i q1 = _mm256_loadu_si256((const __m256i *)w1[b].q);                         \
            const __m256i aq0 = SIGNED ? _mm256_sign_epi8(q0, q0) : q0;                              \
            const __m256i aq1 = SIGNED ? _mm256_sign_epi8(q1, q1) : q1;                              \
            const __m256 xd = _mm256_broadcast_ps((const __m128 *)(sd + b * MF_BST));                \
            const __m256 dd0 = _mm256_mul_ps(_mm256_set1_ps(w0[b].d), xd);                          \
            const __m256 dd1 = _mm256_mul_ps(_mm256_set1_ps(w1[b].d), xd);                          \
            const uint8_t *xq = xb + b * sizeof(mf_q8_32) + offsetof(mf_q8_32, qs);                 \
            BDOT2_ROW(SIGNED, 0, 0x00) BDOT2_ROW(SIGNED, 1, 0x55)                                    \
            BDOT2_ROW(SIGNED, 2, 0xAA) BDOT2_ROW(SIGNED, 3, 0xFF)                                    \
        }                                                                                            \
        for (int i = 0; i < 4; i++) out0[i] = hsum_ps(a0[i]), out1[i] = hsum_ps(a1[i]);              \
    }
#define BDOT2_ROW(SIGNED, I, SH)                                                                     \
    {                                                                                                \
        const __m256i y = _mm256_loadu_si256((const __m256i *)(xq + (I) * xs));                      \
        const __m256i y0 = SIGNED ? _mm256_sign_epi8(y, q0) : y;                                     \
        const __m256i y1 = SIGNED ? _mm256_sign_epi8(y, q1) : y;                                     \
        const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(aq0, y0), ones);                  \
        const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(aq1, y1), ones);                  \
        a0[I] = _mm256_fmadd_ps(_mm256_shuffle_ps(dd0, dd0, SH), _mm256_cvtepi32_ps(p0), a0[I]);    \
        a1[I] = _mm256_fmadd_ps(_mm256_shuffle_ps(dd1, dd1, SH), _mm256_cvtepi32_ps(p1), a1[I]);    \
    }
BDOT(4, 0)
BDOT(1, 0)
BDOT2(0)
BDOT2(1)
BDOT(4, 1)
BDOT(1, 1)
BDOT(4, 2)
BDOT(1, 2)

/* corr[j] = sum_b c_b * st[b * MF_BST + j] for j < m (<= MF_BST), b in order, mul then add */
AVX2 void mf_b32_corr_avx2(const mf_b32 *w, int64_t nb, const float *st, int64_t m, float *corr) {
    __m256 c0 = _mm256_setzero_ps(), c1 = c0;
    for (int64_t b = 0; b < nb; b++) {
        const __m256 cb = _mm256_set1_ps(w[b].c);
        c0 = _mm256_add_ps(c0, _mm256_mul_ps(cb, _mm256_loadu_ps(st + b * MF_BST)));
        if (m > 8) c1 = _mm256_add_ps(c1, _mm256_mul_ps(cb, _mm256_loadu_ps(st + b * MF_BST + 8)));
    }
    _mm256_storeu_ps(corr, c0);
    _mm256_storeu_ps(corr + 8, c1);
}

/* mf_bdot_avx2 on two W rows (w, w + nb; sgn 0 or 1; corr0/corr1 as corr, outputs at out and
 * out + 1; sd: the X rows' d by block, [block][row], MF_BST a block): X rows four at a time by
 * bdot2x4, the last m % 4 by mf_bdot_avx2 on each W row */
AVX2 void mf_bdot2_avx2(const mf_b32 *w, int64_t nb, int sgn, const uint8_t *x, size_t xs, int64_t m,
                        const float *sd, const float *corr0, const float *corr1, float *out, int64_t ostride) {
    int64_t i = 0;
    float o0[4], o1[4];
    for (; i + 4 <= m; i += 4) {
        if (sgn) bdot2x4_1(w, w + nb, nb, x + i * xs, xs, sd + i, o0, o1);
        else bdot2x4_0(w, w + nb, nb, x + i * xs, xs, sd + i, o0, o1);
        for (int k = 0; k < 4; k++) {
            out[(i + k) * ostride] = sgn ? o0[k] : o0[k] + corr0[i + k];
            out[(i + k) * ostride + 1] = sgn ? o1[k] : o1[k] + corr1[i + k];
        }
    }
    if (i < m) {
        mf_bdot_avx2(w, nb, sgn, x + i * xs, xs, m - i, sgn ? NULL : corr0 + i, out + i * ostride, ostride);
        mf_bdot_avx2(w + nb, nb, sgn, x + i * xs, xs, m - i, sgn ? NULL : corr1 + i, out + i * ostride + 1, ostride);
    }
}

AVX2 void mf_bdot_avx2(const mf_b32 *w, int64_t nb, int sgn, const uint8_t *x, size_t xs, int64_t m,
                       const float *corr, float *out, int64_t ostride) {
    int64_t i = 0;
    float o[4];
    for (; i + 4 <= m; i += 4) {
        if (sgn == 2) bdot4_2(w, nb, x + i * xs, xs, o); else if (sgn) bdot4_1(w, nb, x + i * xs, xs, o); else bdot4_0(w, nb, x + i * xs, xs, o);
        for (int k = 0; k < 4; k++) out[(i + k) * ostride] = sgn ? o[k] : o[k] + corr[i + k];
    }
    for (; i < m; i++) {
        if (sgn == 2) bdot1_2(w, nb, x + i * xs, xs, o); else if (sgn) bdot1_1(w, nb, x + i * xs, xs, o); else bdot1_0(w, nb, x + i * xs, xs, o);
        out[i * ostride] = sgn ? o[0] : o[0] + corr[i];
    }
}

/* Decode, 32-element types: 4 W rows per call share each X block and one horizontal sum
 * (rows of 576-640 columns are only 18-20 blocks, so per-row overhead mattered). */
AVX2 static inline __m128 hsum4_ps(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    __m256 s = _mm256_hadd_ps(ab, cd); /* lane k: partial of row k (low half) and (high half) */
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
#define VD4(NAME, UP, SGN)                                                                         \
    AVX2 static void NAME(const uint8_t *w, size_t rb, const void *xv, int64_t nb, float *out) {   \
        const mf_q8_32 *x = xv;                                                                    \
        const int bytes = (int)(rb / (size_t)nb);                                                  \
        __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()}; \
        __m128 cacc = _mm_setzero_ps();                                                            \
        const __m256i ones = _mm256_set1_epi16(1);                                                 \
        const int64_t pfd = MF_PF_MULTI;                                                       \
        for (int64_t b = 0; b < nb; b++) {                                                         \
            MF_PF_ROWS(w + b * bytes, 4, rb, b * bytes, nb * bytes, pfd, bytes);                       \
            __m256i y = _mm256_loadu_si256((const __m256i *)x[b].qs);                              \
            float dx = x[b].d;                                                                     \
            float cs[4];                                                                           \
            for (int r = 0; r < 4; r++) {                                                          \
                mf_b32 u;                                                                          \
                UP(w + r * rb + b * bytes, &u);                                                    \
                __m256i q = _mm256_loadu_si256((const __m256i *)u.q);                              \
                __m256i p = SGN ? _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(y, q)) \
                                : _mm256_maddubs_epi16(q, y);                                      \
                p = _mm256_madd_epi16(p, ones);                                                    \
                a[r] = _mm256_fmadd_ps(_mm256_set1_ps(u.d * dx), _mm256_cvtepi32_ps(p), a[r]);     \
                cs[r] = u.c;                                                                       \
            }                                                                                      \
            if (!SGN) cacc = _mm_fmadd_ps(_mm_loadu_ps(cs), _mm_set1_ps(x[b].s), cacc);            \
        }                                                                                          \
        _mm_storeu_ps(out, _mm_add_ps(hsum4_ps(a[0], a[1], a[2], a[3]), cacc));                    \
    }
VD4(vd4_q5_1, up_q5_1, 0)

/* 4 f16 from 4 addresses -> the low 4 halves (one load, three inserts from memory) */
AVX2 static inline __m128i ld4_f16(const uint8_t *p0, const uint8_t *p1, const uint8_t *p2, const uint8_t *p3) {
    uint16_t h0, h1, h2, h3;
    memcpy(&h0, p0, 2); memcpy(&h1, p1, 2); memcpy(&h2, p2, 2); memcpy(&h3, p3, 2);
    __m128i v = _mm_cvtsi32_si128(h0);
    v = _mm_insert_epi16(v, h1, 1);
    v = _mm_insert_epi16(v, h2, 2);
    return _mm_insert_epi16(v, h3, 3);
}
/* Q4_0, 4 rows, same arithmetic as VD4 in ~half the instructions: the 4 rows' d convert in one
 * vcvtph2ps; nibbles load into both lanes and one per-lane shift splits low/high; the offset
 * c = -8 d (exact) is applied as one 4-lane FMA per block. */
AVX2 static void vd4_q4_0(const uint8_t *w, size_t rb, const void *xv, int64_t nb, float *out) {
    const mf_q8_32 *x = xv;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    __m128 cacc = _mm_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(0xF);
    const __m256i sh = _mm256_set_epi64x(4, 4, 0, 0);
    const __m128 m8 = _mm_set1_ps(-8.0f);
    const uint8_t *w0 = w, *w1 = w + rb, *w2 = w + 2 * rb, *w3 = w + 3 * rb;
    float sc[4]; /* the 4 rows' d * dx: stored once, broadcast from memory (load ports, no shuffle) */
    const int64_t pfd = MF_PF_MULTI;
    for (int64_t b = 0; b < nb; b++, w0 += 18, w1 += 18, w2 += 18, w3 += 18) {
        MF_PF_ROWS(w0, 4, rb, b * 18, nb * 18, pfd, 18);
        const __m256i y = _mm256_loadu_si256((const __m256i *)x[b].qs);
        const __m128 d4 = _mm_cvtph_ps(ld4_f16(w0, w1, w2, w3));
        _mm_storeu_ps(sc, _mm_mul_ps(d4, _mm_set1_ps(x[b].d)));
        cacc = _mm_fmadd_ps(_mm_mul_ps(d4, m8), _mm_set1_ps(x[b].s), cacc);
#define Q40_ROW(W, A, I)                                                                            \
        {                                                                                           \
            __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)((W) + 2)));  \
            q = _mm256_and_si256(_mm256_srlv_epi64(q, sh), m4);                                     \
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), ones);                  \
            A = _mm256_fmadd_ps(_mm256_broadcast_ss(sc + I), _mm256_cvtepi32_ps(p), A);              \
        }
        Q40_ROW(w0, a0, 0) Q40_ROW(w1, a1, 1) Q40_ROW(w2, a2, 2) Q40_ROW(w3, a3, 3)
#undef Q40_ROW
    }
    _mm_storeu_ps(out, _mm_add_ps(hsum4_ps(a0, a1, a2, a3), cacc));
}

/* Q5_0, 4 rows, same arithmetic as VD4: the 4 rows' d convert in one vcvtph2ps; the offset
 * c = -16 d (exact) is applied as one 4-lane FMA per block. */
AVX2 static void vd4_q5_0(const uint8_t *w, size_t rb, const void *xv, int64_t nb, float *out) {
    const mf_q8_32 *x = xv;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    __m128 cacc = _mm_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(0xF), b4 = _mm256_set1_epi8(0x10);
    const __m256i sh = _mm256_set_epi64x(4, 4, 0, 0);
    const __m256i i0 = _mm256_set1_epi32(0), i1 = _mm256_set1_epi32(1);
    const __m256i i2 = _mm256_set1_epi32(2), i3 = _mm256_set1_epi32(3);
    const __m128 m16 = _mm_set1_ps(-16.0f);
    const uint8_t *w0 = w, *w1 = w + rb, *w2 = w + 2 * rb, *w3 = w + 3 * rb;
    const int64_t pfd = MF_PF_MULTI;
    for (int64_t b = 0; b < nb; b++, w0 += 22, w1 += 22, w2 += 22, w3 += 22) {
        MF_PF_ROWS(w0, 4, rb, b * 22, nb * 22, pfd, 22);
        const __m256i y = _mm256_loadu_si256((const __m256i *)x[b].qs);
        const __m128 d4 = _mm_cvtph_ps(ld4_f16(w0, w1, w2, w3));
        const __m256 sc = _mm256_castps128_ps256(_mm_mul_ps(d4, _mm_set1_ps(x[b].d)));
        cacc = _mm_fmadd_ps(_mm_mul_ps(d4, m16), _mm_set1_ps(x[b].s), cacc);
#define Q50_ROW(W, A, I)                                                                            \
        {                                                                                           \
            __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)((W) + 6)));  \
            q = _mm256_and_si256(_mm256_srlv_epi64(q, sh), m4);                                     \
            q = _mm256_or_si256(q, _mm256_and_si256(bits32((W) + 2), b4));                          \
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), ones);                  \
            A = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(sc, I), _mm256_cvtepi32_ps(p), A);         \
        }
        Q50_ROW(w0, a0, i0) Q50_ROW(w1, a1, i1) Q50_ROW(w2, a2, i2) Q50_ROW(w3, a3, i3)
#undef Q50_ROW
    }
    _mm_storeu_ps(out, _mm_add_ps(hsum4_ps(a0, a1, a2, a3), cacc));
}

/* Q4_1, 4 rows, same arithmetic as VD4 in ~half the instructions: the 4 rows' (d, m) f16 pairs
 * convert in one vcvtph2ps and multiply with the (dx, s) pair broadcast as one 64-bit value;
 * the 16 nibble bytes load into both lanes and one per-lane shift splits low/high. */
AVX2 static void vd4_q4_1(const uint8_t *w, size_t rb, const void *xv, int64_t nb, float *out) {
    const mf_q8_32 *x = xv;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, macc = a0;
    const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(0xF);
    const __m256i sh = _mm256_set_epi64x(4, 4, 0, 0);
    const __m256i i0 = _mm256_set1_epi32(0), i1 = _mm256_set1_epi32(2);
    const __m256i i2 = _mm256_set1_epi32(4), i3 = _mm256_set1_epi32(6);
    const uint8_t *w0 = w, *w1 = w + rb, *w2 = w + 2 * rb, *w3 = w + 3 * rb;
    const int64_t pfd = MF_PF_MULTI;
    for (int64_t b = 0; b < nb; b++, w0 += 20, w1 += 20, w2 += 20, w3 += 20) {
        MF_PF_ROWS(w0, 4, rb, b * 20, nb * 20, pfd, 20);
        const __m256i y = _mm256_loadu_si256((const __m256i *)x[b].qs);
        const __m256 xs = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)&x[b])); /* dx s dx s .. */
        int32_t h0, h1, h2, h3;
        memcpy(&h0, w0, 4); memcpy(&h1, w1, 4); memcpy(&h2, w2, 4); memcpy(&h3, w3, 4);
        const __m256 dm = _mm256_cvtph_ps(_mm_setr_epi32(h0, h1, h2, h3)); /* d0 m0 d1 m1 .. */
        const __m256 sc = _mm256_mul_ps(dm, xs);                            /* d_r * dx in even lanes */
        macc = _mm256_fmadd_ps(dm, xs, macc);                               /* += m_r * s in odd lanes */
#define Q41_ROW(W, A, I)                                                                            \
        {                                                                                           \
            __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)((W) + 4)));  \
            q = _mm256_and_si256(_mm256_srlv_epi64(q, sh), m4);                                     \
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), ones);                  \
            A = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(sc, I), _mm256_cvtepi32_ps(p), A);         \
        }
        Q41_ROW(w0, a0, i0) Q41_ROW(w1, a1, i1) Q41_ROW(w2, a2, i2) Q41_ROW(w3, a3, i3)
#undef Q41_ROW
    }
    const __m128 c = _mm256_castps256_ps128(_mm256_permutevar8x32_ps(macc, _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7)));
    _mm_storeu_ps(out, _mm_add_ps(hsum4_ps(a0, a1, a2, a3), c));
}

const uint8_t mf_kpf_avx2[T_MAX] = {[T_Q4_K] = 1, [T_Q5_K] = 1, [T_Q6_K] = 1, [T_Q8_0] = 1, [T_Q3_K] = 1, [T_Q2_K] = 1,
                                     [T_Q4_0] = 1, [T_Q4_1] = 1, [T_Q5_0] = 1, [T_Q5_1] = 1, [T_IQ4_NL] = 1, [T_IQ4_XS] = 1, [T_MXFP4] = 1,
                                     [T_NVFP4] = 1};

mf_vecdot4_fn mf_vecdot4_avx2[T_MAX] = {
    [T_Q4_0] = vd4_q4_0, [T_Q4_1] = vd4_q4_1, [T_Q5_0] = vd4_q5_0, [T_Q5_1] = vd4_q5_1, [T_MXFP4] = mf_vd4_mxfp4_avx2,
    [T_NVFP4] = mf_vd4_nvfp4_avx2, [T_Q4_K] = vd4_q4_k, [T_Q6_K] = vd4_q6_k,
    /* Q8_0/IQ4_NL: the 4-row form measured 2x slower from DRAM (49152x576), so not used */
};

/* the 4-row kernels that read their rows one after another, each in the 1-row kernel's order
 * (VD4_SEQ): worth it on short rows only (rows of at most mf_tune.k_vd4_short_rb bytes), and
 * their tasks are sized as the 1-row kernel's (quant_mm.c) */
const uint8_t mf_vd4_seq_avx2[T_MAX] = {[T_Q4_K] = 1, [T_Q6_K] = 1};

/* TQ2_0 prefill (and batched decode): each 2-bit digit vector serves 4 X rows */
mf_vecdotx4_fn mf_vecdotx4_avx2[T_MAX] = {[T_TQ2_0] = mf_vdx4_tq2_0_avx2};

/* ---------------- prefill: float weights ----------------
 * W rows converted to f32 once per task (row_f32), then 2 W rows x 4 X rows per pass:
 * 6 loads per 8 FMAs instead of 2 per 1. */
AVX2 void mf_row_f32_avx2(int type, const uint8_t *w, float *dst, int64_t n) {
    int64_t k = 0;
    if (type == T_F16)
        for (; k + 8 <= n; k += 8) _mm256_storeu_ps(dst + k, ld_f16(w + 2 * k));
    else if (type == T_BF16)
        for (; k + 8 <= n; k += 8) _mm256_storeu_ps(dst + k, ld_bf16(w + 2 * k));
    else {
        memcpy(dst, w, (size_t)n * 4);
        return;
    }
    for (; k < n; k++) dst[k] = type == T_F16 ? mf_f16(w + 2 * k) : bf16s(w + 2 * k);
}

AVX2 static void fdot_2x4(const float *w0, const float *w1, const float *x, int64_t xs, int64_t n, float *o0, float *o1) {
    __m256 a[2][4];
    for (int i = 0; i < 4; i++) a[0][i] = a[1][i] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k);
        for (int i = 0; i < 4; i++) {
            __m256 xv = _mm256_loadu_ps(x + i * xs + k);
            a[0][i] = _mm256_fmadd_ps(v0, xv, a[0][i]);
            a[1][i] = _mm256_fmadd_ps(v1, xv, a[1][i]);
        }
    }
    __m128 s0 = hsum4_ps(a[0][0], a[0][1], a[0][2], a[0][3]), s1 = hsum4_ps(a[1][0], a[1][1], a[1][2], a[1][3]);
    _mm_storeu_ps(o0, s0);
    _mm_storeu_ps(o1, s1);
    for (; k < n; k++)
        for (int i = 0; i < 4; i++) {
            o0[i] += w0[k] * x[i * xs + k];
            o1[i] += w1[k] * x[i * xs + k];
        }
}

/* one (W row, X row) pair with fdot_2x4's arithmetic for each of its pairs (one 8-lane FMA
 * chain, hsum4_ps's tree, then the tail in order): the GEMM's leftover rows get those bits */
AVX2 static float fdot_1x1(const float *w, const float *x, int64_t n) {
    __m256 a = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a);
    float o = _mm_cvtss_f32(hsum4_ps(a, a, a, a));
    for (; k < n; k++) o += w[k] * x[k];
    return o;
}

/* rows r0..r1 of converted W (wf, row stride cols) against X rows [0, m) -> y[i*ys + r]; every
 * pair with the same arithmetic, so a row's result does not depend on m or the row split */
AVX2 void mf_fgemm_avx2(const float *wf, int64_t nr, const float *x, int64_t m, int64_t cols, float *y, int64_t ys) {
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) {
        int64_t r = 0;
        for (; r + 2 <= nr; r += 2) {
            float o0[4], o1[4];
            fdot_2x4(wf + r * cols, wf + (r + 1) * cols, x + i * cols, cols, cols, o0, o1);
            for (int k = 0; k < 4; k++) { y[(i + k) * ys + r] = o0[k]; y[(i + k) * ys + r + 1] = o1[k]; }
        }
        for (; r < nr; r++)
            for (int k = 0; k < 4; k++) y[(i + k) * ys + r] = fdot_1x1(wf + r * cols, x + (i + k) * cols, cols);
    }
    for (; i < m; i++)
        for (int64_t r = 0; r < nr; r++) y[i * ys + r] = fdot_1x1(wf + r * cols, x + i * cols, cols);
}
