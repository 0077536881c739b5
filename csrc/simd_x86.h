/* Horizontal reductions of AVX2 vectors and the IQ sign decoding, shared by the quant and op kernels.
 * target("avx2") only, so callers compiled for avx2+fma(+f16c) can inline them. */
#ifndef MEMFIT_SIMD_X86_H
#define MEMFIT_SIMD_X86_H
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <immintrin.h>

__attribute__((target("avx2"))) static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
__attribute__((target("avx2"))) static inline float hmax_ps(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
__attribute__((target("avx2"))) static inline int hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
/* ggml's ksigns_iq2xs in vector form: s holds 7-bit sign indices (in 16- or 32-bit lanes, the
 * rest of each lane zero); returns them with bit 7 set where their parity is odd (ksigns[i] =
 * i | parity(i) << 7: an even number of negated values), from a 16-entry nibble table. */
__attribute__((target("avx2"))) static inline __m256i iq_parity7(__m256i s) {
    const __m256i par = _mm256_set_epi64x((long long)0x0080800080000080, (long long)0x8000008000808000,
                                          (long long)0x0080800080000080, (long long)0x8000008000808000);
    return _mm256_or_si256(s, _mm256_shuffle_epi8(par, _mm256_and_si256(_mm256_xor_si256(s, _mm256_srli_epi16(s, 4)),
                                                                        _mm256_set1_epi16(0xF))));
}
/* 8 u32 words of 4 x 7-bit sign indices (IQ2_XXS, IQ3_XXS: | ls << 28) -> per word its 4 sign bytes */
__attribute__((target("avx2"))) static inline __m256i iq_signs4x7(__m256i a) {
    const __m256i m7 = _mm256_set1_epi32(127);
    __m256i sg = iq_parity7(_mm256_and_si256(a, m7));
    sg = _mm256_or_si256(sg, _mm256_slli_epi32(iq_parity7(_mm256_and_si256(_mm256_srli_epi32(a, 7), m7)), 8));
    sg = _mm256_or_si256(sg, _mm256_slli_epi32(iq_parity7(_mm256_and_si256(_mm256_srli_epi32(a, 14), m7)), 16));
    return _mm256_or_si256(sg, _mm256_slli_epi32(iq_parity7(_mm256_and_si256(_mm256_srli_epi32(a, 21), m7)), 24));
}
/* iq_signs4x7 with VBMI: the four 7-bit fields of each u32 to bytes (vpmultishiftqb; bit 7 is
 * the next field's, ignored) and each byte through the 128-entry ksigns table in ks0/ks1 (ggml's
 * ksigns_iq2xs: the same bytes as iq_parity7) by one vpermi2b */
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) static inline __m256i iq_signs4x7_vbmi(__m256i a, __m512i ks0,
                                                                                           __m512i ks1) {
    const __m512i f = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x352E2720150E0700LL), _mm512_castsi256_si512(a));
    return _mm512_castsi512_si256(_mm512_permutex2var_epi8(ks0, f, ks1));
}
/* The IQ vec-dots' int16 scale vector of sub-blocks 2j (lanes 0..15) and 2j+1 (16..31) from the
 * int32 lanes of s8 (only its low 256 bits are read), for vpdpwssd with 64 values' pair sums */
__attribute__((target("avx512f,avx512bw"))) static inline __m512i iq_pair_scales(__m512i s8, int j) {
    const __m512i base = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_setzero_si512(), _mm512_set1_epi16(2));
    return _mm512_permutexvar_epi16(_mm512_add_epi16(base, _mm512_set1_epi16((short)(4 * j))), s8);
}
#endif
#endif
