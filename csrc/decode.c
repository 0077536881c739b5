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
 * Scratch is per calling thread and grows once (no allocation per call after the first). */
#include "memfit.h"
#include "ops.h"
#include "quant_common.h"

#include <stdlib.h>
#include <string.h>

int mf_matmul_multi(int k, const int *types, const uint8_t *const *ws, const int64_t *rows,
                    int64_t cols, const float *x, int64_t n, float *const *ys);

enum { W_Q, W_K, W_V, W_O, W_G, W_U, W_D, NW };
enum { V_ATTN_NORM, V_Q_NORM, V_K_NORM, V_POST_ATTN, V_FFN_NORM, V_POST_FFW, V_BQ, V_BK, V_BV, V_BO,
       V_FREQ, NV };
static const char *const vec_names[NV] = {"attn_norm", "q_norm", "k_norm", "post_attention_norm",
                                          "ffn_norm", "post_ffw_norm", "bq", "bk", "bv", "bo",
                                          "freq_factors"};
static const char *const w_names[NW] = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                        "ffn_up", "ffn_down"};

typedef struct {
    int64_t n_embd, n_head, n_head_kv, dk, dv, n_ff, n_rot, window;
    int neox, gelu;
    double rope_base, freq_scale;
    float eps, attn_scale, softcap;
    int types[NW];
    int64_t rows[NW], cols[NW];
    const float *vec[NV]; /* NULL where absent */
    Py_buffer vbuf[NV];
    int have[NV];
} layer_t;

static _Thread_local float *sc_buf;
static _Thread_local size_t sc_cap;
static _Thread_local int32_t *kp_buf;
static _Thread_local int64_t kp_cap;

static float *scratch(size_t n) {
    if (n > sc_cap) {
        free(sc_buf);
        sc_buf = aligned_alloc(64, ((n * sizeof(float)) + 63) & ~(size_t)63);
        sc_cap = sc_buf ? n : 0;
    }
    return sc_buf;
}

static const int32_t *kv_positions(int64_t T) {
    if (T > kp_cap) {
        int64_t cap = T < 4096 ? 4096 : 2 * T;
        int32_t *p = realloc(kp_buf, (size_t)cap * sizeof(int32_t));
        if (!p) return NULL;
        kp_buf = p;
        for (int64_t t = kp_cap; t < cap; t++) kp_buf[t] = (int32_t)t;
        kp_cap = cap;
    }
    return kp_buf;
}

static inline void add_to(float *y, const float *b, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += b[i];
}

/* The layer (see the file comment). Returns 0, -3 out of memory, or a matmul error code. */
static int run_layer(const layer_t *L, float *x, int32_t pos, void *K, void *V, int kv_f16,
                     const uint8_t *const *w) {
    const int64_t E = L->n_embd, qd = L->n_head * L->dk, kd = L->n_head_kv * L->dk,
                  vd = L->n_head_kv * L->dv, ad = L->n_head * L->dv, F = L->n_ff, T = (int64_t)pos + 1;
    float *s = scratch((size_t)(E + qd + kd + vd + ad + E + 2 * F));
    const int32_t *kvpos = kv_positions(T);
    if (!s || !kvpos) return -3;
    float *h = s, *q = h + E, *k = q + qd, *v = k + kd, *att = v + vd, *o = att + ad, *g = o + E, *u = g + F;
    const float *const *vec = L->vec;
    int rc;

    /* attention */
    mf_rmsnorm_f32(x, vec[V_ATTN_NORM], h, 1, E, L->eps);
    {
        float *ys[3] = {q, k, v};
        if ((rc = mf_matmul_multi(3, L->types, w, L->rows, E, h, 1, ys))) return rc;
    }
    if (vec[V_BQ]) add_to(q, vec[V_BQ], qd);
    if (vec[V_BK]) add_to(k, vec[V_BK], kd);
    if (vec[V_BV]) add_to(v, vec[V_BV], vd);
    if (vec[V_Q_NORM]) mf_rmsnorm_f32(q, vec[V_Q_NORM], q, L->n_head, L->dk, L->eps);
    if (vec[V_K_NORM]) mf_rmsnorm_f32(k, vec[V_K_NORM], k, L->n_head_kv, L->dk, L->eps);
    mf_rope_f32(q, q, &pos, 1, L->n_head, L->dk, L->n_rot, L->rope_base, L->freq_scale, L->neox,
                vec[V_FREQ]);
    mf_rope_f32(k, k, &pos, 1, L->n_head_kv, L->dk, L->n_rot, L->rope_base, L->freq_scale, L->neox,
                vec[V_FREQ]);
    if (kv_f16) { /* llama.cpp's default cache: f16 K/V, and its flash path reads Q as f16 */
        mf_f32_to_f16(k, (uint16_t *)K + (int64_t)pos * kd, kd);
        mf_f32_to_f16(v, (uint16_t *)V + (int64_t)pos * vd, vd);
        mf_round_f16_f32(q, q, qd);
    } else {
        memcpy((float *)K + (int64_t)pos * kd, k, (size_t)kd * sizeof(float));
        memcpy((float *)V + (int64_t)pos * vd, v, (size_t)vd * sizeof(float));
    }
    mf_attn_args at = {.q = q, .k = K, .v = V, .out = att, .q_pos = &pos, .kv_pos = kvpos, .n = 1,
                       .T = T, .Hq = L->n_head, .Hkv = L->n_head_kv, .D = L->dk, .Dv = L->dv,
                       .scale = L->attn_scale, .softcap = L->softcap, .window = L->window,
                       .kv_f16 = kv_f16};
    mf_attention_f32(&at);
    {
        float *ys[1] = {o};
        if ((rc = mf_matmul_multi(1, &L->types[W_O], &w[W_O], &L->rows[W_O], ad, att, 1, ys))) return rc;
    }
    if (vec[V_BO]) add_to(o, vec[V_BO], E);
    if (vec[V_POST_ATTN]) mf_rmsnorm_f32(o, vec[V_POST_ATTN], o, 1, E, L->eps);
    add_to(x, o, E);

    /* feed-forward */
    mf_rmsnorm_f32(x, vec[V_FFN_NORM], h, 1, E, L->eps);
    {
        float *ys[2] = {g, u};
        if ((rc = mf_matmul_multi(2, &L->types[W_G], &w[W_G], &L->rows[W_G], E, h, 1, ys))) return rc;
    }
    if (L->gelu) mf_gelu_mul_f32(g, u, g, F);
    else mf_silu_mul_f32(g, u, g, F);
    {
        float *ys[1] = {o};
        if ((rc = mf_matmul_multi(1, &L->types[W_D], &w[W_D], &L->rows[W_D], F, g, 1, ys))) return rc;
    }
    if (vec[V_POST_FFW]) mf_rmsnorm_f32(o, vec[V_POST_FFW], o, 1, E, L->eps);
    add_to(x, o, E);
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
        PyTuple_GET_SIZE(a[0]) != 10 + NW || PyTuple_GET_SIZE(a[1]) != 5 || PyTuple_GET_SIZE(a[2]) != NV)
        return PyErr_Format(PyExc_TypeError, "decode_layer_new(ints[%d], floats[5], vecs[%d])", 10 + NW, NV);
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
                   .attn_scale = (float)fv[3], .softcap = (float)fv[4]};
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
        if (t < 0 || t >= T_MAX || mf_qtypes[t].block == 0 || cols[j] % mf_qtypes[t].block ||
            (mf_qtypes[t].xfmt == XF_Q8_256 && cols[j] % 256)) {
            PyErr_Format(PyExc_ValueError, "decode_layer_new: %s type %lld cannot run with %lld columns",
                         w_names[j], t, (long long)cols[j]);
            goto fail;
        }
        L->types[j] = (int)t;
        L->rows[j] = rows[j];
        L->cols[j] = cols[j];
    }
    const int64_t vlen[NV] = {E, L->dk, L->dk, E, E, E, rows[W_Q], rows[W_K], rows[W_V], E, L->n_rot / 2};
    for (int i = 0; i < NV; i++) {
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

static PyObject *py_decode_layer(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    if (na != 6 + NW)
        return PyErr_Format(PyExc_TypeError, "decode_layer(layer, x, pos, K, V, kv_f16, wq, wk, wv, wo, wg, wu, wd)");
    layer_t *L = PyCapsule_GetPointer(a[0], CAPSULE);
    if (!L) return NULL;
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
    while (!bad && got < NW) {
        if (PyObject_GetBuffer(a[6 + got], &w[got], PyBUF_C_CONTIGUOUS) < 0) { rc = -9; break; }
        got++;
        if (w[got - 1].len < wbytes(L->types[got - 1], L->rows[got - 1], L->cols[got - 1]))
            bad = "a weight buffer is smaller than its shape and type need";
    }
    if (!bad && rc == 0) {
        const uint8_t *wp[NW];
        for (int j = 0; j < NW; j++) wp[j] = w[j].buf;
        Py_BEGIN_ALLOW_THREADS
        rc = run_layer(L, x.buf, (int32_t)pos, K.buf, V.buf, kv_f16, wp);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&K);
    PyBuffer_Release(&V);
    for (int j = 0; j < got; j++) PyBuffer_Release(&w[j]);
    if (bad) return PyErr_Format(PyExc_ValueError, "decode_layer: %s", bad);
    if (rc == -9) return NULL;
    if (rc == -3) return PyErr_NoMemory();
    if (rc) return PyErr_Format(PyExc_ValueError, "decode_layer: native kernel failed (%d)", rc);
    Py_RETURN_NONE;
}

PyMethodDef mf_decode_methods[] = {
    {"decode_layer_new", (PyCFunction)(void (*)(void))py_decode_layer_new, METH_FASTCALL,
     "decode_layer_new(ints, floats, vecs) -> layer: a prepared decoder layer (see csrc/decode.c)"},
    {"decode_layer", (PyCFunction)(void (*)(void))py_decode_layer, METH_FASTCALL,
     "decode_layer(layer, x[n_embd], pos, K, V, kv_f16, wq, wk, wv, wo, wg, wu, wd): one token through one "
     "layer, x updated in place, K/V row pos written"},
    {NULL, NULL, 0, NULL},
};
