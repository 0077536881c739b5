/* Quant kernels: block layouts (ggml), activation formats, per-ISA vec-dot tables. */
#ifndef MF_QUANT_COMMON_H
#define MF_QUANT_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20,
    T_IQ2_XXS = 16, T_IQ2_XS = 17, T_IQ3_XXS = 18, T_IQ1_S = 19, T_IQ3_S = 21, T_IQ2_S = 22,
    T_IQ4_XS = 23, T_IQ1_M = 29, T_BF16 = 30, T_TQ1_0 = 34, T_TQ2_0 = 35, T_MXFP4 = 39,
    T_NVFP4 = 40, T_MAX = 48
};

/* Activation formats the integer vec-dots consume (memfit's own, not ggml's byte layout).
 * XF_Q8_256S: XF_Q8_256 with the middle two 32-byte quarters of each 128 values of qs swapped
 * (bsums, d unchanged; mf_q8_256_reorder), so that a 64-byte load of a K-quant row's packed
 * nibbles (two 32-byte chunks) meets its activations in one 64-byte load (the avx512vnni
 * Q4_K and Q5_K decode kernels). XF_Q8_256N: each 128 values' 16-byte pieces in the order
 * 0, 2, 4, 6, 1, 3, 5, 7 (the first halves of its four 32-value sub-blocks, then the second
 * halves), the order of a 64-byte load of IQ4_XS nibbles split low / high.
 * XF_Q8_256T: the 32-byte quarters in the order 0, 4, 1, 5, 2, 6, 3, 7, the order of a 64-byte
 * load of Q2_K/Q3_K 2-bit fields taken at one shift. */
enum { XF_F32 = 0, XF_Q8_32 = 1, XF_Q8_256 = 2, XF_B32BAND = 3, XF_Q8_256S = 4, XF_Q8_256N = 5, XF_Q8_256T = 6,
       XF_N = 7 };
typedef struct { float d; float s; int8_t qs[32]; } mf_q8_32;                /* s = d * sum(qs) */
/* qs first and the struct 64-byte aligned (320 bytes): the prefill kernels' 32-byte loads of
 * qs never split a cache line (292 packed bytes split half of them) */
typedef struct { _Alignas(64) int8_t qs[256]; int16_t bsums[16]; float d; } mf_q8_256; /* bsums per 16 */

/* XF_Q8_256 rows (nb blocks) -> the order of xfmt (XF_Q8_256S/N/T) in place: per 128 values,
 * the source piece of each destination piece (32-byte pieces for S and T, 16-byte for N) */
static inline void mf_q8_256_reorder(void *x, int64_t nb, int xfmt) {
    static const uint8_t order[3][16] = {{0, 2, 1, 3, 4, 6, 5, 7},                                  /* S */
                                         {0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15},    /* N */
                                         {0, 4, 1, 5, 2, 6, 3, 7}};                                 /* T */
    const uint8_t *o = order[xfmt - XF_Q8_256S];
    const int piece = xfmt == XF_Q8_256N ? 16 : 32;
    mf_q8_256 *b = x;
    for (int64_t i = 0; i < nb; i++) {
        int8_t t[256];
        memcpy(t, b[i].qs, 256);
        for (int k = 0; k < 256 / piece; k++) memcpy(b[i].qs + piece * k, t + piece * o[k], (size_t)piece);
    }
}

/* One row of W (nb blocks) against one prepared activation row. */
typedef float (*mf_vecdot_fn)(const uint8_t *w, const void *x, int64_t nb);

typedef struct {
    int block;      /* elements per block */
    int bytes;      /* bytes per block */
    int xfmt;       /* activation format for the avx2/avx512 vec-dot */
} mf_qinfo;

extern const mf_qinfo mf_qtypes[T_MAX];
extern const int8_t mf_kvalues_iq4nl[16];
extern float mf_f16_table[65536];

static inline float mf_f16(const uint8_t *p) { return mf_f16_table[p[0] | (p[1] << 8)]; }
/* a little-endian u32 of a block (unaligned) */
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

void mf_quant_init(void);
/* 1 when the native core computes with the type: a float type, or a quant type whose
 * dequantizer exists and whose tables (quant_tables.c) are installed */
int mf_type_ok(int type);
int mf_dequant_row(int type, const uint8_t *src, float *dst, int64_t n);
void mf_get_scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m);

/* Lattice tables of the IQ types (quant_tables.c), installed once at import from gguf-py (see
 * there). Row-major int8 values, so e.g. mf_grid_iq2xxs read as uint64[256] is ggml's
 * iq2xxs_grid and mf_grid_iq3xxs as uint32[256] is iq3xxs_grid. */
extern _Alignas(64) int8_t mf_grid_iq2xxs[256 * 8], mf_grid_iq2xs[512 * 8], mf_grid_iq2s[1024 * 8];
extern _Alignas(64) uint8_t mf_grid_iq3xxs[256 * 4], mf_grid_iq3s[512 * 4];
/* IQ3_S's grid as two nibble tables for the AVX-512 VBMI byte lookups (quant_tables.c derives
 * them from mf_grid_iq3s when it is installed): row i's values g0..g3 (odd, 1..15) as
 * g0 | g1 << 4 in mf_iq3s_n01[i] and g2 | g3 << 4 in mf_iq3s_n23[i] */
extern _Alignas(64) uint8_t mf_iq3s_n01[512], mf_iq3s_n23[512];
/* IQ3_XXS's the same way, with each value's code (0..7: 4, 12, .., 52, 62) in place of the value */
extern _Alignas(64) uint8_t mf_iq3xxs_n01[256], mf_iq3xxs_n23[256];
/* IQ2_XXS's grid as 2-bit value codes (0, 1, 2: 8, 25, 43) for the AVX-512 VBMI lookups: row i's
 * values 0..3 in mf_iq2xxs_c03[i] (value k at bits 2k), values 4..7 in mf_iq2xxs_c47[i] */
extern _Alignas(64) uint8_t mf_iq2xxs_c03[256], mf_iq2xxs_c47[256];
extern _Alignas(64) int8_t mf_grid_iq1s[2048 * 8]; /* -1/0/+1; IQ1_S and IQ1_M share it */
/* the same rows in IQ1's unsigned form for the AVX2 vec-dots: entry q | n << 8 (n: the 3 high
 * index bits and, in bit 3, the delta's sign) holds 8 bytes 8 (grid + 1) + (n & 8 ? 0 : 2),
 * i.e. 8 (grid + delta) + 9 with delta = +-1/8 scaled by 8 */
extern _Alignas(64) uint64_t mf_iq1_u[4096];
extern uint8_t mf_ksigns_iq2xs[128];                /* ggml's ksigns_iq2xs */
/* mf_ksigns_iq2xs as sign_epi8 patterns: byte k of entry i 0xFF (-1) where bit k of
 * ksigns_iq2xs[i] is set, else 0x01; derived when that table is installed (quant_tables.c), for
 * the AVX2 IQ2_XXS vec-dot's table loads (quant_iq2.c). */
extern _Alignas(64) uint64_t mf_ksign_u64[128];
extern int mf_slow_gather; /* pool.c: this CPU's grid-row gathers are slower than scalar loads */
extern int mf_has_bmi1;    /* pool.c: BMI1 (bextr); MEMFIT_BMI1=0 turns it off */
/* Decode matvec and prefill GEMM tiling (pool.c tune_init): chosen per CPU family from a measured table,
 * each field overridable by MEMFIT_TUNE="name=value,...". None changes a result bit: they pick
 * among kernels with the same per-row arithmetic and the order rows are read in. */
typedef struct {
    int pf_rows;       /* 1-row decode kernels: W rows prefetched this many rows ahead (0: none) */
    int pf_rows_multi; /* 4/8-row decode kernels (adjacent rows): the same */
    int pf_strided;    /* strided 4/8-row groups: rows ahead in each part */
    int q8_vd4_min_rb; /* avx512vnni: Q8_0 rows of at least this many bytes take the 4-row kernel */
    int k_vd4_min_rb;  /* avx512vnni: Q4_K/Q5_K/Q6_K rows of at least this many bytes (Q2_K/Q3_K/IQ4_XS: as many values as a Q4_K row of it): 4-row kernel */
    int k_vd8_min_rb;  /* the same for their 8-row kernel (taken before the 4-row one) */
    int stride_max_rb; /* avx512vnni 4/8-row kernels: rows up to this many bytes grouped a part apart */
    int streams;       /* decode, 1-row kernels: a task's rows read as this many interleaved streams */
    int task_kib;      /* decode, 1-row kernels: 4x this many contiguous KiB of W per task */
    int task_kib_multi; /* decode, 4/8-row kernels: contiguous KiB of W per task */
    int task_kib_strided; /* decode, 4/8-row kernels on rows grouped a part apart (stride_max_rb): the same */
    int kg_tile_kib;   /* prefill, K-quant GEMM (avx512vnni): KiB of unpacked W per task */
    int fa_heads;      /* f16-cache attention (AVX2 and up): q heads of one KV group per task at most,
                        * sharing the K/V rows' conversion (0: one head per task, ops.c fa16_paged_task) */
    int pf_dist;       /* decode kernels that prefetch in their block loop (mf_kpf_avx512/avx2): W
                        * bytes ahead in each row's stream, 1-row kernels (0: no in-loop prefetch,
                        * pf_rows applies instead) */
    int pf_dist_multi; /* the same for the 4/8-row kernels: each of their 4-8 streams a core walks
                        * at once gets this distance (0: none, pf_rows_multi applies instead) */
    int pdep;          /* IQ1_S/IQ1_M/IQ3_S AVX2 decode: grid-row indexes built by pdep (1; only with BMI2) */
    int k_vd4_short_rb; /* rows of at most this many bytes take the 4-row kernel (0: never): avx2 the types in mf_vd4_seq_avx2 (Q4_K, Q6_K), avx512vnni the 256-value types with 4-row kernels */
} mf_tune_t;
#define MF_FA_HEADS_MAX 128 /* mf_tune.fa_heads at most (ops.c's per-task state arrays) */
extern mf_tune_t mf_tune;
extern const char *mf_tune_source; /* "default", "amd-zen4", ... (+ " +" the MEMFIT_TUNE spec) */
int mf_tables_ready(int type);                      /* 1 when the type's tables are installed */

/* In-kernel prefetch for decode: each block step of a row prefetches (prefetcht1, into L2) the
 * lines of the step `mf_tune.pf_dist` bytes further along the row's stream, so the requests stay
 * in flight while the core computes (the row-ahead bursts of quant_mm.c prefetch_rows left the
 * reads and the arithmetic one after the other: docs/NOTES.md session 20). No arithmetic
 * changes. mf_pf_span: the lines of [p, p + bytes) (64-byte steps cover each line once or twice). */
#define mf_pf_span(p, bytes)                                                                       \
    do {                                                                                           \
        for (int span_o_ = 0; span_o_ < (bytes); span_o_ += 64) __builtin_prefetch((const char *)(p) + span_o_, 0, 2); \
    } while (0)
/* The offset to prefetch from, for block position pos of one row of a group of R rows rb bytes
 * apart with rowb bytes each: adjacent rows (rb == rowb) continue past a row's end in the same
 * row of the next group (R rows on); rows a part apart (rb > rowb, quant_mm.c vec_rows_strided)
 * continue in the next row. */
static inline int64_t mf_pf_off(int64_t pos, int64_t d, int64_t rowb, size_t rb, int R) {
    const int64_t o = pos + d;
    return o >= rowb && (int64_t)rb == rowb ? o + (R - 1) * rowb : o;
}
#define MF_PF_MULTI (mf_tune.pf_dist_multi) /* 4/8-row kernels' distance */
/* a 1-row kernel's block step: the step pf bytes further along the row (pf 0: none) */
#define MF_PF_STEP(w, pf, bytes)                       \
    do {                                               \
        if (pf) mf_pf_span((w) + (pf), (bytes));       \
    } while (0)
/* an R-row kernel's block step: w the first row at position pos of rows of rowb bytes, the rows
 * rb bytes apart; the step's bytes pf further along each row's stream (pf 0: none) */
#define MF_PF_ROWS(w, R, rb, pos, rowb, pf, bytes)                                                     \
    do {                                                                                               \
        if (pf) {                                                                                      \
            const int64_t rows_o_ = mf_pf_off((pos), (pf), (rowb), (rb), (R)) - (pos);                 \
            for (int rows_r_ = 0; rows_r_ < (R); rows_r_++)                                            \
                mf_pf_span((w) + rows_r_ * (int64_t)(rb) + rows_o_, bytes);                            \
        }                                                                                              \
    } while (0)
/* types whose avx512vnni (avx2) decode kernels, 1-row and 4/8-row, prefetch in their block loop */
extern const uint8_t mf_kpf_avx512[T_MAX], mf_kpf_avx2[T_MAX];

/* A K-quant block unpacked for the prefill kernel (see quant_avx2.c). */
typedef struct { _Alignas(64) uint8_t q[256]; int16_t sv[8][16]; int16_t cc[16]; float d, dc; } mf_kblk; /* 576 B */
typedef void (*mf_kunpack_fn)(const uint8_t *w, mf_kblk *o);

/* A 32-element block unpacked for the prefill kernel: w = d*q + c (q signed for Q8_0/IQ4_NL). */
typedef struct { float d, c; uint8_t q[32]; } mf_b32;
typedef void (*mf_b32unpack_fn)(const uint8_t *w, mf_b32 *o);

/* prefill unpacks of MXFP4 (into mf_b32) and TQ1_0 / TQ2_0 (into mf_kblk), quant_fp4tq.c */
void mf_up_mxfp4_avx2(const uint8_t *w, mf_b32 *o);
void mf_up_nvfp4_avx2(const uint8_t *w, int8_t *q, float *d);
void mf_up_nvfp4_b32(const uint8_t *w, mf_b32 *o); /* writes o[0], o[1] */
void mf_up_tq1_0_avx2(const uint8_t *w, mf_kblk *o);
/* MXFP4's AVX2 prefill GEMM (quant_fp4tq.c): 8 W rows unpacked per block as 8 chunks of their
 * values 4k..4k+3 (+ 12, unsigned), row r at bytes 4r..4r+3 of each chunk, and their scales */
typedef struct { _Alignas(32) uint8_t u[8][32]; float d[8]; } mf_mx8; /* 288 B */
void mf_up_mxfp4_x8(const uint8_t *w, size_t rb, int nr, int64_t nb, mf_mx8 *o);
void mf_mx8_ysum12_avx2(const uint8_t *xb, size_t xs, int64_t m, int64_t nb, int32_t *sy);
void mf_mx8_gemm_avx2(const mf_mx8 *w, int64_t nb, int nr, const uint8_t *xb, size_t xs, const int32_t *sy,
                      int64_t m, float *y, int64_t ostride);
void mf_up_tq2_0_avx2(const uint8_t *w, mf_kblk *o);

/* 4 consecutive W rows (row stride rb bytes) against one prepared X row -> out[4] */
typedef void (*mf_vecdot4_fn)(const uint8_t *w, size_t rb, const void *x, int64_t nb, float *out);
/* one W row against 4 X rows xs bytes apart: out[i] the same bits as the type's 1-row vec-dot
 * of X row i (quant_mm.c takes it where mf_vecdotx4_avx2 has one) */
typedef void (*mf_vecdotx4_fn)(const uint8_t *w, const void *x, size_t xs, int64_t nb, float *out);
void mf_vdx4_tq2_0_avx2(const uint8_t *w, const void *x, size_t xs, int64_t nb, float *out);

/* IQ2_XXS / IQ2_XS / IQ2_S (quant_iq2.c): dequantize one block, vec-dots x Q8_256, prefill unpack */
void mf_dq_iq2_xxs(const uint8_t *b, float *y);
void mf_dq_iq2_xs(const uint8_t *b, float *y);
void mf_dq_iq2_s(const uint8_t *b, float *y);
float mf_vd_iq2_xxs_avx2(const uint8_t *w, const void *x, int64_t nb);
float mf_vd_iq2_xs_avx2(const uint8_t *w, const void *x, int64_t nb);
float mf_vd_iq2_s_avx2(const uint8_t *w, const void *x, int64_t nb);
float mf_vd_iq2_xxs_avx512(const uint8_t *w, const void *x, int64_t nb);
float mf_vd_iq2_xs_avx512(const uint8_t *w, const void *x, int64_t nb);
float mf_vd_iq2_s_avx512(const uint8_t *w, const void *x, int64_t nb);
void mf_up_iq2_xxs(const uint8_t *w, mf_kblk *o);
void mf_up_iq2_xs(const uint8_t *w, mf_kblk *o);
void mf_up_iq2_s(const uint8_t *w, mf_kblk *o);
/* MXFP4, NVFP4, TQ1_0, TQ2_0 (quant_fp4tq.c): one-block dequantizers and the vec-dots */
void mf_dq_mxfp4(const uint8_t *b, float *y);
void mf_dq_nvfp4(const uint8_t *b, float *y);
void mf_dq_tq1_0(const uint8_t *b, float *y);
void mf_dq_tq2_0(const uint8_t *b, float *y);
float mf_vd_mxfp4_avx2(const uint8_t *w, const void *x, int64_t nb);
void mf_vd1_mxfp4_avx2(const uint8_t *w, size_t rb, const void *x, int64_t nb, float *out);
void mf_vd4_mxfp4_avx2(const uint8_t *w, size_t rb, const void *x, int64_t nb, float *out);
void mf_vd4_nvfp4_avx2(const uint8_t *w, size_t rb, const void *x, int64_t nb, float *out);
float mf_vd_nvfp4_avx2(const uint8_t *w, const void *x, int64_t nb);
float mf_vd_tq1_0_avx2(const uint8_t *w, const void *x, int64_t nb);
float mf_vd_tq2_0_avx2(const uint8_t *w, const void *x, int64_t nb);
float mf_vd_tq1_0_avx512(const uint8_t *w, const void *x, int64_t nb);
float mf_vd_tq2_0_avx512(const uint8_t *w, const void *x, int64_t nb);
void mf_vd4_tq2_0_avx512(const uint8_t *w, size_t rb, const void *x, int64_t nb, float *out);
float mf_vd_mxfp4_avx512(const uint8_t *w, const void *x, int64_t nb);
void mf_vd1_mxfp4_avx512(const uint8_t *w, size_t rb, const void *x, int64_t nb, float *out);
void mf_vd4_mxfp4_avx512(const uint8_t *w, size_t rb, const void *x, int64_t nb, float *out);
void mf_vd8_mxfp4_avx512(const uint8_t *w, size_t rb, const void *x, int64_t nb, float *out);
float mf_vd_nvfp4_avx512(const uint8_t *w, const void *x, int64_t nb);
void mf_vd1_nvfp4_avx512(const uint8_t *w, size_t rb, const void *x, int64_t nb, float *out);
void mf_vd4_nvfp4_avx512(const uint8_t *w, size_t rb, const void *x, int64_t nb, float *out);
void mf_vd8_nvfp4_avx512(const uint8_t *w, size_t rb, const void *x, int64_t nb, float *out);

/* AVX2 (quant_avx2.c) */
void mf_row_f32_avx2(int type, const uint8_t *w, float *dst, int64_t n);
void mf_fgemm_avx2(const float *wf, int64_t nr, const float *x, int64_t m, int64_t cols, float *y, int64_t ys);
extern mf_vecdot4_fn mf_vecdot4_avx2[T_MAX];
extern const uint8_t mf_vd4_seq_avx2[T_MAX]; /* vd4 reads its rows one after another: short rows only */
extern mf_vecdotx4_fn mf_vecdotx4_avx2[T_MAX]; /* optional: 1 W row x 4 X rows, each X row the bits of the 1-row kernel */
extern mf_b32unpack_fn mf_b32unpack_avx2[T_MAX];
#define MF_BST 16 /* X rows per prefill tile: stride of the transposed s and d tables */
void mf_bdot2_avx2(const mf_b32 *w, int64_t nb, int sgn, const uint8_t *x, size_t xs, int64_t m,
                   const float *sd, const float *corr0, const float *corr1, float *out, int64_t ostride);
void mf_bdot_avx2(const mf_b32 *w, int64_t nb, int sgn, const uint8_t *x, size_t xs, int64_t m,
                  const float *corr, float *out, int64_t ostride);
void mf_b32_corr_avx2(const mf_b32 *w, int64_t nb, const float *st, int64_t m, float *corr);
extern mf_kunpack_fn mf_kunpack_avx2[T_MAX];
void mf_kdot_avx2(const mf_kblk *w, int64_t nb, const uint8_t *x, size_t xs, int64_t m, float *out, int64_t ostride);
void mf_kdot2_avx2(const mf_kblk *w0, const mf_kblk *w1, int64_t nb, const uint8_t *x, size_t xs, int64_t m,
                   float *out0, float *out1, int64_t ostride);
extern mf_vecdot_fn mf_vecdot_avx2[T_MAX];
void mf_quantize_q8_32_avx2(const float *x, mf_q8_32 *y, int64_t n);
void mf_quantize_q8_256_avx2(const float *x, mf_q8_256 *y, int64_t n);

/* AVX-512 VNNI decode vec-dots (quant_avx512.c): NULL where the AVX2 one is used (a type with
 * a 4-row kernel there has its 1-row AVX2 vec-dot for the remainder rows); the activation
 * format per type */
extern mf_vecdot_fn mf_vecdot_avx512[T_MAX];
extern mf_vecdot4_fn mf_vecdot4_avx512[T_MAX];
extern mf_vecdot4_fn mf_vecdot8_avx512[T_MAX]; /* 8 rows -> out[8], per row the bits of the 4-row one */
/* prefill kernels with vpdpwssd / vpdpbusd: bit-identical to mf_kdot_avx2 / mf_kdot2_avx2 /
 * mf_bdot_avx2 */
void mf_bdot_avx512(const mf_b32 *w, int64_t nb, int sgn, const uint8_t *x, size_t xs, int64_t m,
                    const float *corr, float *out, int64_t ostride);
void mf_kdot_avx512(const mf_kblk *w, int64_t nb, const uint8_t *x, size_t xs, int64_t m, float *out, int64_t ostride);
void mf_kdot2_avx512(const mf_kblk *w0, const mf_kblk *w1, int64_t nb, const uint8_t *x, size_t xs, int64_t m,
                     float *out0, float *out1, int64_t ostride);
extern int mf_xfmt_avx512[T_MAX];
/* prefill GEMM, 32-element types (quant_avx512.c): X as bands of 16 rows, per 32-value block
 * x[g][4j..4j+3] = row j's int8 values 4g..4g+3 + 128 (u8), its dx and s = dx*sum(qs);
 * rows past the band's end are zero (x = 128, dx = s = 0). 640 B per 512 values. */
typedef struct { _Alignas(64) uint8_t x[8][64]; float dx[16]; float sx[16]; } mf_b32band;
extern const int mf_b32gemm_ok[T_MAX];
void mf_b32band_quant_avx512(const float *x, int64_t cols, int64_t m, mf_b32band *out);
void mf_b32gemm_avx512(int type, const uint8_t *w, size_t rb, int64_t nrows, int64_t nb, const mf_b32band *xb,
                      int64_t n, float *y, int64_t ys);

/* K-quant prefill GEMM (quant_avx512.c, avx512vnni): 16 X rows x R W rows per microkernel.
 * X band: per 16 rows and 256-block, qs[g][j*4..j*4+3] = X row j's int8 values 4g..4g+3 (one
 * zmm per 4 K positions, lane j = X row j), bs[p][j] = row j's bsums[2p] | bsums[2p+1] << 16,
 * bs32[p][j] the same of the sums per 32 (S[2p] | S[2p+1] << 16, for the types whose corrections
 * are per 32), dx[j] = row j's scale (0 for pad rows). */
/* matmul kernel families (quant_mm.c), chosen by the caller, never by the row count */
#define MF_MM_PREFILL 0 /* the type's widest batched kernel (16-row X bands on avx512vnni) */
#define MF_MM_DECODE 1  /* the one-row vec-dots */
#define MF_XB_ROWS 16
typedef struct { _Alignas(64) int8_t qs[64][64]; int32_t bs[8][16]; int32_t bs32[4][16]; float dx[16]; } mf_xband; /* 4928 B */
/* W block: u8 codes in K order, float scale d*sc per sub-block (16 groups of 16, or the first
 * 8 for groups of 32), correction cc pairs as int16x2 (groups of 32: the first 4, one cc per 32)
 * and its float factor dc */
typedef struct { _Alignas(64) uint8_t q[256]; float s[16]; int32_t cc2[8]; float dc; } mf_kw; /* 384 B */
void mf_kw_from_kblk(const mf_kblk *k, int g32, mf_kw *o);
typedef void (*mf_kwunpack_fn)(const uint8_t *w, mf_kw *o);
/* two int16 as one int32 lane (low, high): the pairs vpdpwssd multiplies */
static inline int32_t mf_pack16(int a, int b) { return (int32_t)((uint32_t)(uint16_t)a | ((uint32_t)(uint16_t)b << 16)); }
extern mf_kwunpack_fn mf_kwunpack_avx2[T_MAX]; /* Q4_K, Q6_K: up + mf_kw_from_kblk in one (quant_avx2.c) */
void mf_xband_build(const mf_q8_256 *rows, int64_t m, int64_t nb, mf_xband *o); /* rows[j*nb+b] */
#ifndef MF_KG_R
#define MF_KG_R 8 /* W rows per mf_kgemm_avx512 call, at most */
#endif
/* W rows w[0..R) (each nb blocks) x one or two X bands (nb blocks each; x1 NULL: one) ->
 * out[(h*R + r)*16 + j] for band h, W row r, lane j */
void mf_kgemm_avx512(const mf_kw *const *w, int R, int g32, int64_t nb, const mf_xband *x0,
                     const mf_xband *x1, float *out);
void mf_kgemm4_avx512(const mf_kw *const *w, int R, int g32, int64_t nb, const mf_xband *x0, float *out);
void mf_kg_store8_avx512(const float *out, int m, float *y, int64_t ys);

/* IQ3_XXS, IQ3_S, IQ1_S, IQ1_M (quant_iq3.c): one-block dequantizers (quant.c dq_table) and
 * AVX2 vec-dots x Q8_K (mf_vecdot_avx2) */
void mf_dq_iq3_xxs(const uint8_t *b, float *y);
void mf_dq_iq3_s(const uint8_t *b, float *y);
void mf_dq_iq1_s(const uint8_t *b, float *y);
void mf_dq_iq1_m(const uint8_t *b, float *y);
float mf_vd_iq3_xxs_avx2(const uint8_t *w, const void *x, int64_t nb);
float mf_vd_iq3_s_avx2(const uint8_t *w, const void *x, int64_t nb);
float mf_vd_iq1_s_avx2(const uint8_t *w, const void *x, int64_t nb);
float mf_vd_iq1_m_avx2(const uint8_t *w, const void *x, int64_t nb);
/* prefill: blocks unpacked for the K-quant GEMMs (mf_kunpack_avx2) */
void mf_up_iq3_xxs(const uint8_t *w, mf_kblk *o);
void mf_up_iq3_s(const uint8_t *w, mf_kblk *o);
void mf_up_iq1_s(const uint8_t *w, mf_kblk *o);
void mf_up_iq1_m(const uint8_t *w, mf_kblk *o);
/* AVX-512 VNNI forms (mf_vecdot_avx512, activations XF_Q8_256) */
float mf_vd_iq3_xxs_avx512(const uint8_t *w, const void *x, int64_t nb);
float mf_vd_iq3_s_avx512(const uint8_t *w, const void *x, int64_t nb);
float mf_vd_iq1_s_avx512(const uint8_t *w, const void *x, int64_t nb);
float mf_vd_iq1_m_avx512(const uint8_t *w, const void *x, int64_t nb);

/* per-thread scratch that grows: 64-byte aligned, at least `bytes`; NULL when out of memory */
typedef struct { void *p; size_t cap; } tl_scratch;
static inline void *tl_reserve(tl_scratch *s, size_t bytes) {
    if (bytes > s->cap) {
        free(s->p);
        s->p = aligned_alloc(64, (bytes + 63) & ~(size_t)63); /* C11: size % align == 0 */
        s->cap = s->p ? bytes : 0;
    }
    return s->p;
}

#endif
