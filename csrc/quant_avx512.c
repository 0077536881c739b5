/* AVX-512 VNNI decode vec-dots (Ice Lake and later: F/BW/VL/VNNI/VBMI), one W row against
 * one prepared X row, 64 weights per 512-bit step.
 *
 * K-quants x Q8_256: a 32-byte chunk of packed quants is broadcast to both 256-bit halves by
 * the load itself and one per-half variable shift + mask gives 64 weights in element order,
 * so X is read in its natural order (one aligned 64-byte load); Q4_K and Q5_K instead load two
 * chunks at once against X in the XF_Q8_256S order (q4_k_step). vpmaddubsw makes the u8 x s8
 * pair sums, vpdpwssd multiplies them by the sub-block scales and accumulates in int32 (the
 * AVX2 path needs madd + add + a scale shuffle for that): exact integer block sums, then one
 * float FMA per block as in the AVX2 kernels (only the float summation order differs).
 *
 * 32-element types x Q8_32P (a row of X as all blocks' 32 int8 values, then per-block
 * dx expanded to 8 lanes, then -8 * the sums of each 4 values, see mf_quantize_q8_32p): two
 * blocks per 512-bit step; one unaligned 64-byte load of W covers both blocks (18- or 34-byte
 * blocks) and one vpermb puts their quants (and another their scales) in place; vpdpbusd
 * accumulates u8 x s8 into an accumulator that starts at the offset term. */
#include "quant_common.h"

#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx512dq,avx2,fma,f16c,bmi2")))

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
/* lane j: mins[j] * (bsums[2j] + bsums[2j+1]), mins = bytes 8..15 of u (no horizontal sum:
 * the caller accumulates the 8 lanes in float and sums once per row) */
VNNI static inline __m256i k4_minlanes(const uint32_t u[4], const int16_t *bsums) {
    const __m128i m8 = _mm_cvtsi64_si128((int64_t)((uint64_t)u[3] << 32 | u[2]));
    const __m256i m16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8)); /* each min twice */
    return _mm256_madd_epi16(m16, _mm256_loadu_si256((const __m256i *)bsums));
}
/* words 8i..8i+7 = index a + i, i < 4 */
VNNI static inline __m512i sel4(int a) {
    return _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_set_epi64x(0x0303030303030303 + a * 0x0101010101010101LL,
                                                                0x0202020202020202 + a * 0x0101010101010101LL),
                                                 _mm_set_epi64x(0x0101010101010101 + a * 0x0101010101010101LL,
                                                                a * 0x0101010101010101LL)));
}
/* 32 bytes at p in both 256-bit halves */
VNNI static inline __m512i bcast32(const uint8_t *p) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p));
}
/* (A & C) | B */
#define OR_AND(A, B, C) _mm512_ternarylogic_epi32((A), (B), (C), 0xEC)
/* ---------------- K-quants x Q8_256 ---------------- */

/* the K-quants with mins (Q2_K/Q4_K/Q5_K): the block's f16 d, dmin at dm times X's dx; acc +=
 * d dx * the int32 lanes, accm += dmin dx * the 8 mins x bsums lanes (taken off at the end) */
VNNI static inline void kmin_fma(const uint8_t *dmp, const mf_q8_256 *x, __m512i sumi, __m256i mlanes, __m512 *acc,
                                 __m256 *accm) {
    int32_t h;
    memcpy(&h, dmp, 4);
    const __m128 dm = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(h)), _mm_set1_ps(x->d)); /* d*dx, dmin*dx */
    *acc = _mm512_fmadd_ps(_mm512_broadcastss_ps(dm), _mm512_cvtepi32_ps(sumi), *acc);
    *accm = _mm256_fmadd_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dm)), _mm256_cvtepi32_ps(mlanes), *accm);
}

/* the K-quants without mins (Q3_K/Q6_K/IQ4_XS): acc += the block's f16 d at dp times X's dx
 * times the int32 lanes */
VNNI static inline void kd_fma(const uint8_t *dp, const mf_q8_256 *x, __m512i sumi, __m512 *acc) {
    uint16_t hd;
    memcpy(&hd, dp, 2);
    *acc = _mm512_fmadd_ps(_mm512_set1_ps(_cvtsh_ss(hd) * x->d), _mm512_cvtepi32_ps(sumi), *acc);
}

/* words 0-15 = byte a of each 128-bit lane's low 8 bytes, 16-31 = byte b, zero-extended (a
 * vpshufb control; on Zen 4 the scale bytes broadcast from a general register and 4 vpshufb a
 * block measured 3-4% faster than 8 words by vpmovzxbw and 4 vpermw, tools/vd_harness.c) */
VNNI static inline __m512i bsel2(int a, int b) {
    const int64_t A = 0x8000800080008000LL | (int64_t)a * 0x0001000100010001LL;
    const int64_t B = 0x8000800080008000LL | (int64_t)b * 0x0001000100010001LL;
    return _mm512_set_epi64(B, B, B, B, A, A, A, A);
}
/* chunk pair P of an XF_Q8_256S step: the low-nibble values lo (sub-blocks 4P, 4P + 2) and the
 * high ones hi (4P + 1, 4P + 3) against X's 128 bytes at 128P, times their scales (bytes 0..7
 * of every 128-bit lane of sc) as words, into the block's one accumulator v (set by P = 0) */
VNNI static inline void s_dot(int P, __m512i lo, __m512i hi, const mf_q8_256 *x, __m512i sc, __m512i *v) {
    const int8_t *y = x->qs + 128 * P;
    const __m512i pl = _mm512_maddubs_epi16(lo, _mm512_load_si512((const void *)y));
    const __m512i ph = _mm512_maddubs_epi16(hi, _mm512_load_si512((const void *)(y + 64)));
    if (P == 0) *v = _mm512_madd_epi16(pl, _mm512_shuffle_epi8(sc, bsel2(0, 2)));
    else *v = _mm512_dpwssd_epi32(*v, pl, _mm512_shuffle_epi8(sc, bsel2(4 * P, 4 * P + 2)));
    *v = _mm512_dpwssd_epi32(*v, ph, _mm512_shuffle_epi8(sc, bsel2(4 * P + 1, 4 * P + 3)));
}

/* One block of one row into the row's accumulators (acc; accm: the mins term). X is
 * XF_Q8_256S. A 64-byte load of the packed quants holds chunks 2P and 2P+1 (32 bytes each; a
 * chunk's low nibbles are its first 32 values, its high nibbles the next 32): its low nibbles
 * meet one 64-byte load of the swizzled activations, its high nibbles the next. All four
 * products go into one int32 accumulator (the first by vpmaddwd, so nothing is zeroed): each
 * lane ends with an exact sum over 4 of the 8 sub-blocks, and the 16 lanes together hold the
 * block's exact sum; then one cvt + FMA with d * dx. Bits of their own (this ISA's decode; the
 * 4/8-row kernels run the same step per row). Against the two-accumulator form folded back to
 * the one-chunk lanes (128-bit shuffles + add) this is 5 fewer 512-bit ops a block: on Zen 4
 * 5.28 -> 4.55-4.72 ns a block from L2 (tools/vd_harness.c, BENCHMARKS.md section 41). */
VNNI static inline void q4_k_step(const uint8_t *w, const mf_q8_256 *x, __m512 *acc, __m256 *accm) {
    const __m512i m4 = _mm512_set1_epi8(0xF);
    uint32_t u[4];
    k4_scales(w + 4, u);
    const __m256i mlanes = k4_minlanes(u, x->bsums);
    const __m512i sc = _mm512_set1_epi64((int64_t)((uint64_t)u[1] << 32 | u[0]));
    const uint8_t *qs = w + 16;
    __m512i v = _mm512_setzero_si512();
    for (int P = 0; P < 2; P++) {
        const __m512i raw = _mm512_loadu_si512((const void *)(qs + 64 * P));
        const __m512i lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
        s_dot(P, lo, hi, x, sc, &v);
    }
    kmin_fma(w, x, v, mlanes, acc, accm);
}

/* Q5_K as q4_k_step (X in XF_Q8_256S, the same lanes); each nibble's 5th bit from the
 * broadcast qh: bit 2c of qh byte l for value l of chunk c's low nibbles, bit 2c + 1 for its
 * high nibbles, rotated per 256-bit half to bit 4 */
VNNI static inline void q5_k_step(const uint8_t *w, const mf_q8_256 *x, __m512 *acc, __m256 *accm) {
    const __m512i m4 = _mm512_set1_epi8(0xF), b4 = _mm512_set1_epi8(0x10);
    uint32_t u[4];
    k4_scales(w + 4, u);
    const __m256i mlanes = k4_minlanes(u, x->bsums);
    const __m512i sc = _mm512_set1_epi64((int64_t)((uint64_t)u[1] << 32 | u[0]));
    const uint8_t *qs = w + 48;
    const __m512i qh = bcast32(w + 16);
    __m512i v = _mm512_setzero_si512();
    for (int P = 0; P < 2; P++) {
        /* low nibbles: chunk 2P (bit 4P) in the low half, chunk 2P + 1 (bit 4P + 2) in the high */
        const __m512i rl = _mm512_set_epi64((2 - 4 * P) & 63, (2 - 4 * P) & 63, (2 - 4 * P) & 63, (2 - 4 * P) & 63,
                                            (4 - 4 * P) & 63, (4 - 4 * P) & 63, (4 - 4 * P) & 63, (4 - 4 * P) & 63);
        const __m512i rh = _mm512_set_epi64((1 - 4 * P) & 63, (1 - 4 * P) & 63, (1 - 4 * P) & 63, (1 - 4 * P) & 63,
                                            (3 - 4 * P) & 63, (3 - 4 * P) & 63, (3 - 4 * P) & 63, (3 - 4 * P) & 63);
        const __m512i raw = _mm512_loadu_si512((const void *)(qs + 64 * P));
        const __m512i lo = OR_AND(raw, _mm512_and_si512(_mm512_rolv_epi64(qh, rl), b4), m4);
        const __m512i hi = OR_AND(_mm512_srli_epi16(raw, 4), _mm512_and_si512(_mm512_rolv_epi64(qh, rh), b4), m4);
        s_dot(P, lo, hi, x, sc, &v);
    }
    kmin_fma(w, x, v, mlanes, acc, accm);
}

/* Q6_K: values 0..63 (4 low bits | 2 high bits << 4) minus 32, the -32 taken off as -32 *
 * sc_i * bsums_i, 8 lanes of pairs in the accumulator's first lanes (an exact int32 partial
 * sum like every other lane; a horizontal sum of them per block was 11% of the kernel); all
 * four 64-value steps into that one accumulator, one float FMA a block. Bits of their own;
 * 6.68 -> 6.07 ns a block on Zen 4 (section 41). */
VNNI static inline void q6_k_step(const uint8_t *w, const mf_q8_256 *x, __m512 *acc, __m256 *unused) {
    (void)unused;
    const __m512i m4 = _mm512_set1_epi8(0xF), m30 = _mm512_set1_epi8(0x30);
    const __m512i shl = _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4), shr = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
    const __m256i sc8 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 192)));
    const __m256i corr = _mm256_madd_epi16(sc8, _mm256_loadu_si256((const __m256i *)x->bsums));
    const __m512i sc = _mm512_castsi256_si512(sc8);
    __m512i sumi = _mm512_zextsi256_si512(_mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(corr, 5)));
    for (int h = 0; h < 2; h++) {
        const __m512i ql = _mm512_loadu_si512((const void *)(w + 64 * h));
        const __m512i qh = bcast32(w + 128 + 32 * h);
        const int8_t *y = x->qs + 128 * h;
        /* elements 128h + 0..63: low nibbles | qh bits 0-1 (first 32) / 2-3 (next 32) << 4 */
        __m512i v0 = OR_AND(ql, _mm512_and_si512(_mm512_sllv_epi64(qh, shl), m30), m4);
        /* elements 128h + 64..127: high nibbles | qh bits 4-5 / 6-7 << 4 */
        __m512i v1 = OR_AND(_mm512_srli_epi16(ql, 4), _mm512_and_si512(_mm512_srlv_epi64(qh, shr), m30), m4);
        __m512i p0 = _mm512_maddubs_epi16(v0, _mm512_loadu_si512((const void *)y));
        __m512i p1 = _mm512_maddubs_epi16(v1, _mm512_loadu_si512((const void *)(y + 64)));
        sumi = _mm512_dpwssd_epi32(sumi, p0, _mm512_permutexvar_epi16(sel4(8 * h), sc));
        sumi = _mm512_dpwssd_epi32(sumi, p1, _mm512_permutexvar_epi16(sel4(8 * h + 4), sc));
    }
    kd_fma(w + 208, x, sumi, acc);
}

/* words 8i..8i+7 = index 2s, 2s + 1, 8 + 2s, 9 + 2s for i = 0..3 (a vpermw selector): the
 * 16-value sub-blocks of X_T's 64 bytes at 64s (values 32s.., then 128 + 32s..) */
VNNI static inline __m512i selt(int s) {
    const int64_t a = 0x0101010101010101LL;
    return _mm512_cvtepu8_epi16(_mm256_set_epi64x((9 + 2 * s) * a, (8 + 2 * s) * a, (2 * s + 1) * a, 2 * s * a));
}

/* shift s of an XF_Q8_256T step: the 2-bit values q (u8) against X's 64 bytes at 64s, times
 * their sub-blocks' scale words, into v */
VNNI static inline void t_dot(int s, __m512i q, const mf_q8_256 *x, __m512i sc, __m512i *v) {
    const __m512i p = _mm512_maddubs_epi16(q, _mm512_load_si512((const void *)(x->qs + 64 * s)));
    *v = _mm512_dpwssd_epi32(*v, p, _mm512_permutexvar_epi16(selt(s), sc));
}

/* Q3_K: element e = 128c + 32s + l is ((qs[32c + l] >> 2s) & 3) | 4 * (bit e/32 of hmask[l]),
 * minus 4 (taken off as -4 * sc_i * bsums_i, 8 lanes of pairs, in the accumulator's first
 * lanes); 16 6-bit scales unpacked in registers. X is XF_Q8_256T: one 64-byte load of qs (both
 * 32-byte chunks) shifted by 2s gives values 32s.. of chunk 0 and 128 + 32s.. of chunk 1, which
 * meet X's 64 bytes at 64s. Every shift goes into one int32 accumulator: the lanes are exact
 * partial sums of the block (no lane fold, no horizontal sum of the correction), then one float
 * FMA. Bits of their own; 8.3 -> 6.75 ns a block on Zen 4 (section 41). */
VNNI static inline void q3_k_step(const uint8_t *w, const mf_q8_256 *x, __m512 *acc, __m256 *unused) {
    (void)unused;
    const __m512i m3 = _mm512_set1_epi8(3), b2 = _mm512_set1_epi8(4);
    uint32_t a[3], u[4];
    memcpy(a, w + 96, 12);
    const uint32_t k1 = 0x03030303, k2 = 0x0f0f0f0f;
    u[0] = (a[0] & k2) | ((a[2] & k1) << 4);
    u[1] = (a[1] & k2) | (((a[2] >> 2) & k1) << 4);
    u[2] = ((a[0] >> 4) & k2) | (((a[2] >> 4) & k1) << 4);
    u[3] = ((a[1] >> 4) & k2) | (((a[2] >> 6) & k1) << 4);
    const __m128i s8 = _mm_sub_epi8(_mm_set_epi32((int)u[3], (int)u[2], (int)u[1], (int)u[0]), _mm_set1_epi8(32));
    const __m256i sc16 = _mm256_cvtepi8_epi16(s8);
    const __m256i corr = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)x->bsums));
    const __m512i sc = _mm512_castsi256_si512(sc16);
    const __m512i hm = bcast32(w), raw = _mm512_loadu_si512((const void *)(w + 32));
    __m512i v = _mm512_zextsi256_si512(_mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(corr, 2)));
    for (int s = 0; s < 4; s++) {
        /* hmask bit s (chunk 0, low half) / 4 + s (chunk 1, high half) rotated to bit 2 */
        const __m512i rot = _mm512_set_epi64((-2 - s) & 63, (-2 - s) & 63, (-2 - s) & 63, (-2 - s) & 63,
                                             (2 - s) & 63, (2 - s) & 63, (2 - s) & 63, (2 - s) & 63);
        const __m512i h = _mm512_and_si512(_mm512_rolv_epi64(hm, rot), b2);
        t_dot(s, OR_AND(_mm512_srli_epi16(raw, 2 * s), h, m3), x, sc, &v);
    }
    kd_fma(w + 108, x, v, acc);
}

/* Q2_K as q3_k_step's lanes (X in XF_Q8_256T, values (qs >> 2s) & 3, no high bit, scales the
 * low nibbles of the first 16 bytes) and the mins as q4_k_step's: 8 lanes of mins x bsums
 * pairs, one FMA with dmin * dx a block. Bits of their own (the AVX2 kernel sums 8 lanes);
 * one accumulator, 5.35 -> 4.93 ns a block on Zen 4 (section 41). */
VNNI static inline void q2_k_step(const uint8_t *w, const mf_q8_256 *x, __m512 *acc, __m256 *accm) {
    const __m512i m3 = _mm512_set1_epi8(3);
    const __m128i s8 = _mm_loadu_si128((const __m128i *)w), m4 = _mm_set1_epi8(0xF);
    const __m512i sc = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_and_si128(s8, m4)));
    const __m256i mlanes = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s8, 4), m4)),
                                             _mm256_loadu_si256((const __m256i *)x->bsums));
    const __m512i raw = _mm512_loadu_si512((const void *)(w + 16));
    __m512i v = _mm512_setzero_si512();
    for (int s = 0; s < 4; s++) t_dot(s, _mm512_and_si512(_mm512_srli_epi16(raw, 2 * s), m3), x, sc, &v);
    kmin_fma(w + 80, x, v, mlanes, acc, accm);
}

/* IQ4_XS, X in XF_Q8_256N: a 64-byte load holds four sub-blocks' 16 bytes; its low nibbles
 * (each sub-block's first 16 values) meet one 64-byte load of X, its high nibbles the next,
 * and both take the same scale words (dword lanes 4i..4i+3 sub-block i). The non-linear values
 * come from a 16-byte table lookup as magnitudes (vpshufb) with the sign moved onto X (the
 * table's first 8 entries are the negative ones: index bit 3 clear), so vpmaddubsw's u8 x s8
 * applies; pair sums stay below 2 * 127 * 127. Per block one float FMA of the exact int32 lane
 * sums, as the K-quants. Bits of their own (this ISA's decode only): the AVX2 kernel, the prefill
 * path and the other ISAs have other lanes, as they do for every type. */
VNNI static inline void iq4_xs_step(const uint8_t *w, const mf_q8_256 *x, __m512 *acc, __m256 *unused) {
    (void)unused;
    const __m512i m4 = _mm512_set1_epi8(0xF), b3 = _mm512_set1_epi8(8);
    const __m512i mag = _mm512_abs_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)mf_kvalues_iq4nl)));
    uint16_t sh;
    uint32_t sl;
    memcpy(&sh, w + 2, 2);
    memcpy(&sl, w + 4, 4);
    /* the 8 6-bit scales, minus 32, as words */
    const uint64_t ls = _pdep_u64(sl, 0x0F0F0F0F0F0F0F0FULL) | _pdep_u64(sh, 0x3030303030303030ULL);
    const __m512i sc = _mm512_castsi128_si512(_mm_sub_epi16(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((int64_t)ls)), _mm_set1_epi16(32)));
    const int8_t *y = x->qs;
    __m512i v = _mm512_setzero_si512();
    for (int P = 0; P < 2; P++) {
        const __m512i raw = _mm512_loadu_si512((const void *)(w + 8 + 64 * P));
        const __m512i lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
        const __m512i ylo = _mm512_load_si512((const void *)(y + 128 * P)), yhi = _mm512_load_si512((const void *)(y + 128 * P + 64));
        const __m512i pl = _mm512_maddubs_epi16(_mm512_shuffle_epi8(mag, lo),
                                                _mm512_mask_sub_epi8(ylo, _mm512_testn_epi8_mask(lo, b3), _mm512_setzero_si512(), ylo));
        const __m512i ph = _mm512_maddubs_epi16(_mm512_shuffle_epi8(mag, hi),
                                                _mm512_mask_sub_epi8(yhi, _mm512_testn_epi8_mask(hi, b3), _mm512_setzero_si512(), yhi));
        const __m512i scw = _mm512_permutexvar_epi16(sel4(4 * P), sc);
        v = _mm512_dpwssd_epi32(v, pl, scw);
        v = _mm512_dpwssd_epi32(v, ph, scw);
    }
    kd_fma(w, x, v, acc);
}

/* The 1-row kernels over the per-block steps (the row's stream continues in the next row). */
#define KQ_DRIVER(T, BYTES, FINAL)                                                                   \
    VNNI static float vd_##T(const uint8_t *w, const void *xv, int64_t nb) {                        \
        const mf_q8_256 *x = xv;                                                                    \
        __m512 acc = _mm512_setzero_ps();                                                           \
        __m256 accm = _mm256_setzero_ps();                                                          \
        const int64_t pfd = mf_tune.pf_dist;                                                        \
        for (int64_t b = 0; b < nb; b++) {                                                          \
            MF_PF_STEP(w + b * BYTES, pfd, BYTES);                                                  \
            T##_step(w + b * BYTES, x + b, &acc, &accm);                                            \
        }                                                                                           \
        return FINAL(acc, accm);                                                                    \
    }
VNNI static inline float fin_min(__m512 acc, __m256 accm) {
    return _mm512_reduce_add_ps(_mm512_sub_ps(acc, _mm512_zextps256_ps512(accm)));
}
VNNI static inline float fin_plain(__m512 acc, __m256 accm) {
    (void)accm;
    return _mm512_reduce_add_ps(acc);
}

/* R rows block by block: per row exactly vd_T's arithmetic (the same bits); X loads shared.
 * 4 rows on long rows everywhere; 8 rows where the CPU's tuning row asks (mf_tune.k_vd8_min_rb). */
#define KQ_DRIVERN(NAME, T, BYTES, FINAL, R)                                                         \
    VNNI static void NAME(const uint8_t *w, size_t rb, const void *xv, int64_t nb, float *out) {     \
        const mf_q8_256 *x = xv;                                                                    \
        __m512 acc[R];                                                                              \
        __m256 accm[R];                                                                             \
        for (int r = 0; r < R; r++) { acc[r] = _mm512_setzero_ps(); accm[r] = _mm256_setzero_ps(); } \
        const int64_t pfd = MF_PF_MULTI, rowb = nb * BYTES;                                     \
        for (int64_t b = 0; b < nb; b++) {                                                          \
            MF_PF_ROWS(w + b * BYTES, R, rb, b * BYTES, rowb, pfd, BYTES);                          \
            for (int r = 0; r < R; r++) T##_step(w + r * rb + b * BYTES, x + b, &acc[r], &accm[r]);  \
        }                                                                                           \
        for (int r = 0; r < R; r++) out[r] = FINAL(acc[r], accm[r]);                                \
    }
/* a type's 1-, 4- and 8-row decode kernels vd_T, vd4_T, vd8_T */
#define KQ_KERNELS(T, BYTES, FINAL) \
    KQ_DRIVER(T, BYTES, FINAL) KQ_DRIVERN(vd4_##T, T, BYTES, FINAL, 4) KQ_DRIVERN(vd8_##T, T, BYTES, FINAL, 8)
KQ_KERNELS(q4_k, 144, fin_min)
KQ_KERNELS(q5_k, 176, fin_min)
KQ_KERNELS(q6_k, 210, fin_plain)
KQ_KERNELS(q3_k, 110, fin_plain)
KQ_KERNELS(q2_k, 84, fin_min)
KQ_KERNELS(iq4_xs, 136, fin_plain)

/* ---------------- 32-element types x Q8_32 (256-bit VNNI) ----------------
 * Per block the work is one 32-byte product and its float scale; vpdpbusd replaces the
 * maddubs + madd pair, and the 4-row kernels share X and the scale conversion. */

/* 4 f16 from 4 addresses -> the low 4 halves */
VNNI static inline __m128i ld4_f16(const uint8_t *p0, const uint8_t *p1, const uint8_t *p2, const uint8_t *p3) {
    uint16_t h0, h1, h2, h3;
    memcpy(&h0, p0, 2); memcpy(&h1, p1, 2); memcpy(&h2, p2, 2); memcpy(&h3, p3, 2);
    return _mm_cvtsi64_si128((int64_t)((uint64_t)h0 | (uint64_t)h1 << 16 | (uint64_t)h2 << 32 | (uint64_t)h3 << 48));
}
/* the same reduction order as simd_x86.h's hsum_ps (bit-identical sums) */
VNNI static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
VNNI static inline __m128 hsum4_ps(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    __m256 s = _mm256_hadd_ps(ab, cd);
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* Q8_0, 4 rows (long rows only, see quant_mm.c): w + 128 is unsigned for vpdpbusd, so
 * w = d (u - 128); one X load and one scale conversion per block serve the 4 rows, the
 * -128 d s_x term is one 4-lane FMA per block. */
VNNI static void vd4_q8_0(const uint8_t *w, size_t rb, const void *xv, int64_t nb, float *out) {
    const mf_q8_32 *x = xv;
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    __m128 cacc = _mm_setzero_ps();
    const __m256i k80 = _mm256_set1_epi8((char)0x80);
    const __m128 off = _mm_set1_ps(-128.0f);
    float sc[4];
    const int64_t pfd = MF_PF_MULTI, rowb = nb * 34;
    for (int64_t b = 0; b < nb; b++, w += 34) {
        MF_PF_ROWS(w, 4, rb, b * 34, rowb, pfd, 34);
        const __m256i y = _mm256_loadu_si256((const __m256i *)x[b].qs);
        const __m128 d4 = _mm_cvtph_ps(ld4_f16(w, w + rb, w + 2 * rb, w + 3 * rb));
        _mm_storeu_ps(sc, _mm_mul_ps(d4, _mm_set1_ps(x[b].d)));
        cacc = _mm_fmadd_ps(_mm_mul_ps(d4, off), _mm_set1_ps(x[b].s), cacc);
        for (int r = 0; r < 4; r++) {
            const __m256i q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + r * rb + 2)), k80);
            const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, y);
            a[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(sc + r), _mm256_cvtepi32_ps(p), a[r]);
        }
    }
    _mm_storeu_ps(out, _mm_add_ps(hsum4_ps(a[0], a[1], a[2], a[3]), cacc));
}

/* Q8_0: w + 128 is unsigned (one xor), so vpdpbusd applies; the 128 * d * s_x it adds is
 * taken off in float once per row */
VNNI static float vd_q8_0(const uint8_t *w, const void *xv, int64_t nb) {
    const mf_q8_32 *x = xv;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float c0 = 0, c1 = 0;
    const __m256i k80 = _mm256_set1_epi8((char)0x80);
    const int64_t pfd = mf_tune.pf_dist;
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2, w += 68) {
        MF_PF_STEP(w, pfd, 68);
        uint16_t h0, h1;
        memcpy(&h0, w, 2); memcpy(&h1, w + 34, 2);
        const float d0 = _cvtsh_ss(h0), d1 = _cvtsh_ss(h1);
        __m256i q0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 2)), k80);
        __m256i q1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 36)), k80);
        __m256i p0 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q0, _mm256_loadu_si256((const __m256i *)x[b].qs));
        __m256i p1 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q1, _mm256_loadu_si256((const __m256i *)x[b + 1].qs));
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d0 * x[b].d), _mm256_cvtepi32_ps(p0), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d1 * x[b + 1].d), _mm256_cvtepi32_ps(p1), acc1);
        c0 += d0 * x[b].s;
        c1 += d1 * x[b + 1].s;
    }
    for (; b < nb; b++, w += 34) {
        uint16_t h0;
        memcpy(&h0, w, 2);
        const float d0 = _cvtsh_ss(h0);
        __m256i q0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 2)), k80);
        __m256i p0 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q0, _mm256_loadu_si256((const __m256i *)x[b].qs));
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d0 * x[b].d), _mm256_cvtepi32_ps(p0), acc0);
        c0 += d0 * x[b].s;
    }
    __m256 a = _mm256_add_ps(acc0, acc1);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s) - 128.0f * (c0 + c1);
}

/* 32 bits -> 32 bytes, 0xFF where the bit is set: one mask op */
VNNI static inline __m256i bits32(const uint8_t *p) {
    uint32_t x;
    memcpy(&x, p, 4);
    return _mm256_movm_epi8((__mmask32)x);
}

/* Q5_0, 4 rows: as the AVX2 vd4_q5_0 (same lanes and float order, so the same bits) with
 * vpdpbusd and the 5th bits from one mask move */
VNNI static void vd4_q5_0(const uint8_t *w, size_t rb, const void *xv, int64_t nb, float *out) {
    const mf_q8_32 *x = xv;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    __m128 cacc = _mm_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0xF), b4 = _mm256_set1_epi8(0x10), sh = _mm256_set_epi64x(4, 4, 0, 0);
    const __m128 m16 = _mm_set1_ps(-16.0f);
    const uint8_t *w0 = w, *w1 = w + rb, *w2 = w + 2 * rb, *w3 = w + 3 * rb;
    float sc[4];
    const int64_t pfd = MF_PF_MULTI;
    for (int64_t b = 0; b < nb; b++, w0 += 22, w1 += 22, w2 += 22, w3 += 22) {
        MF_PF_ROWS(w0, 4, rb, b * 22, nb * 22, pfd, 22);
        const __m256i y = _mm256_loadu_si256((const __m256i *)x[b].qs);
        const __m128 d4 = _mm_cvtph_ps(ld4_f16(w0, w1, w2, w3));
        _mm_storeu_ps(sc, _mm_mul_ps(d4, _mm_set1_ps(x[b].d)));
        cacc = _mm_fmadd_ps(_mm_mul_ps(d4, m16), _mm_set1_ps(x[b].s), cacc);
#define Q50_ROW(W, A, I)                                                                            \
        {                                                                                           \
            __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)((W) + 6)));  \
            q = _mm256_ternarylogic_epi32(_mm256_srlv_epi64(q, sh), _mm256_and_si256(bits32((W) + 2), b4), m4, 0xEC); \
            const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, y);                   \
            A = _mm256_fmadd_ps(_mm256_broadcast_ss(sc + I), _mm256_cvtepi32_ps(p), A);              \
        }
        Q50_ROW(w0, a0, 0) Q50_ROW(w1, a1, 1) Q50_ROW(w2, a2, 2) Q50_ROW(w3, a3, 3)
#undef Q50_ROW
    }
    _mm_storeu_ps(out, _mm_add_ps(hsum4_ps(a0, a1, a2, a3), cacc));
}

/* Q4_1 / Q5_1, 4 rows: w = d q + m, as the AVX2 vd4_q4_1 (same bits) with vpdpbusd */
#define VD4_Q41(NAME, BYTES, QOFF, HIBITS)                                                          \
    VNNI static void NAME(const uint8_t *w, size_t rb, const void *xv, int64_t nb, float *out) {   \
        const mf_q8_32 *x = xv;                                                                    \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, macc = a0;                     \
        const __m256i m4 = _mm256_set1_epi8(0xF), b4 = _mm256_set1_epi8(0x10);                     \
        const __m256i sh = _mm256_set_epi64x(4, 4, 0, 0);                                          \
        const __m256i i0 = _mm256_set1_epi32(0), i1 = _mm256_set1_epi32(2);                        \
        const __m256i i2 = _mm256_set1_epi32(4), i3 = _mm256_set1_epi32(6);                        \
        const uint8_t *w0 = w, *w1 = w + rb, *w2 = w + 2 * rb, *w3 = w + 3 * rb;                   \
        (void)b4;                                                                                  \
        const int64_t pfd = MF_PF_MULTI;                                                       \
        for (int64_t b = 0; b < nb; b++, w0 += BYTES, w1 += BYTES, w2 += BYTES, w3 += BYTES) {     \
            MF_PF_ROWS(w0, 4, rb, b * BYTES, nb * BYTES, pfd, BYTES);                              \
            const __m256i y = _mm256_loadu_si256((const __m256i *)x[b].qs);                        \
            const __m256 xs = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)&x[b]));        \
            int32_t h0, h1, h2, h3;                                                                \
            memcpy(&h0, w0, 4); memcpy(&h1, w1, 4); memcpy(&h2, w2, 4); memcpy(&h3, w3, 4);        \
            const __m256 dm = _mm256_cvtph_ps(_mm_setr_epi32(h0, h1, h2, h3));                     \
            const __m256 sc = _mm256_mul_ps(dm, xs);                                               \
            macc = _mm256_fmadd_ps(dm, xs, macc);                                                  \
            Q41_ROW(w0, a0, i0, QOFF, HIBITS) Q41_ROW(w1, a1, i1, QOFF, HIBITS) \
            Q41_ROW(w2, a2, i2, QOFF, HIBITS) Q41_ROW(w3, a3, i3, QOFF, HIBITS)        \
        }                                                                                          \
        const __m128 c = _mm256_castps256_ps128(_mm256_permutevar8x32_ps(macc, _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7))); \
        _mm_storeu_ps(out, _mm_add_ps(hsum4_ps(a0, a1, a2, a3), c));                               \
    }
#define Q41_ROW(W, A, I, QOFF, HIBITS)                                                                          \
    {                                                                                               \
        __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)((W) + QOFF)));   \
        q = _mm256_and_si256(_mm256_srlv_epi64(q, sh), m4);                                         \
        if (HIBITS) q = _mm256_or_si256(q, _mm256_and_si256(bits32((W) + 4), b4));                  \
        const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, y);                       \
        A = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(sc, I), _mm256_cvtepi32_ps(p), A);             \
    }
VD4_Q41(vd4_q4_1, 20, 4, 0)
VD4_Q41(vd4_q5_1, 24, 8, 1)
#undef Q41_ROW

/* Q4_0, R = 4 or 8 rows, two blocks per 512-bit step: lanes 0-7 carry the even blocks, 8-15
 * the odd ones (each row's accumulator adds the two halves at the end, then the -8 d s_x
 * term). Half the vector instructions per weight of the 256-bit form; the 4- and 8-row
 * kernels do the same per-row arithmetic, so a row's bits do not depend on its group. */
#define VDZ_Q4_0(NAME, R)                                                                           \
    VNNI static void NAME(const uint8_t *w, size_t rb, const void *xv, int64_t nb, float *out) {   \
        const mf_q8_32 *x = xv;                                                                     \
        __m512 a[R];                                                                                \
        for (int r = 0; r < R; r++) a[r] = _mm512_setzero_ps();                                     \
        __m512 cacc = _mm512_setzero_ps();                                                          \
        const __m512i m4 = _mm512_set1_epi8(0xF), sh = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0);    \
        const __m512 m8 = _mm512_set1_ps(-8.0f);                                                    \
        const int64_t pfd = MF_PF_MULTI;                                                        \
        for (int64_t b = 0; b < nb; b += 2, w += 36) {                                              \
            MF_PF_ROWS(w, R, rb, b * 18, nb * 18, pfd, 36);                                         \
            const int two = b + 1 < nb;                                                             \
            const __m256i y0 = _mm256_loadu_si256((const __m256i *)x[b].qs);                        \
            const __m512i y = two ? _mm512_inserti64x4(_mm512_castsi256_si512(y0),                  \
                                        _mm256_loadu_si256((const __m256i *)x[b + 1].qs), 1)        \
                                  : _mm512_zextsi256_si512(y0);                                     \
            /* the rows' f16 scales by scalar loads (a 16-lane gather took ~30% of the kernel on \
             * Zen 4): lanes 0-7 the even block of rows 0-7, 8-15 the odd block */              \
            const __m128i z = _mm_setzero_si128();                                                  \
            const __m128i l0 = ld4_f16(w, w + rb, w + 2 * rb, w + 3 * rb);                          \
            const __m128i l1 = R == 8 ? ld4_f16(w + 4 * rb, w + 5 * rb, w + 6 * rb, w + 7 * rb) : z; \
            const __m128i h0 = two ? ld4_f16(w + 18, w + rb + 18, w + 2 * rb + 18, w + 3 * rb + 18) : z; \
            const __m128i h1 = two && R == 8 ? ld4_f16(w + 4 * rb + 18, w + 5 * rb + 18, w + 6 * rb + 18, w + 7 * rb + 18) : z; \
            const __m512 d = _mm512_cvtph_ps(_mm256_set_m128i(_mm_unpacklo_epi64(h0, h1), _mm_unpacklo_epi64(l0, l1))); \
            const __m512 xd = _mm512_insertf32x8(_mm512_set1_ps(x[b].d), _mm256_set1_ps(two ? x[b + 1].d : 0.0f), 1); \
            const __m512 xs = _mm512_insertf32x8(_mm512_set1_ps(x[b].s), _mm256_set1_ps(two ? x[b + 1].s : 0.0f), 1); \
            const __m512 sc = _mm512_mul_ps(d, xd);                                                 \
            cacc = _mm512_fmadd_ps(_mm512_mul_ps(d, m8), xs, cacc);                                 \
            for (int r = 0; r < R; r++) {                                                           \
                const uint8_t *wr = w + r * rb + 2;                                                 \
                const __m256i q0 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)wr)); \
                const __m256i q1 = two ? _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(wr + 18))) \
                                       : _mm256_setzero_si256();                                    \
                __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1);                   \
                q = _mm512_and_si512(_mm512_srlv_epi64(q, sh), m4);                                 \
                const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, y);                \
                const __m512 s = _mm512_permutexvar_ps(                                             \
                    _mm512_set_epi32(8 + r, 8 + r, 8 + r, 8 + r, 8 + r, 8 + r, 8 + r, 8 + r,        \
                                     r, r, r, r, r, r, r, r), sc);                                  \
                a[r] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(p), a[r]);                             \
            }                                                                                       \
        }                                                                                           \
        float c[16];                                                                                \
        _mm512_storeu_ps(c, cacc);                                                                  \
        for (int r = 0; r < R; r++) {                                                               \
            const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a[r]), _mm512_extractf32x8_ps(a[r], 1)); \
            out[r] = hsum8(h) + (c[r] + c[8 + r]);                                                  \
        }                                                                                           \
    }
VDZ_Q4_0(vdz4_q4_0, 4)
VDZ_Q4_0(vdz8_q4_0, 8)
const uint8_t mf_kpf_avx512[T_MAX] = {[T_Q4_K] = 1, [T_Q5_K] = 1, [T_Q6_K] = 1, [T_Q3_K] = 1, [T_Q2_K] = 1, [T_Q8_0] = 1,
                                       [T_MXFP4] = 1, [T_NVFP4] = 1, [T_IQ2_XXS] = 1, [T_IQ2_XS] = 1, [T_IQ2_S] = 1,
                                       [T_IQ3_XXS] = 1, [T_IQ3_S] = 1, [T_IQ1_S] = 1, [T_IQ1_M] = 1, [T_IQ4_XS] = 1,
                                       /* 1-row kernels: the AVX2 ones (mf_kpf_avx2) */
                                       [T_Q4_0] = 1, [T_Q5_0] = 1, [T_Q4_1] = 1, [T_Q5_1] = 1,
                                       [T_IQ4_NL] = 1};

mf_vecdot4_fn mf_vecdot8_avx512[T_MAX] = {[T_Q4_0] = vdz8_q4_0, [T_Q4_K] = vd8_q4_k, [T_Q5_K] = vd8_q5_k, [T_Q6_K] = vd8_q6_k,
                                          [T_IQ4_XS] = vd8_iq4_xs, [T_Q3_K] = vd8_q3_k, [T_Q2_K] = vd8_q2_k,
                                          [T_MXFP4] = mf_vd8_mxfp4_avx512, [T_NVFP4] = mf_vd8_nvfp4_avx512};

mf_vecdot4_fn mf_vecdot4_avx512[T_MAX] = {
    [T_Q4_0] = vdz4_q4_0, [T_Q5_0] = vd4_q5_0, [T_Q4_1] = vd4_q4_1, [T_Q5_1] = vd4_q5_1,
    [T_Q8_0] = vd4_q8_0,
    [T_Q4_K] = vd4_q4_k, [T_Q5_K] = vd4_q5_k, [T_Q6_K] = vd4_q6_k, [T_IQ4_XS] = vd4_iq4_xs,
    [T_Q3_K] = vd4_q3_k, [T_Q2_K] = vd4_q2_k,
    [T_TQ2_0] = mf_vd4_tq2_0_avx512, [T_MXFP4] = mf_vd4_mxfp4_avx512,
    [T_NVFP4] = mf_vd4_nvfp4_avx512,
};

/* ---------------- prefill, K-quants: the AVX2 kernels (quant_avx2.c) with vpdpwssd ---------
 * madd(maddubs(q, y), sv) + add becomes dpwssd(acc, maddubs(q, y), sv): the same exact int32
 * sums, so the results are bit-identical to the AVX2 kernels (tests/test_native_quant.py). */
#define KDOT(M)                                                                                        \
    VNNI static void kdot##M(const mf_kblk *w, int64_t nb, const uint8_t *xb, size_t xs, float *out) { \
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
                    s[i] = _mm256_dpwssd_epi32(s[i], _mm256_maddubs_epi16(q,                           \
                               _mm256_loadu_si256((const __m256i *)(x[i]->qs + 32 * c))), sv);         \
            }                                                                                          \
            __m256i cc = _mm256_loadu_si256((const __m256i *)k->cc);                                   \
            __m256 d = _mm256_set1_ps(k->d), dc = _mm256_set1_ps(k->dc);                               \
            for (int i = 0; i < M; i++) {                                                              \
                __m256i cr = _mm256_madd_epi16(cc, _mm256_loadu_si256((const __m256i *)x[i]->bsums));  \
                __m256 t = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s[i]), _mm256_mul_ps(dc, _mm256_cvtepi32_ps(cr))); \
                acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(x[i]->d), t, acc[i]);                          \
            }                                                                                          \
        }                                                                                              \
        for (int i = 0; i < M; i++) out[i] = hsum8(acc[i]);                                            \
    }
KDOT(4)
KDOT(1)

/* two unpacked W rows x 4 X rows, 64 weights (two chunks, their two scale vectors are adjacent
 * in sv) per 512-bit step; the halves are added in int32 at the end of the block, so the
 * sums, and with the same float steps the results, equal the AVX2 kernel's bit for bit */
VNNI static void kdot2x4(const mf_kblk *w0, const mf_kblk *w1, int64_t nb, const uint8_t *xb, size_t xs,
                         float *out0, float *out1) {
    __m256 a0[4], a1[4];
    for (int i = 0; i < 4; i++) a0[i] = a1[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const mf_kblk *k0 = w0 + b, *k1 = w1 + b;
        const mf_q8_256 *x[4];
        __m512i s0[4], s1[4];
        for (int i = 0; i < 4; i++) {
            x[i] = (const mf_q8_256 *)(xb + i * xs) + b;
            s0[i] = s1[i] = _mm512_setzero_si512();
        }
        for (int c = 0; c < 8; c += 2) {
            const __m512i q0 = _mm512_load_si512((const void *)(k0->q + 32 * c));
            const __m512i q1 = _mm512_load_si512((const void *)(k1->q + 32 * c));
            const __m512i v0 = _mm512_loadu_si512((const void *)k0->sv[c]);
            const __m512i v1 = _mm512_loadu_si512((const void *)k1->sv[c]);
            for (int i = 0; i < 4; i++) {
                const __m512i y = _mm512_load_si512((const void *)(x[i]->qs + 32 * c));
                s0[i] = _mm512_dpwssd_epi32(s0[i], _mm512_maddubs_epi16(q0, y), v0);
                s1[i] = _mm512_dpwssd_epi32(s1[i], _mm512_maddubs_epi16(q1, y), v1);
            }
        }
        const __m256i cc0 = _mm256_loadu_si256((const __m256i *)k0->cc), cc1 = _mm256_loadu_si256((const __m256i *)k1->cc);
        const __m256 d0 = _mm256_set1_ps(k0->d), dc0 = _mm256_set1_ps(k0->dc);
        const __m256 d1 = _mm256_set1_ps(k1->d), dc1 = _mm256_set1_ps(k1->dc);
        for (int i = 0; i < 4; i++) {
            const __m256i t0i = _mm256_add_epi32(_mm512_castsi512_si256(s0[i]), _mm512_extracti64x4_epi64(s0[i], 1));
            const __m256i t1i = _mm256_add_epi32(_mm512_castsi512_si256(s1[i]), _mm512_extracti64x4_epi64(s1[i], 1));
            const __m256i bs = _mm256_loadu_si256((const __m256i *)x[i]->bsums);
            const __m256 dx = _mm256_set1_ps(x[i]->d);
            __m256 t0 = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(t0i), _mm256_mul_ps(dc0, _mm256_cvtepi32_ps(_mm256_madd_epi16(cc0, bs))));
            __m256 t1 = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(t1i), _mm256_mul_ps(dc1, _mm256_cvtepi32_ps(_mm256_madd_epi16(cc1, bs))));
            a0[i] = _mm256_fmadd_ps(dx, t0, a0[i]);
            a1[i] = _mm256_fmadd_ps(dx, t1, a1[i]);
        }
    }
    for (int i = 0; i < 4; i++) {
        out0[i] = hsum8(a0[i]);
        out1[i] = hsum8(a1[i]);
    }
}

VNNI void mf_kdot_avx512(const mf_kblk *w, int64_t nb, const uint8_t *x, size_t xs, int64_t m, float *out, int64_t ostride) {
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

VNNI void mf_kdot2_avx512(const mf_kblk *w0, const mf_kblk *w1, int64_t nb, const uint8_t *x, size_t xs,
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
        mf_kdot_avx512(w0, nb, x + i * xs, xs, m - i, out0 + i * ostride, ostride);
        mf_kdot_avx512(w1, nb, x + i * xs, xs, m - i, out1 + i * ostride, ostride);
    }
}

mf_vecdot_fn mf_vecdot_avx512[T_MAX] = {
    [T_Q8_0] = vd_q8_0, [T_Q3_K] = vd_q3_k, [T_Q2_K] = vd_q2_k,
    [T_Q4_K] = vd_q4_k, [T_Q5_K] = vd_q5_k, [T_Q6_K] = vd_q6_k, [T_IQ4_XS] = vd_iq4_xs,
    [T_IQ2_XXS] = mf_vd_iq2_xxs_avx512, [T_IQ2_XS] = mf_vd_iq2_xs_avx512, [T_IQ2_S] = mf_vd_iq2_s_avx512,
    [T_IQ3_XXS] = mf_vd_iq3_xxs_avx512, [T_IQ3_S] = mf_vd_iq3_s_avx512, [T_IQ1_S] = mf_vd_iq1_s_avx512, [T_IQ1_M] = mf_vd_iq1_m_avx512,
    [T_TQ1_0] = mf_vd_tq1_0_avx512, [T_TQ2_0] = mf_vd_tq2_0_avx512, [T_MXFP4] = mf_vd_mxfp4_avx512,
    [T_NVFP4] = mf_vd_nvfp4_avx512,
};
int mf_xfmt_avx512[T_MAX] = {
    [T_Q4_0] = XF_Q8_32, [T_Q8_0] = XF_Q8_32, [T_Q3_K] = XF_Q8_256T, [T_Q2_K] = XF_Q8_256T, [T_Q5_0] = XF_Q8_32,
    [T_Q4_1] = XF_Q8_32, [T_Q5_1] = XF_Q8_32,
    [T_Q4_K] = XF_Q8_256S, [T_Q5_K] = XF_Q8_256S, [T_Q6_K] = XF_Q8_256, [T_IQ4_XS] = XF_Q8_256N,
    [T_IQ2_XXS] = XF_Q8_256, [T_IQ2_XS] = XF_Q8_256, [T_IQ2_S] = XF_Q8_256,
    [T_IQ3_XXS] = XF_Q8_256, [T_IQ3_S] = XF_Q8_256, [T_IQ1_S] = XF_Q8_256, [T_IQ1_M] = XF_Q8_256,
    [T_TQ1_0] = XF_Q8_256, [T_TQ2_0] = XF_Q8_256, [T_MXFP4] = XF_Q8_32, [T_NVFP4] = XF_Q8_32,
};

/* ---------------- prefill, 32-element types: the AVX2 bdot kernels with vpdpbusd ----------
 * dpbusd(0, q, y) gives the lanes of madd(maddubs(q, y), 1) exactly (no pair sum reaches
 * the int16 limit: |q| <= 128 after the sign trick, |y| <= 127), so the same bits. */
#define BDOT(M, SIGNED)                                                                              \
    VNNI static void bdot##M##_##SIGNED(const mf_b32 *w, int64_t nb, const uint8_t *xb, size_t xs, float *out) { \
        __m256 acc[M];                                                                               \
        for (int i = 0; i < M; i++) acc[i] = _mm256_setzero_ps();                                    \
        for (int64_t b = 0; b < nb; b++) {                                                           \
            __m256i q = _mm256_loadu_si256((const __m256i *)w[b].q);                                 \
            __m256i aq = SIGNED ? _mm256_sign_epi8(q, q) : q;                                        \
            for (int i = 0; i < M; i++) {                                                            \
                const mf_q8_32 *x = (const mf_q8_32 *)(xb + i * xs) + b;                             \
                __m256i y = _mm256_loadu_si256((const __m256i *)x->qs);                              \
                if (SIGNED) y = _mm256_sign_epi8(y, q);                                              \
                __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), aq, y);                      \
                acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(w[b].d * x->d), _mm256_cvtepi32_ps(p), acc[i]); \
            }                                                                                        \
        }                                                                                            \
        for (int i = 0; i < M; i++) out[i] = hsum8(acc[i]);                                          \
    }
BDOT(4, 0)
BDOT(1, 0)
BDOT(4, 1)
BDOT(1, 1)

VNNI void mf_bdot_avx512(const mf_b32 *w, int64_t nb, int sgn, const uint8_t *x, size_t xs, int64_t m,
                         const float *corr, float *out, int64_t ostride) {
    int64_t i = 0;
    float o[4];
    for (; i + 4 <= m; i += 4) {
        if (sgn) bdot4_1(w, nb, x + i * xs, xs, o); else bdot4_0(w, nb, x + i * xs, xs, o);
        for (int k = 0; k < 4; k++) out[(i + k) * ostride] = sgn ? o[k] : o[k] + corr[i + k];
    }
    for (; i < m; i++) {
        if (sgn) bdot1_1(w, nb, x + i * xs, xs, o); else bdot1_0(w, nb, x + i * xs, xs, o);
        out[i * ostride] = sgn ? o[0] : o[0] + corr[i];
    }
}

/* ---------------- prefill GEMM, 32-element types: 16 X rows per vector ----------------
 * X comes as mf_b32band (16 rows interleaved per 4 K positions, + 128 so it is the u8
 * operand); W is unpacked to signed int8 (Q4_0/Q5_0 offsets folded in: q - 8, q - 16) and
 * each 4-byte group is the broadcast s8 operand of vpdpbusd: 8 vpdpbusd per block give
 * sum (x + 128) * w for 16 X rows at once; the accumulator starts at -128 * sum(w), so the
 * int32 block sum is exact. Per (W row, block) then one cvt, one mul (dw * dx lanes) and an
 * fma (one more for Q4_1/Q5_1's min term c * s). Every lane does the same sequence of ops
 * for its (W row, X row) alone: results do not depend on n, the band, R or the task split. */
typedef struct { int8_t q[32]; float d, c; int32_t bias, pad; } b32g_w; /* 48 B */

const int mf_b32gemm_ok[T_MAX] = {[T_Q4_0] = 1, [T_Q4_1] = 1, [T_Q5_0] = 1, [T_Q5_1] = 1,
                                   [T_Q8_0] = 1, [T_IQ4_NL] = 1, [T_MXFP4] = 1, [T_NVFP4] = 1};

/* as mf_quantize_q8_32_avx2 (amax / 127, x * (1 / d) rounded to nearest even, d stored
 * rounded to f16, s = d * sum): the same bits, 16 values per step; the 16 rows' blocks go
 * through a 16 x 32-byte tile that 8 gathers transpose */
VNNI void mf_b32band_quant_avx512(const float *x, int64_t cols, int64_t m, mf_b32band *out) {
    const int64_t nb = cols / 32;
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(8));
    _Alignas(64) uint8_t tile[16][32];
    memset(tile, 0x80, sizeof tile); /* rows j >= m stay x = 0 (+ 128) */
    for (int64_t b = 0; b < nb; b++) {
        float dx[16] = {0}, sx[16] = {0};
        for (int64_t j = 0; j < m; j++) {
            const float *p = x + j * cols + 32 * b;
            const __m512 v0 = _mm512_loadu_ps(p), v1 = _mm512_loadu_ps(p + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            const __m512 idv = _mm512_set1_ps(id);
            const __m128i q0 = _mm512_cvtsepi32_epi8(_mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            const __m128i q1 = _mm512_cvtsepi32_epi8(_mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            const __m256i u = _mm256_xor_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(q0), q1, 1), _mm256_set1_epi8((char)0x80));
            _mm256_store_si256((__m256i *)tile[j], u);
            const __m256i sad = _mm256_sad_epu8(u, _mm256_setzero_si256());
            const __m128i h = _mm_add_epi64(_mm256_castsi256_si128(sad), _mm256_extracti128_si256(sad, 1));
            const int sum = (int)(_mm_cvtsi128_si64(h) + _mm_extract_epi64(h, 1)) - 32 * 128;
            dx[j] = _cvtsh_ss(_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT));
            sx[j] = dx[j] * (float)sum;
        }
        for (int g = 0; g < 8; g++)
            _mm512_store_si512((void *)out[b].x[g], _mm512_i32gather_epi32(_mm512_add_epi32(idx, _mm512_set1_epi32(g)), tile, 4));
        memcpy(out[b].dx, dx, sizeof dx);
        memcpy(out[b].sx, sx, sizeof sx);
    }
}

/* R W rows (w, row stride ws blocks) x one band, blocks [0, nb) -> out[16 r + j] (X row j);
 * acc: continue the sums in out (a split block range gives the same bits). H = 1 (NVFP4): a
 * block's two 16-value halves have their own scales (d, c) and biases (bias, pad), so the
 * first half's int32 sum goes into the float sum after 4 of the 8 steps */
#define B32G_HALF(R, H, A, DX, W, F)                                                                \
    if (H) {                                                                                     \
        for (int r = 0; r < R; r++) {                                                            \
            F[r] = _mm512_fmadd_ps(_mm512_mul_ps(DX, _mm512_set1_ps(W(r).d)), _mm512_cvtepi32_ps(A[r]), F[r]); \
            A[r] = _mm512_set1_epi32(W(r).pad);                                                  \
        }                                                                                        \
    }
#define B32G(R, H, NAME)                                                                         \
    VNNI static void NAME(const b32g_w *w, int64_t ws, int64_t nb, const mf_b32band *xb,         \
                          int hasc, int acc, float *out) {                                       \
        __m512 f[R];                                                                             \
        for (int r = 0; r < R; r++) f[r] = acc ? _mm512_loadu_ps(out + 16 * r) : _mm512_setzero_ps(); \
        for (int64_t b = 0; b < nb; b++) {                                                       \
            __m512i a[R];                                                                        \
            const __m512 dx = _mm512_load_ps(xb[b].dx);                                          \
            for (int r = 0; r < R; r++) a[r] = _mm512_set1_epi32(w[r * ws + b].bias);            \
            for (int g = 0; g < 8; g++) {                                                        \
                if (g == 4) { B32G_HALF(R, H, a, dx, B32G_W, f) }                                   \
                const __m512i xv = _mm512_load_si512((const void *)xb[b].x[g]);                  \
                for (int r = 0; r < R; r++) {                                                    \
                    int32_t wq;                                                                  \
                    memcpy(&wq, w[r * ws + b].q + 4 * g, 4);                                     \
                    a[r] = _mm512_dpbusd_epi32(a[r], xv, _mm512_set1_epi32(wq));                 \
                }                                                                                \
            }                                                                                    \
            for (int r = 0; r < R; r++)                                                          \
                f[r] = _mm512_fmadd_ps(_mm512_mul_ps(dx, _mm512_set1_ps(H ? w[r * ws + b].c : w[r * ws + b].d)), \
                                       _mm512_cvtepi32_ps(a[r]), f[r]);                          \
            if (hasc) {                                                                          \
                const __m512 sx = _mm512_load_ps(xb[b].sx);                                      \
                for (int r = 0; r < R; r++)                                                      \
                    f[r] = _mm512_fmadd_ps(sx, _mm512_set1_ps(w[r * ws + b].c), f[r]);           \
            }                                                                                    \
        }                                                                                        \
        for (int r = 0; r < R; r++) _mm512_storeu_ps(out + 16 * r, f[r]);                        \
    }
#define B32G_W(r) w[(r) * ws + b]
B32G(10, 0, b32g_10)
B32G(1, 0, b32g_1)
B32G(10, 1, b32gh_10)
B32G(1, 1, b32gh_1)

/* the same per lane for two bands at once (xb, xb + nb): each W broadcast serves 32 X rows;
 * out[16 r + j] band 0, out[16 (R + r) + j] band 1 */
#define B32G2(R, H, NAME)                                                                        \
    VNNI static void NAME(const b32g_w *w, int64_t ws, int64_t nb, const mf_b32band *xb,         \
                          int hasc, float *out) {                                                \
        __m512 f0[R], f1[R];                                                                     \
        for (int r = 0; r < R; r++) f0[r] = f1[r] = _mm512_setzero_ps();                         \
        for (int64_t b = 0; b < nb; b++) {                                                       \
            __m512i a0[R], a1[R];                                                                \
            const __m512 dx0 = _mm512_load_ps(xb[b].dx), dx1 = _mm512_load_ps(xb[nb + b].dx);    \
            for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_set1_epi32(w[r * ws + b].bias);   \
            for (int g = 0; g < 8; g++) {                                                        \
                if (g == 4) { B32G_HALF(R, H, a0, dx0, B32G_W, f0) B32G_HALF(R, H, a1, dx1, B32G_W, f1) } \
                const __m512i x0 = _mm512_load_si512((const void *)xb[b].x[g]);                  \
                const __m512i x1 = _mm512_load_si512((const void *)xb[nb + b].x[g]);             \
                for (int r = 0; r < R; r++) {                                                    \
                    int32_t wq;                                                                  \
                    memcpy(&wq, w[r * ws + b].q + 4 * g, 4);                                     \
                    const __m512i wv = _mm512_set1_epi32(wq);                                    \
                    a0[r] = _mm512_dpbusd_epi32(a0[r], x0, wv);                                  \
                    a1[r] = _mm512_dpbusd_epi32(a1[r], x1, wv);                                  \
                }                                                                                \
            }                                                                                    \
            for (int r = 0; r < R; r++) {                                                        \
                const __m512 d = _mm512_set1_ps(H ? w[r * ws + b].c : w[r * ws + b].d);          \
                f0[r] = _mm512_fmadd_ps(_mm512_mul_ps(dx0, d), _mm512_cvtepi32_ps(a0[r]), f0[r]); \
                f1[r] = _mm512_fmadd_ps(_mm512_mul_ps(dx1, d), _mm512_cvtepi32_ps(a1[r]), f1[r]); \
            }                                                                                    \
            if (hasc) {                                                                          \
                const __m512 sx0 = _mm512_load_ps(xb[b].sx), sx1 = _mm512_load_ps(xb[nb + b].sx); \
                for (int r = 0; r < R; r++) {                                                    \
                    const __m512 c = _mm512_set1_ps(w[r * ws + b].c);                            \
                    f0[r] = _mm512_fmadd_ps(sx0, c, f0[r]);                                      \
                    f1[r] = _mm512_fmadd_ps(sx1, c, f1[r]);                                      \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        for (int r = 0; r < R; r++) {                                                            \
            _mm512_storeu_ps(out + 16 * r, f0[r]);                                               \
            _mm512_storeu_ps(out + 16 * (R + r), f1[r]);                                         \
        }                                                                                        \
    }
B32G2(5, 0, b32g2_5)
B32G2(5, 1, b32gh2_5)

VNNI static inline void b32g_put(b32g_w *p, __m256i q, float d, float c) {
    _mm256_storeu_si256((__m256i *)p->q, q);
    /* sum of the signed q: sad of q + 128 */
    const __m256i sad = _mm256_sad_epu8(_mm256_xor_si256(q, _mm256_set1_epi8((char)0x80)), _mm256_setzero_si256());
    const __m128i h = _mm_add_epi64(_mm256_castsi256_si128(sad), _mm256_extracti128_si256(sad, 1));
    p->bias = -128 * ((int32_t)(_mm_cvtsi128_si64(h) + _mm_extract_epi64(h, 1)) - 32 * 128);
    p->d = d;
    p->c = c;
    p->pad = 0;
}
/* NVFP4: the halves' sums apart (bias for elements 0..15, pad for 16..31), d and c their scales */
VNNI static inline void b32g_put_halves(b32g_w *p, __m256i q, float d0, float d1) {
    _mm256_storeu_si256((__m256i *)p->q, q);
    const __m256i sad = _mm256_sad_epu8(_mm256_xor_si256(q, _mm256_set1_epi8((char)0x80)), _mm256_setzero_si256());
    const __m128i lo = _mm256_castsi256_si128(sad), hi = _mm256_extracti128_si256(sad, 1);
    p->bias = -128 * ((int32_t)(_mm_cvtsi128_si64(lo) + _mm_extract_epi64(lo, 1)) - 16 * 128);
    p->pad = -128 * ((int32_t)(_mm_cvtsi128_si64(hi) + _mm_extract_epi64(hi, 1)) - 16 * 128);
    p->d = d0;
    p->c = d1;
}
VNNI static inline float b32g_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
/* 16 bytes of nibbles -> elements 0..15 (low nibbles), 16..31 (high) */
VNNI static inline __m256i b32g_nib(const uint8_t *p) {
    const __m128i t = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1), _mm256_set1_epi8(0xF));
}

/* W rows [0, nrows) x 32-value blocks [0, nb) of a packed matrix (row stride rb bytes) -> o
 * (row stride os blocks; NVFP4: nb even, two per 64-value block). Q4_0, Q4_1 and Q8_0 directly (unpacking 4096x4096 Q8_0 through
 * mf_b32unpack_avx2 cost ~14% of a 512-row matmul), the others through mf_b32. */
VNNI static void b32g_unpack(int type, const uint8_t *w, size_t rb, int64_t nrows, int64_t nb, b32g_w *o, int64_t os) {
    const int bytes = mf_qtypes[type].bytes;
    for (int64_t r = 0; r < nrows; r++) {
        const uint8_t *src = w + (size_t)r * rb;
        b32g_w *p = o + r * os;
        if (type == T_Q4_0)
            for (int64_t b = 0; b < nb; b++, src += 18)
                b32g_put(p + b, _mm256_sub_epi8(b32g_nib(src + 2), _mm256_set1_epi8(8)), b32g_f16(src), 0.0f);
        else if (type == T_Q4_1)
            for (int64_t b = 0; b < nb; b++, src += 20)
                b32g_put(p + b, b32g_nib(src + 4), b32g_f16(src), b32g_f16(src + 2));
        else if (type == T_Q8_0)
            for (int64_t b = 0; b < nb; b++, src += 34)
                b32g_put(p + b, _mm256_loadu_si256((const __m256i *)(src + 2)), b32g_f16(src), 0.0f);
        else if (type == T_NVFP4)
            for (int64_t b = 0; b < nb; b += 2, src += 36) { /* one 64-value block: two bands' blocks */
                _Alignas(32) int8_t q[64];
                float d[4];
                mf_up_nvfp4_avx2(src, q, d);
                b32g_put_halves(p + b, _mm256_load_si256((const __m256i *)q), d[0], d[1]);
                b32g_put_halves(p + b + 1, _mm256_load_si256((const __m256i *)(q + 32)), d[2], d[3]);
            }
        else {
            mf_b32unpack_fn up = mf_b32unpack_avx2[type];
            const int off = type == T_Q5_0 ? 16 : 0, hasc = type == T_Q5_1;
            for (int64_t b = 0; b < nb; b++, src += bytes) {
                mf_b32 u; /* Q5_0: q - 16 (c = -16 d folded); IQ4_NL: q holds the signed values */
                up(src, &u);
                b32g_put(p + b, _mm256_sub_epi8(_mm256_loadu_si256((const __m256i *)u.q), _mm256_set1_epi8((char)off)),
                         u.d, hasc ? u.c : 0.0f);
            }
        }
    }
}

static _Thread_local tl_scratch tl_gws;

/* Y rows [0, n) x W rows [0, nrows) (nb 32-value blocks, rb bytes per row) into y (row stride
 * ys); xb: ceil(n / 16) bands of nb blocks. */
VNNI void mf_b32gemm_avx512(int type, const uint8_t *w, size_t rb, int64_t nrows, int64_t nb, const mf_b32band *xb,
                           int64_t n, float *y, int64_t ys) {
    const int hasc = type == T_Q4_1 || type == T_Q5_1, half = type == T_NVFP4;
    void (*g1)(const b32g_w *, int64_t, int64_t, const mf_b32band *, int, int, float *) = half ? b32gh_1 : b32g_1;
    void (*g10)(const b32g_w *, int64_t, int64_t, const mf_b32band *, int, int, float *) = half ? b32gh_10 : b32g_10;
    void (*g2_5)(const b32g_w *, int64_t, int64_t, const mf_b32band *, int, float *) = half ? b32gh2_5 : b32g2_5;
    const size_t bb = (size_t)mf_qtypes[type].bytes * 32 / (size_t)mf_qtypes[type].block; /* bytes per 32 values */
    const int64_t np = (nrows + 9) / 10 * 10; /* zero rows pad the last group of 10 */
    b32g_w *gw = tl_reserve(&tl_gws, (size_t)(np * nb) * sizeof(b32g_w));
    float out[10 * 16];
    if (!gw) { /* no scratch: 8 rows x 16 blocks at a time on the stack, re-unpacked per band */
        b32g_w wb[8 * 16];
        for (int64_t t = 0; t * 16 < n; t++) {
            const int64_t m = n - t * 16 < 16 ? n - t * 16 : 16;
            for (int64_t r = 0; r < nrows; r += 8) {
                const int64_t R = nrows - r < 8 ? nrows - r : 8;
                for (int64_t b = 0; b < nb; b += 16) {
                    const int64_t kb = nb - b < 16 ? nb - b : 16;
                    b32g_unpack(type, w + (size_t)r * rb + (size_t)b * bb, rb, R, kb, wb, 16);
                    for (int64_t k = 0; k < R; k++)
                        g1(wb + k * 16, 16, kb, xb + t * nb + b, hasc, b > 0, out + 16 * k);
                }
                for (int64_t j = 0; j < m; j++)
                    for (int64_t k = 0; k < R; k++) y[(t * 16 + j) * ys + r + k] = out[16 * k + j];
            }
        }
        return;
    }
    b32g_unpack(type, w, rb, nrows, nb, gw, nb);
    memset(gw + nrows * nb, 0, (size_t)((np - nrows) * nb) * sizeof(b32g_w));
    int64_t t = 0;
    for (; (t + 2) * 16 <= n; t += 2) { /* band pairs */
        const mf_b32band *xt = xb + t * nb;
        float *yt = y + t * 16 * ys;
        for (int64_t r = 0; r < nrows; r += 5) {
            const int64_t R = nrows - r < 5 ? nrows - r : 5;
            g2_5(gw + r * nb, nb, nb, xt, hasc, out);
            for (int64_t j = 0; j < 32; j++)
                for (int64_t k = 0; k < R; k++) yt[j * ys + r + k] = out[16 * (k + (j >> 4) * 5) + (j & 15)];
        }
    }
    for (; t * 16 < n; t++) {
        const int64_t m = n - t * 16 < 16 ? n - t * 16 : 16;
        const mf_b32band *xt = xb + t * nb;
        float *yt = y + t * 16 * ys;
        for (int64_t r = 0; r < nrows; r += 10) {
            const int64_t R = nrows - r < 10 ? nrows - r : 10;
            g10(gw + r * nb, nb, nb, xt, hasc, 0, out);
            for (int64_t j = 0; j < m; j++)
                for (int64_t k = 0; k < R; k++) yt[j * ys + r + k] = out[16 * k + j];
        }
    }
}

/* ---------------- K-quant prefill GEMM: 16 X rows (lanes) x R W rows ----------------
 * Per 4 K positions one zmm of X (4 int8 of each of 16 rows) and per W row a broadcast of its
 * 4 u8 codes into vpdpbusd; int32 sums per sub-block, then one cvt + FMA with the float
 * sub-block scale; the correction (mins / offsets) as vpdpwssd of bsum pairs x cc pairs; one
 * FMA with dx per block. Lanes never mix, so a row's result does not depend on the others. */


void mf_kw_from_kblk(const mf_kblk *k, int g32, mf_kw *o) {
    memcpy(o->q, k->q, 256);
    for (int g = 0; g < 16; g++)
        o->s[g] = g32 ? (g < 8 ? k->d * (float)k->sv[g][0] : 0.0f) : k->d * (float)k->sv[g / 2][(g % 2) * 8];
    for (int p = 0; p < 8; p++) /* groups of 32 (Q4_K/Q5_K: cc[2i] == cc[2i+1]): one cc per 32 */
        o->cc2[p] = g32 ? (p < 4 ? mf_pack16(k->cc[4 * p], k->cc[4 * p + 2]) : 0) : mf_pack16(k->cc[2 * p], k->cc[2 * p + 1]);
    o->dc = k->dc;
}

void mf_xband_build(const mf_q8_256 *rows, int64_t m, int64_t nb, mf_xband *o) {
    memset(o, 0, (size_t)nb * sizeof(mf_xband));
    for (int64_t b = 0; b < nb; b++)
        for (int64_t j = 0; j < m; j++) {
            const mf_q8_256 *r = rows + j * nb + b;
            for (int g = 0; g < 64; g++) memcpy(&o[b].qs[g][4 * j], r->qs + 4 * g, 4);
            const int16_t *bs = r->bsums;
            for (int p = 0; p < 8; p++) o[b].bs[p][j] = mf_pack16(bs[2 * p], bs[2 * p + 1]);
            for (int p = 0; p < 4; p++) o[b].bs32[p][j] = mf_pack16(bs[4 * p] + bs[4 * p + 1], bs[4 * p + 2] + bs[4 * p + 3]);
            o[b].dx[j] = r->d;
        }
}

#define KG_MAXR MF_KG_R
/* B bands (1 or 2) x R W rows: B*R int32 chains per step (enough to hide vpdpbusd's latency
 * at B = 2), B + R loads per B*R vpdpbusd; the totals live in out[] (one update per block) */
VNNI static inline __attribute__((always_inline)) void kgemm_core(const mf_kw *const *w, const int R, const int G,
                                                                   const int B, int64_t nb, const mf_xband *x0,
                                                                   const mf_xband *x1, float *out) {
    for (int i = 0; i < B * R; i++) _mm512_storeu_ps(out + 16 * i, _mm512_setzero_ps());
    for (int64_t b = 0; b < nb; b++) {
        const mf_xband *xb[2] = {x0 + b, B > 1 ? x1 + b : x0 + b};
        const mf_kw *k[KG_MAXR];
        __m512 f[2][KG_MAXR];
        for (int r = 0; r < R; r++) {
            k[r] = w[r] + b;
            for (int h = 0; h < B; h++) f[h][r] = _mm512_setzero_ps();
        }
        for (int g = 0; g < 256 / G; g++) {
            __m512i a[2][KG_MAXR];
            for (int r = 0; r < R; r++)
                for (int h = 0; h < B; h++) a[h][r] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int s = 0; s < G / 4; s++) {
                const int kk = g * (G / 4) + s;
                __m512i xv[2];
                for (int h = 0; h < B; h++) xv[h] = _mm512_load_si512((const void *)xb[h]->qs[kk]);
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    int32_t wv;
                    memcpy(&wv, k[r]->q + 4 * kk, 4);
                    const __m512i wb = _mm512_set1_epi32(wv);
                    for (int h = 0; h < B; h++) a[h][r] = _mm512_dpbusd_epi32(a[h][r], wb, xv[h]);
                }
            }
            for (int r = 0; r < R; r++) {
                const __m512 sc = _mm512_set1_ps(k[r]->s[g]);
                for (int h = 0; h < B; h++) f[h][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[h][r]), sc, f[h][r]);
            }
        }
        for (int h = 0; h < B; h++) {
            __m512i c[KG_MAXR];
            for (int r = 0; r < R; r++) c[r] = _mm512_setzero_si512();
            for (int p = 0; p < (G == 32 ? 4 : 8); p++) {
                const __m512i bv = _mm512_load_si512((const void *)(G == 32 ? xb[h]->bs32[p] : xb[h]->bs[p]));
                for (int r = 0; r < R; r++) c[r] = _mm512_dpwssd_epi32(c[r], bv, _mm512_set1_epi32(k[r]->cc2[p]));
            }
            const __m512 dx = _mm512_load_ps(xb[h]->dx);
            for (int r = 0; r < R; r++) {
                float *o = out + 16 * (h * R + r);
                f[h][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c[r]), _mm512_set1_ps(k[r]->dc), f[h][r]);
                _mm512_storeu_ps(o, _mm512_fmadd_ps(f[h][r], dx, _mm512_loadu_ps(o)));
            }
        }
    }
}

#define KG_FN(R, G, B) \
    VNNI static void kgemm_##R##_##G##_##B(const mf_kw *const *w, int64_t nb, const mf_xband *x0, const mf_xband *x1, float *out) { \
        kgemm_core(w, R, G, B, nb, x0, x1, out); \
    }
#define KG_FNS(R) KG_FN(R, 16, 1) KG_FN(R, 32, 1) KG_FN(R, 16, 2) KG_FN(R, 32, 2)
KG_FNS(1) KG_FNS(2) KG_FNS(3) KG_FNS(4) KG_FNS(5) KG_FNS(6)
KG_FNS(7) KG_FNS(8)
_Static_assert(MF_KG_R >= 1 && MF_KG_R <= 8, "kg_tab holds 1..8 rows");
typedef void (*kg_fn)(const mf_kw *const *, int64_t, const mf_xband *, const mf_xband *, float *);
#define KG_ROW(G, B) {NULL, kgemm_1_##G##_##B, kgemm_2_##G##_##B, kgemm_3_##G##_##B, kgemm_4_##G##_##B, \
                      kgemm_5_##G##_##B, kgemm_6_##G##_##B, kgemm_7_##G##_##B, kgemm_8_##G##_##B}
static const kg_fn kg_tab[2][2][9] = {{KG_ROW(16, 1), KG_ROW(16, 2)}, {KG_ROW(32, 1), KG_ROW(32, 2)}};

/* The same per-lane arithmetic on the first 4 rows of one band only (128-bit lanes): a call
 * with at most 4 X rows (a prompt's tail, a small expert group) does a quarter of the work and
 * gives each row the bits kgemm_core gives it (vpdpbusd, the float conversion and each FMA are
 * lane-wise; the same operands in the same order). out as kgemm_core's (lanes 4-15 untouched). */
VNNI static inline __attribute__((always_inline)) void kgemm4_core(const mf_kw *const *w, const int R, const int G,
                                                                    int64_t nb, const mf_xband *x0, float *out) {
    for (int i = 0; i < R; i++) _mm_storeu_ps(out + 16 * i, _mm_setzero_ps());
    for (int64_t b = 0; b < nb; b++) {
        const mf_xband *xb = x0 + b;
        const mf_kw *k[KG_MAXR];
        __m128 f[KG_MAXR];
        for (int r = 0; r < R; r++) {
            k[r] = w[r] + b;
            f[r] = _mm_setzero_ps();
        }
        for (int g = 0; g < 256 / G; g++) {
            __m128i a[KG_MAXR];
            for (int r = 0; r < R; r++) a[r] = _mm_setzero_si128();
#pragma GCC unroll 8
            for (int s = 0; s < G / 4; s++) {
                const int kk = g * (G / 4) + s;
                const __m128i xv = _mm_load_si128((const __m128i *)xb->qs[kk]);
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    int32_t wv;
                    memcpy(&wv, k[r]->q + 4 * kk, 4);
                    a[r] = _mm_dpbusd_epi32(a[r], _mm_set1_epi32(wv), xv);
                }
            }
            for (int r = 0; r < R; r++)
                f[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(a[r]), _mm_set1_ps(k[r]->s[g]), f[r]);
        }
        __m128i c[KG_MAXR];
        for (int r = 0; r < R; r++) c[r] = _mm_setzero_si128();
        for (int p = 0; p < (G == 32 ? 4 : 8); p++) {
            const __m128i bv = _mm_loadu_si128((const __m128i *)(G == 32 ? xb->bs32[p] : xb->bs[p]));
            for (int r = 0; r < R; r++) c[r] = _mm_dpwssd_epi32(c[r], bv, _mm_set1_epi32(k[r]->cc2[p]));
        }
        const __m128 dx = _mm_loadu_ps(xb->dx);
        for (int r = 0; r < R; r++) {
            float *o = out + 16 * r;
            f[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(c[r]), _mm_set1_ps(k[r]->dc), f[r]);
            _mm_storeu_ps(o, _mm_fmadd_ps(f[r], dx, _mm_loadu_ps(o)));
        }
    }
}

#define KG4_FN(R, G) \
    VNNI static void kgemm4_##R##_##G(const mf_kw *const *w, int64_t nb, const mf_xband *x0, float *out) { \
        kgemm4_core(w, R, G, nb, x0, out); \
    }
#define KG4_FNS(R) KG4_FN(R, 16) KG4_FN(R, 32)
KG4_FNS(1) KG4_FNS(2) KG4_FNS(3) KG4_FNS(4) KG4_FNS(5) KG4_FNS(6) KG4_FNS(7) KG4_FNS(8)
typedef void (*kg4_fn)(const mf_kw *const *, int64_t, const mf_xband *, float *);
#define KG4_ROW(G) {NULL, kgemm4_1_##G, kgemm4_2_##G, kgemm4_3_##G, kgemm4_4_##G, kgemm4_5_##G, \
                    kgemm4_6_##G, kgemm4_7_##G, kgemm4_8_##G}
static const kg4_fn kg4_tab[2][9] = {KG4_ROW(16), KG4_ROW(32)};

/* at most 4 X rows, all in x0's first lanes */
VNNI void mf_kgemm4_avx512(const mf_kw *const *w, int R, int g32, int64_t nb, const mf_xband *x0, float *out) {
    kg4_tab[g32 != 0][R](w, nb, x0, out);
}

/* out[] of an 8-row mf_kgemm_avx512 call (band h, row r, lane j at 16 * (8h + r) + j) into Y:
 * X row 16h + j's 8 values at y + (16h + j) * ys, for bands 16 rows full (m = 16 or 32). An
 * in-register 8x16 transpose per band (unpack, shuffle, two-source permute) and 256-bit stores,
 * in place of 256 scalar loads and stores (3% of a 7B's pp512 on Zen 4). */
VNNI void mf_kg_store8_avx512(const float *out, int m, float *y, int64_t ys) {
    const __m512i lo = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i hi = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    for (int h = 0; h < m / 16; h++) {
        const float *o = out + 128 * h;
        __m512 v[8], t[8], u[8];
        for (int r = 0; r < 8; r++) v[r] = _mm512_loadu_ps(o + 16 * r);
        for (int r = 0; r < 8; r += 2) t[r] = _mm512_unpacklo_ps(v[r], v[r + 1]), t[r + 1] = _mm512_unpackhi_ps(v[r], v[r + 1]);
        for (int g = 0; g < 8; g += 4) { /* lane L of u[g + c]: value 4L + c of rows g..g+3 */
            u[g] = _mm512_shuffle_ps(t[g], t[g + 2], 0x44), u[g + 1] = _mm512_shuffle_ps(t[g], t[g + 2], 0xEE);
            u[g + 2] = _mm512_shuffle_ps(t[g + 1], t[g + 3], 0x44), u[g + 3] = _mm512_shuffle_ps(t[g + 1], t[g + 3], 0xEE);
        }
        float *yh = y + 16 * h * ys;
        for (int c = 0; c < 4; c++) {
            const __m512 a = _mm512_permutex2var_ps(u[c], lo, u[4 + c]), b = _mm512_permutex2var_ps(u[c], hi, u[4 + c]);
            _mm256_storeu_ps(yh + c * ys, _mm512_castps512_ps256(a));
            _mm256_storeu_ps(yh + (4 + c) * ys, _mm512_extractf32x8_ps(a, 1));
            _mm256_storeu_ps(yh + (8 + c) * ys, _mm512_castps512_ps256(b));
            _mm256_storeu_ps(yh + (12 + c) * ys, _mm512_extractf32x8_ps(b, 1));
        }
    }
}

/* x1 NULL: one band */
VNNI void mf_kgemm_avx512(const mf_kw *const *w, int R, int g32, int64_t nb, const mf_xband *x0,
                          const mf_xband *x1, float *out) {
    kg_tab[g32 != 0][x1 != NULL][R](w, nb, x0, x1, out);
}
