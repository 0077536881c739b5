/* One decoder layer for one token (decode), in a single native call.
 *
 * Why: at decode every op works on one row, so a Python-level layer (norm, 3 projections,
 * rope, cache write, attention, output projection, norm, gate/up, activation, down) spends as
 * much time in interpreter glue and per-op dispatch as in the kernels. This file runs the same
 * kernels in the same order as models/layers.py does op by op, so its result is bit-identical
 * to the Python path (tests/test_decode_fused.py checks that per architecture).
 *
 *   layer = decode_layer_new(ints, floats, vecs)     once per layer and model
 *   decode_layer(layer, x, pos, K, V, kv_f16, wq, wk, wv, wo, wg, wu, wd)   per token
 *
 * x [n_embd] f32 is updated in place (the residual stream); K/V are the layer's cache arrays
 * [n_ctx, Hkv, D], float16 when kv_f16 (else float32), row pos is written; the w* are the raw GGUF bytes of the 7 matrices.
 * Scratch is per calling thread and grows once (no allocation per call after the first).
 *
 * A MoE layer (moe_layer_new) has the same attention half (with YaRN rope and attention sinks
 * where the layer has them: gpt-oss) and, for its FFN, the routed experts
 * of models/layers.py Model.moe_ffn: router matvec (+ bias), softmax or sigmoid (or the logits
 * themselves, softmax_weight: gpt-oss), top-k (ties to the lower expert, as numpy's stable
 * argsort; on probability + exp_probs_b where the file has it), for softmax_weight a softmax
 * over the chosen, weights renormalized (sum in double, clamped at 2^-14) and scaled, the union of the
 * rows' experts in index order, each expert's rows through mf_moe_ffn (csrc/moe.c) with its
 * gate/up/down read in place from the stacked ffn_*_exps tensors (+ their biases; SiLU, GELU or
 * gpt-oss's clamped SwiGLU), then the shared expert
 * (sigmoid-gated by ffn_gate_inp_shexp, or ungated). decode_batch takes its 4 attention
 * matrices, the router, the 3 stacked expert tensors and the 3 shared-expert ones (if any).
 * Where the store streams the experts (they are not in place), the layer is two calls:
 * decode_batch_route (attention, residual, FFN norm, router, top-k: the chosen experts out) and,
 * once the caller has those experts' bytes, decode_batch_experts (a table of each expert's
 * gate/up/down; norm, router and top-k again, the same selection, then the groups as above). */
#include "memfit.h"
#include "ops.h"
#include "quant_common.h"

#include <stdlib.h>
#include <string.h>

int mf_matmul_multi_ex(int k, const int *types, const uint8_t *const *ws, const int64_t *rows,
                       int64_t cols, const float *x, int64_t n, float *const *ys, int vec_only);

void mf_sigmoid_f32(const float *x, float *out, int64_t n); /* csrc/ops.c */
int mf_matmul_grouped(int k, const int *types, const uint8_t *const *ws, const int64_t *rows, int64_t cols,
                      const float *x, const int64_t *off, int64_t G, float *const *ys,
                      int64_t n_prof); /* csrc/quant_mm.c */

enum { W_Q, W_K, W_V, W_O, W_G, W_U, W_D, NW };
/* a MoE layer's matrices: the attention's 4, then these */
enum { M_ROUTER = 4, M_GE, M_UE, M_DE, M_GS, M_US, M_DS, NWM };
enum { V_ATTN_NORM, V_Q_NORM, V_K_NORM, V_POST_ATTN, V_FFN_NORM, V_POST_FFW, V_BQ, V_BK, V_BV, V_BO,
       V_FREQ, NV_DENSE, V_ROUTER_B = NV_DENSE, V_PROBS_B, V_SHEXP_GATE, V_SINKS, V_GATE_EB, V_UP_EB, V_DOWN_EB, NV };
static const char *const vec_names[NV] = {"attn_norm", "q_norm", "k_norm", "post_attention_norm",
                                          "ffn_norm", "post_ffw_norm", "bq", "bk", "bv", "bo",
                                          "freq_factors", "router_bias", "exp_probs_b", "shexp_gate",
                                          "sinks", "gate_exps_b", "up_exps_b", "down_exps_b"};
static const char *const w_names[NW] = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                        "ffn_up", "ffn_down"};
static const char *const wm_names[NWM] = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp",
                                          "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
                                          "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"};

typedef struct {
    int64_t n_embd, n_head, n_head_kv, dk, dv, n_ff, n_rot, window;
    int neox, gelu;
    double rope_base, freq_scale;
    double yarn_ext, yarn_attn, yarn_lo, yarn_hi; /* YaRN (mf_rope_yarn_f32; ext 0, attn 1: none) */
    float eps, attn_scale, softcap;
    int nw;                    /* weight buffers decode_batch takes: NW dense, 8 or NWM MoE */
    int types[NWM];
    int64_t rows[NWM], cols[NWM];
    const float *vec[NV]; /* NULL where absent */
    Py_buffer vbuf[NV];
    int have[NV];
    /* MoE layers (moe != 0) */
    int moe, qk_full, sigmoid, wnorm, shexp_gated;
    int oai;       /* experts' activation gpt-oss's clamped SwiGLU (else gelu or silu) */
    int softmax_w; /* gating softmax_weight: top-k by logit, weights a softmax over the chosen */
    int64_t n_expert, k_used, n_ff_exp, n_ff_sh;
    float wscale;
} layer_t;

static _Thread_local float *sc_buf;
static _Thread_local size_t sc_cap;

static float *scratch(size_t n) {
    if (n > sc_cap) {
        free(sc_buf);
        sc_buf = aligned_alloc(64, ((n * sizeof(float)) + 63) & ~(size_t)63);
        sc_cap = sc_buf ? n : 0;
    }
    return sc_buf;
}

/* the MoE half's own scratch (routing and expert tables), beside scratch()'s */
static _Thread_local void *mo_buf;
static _Thread_local size_t mo_cap;

static void *moe_scratch(size_t bytes) {
    if (bytes > mo_cap) {
        free(mo_buf);
        mo_buf = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
        mo_cap = mo_buf ? bytes : 0;
    }
    return mo_buf;
}

/* y[r, :] += b for each of n rows of d values */
static inline void add_rows(float *y, const float *b, int64_t n, int64_t d) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t i = 0; i < d; i++) y[r * d + i] += b[i];
}

/* Where a batch's K/V go and are read from: the layer's pools and the rows' paged addressing
 * (see mf_paged_args); row i is written at physical row slots[i]. */
typedef struct {
    void *K, *V;
    int kv_type;
    const int32_t *pos, *slots, *q_tab, *tables;
    int64_t bs;
} kvref_t;

/* Where the route-only call (decode_batch_route) leaves a MoE layer's routing: the chosen experts
 * sel [n, K] and, where not NULL, the FFN-normed rows h [n, E] and the router logits [n, X]. */
typedef struct {
    int64_t *sel;
    float *h, *logits;
} route_out_t;

static int moe_half(const layer_t *L, float *x, int64_t n, const uint8_t *const *w,
                    const uint8_t *const *xtab, route_out_t *rt, float *h, float *out, float *yk,
                    uint8_t *done, int phase, const float *pre_h, const float *pre_lg);

/* The layer (see the file comment) for n rows, each a decode token of its own sequence (or any
 * causal rows). Matmuls keep the one-row kernels (vec_only), so a row's result does not depend
 * on the others. rt != NULL (a MoE layer): the attention and the routing, the routing left in
 * *rt, and with xtab the experts too when every chosen one is in xtab (see moe_half). Returns 0,
 * 1 (routed only: a chosen expert is not in xtab), -3 out of memory, -4 unsupported kv type, -5
 * (moe_half), or a matmul error code. */
static int run_layer(const layer_t *L, float *x, int64_t n, const kvref_t *kv, const uint8_t *const *w,
                     const uint8_t *const *xtab, route_out_t *rt) {
    const int64_t E = L->n_embd, qd = L->n_head * L->dk, kd = L->n_head_kv * L->dk,
                  vd = L->n_head_kv * L->dv, ad = L->n_head * L->dv, F = L->moe ? 0 : L->n_ff;
    float *s = scratch((size_t)(n * (E + qd + kd + vd + ad + E + 2 * F)));
    if (!s) return -3;
    float *h = s, *q = h + n * E, *k = q + n * qd, *v = k + n * kd, *att = v + n * vd, *o = att + n * ad,
          *g = o + n * E, *u = g + n * F;
    const float *const *vec = L->vec;
    int rc;

    /* attention */
    mf_rmsnorm_f32(x, vec[V_ATTN_NORM], h, n, E, L->eps);
    {
        float *ys[3] = {q, k, v};
        if ((rc = mf_matmul_multi_ex(3, L->types, w, L->rows, E, h, n, ys, 1))) return rc;
    }
    if (vec[V_BQ]) add_rows(q, vec[V_BQ], n, qd);
    if (vec[V_BK]) add_rows(k, vec[V_BK], n, kd);
    if (vec[V_BV]) add_rows(v, vec[V_BV], n, vd);
    if (L->qk_full) { /* olmoe: over the whole projection */
        mf_rmsnorm_f32(q, vec[V_Q_NORM], q, n, qd, L->eps);
        mf_rmsnorm_f32(k, vec[V_K_NORM], k, n, kd, L->eps);
    } else {
        if (vec[V_Q_NORM]) mf_rmsnorm_f32(q, vec[V_Q_NORM], q, n * L->n_head, L->dk, L->eps);
        if (vec[V_K_NORM]) mf_rmsnorm_f32(k, vec[V_K_NORM], k, n * L->n_head_kv, L->dk, L->eps);
    }
    mf_rope_yarn_f32(q, q, kv->pos, n, L->n_head, L->dk, L->n_rot, L->rope_base, L->freq_scale, L->neox,
                     vec[V_FREQ], L->yarn_ext, L->yarn_attn, L->yarn_lo, L->yarn_hi);
    mf_rope_yarn_f32(k, k, kv->pos, n, L->n_head_kv, L->dk, L->n_rot, L->rope_base, L->freq_scale, L->neox,
                     vec[V_FREQ], L->yarn_ext, L->yarn_attn, L->yarn_lo, L->yarn_hi);
    if (mf_kv_store(kv->kv_type, kv->K, kv->slots, k, n, kd) || mf_kv_store(kv->kv_type, kv->V, kv->slots, v, n, vd))
        return -4;
    mf_paged_args at = {.q = q, .k = kv->K, .v = kv->V, .out = att, .q_pos = kv->pos, .q_tab = kv->q_tab,
                        .tables = kv->tables, .n = n, .Hq = L->n_head, .Hkv = L->n_head_kv, .D = L->dk,
                        .Dv = L->dv, .bs = kv->bs, .scale = L->attn_scale, .softcap = L->softcap,
                        .window = L->window, .kv_type = kv->kv_type, .sinks = vec[V_SINKS]};
    if (mf_attention_paged(&at)) return -4;
    {
        float *ys[1] = {o};
        if ((rc = mf_matmul_multi_ex(1, &L->types[W_O], &w[W_O], &L->rows[W_O], ad, att, n, ys, 1))) return rc;
    }
    if (vec[V_BO]) add_rows(o, vec[V_BO], n, E);
    if (vec[V_POST_ATTN]) mf_rmsnorm_f32(o, vec[V_POST_ATTN], o, n, E, L->eps);
    add_rows(x, o, 1, n * E);
    if (L->moe) return moe_half(L, x, n, w, xtab, rt, h, o, NULL, NULL, 0, NULL, NULL);

    /* feed-forward */
    mf_rmsnorm_f32(x, vec[V_FFN_NORM], h, n, E, L->eps);
    {
        float *ys[2] = {g, u};
        if ((rc = mf_matmul_multi_ex(2, &L->types[W_G], &w[W_G], &L->rows[W_G], E, h, n, ys, 1))) return rc;
    }
    if (L->gelu) mf_gelu_mul_f32(g, u, g, n * F);
    else mf_silu_mul_f32(g, u, g, n * F);
    {
        float *ys[1] = {o};
        if ((rc = mf_matmul_multi_ex(1, &L->types[W_D], &w[W_D], &L->rows[W_D], F, g, n, ys, 1))) return rc;
    }
    if (vec[V_POST_FFW]) mf_rmsnorm_f32(o, vec[V_POST_FFW], o, n, E, L->eps);
    add_rows(x, o, 1, n * E);
    return 0;
}

/* The MoE FFN of n rows: x += experts(rmsnorm(x)) (+ the shared expert). h [n, E] and out
 * [n, E] are the caller's scratch. Same kernels in the same order as Model.moe_ffn with
 * Backend.route and group_rows (models/layers.py, ops/backend.py). Expert e's gate/up/down are
 * read in place from the stacked w[M_GE..M_DE] (xtab NULL) or at xtab[3 e + 0..2] (experts the
 * store streams; -5 when a chosen one is NULL). rt != NULL: the routing into *rt, and then
 * nothing more without xtab (returns 0); with xtab, the experts when every chosen one is there
 * (returns 0), else nothing more (returns 1). */
/* The k largest of p[0..X) into out, the largest first, ties to the lower index (numpy's
 * stable argsort of -p) */
static void topk_row(const float *p, int64_t X, int64_t K, int64_t *out) {
    for (int64_t j = 0; j < K; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < X; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= out[i] == e;
            if (!taken && (best < 0 || p[e] > p[best])) best = e;
        }
        out[j] = best;
    }
}

/* Gate/up, their biases and activation, down and its bias of G groups of rows: group g's
 * rows are xe [off[g], off[g + 1]), its expert gid[g], its gate and up at wp[2 g], wp[2 g + 1],
 * its down at wp[2 X + g]; results in ye (ge, ue scratch). */
static int expert_groups(const layer_t *L, const uint8_t **wp, const int64_t *off, const int64_t *gid,
                         int64_t G, const float *xe, float *ge, float *ue, float *ye, int64_t n) {
    const int64_t E = L->n_embd, X = L->n_expert, F = L->n_ff_exp, N = off[G];
    const float *const *vec = L->vec;
    int rc;
    if (!G) return 0;
    {
        const int64_t gr[2] = {F, F};
        float *ys[2] = {ge, ue};
        if ((rc = mf_matmul_grouped(2, &L->types[M_GE], wp, gr, E, xe, off, G, ys, n))) return rc;
    }
    /* the experts' biases (gpt-oss), as mf_moe_ffn adds them: gate and up before the
     * activation, down before the routing weight */
    for (int64_t g = 0; g < G; g++) {
        const int64_t m = off[g + 1] - off[g];
        if (vec[V_GATE_EB]) add_rows(ge + off[g] * F, vec[V_GATE_EB] + gid[g] * F, m, F);
        if (vec[V_UP_EB]) add_rows(ue + off[g] * F, vec[V_UP_EB] + gid[g] * F, m, F);
    }
    if (L->oai) mf_swiglu_oai_f32(ge, ue, ge, N * F, MF_OAI_ALPHA, MF_OAI_LIMIT);
    else if (L->gelu) mf_gelu_mul_f32(ge, ue, ge, N * F);
    else mf_silu_mul_f32(ge, ue, ge, N * F);
    {
        float *ys[1] = {ye};
        if ((rc = mf_matmul_grouped(1, &L->types[M_DE], wp + 2 * X, &E, F, ge, off, G, ys, n))) return rc;
    }
    if (vec[V_DOWN_EB])
        for (int64_t g = 0; g < G; g++) add_rows(ye + off[g] * E, vec[V_DOWN_EB] + gid[g] * E, off[g + 1] - off[g], E);
    return 0;
}

static int moe_half(const layer_t *L, float *x, int64_t n, const uint8_t *const *w,
                    const uint8_t *const *xtab, route_out_t *rt, float *h, float *out, float *yk,
                    uint8_t *done, int phase, const float *pre_h, const float *pre_lg) {
    const int64_t E = L->n_embd, X = L->n_expert, K = L->k_used, F = L->n_ff_exp, Fs = L->n_ff_sh;
    const float *const *vec = L->vec;
    /* logits, probs, sel_p [n, X]; picked wts, group wts [n K]; shared: gate [n], g, u [n, Fs],
     * s [n, E]; experts' rows: x [n K, E], gate, up [n K, F], y [n K, E]; then int64: sel,
     * group rows [n K], count [X], off [X + 1], the groups' experts [X]; pointers [3 X] */
    const size_t nf = (size_t)(3 * n * X + 2 * n * K + n + 2 * n * Fs + n * E + 2 * n * K * (E + F)),
                 ni = (size_t)(2 * n * K + 6 * X + 2);
    uint8_t *mem = moe_scratch(nf * 4 + ni * 8 + (size_t)(6 * X) * sizeof(void *) + 16);
    if (!mem) return -3;
    float *logits = (float *)mem, *probs = logits + n * X, *selp = probs + n * X, *pw = selp + n * X,
          *gw = pw + n * K, *sg = gw + n * K, *g = sg + n, *u = g + n * Fs, *sy = u + n * Fs,
          *xe = sy + n * E, *ge = xe + n * K * E, *ue = ge + n * K * F, *ye = ue + n * K * F;
    int64_t *sel = (int64_t *)(((uintptr_t)(ye + n * K * E) + 7) & ~(uintptr_t)7), *grow = sel + n * K,
            *cnt = grow + n * K, *off = cnt + X, *gid = off + X + 1;
    int64_t *soff = gid + X, *sgid = soff + X + 1, *sgrp = sgid + X; /* phases 1, 2: the groups now */
    const uint8_t **wp = (const uint8_t **)(((uintptr_t)(sgrp + X) + 7) & ~(uintptr_t)7), **swp = wp + 3 * X;
    int rc;

    /* pre_h, pre_lg: what the route call left (route_out_t h and logits, the bias added) for
     * these rows of this x: the same computation, so taken as they are */
    if (pre_h) memcpy(h, pre_h, sizeof(float) * (size_t)(n * E));
    else mf_rmsnorm_f32(x, vec[V_FFN_NORM], h, n, E, L->eps);
    if (pre_lg) {
        memcpy(logits, pre_lg, sizeof(float) * (size_t)(n * X));
    } else {
        float *ys[1] = {logits};
        if ((rc = mf_matmul_multi_ex(1, &L->types[M_ROUTER], &w[M_ROUTER], &L->rows[M_ROUTER], E, h, n, ys, 1)))
            return rc;
        if (vec[V_ROUTER_B]) add_rows(logits, vec[V_ROUTER_B], n, X);
    }
    if (L->sigmoid) mf_sigmoid_f32(logits, probs, n * X);
    else if (L->softmax_w) memcpy(probs, logits, sizeof(float) * (size_t)(n * X));
    else mf_softmax_f32(logits, probs, n, X);
    const float *sp = probs;
    if (vec[V_PROBS_B]) {
        for (int64_t r = 0; r < n; r++)
            for (int64_t e = 0; e < X; e++) selp[r * X + e] = probs[r * X + e] + vec[V_PROBS_B][e];
        sp = selp;
    }
    /* top-k per row (topk_row) */
    for (int64_t e = 0; e < X; e++) cnt[e] = 0;
    for (int64_t r = 0; r < n; r++) {
        int64_t *sr = sel + r * K;
        topk_row(sp + r * X, X, K, sr);
        for (int64_t j = 0; j < K; j++) {
            pw[r * K + j] = probs[r * X + sr[j]];
            cnt[sr[j]]++;
        }
        if (L->softmax_w) mf_softmax_f32(pw + r * K, pw + r * K, 1, K);
        if (L->wnorm) {
            double sum = 0.0;
            for (int64_t j = 0; j < K; j++) sum += (double)pw[r * K + j];
            const float d = (float)sum > 6.103515625e-5f ? (float)sum : 6.103515625e-5f;
            for (int64_t j = 0; j < K; j++) pw[r * K + j] = pw[r * K + j] / d;
        }
        if (L->wscale != 0.0f && L->wscale != 1.0f)
            for (int64_t j = 0; j < K; j++) pw[r * K + j] = pw[r * K + j] * L->wscale;
    }
    if (rt) {
        memcpy(rt->sel, sel, sizeof(int64_t) * (size_t)(n * K));
        if (rt->h) memcpy(rt->h, h, sizeof(float) * (size_t)(n * E));
        if (rt->logits) memcpy(rt->logits, logits, sizeof(float) * (size_t)(n * X));
        if (!xtab) return 0;
        /* both: go on to the experts when every chosen one is at hand, else stop routed (1) */
        for (int64_t i = 0; i < n * K; i++) {
            const int64_t e = sel[i];
            if (!(xtab[3 * e] && xtab[3 * e + 1] && xtab[3 * e + 2])) return 1;
        }
    }
    /* groups: the experts in index order, each with its rows in row order (group_rows) */
    int64_t G = 0;
    const int64_t gb = F * mf_qtypes[L->types[M_GE]].bytes * (E / mf_qtypes[L->types[M_GE]].block),
                  ub = F * mf_qtypes[L->types[M_UE]].bytes * (E / mf_qtypes[L->types[M_UE]].block),
                  db = E * mf_qtypes[L->types[M_DE]].bytes * (F / mf_qtypes[L->types[M_DE]].block);
    off[0] = 0;
    for (int64_t e = 0; e < X; e++) {
        if (!cnt[e]) continue;
        /* phase 1 takes what is there; phase 2 needs what phase 1 did not take */
        if (xtab && phase != 1 && !(done && done[e]) && !(xtab[3 * e] && xtab[3 * e + 1] && xtab[3 * e + 2]))
            return -5;
        /* gate, up of group g at 2 g, 2 g + 1; downs after them */
        wp[2 * G] = xtab ? xtab[3 * e] : w[M_GE] + e * gb;
        wp[2 * G + 1] = xtab ? xtab[3 * e + 1] : w[M_UE] + e * ub;
        wp[2 * X + G] = xtab ? xtab[3 * e + 2] : w[M_DE] + e * db;
        off[G + 1] = off[G] + cnt[e];
        cnt[e] = off[G]; /* now the group's next free place */
        gid[G++] = e;
    }
    for (int64_t r = 0; r < n; r++)
        for (int64_t j = 0; j < K; j++) {
            const int64_t at = cnt[sel[r * K + j]]++;
            grow[at] = r;
            gw[at] = pw[r * K + j];
        }
    /* the experts, as csrc/moe.c's mf_moe_ffn computes them group by group (the same kernels
     * and plans per group), with one pool job for every group's gate and up and one for the
     * downs; then each row's results added in expert order. A group's results do not depend
     * on the other groups of the call (one reduction order per row), so phase 1 computes the
     * groups whose experts are there (not done before) into yk at their places among all the
     * groups and marks them done; phase 2 the groups not done, then adds them all from yk. */
    const int64_t N = off[G];
    if (!phase) {
        for (int64_t i = 0; i < N; i++) memcpy(xe + i * E, h + grow[i] * E, sizeof(float) * (size_t)E);
        if ((rc = expert_groups(L, wp, off, gid, G, xe, ge, ue, ye, n))) return rc;
    } else {
        int64_t S = 0;
        soff[0] = 0;
        for (int64_t g = 0; g < G; g++) {
            const int64_t e = gid[g];
            if (done[e] || !(wp[2 * g] && wp[2 * g + 1] && wp[2 * X + g])) continue;
            swp[2 * S] = wp[2 * g];
            swp[2 * S + 1] = wp[2 * g + 1];
            swp[2 * X + S] = wp[2 * X + g];
            for (int64_t i = off[g]; i < off[g + 1]; i++)
                memcpy(xe + (soff[S] + i - off[g]) * E, h + grow[i] * E, sizeof(float) * (size_t)E);
            soff[S + 1] = soff[S] + off[g + 1] - off[g];
            sgid[S] = e;
            sgrp[S++] = g;
        }
        if ((rc = expert_groups(L, swp, soff, sgid, S, xe, ge, ue, ye, n))) return rc;
        for (int64_t j = 0; j < S; j++) {
            memcpy(yk + off[sgrp[j]] * E, ye + soff[j] * E, sizeof(float) * (size_t)((soff[j + 1] - soff[j]) * E));
            done[sgid[j]] = 1;
        }
        if (phase == 1) return 0;
        ye = yk;
    }
    memset(out, 0, sizeof(float) * (size_t)(n * E));
    for (int64_t i = 0; i < N; i++) {
        const float s = gw[i], *yi = ye + i * E;
        float *o = out + grow[i] * E;
        for (int64_t c = 0; c < E; c++) o[c] += s * yi[c];
    }
    if (Fs) {
        float *ys[2] = {g, u};
        if ((rc = mf_matmul_multi_ex(2, &L->types[M_GS], &w[M_GS], &L->rows[M_GS], E, h, n, ys, 1))) return rc;
        if (L->gelu) mf_gelu_mul_f32(g, u, g, n * Fs);
        else mf_silu_mul_f32(g, u, g, n * Fs);
        float *yd[1] = {sy};
        if ((rc = mf_matmul_multi_ex(1, &L->types[M_DS], &w[M_DS], &L->rows[M_DS], Fs, g, n, yd, 1))) return rc;
        if (L->shexp_gated) {
            /* the gate: x . ffn_gate_inp_shexp as an F32 matvec of one row, then sigmoid */
            const int t32 = T_F32;
            const int64_t one = 1;
            const uint8_t *gv = (const uint8_t *)vec[V_SHEXP_GATE];
            float *yg[1] = {sg};
            if ((rc = mf_matmul_multi_ex(1, &t32, &gv, &one, E, h, n, yg, 1))) return rc;
            mf_sigmoid_f32(sg, sg, n);
            for (int64_t r = 0; r < n; r++)
                for (int64_t c = 0; c < E; c++) out[r * E + c] += sy[r * E + c] * sg[r];
        } else {
            add_rows(out, sy, 1, n * E);
        }
    }
    add_rows(x, out, 1, n * E);
    return 0;
}

/* The MoE half alone (decode_batch_experts): x [n, E] after the attention's residual, the
 * experts at xtab (see moe_half). */
static int run_experts(const layer_t *L, float *x, int64_t n, const uint8_t *const *w,
                       const uint8_t *const *xtab, float *yk, uint8_t *done, int phase,
                       const float *pre_h, const float *pre_lg) {
    float *s = scratch((size_t)(2 * n * L->n_embd));
    if (!s) return -3;
    return moe_half(L, x, n, w, xtab, NULL, s, s + n * L->n_embd, yk, done, phase, pre_h, pre_lg);
}

/* Router look-ahead (models/lookahead.py RouterLookahead, the same state and float operations):
 * after layer il routed n decode rows (h [n, E] its FFN input, logits [n, X] its router's), the
 * rows' real logits are kept for layer il (last row of a sequence slot wins), and layer il + 1's
 * router (nr, type nt, bias nb or NULL) applied to h predicts layer il + 1's experts: the score
 * is the look-ahead's logits, or, where the slot has both states at pos - 1 and the rows are
 * one per slot, real_{t-1} + (look_t - look_{t-1}); its top k (ties to the lower expert) into
 * pred [n, K], and the look-ahead's logits are kept for layer il + 1. State: real, look [NL, S,
 * X], rpos, lpos [NL, S] (-1: none). */
typedef struct {
    const int32_t *seq;
    float *real, *look;
    int32_t *rpos, *lpos;
    int64_t S, il;
    const uint8_t *nr;
    int nt;
    const float *nb;
    int64_t *pred;
} ahead_t;

static int lookahead(const layer_t *L, int64_t n, const int32_t *pos, const float *h, const float *logits,
                     const ahead_t *A) {
    const int64_t E = L->n_embd, X = L->n_expert, K = L->k_used, S = A->S;
    for (int64_t r = 0; r < n; r++) {
        const int64_t at = A->il * S + A->seq[r];
        memcpy(A->real + at * X, logits + r * X, sizeof(float) * (size_t)X);
        A->rpos[at] = pos[r];
    }
    if (!A->nr) return 0;
    float *lk = moe_scratch(sizeof(float) * (size_t)(2 * n * X));
    if (!lk) return -3;
    float *sc = lk + n * X;
    int rc;
    {
        float *ys[1] = {lk};
        if ((rc = mf_matmul_multi_ex(1, &A->nt, &A->nr, &X, E, h, n, ys, 1))) return rc;
    }
    if (A->nb) add_rows(lk, A->nb, n, X);
    int distinct = 1;
    for (int64_t r = 0; r < n && distinct; r++)
        for (int64_t q = 0; q < r; q++) distinct &= A->seq[q] != A->seq[r];
    for (int64_t r = 0; r < n; r++) {
        const int64_t at = (A->il + 1) * S + A->seq[r];
        const float *l = lk + r * X, *rl = A->real + at * X, *pl = A->look + at * X;
        float *o = sc + r * X;
        if (distinct && A->rpos[at] == pos[r] - 1 && A->lpos[at] == pos[r] - 1)
            for (int64_t e = 0; e < X; e++) o[e] = rl[e] + (l[e] - pl[e]);
        else memcpy(o, l, sizeof(float) * (size_t)X);
    }
    for (int64_t r = 0; r < n; r++) {
        const int64_t at = (A->il + 1) * S + A->seq[r];
        memcpy(A->look + at * X, lk + r * X, sizeof(float) * (size_t)X);
        A->lpos[at] = pos[r];
        topk_row(sc + r * X, X, K, A->pred + r * K);
    }
    return 0;
}

/* ---- Python bindings ------------------------------------------------------------------------ */

#define CAPSULE "memfit.decode_layer"

static void layer_free(PyObject *cap) {
    layer_t *L = PyCapsule_GetPointer(cap, CAPSULE);
    if (!L) return;
    for (int i = 0; i < NV; i++)
        if (L->have[i]) PyBuffer_Release(&L->vbuf[i]);
    free(L);
}

/* a C-contiguous float32 (f16 = 0) or float16 (f16 = 1) buffer */
static int typed_buffer(PyObject *o, Py_buffer *b, int writable, int f16, const char *what) {
    const char *dt = f16 ? "float16" : "float32";
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "decode_layer: %s must be a C-contiguous%s %s array", what,
                     writable ? " writable" : "", dt);
        return -1;
    }
    const char *f = b->format ? b->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (strcmp(f, f16 ? "e" : "f") != 0 || b->itemsize != (f16 ? 2 : 4)) {
        PyErr_Format(PyExc_TypeError, "decode_layer: %s must be %s (got format %s)", what, dt, f);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}


static int64_t wbytes(int type, int64_t rows, int64_t cols) {
    return rows * (cols / mf_qtypes[type].block) * mf_qtypes[type].bytes;
}

/* decode_layer_new(ints, floats, vecs):
 *   ints   = (n_embd, n_head, n_head_kv, dk, dv, n_ff, n_rot, window, neox, gelu, 7 type ids)
 *   floats = (rope_base, freq_scale, eps, attn_scale, softcap)
 *   vecs   = 11 float32 arrays or None, in the order of vec_names */
static PyObject *py_decode_layer_new(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    if (na != 3 || !PyTuple_Check(a[0]) || !PyTuple_Check(a[1]) || !PyTuple_Check(a[2]) ||
        PyTuple_GET_SIZE(a[0]) != 10 + NW || PyTuple_GET_SIZE(a[1]) != 5 || PyTuple_GET_SIZE(a[2]) != NV_DENSE)
        return PyErr_Format(PyExc_TypeError, "decode_layer_new(ints[%d], floats[5], vecs[%d])", 10 + NW, NV_DENSE);
    long long iv[10 + NW];
    double fv[5];
    for (int i = 0; i < 10 + NW; i++) {
        iv[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(a[0], i));
        if (iv[i] == -1 && PyErr_Occurred()) return NULL;
    }
    for (int i = 0; i < 5; i++) {
        fv[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(a[1], i));
        if (fv[i] == -1.0 && PyErr_Occurred()) return NULL;
    }
    layer_t *L = calloc(1, sizeof *L);
    if (!L) return PyErr_NoMemory();
    *L = (layer_t){.n_embd = iv[0], .n_head = iv[1], .n_head_kv = iv[2], .dk = iv[3], .dv = iv[4],
                   .n_ff = iv[5], .n_rot = iv[6], .window = iv[7], .neox = (int)iv[8], .gelu = (int)iv[9],
                   .rope_base = fv[0], .freq_scale = fv[1], .eps = (float)fv[2],
                   .attn_scale = (float)fv[3], .softcap = (float)fv[4], .nw = NW, .yarn_attn = 1.0};
    PyObject *cap = PyCapsule_New(L, CAPSULE, layer_free);
    if (!cap) { free(L); return NULL; }
    if (L->n_embd <= 0 || L->n_head <= 0 || L->n_head_kv <= 0 || L->n_head % L->n_head_kv || L->dk <= 0 ||
        L->dv <= 0 || L->dk > MF_ATTN_MAX_DIM || L->dv > MF_ATTN_MAX_DIM || L->n_ff <= 0 || L->n_rot < 0 ||
        L->n_rot > L->dk || L->n_rot % 2 || L->n_rot > MF_ROPE_MAX_ROT || L->window < 0 || L->softcap < 0) {
        PyErr_Format(PyExc_ValueError, "decode_layer_new: inconsistent layer shape (n_embd %lld, heads %lld/%lld, "
                     "head dims %lld/%lld, n_ff %lld, n_rot %lld)", iv[0], iv[1], iv[2], iv[3], iv[4], iv[5], iv[6]);
        goto fail;
    }
    const int64_t E = L->n_embd;
    const int64_t rows[NW] = {L->n_head * L->dk, L->n_head_kv * L->dk, L->n_head_kv * L->dv, E, L->n_ff,
                              L->n_ff, E};
    const int64_t cols[NW] = {E, E, E, L->n_head * L->dv, E, E, L->n_ff};
    for (int j = 0; j < NW; j++) {
        long long t = iv[10 + j];
        if (t < 0 || t >= T_MAX || !mf_type_ok(t) || cols[j] % mf_qtypes[t].block ||
            (mf_qtypes[t].xfmt == XF_Q8_256 && cols[j] % 256)) {
            PyErr_Format(PyExc_ValueError, "decode_layer_new: %s type %lld cannot run with %lld columns",
                         w_names[j], t, (long long)cols[j]);
            goto fail;
        }
        L->types[j] = (int)t;
        L->rows[j] = rows[j];
        L->cols[j] = cols[j];
    }
    const int64_t vlen[NV_DENSE] = {E, L->dk, L->dk, E, E, E, rows[W_Q], rows[W_K], rows[W_V], E, L->n_rot / 2};
    for (int i = 0; i < NV_DENSE; i++) {
        PyObject *o = PyTuple_GET_ITEM(a[2], i);
        if (o == Py_None) {
            if (i == V_ATTN_NORM || i == V_FFN_NORM) {
                PyErr_Format(PyExc_ValueError, "decode_layer_new: %s is required", vec_names[i]);
                goto fail;
            }
            continue;
        }
        if (typed_buffer(o, &L->vbuf[i], 0, 0, vec_names[i]) < 0) goto fail;
        L->have[i] = 1;
        if (L->vbuf[i].len != vlen[i] * 4) {
            PyErr_Format(PyExc_ValueError, "decode_layer_new: %s has %zd values, expected %lld", vec_names[i],
                         L->vbuf[i].len / 4, (long long)vlen[i]);
            goto fail;
        }
        L->vec[i] = L->vbuf[i].buf;
    }
    return cap;
fail:
    Py_DECREF(cap);
    return NULL;
}

/* moe_layer_new(ints, floats, vecs): a MoE layer (see the file comment), slots named by
 * moe_layer_fields():
 *   ints   = (n_embd, n_head, n_head_kv, dk, dv, n_rot, window, neox, gelu, qk_norm_full, n_expert,
 *             n_expert_used, n_ff_exp, n_ff_shexp, sigmoid, expert_weights_norm, shexp_gated,
 *             swiglu_oai, softmax_weight, 11 type ids: -1 for absent shared-expert matrices)
 *   floats = (rope_base, freq_scale, eps, attn_scale, softcap, expert_weights_scale, yarn_ext_factor,
 *             yarn_attn_factor, yarn_corr_lo, yarn_corr_hi)
 *   vecs   = 18 float32 arrays or None, in the order of vec_names (sinks [n_head]; the experts'
 *            biases gate, up [n_expert, n_ff_exp], down [n_expert, n_embd]) */
#define MOE_NI 19
#define MOE_NF 10
static PyObject *py_moe_layer_new(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    if (na != 3 || !PyTuple_Check(a[0]) || !PyTuple_Check(a[1]) || !PyTuple_Check(a[2]) ||
        PyTuple_GET_SIZE(a[0]) != MOE_NI + NWM || PyTuple_GET_SIZE(a[1]) != MOE_NF || PyTuple_GET_SIZE(a[2]) != NV)
        return PyErr_Format(PyExc_TypeError, "moe_layer_new(ints[%d], floats[%d], vecs[%d])", MOE_NI + NWM, MOE_NF, NV);
    long long iv[MOE_NI + NWM];
    double fv[MOE_NF];
    for (int i = 0; i < MOE_NI + NWM; i++) {
        iv[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(a[0], i));
        if (iv[i] == -1 && PyErr_Occurred()) return NULL;
    }
    for (int i = 0; i < MOE_NF; i++) {
        fv[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(a[1], i));
        if (fv[i] == -1.0 && PyErr_Occurred()) return NULL;
    }
    layer_t *L = calloc(1, sizeof *L);
    if (!L) return PyErr_NoMemory();
    *L = (layer_t){.n_embd = iv[0], .n_head = iv[1], .n_head_kv = iv[2], .dk = iv[3], .dv = iv[4],
                   .n_rot = iv[5], .window = iv[6], .neox = (int)iv[7], .gelu = (int)iv[8], .qk_full = (int)iv[9],
                   .n_expert = iv[10], .k_used = iv[11], .n_ff_exp = iv[12], .n_ff_sh = iv[13],
                   .sigmoid = (int)iv[14], .wnorm = (int)iv[15], .shexp_gated = (int)iv[16], .oai = (int)iv[17],
                   .softmax_w = (int)iv[18], .moe = 1, .rope_base = fv[0], .freq_scale = fv[1], .eps = (float)fv[2],
                   .attn_scale = (float)fv[3], .softcap = (float)fv[4], .wscale = (float)fv[5],
                   .yarn_ext = fv[6], .yarn_attn = fv[7], .yarn_lo = fv[8], .yarn_hi = fv[9]};
    L->nw = L->n_ff_sh ? NWM : M_GS;
    PyObject *cap = PyCapsule_New(L, CAPSULE, layer_free);
    if (!cap) { free(L); return NULL; }
    if (L->n_embd <= 0 || L->n_head <= 0 || L->n_head_kv <= 0 || L->n_head % L->n_head_kv || L->dk <= 0 ||
        L->dv <= 0 || L->dk > MF_ATTN_MAX_DIM || L->dv > MF_ATTN_MAX_DIM || L->n_rot < 0 || L->n_rot > L->dk ||
        L->n_rot % 2 || L->n_rot > MF_ROPE_MAX_ROT || L->window < 0 || L->softcap < 0 || L->n_expert < 1 ||
        L->k_used < 1 || L->k_used > L->n_expert || L->n_ff_exp <= 0 || L->n_ff_sh < 0 ||
        (L->shexp_gated && !L->n_ff_sh) || (L->sigmoid && L->softmax_w) || (L->oai && L->gelu)) {
        PyErr_Format(PyExc_ValueError, "moe_layer_new: inconsistent layer shape (n_embd %lld, heads %lld/%lld, "
                     "head dims %lld/%lld, n_rot %lld, experts %lld (%lld used) of %lld rows, shared %lld)",
                     iv[0], iv[1], iv[2], iv[3], iv[4], iv[5], iv[10], iv[11], iv[12], iv[13]);
        goto fail;
    }
    const int64_t E = L->n_embd, X = L->n_expert, F = L->n_ff_exp, Fs = L->n_ff_sh;
    const int64_t rows[NWM] = {L->n_head * L->dk, L->n_head_kv * L->dk, L->n_head_kv * L->dv, E, X,
                               X * F, X * F, X * E, Fs, Fs, E};
    const int64_t cols[NWM] = {E, E, E, L->n_head * L->dv, E, E, E, F, E, E, Fs};
    for (int j = 0; j < NWM; j++) {
        long long t = iv[MOE_NI + j];
        if (j >= L->nw) {
            L->types[j] = -1;
            continue;
        }
        if (t < 0 || t >= T_MAX || !mf_type_ok(t) || cols[j] % mf_qtypes[t].block ||
            (mf_qtypes[t].xfmt == XF_Q8_256 && cols[j] % 256)) {
            PyErr_Format(PyExc_ValueError, "moe_layer_new: %s type %lld cannot run with %lld columns",
                         wm_names[j], t, (long long)cols[j]);
            goto fail;
        }
        L->types[j] = (int)t;
        L->rows[j] = rows[j];
        L->cols[j] = cols[j];
    }
    const int64_t qn = L->qk_full ? rows[W_Q] : L->dk, kn = L->qk_full ? rows[W_K] : L->dk;
    const int64_t vlen[NV] = {E, qn, kn, E, E, E, rows[W_Q], rows[W_K], rows[W_V], E, L->n_rot / 2, X, X, E,
                              L->n_head, X * F, X * F, X * E};
    for (int i = 0; i < NV; i++) {
        PyObject *o = PyTuple_GET_ITEM(a[2], i);
        if (o == Py_None) {
            if (i == V_ATTN_NORM || i == V_FFN_NORM || (L->qk_full && (i == V_Q_NORM || i == V_K_NORM)) ||
                (L->shexp_gated && i == V_SHEXP_GATE)) {
                PyErr_Format(PyExc_ValueError, "moe_layer_new: %s is required", vec_names[i]);
                goto fail;
            }
            continue;
        }
        if (i == V_POST_ATTN || i == V_POST_FFW) {
            PyErr_Format(PyExc_ValueError, "moe_layer_new: %s is not part of a MoE layer", vec_names[i]);
            goto fail;
        }
        if (typed_buffer(o, &L->vbuf[i], 0, 0, vec_names[i]) < 0) goto fail;
        L->have[i] = 1;
        if (L->vbuf[i].len != vlen[i] * 4) {
            PyErr_Format(PyExc_ValueError, "moe_layer_new: %s has %zd values, expected %lld", vec_names[i],
                         L->vbuf[i].len / 4, (long long)vlen[i]);
            goto fail;
        }
        L->vec[i] = L->vbuf[i].buf;
    }
    return cap;
fail:
    Py_DECREF(cap);
    return NULL;
}

/* nw weight buffers a[0..] of the layer's matrices slot[0..] (NULL: slots 0..nw-1), checked
 * against their shapes; *got of them held in w[] */
static const char *get_weights(const layer_t *L, PyObject *const *a, const int *slot, int nw, Py_buffer *w,
                               int *got) {
    while (*got < nw) {
        const int j = slot ? slot[*got] : *got;
        if (PyObject_GetBuffer(a[*got], &w[*got], PyBUF_C_CONTIGUOUS) < 0) return "";
        (*got)++;
        if (w[*got - 1].len < wbytes(L->types[j], L->rows[j], L->cols[j]))
            return "a weight buffer is smaller than its shape and type need";
    }
    return NULL;
}

static PyObject *finish(const char *bad, int rc, Py_buffer *w, int got) {
    for (int j = 0; j < got; j++) PyBuffer_Release(&w[j]);
    if (bad && *bad) return PyErr_Format(PyExc_ValueError, "decode_layer: %s", bad);
    if (bad || rc == -9) return NULL;
    if (rc == -3) return PyErr_NoMemory();
    if (rc == -4) return PyErr_Format(PyExc_ValueError, "decode_layer: unsupported KV cache type");
    if (rc == -5)
        return PyErr_Format(PyExc_ValueError, "decode_batch_experts: a row chose an expert whose weights "
                            "were not given (pass every expert of decode_batch_route's selection)");
    if (rc) return PyErr_Format(PyExc_ValueError, "decode_layer: native kernel failed (%d)", rc);
    Py_RETURN_NONE;
}

/* decode_layer(layer, x, pos, K, V, kv_f16, w*7): one token, contiguous K/V [n_ctx, Hkv, D]. */
static PyObject *py_decode_layer(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    if (na != 6 + NW)
        return PyErr_Format(PyExc_TypeError, "decode_layer(layer, x, pos, K, V, kv_f16, wq, wk, wv, wo, wg, wu, wd)");
    layer_t *L = PyCapsule_GetPointer(a[0], CAPSULE);
    if (!L) return NULL;
    if (L->moe) return PyErr_Format(PyExc_TypeError, "decode_layer: a MoE layer runs through decode_batch");
    long long pos = PyLong_AsLongLong(a[2]);
    int kv_f16 = PyObject_IsTrue(a[5]);
    if ((pos == -1 && PyErr_Occurred()) || kv_f16 < 0) return NULL;
    Py_buffer x, K, V, w[NW];
    int got = 0, rc = 0;
    if (typed_buffer(a[1], &x, 1, 0, "x") < 0) return NULL;
    if (typed_buffer(a[3], &K, 1, kv_f16, "K") < 0) { PyBuffer_Release(&x); return NULL; }
    if (typed_buffer(a[4], &V, 1, kv_f16, "V") < 0) { PyBuffer_Release(&x); PyBuffer_Release(&K); return NULL; }
    const char *bad = NULL;
    const int64_t es = kv_f16 ? 2 : 4;
    if (x.len != L->n_embd * 4) bad = "x must have n_embd values";
    else if (pos < 0 || pos >= INT32_MAX || K.len < (pos + 1) * L->n_head_kv * L->dk * es ||
             V.len < (pos + 1) * L->n_head_kv * L->dv * es)
        bad = "pos is outside the K/V cache arrays";
    if (!bad) bad = get_weights(L, a + 6, NULL, NW, w, &got);
    if (!bad) {
        const uint8_t *wp[NW];
        for (int j = 0; j < NW; j++) wp[j] = w[j].buf;
        const int32_t p32 = (int32_t)pos, zero = 0;
        /* one block as long as the arrays: logical row t is physical row t */
        kvref_t kv = {.K = K.buf, .V = V.buf, .kv_type = kv_f16 ? MF_KV_F16 : MF_KV_F32, .pos = &p32,
                      .slots = &p32, .q_tab = &zero, .tables = &zero, .bs = INT32_MAX};
        Py_BEGIN_ALLOW_THREADS
        rc = run_layer(L, x.buf, 1, &kv, wp, NULL, NULL);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&K);
    PyBuffer_Release(&V);
    return finish(bad, rc, w, got);
}

/* a C-contiguous buffer of `size`-byte integers (4: int32, 8: int64), writable if asked */
static int int_buffer(PyObject *o, Py_buffer *b, int size, int writable, const char *what) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "decode_batch: %s must be a C-contiguous%s int%d array", what,
                     writable ? " writable" : "", 8 * size);
        return -1;
    }
    const char *f = b->format ? b->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (b->itemsize != size || (strcmp(f, size == 4 ? "i" : "q") != 0 && strcmp(f, "l") != 0)) {
        PyErr_Format(PyExc_TypeError, "decode_batch: %s must be int%d", what, 8 * size);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

static int i32_buffer(PyObject *o, Py_buffer *b, const char *what) { return int_buffer(o, b, 4, 0, what); }

static int i64_buffer(PyObject *o, Py_buffer *b, int writable, const char *what) {
    return int_buffer(o, b, 8, writable, what);
}

/* The store's table of a layer's experts (memory/store.py): xoff int64 [n_expert, 3] holds the
 * byte offsets in xbuf of each expert's gate, up and down, or -1 (all three) for an expert that
 * is not there. *xtab (3 n_expert pointers, NULL where absent; the caller frees it). */
static const char *expert_table(const layer_t *L, const Py_buffer *xbuf, const Py_buffer *xoff,
                                const uint8_t ***xtab) {
    const int64_t E = L->n_embd, X = L->n_expert, F = L->n_ff_exp;
    const int64_t need[3] = {wbytes(L->types[M_GE], F, E), wbytes(L->types[M_UE], F, E),
                             wbytes(L->types[M_DE], E, F)};
    if (xoff->len != X * 3 * 8) return "xoff must be [n_expert, 3]";
    const int64_t *o = xoff->buf;
    const uint8_t **t = calloc((size_t)(3 * X), sizeof *t);
    if (!t) {
        PyErr_NoMemory();
        return "";
    }
    for (int64_t e = 0; e < X; e++) {
        if (o[3 * e] == -1 && o[3 * e + 1] == -1 && o[3 * e + 2] == -1) continue;
        for (int k = 0; k < 3; k++) {
            if (o[3 * e + k] < 0 || o[3 * e + k] > (int64_t)xbuf->len - need[k]) {
                free(t);
                return "an expert's offsets in xoff lie outside xbuf";
            }
            t[3 * e + k] = (const uint8_t *)xbuf->buf + o[3 * e + k];
        }
    }
    *xtab = t;
    return NULL;
}

/* decode_batch(layer, x[n, E], pos, slots, q_tab, tables, bs, kv_type, K, V, w*7):
 * n rows through one layer, K/V pools of physical rows, paged addressing as mf_paged_args.
 * route = 1 (decode_batch_route(layer, x, pos, slots, q_tab, tables, bs, kv_type, K, V, sel, h,
 * logits, wq, wk, wv, wo, router)): a MoE layer's attention and routing only (see run_layer). */
static PyObject *decode_batch_impl(PyObject *const *a, Py_ssize_t na, int route) {
    static const int route_slots[8] = {W_Q, W_K, W_V, W_O, M_ROUTER, M_GS, M_US, M_DS};
    layer_t *L = na >= 1 ? PyCapsule_GetPointer(a[0], CAPSULE) : NULL;
    if (!L && na >= 1) return NULL;
    const int tab = route == 2;   /* decode_batch_moe: the experts from a table when all are there */
    const int ahead = route == 3; /* decode_batch_route_ahead: and the router look-ahead */
    const int nw = L ? (tab ? 5 + (L->nw > M_GS ? L->nw - M_GS : 0) : route ? 5 : L->nw) : 0,
              wa = ahead ? 23 : tab ? 15 : route ? 13 : 10; /* weights from a[wa] on */
    if (!L || na != wa + nw || (route && !L->moe)) {
        if (ahead)
            return PyErr_Format(PyExc_TypeError, "decode_batch_route_ahead(layer, x, pos, slots, q_tab, tables, "
                                "bs, kv_type, K, V, sel, h, logits, seq, real, real_pos, look, look_pos, il, "
                                "next_router | None, next_type, next_bias | None, pred, wq, wk, wv, wo, router) of "
                                "a MoE layer");
        if (tab)
            return PyErr_Format(PyExc_TypeError, "decode_batch_moe(layer, x, pos, slots, q_tab, tables, bs, "
                                "kv_type, K, V, sel, h, logits, xbuf, xoff, wq, wk, wv, wo, router[, the 3 "
                                "shared-expert matrices]) of a MoE layer");
        if (route)
            return PyErr_Format(PyExc_TypeError, "decode_batch_route(layer, x, pos, slots, q_tab, tables, bs, "
                                "kv_type, K, V, sel, h, logits, wq, wk, wv, wo, router) of a MoE layer");
        return PyErr_Format(PyExc_TypeError, "decode_batch(layer, x, pos, slots, q_tab, tables, bs, kv_type, K, V, "
                            "and the layer's %d weights: wq, wk, wv, wo, then wg, wu, wd (dense) or the router, "
                            "the 3 stacked experts[, the 3 shared-expert matrices] (MoE))", L ? L->nw : NW);
    }
    long long bs = PyLong_AsLongLong(a[6]), kv_type = PyLong_AsLongLong(a[7]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer x, ib[4], K, V, w[NWM], ob[3];
    int nb = 0, got = 0, rc = 0, have_k = 0, have_v = 0, nob = 0;
    int have_o[3] = {0, 0, 0};
    const char *bad = NULL;
    static const char *inames[4] = {"pos", "slots", "q_tab", "tables"};
    if (typed_buffer(a[1], &x, 1, 0, "x") < 0) return NULL;
    for (; nb < 4; nb++)
        if (i32_buffer(a[2 + nb], &ib[nb], inames[nb]) < 0) { bad = ""; break; }
    const int64_t rbk = mf_kv_row_bytes((int)kv_type, L->n_head_kv * L->dk),
                  rbv = mf_kv_row_bytes((int)kv_type, L->n_head_kv * L->dv);
    if (!bad && (rbk == 0 || rbv == 0)) bad = "unsupported KV cache type";
    if (!bad) {
        if (PyObject_GetBuffer(a[8], &K, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) bad = "";
        else have_k = 1;
    }
    if (!bad) {
        if (PyObject_GetBuffer(a[9], &V, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) bad = "";
        else have_v = 1;
    }
    /* route: sel [n, K] int64, then h [n, E] and logits [n, X] float32 or None */
    for (; route && !bad && nob < 3; nob++) {
        if (nob > 0 && a[10 + nob] == Py_None) continue;
        if ((nob == 0 ? i64_buffer(a[10], &ob[0], 1, "sel")
                      : typed_buffer(a[10 + nob], &ob[nob], 1, 0, nob == 1 ? "h" : "logits")) < 0)
            bad = "";
        else have_o[nob] = 1;
    }
    int64_t n = 0;
    if (!bad) {
        n = x.len / 4 / L->n_embd;
        const int64_t rows = K.len / rbk, nt = ib[3].len / 4;
        const int32_t *pos = ib[0].buf, *slots = ib[1].buf, *qt = ib[2].buf, *tab = ib[3].buf;
        if (n < 1 || x.len != n * L->n_embd * 4) bad = "x must be [n, n_embd]";
        else if (ib[0].len != n * 4 || ib[1].len != n * 4 || ib[2].len != n * 4) bad = "pos, slots and q_tab need n values";
        else if (bs < 1 || rows % bs || V.len / rbv != rows) bad = "K and V must hold the same whole blocks of bs rows";
        else if (route && (ob[0].len != n * L->k_used * 8 || (have_o[1] && ob[1].len != n * L->n_embd * 4) ||
                           (have_o[2] && ob[2].len != n * L->n_expert * 4)))
            bad = "sel, h and logits must be [n, n_expert_used], [n, n_embd] and [n, n_expert]";
        for (int64_t i = 0; !bad && i < nt; i++)
            if (tab[i] < 0 || tab[i] >= rows / bs) bad = "a block table entry is outside the pool";
        for (int64_t i = 0; !bad && i < n; i++)
            if (pos[i] < 0 || slots[i] < 0 || slots[i] >= rows || qt[i] < 0 || qt[i] + pos[i] / bs >= nt)
                bad = "a row's position, slot or table lies outside the pool";
    }
    Py_buffer xbuf, xoff;
    int have_xb = 0, have_xo = 0;
    const uint8_t **xtab = NULL;
    if (tab && !bad) {
        if (PyObject_GetBuffer(a[13], &xbuf, PyBUF_C_CONTIGUOUS) < 0) bad = "";
        else have_xb = 1;
    }
    if (tab && !bad) {
        if (i64_buffer(a[14], &xoff, 0, "xoff") < 0) bad = "";
        else have_xo = 1;
    }
    if (tab && !bad) bad = expert_table(L, &xbuf, &xoff, &xtab);
    /* look-ahead: seq int32 [n]; real, look float32 [NL, S, X]; real_pos, look_pos int32 [NL, S];
     * il; next router (type next_type) and bias or None; pred int64 [n, K] */
    Py_buffer ab[8];
    int have_ab[8] = {0};
    ahead_t A = {0};
    if (ahead && !bad) {
        if (!have_o[1] || !have_o[2]) bad = "the look-ahead needs h and logits";
        const long long il = bad ? 0 : PyLong_AsLongLong(a[18]), nt = bad ? 0 : PyLong_AsLongLong(a[20]);
        if (!bad && PyErr_Occurred()) bad = "";
        static const char *anames[5] = {"seq", "real", "real_pos", "look", "look_pos"};
        for (int i = 0; !bad && i < 5; i++) {
            const int f32 = i == 1 || i == 3;
            if ((f32 ? typed_buffer(a[13 + i], &ab[i], 1, 0, anames[i])
                     : int_buffer(a[13 + i], &ab[i], 4, i > 0, anames[i])) < 0)
                bad = "";
            else have_ab[i] = 1;
        }
        const int64_t X = L->n_expert, E = L->n_embd;
        int64_t NL = 0, S = 0;
        if (!bad) {
            NL = ab[2].ndim == 2 ? ab[2].shape[0] : 0;
            S = ab[2].ndim == 2 ? ab[2].shape[1] : 0;
            if (NL < 1 || S < 1 || ab[4].len != ab[2].len || ab[1].len != NL * S * X * 4 || ab[3].len != ab[1].len)
                bad = "real, look must be [n_layer, slots, n_expert] and real_pos, look_pos [n_layer, slots]";
            else if (ab[0].len != n * 4) bad = "seq needs n values";
            else if (il < 0 || il >= NL) bad = "il is outside the state's layers";
        }
        for (int64_t r = 0; !bad && r < n; r++)
            if (((const int32_t *)ab[0].buf)[r] < 0 || ((const int32_t *)ab[0].buf)[r] >= S)
                bad = "a row's sequence slot is outside the state's slots";
        if (!bad && a[19] != Py_None) {
            if (il + 1 >= NL) bad = "no layer after il";
            else if (nt < 0 || nt >= T_MAX || !mf_qtypes[nt].block || E % mf_qtypes[nt].block)
                bad = "next_type is not a type the router can have";
            else if (PyObject_GetBuffer(a[19], &ab[5], PyBUF_C_CONTIGUOUS) < 0) bad = "";
            else if ((have_ab[5] = 1) && ab[5].len < wbytes((int)nt, X, E))
                bad = "next_router is smaller than its shape and type need";
            if (!bad && a[21] != Py_None) {
                if (typed_buffer(a[21], &ab[6], 0, 0, "next_bias") < 0) bad = "";
                else if ((have_ab[6] = 1) && ab[6].len != X * 4) bad = "next_bias must have n_expert values";
            }
            if (!bad) {
                if (i64_buffer(a[22], &ab[7], 1, "pred") < 0) bad = "";
                else if ((have_ab[7] = 1) && ab[7].len != n * L->k_used * 8) bad = "pred must be [n, n_expert_used]";
            }
        }
        if (!bad)
            A = (ahead_t){.seq = ab[0].buf, .real = ab[1].buf, .rpos = ab[2].buf, .look = ab[3].buf,
                          .lpos = ab[4].buf, .S = S, .il = il, .nr = have_ab[5] ? ab[5].buf : NULL, .nt = (int)nt,
                          .nb = have_ab[6] ? ab[6].buf : NULL, .pred = have_ab[7] ? ab[7].buf : NULL};
    }
    if (!bad) bad = get_weights(L, a + wa, route ? route_slots : NULL, nw, w, &got);
    if (!bad) {
        const uint8_t *wp[NWM] = {0};
        for (int j = 0; j < nw; j++) wp[route ? route_slots[j] : j] = w[j].buf;
        kvref_t kv = {.K = K.buf, .V = V.buf, .kv_type = (int)kv_type, .pos = ib[0].buf, .slots = ib[1].buf,
                      .q_tab = ib[2].buf, .tables = ib[3].buf, .bs = bs};
        route_out_t rt = {.sel = route ? ob[0].buf : NULL, .h = have_o[1] ? ob[1].buf : NULL,
                          .logits = have_o[2] ? ob[2].buf : NULL};
        Py_BEGIN_ALLOW_THREADS
        rc = run_layer(L, x.buf, n, &kv, wp, xtab, route ? &rt : NULL);
        if (!rc && ahead) rc = lookahead(L, n, ib[0].buf, rt.h, rt.logits, &A);
        Py_END_ALLOW_THREADS
    }
    for (int i = 0; i < 8; i++)
        if (have_ab[i]) PyBuffer_Release(&ab[i]);
    free(xtab);
    if (have_xb) PyBuffer_Release(&xbuf);
    if (have_xo) PyBuffer_Release(&xoff);
    PyBuffer_Release(&x);
    for (int i = 0; i < nb; i++) PyBuffer_Release(&ib[i]);
    for (int i = 0; i < 3; i++)
        if (have_o[i]) PyBuffer_Release(&ob[i]);
    if (have_k) PyBuffer_Release(&K);
    if (have_v) PyBuffer_Release(&V);
    const int routed_only = tab && !bad && rc == 1;
    PyObject *r = finish(bad, routed_only ? 0 : rc, w, got);
    if (r && tab) {
        Py_DECREF(r);
        return PyBool_FromLong(!routed_only);
    }
    return r;
}

static PyObject *py_decode_batch(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    return decode_batch_impl(a, na, 0);
}

static PyObject *py_decode_batch_route(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    return decode_batch_impl(a, na, 1);
}

static PyObject *py_decode_batch_moe(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    return decode_batch_impl(a, na, 2);
}

static PyObject *py_decode_batch_route_ahead(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    return decode_batch_impl(a, na, 3);
}

/* decode_batch_experts_at(layer, x[n, E], xbuf, xoff, router[, gate_shexp, up_shexp, down_shexp]
 * [, h, logits]): decode_batch_experts with the experts from the store's table (see
 * expert_table); every expert the rows choose must be there. h [n, E] and logits [n, X]: the
 * route call's (route_out_t) for this x, taken instead of running the FFN norm and the router
 * again (the same bits: the same computation on the same x).
 * part (decode_batch_experts_part(layer, x, xbuf, xoff, yk, done, final, router[, ...])): in
 * pieces while the store reads the rest: final 0 computes the chosen experts that are there and
 * not done (done uint8 [n_expert], yk float32 [n, n_expert_used, n_embd] keep them; x untouched);
 * final 1 the chosen ones not done (they must be there now), then x gets them all. */
static PyObject *experts_at_impl(PyObject *const *a, Py_ssize_t na, int part) {
    static const int slots[4] = {M_ROUTER, M_GS, M_US, M_DS};
    const int wa = part ? 7 : 4;
    layer_t *L = na >= 1 ? PyCapsule_GetPointer(a[0], CAPSULE) : NULL;
    if (!L && na >= 1) return NULL;
    const int nw = L ? 1 + (L->nw - M_GS) : 0;
    if (!L || !L->moe || (na != wa + nw && na != wa + nw + 2)) {
        if (part)
            return PyErr_Format(PyExc_TypeError, "decode_batch_experts_part(layer, x, xbuf, xoff, yk, done, "
                                "final, router[, the 3 shared-expert matrices][, h, logits]) of a MoE layer");
        return PyErr_Format(PyExc_TypeError, "decode_batch_experts_at(layer, x, xbuf, xoff, router[, the 3 "
                            "shared-expert matrices][, h, logits]) of a MoE layer");
    }
    const int routed = na == wa + nw + 2; /* h [n, E], logits [n, X] from the route call */
    Py_buffer x, xbuf, xoff, yk, dn, w[NWM], hb, lb;
    int got = 0, rc = 0, have_xb = 0, have_xo = 0, have_yk = 0, have_dn = 0, have_h = 0, have_l = 0, final = 1;
    const uint8_t **xtab = NULL;
    const char *bad = NULL;
    if (part) {
        final = PyObject_IsTrue(a[6]);
        if (final < 0) return NULL;
    }
    if (typed_buffer(a[1], &x, 1, 0, "x") < 0) return NULL;
    const int64_t n = x.len / 4 / L->n_embd;
    if (n < 1 || x.len != n * L->n_embd * 4) bad = "x must be [n, n_embd]";
    if (!bad) {
        if (PyObject_GetBuffer(a[2], &xbuf, PyBUF_C_CONTIGUOUS) < 0) bad = "";
        else have_xb = 1;
    }
    if (!bad) {
        if (i64_buffer(a[3], &xoff, 0, "xoff") < 0) bad = "";
        else have_xo = 1;
    }
    if (part && !bad) {
        if (typed_buffer(a[4], &yk, 1, 0, "yk") < 0) bad = "";
        else if ((have_yk = 1) && yk.len != n * L->k_used * L->n_embd * 4)
            bad = "yk must be [n, n_expert_used, n_embd]";
    }
    if (part && !bad) {
        if (PyObject_GetBuffer(a[5], &dn, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) bad = "";
        else if ((have_dn = 1) && dn.len != L->n_expert)
            bad = "done must be n_expert bytes";
    }
    if (routed && !bad) {
        if (typed_buffer(a[na - 2], &hb, 0, 0, "h") < 0) bad = "";
        else if ((have_h = 1) && hb.len != n * L->n_embd * 4) bad = "h must be [n, n_embd]";
    }
    if (routed && !bad) {
        if (typed_buffer(a[na - 1], &lb, 0, 0, "logits") < 0) bad = "";
        else if ((have_l = 1) && lb.len != n * L->n_expert * 4) bad = "logits must be [n, n_expert]";
    }
    if (!bad) bad = expert_table(L, &xbuf, &xoff, &xtab);
    if (!bad) bad = get_weights(L, a + wa, slots, nw, w, &got);
    if (!bad) {
        const uint8_t *wp[NWM] = {0};
        for (int j = 0; j < nw; j++) wp[slots[j]] = w[j].buf;
        Py_BEGIN_ALLOW_THREADS
        rc = run_experts(L, x.buf, n, wp, xtab, part ? yk.buf : NULL, part ? dn.buf : NULL,
                         part ? (final ? 2 : 1) : 0, have_h ? hb.buf : NULL, have_l ? lb.buf : NULL);
        Py_END_ALLOW_THREADS
    }
    if (have_h) PyBuffer_Release(&hb);
    if (have_l) PyBuffer_Release(&lb);
    free(xtab);
    if (have_xb) PyBuffer_Release(&xbuf);
    if (have_xo) PyBuffer_Release(&xoff);
    if (have_yk) PyBuffer_Release(&yk);
    if (have_dn) PyBuffer_Release(&dn);
    PyBuffer_Release(&x);
    return finish(bad, rc, w, got);
}

static PyObject *py_decode_batch_experts_at(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    return experts_at_impl(a, na, 0);
}

static PyObject *py_decode_batch_experts_part(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    return experts_at_impl(a, na, 1);
}

/* decode_batch_experts(layer, x[n, E], experts int64 [m], mats, router[, gate_shexp, up_shexp,
 * down_shexp]): the MoE half of a layer whose experts the store streams, after
 * decode_batch_route: mats holds 3 m buffers, gate, up, down of experts[0], then of experts[1],
 * ..., each exactly one expert's bytes of the layer's types and shapes. x updated in place. */
static PyObject *py_decode_batch_experts(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    static const int slots[4] = {M_ROUTER, M_GS, M_US, M_DS};
    layer_t *L = na >= 1 ? PyCapsule_GetPointer(a[0], CAPSULE) : NULL;
    if (!L && na >= 1) return NULL;
    const int nw = L ? 1 + (L->nw - M_GS) : 0;
    if (!L || !L->moe || na != 4 + nw)
        return PyErr_Format(PyExc_TypeError, "decode_batch_experts(layer, x, experts, mats, router[, the 3 "
                            "shared-expert matrices]) of a MoE layer");
    const int64_t E = L->n_embd, X = L->n_expert, F = L->n_ff_exp;
    const int64_t need[3] = {wbytes(L->types[M_GE], F, E), wbytes(L->types[M_UE], F, E),
                             wbytes(L->types[M_DE], E, F)};
    Py_buffer x, ids, w[NWM], *xb = NULL;
    const uint8_t **xtab = NULL;
    int got = 0, rc = 0, have_ids = 0;
    Py_ssize_t nxb = 0, m = 0;
    const char *bad = NULL;
    PyObject *seq = NULL;
    if (typed_buffer(a[1], &x, 1, 0, "x") < 0) return NULL;
    const int64_t n = x.len / 4 / E;
    if (n < 1 || x.len != n * E * 4) bad = "x must be [n, n_embd]";
    if (!bad) {
        if (i64_buffer(a[2], &ids, 0, "experts") < 0) bad = "";
        else have_ids = 1;
    }
    if (!bad && !(seq = PySequence_Fast(a[3], "decode_batch_experts: mats must be a sequence of buffers")))
        bad = "";
    if (!bad) {
        m = (Py_ssize_t)(ids.len / 8);
        if (m < 1 || m > X || PySequence_Fast_GET_SIZE(seq) != 3 * m)
            bad = "experts must name 1..n_expert experts and mats hold 3 buffers (gate, up, down) for each";
    }
    if (!bad) {
        xb = calloc((size_t)(3 * m), sizeof *xb);
        xtab = calloc((size_t)(3 * X), sizeof *xtab);
        if (!xb || !xtab) {
            PyErr_NoMemory();
            bad = "";
        }
    }
    for (Py_ssize_t i = 0; !bad && i < m; i++) {
        const int64_t e = ((const int64_t *)ids.buf)[i];
        if (e < 0 || e >= X) bad = "an expert id is outside the layer's experts";
        else if (xtab[3 * e]) bad = "an expert is given twice";
        for (int k = 0; !bad && k < 3; k++) {
            if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, 3 * i + k), &xb[nxb], PyBUF_C_CONTIGUOUS) < 0) {
                bad = "";
                break;
            }
            nxb++;
            if (xb[nxb - 1].len != need[k] || !xb[nxb - 1].buf)
                bad = "an expert's buffer is not one expert's bytes of the layer's type and shape";
            else xtab[3 * e + k] = xb[nxb - 1].buf;
        }
    }
    if (!bad) bad = get_weights(L, a + 4, slots, nw, w, &got);
    if (!bad) {
        const uint8_t *wp[NWM] = {0};
        for (int j = 0; j < nw; j++) wp[slots[j]] = w[j].buf;
        Py_BEGIN_ALLOW_THREADS
        rc = run_experts(L, x.buf, n, wp, xtab, NULL, NULL, 0, NULL, NULL);
        Py_END_ALLOW_THREADS
    }
    for (Py_ssize_t i = 0; i < nxb; i++) PyBuffer_Release(&xb[i]);
    free(xb);
    free(xtab);
    Py_XDECREF(seq);
    if (have_ids) PyBuffer_Release(&ids);
    PyBuffer_Release(&x);
    return finish(bad, rc, w, got);
}

/* decode_layer_fields() -> (ints, floats, weights, vecs): the names of decode_layer_new's tuple
 * slots and of decode_batch's weight arguments, in order (models/fused.py packs by them) */
static PyObject *names_tuple(const char *const *names, int n) {
    PyObject *t = PyTuple_New(n);
    for (int i = 0; t && i < n; i++) {
        PyObject *s = PyUnicode_FromString(names[i]);
        if (!s) { Py_DECREF(t); return NULL; }
        PyTuple_SET_ITEM(t, i, s);
    }
    return t;
}

static PyObject *py_decode_layer_fields(PyObject *self, PyObject *unused) {
    static const char *const ints[10] = {"n_embd", "n_head", "n_head_kv", "head_dim_k", "head_dim_v",
                                         "n_ff", "n_rot", "window", "rope_neox", "gelu"};
    static const char *const floats[5] = {"rope_base", "rope_freq_scale", "rms_eps", "attn_scale",
                                          "attn_softcap"};
    PyObject *a = names_tuple(ints, 10), *b = names_tuple(floats, 5), *c = names_tuple(w_names, NW),
             *d = names_tuple(vec_names, NV_DENSE), *r = NULL;
    if (a && b && c && d) r = PyTuple_Pack(4, a, b, c, d);
    Py_XDECREF(a); Py_XDECREF(b); Py_XDECREF(c); Py_XDECREF(d);
    return r;
}

static PyObject *py_moe_layer_fields(PyObject *self, PyObject *unused) {
    static const char *const ints[MOE_NI] = {"n_embd", "n_head", "n_head_kv", "head_dim_k", "head_dim_v", "n_rot",
                                             "window", "rope_neox", "gelu", "qk_norm_full", "n_expert",
                                             "n_expert_used", "n_ff_exp", "n_ff_shexp", "sigmoid",
                                             "expert_weights_norm", "shexp_gated", "swiglu_oai", "softmax_weight"};
    static const char *const floats[MOE_NF] = {"rope_base", "rope_freq_scale", "rms_eps", "attn_scale",
                                               "attn_softcap", "expert_weights_scale", "yarn_ext_factor",
                                               "yarn_attn_factor", "yarn_corr_lo", "yarn_corr_hi"};
    PyObject *a = names_tuple(ints, MOE_NI), *b = names_tuple(floats, MOE_NF), *c = names_tuple(wm_names, NWM),
             *d = names_tuple(vec_names, NV), *r = NULL;
    if (a && b && c && d) r = PyTuple_Pack(4, a, b, c, d);
    Py_XDECREF(a); Py_XDECREF(b); Py_XDECREF(c); Py_XDECREF(d);
    return r;
}

PyMethodDef mf_decode_methods[] = {
    {"moe_layer_fields", py_moe_layer_fields, METH_NOARGS,
     "moe_layer_fields() -> (ints, floats, weights, vecs): names of moe_layer_new's slots, in order"},
    {"moe_layer_new", (PyCFunction)(void (*)(void))py_moe_layer_new, METH_FASTCALL,
     "moe_layer_new(ints, floats, vecs) -> layer: a prepared MoE decoder layer for decode_batch (csrc/decode.c)"},
    {"decode_layer_fields", py_decode_layer_fields, METH_NOARGS,
     "decode_layer_fields() -> (ints, floats, weights, vecs): names of decode_layer_new's slots, in order"},
    {"decode_layer_new", (PyCFunction)(void (*)(void))py_decode_layer_new, METH_FASTCALL,
     "decode_layer_new(ints, floats, vecs) -> layer: a prepared decoder layer (see csrc/decode.c)"},
    {"decode_layer", (PyCFunction)(void (*)(void))py_decode_layer, METH_FASTCALL,
     "decode_layer(layer, x[n_embd], pos, K, V, kv_f16, wq, wk, wv, wo, wg, wu, wd): one token through one "
     "layer, x updated in place, K/V row pos written"},
    {"decode_batch_route", (PyCFunction)(void (*)(void))py_decode_batch_route, METH_FASTCALL,
     "decode_batch_route(layer, x[n, n_embd], pos, slots, q_tab, tables, bs, kv_type, K, V, sel[n, k] int64, "
     "h[n, n_embd] | None, logits[n, n_expert] | None, wq, wk, wv, wo, router): a MoE layer's attention (x "
     "updated, K/V written) and routing (the chosen experts into sel) for decode_batch_experts"},
    {"decode_batch_experts", (PyCFunction)(void (*)(void))py_decode_batch_experts, METH_FASTCALL,
     "decode_batch_experts(layer, x[n, n_embd], experts int64[m], mats[3 m], router[, gate_shexp, up_shexp, "
     "down_shexp]): a MoE layer's experts (+ the shared one) on x in place, expert experts[i]'s gate, up, down "
     "at mats[3 i:3 i + 3]"},
    {"decode_batch_moe", (PyCFunction)(void (*)(void))py_decode_batch_moe, METH_FASTCALL,
     "decode_batch_moe(layer, x[n, n_embd], pos, slots, q_tab, tables, bs, kv_type, K, V, sel[n, k] int64, "
     "h | None, logits | None, xbuf, xoff int64[n_expert, 3], wq, wk, wv, wo, router[, gate_shexp, up_shexp, "
     "down_shexp]) -> bool: decode_batch_route, then the experts from the store's table (offsets in xbuf, "
     "-1: not there) when every chosen one is there (True); False: routed only"},
    {"decode_batch_experts_at", (PyCFunction)(void (*)(void))py_decode_batch_experts_at, METH_FASTCALL,
     "decode_batch_experts_at(layer, x[n, n_embd], xbuf, xoff int64[n_expert, 3], router[, gate_shexp, "
     "up_shexp, down_shexp][, h, logits]): decode_batch_experts with the experts from the store's table; h and "
     "logits: what the route call left for this x (its FFN norm and router are not run again)"},
    {"decode_batch_route_ahead", (PyCFunction)(void (*)(void))py_decode_batch_route_ahead, METH_FASTCALL,
     "decode_batch_route_ahead(layer, x, pos, slots, q_tab, tables, bs, kv_type, K, V, sel, h, logits, seq int32[n], "
     "real, real_pos, look, look_pos, il, next_router | None, next_type, next_bias | None, pred int64[n, k], wq, wk, "
     "wv, wo, router): decode_batch_route, then models/lookahead.py's observe (layer il) and, with next_router, "
     "predict (layer il + 1, its top k into pred) on the state arrays"},
    {"decode_batch_experts_part", (PyCFunction)(void (*)(void))py_decode_batch_experts_part, METH_FASTCALL,
     "decode_batch_experts_part(layer, x[n, n_embd], xbuf, xoff, yk[n, k, n_embd], done uint8[n_expert], final, "
     "router[, gate_shexp, up_shexp, down_shexp][, h, logits]): decode_batch_experts_at in pieces while the store reads: final "
     "false computes the chosen experts at hand and not done into yk (done marked), final true the rest and adds "
     "them all to x"},
    {"decode_batch", (PyCFunction)(void (*)(void))py_decode_batch, METH_FASTCALL,
     "decode_batch(layer, x[n, n_embd], pos, slots, q_tab, tables (int32), bs, kv_type, K, V, wq, wk, wv, wo, wg, "
     "wu, wd): n rows through one layer over a paged KV pool; x updated in place, K/V rows slots written"},
    {NULL, NULL, 0, NULL},
};
