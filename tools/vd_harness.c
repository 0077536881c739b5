/* A decode vec-dot timed alone: one thread, rows of one type in L2 (or larger with more rows),
 * one X row, the best of 7 passes of 2000 calls per row. Not part of the build or of CI; see
 * tools/vd-harness.sh. The blocks are random bytes with every block's fp16 scales set to 1.0
 * (random fp16 scales could make subnormal products and time the FPU's slow path instead of
 * the kernel). The K-quants, Q4_0, Q8_0 and IQ4_XS: the other IQ types' grids are installed
 * from Python.
 *
 *   tools/vd-harness.sh [TYPE [ROWS [PF_DIST [BLOCKS_PER_ROW]]]]   e.g. tools/vd-harness.sh Q4_K 96 0 3
 * (ISA=avx512: the AVX-512 VNNI kernels, AVX2 otherwise; VD4=1: 4-row, VD8=1 with avx512: 8-row) */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <time.h>
#include "quant_common.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    /* the K-quants (their activations are Q8_256 rows, their tables static) and Q4_0 / Q8_0
     * (Q8_32 rows): where each block's fp16 scales are and how many */
    static const struct { const char *name; int type, at, n; } kq[] = {
        {"Q2_K", T_Q2_K, 80, 2}, {"Q3_K", T_Q3_K, 108, 1}, {"Q4_K", T_Q4_K, 0, 2},
        {"Q5_K", T_Q5_K, 0, 2}, {"Q6_K", T_Q6_K, 208, 1}, {"Q4_0", T_Q4_0, 0, 1}, {"Q8_0", T_Q8_0, 0, 1},
        {"IQ4_XS", T_IQ4_XS, 0, 1}};
    const char *name = argc > 1 ? argv[1] : "Q4_K";
    int k = -1;
    for (int i = 0; i < (int)(sizeof kq / sizeof kq[0]); i++)
        if (strcmp(kq[i].name, name) == 0) k = i;
    if (k < 0) {
        fprintf(stderr, "vd_harness: TYPE is one of Q2_K Q3_K Q4_K Q5_K Q6_K Q4_0 Q8_0 IQ4_XS, not %s\n", name);
        return 2;
    }
    const int type = kq[k].type;
    const int rows = argc > 2 ? atoi(argv[2]) : 96;
    mf_tune.pf_dist = argc > 3 ? atoi(argv[3]) : 0;
    const int64_t nb = argc > 4 ? atoi(argv[4]) : 14; /* blocks a row (14: 3584 values) */
    const size_t bb = (size_t)mf_qtypes[type].bytes, rb = nb * bb;
    uint8_t *w = aligned_alloc(64, (rows * rb + 63) / 64 * 64);
    srand(1);
    for (size_t i = 0; i < rows * rb; i++) w[i] = (uint8_t)rand();
    const uint16_t one = 0x3c00;
    for (size_t b = 0; b < (size_t)rows * nb; b++)
        for (int j = 0; j < kq[k].n; j++) memcpy(w + b * bb + kq[k].at + 2 * j, &one, 2);
    const int q32 = mf_qtypes[type].xfmt == XF_Q8_32;
    void *xv = aligned_alloc(64, q32 ? sizeof(mf_q8_32) * nb : sizeof(mf_q8_256) * nb);
    mf_q8_256 *x = xv;
    mf_q8_32 *x32 = xv;
    for (int b = 0; b < nb; b++) {
        if (q32) {
            int s = 0;
            for (int i = 0; i < 32; i++) s += x32[b].qs[i] = (int8_t)(rand() % 255 - 127);
            x32[b].d = 0.01f;
            x32[b].s = 0.01f * (float)s;
            continue;
        }
        x[b].d = 0.01f;
        for (int i = 0; i < 256; i++) x[b].qs[i] = (int8_t)(rand() % 255 - 127);
        for (int i = 0; i < 16; i++) {
            int s = 0;
            for (int k = 0; k < 16; k++) s += x[b].qs[16 * i + k];
            x[b].bsums[i] = (int16_t)s;
        }
    }
    const char *isa = getenv("ISA") ? getenv("ISA") : "avx2";
    const int z = strcmp(isa, "avx512") == 0;
    mf_vecdot_fn vd = z && mf_vecdot_avx512[type] ? mf_vecdot_avx512[type] : mf_vecdot_avx2[type];
    mf_vecdot4_fn vd4 = getenv("VD4") ? (z ? mf_vecdot4_avx512 : mf_vecdot4_avx2)[type] : NULL;
    if (getenv("VD8") && z) vd4 = mf_vecdot8_avx512[type];
    const int g = getenv("VD8") && z ? 8 : 4;
    if ((getenv("VD4") || getenv("VD8")) && !vd4) {
        fprintf(stderr, "vd_harness: %s has no %s %d-row kernel\n", name, isa, g);
        return 2;
    }
    if (z && mf_xfmt_avx512[type] >= XF_Q8_256S) mf_q8_256_reorder(x, nb, mf_xfmt_avx512[type]); /* the kernel's X order */
    if (!vd4 && !vd) {
        fprintf(stderr, "vd_harness: %s has no %s 1-row kernel (VD4=1 / VD8=1)\n", name, isa);
        return 2;
    }
    /* the K-quants' 4/8-row kernels give each row the 1-row kernel's bits (the 32-value types'
     * group kernels have bits of their own: a matrix's rows are grouped the same way for any
     * batch, so a row's bits still do not depend on the batch) */
    if (vd4 && !q32)
        for (int r = 0; r + g <= rows; r += g) {
            float o[8];
            vd4(w + r * rb, rb, x, nb, o);
            for (int k = 0; k < g; k++) {
                float e = vd(w + (r + k) * rb, x, nb);
                if (memcmp(&e, &o[k], 4)) {
                    fprintf(stderr, "vd_harness: row %d: 4-row %.9g != 1-row %.9g\n", r + k, o[k], e);
                    return 1;
                }
            }
        }
    volatile float sink = 0;
    double best = 1e9;
    for (int rep = 0; rep < 7; rep++) {
        double t0 = now();
        for (int it = 0; it < 2000; it++)
            if (vd4)
                for (int r = 0; r + g <= rows; r += g) {
                    float o[8];
                    vd4(w + r * rb, rb, x, nb, o);
                    sink += o[0] + o[3];
                }
            else
                for (int r = 0; r < rows; r++) sink += vd(w + r * rb, x, nb);
        double dt = now() - t0;
        if (dt < best) best = dt;
    }
    const double blocks = 2000.0 * rows * nb;
    printf("%s %s%s rows %d pf_dist %d: %.2f ns/block, %.1f GB/s\n", name, isa, vd4 ? (g == 8 ? " 8-row" : " 4-row") : "", rows, (int)mf_tune.pf_dist,
           best / blocks * 1e9, blocks * bb / best / 1e9);
    free(w);
    free(x);
    return 0;
}
