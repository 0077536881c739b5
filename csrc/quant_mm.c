/* matmul Y[n, rows] = X[n, cols] · W[rows, cols]^T and get_rows, over the pool.
 * avx2+: X is quantized once per call (Q8 per 32 or per 256 like llama.cpp's vec_dot_type),
 * then each task takes a tile of W rows and dots every row with every X row (tiled so the
 * W tile stays in L1/L2 while X rows stream). scalar: each W row is dequantized into
 * per-thread scratch and dotted in f32. */
#include "memfit.h"
#include "quant_common.h"

#define MF_MM_MAX 4 /* weights per multi-matmul call */

#include <assert.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int type, xfmt;
    const uint8_t *w;
    int64_t rows, cols, rb, nb; /* row bytes, blocks per row */
    const float *x;
    int64_t n;
    float *y;
    const uint8_t *xq;
    size_t xs; /* bytes per prepared X row */
    mf_vecdot_fn vd;
    mf_vecdot4_fn vd4; /* optional 4-row variant */
    mf_vecdot4_fn vd8; /* optional 8-row variant (each row's bits equal vd4's) */
    mf_vecdotx4_fn vx4; /* optional 4-X-row variant of vd (each X row's bits equal vd's) */
    int streams;       /* decode, 1-row kernels: rows of a task read as this many streams */
    int strided;       /* decode, 4/8-row kernels on short rows: a group's rows are a task part apart */
    int kpf;           /* decode: the 1-row kernels prefetch in their block loop (no row-ahead prefetch) */
    int kpf_multi;     /* the same for the 4/8-row kernels */
    int vd4_seq;       /* decode: vd4 reads its 4 rows one after another as the 1-row kernel (its tasks) */
    int64_t rt; /* W rows per task */
    int kg, g32;             /* K-quant GEMM path (avx512vnni); sub-blocks of 32 (Q4_K/Q5_K) */
    int err;                 /* set by a task that could not get its scratch: the call returns -3 */
    const mf_xband *xb;      /* its X bands: [ceil(n/16)][nb] */
} mm_ctx;

static _Thread_local float *tl_buf;
static _Thread_local size_t tl_cap;

static float *scratch_f32(size_t n) {
    if (n > tl_cap) {
        free(tl_buf);
        tl_buf = malloc(n * sizeof(float));
        tl_cap = tl_buf ? n : 0;
    }
    return tl_buf;
}

static void mm_task_scalar(void *p, int64_t t) {
    mm_ctx *c = p;
    int64_t r0 = t * c->rt, r1 = r0 + c->rt < c->rows ? r0 + c->rt : c->rows;
    float *buf = scratch_f32((size_t)c->cols);
    if (!buf) return; /* allocation failure leaves y untouched; caller pre-checks memory */
    for (int64_t r = r0; r < r1; r++) {
        mf_dequant_row(c->type, c->w + r * c->rb, buf, c->cols);
        for (int64_t i = 0; i < c->n; i++) {
            const float *x = c->x + i * c->cols;
            float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
            int64_t k = 0;
            for (; k + 4 <= c->cols; k += 4) {
                s0 += buf[k] * x[k]; s1 += buf[k + 1] * x[k + 1];
                s2 += buf[k + 2] * x[k + 2]; s3 += buf[k + 3] * x[k + 3];
            }
            for (; k < c->cols; k++) s0 += buf[k] * x[k];
            c->y[i * c->rows + r] = (s0 + s1) + (s2 + s3);
        }
    }
}

#define XT 8 /* X rows per inner tile */
/* Kernel families per (type, ISA), chosen by the caller's mode (quant_common.h MF_MM_*) and
 * never by the row count (batch invariance): decode runs the one-row integer vec-dots (and
 * their 4/8-row forms, which keep each row's bits) for any n; prefill runs the type's batched
 * kernel for any n (K-quants: kgemm on avx512vnni, kblk on avx2; 32-element types and NVFP4:
 * b32g where it exists, else b32 (NVFP4 as half-scaled 32-value blocks); float types: the 2x4 FMA GEMM). Each batched kernel's result
 * for a row does not depend on the other rows, the row count or the task split. A type
 * without a batched kernel runs its vec-dots in both modes. So a prompt row gets the same bits whether its prompt was chunked, packed with
 * others or found partly in the prefix cache. */
#ifndef MF_KG_RT_MAX
#define MF_KG_RT_MAX (64 / MF_KG_R * MF_KG_R)
#endif
/* Decode on avx512vnni: the 4-row kernel only for rows of at least mf_tune.*_vd4_min_rb bytes.
 * On the Xeon, from DRAM, in-process A/B (docs/NOTES.md): Q8_0 4 rows +45-70% at 3584-14336
 * columns, +5% at 2048, -13% at 1024, mixed at 640; Q4_K/Q5_K/Q6_K (4 rows block by block, each
 * row's bits as the 1-row kernel's) +35-40% at 14336-18944 columns, 2-12% slower at 3584-4096.
 * Shorter rows keep the 1-row kernel (mf_tune.streams per task). Other CPUs: pool.c's table. */
/* The 256-value types whose 4/8-row kernels keep the 1-row bits: Q4_K/Q5_K/Q6_K at rows of
 * k_vd*_min_rb bytes, Q2_K/Q3_K/IQ4_XS at rows as long in values as a Q4_K row of that many
 * bytes (Zen 4, bench --kernels --tune, from DRAM: Q2_K 4096x14336, 4.7 KiB rows, 8 rows 28.0
 * vs 1 row 20.1 GB/s; IQ4_XS 33.9 vs 24.3; Q3_K level). */
static int kq_rows(int type) {
    return type == T_Q4_K || type == T_Q5_K || type == T_Q6_K ? 1 : type == T_Q2_K || type == T_Q3_K || type == T_IQ4_XS ? 2 : 0;
}
static int64_t kq_min_rb(int type, int64_t q4k_rb) {
    const int k = kq_rows(type);
    return k == 1 ? q4k_rb : k == 2 ? q4k_rb / 144 * mf_qtypes[type].bytes : 0;
}
static int64_t vd8_min_rb(int type) { return kq_min_rb(type, mf_tune.k_vd8_min_rb); }
static int64_t vd4_min_rb(int type) { return type == T_Q8_0 ? mf_tune.q8_vd4_min_rb : kq_min_rb(type, mf_tune.k_vd4_min_rb); }
/* Decode on avx512vnni, 4/8-row kernels: rows of at most mf_tune.stride_max_rb bytes are
 * grouped a task part apart (vec_rows_strided), longer ones adjacent. In-process A/B on the
 * Xeon (docs/NOTES.md): Q4_0 at 3584-5120 columns +14-22%, Q4_1/Q5_1 at 1024-1536 +14%,
 * Q4_0/Q5_0 at 640 +5-7%; Q4_0 at 7168 columns -8% and 14336 -31% (their adjacent rows are
 * already far apart). */
/* Software prefetch of W rows [a, b) clipped to the task's end, into all cache levels
 * (prefetcht0). Decode reads each weight byte once; on the Xeon of BENCHMARKS.md the
 * hardware prefetchers alone left the 2-core matvec of small matrices at ~11 GB/s. The hint
 * matters more than the distance: with prefetchnta (8 rows ahead, rows <= 1 KiB only), Q8_0
 * 262144x640 streamed 9.8-13 GB/s, with prefetcht0 20-23 GB/s (in-process A/B, docs/NOTES.md);
 * 2-32 KiB ahead measured the same, and long rows, which lost with prefetchnta, gain or stay
 * level with prefetcht0. */
static inline void prefetch_rows(const mm_ctx *c, int64_t a, int64_t b, int64_t end) {
    if (b > end) b = end;
    if (a >= b) return;
    const char *p = (const char *)(c->w + a * c->rb), *e = (const char *)(c->w + b * c->rb);
    for (; p < e; p += 64) __builtin_prefetch(p, 0, 3);
}

/* rows [a, b) of W against X rows [i0, i1): 8-row, then 4-row groups from a (a multiple of
 * 4 rows from the matrix start, so a row's kernel never depends on the task split), the
 * last rows of the matrix one by one */
static void vec_rows(const mm_ctx *c, int64_t a, int64_t b, int64_t i0, int64_t i1, int pf, int64_t end) {
    int64_t r = a;
    if (c->vd8)
        for (; r + 8 <= b; r += 8) {
            if (pf && !c->kpf_multi && mf_tune.pf_rows_multi) prefetch_rows(c, r + mf_tune.pf_rows_multi, r + mf_tune.pf_rows_multi + 8, end);
            for (int64_t i = i0; i < i1; i++) {
                float o[8];
                c->vd8(c->w + r * c->rb, (size_t)c->rb, c->xq + (size_t)i * c->xs, c->nb, o);
                for (int k = 0; k < 8; k++) c->y[i * c->rows + r + k] = o[k];
            }
        }
    if (c->vd4)
        for (; r + 4 <= b; r += 4) {
            if (pf && !c->kpf_multi && mf_tune.pf_rows_multi) prefetch_rows(c, r + mf_tune.pf_rows_multi, r + mf_tune.pf_rows_multi + 4, end);
            for (int64_t i = i0; i < i1; i++) {
                float o[4];
                c->vd4(c->w + r * c->rb, (size_t)c->rb, c->xq + (size_t)i * c->xs, c->nb, o);
                for (int k = 0; k < 4; k++) c->y[i * c->rows + r + k] = o[k];
            }
        }
    for (; r < b; r++) {
        const uint8_t *w = c->w + r * c->rb;
        if (pf && !c->kpf && mf_tune.pf_rows) prefetch_rows(c, r + mf_tune.pf_rows, r + mf_tune.pf_rows + 1, end);
        int64_t i = i0;
        if (c->vx4)
            for (; i + 4 <= i1; i += 4) {
                float o[4];
                c->vx4(w, c->xq + (size_t)i * c->xs, c->xs, c->nb, o);
                for (int k = 0; k < 4; k++) c->y[(i + k) * c->rows + r] = o[k];
            }
        for (; i < i1; i++)
            c->y[i * c->rows + r] = c->vd(w, c->xq + (size_t)i * c->xs, c->nb);
    }
}

/* Rows [r0, r1) as G = 8 (4) parts of P rows: the group kernel takes row j of every part at
 * once (stride P rows), so each core reads G streams a part apart instead of one. A row's
 * bits are the group kernel's either way (the 8- and 4-row kernels do the same per-row
 * arithmetic); the rows left over ((r1 - r0) % G, a multiple of 4 but at the matrix end)
 * go through vec_rows. */
static void vec_rows_strided(const mm_ctx *c, int64_t r0, int64_t r1, int64_t i0, int64_t i1, int pf) {
    const int G = c->vd8 ? 8 : 4;
    mf_vecdot4_fn k = c->vd8 ? c->vd8 : c->vd4;
    const int64_t P = (r1 - r0) / G;
    for (int64_t j = 0; j < P; j++) {
        if (pf && !c->kpf_multi)
            for (int g = 0; g < G && mf_tune.pf_strided; g++) prefetch_rows(c, r0 + g * P + j + mf_tune.pf_strided, r0 + g * P + j + mf_tune.pf_strided + 1, r1);
        for (int64_t i = i0; i < i1; i++) {
            float o[8];
            k(c->w + (r0 + j) * c->rb, (size_t)(P * c->rb), c->xq + (size_t)i * c->xs, c->nb, o);
            for (int g = 0; g < G; g++) c->y[i * c->rows + r0 + g * P + j] = o[g];
        }
    }
    if (r0 + G * P < r1) vec_rows(c, r0 + G * P, r1, i0, i1, pf, r1);
}

static void mm_task_vec(void *p, int64_t t) {
    mm_ctx *c = p;
    int64_t r0 = t * c->rt, r1 = r0 + c->rt < c->rows ? r0 + c->rt : c->rows;
    /* 1-row kernels read the task as c->streams (mf_tune.streams) parts in row-by-row
     * alternation. On the Xeon, from DRAM, two long ascending streams per core measured ~8-10%
     * faster than one (1 thread, Q4_K/Q6_K 14336x4096: 8.3 -> 9.1, 8.9 -> 9.9 GB/s per
     * CPU-second; on Zen 4 one stream is +45-65%, pool.c); alternating 8-row or 16-row
     * stretches gained nothing, nor did 4 or 2 adjacent rows block by block on rows under
     * 6 KiB (longer rows take the 4-row kernel: mf_tune.k_vd4_min_rb, q8_vd4_min_rb). */
    const int64_t S = c->streams > 1 ? c->streams : 1, part = (r1 - r0 + S - 1) / S;
    for (int64_t i0 = 0; i0 < c->n; i0 += XT) {
        int64_t i1 = i0 + XT < c->n ? i0 + XT : c->n;
        const int pf = i0 == 0; /* the first X tile streams W; later ones hit cache */
        if (c->strided) {
            vec_rows_strided(c, r0, r1, i0, i1, pf);
            continue;
        }
        if (S == 1) {
            vec_rows(c, r0, r1, i0, i1, pf, r1);
            continue;
        }
        for (int64_t j = 0; j < part; j++)
            for (int64_t s = 0; s < S; s++) {
                const int64_t r = r0 + s * part + j;
                if (r < r1 && r < r0 + (s + 1) * part) vec_rows(c, r, r + 1, i0, i1, pf, r1);
            }
    }
}

static _Thread_local tl_scratch tl_kbs;

/* prefill, K-quants: unpack the task's W rows once, then 4 X rows per kernel call over X tiles
 * of XT2 rows (the unpacked tile + X tile stay in L2). */
#define XT2 16 /* == MF_BST */
static void mm_task_kblk(void *p, int64_t t) {
    mm_ctx *c = p;
    int64_t r0 = t * c->rt, r1 = r0 + c->rt < c->rows ? r0 + c->rt : c->rows;
    mf_kblk *wb = tl_reserve(&tl_kbs, (size_t)((r1 - r0) * c->nb) * sizeof(mf_kblk));
    if (!wb) { __atomic_store_n(&c->err, 1, __ATOMIC_RELAXED); return; }
    mf_kunpack_fn up = mf_kunpack_avx2[c->type];
    int bytes = mf_qtypes[c->type].bytes;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t b = 0; b < c->nb; b++) up(c->w + r * c->rb + b * bytes, wb + (r - r0) * c->nb + b);
    const int vnni = mf_isa >= MF_ISA_AVX512VNNI; /* same bits, fewer instructions */
    for (int64_t i0 = 0; i0 < c->n; i0 += XT2) {
        int64_t m = c->n - i0 < XT2 ? c->n - i0 : XT2;
        int64_t r = r0;
        for (; r + 2 <= r1; r += 2) /* W row pairs: each X load serves two rows */
            (vnni ? mf_kdot2_avx512 : mf_kdot2_avx2)(wb + (r - r0) * c->nb, wb + (r + 1 - r0) * c->nb, c->nb,
                          c->xq + (size_t)i0 * c->xs, c->xs, m, c->y + i0 * c->rows + r,
                          c->y + i0 * c->rows + r + 1, c->rows);
        for (; r < r1; r++)
            (vnni ? mf_kdot_avx512 : mf_kdot_avx2)(wb + (r - r0) * c->nb, c->nb, c->xq + (size_t)i0 * c->xs, c->xs, m,
                         c->y + i0 * c->rows + r, c->rows);
    }
}

static _Thread_local tl_scratch tl_kws;

/* prefill, K-quants, avx512vnni: the task's W rows unpacked once (mf_kw), then per X band of
 * 16 rows MF_KG_R W rows per kernel call over all of K (the tile stays in L2, the band streams
 * from L2). Any row split gives the same bits: rows never mix in the kernel. */
static void mm_task_kgemm(void *p, int64_t t) {
    mm_ctx *c = p;
    int64_t r0 = t * c->rt, r1 = r0 + c->rt < c->rows ? r0 + c->rt : c->rows;
    mf_kw *wk = tl_reserve(&tl_kws, (size_t)((r1 - r0) * c->nb) * sizeof(mf_kw));
    if (!wk) { __atomic_store_n(&c->err, 1, __ATOMIC_RELAXED); return; } /* -3 from the caller */
    mf_kunpack_fn up = mf_kunpack_avx2[c->type];
    mf_kwunpack_fn kw = mf_kwunpack_avx2[c->type];
    int bytes = mf_qtypes[c->type].bytes;
    mf_kblk kb;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t b = 0; b < c->nb; b++) {
            const uint8_t *src = c->w + r * c->rb + b * bytes;
            mf_kw *dst = wk + (r - r0) * c->nb + b;
            if (kw) kw(src, dst); /* one pass where the type has one */
            else up(src, &kb), mf_kw_from_kblk(&kb, c->g32, dst);
        }
    _Alignas(64) float out[2 * MF_KG_R * MF_XB_ROWS];
    const mf_kw *wr[MF_KG_R];
    for (int64_t i0 = 0; i0 < c->n; i0 += 2 * MF_XB_ROWS) { /* two bands per kernel call */
        const mf_xband *x0 = c->xb + (i0 / MF_XB_ROWS) * c->nb;
        const mf_xband *x1 = c->n - i0 > MF_XB_ROWS ? x0 + c->nb : NULL;
        int64_t m = c->n - i0 < 2 * MF_XB_ROWS ? c->n - i0 : 2 * MF_XB_ROWS;
        for (int64_t r = r0; r < r1; r += MF_KG_R) {
            int R = r1 - r < MF_KG_R ? (int)(r1 - r) : MF_KG_R;
            for (int k = 0; k < R; k++) wr[k] = wk + (r + k - r0) * c->nb;
            if (c->n <= 4) /* a quarter of the lanes, the same bits per row */
                mf_kgemm4_avx512(wr, R, c->g32, c->nb, x0, out);
            else
                mf_kgemm_avx512(wr, R, c->g32, c->nb, x0, x1, out);
            /* row by row of Y: R adjacent values each (column by column, the stores a row
             * apart alias at 4 KiB strides and stalled the loads of out: 12% of a MoE prefill) */
            if (R == 8 && m % MF_XB_ROWS == 0) { /* full bands (so c->n > 4: mf_kgemm_avx512's layout) */
                mf_kg_store8_avx512(out, (int)m, c->y + i0 * c->rows + r, c->rows);
                continue;
            }
            for (int64_t j = 0; j < m; j++) {
                const float *oj = out + (j / MF_XB_ROWS) * R * MF_XB_ROWS + j % MF_XB_ROWS;
                float *yj = c->y + (i0 + j) * c->rows + r;
                for (int k = 0; k < R; k++) yj[k] = oj[k * MF_XB_ROWS];
            }
        }
    }
}

static _Thread_local tl_scratch tl_q8s;

/* X band t of a K-quant GEMM plan: its 16 rows quantized (Q8_256, as the row kernels do) into
 * per-thread scratch, then interleaved */
static void xband_task(void *p, int64_t t) {
    mm_ctx *c = p;
    int64_t i0 = t * MF_XB_ROWS, m = c->n - i0 < MF_XB_ROWS ? c->n - i0 : MF_XB_ROWS;
    mf_q8_256 *xq8 = tl_reserve(&tl_q8s, (size_t)(MF_XB_ROWS * c->nb) * sizeof(mf_q8_256));
    if (!xq8) { __atomic_store_n(&c->err, 1, __ATOMIC_RELAXED); return; }
    for (int64_t j = 0; j < m; j++) mf_quantize_q8_256_avx2(c->x + (i0 + j) * c->cols, xq8 + j * c->nb, c->cols);
    mf_xband_build(xq8, m, c->nb, (mf_xband *)c->xb + t * c->nb);
}

static _Thread_local tl_scratch tl_bbs;

static void mm_task_b32(void *p, int64_t t) {
    mm_ctx *c = p;
    int64_t r0 = t * c->rt, r1 = r0 + c->rt < c->rows ? r0 + c->rt : c->rows;
    /* NVFP4: each 64-value block as two half-scaled mf_b32 (sgn 2) */
    const int nv = c->type == T_NVFP4;
    const int64_t nbb = c->cols / 32;
    mf_b32 *wb = tl_reserve(&tl_bbs, (size_t)((r1 - r0) * nbb) * sizeof(mf_b32));
    if (!wb) { __atomic_store_n(&c->err, 1, __ATOMIC_RELAXED); return; }
    mf_b32unpack_fn up = mf_b32unpack_avx2[c->type];
    int bytes = mf_qtypes[c->type].bytes, sgn = nv ? 2 : c->type == T_Q8_0 || c->type == T_IQ4_NL || c->type == T_MXFP4;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t b = 0; b < c->nb; b++) {
            const uint8_t *src = c->w + r * c->rb + b * bytes;
            if (nv) mf_up_nvfp4_b32(src, wb + (r - r0) * nbb + 2 * b); else up(src, wb + (r - r0) * nbb + b);
        }
    /* AVX2: two W rows at a time share each X block's load (mf_bdot2_avx2) */
    const int two = mf_isa < MF_ISA_AVX512VNNI && !nv && r1 - r0 >= 2;
    float *st = sgn && !two ? NULL : scratch_f32((size_t)(2 * nbb * MF_BST)), corr[MF_BST];
    if ((!sgn || two) && !st) { __atomic_store_n(&c->err, 1, __ATOMIC_RELAXED); return; }
    float *sd = st ? st + nbb * MF_BST : NULL;
    for (int64_t i0 = 0; i0 < c->n; i0 += XT2) {
        int64_t m = c->n - i0 < XT2 ? c->n - i0 : XT2;
        /* s (for corr) and d (for mf_bdot2_avx2) of the tile's X rows, transposed to [block][row]
         * (zero-padded) */
        for (int64_t b = 0; st && b < nbb; b++)
            for (int64_t i = 0; i < MF_BST; i++) {
                const mf_q8_32 *xb = i < m ? (const mf_q8_32 *)(c->xq + (size_t)(i0 + i) * c->xs) + b : NULL;
                st[b * MF_BST + i] = xb ? xb->s : 0.0f;
                sd[b * MF_BST + i] = xb ? xb->d : 0.0f;
            }
        int64_t r = r0;
        if (two)
            for (; r + 2 <= r1; r += 2) {
                float corr1[MF_BST];
                if (!sgn) {
                    mf_b32_corr_avx2(wb + (r - r0) * nbb, nbb, st, m, corr);
                    mf_b32_corr_avx2(wb + (r + 1 - r0) * nbb, nbb, st, m, corr1);
                }
                mf_bdot2_avx2(wb + (r - r0) * nbb, nbb, sgn, c->xq + (size_t)i0 * c->xs, c->xs, m, sd, corr, corr1,
                              c->y + i0 * c->rows + r, c->rows);
            }
        for (; r < r1; r++) {
            if (!sgn) mf_b32_corr_avx2(wb + (r - r0) * nbb, nbb, st, m, corr);
            (mf_isa >= MF_ISA_AVX512VNNI && !nv ? mf_bdot_avx512 : mf_bdot_avx2)(wb + (r - r0) * nbb, nbb, sgn, c->xq + (size_t)i0 * c->xs, c->xs, m,
                         corr, c->y + i0 * c->rows + r, c->rows);
        }
    }
}

/* prefill, MXFP4 on AVX2: the task's rows unpacked once as 8-row groups (mf_mx8), then per X
 * tile of XT2 rows each group against 4 X rows at a time (quant_fp4tq.c mf_mx8_gemm_avx2) */
static void mm_task_mx8(void *p, int64_t t) {
    mm_ctx *c = p;
    int64_t r0 = t * c->rt, r1 = r0 + c->rt < c->rows ? r0 + c->rt : c->rows;
    const int64_t ng = (r1 - r0 + 7) / 8;
    mf_mx8 *wb = tl_reserve(&tl_bbs, (size_t)(ng * c->nb) * sizeof(mf_mx8));
    int32_t *sy = (int32_t *)scratch_f32((size_t)(XT2 * c->nb));
    if (!wb || !sy) { __atomic_store_n(&c->err, 1, __ATOMIC_RELAXED); return; }
    for (int64_t g = 0; g < ng; g++) {
        const int64_t nr = r1 - r0 - 8 * g < 8 ? r1 - r0 - 8 * g : 8;
        mf_up_mxfp4_x8(c->w + (r0 + 8 * g) * c->rb, (size_t)c->rb, (int)nr, c->nb, wb + g * c->nb);
    }
    for (int64_t i0 = 0; i0 < c->n; i0 += XT2) {
        int64_t m = c->n - i0 < XT2 ? c->n - i0 : XT2;
        mf_mx8_ysum12_avx2(c->xq + (size_t)i0 * c->xs, c->xs, m, c->nb, sy);
        for (int64_t g = 0; g < ng; g++) {
            const int64_t nr = r1 - r0 - 8 * g < 8 ? r1 - r0 - 8 * g : 8;
            mf_mx8_gemm_avx2(wb + g * c->nb, c->nb, (int)nr, c->xq + (size_t)i0 * c->xs, c->xs, sy, m,
                             c->y + i0 * c->rows + r0 + 8 * g, c->rows);
        }
    }
}

/* prefill, 32-element types on avx512vnni: X as 16-row bands (mf_b32band, built once per
 * call), W rows of the task unpacked once (quant_avx512.c) */
static void mm_task_b32g(void *p, int64_t t) {
    mm_ctx *c = p;
    int64_t r0 = t * c->rt, r1 = r0 + c->rt < c->rows ? r0 + c->rt : c->rows;
    mf_b32gemm_avx512(c->type, c->w + r0 * c->rb, (size_t)c->rb, r1 - r0, c->cols / 32, (const mf_b32band *)c->xq, c->n,
                      c->y + r0, c->rows);
}

/* prefill, float weights: convert the task's W rows to f32 once, 2x4 FMA kernel over X tiles */
static void mm_task_float(void *p, int64_t t) {
    mm_ctx *c = p;
    int64_t r0 = t * c->rt, r1 = r0 + c->rt < c->rows ? r0 + c->rt : c->rows;
    float *wf = scratch_f32((size_t)((r1 - r0) * c->cols));
    if (!wf) { __atomic_store_n(&c->err, 1, __ATOMIC_RELAXED); return; }
    for (int64_t r = r0; r < r1; r++) mf_row_f32_avx2(c->type, c->w + r * c->rb, wf + (r - r0) * c->cols, c->cols);
    for (int64_t i0 = 0; i0 < c->n; i0 += XT2) {
        int64_t m = c->n - i0 < XT2 ? c->n - i0 : XT2;
        mf_fgemm_avx2(wf, r1 - r0, c->x + i0 * c->cols, m, c->cols, c->y + i0 * c->rows + r0, c->rows);
    }
}

static void quant_x_task(void *p, int64_t i) {
    mm_ctx *c = p;
    if (c->xfmt == XF_B32BAND) { /* i: a band of 16 rows */
        const int64_t m = c->n - i * 16 < 16 ? c->n - i * 16 : 16;
        mf_b32band_quant_avx512(c->x + i * 16 * c->cols, c->cols, m, (mf_b32band *)(void *)c->xq + i * (c->cols / 32));
        return;
    }
    const float *x = c->x + i * c->cols;
    void *dst = (void *)(c->xq + (size_t)i * c->xs);
    if (c->xfmt == XF_Q8_32) mf_quantize_q8_32_avx2(x, dst, c->cols);
    else mf_quantize_q8_256_avx2(x, dst, c->cols);
    if (c->xfmt >= XF_Q8_256S) mf_q8_256_reorder(dst, c->cols / 256, c->xfmt);
}

static pthread_mutex_t xq_lock = PTHREAD_MUTEX_INITIALIZER;
static uint8_t *xq_buf;
static size_t xq_cap;

/* One weight's share of a (multi-)matmul: its context, task function and task count. */
typedef struct {
    mm_ctx c;
    mf_task_fn fn;
    int64_t ntasks;
} mm_plan;

/* Fill p for Y = X · W^T (everything but c.xq for quantized activations). 0 or -1/-2. */
static int mm_plan_init(mm_plan *p, int type, const uint8_t *w, int64_t rows, int64_t cols,
                        const float *x, int64_t n, float *y, int mode) {
    const int vec_only = mode == MF_MM_DECODE;
    if (type < 0 || type >= T_MAX || !mf_type_ok(type)) return -1;
    const mf_qinfo *q = &mf_qtypes[type];
    if (cols % q->block) return -2;
    mm_ctx c = {.type = type, .w = w, .rows = rows, .cols = cols, .nb = cols / q->block,
                .x = x, .n = n, .y = y};
    c.rb = c.nb * q->bytes;
    int nt = mf_n_threads();
    /* ~4 tasks per thread at least; 16 rows keeps a Q4_K 4096-col tile at 36 KB */
    int64_t rt = 16;
    while (rt > 1 && (rows + rt - 1) / rt < 4 * nt) rt /= 2;
    c.rt = rt;
    p->fn = mm_task_vec;
    mf_vecdot_fn vd = mf_isa >= MF_ISA_AVX2 ? mf_vecdot_avx2[type] : NULL;
    if (!vd) {
        p->fn = mm_task_scalar;
        c.xfmt = XF_F32;
    } else {
        c.vd = vd;
        c.vd4 = mf_vecdot4_avx2[type];
        /* a 4-row kernel that reads its rows one after another on short rows only
         * (mf_tune.k_vd4_short_rb: per-row overhead is a large share of a row of few blocks) */
        if (mf_vd4_seq_avx2[type]) {
            if (c.rb > mf_tune.k_vd4_short_rb) c.vd4 = NULL;
            c.vd4_seq = c.vd4 != NULL;
        }
        c.vx4 = mf_vecdotx4_avx2[type];
        c.kpf = mf_tune.pf_dist && mf_kpf_avx2[type];
        c.kpf_multi = mf_tune.pf_dist_multi && mf_kpf_avx2[type];
        c.xfmt = q->xfmt;
        if (q->xfmt == XF_F32) {
            c.xq = (const uint8_t *)x;
            c.xs = (size_t)cols * 4;
            if (!vec_only) {
                int64_t rk = (128 * 1024) / (cols * 4);
                c.rt = rk < 2 ? 2 : rk > c.rt ? c.rt : rk;
                c.rt += c.rt & 1; /* even: the 2-row kernel pairs the same rows for any split */
                p->fn = mm_task_float;
            }
        } else {
            if (q->xfmt == XF_Q8_256 && cols % 256) return -2;
            c.xs = q->xfmt == XF_Q8_32 ? (size_t)(cols / 32) * sizeof(mf_q8_32)
                                       : (size_t)(cols / 256) * sizeof(mf_q8_256);
            if (vec_only) {
                /* row-independent: every X row is dotted as if alone */
            } else if (mf_kunpack_avx2[type] && mf_isa >= MF_ISA_AVX512VNNI) {
                /* unpacked W per GEMM task: mf_tune.kg_tile_kib (the Xeons' 2 MiB L2: 1 MiB) */
                int64_t rk = (int64_t)mf_tune.kg_tile_kib * 1024 / (c.nb * (int64_t)sizeof(mf_kw)) / MF_KG_R * MF_KG_R;
                c.rt = rk < MF_KG_R ? MF_KG_R : rk > MF_KG_RT_MAX ? MF_KG_RT_MAX : rk;
                while (c.rt > MF_KG_R && (rows + c.rt - 1) / c.rt < 4 * nt) c.rt -= MF_KG_R;
                c.kg = 1;
                /* scales and corrections per 32 values (the unpacked halves of each 32 equal):
                 * one int32 sum, conversion and FMA per 32 instead of per 16 */
                c.g32 = type == T_Q4_K || type == T_Q5_K || type == T_IQ2_XXS || type == T_IQ3_XXS ||
                        type == T_IQ3_S || type == T_IQ1_S || type == T_TQ1_0 || type == T_TQ2_0;
                p->fn = mm_task_kgemm;
            } else if (mf_kunpack_avx2[type] && type != T_TQ2_0) { /* TQ2_0: its vec-dot beat kblk by 20% */
                int64_t rk = (192 * 1024) / (c.nb * (int64_t)sizeof(mf_kblk));
                c.rt = rk < 1 ? 1 : rk > c.rt ? c.rt : rk;
                p->fn = mm_task_kblk;
            } else if (mf_isa >= MF_ISA_AVX512VNNI && mf_b32gemm_ok[type]) {
                c.xfmt = XF_B32BAND;
                c.xs = (size_t)(cols / 32) * sizeof(mf_b32band); /* per band of 16 rows */
                /* W tile (48 B per unpacked 32 values) <= ~192 KB, a multiple of 10 rows (the
                 * kernel's group), >= 4 tasks per thread */
                int64_t rk = (192 * 1024) / (cols / 32 * 48), t = 80;
                while (t > 10 && ((rows + t - 1) / t < 4 * nt || t > rk)) t /= 2;
                c.rt = t;
                p->fn = mm_task_b32g;
            } else if (type == T_MXFP4) {
                /* 8-row groups of 36 B per 32 values, <= ~192 KB a task, >= 4 tasks per thread */
                int64_t rk = (192 * 1024) / (cols / 32 * (int64_t)sizeof(mf_mx8) / 8) / 8 * 8, t = 64;
                while (t > 8 && ((rows + t - 1) / t < 4 * nt || t > rk)) t -= 8;
                c.rt = t;
                p->fn = mm_task_mx8;
            } else if (mf_b32unpack_avx2[type] || type == T_NVFP4) {
                int64_t rk = (192 * 1024) / (cols / 32 * (int64_t)sizeof(mf_b32));
                c.rt = rk < 1 ? 1 : rk > c.rt ? c.rt : rk;
                p->fn = mm_task_b32;
            }
        }
    }
    if (p->fn == mm_task_vec && mf_isa >= MF_ISA_AVX512VNNI && (mf_vecdot_avx512[type] || mf_vecdot4_avx512[type])) {
        if (mf_vecdot_avx512[type]) c.vd = mf_vecdot_avx512[type], c.vx4 = NULL; /* vx4 pairs with the AVX2 vd */
        c.vd4 = mf_vecdot4_avx512[type];
        c.vd8 = mf_vecdot8_avx512[type];
        c.vd4_seq = 0;
        /* the 256-value types also on short rows (mf_tune.k_vd4_short_rb), grouped strided */
        if (c.rb < vd4_min_rb(type) && !(kq_rows(type) && c.rb <= mf_tune.k_vd4_short_rb)) c.vd4 = NULL;
        if (c.rb < vd8_min_rb(type)) c.vd8 = NULL;
        c.strided = (c.vd4 || c.vd8) && c.rb <= mf_tune.stride_max_rb;
        c.xfmt = mf_xfmt_avx512[type];
        c.kpf = mf_tune.pf_dist && mf_kpf_avx512[type];
        c.kpf_multi = mf_tune.pf_dist_multi && mf_kpf_avx512[type];
        c.xs = c.xfmt == XF_Q8_32 ? (size_t)(cols / 32) * sizeof(mf_q8_32) : (size_t)(cols / 256) * sizeof(mf_q8_256);
    }
    if (p->fn == mm_task_vec) {
        /* decode streams W once: tasks of ~4 x mf_tune.task_kib contiguous KiB for the 1-row
         * kernels, mf_tune.task_kib_multi for the 4/8-row ones (task_kib_strided where their rows are
         * grouped a part apart) (at most one
         * share per thread). Small interleaved tiles defeat the hardware prefetchers: with
         * 16-row tiles two threads streamed SmolLM2's layers at 5.7 GB/s, with 64 KiB tasks
         * at 11 GB/s (one thread: 6 GB/s). A multiple of 4 rows keeps the 4-row kernel's
         * grouping (and so the result bits) independent of the task size. */
        int64_t share = (rows + nt - 1) / nt;
        c.streams = c.vd4 || c.vd8 ? 1 : mf_tune.streams;
        const int64_t tb = c.strided ? (int64_t)mf_tune.task_kib_strided * 1024
                         : (c.vd4 || c.vd8) && !c.vd4_seq ? (int64_t)mf_tune.task_kib_multi * 1024 : (int64_t)mf_tune.task_kib * 4096;
        if (share * c.rb > tb) share = tb / c.rb;
        c.rt = share < 4 ? 4 : (share + 3) & ~(int64_t)3; /* rows longer than a task: 4 rows a task */
    }
    p->ntasks = rows == 0 ? 0 : (rows + c.rt - 1) / c.rt;
    p->c = c;
    return 0;
}

typedef struct {
    mm_plan *p;
    int k;
    int64_t off[MF_MM_MAX + 1]; /* task prefix sums */
} multi_ctx;

static void multi_task(void *v, int64_t t) {
    multi_ctx *m = v;
    int j = 0;
    while (t >= m->off[j + 1]) j++;
    m->p[j].fn(&m->p[j].c, t - m->off[j]);
}

static int matmul_multi(int k, const int *types, const uint8_t *const *ws, const int64_t *rows,
                        int64_t cols, const float *x, int64_t n, float *const *ys, int vec_only) {
    assert(k >= 1 && k <= MF_MM_MAX);
    mm_plan p[MF_MM_MAX];
    multi_ctx m = {p, k, {0}};
    int need_xb = 0;
    size_t sz[XF_N] = {0}, at[XF_N] = {0}, total = 0; /* X bytes per activation format used */
    for (int j = 0; j < k; j++) {
        int rc = mm_plan_init(&p[j], types[j], ws[j], rows[j], cols, x, n, ys[j], vec_only);
        if (rc) return rc;
        m.off[j + 1] = m.off[j] + p[j].ntasks;
        if (p[j].c.kg) need_xb = 1;
        else if (p[j].c.xfmt != XF_F32) /* the b32 GEMM quantizes X by bands of 16 rows */
            sz[p[j].c.xfmt] = p[j].c.xs * (size_t)(p[j].c.xfmt == XF_B32BAND ? (n + 15) / 16 : n);
    }
    if (n == 0 || m.off[k] == 0) return 0;
    /* decode: every thread sweeps one ascending stretch of the weights (see pool.c) */
    int vec = 1;
    for (int j = 0; j < k; j++) vec &= p[j].fn == mm_task_vec;
    void (*pfor)(int64_t, mf_task_fn, void *) = vec ? mf_parallel_for_ranged : mf_parallel_for;
    size_t at_xb = 0;
    for (int f = XF_Q8_32; f < XF_N; f++) {
        at[f] = at_xb;
        at_xb += (sz[f] + 63) & ~(size_t)63;
    }
    const int64_t nbands = (n + MF_XB_ROWS - 1) / MF_XB_ROWS;
    total = at_xb + (need_xb ? (size_t)nbands * (size_t)(cols / 256) * sizeof(mf_xband) : 0);
    if (total == 0) {
        pfor(m.off[k], multi_task, &m);
        return 0;
    }
    pthread_mutex_lock(&xq_lock);
    if (total > xq_cap) {
        free(xq_buf);
        xq_buf = aligned_alloc(64, (total + 63) & ~(size_t)63);
        xq_cap = xq_buf ? total : 0;
        if (!xq_buf) { pthread_mutex_unlock(&xq_lock); return -3; }
    }
    for (int f = XF_Q8_32; f < XF_N; f++) {
        if (!sz[f]) continue;
        int j = 0;
        while (p[j].c.xfmt != f) j++;
        p[j].c.xq = xq_buf + at[f];
        mf_parallel_for(f == XF_B32BAND ? (n + 15) / 16 : n, quant_x_task, &p[j].c);
        for (int i = 0; i < k; i++)
            if (p[i].c.xfmt == f) p[i].c.xq = xq_buf + at[f];
    }
    int rc = 0;
    if (need_xb) {
        int j = 0;
        while (!p[j].c.kg) j++;
        p[j].c.xb = (const mf_xband *)(xq_buf + at_xb);
        mf_parallel_for(nbands, xband_task, &p[j].c);
        for (int i = 0; i < k; i++) {
            if (p[i].c.kg) p[i].c.xb = p[j].c.xb;
            if (p[i].c.err) rc = -3;
        }
    }
    if (!rc) pfor(m.off[k], multi_task, &m);
    for (int i = 0; i < k; i++)
        if (p[i].c.err) rc = -3;
    pthread_mutex_unlock(&xq_lock);
    return rc;
}

/* Grouped decode matmul (the routed experts of a MoE layer in one pool job): for groups g <
 * G and weights j < k, Y_j[off[g] .. off[g + 1]) = X[off[g] .. off[g + 1]) · W_{g k + j}^T,
 * X [off[G], cols], Y_j [off[G], rows_j]. The decode kernels only (mode MF_MM_DECODE): each
 * group's plan is the one mf_matmul_multi_ex would make for its rows alone, and X is quantized
 * once per row, so every row equals that call bit for bit; only the pool jobs differ (one for
 * all groups instead of one per group). Returns 0, -1/-2 (type, cols), -3 out of memory. */
typedef struct {
    mm_plan *p;
    int64_t np;
    int64_t *off; /* task prefix sums [np + 1] */
} grouped_ctx;

static void grouped_task(void *v, int64_t t) {
    grouped_ctx *m = v;
    int64_t lo = 0, hi = m->np - 1; /* the plan whose tasks hold t */
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (m->off[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    m->p[lo].fn(&m->p[lo].c, t - m->off[lo]);
}

static _Thread_local void *gr_buf;
static _Thread_local size_t gr_cap;

static int matmul_grouped(int k, const int *types, const uint8_t *const *ws, const int64_t *rows, int64_t cols,
                          const float *x, const int64_t *off, int64_t G, float *const *ys) {
    const int64_t np = G * k, N = off[G];
    const size_t need = (size_t)np * sizeof(mm_plan) + (size_t)(np + 1) * sizeof(int64_t);
    if (need > gr_cap) {
        free(gr_buf);
        gr_buf = malloc(need);
        gr_cap = gr_buf ? need : 0;
        if (!gr_buf) return -3;
    }
    mm_plan *p = gr_buf;
    grouped_ctx m = {p, 0, (int64_t *)(p + np)};
    m.off[0] = 0;
    int vec = 1;
    size_t xs[XF_N] = {0}; /* bytes per X row of each activation format used (XF_Q8_*) */
    for (int64_t g = 0; g < G; g++)
        for (int j = 0; j < k; j++) {
            const int64_t i = g * k + j, a = off[g];
            int rc = mm_plan_init(&p[i], types[j], ws[i], rows[j], cols, x + a * cols, off[g + 1] - a,
                                  ys[j] + a * rows[j], MF_MM_DECODE);
            if (rc) return rc;
            if (p[i].c.xfmt != XF_F32) xs[p[i].c.xfmt] = p[i].c.xs;
            vec &= p[i].fn == mm_task_vec;
            m.off[i + 1] = m.off[i] + p[i].ntasks;
        }
    m.np = np;
    if (N == 0 || m.off[np] == 0) return 0;
    void (*pfor)(int64_t, mf_task_fn, void *) = vec ? mf_parallel_for_ranged : mf_parallel_for;
    size_t at[XF_N] = {0}, total = 0;
    for (int f = XF_Q8_32; f < XF_N; f++) {
        at[f] = total;
        total += (xs[f] * (size_t)N + 63) & ~(size_t)63;
    }
    if (total == 0) {
        pfor(m.off[np], grouped_task, &m);
        return 0;
    }
    pthread_mutex_lock(&xq_lock);
    if (total > xq_cap) {
        free(xq_buf);
        xq_buf = aligned_alloc(64, (total + 63) & ~(size_t)63);
        xq_cap = xq_buf ? total : 0;
        if (!xq_buf) { pthread_mutex_unlock(&xq_lock); return -3; }
    }
    for (int f = XF_Q8_32; f < XF_N; f++) {
        if (!xs[f]) continue;
        mm_ctx qc = {.xfmt = f, .x = x, .n = N, .cols = cols, .xs = xs[f], .xq = xq_buf + at[f]};
        mf_parallel_for(N, quant_x_task, &qc); /* all rows of X at once, one row as alone */
    }
    for (int64_t g = 0; g < G; g++)
        for (int j = 0; j < k; j++) {
            mm_ctx *c = &p[g * k + j].c;
            if (c->xfmt != XF_F32) c->xq = xq_buf + at[c->xfmt] + (size_t)off[g] * xs[c->xfmt];
        }
    pfor(m.off[np], grouped_task, &m);
    pthread_mutex_unlock(&xq_lock);
    return 0;
}

/* ---- profile (memfit bench --profile): calls, time and weight bytes per weight set ---- */
extern int mf_prof_on;   /* pool.c */
int64_t mf_now_ns(void); /* pool.c */
#define MF_PROF_KEYS 64
typedef struct {
    int k, types[MF_MM_MAX];
    int64_t rows[MF_MM_MAX], cols, n, calls, ns, bytes;
} prof_mm;
static prof_mm prof_tab[MF_PROF_KEYS];
static int prof_used;
static pthread_mutex_t prof_lock = PTHREAD_MUTEX_INITIALIZER;

void mf_prof_mm_reset(void) {
    pthread_mutex_lock(&prof_lock);
    prof_used = 0;
    pthread_mutex_unlock(&prof_lock);
}

static void prof_record(int k, const int *types, const int64_t *rows, int64_t cols, int64_t n, int64_t ns) {
    pthread_mutex_lock(&prof_lock);
    int e = 0;
    for (; e < prof_used; e++) {
        prof_mm *p = &prof_tab[e];
        int same = p->k == k && p->cols == cols && p->n == n;
        for (int j = 0; same && j < k; j++) same = p->types[j] == types[j] && p->rows[j] == rows[j];
        if (same) break;
    }
    if (e == prof_used && prof_used < MF_PROF_KEYS) {
        prof_mm *p = &prof_tab[prof_used++];
        *p = (prof_mm){.k = k, .cols = cols, .n = n};
        for (int j = 0; j < k; j++) {
            p->types[j] = types[j];
            p->rows[j] = rows[j];
            p->bytes += rows[j] * (cols / mf_qtypes[types[j]].block) * mf_qtypes[types[j]].bytes;
        }
    }
    if (e < prof_used) {
        prof_tab[e].calls++;
        prof_tab[e].ns += ns;
    }
    pthread_mutex_unlock(&prof_lock);
}

/* [{types, rows, cols, n, calls, ns, bytes (weight bytes of one call)}] */
PyObject *mf_prof_mm_list(void) {
    pthread_mutex_lock(&prof_lock);
    PyObject *out = PyList_New(0);
    for (int e = 0; out && e < prof_used; e++) {
        prof_mm *p = &prof_tab[e];
        PyObject *t = PyTuple_New(p->k), *r = PyTuple_New(p->k), *d = NULL;
        if (t && r) {
            for (int j = 0; j < p->k; j++) {
                PyTuple_SET_ITEM(t, j, PyLong_FromLong(p->types[j]));
                PyTuple_SET_ITEM(r, j, PyLong_FromLongLong(p->rows[j]));
            }
            d = Py_BuildValue("{s:O,s:O,s:L,s:L,s:L,s:L,s:L}", "types", t, "rows", r, "cols",
                              (long long)p->cols, "n", (long long)p->n, "calls", (long long)p->calls,
                              "ns", (long long)p->ns, "bytes", (long long)p->bytes);
        }
        Py_XDECREF(t);
        Py_XDECREF(r);
        if (!d || PyList_Append(out, d) < 0) { Py_XDECREF(d); Py_CLEAR(out); break; }
        Py_DECREF(d);
    }
    pthread_mutex_unlock(&prof_lock);
    return out;
}

/* Y_j[n, rows_j] = X[n, cols] · W_j^T for k <= MF_MM_MAX weights sharing X: X is quantized
 * once per activation format and all weights' row tiles run as one pool job (decode issues
 * Q/K/V and gate/up this way: fewer wake-ups, one quantization).
 * Returns 0, or -1 unknown type / -2 bad cols / -3 out of memory. Call without the GIL. */
int mf_matmul_multi_ex(int k, const int *types, const uint8_t *const *ws, const int64_t *rows,
                       int64_t cols, const float *x, int64_t n, float *const *ys, int vec_only) {
    if (!mf_prof_on) return matmul_multi(k, types, ws, rows, cols, x, n, ys, vec_only);
    int64_t t0 = mf_now_ns();
    int rc = matmul_multi(k, types, ws, rows, cols, x, n, ys, vec_only);
    if (rc == 0) prof_record(k, types, rows, cols, n, mf_now_ns() - t0);
    return rc;
}

/* matmul_grouped above (k <= MF_MM_MAX weights per group); profiled as one call of G stacked
 * weights per j over n_prof rows (the step's own rows, not the gathered copies). Call without
 * the GIL. */
int mf_matmul_grouped(int k, const int *types, const uint8_t *const *ws, const int64_t *rows, int64_t cols,
                      const float *x, const int64_t *off, int64_t G, float *const *ys, int64_t n_prof) {
    assert(k >= 1 && k <= MF_MM_MAX);
    if (!mf_prof_on) return matmul_grouped(k, types, ws, rows, cols, x, off, G, ys);
    int64_t t0 = mf_now_ns();
    int rc = matmul_grouped(k, types, ws, rows, cols, x, off, G, ys);
    int64_t gr[MF_MM_MAX];
    for (int j = 0; j < k; j++) gr[j] = rows[j] * G;
    if (rc == 0) prof_record(k, types, gr, cols, n_prof, mf_now_ns() - t0);
    return rc;
}

/* The above; vec_only keeps the one-row (decode) kernels for any n, so each row of Y is
 * bit-identical to the same X row alone (batched decode relies on it). */
int mf_matmul_multi(int k, const int *types, const uint8_t *const *ws, const int64_t *rows,
                    int64_t cols, const float *x, int64_t n, float *const *ys) {
    return mf_matmul_multi_ex(k, types, ws, rows, cols, x, n, ys, 0);
}

/* Returns 0, or -1 unknown type / -2 bad cols / -3 out of memory. Call without the GIL. */
int mf_matmul(int type, const uint8_t *w, int64_t rows, int64_t cols, const float *x, int64_t n,
              float *y) {
    return mf_matmul_multi(1, &type, &w, &rows, cols, x, n, &y);
}

/* ---- per-head matmuls (DeepSeek MLA's absorbed projections) ------------------------------ */

/* One plan per head; every head has the same shape, so the same task count and activation
 * layout: head h's share of a pool job is tasks [h * per, (h + 1) * per). */
typedef struct {
    mm_plan *p;
    int64_t per;                   /* tasks per head */
    const float *x;                /* gather: x[n, H, cols] -> xh[H, n, cols]; scatter back */
    float *xh, *yh, *y;
    int64_t H, n, rows, cols;
} heads_ctx;

static void heads_gather_task(void *v, int64_t h) {
    const heads_ctx *c = v;
    for (int64_t i = 0; i < c->n; i++)
        memcpy(c->xh + (h * c->n + i) * c->cols, c->x + (i * c->H + h) * c->cols, sizeof(float) * (size_t)c->cols);
}

static void heads_scatter_task(void *v, int64_t h) {
    const heads_ctx *c = v;
    for (int64_t i = 0; i < c->n; i++)
        memcpy(c->y + (i * c->H + h) * c->rows, c->yh + (h * c->n + i) * c->rows, sizeof(float) * (size_t)c->rows);
}

static void heads_quant_task(void *v, int64_t t) {
    const heads_ctx *c = v;
    quant_x_task(&c->p[t / c->per].c, t % c->per);
}

static void heads_xband_task(void *v, int64_t t) {
    const heads_ctx *c = v;
    xband_task(&c->p[t / c->per].c, t % c->per);
}

static void heads_mm_task(void *v, int64_t t) {
    const heads_ctx *c = v;
    const mm_plan *p = &c->p[t / c->per];
    p->fn((void *)&p->c, t % c->per);
}

static size_t align64(size_t b) { return (b + 63) & ~(size_t)63; }

/* y[n, H, rows] = per head h: x[n, h, :] . W_h^T, W_h the h-th of H consecutive (rows, cols)
 * matrices of w. Each head gets the plan that mf_matmul_multi_ex(1, ..) makes for x[:, h]
 * alone (same kernels, same task split), and all heads' tasks run as one pool job, so head h
 * equals that call bit for bit (batch invariance as ever: mode picks the family, not n). The
 * heads are gathered to contiguous [n, cols] blocks first and the results scattered back.
 * Returns 0, or -1 unknown type / -2 bad cols / -3 out of memory. Call without the GIL. */
int mf_matmul_heads(int type, const uint8_t *w, int64_t H, int64_t rows, int64_t cols, const float *x,
                    int64_t n, float *y, int mode) {
    if (type < 0 || type >= T_MAX || !mf_type_ok(type)) return -1;
    if (cols % mf_qtypes[type].block) return -2;
    if (n == 0 || H == 0 || rows == 0) return 0;
    const int64_t t0 = mf_prof_on ? mf_now_ns() : 0;
    const int64_t rb = cols / mf_qtypes[type].block * mf_qtypes[type].bytes;
    mm_plan *p = malloc(sizeof(mm_plan) * (size_t)H);
    if (!p) return -3;
    /* one buffer: xh [H, n, cols], yh [H, n, rows], then per head its prepared activations */
    const size_t bx = align64(sizeof(float) * (size_t)(H * n * cols)), by = align64(sizeof(float) * (size_t)(H * n * rows));
    pthread_mutex_lock(&xq_lock);
    int rc = 0;
    heads_ctx c = {.p = p, .x = x, .y = y, .H = H, .n = n, .rows = rows, .cols = cols};
    size_t per_q = 0, need = bx + by;
    for (int64_t h = 0; h < H && rc == 0; h++) {
        /* x and y pointers are set once the buffer exists; the plan does not depend on them */
        rc = mm_plan_init(&p[h], type, w + h * rows * rb, rows, cols, NULL, n, NULL, mode);
    }
    if (rc == 0) {
        const mm_ctx *c0 = &p[0].c;
        if (c0->kg) per_q = (size_t)((n + MF_XB_ROWS - 1) / MF_XB_ROWS) * (size_t)(cols / 256) * sizeof(mf_xband);
        else if (c0->xfmt == XF_B32BAND) per_q = c0->xs * (size_t)((n + 15) / 16);
        else if (c0->xfmt != XF_F32) per_q = c0->xs * (size_t)n;
        per_q = align64(per_q);
        need += per_q * (size_t)H;
        if (need > xq_cap) {
            free(xq_buf);
            xq_buf = aligned_alloc(64, need);
            xq_cap = xq_buf ? need : 0;
            if (!xq_buf) rc = -3;
        }
    }
    if (rc == 0) {
        c.xh = (float *)(void *)xq_buf;
        c.yh = (float *)(void *)(xq_buf + bx);
        for (int64_t h = 0; h < H; h++) {
            mm_ctx *ch = &p[h].c;
            ch->x = c.xh + h * n * cols;
            ch->y = c.yh + h * n * rows;
            uint8_t *q = xq_buf + bx + by + (size_t)h * per_q;
            if (ch->kg) ch->xb = (const mf_xband *)(void *)q;
            else if (ch->xfmt != XF_F32) ch->xq = q;
            else ch->xq = (const uint8_t *)ch->x; /* float weights (and scalar) read x itself */
        }
        mf_parallel_for(H, heads_gather_task, &c);
        const mm_ctx *c0 = &p[0].c;
        if (c0->kg) {
            c.per = (n + MF_XB_ROWS - 1) / MF_XB_ROWS;
            mf_parallel_for(H * c.per, heads_xband_task, &c);
        } else if (c0->xfmt != XF_F32) {
            c.per = c0->xfmt == XF_B32BAND ? (n + 15) / 16 : n;
            mf_parallel_for(H * c.per, heads_quant_task, &c);
        }
        for (int64_t h = 0; h < H; h++)
            if (p[h].c.err) rc = -3;
    }
    if (rc == 0 && p[0].ntasks > 0) {
        c.per = p[0].ntasks;
        (p[0].fn == mm_task_vec ? mf_parallel_for_ranged : mf_parallel_for)(H * c.per, heads_mm_task, &c);
        for (int64_t h = 0; h < H; h++)
            if (p[h].c.err) rc = -3;
        if (rc == 0) mf_parallel_for(H, heads_scatter_task, &c);
    }
    pthread_mutex_unlock(&xq_lock);
    free(p);
    if (rc == 0 && mf_prof_on) {
        const int64_t all = rows * H;
        prof_record(1, &type, &all, cols, n, mf_now_ns() - t0);
    }
    return rc;
}

typedef struct {
    int type;
    const uint8_t *w;
    int64_t cols, rb;
    const int64_t *ids;
    float *out;
} gr_ctx;

static void gr_task(void *p, int64_t i) {
    gr_ctx *c = p;
    mf_dequant_row(c->type, c->w + c->ids[i] * c->rb, c->out + i * c->cols, c->cols);
}

/* ids already range-checked by the caller. */
int mf_get_rows(int type, const uint8_t *w, int64_t cols, const int64_t *ids, int64_t n, float *out) {
    if (type < 0 || type >= T_MAX || !mf_type_ok(type)) return -1;
    const mf_qinfo *q = &mf_qtypes[type];
    if (cols % q->block) return -2;
    gr_ctx c = {type, w, cols, cols / q->block * q->bytes, ids, out};
    mf_parallel_for(n, gr_task, &c);
    return 0;
}

typedef struct {
    int type;
    const uint8_t *src;
    float *dst;
    int64_t chunk, n;
    int bytes, block;
} dq_ctx;

static void dq_task(void *p, int64_t t) {
    dq_ctx *c = p;
    int64_t e0 = t * c->chunk, e1 = e0 + c->chunk < c->n ? e0 + c->chunk : c->n;
    mf_dequant_row(c->type, c->src + e0 / c->block * c->bytes, c->dst + e0, e1 - e0);
}

int mf_dequantize(int type, const uint8_t *src, int64_t n, float *dst) {
    if (type < 0 || type >= T_MAX || !mf_type_ok(type)) return -1;
    const mf_qinfo *q = &mf_qtypes[type];
    if (n % q->block) return -2;
    int64_t chunk = (int64_t)q->block * 256;
    dq_ctx c = {type, src, dst, chunk, n, q->bytes, q->block};
    mf_parallel_for((n + chunk - 1) / chunk, dq_task, &c);
    return 0;
}
