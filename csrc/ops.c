/* Forward-pass kernels: rmsnorm, rope (+ YaRN), softmax, gated activations (silu, gelu,
 * swiglu_oai), attention (+ sinks).
 * Each has a portable scalar path and an AVX2+FMA path chosen at run time through mf_isa
 * (the AVX-512 machines run the AVX2 path: these ops are a small share of a forward). */
#include "memfit.h"
#include "ops.h"
#include "quant_common.h" /* mf_f16_table */
#include "kv_quant.h"    /* the q8_0 / q4_0 cache types */

#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#define MF_X86 1
#include <immintrin.h>
#include "simd_x86.h"
#define MF_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

/* Elementwise work is cut into chunks of this many values for the pool; below PAR_MIN values
 * the op runs on the calling thread (the pool's wake-up would cost more than it saves). */
#define CHUNK 16384
#define PAR_MIN 65536

static inline int use_avx2(void) {
#ifdef MF_X86
    return mf_isa >= MF_ISA_AVX2;
#else
    return 0;
#endif
}

/* ------------------------------------------------------------------------------------------ */
/* AVX2 helpers                                                                                */

#ifdef MF_X86
/* exp(x), Cephes-style range reduction + degree-6 polynomial: within ~2 ulp of expf on
 * [-87.3, 88]; below -87.3 (result under FLT_MIN) it returns 0, above 88 it saturates. */
MF_AVX2 static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3365447f), hi = _mm256_set1_ps(88.0f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(under, y);
}
#endif

/* ------------------------------------------------------------------------------------------ */
/* RMSNorm                                                                                     */

typedef struct {
    const float *x, *w;
    float *out;
    int64_t d;
    float eps;
} norm_ctx;

static void rmsnorm_row_scalar(const float *x, const float *w, float *y, int64_t d, float eps) {
    double ss = 0.0;
    for (int64_t j = 0; j < d; j++) ss += (double)x[j] * x[j];
    const float s = (float)(1.0 / sqrt(ss / (double)d + (double)eps));
    if (w)
        for (int64_t j = 0; j < d; j++) y[j] = (x[j] * s) * w[j];
    else
        for (int64_t j = 0; j < d; j++) y[j] = x[j] * s;
}

#ifdef MF_X86
MF_AVX2 static void rmsnorm_row_avx2(const float *x, const float *w, float *y, int64_t d, float eps) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= d; j += 16) {
        __m256 v0 = _mm256_loadu_ps(x + j), v1 = _mm256_loadu_ps(x + j + 8);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
    }
    for (; j + 8 <= d; j += 8) {
        __m256 v0 = _mm256_loadu_ps(x + j);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
    }
    double ss = hsum_ps(_mm256_add_ps(a0, a1));
    for (; j < d; j++) ss += (double)x[j] * x[j];
    const float s = (float)(1.0 / sqrt(ss / (double)d + (double)eps));
    const __m256 vs = _mm256_set1_ps(s);
    j = 0;
    if (w) {
        for (; j + 8 <= d; j += 8)
            _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), vs),
                                                  _mm256_loadu_ps(w + j)));
        for (; j < d; j++) y[j] = (x[j] * s) * w[j];
    } else {
        for (; j + 8 <= d; j += 8) _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_loadu_ps(x + j), vs));
        for (; j < d; j++) y[j] = x[j] * s;
    }
}
#endif

static void rmsnorm_task(void *p, int64_t r) {
    const norm_ctx *c = p;
#ifdef MF_X86
    if (use_avx2()) {
        rmsnorm_row_avx2(c->x + r * c->d, c->w, c->out + r * c->d, c->d, c->eps);
        return;
    }
#endif
    rmsnorm_row_scalar(c->x + r * c->d, c->w, c->out + r * c->d, c->d, c->eps);
}

void mf_rmsnorm_f32(const float *x, const float *w, float *out, int64_t rows, int64_t d, float eps) {
    norm_ctx c = {x, w, out, d, eps};
    if (rows > 1 && rows * d >= PAR_MIN)
        mf_parallel_for(rows, rmsnorm_task, &c);
    else
        for (int64_t r = 0; r < rows; r++) rmsnorm_task(&c, r);
}

/* ------------------------------------------------------------------------------------------ */
/* RoPE                                                                                        */

typedef struct {
    const float *x;
    float *out;
    const int32_t *pos;
    int64_t heads, head_dim, n_rot;
    double base, freq_scale;
    int neox;
    const double *inv; /* [n_rot/2] base^(-2k/n_rot) / ff[k], computed once per call */
    /* YaRN: ramp[k] mixes in the extrapolated angle (NULL: none); cos/sin times mscale */
    const double *ramp;
    double mscale;
} rope_ctx;

static void rope_task(void *p, int64_t i) {
    const rope_ctx *c = p;
    const int64_t half = c->n_rot / 2, hd = c->head_dim;
    float cs[MF_ROPE_MAX_ROT / 2], sn[MF_ROPE_MAX_ROT / 2];
    /* angles in double: pos * scale reaches ~1e5 rad, where float loses ~1e-2 rad */
    const double pf = (double)c->pos[i] * c->freq_scale;
    if (c->ramp || c->mscale != 1.0) {
        const double p = (double)c->pos[i], ms = c->mscale;
        for (int64_t k = 0; k < half; k++) {
            const double ti = pf * c->inv[k], r = c->ramp ? c->ramp[k] : 0.0;
            const double th = c->ramp ? ti * (1.0 - r) + p * c->inv[k] * r : ti;
            cs[k] = (float)(cos(th) * ms);
            sn[k] = (float)(sin(th) * ms);
        }
    } else {
        for (int64_t k = 0; k < half; k++) {
            const double th = pf * c->inv[k];
            cs[k] = (float)cos(th);
            sn[k] = (float)sin(th);
        }
    }
    for (int64_t h = 0; h < c->heads; h++) {
        const float *x = c->x + (i * c->heads + h) * hd;
        float *y = c->out + (i * c->heads + h) * hd;
        if (c->neox) {
            for (int64_t k = 0; k < half; k++) {
                const float x0 = x[k], x1 = x[k + half];
                y[k] = x0 * cs[k] - x1 * sn[k];
                y[k + half] = x0 * sn[k] + x1 * cs[k];
            }
        } else {
            for (int64_t k = 0; k < half; k++) {
                const float x0 = x[2 * k], x1 = x[2 * k + 1];
                y[2 * k] = x0 * cs[k] - x1 * sn[k];
                y[2 * k + 1] = x0 * sn[k] + x1 * cs[k];
            }
        }
        if (y != x && c->n_rot < hd) memcpy(y + c->n_rot, x + c->n_rot, (size_t)(hd - c->n_rot) * sizeof(float));
    }
}

void mf_rope_yarn_f32(const float *x, float *out, const int32_t *pos, int64_t n, int64_t heads,
                      int64_t head_dim, int64_t n_rot, double base, double freq_scale, int neox,
                      const float *freq_factors, double ext_factor, double attn_factor,
                      double corr_lo, double corr_hi) {
    double inv[MF_ROPE_MAX_ROT / 2], ramp[MF_ROPE_MAX_ROT / 2];
    for (int64_t k = 0; k < n_rot / 2; k++) {
        inv[k] = pow(base, -2.0 * (double)k / (double)n_rot);
        if (freq_factors) inv[k] /= (double)freq_factors[k];
    }
    double mscale = attn_factor;
    if (ext_factor != 0.0) {
        /* pair k is ggml's i0 = 2k: its ramp is at i0 / 2 = k */
        const double w = corr_hi - corr_lo > 0.001 ? corr_hi - corr_lo : 0.001;
        for (int64_t k = 0; k < n_rot / 2; k++) {
            const double y = ((double)k - corr_lo) / w;
            ramp[k] = (1.0 - (y < 0.0 ? 0.0 : y > 1.0 ? 1.0 : y)) * ext_factor;
        }
        mscale *= 1.0 + 0.1 * log(1.0 / freq_scale);
    }
    rope_ctx c = {x, out, pos, heads, head_dim, n_rot, base, freq_scale, neox, inv,
                  ext_factor != 0.0 ? ramp : NULL, mscale};
    if (n >= 4 && n * heads * head_dim >= PAR_MIN / 4)
        mf_parallel_for(n, rope_task, &c);
    else
        for (int64_t i = 0; i < n; i++) rope_task(&c, i);
}

void mf_rope_f32(const float *x, float *out, const int32_t *pos, int64_t n, int64_t heads,
                 int64_t head_dim, int64_t n_rot, double base, double freq_scale, int neox,
                 const float *freq_factors) {
    mf_rope_yarn_f32(x, out, pos, n, heads, head_dim, n_rot, base, freq_scale, neox, freq_factors, 0.0, 1.0,
                     0.0, 0.0);
}

/* ------------------------------------------------------------------------------------------ */
/* Softmax                                                                                     */

typedef struct {
    const float *x;
    float *out;
    int64_t k;
} softmax_ctx;

static void softmax_row_scalar(const float *x, float *y, int64_t k) {
    float m = -INFINITY;
    for (int64_t j = 0; j < k; j++) m = x[j] > m ? x[j] : m;
    double s = 0.0;
    for (int64_t j = 0; j < k; j++) {
        const float e = expf(x[j] - m);
        y[j] = e;
        s += e;
    }
    const float inv = (float)(1.0 / s);
    for (int64_t j = 0; j < k; j++) y[j] *= inv;
}

#ifdef MF_X86
MF_AVX2 static void softmax_row_avx2(const float *x, float *y, int64_t k) {
    __m256 vm = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= k; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(x + j));
    float m = hmax_ps(vm);
    for (; j < k; j++) m = x[j] > m ? x[j] : m;
    vm = _mm256_set1_ps(m);
    __m256 vs = _mm256_setzero_ps();
    for (j = 0; j + 8 <= k; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm));
        _mm256_storeu_ps(y + j, e);
        vs = _mm256_add_ps(vs, e);
    }
    double s = hsum_ps(vs);
    for (; j < k; j++) {
        const float e = expf(x[j] - m);
        y[j] = e;
        s += e;
    }
    const float inv = (float)(1.0 / s);
    const __m256 vi = _mm256_set1_ps(inv);
    for (j = 0; j + 8 <= k; j += 8) _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_loadu_ps(y + j), vi));
    for (; j < k; j++) y[j] *= inv;
}
#endif

static void softmax_task(void *p, int64_t r) {
    const softmax_ctx *c = p;
#ifdef MF_X86
    if (use_avx2()) {
        softmax_row_avx2(c->x + r * c->k, c->out + r * c->k, c->k);
        return;
    }
#endif
    softmax_row_scalar(c->x + r * c->k, c->out + r * c->k, c->k);
}

void mf_softmax_f32(const float *x, float *out, int64_t rows, int64_t k) {
    softmax_ctx c = {x, out, k};
    if (rows > 1 && rows * k >= PAR_MIN)
        mf_parallel_for(rows, softmax_task, &c);
    else
        for (int64_t r = 0; r < rows; r++) softmax_task(&c, r);
}

/* ------------------------------------------------------------------------------------------ */
/* Sigmoid: out = 1 / (1 + expf(-x)), one scalar expf per value (the router's and the shared
 * expert's gates: a few values per token, so one definition for every ISA). */
void mf_sigmoid_f32(const float *x, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = 1.0f / (1.0f + expf(-x[i]));
}

/* ------------------------------------------------------------------------------------------ */
/* Gated activations. gelu_tanh(g) = 0.5 g (1 + tanh(y)) = g / (1 + exp(-2y)),
 * y = sqrt(2/pi) (g + 0.044715 g^3); the sigmoid form avoids cancellation for g < 0. */

#define GELU_C 0.7978845608028654f
#define GELU_A 0.044715f

enum { ACT_SILU = 0, ACT_GELU = 1, ACT_SWIGLU_OAI = 2 };

typedef struct {
    const float *g, *u;
    float *out;
    int64_t n;
    int act;            /* ACT_* */
    float alpha, limit; /* ACT_SWIGLU_OAI */
} gate_ctx;

static void swiglu_oai_scalar(const float *g, const float *u, float *y, int64_t n, float alpha, float limit) {
    for (int64_t j = 0; j < n; j++) {
        const float x = limit < g[j] ? limit : g[j]; /* std::min and std::clamp: NaN stays NaN */
        const float c = u[j] < -limit ? -limit : limit < u[j] ? limit : u[j];
        y[j] = x / (1.0f + expf(alpha * -x)) * (c + 1.0f);
    }
}

static void gate_scalar(const float *g, const float *u, float *y, int64_t n, int gelu) {
    if (gelu) {
        for (int64_t j = 0; j < n; j++) {
            const float x = g[j];
            const float t = GELU_C * (x + GELU_A * x * x * x);
            y[j] = x * u[j] / (1.0f + expf(-2.0f * t));
        }
    } else {
        for (int64_t j = 0; j < n; j++) y[j] = g[j] * u[j] / (1.0f + expf(-g[j]));
    }
}

#ifdef MF_X86
MF_AVX2 static void gate_avx2(const float *g, const float *u, float *y, int64_t n, int gelu) {
    const __m256 one = _mm256_set1_ps(1.0f);
    int64_t j = 0;
    if (gelu) {
        const __m256 c2 = _mm256_set1_ps(-2.0f * GELU_C), a = _mm256_set1_ps(GELU_A);
        for (; j + 8 <= n; j += 8) {
            __m256 x = _mm256_loadu_ps(g + j);
            __m256 x2 = _mm256_mul_ps(x, x);
            __m256 t = _mm256_mul_ps(c2, _mm256_fmadd_ps(_mm256_mul_ps(a, x2), x, x));
            __m256 num = _mm256_mul_ps(x, _mm256_loadu_ps(u + j));
            _mm256_storeu_ps(y + j, _mm256_div_ps(num, _mm256_add_ps(one, exp8(t))));
        }
    } else {
        const __m256 neg = _mm256_set1_ps(-0.0f);
        for (; j + 8 <= n; j += 8) {
            __m256 x = _mm256_loadu_ps(g + j);
            __m256 num = _mm256_mul_ps(x, _mm256_loadu_ps(u + j));
            _mm256_storeu_ps(y + j, _mm256_div_ps(num, _mm256_add_ps(one, exp8(_mm256_xor_ps(x, neg)))));
        }
    }
    gate_scalar(g + j, u + j, y + j, n - j, gelu);
}

/* min_ps / max_ps return their second operand on NaN: with the input second, a NaN gate or up
 * stays NaN, as in the scalar form */
MF_AVX2 static void swiglu_oai_avx2(const float *g, const float *u, float *y, int64_t n, float alpha, float limit) {
    const __m256 one = _mm256_set1_ps(1.0f), na = _mm256_set1_ps(-alpha);
    const __m256 hi = _mm256_set1_ps(limit), lo = _mm256_set1_ps(-limit);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 x = _mm256_min_ps(hi, _mm256_loadu_ps(g + j));
        const __m256 c = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_loadu_ps(u + j)));
        const __m256 glu = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_mul_ps(na, x))));
        _mm256_storeu_ps(y + j, _mm256_mul_ps(glu, _mm256_add_ps(c, one)));
    }
    swiglu_oai_scalar(g + j, u + j, y + j, n - j, alpha, limit);
}
#endif

static void gate_task(void *p, int64_t ci) {
    const gate_ctx *c = p;
    const int64_t j0 = ci * CHUNK, len = c->n - j0 < CHUNK ? c->n - j0 : CHUNK;
#ifdef MF_X86
    if (use_avx2()) {
        if (c->act == ACT_SWIGLU_OAI) swiglu_oai_avx2(c->g + j0, c->u + j0, c->out + j0, len, c->alpha, c->limit);
        else gate_avx2(c->g + j0, c->u + j0, c->out + j0, len, c->act == ACT_GELU);
        return;
    }
#endif
    if (c->act == ACT_SWIGLU_OAI) swiglu_oai_scalar(c->g + j0, c->u + j0, c->out + j0, len, c->alpha, c->limit);
    else gate_scalar(c->g + j0, c->u + j0, c->out + j0, len, c->act == ACT_GELU);
}

static void gate_run_ex(const float *g, const float *u, float *out, int64_t n, int act, float alpha, float limit) {
    gate_ctx c = {g, u, out, n, act, alpha, limit};
    const int64_t chunks = (n + CHUNK - 1) / CHUNK;
    if (n >= PAR_MIN)
        mf_parallel_for(chunks, gate_task, &c);
    else
        for (int64_t i = 0; i < chunks; i++) gate_task(&c, i);
}

static void gate_run(const float *g, const float *u, float *out, int64_t n, int gelu) {
    gate_run_ex(g, u, out, n, gelu ? ACT_GELU : ACT_SILU, 0.0f, 0.0f);
}

void mf_swiglu_oai_f32(const float *g, const float *u, float *out, int64_t n, float alpha, float limit) {
    gate_run_ex(g, u, out, n, ACT_SWIGLU_OAI, alpha, limit);
}

void mf_silu_mul_f32(const float *g, const float *u, float *out, int64_t n) { gate_run(g, u, out, n, 0); }

/* Each row of n values (n a power of two) times the orthonormal Sylvester Walsh-Hadamard
 * matrix, as a fast transform: scaled by `scale` first, then log2(n) butterfly passes
 * (a + b, a - b), one row at a time, so a row's bits never depend on the other rows
 * (kv/quant.py rotate: the quantized KV cache's rotation; its numpy form gives the same bits).
 * out may be x. */
void mf_fwht_f32(const float *x, float *out, int64_t rows, int64_t n, float scale) {
    for (int64_t r = 0; r < rows; r++) {
        float *y = out + r * n;
        const float *xr = x + r * n;
        for (int64_t i = 0; i < n; i++) y[i] = xr[i] * scale;
        for (int64_t h = 1; h < n; h *= 2)
            for (int64_t j0 = 0; j0 < n; j0 += 2 * h)
                for (int64_t j = j0; j < j0 + h; j++) {
                    const float a = y[j], b = y[j + h];
                    y[j] = a + b;
                    y[j + h] = a - b;
                }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* float16 rounding of float32 values (the f16 KV cache and f16 Q of llama.cpp's flash path).  */

static float round_f16_scalar(float f) {
    uint32_t u, a;
    memcpy(&u, &f, 4);
    a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) return f;                 /* inf, nan */
    if (a >= 0x477ff000u) u = (u & 0x80000000u) | 0x7f800000u; /* >= 65520 rounds to inf */
    else if (a < 0x38800000u) {                      /* below 2^-14: f16 subnormal, step 2^-24 */
        float m = nearbyintf(fabsf(f) * 16777216.0f) * (1.0f / 16777216.0f);
        memcpy(&a, &m, 4);
        u = (u & 0x80000000u) | a;
    } else {                                         /* keep 10 mantissa bits, ties to even */
        a = (a + 0xfffu + ((a >> 13) & 1u)) & ~0x1fffu;
        u = (u & 0x80000000u) | a;
    }
    memcpy(&f, &u, 4);
    return f;
}

#ifdef MF_X86
__attribute__((target("avx2,fma,f16c"))) static void round_f16_avx2(const float *x, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT)));
    for (; i < n; i++) out[i] = round_f16_scalar(x[i]);
}
#endif

/* float16 bits of a float32 (IEEE round to nearest even): the f16 K/V cache's store path */
static uint16_t f16_bits_scalar(float f) {
    float r = round_f16_scalar(f); /* exactly representable now: only re-encode */
    uint32_t u;
    memcpy(&u, &r, 4);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) return sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0u); /* inf, nan */
    if (a < 0x38800000u) {                                 /* f16 subnormal or zero: units of 2^-24 */
        float m;
        memcpy(&m, &a, 4);
        return sign | (uint16_t)(m * 16777216.0f);
    }
    return sign | (uint16_t)(((a >> 23) - 112) << 10) | (uint16_t)((a >> 13) & 0x3ffu);
}

#ifdef MF_X86
MF_AVX2 static int64_t f32_to_f16_avx2(const float *x, uint16_t *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    return i;
}
#endif

void mf_f32_to_f16(const float *x, uint16_t *out, int64_t n) {
    int64_t i = 0;
#ifdef MF_X86
    if (use_avx2()) i = f32_to_f16_avx2(x, out, n);
#endif
    for (; i < n; i++) out[i] = f16_bits_scalar(x[i]);
}

typedef struct { const float *x; float *out; int64_t n; } r16_ctx;

static void r16_run(const float *x, float *out, int64_t n) {
#ifdef MF_X86
    if (use_avx2()) { round_f16_avx2(x, out, n); return; }
#endif
    for (int64_t i = 0; i < n; i++) out[i] = round_f16_scalar(x[i]);
}

static void r16_task(void *p, int64_t t) {
    const r16_ctx *c = p;
    const int64_t i0 = t * CHUNK, m = c->n - i0 < CHUNK ? c->n - i0 : CHUNK;
    r16_run(c->x + i0, c->out + i0, m);
}

void mf_round_f16_f32(const float *x, float *out, int64_t n) {
    if (n < PAR_MIN) { r16_run(x, out, n); return; }
    r16_ctx c = {x, out, n};
    mf_parallel_for((n + CHUNK - 1) / CHUNK, r16_task, &c);
}
void mf_gelu_mul_f32(const float *g, const float *u, float *out, int64_t n) { gate_run(g, u, out, n, 1); }

/* ------------------------------------------------------------------------------------------ */
/* Attention: one task per (query row, q head); keys in blocks of KB with an online softmax
 * (running max m, running sum l, accumulator acc[Dv]), so no T-sized buffer exists. */

#define KB 64
#define HG 4 /* q heads per task at most (they share one kv head) */

static inline int visible(const mf_attn_args *a, int64_t qp, int64_t t) {
    const int64_t kp = a->kv_pos[t];
    return kp <= qp && (a->window <= 0 || qp - kp < a->window);
}

static inline float cap(const mf_attn_args *a, float s) {
    return a->softcap > 0.0f ? a->softcap * tanhf(s / a->softcap) : s;
}

#define KV_T float
#define KV_FN(name) name##_f32
#define KV_LD8(p) _mm256_loadu_ps(p)
#define KV_LD1(p) (*(p))
#include "attn_kv.h"
#undef KV_T
#undef KV_FN
#undef KV_LD8
#undef KV_LD1

#define KV_T uint16_t
#define KV_FN(name) name##_f16
#define KV_LD8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define KV_LD1(p) mf_f16_table[*(p)]
#include "attn_kv.h"
#undef KV_T
#undef KV_FN
#undef KV_LD8
#undef KV_LD1

typedef struct {
    const mf_attn_args *a;
    int64_t hc, cpg; /* heads per task, tasks per kv head */
} attn_ctx;

static void attn_task(void *p, int64_t task) {
    const attn_ctx *c = p;
    const mf_attn_args *a = c->a;
    const int64_t G = a->Hq / a->Hkv, per_row = a->Hkv * c->cpg;
    const int64_t i = task / per_row, r = task % per_row, g = r / c->cpg, ch = r % c->cpg;
    const int64_t h0 = g * G + ch * c->hc, nh = G - ch * c->hc < c->hc ? G - ch * c->hc : c->hc;
#ifdef MF_X86
    if (use_avx2()) {
        if (a->kv_f16) attn_task_avx2_f16(a, i, h0, nh);
        else attn_task_avx2_f32(a, i, h0, nh);
        return;
    }
#endif
    for (int64_t hh = 0; hh < nh; hh++) {
        if (a->kv_f16) attn_task_scalar_f16(a, i, h0 + hh);
        else attn_task_scalar_f32(a, i, h0 + hh);
    }
}

static void fa16_task(void *p, int64_t task);
extern int mf_attn_ggml_fa;

void mf_attention_f32(const mf_attn_args *a) {
    if (a->kv_f16 && mf_attn_ggml_fa) { /* llama.cpp's flash-attention order (below) */
        const int64_t tasks = a->n * a->Hq;
        if (tasks > 1 && a->n * a->Hq * a->T * (a->D + a->Dv) >= PAR_MIN)
            mf_parallel_for(tasks, fa16_task, (void *)a);
        else
            for (int64_t t = 0; t < tasks; t++) fa16_task((void *)a, t);
        return;
    }
    /* group up to HG q heads of one kv head per task, but keep >= 2 tasks per thread */
    const int64_t G = a->Hq / a->Hkv, want = 2 * (int64_t)mf_n_threads();
    int64_t hc = G < HG ? G : HG;
    while (hc > 1 && a->n * a->Hkv * ((G + hc - 1) / hc) < want) hc--;
    attn_ctx c = {a, hc, (G + hc - 1) / hc};
    const int64_t tasks = a->n * a->Hkv * c.cpg;
    if (tasks > 1 && a->n * a->Hq * a->T * (a->D + a->Dv) >= PAR_MIN)
        mf_parallel_for(tasks, attn_task, &c);
    else
        for (int64_t t = 0; t < tasks; t++) attn_task(&c, t);
}

/* ------------------------------------------------------------------------------------------ */
/* Paged attention (ops.h): the tasks of mf_attention_f32, keys through per-row block tables. */

typedef struct {
    const mf_paged_args *pa;
    mf_attn_args a; /* shapes, scale and softcap for the shared block kernel */
    int64_t hc, cpg;
} paged_ctx;

static void paged_task(void *p, int64_t task) {
    const paged_ctx *c = p;
    const mf_paged_args *pa = c->pa;
    const int64_t G = pa->Hq / pa->Hkv, per_row = pa->Hkv * c->cpg;
    const int64_t i = task / per_row, r = task % per_row, g = r / c->cpg, ch = r % c->cpg;
    const int64_t h0 = g * G + ch * c->hc, nh = G - ch * c->hc < c->hc ? G - ch * c->hc : c->hc;
#ifdef MF_X86
    if (use_avx2()) {
        if (pa->kv_type == MF_KV_F16) paged_task_avx2_f16(pa, &c->a, i, h0, nh);
        else paged_task_avx2_f32(pa, &c->a, i, h0, nh);
        return;
    }
#endif
    for (int64_t hh = 0; hh < nh; hh++) {
        if (pa->kv_type == MF_KV_F16) paged_task_scalar_f16(pa, i, h0 + hh);
        else paged_task_scalar_f32(pa, i, h0 + hh);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* llama.cpp's numerics for an f16 cache (mf_attn_ggml_fa, the default): ggml's CPU flash
 * attention (ggml_compute_forward_flash_attn_ext_f16_one_chunk), which llama-server and
 * llama-perplexity run by default ("auto"): the keys one by one in position order, the running
 * max M and sum S updated per key, the V accumulator kept in f16 and rounded at every key
 * (ggml_vec_scale_f16 / ggml_vec_mad_f16), the sink after the keys, out = acc / S. Against
 * llama.cpp on an all-F32 file this agrees to ~1e-6 in the logits where the f32-accumulating
 * blocked kernels above differ by ~1e-3 (benchmarks/attn_numerics_probe.py). One task per
 * (query row, q head); a row's result depends on its own keys only. */

int mf_attn_ggml_fa = 1;

#ifdef MF_X86
MF_AVX2 static float fa_dot_avx2(const float *q, const uint16_t *k, int64_t D) { return dot1_avx2_f16(q, k, D); }
#endif

static inline float fa_dot(const float *q, const uint16_t *k, int64_t D) {
#ifdef MF_X86
    if (use_avx2()) return fa_dot_avx2(q, k, D);
#endif
    float d = 0.0f;
    for (int64_t j = 0; j < D; j++) d += q[j] * mf_f16_table[k[j]];
    return d;
}

#ifdef MF_X86
MF_AVX2 static int64_t fa_scale_avx2(uint16_t *acc, int64_t n, float ms) {
    const __m256 vm = _mm256_set1_ps(ms);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(acc + j)));
        _mm_storeu_si128((__m128i *)(acc + j), _mm256_cvtps_ph(_mm256_mul_ps(a, vm), _MM_FROUND_TO_NEAREST_INT));
    }
    return j;
}

MF_AVX2 static int64_t fa_mad_avx2(uint16_t *acc, const uint16_t *v, int64_t n, float vs) {
    const __m256 vv = _mm256_set1_ps(vs);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(acc + j)));
        const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(v + j)));
        _mm_storeu_si128((__m128i *)(acc + j), _mm256_cvtps_ph(_mm256_fmadd_ps(x, vv, a), _MM_FROUND_TO_NEAREST_INT));
    }
    return j;
}
#endif

static void fa_scale(uint16_t *acc, int64_t n, float ms) {
    int64_t j = 0;
#ifdef MF_X86
    if (use_avx2()) j = fa_scale_avx2(acc, n, ms);
#endif
    for (; j < n; j++) acc[j] = f16_bits_scalar(mf_f16_table[acc[j]] * ms);
}

static void fa_mad(uint16_t *acc, const uint16_t *v, int64_t n, float vs) {
    int64_t j = 0;
#ifdef MF_X86
    if (use_avx2()) j = fa_mad_avx2(acc, v, n, vs);
#endif
    for (; j < n; j++) acc[j] = f16_bits_scalar(mf_f16_table[acc[j]] + mf_f16_table[v[j]] * vs);
}

/* scores q.k of nb key rows (before the scale), 4 rows per pass where AVX2 runs */
#ifdef MF_X86
MF_AVX2 static int fa_scores_avx2(const float *q, const uint16_t *const *k, int nb, int64_t D, float *sc) {
    int b = 0;
    for (; b + 4 <= nb; b += 4) _mm_storeu_ps(sc + b, dot4_avx2_f16(q, k[b], k[b + 1], k[b + 2], k[b + 3], D));
    return b;
}
#endif

static void fa_scores(const float *q, const uint16_t *const *k, int nb, int64_t D, float *sc) {
    int b = 0;
#ifdef MF_X86
    if (use_avx2()) b = fa_scores_avx2(q, k, nb, D, sc);
#endif
    for (; b < nb; b++) sc[b] = fa_dot(q, k[b], D);
}

/* the running state of one query row and head over its keys, in order */
typedef struct {
    float M, S;
    uint16_t acc[MF_ATTN_MAX_DIM];
} fa_state;

/* fa_keys' state update for nb scores sc (before the scale): per key, the factor the
 * accumulator is scaled by first (1: not scaled) and the weight its V row is added with */
static void fa_step(float *M, float *S, const float *sc, int nb, float scale, float softcap, float *ms_out,
                    float *vs_out) {
    for (int b = 0; b < nb; b++) {
        float s = sc[b] * scale;
        if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
        float ms = 1.0f, vs = 1.0f;
        if (s > *M) {
            const float m_old = *M;
            *M = s;
            ms = expf(m_old - *M);
        } else {
            vs = expf(s - *M);
        }
        *S = *S * ms + vs;
        ms_out[b] = ms;
        vs_out[b] = vs;
    }
}

/* out = acc / S with the sink (fa_finish on an accumulator already in out) */
static void fa_finish_f32(float M, float S, const float *sink, int64_t Dv, float *o) {
    if (sink) {
        float ms = 1.0f, vs = 1.0f;
        if (*sink > M) {
            ms = expf(M - *sink);
            for (int64_t j = 0; j < Dv; j++) o[j] *= ms;
        } else {
            vs = expf(*sink - M);
        }
        S = S * ms + vs;
    }
    const float inv = S == 0.0f ? 0.0f : 1.0f / S;
    for (int64_t j = 0; j < Dv; j++) o[j] *= inv;
}

static void fa_keys(fa_state *st, const float *sc, const uint16_t *const *v, int nb, int64_t Dv, float scale,
                    float softcap) {
    float ms[KB], vs[KB];
    fa_step(&st->M, &st->S, sc, nb, scale, softcap, ms, vs);
    for (int b = 0; b < nb; b++) {
        if (ms[b] != 1.0f) fa_scale(st->acc, Dv, ms[b]); /* (scaling by 1 leaves f16 values as they are) */
        fa_mad(st->acc, v[b], Dv, vs[b]);
    }
}

static void fa_finish(const fa_state *st, const float *sink, int64_t Dv, float *o) {
    for (int64_t j = 0; j < Dv; j++) o[j] = mf_f16_table[st->acc[j]];
    fa_finish_f32(st->M, st->S, sink, Dv, o);
}

static void fa16_paged_task(void *p, int64_t task) {
    const mf_paged_args *pa = p;
    const int64_t i = task / pa->Hq, h = task % pa->Hq;
    const int64_t D = pa->D, Dv = pa->Dv, Hkv = pa->Hkv, g = h / (pa->Hq / Hkv), qp = pa->q_pos[i];
    const int64_t bs = pa->bs, lo = paged_lo_f16(pa, qp);
    const int32_t *tab = pa->tables + pa->q_tab[i];
    const float *q = pa->q + (i * pa->Hq + h) * D;
    fa_state st = {.M = -INFINITY, .S = 0.0f};
    memset(st.acc, 0, (size_t)Dv * sizeof(uint16_t));
    const uint16_t *kr[KB], *vr[KB];
    float sc[KB];
    for (int64_t t0 = lo; t0 <= qp; t0 += KB) {
        const int nb = (int)(qp + 1 - t0 < KB ? qp + 1 - t0 : KB);
        for (int b = 0; b < nb; b++) {
            const int64_t t = t0 + b, row = (int64_t)tab[t / bs] * bs + t % bs;
            kr[b] = (const uint16_t *)pa->k + (row * Hkv + g) * D;
            vr[b] = pa->v ? (const uint16_t *)pa->v + (row * Hkv + g) * Dv : kr[b]; /* V inside K */
        }
        fa_scores(q, kr, nb, D, sc);
        fa_keys(&st, sc, vr, nb, Dv, pa->scale, pa->softcap);
    }
    fa_finish(&st, pa->sinks ? pa->sinks + h : NULL, Dv, pa->out + (i * pa->Hq + h) * Dv);
}

/* the same for the contiguous kernel (mf_attention_f32 with kv_f16): the visible keys of 0..T-1 */
static void fa16_task(void *p, int64_t task) {
    const mf_attn_args *a = p;
    const int64_t i = task / a->Hq, h = task % a->Hq;
    const int64_t D = a->D, Dv = a->Dv, Hkv = a->Hkv, g = h / (a->Hq / Hkv), qp = a->q_pos[i];
    const float *q = a->q + (i * a->Hq + h) * D;
    fa_state st = {.M = -INFINITY, .S = 0.0f};
    memset(st.acc, 0, (size_t)Dv * sizeof(uint16_t));
    const uint16_t *kr[KB], *vr[KB];
    float sc[KB];
    int nb = 0;
    for (int64_t t = 0; t < a->T; t++) {
        if (!visible(a, qp, t)) continue;
        kr[nb] = (const uint16_t *)a->k + (t * Hkv + g) * D;
        vr[nb] = (const uint16_t *)a->v + (t * Hkv + g) * Dv;
        if (++nb == KB) {
            fa_scores(q, kr, nb, D, sc);
            fa_keys(&st, sc, vr, nb, Dv, a->scale, a->softcap);
            nb = 0;
        }
    }
    if (nb) {
        fa_scores(q, kr, nb, D, sc);
        fa_keys(&st, sc, vr, nb, Dv, a->scale, a->softcap);
    }
    fa_finish(&st, a->sinks ? a->sinks + h : NULL, Dv, a->out + (i * a->Hq + h) * Dv);
}

/* The heads of one KV group together, with fa16_paged_task's arithmetic per (query row, head)
 * bit for bit: FA_SB keys at a time are converted from f16 to f32 once for every head of the
 * task (F16C conversion is exact, and the dots run in dot4/dot1's order on the same values:
 * the scores of the same key groups of four), each head's softmax state is stepped key by key
 * (fa_step: fa_keys' scalar arithmetic), and its f16 accumulator is held in vector registers as
 * f32 values rounded to f16 after every update (a vcvtps2ph / vcvtph2ps round trip: the values
 * fa_scale and fa_mad store). Lanes are independent, so 8-wide (AVX2) and 16-wide (AVX-512)
 * give the same bits. The sharing is what pays: K and V rows are converted once per group
 * instead of once per head, and the accumulator is not stored and reloaded at every key. */
#define FA_SB 16

#define FA_QT 4 /* query rows per task (fa16g_task): their K/V rows converted once for them all */

typedef struct {
    const mf_paged_args *pa;
    int64_t hc, cpg; /* heads per task, tasks per KV group */
    int64_t qt; /* query rows per task (<= FA_QT), run by fa16g_rows in stretches of one sequence and one lo */
} fag_ctx;

#ifdef MF_X86
#define MF_AVX512F __attribute__((target("avx512f,avx512vl,avx2,fma,f16c")))

/* acc[0..W*8) over nb keys: acc = r16(acc * ms[b]) where ms[b] != 1, acc = r16(v_b * vs[b] + acc) */
#define FA_ACC8(W)                                                                                                  \
    MF_AVX2 static void fa_acc8_##W(float *acc, const float *v, int64_t vstride, int nb, const float *ms,           \
                                    const float *vs) {                                                              \
        __m256 a[W];                                                                                                \
        for (int r = 0; r < W; r++) a[r] = _mm256_loadu_ps(acc + 8 * r);                                           \
        for (int b = 0; b < nb; b++) {                                                                              \
            if (ms[b] != 1.0f) {                                                                                    \
                const __m256 m = _mm256_set1_ps(ms[b]);                                                             \
                for (int r = 0; r < W; r++)                                                                         \
                    a[r] = _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_mul_ps(a[r], m), _MM_FROUND_TO_NEAREST_INT));   \
            }                                                                                                       \
            const __m256 w = _mm256_set1_ps(vs[b]);                                                                 \
            const float *vb = v + b * vstride;                                                                      \
            for (int r = 0; r < W; r++)                                                                             \
                a[r] = _mm256_cvtph_ps(                                                                             \
                    _mm256_cvtps_ph(_mm256_fmadd_ps(_mm256_loadu_ps(vb + 8 * r), w, a[r]), _MM_FROUND_TO_NEAREST_INT)); \
        }                                                                                                           \
        for (int r = 0; r < W; r++) _mm256_storeu_ps(acc + 8 * r, a[r]);                                           \
    }
FA_ACC8(8)
FA_ACC8(1)

#define FA_ACC16(W)                                                                                                 \
    MF_AVX512F static void fa_acc16_##W(float *acc, const float *v, int64_t vstride, int nb, const float *ms,       \
                                        const float *vs) {                                                          \
        __m512 a[W];                                                                                                \
        for (int r = 0; r < W; r++) a[r] = _mm512_loadu_ps(acc + 16 * r);                                          \
        for (int b = 0; b < nb; b++) {                                                                              \
            if (ms[b] != 1.0f) {                                                                                    \
                const __m512 m = _mm512_set1_ps(ms[b]);                                                             \
                for (int r = 0; r < W; r++)                                                                         \
                    a[r] = _mm512_cvtph_ps(_mm512_cvtps_ph(_mm512_mul_ps(a[r], m), _MM_FROUND_TO_NEAREST_INT));   \
            }                                                                                                       \
            const __m512 w = _mm512_set1_ps(vs[b]);                                                                 \
            const float *vb = v + b * vstride;                                                                      \
            for (int r = 0; r < W; r++)                                                                             \
                a[r] = _mm512_cvtph_ps(                                                                             \
                    _mm512_cvtps_ph(_mm512_fmadd_ps(_mm512_loadu_ps(vb + 16 * r), w, a[r]), _MM_FROUND_TO_NEAREST_INT)); \
        }                                                                                                           \
        for (int r = 0; r < W; r++) _mm512_storeu_ps(acc + 16 * r, a[r]);                                          \
    }
FA_ACC16(8)
FA_ACC16(4)
FA_ACC16(1)

/* the accumulator update of one head over nb keys (Dv a multiple of 8) */
static void fa_acc(float *acc, const float *v, int64_t vstride, int64_t Dv, int nb, const float *ms,
                   const float *vs) {
    int64_t j = 0;
    if (mf_isa >= MF_ISA_AVX512 && Dv % 16 == 0) {
        for (; j + 128 <= Dv; j += 128) fa_acc16_8(acc + j, v + j, vstride, nb, ms, vs);
        for (; j + 64 <= Dv; j += 64) fa_acc16_4(acc + j, v + j, vstride, nb, ms, vs); /* 4 chains, not 1 */
        for (; j < Dv; j += 16) fa_acc16_1(acc + j, v + j, vstride, nb, ms, vs);
        return;
    }
    for (; j + 64 <= Dv; j += 64) fa_acc8_8(acc + j, v + j, vstride, nb, ms, vs);
    for (; j < Dv; j += 8) fa_acc8_1(acc + j, v + j, vstride, nb, ms, vs);
}

/* f16 row -> f32 (exact) */
MF_AVX2 static void fa_cvt_row(const uint16_t *s, float *d, int64_t n) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(d + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + j))));
    for (; j < n; j++) d[j] = mf_f16_table[s[j]];
}

/* scores of keys [b0, b1) of a block of nb keys in fa_scores' grouping: groups of four from the
 * block's first key while four fit in nb, then one by one */
MF_AVX2 static void fa_scores_f32(const float *q, const float *kf, int64_t D, int b0, int b1, int nb, float *sc) {
    const int nb4 = nb & ~3;
    int b = b0;
    for (; b + 4 <= b1 && b + 4 <= nb4; b += 4)
        _mm_storeu_ps(sc + b, dot4_avx2_f32(q, kf + (b - b0) * D, kf + (b - b0 + 1) * D, kf + (b - b0 + 2) * D,
                                            kf + (b - b0 + 3) * D, D));
    for (; b < b1; b++) sc[b] = dot1_avx2_f32(q, kf + (b - b0) * D, D);
}

static _Thread_local float *fag_buf;
static _Thread_local size_t fag_cap;

/* A tile of query rows (consecutive rows of one sequence whose keys start at the same lo) x a
 * KV group's heads: each FA_SB keys are converted once for the tile, and each row then runs
 * exactly the per-row steps (its own key blocks from lo, its own end qp), so a row's bits do
 * not depend on the tile it is in. */
static void fa16g_rows(const fag_ctx *c, int64_t g, int64_t ch, int64_t i0, int64_t nq) {
    const mf_paged_args *pa = c->pa;
    const int64_t G = pa->Hq / pa->Hkv;
    const int64_t h0 = g * G + ch * c->hc, nh = G - ch * c->hc < c->hc ? G - ch * c->hc : c->hc;
    const int64_t D = pa->D, Dv = pa->Dv, Hkv = pa->Hkv, bs = pa->bs;
    const int64_t lo = paged_lo_f16(pa, pa->q_pos[i0]);
    int64_t qmax = pa->q_pos[i0];
    for (int64_t q = 1; q < nq; q++) qmax = pa->q_pos[i0 + q] > qmax ? pa->q_pos[i0 + q] : qmax;
    const int32_t *tab = pa->tables + pa->q_tab[i0];
    const int vin = pa->v == NULL; /* V inside K: V rows are the first Dv values of the K rows */
    /* kf [FA_SB, D], vf [FA_SB, Dv] (absent with V inside K), acc [nq, nh, Dv] */
    const size_t need = (size_t)FA_SB * (size_t)(D + (vin ? 0 : Dv)) + (size_t)(nq * nh) * (size_t)Dv;
    if (need > fag_cap) {
        free(fag_buf);
        fag_buf = malloc(need * sizeof(float));
        fag_cap = fag_buf ? need : 0;
        if (!fag_buf) { /* the per-head kernel needs no buffer */
            for (int64_t q = 0; q < nq; q++)
                for (int64_t hh = 0; hh < nh; hh++) fa16_paged_task((void *)pa, (i0 + q) * pa->Hq + h0 + hh);
            return;
        }
    }
    float *kf = fag_buf, *vf = vin ? kf : kf + FA_SB * D, *acc = kf + FA_SB * (D + (vin ? 0 : Dv));
    const int64_t vstride = vin ? D : Dv;
    float M[FA_QT][MF_FA_HEADS_MAX], S[FA_QT][MF_FA_HEADS_MAX], sc[KB], ms[FA_SB], vs[FA_SB];
    for (int64_t q = 0; q < nq; q++)
        for (int64_t hh = 0; hh < nh; hh++) M[q][hh] = -INFINITY, S[q][hh] = 0.0f;
    memset(acc, 0, (size_t)(nq * nh) * (size_t)Dv * sizeof(float));
    for (int64_t t0 = lo; t0 <= qmax; t0 += KB) {
        const int nbmax = (int)(qmax + 1 - t0 < KB ? qmax + 1 - t0 : KB);
        for (int b0 = 0; b0 < nbmax; b0 += FA_SB) {
            const int b1max = b0 + FA_SB < nbmax ? b0 + FA_SB : nbmax;
            for (int b = b0; b < b1max; b++) {
                const int64_t t = t0 + b, row = (int64_t)tab[t / bs] * bs + t % bs;
                fa_cvt_row((const uint16_t *)pa->k + (row * Hkv + g) * D, kf + (b - b0) * D, D);
                if (!vin) fa_cvt_row((const uint16_t *)pa->v + (row * Hkv + g) * Dv, vf + (b - b0) * Dv, Dv);
            }
            for (int64_t q = 0; q < nq; q++) {
                const int64_t qp = pa->q_pos[i0 + q];
                if (t0 > qp) continue;
                const int nb = (int)(qp + 1 - t0 < KB ? qp + 1 - t0 : KB); /* this row's block */
                if (b0 >= nb) continue;
                const int b1 = b0 + FA_SB < nb ? b0 + FA_SB : nb;
                for (int64_t hh = 0; hh < nh; hh++) {
                    fa_scores_f32(pa->q + ((i0 + q) * pa->Hq + h0 + hh) * D, kf, D, b0, b1, nb, sc);
                    fa_step(&M[q][hh], &S[q][hh], sc + b0, b1 - b0, pa->scale, pa->softcap, ms, vs);
                    fa_acc(acc + (q * nh + hh) * Dv, vf, vstride, Dv, b1 - b0, ms, vs);
                }
            }
        }
    }
    for (int64_t q = 0; q < nq; q++)
        for (int64_t hh = 0; hh < nh; hh++) {
            const int64_t h = h0 + hh;
            float *o = pa->out + ((i0 + q) * pa->Hq + h) * Dv;
            memcpy(o, acc + (q * nh + hh) * Dv, (size_t)Dv * sizeof(float));
            fa_finish_f32(M[q][hh], S[q][hh], pa->sinks ? pa->sinks + h : NULL, Dv, o);
        }
}

static void fa16g_task(void *p, int64_t task) {
    const fag_ctx *c = p;
    const mf_paged_args *pa = c->pa;
    const int64_t per_row = pa->Hkv * c->cpg, tile = task / per_row, r = task % per_row;
    const int64_t i1 = (tile + 1) * c->qt < pa->n ? (tile + 1) * c->qt : pa->n;
    for (int64_t i = tile * c->qt; i < i1;) { /* stretches of one sequence whose keys start at one lo */
        const int64_t lo = paged_lo_f16(pa, pa->q_pos[i]);
        int64_t j = i + 1;
        while (j < i1 && pa->q_tab[j] == pa->q_tab[i] && paged_lo_f16(pa, pa->q_pos[j]) == lo) j++;
        fa16g_rows(c, r / c->cpg, r % c->cpg, i, j - i);
        i = j;
    }
}
#endif

int mf_attention_paged(const mf_paged_args *pa) {
    if (pa->kv_type == MF_KV_Q8_0 || pa->kv_type == MF_KV_Q4_0) {
        /* csrc/kv_quant.c over the raw rows; llama.cpp's Hadamard rotation of q, k, v and the
         * output is the caller's (kv/view.py), so the fused decode layer skips these types */
        const mf_attnq_args qa = {.q = pa->q, .k = pa->k, .v = pa->v, .out = pa->out, .q_pos = pa->q_pos,
                                  .q_tab = pa->q_tab, .tables = pa->tables, .bs = pa->bs, .n = pa->n,
                                  .Hq = pa->Hq, .Hkv = pa->Hkv, .D = pa->D, .Dv = pa->Dv, .scale = pa->scale,
                                  .softcap = pa->softcap, .window = pa->window, .type_k = pa->kv_type,
                                  .type_v = pa->kv_type, .sinks = pa->sinks};
        mf_attention_kvq(&qa);
        return 0;
    }
    if (pa->kv_type != MF_KV_F32 && pa->kv_type != MF_KV_F16) return -1;
    if (pa->n == 0) return 0;
    if (pa->kv_type == MF_KV_F16) /* llama.cpp's f16 flash path reads Q as f16 */
        mf_round_f16_f32(pa->q, pa->q, pa->n * pa->Hq * pa->D);
    if (pa->kv_type == MF_KV_F16 && mf_attn_ggml_fa) {
        int64_t T = 1;
        for (int64_t i = 0; i < pa->n; i++) T = pa->q_pos[i] + 1 > T ? pa->q_pos[i] + 1 : T;
        const int par = pa->n * pa->Hq > 1 && pa->n * pa->Hq * T * (pa->D + pa->Dv) >= PAR_MIN;
#ifdef MF_X86
        if (use_avx2() && pa->Dv % 8 == 0 && mf_tune.fa_heads > 0) { /* a KV group's heads together */
            const int64_t G = pa->Hq / pa->Hkv, want = 2 * (int64_t)mf_n_threads();
            int64_t hc = G < mf_tune.fa_heads ? G : mf_tune.fa_heads;
            while (hc > 1 && pa->n * pa->Hkv * ((G + hc - 1) / hc) < want) hc--;
            fag_ctx c = {.pa = pa, .hc = hc, .cpg = (G + hc - 1) / hc};
            /* tiles of up to FA_QT consecutive rows of one sequence and one lo, fewer rows a
             * tile where tiles of FA_QT would leave threads without tasks */
            int64_t qt = pa->n * pa->Hkv * c.cpg / want;
            c.qt = qt < 1 ? 1 : qt > FA_QT ? FA_QT : qt;
            const int64_t tasks = (pa->n + c.qt - 1) / c.qt * pa->Hkv * c.cpg;
            if (par && tasks > 1) mf_parallel_for(tasks, fa16g_task, &c);
            else
                for (int64_t t = 0; t < tasks; t++) fa16g_task(&c, t);
            return 0;
        }
#endif
        const int64_t tasks = pa->n * pa->Hq;
        if (par)
            mf_parallel_for(tasks, fa16_paged_task, (void *)pa);
        else
            for (int64_t t = 0; t < tasks; t++) fa16_paged_task((void *)pa, t);
        return 0;
    }
    const int64_t G = pa->Hq / pa->Hkv, want = 2 * (int64_t)mf_n_threads();
    int64_t hc = G < HG ? G : HG;
    while (hc > 1 && pa->n * pa->Hkv * ((G + hc - 1) / hc) < want) hc--;
    paged_ctx c = {.pa = pa,
                   .a = {.q = pa->q, .out = pa->out, .n = pa->n, .Hq = pa->Hq, .Hkv = pa->Hkv, .D = pa->D,
                         .Dv = pa->Dv, .scale = pa->scale, .softcap = pa->softcap, .window = pa->window,
                         .sinks = pa->sinks},
                   .hc = hc, .cpg = (G + hc - 1) / hc};
    const int64_t tasks = pa->n * pa->Hkv * c.cpg;
    int64_t T = 1;
    for (int64_t i = 0; i < pa->n; i++) T = pa->q_pos[i] + 1 > T ? pa->q_pos[i] + 1 : T;
    if (tasks > 1 && pa->n * pa->Hq * T * (pa->D + pa->Dv) >= PAR_MIN)
        mf_parallel_for(tasks, paged_task, &c);
    else
        for (int64_t t = 0; t < tasks; t++) paged_task(&c, t);
    return 0;
}

int64_t mf_kv_row_bytes(int kv_type, int64_t elems) {
    switch (kv_type) {
    case MF_KV_F32: return elems * 4;
    case MF_KV_F16: return elems * 2;
    case MF_KV_Q8_0:
    case MF_KV_Q4_0: return elems % MF_KV_QK ? 0 : mf_kvq_row_bytes(kv_type, elems);
    default: return 0;
    }
}

int mf_kv_store(int kv_type, void *pool, const int32_t *rows, const float *x, int64_t n, int64_t elems) {
    const int64_t rb = mf_kv_row_bytes(kv_type, elems);
    if (rb == 0) return -1;
    for (int64_t i = 0; i < n; i++) {
        uint8_t *dst = (uint8_t *)pool + (int64_t)rows[i] * rb;
        if (kv_type == MF_KV_Q8_0 || kv_type == MF_KV_Q4_0) mf_kv_quantize(kv_type, x + i * elems, dst, 1, elems);
        else if (kv_type == MF_KV_F16) mf_f32_to_f16(x + i * elems, (uint16_t *)dst, elems);
        else memcpy(dst, x + i * elems, (size_t)rb);
    }
    return 0;
}
