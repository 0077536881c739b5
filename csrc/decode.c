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

int mf_matmul_multi_ex(int k, const int *types, const uint8_t *const *ws, const int64_t *rows,
                       int64_t cols, const float *x, int64_t n, float *const *ys, int vec_only);

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

static float *scratch(size_t n) {
    if (n > sc_cap) {
        free(sc_buf);
        sc_buf = aligned_alloc(64, ((n * sizeof(float)) + 63) & ~(size_t)63);
        sc_cap = sc_buf ? n : 0;
    }
    return sc_buf;
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

/* The layer (see the file comment) for n rows, each a decode token of its own sequence (or any
 * causal rows). Matmuls keep the one-row kernels (vec_only), so a row's result does not depend
 * on the others. Returns 0, -3 out of memory, -4 unsupported kv type, or a matmul error code. */
static int run_layer(const layer_t *L, float *x, int64_t n, const kvref_t *kv, const uint8_t *const *w) {
    const int64_t E = L->n_embd, qd = L->n_head * L->dk, kd = L->n_head_kv * L->dk,
                  vd = L->n_head_kv * L->dv, ad = L->n_head * L->dv, F = L->n_ff;
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
    if (vec[V_Q_NORM]) mf_rmsnorm_f32(q, vec[V_Q_NORM], q, n * L->n_head, L->dk, L->eps);
    if (vec[V_K_NORM]) mf_rmsnorm_f32(k, vec[V_K_NORM], k, n * L->n_head_kv, L->dk, L->eps);
    mf_rope_f32(q, q, kv->pos, n, L->n_head, L->dk, L->n_rot, L->rope_base, L->freq_scale, L->neox,
                vec[V_FREQ]);
    mf_rope_f32(k, k, kv->pos, n, L->n_head_kv, L->dk, L->n_rot, L->rope_base, L->freq_scale, L->neox,
                vec[V_FREQ]);
    if (mf_kv_store(kv->kv_type, kv->K, kv->slots, k, n, kd) || mf_kv_store(kv->kv_type, kv->V, kv->slots, v, n, vd))
        return -4;
    mf_paged_args at = {.q = q, .k = kv->K, .v = kv->V, .out = att, .q_pos = kv->pos, .q_tab = kv->q_tab,
                        .tables = kv->tables, .n = n, .Hq = L->n_head, .Hkv = L->n_head_kv, .D = L->dk,
                        .Dv = L->dv, .bs = kv->bs, .scale = L->attn_scale, .softcap = L->softcap,
                        .window = L->window, .kv_type = kv->kv_type};
    if (mf_attention_paged(&at)) return -4;
    {
        float *ys[1] = {o};
        if ((rc = mf_matmul_multi_ex(1, &L->types[W_O], &w[W_O], &L->rows[W_O], ad, att, n, ys, 1))) return rc;
    }
    if (vec[V_BO]) add_rows(o, vec[V_BO], n, E);
    if (vec[V_POST_ATTN]) mf_rmsnorm_f32(o, vec[V_POST_ATTN], o, n, E, L->eps);
    add_rows(x, o, 1, n * E);

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

/* the 7 weight buffers a[0..6], checked against the layer's shapes; *got of them held */
static const char *get_weights(const layer_t *L, PyObject *const *a, Py_buffer *w, int *got) {
    while (*got < NW) {
        if (PyObject_GetBuffer(a[*got], &w[*got], PyBUF_C_CONTIGUOUS) < 0) return "";
        (*got)++;
        if (w[*got - 1].len < wbytes(L->types[*got - 1], L->rows[*got - 1], L->cols[*got - 1]))
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
    if (rc) return PyErr_Format(PyExc_ValueError, "decode_layer: native kernel failed (%d)", rc);
    Py_RETURN_NONE;
}

/* decode_layer(layer, x, pos, K, V, kv_f16, w*7): one token, contiguous K/V [n_ctx, Hkv, D]. */
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
    if (!bad) bad = get_weights(L, a + 6, w, &got);
    if (!bad) {
        const uint8_t *wp[NW];
        for (int j = 0; j < NW; j++) wp[j] = w[j].buf;
        const int32_t p32 = (int32_t)pos, zero = 0;
        /* one block as long as the arrays: logical row t is physical row t */
        kvref_t kv = {.K = K.buf, .V = V.buf, .kv_type = kv_f16 ? MF_KV_F16 : MF_KV_F32, .pos = &p32,
                      .slots = &p32, .q_tab = &zero, .tables = &zero, .bs = INT32_MAX};
        Py_BEGIN_ALLOW_THREADS
        rc = run_layer(L, x.buf, 1, &kv, wp);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&K);
    PyBuffer_Release(&V);
    return finish(bad, rc, w, got);
}

/* an int32 C-contiguous buffer of at least `min` values */
static int i32_buffer(PyObject *o, Py_buffer *b, const char *what) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    const char *f = b->format ? b->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (b->itemsize != 4 || (strcmp(f, "i") != 0 && strcmp(f, "l") != 0)) {
        PyErr_Format(PyExc_TypeError, "decode_batch: %s must be int32", what);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

/* decode_batch(layer, x[n, E], pos, slots, q_tab, tables, bs, kv_type, K, V, w*7):
 * n rows through one layer, K/V pools of physical rows, paged addressing as mf_paged_args. */
static PyObject *py_decode_batch(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    if (na != 10 + NW)
        return PyErr_Format(PyExc_TypeError, "decode_batch(layer, x, pos, slots, q_tab, tables, bs, kv_type, K, V, "
                            "wq, wk, wv, wo, wg, wu, wd)");
    layer_t *L = PyCapsule_GetPointer(a[0], CAPSULE);
    if (!L) return NULL;
    long long bs = PyLong_AsLongLong(a[6]), kv_type = PyLong_AsLongLong(a[7]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer x, ib[4], K, V, w[NW];
    int nb = 0, got = 0, rc = 0, have_k = 0, have_v = 0;
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
    int64_t n = 0;
    if (!bad) {
        n = x.len / 4 / L->n_embd;
        const int64_t rows = K.len / rbk, nt = ib[3].len / 4;
        const int32_t *pos = ib[0].buf, *slots = ib[1].buf, *qt = ib[2].buf, *tab = ib[3].buf;
        if (n < 1 || x.len != n * L->n_embd * 4) bad = "x must be [n, n_embd]";
        else if (ib[0].len != n * 4 || ib[1].len != n * 4 || ib[2].len != n * 4) bad = "pos, slots and q_tab need n values";
        else if (bs < 1 || rows % bs || V.len / rbv != rows) bad = "K and V must hold the same whole blocks of bs rows";
        for (int64_t i = 0; !bad && i < nt; i++)
            if (tab[i] < 0 || tab[i] >= rows / bs) bad = "a block table entry is outside the pool";
        for (int64_t i = 0; !bad && i < n; i++)
            if (pos[i] < 0 || slots[i] < 0 || slots[i] >= rows || qt[i] < 0 || qt[i] + pos[i] / bs >= nt)
                bad = "a row's position, slot or table lies outside the pool";
    }
    if (!bad) bad = get_weights(L, a + 10, w, &got);
    if (!bad) {
        const uint8_t *wp[NW];
        for (int j = 0; j < NW; j++) wp[j] = w[j].buf;
        kvref_t kv = {.K = K.buf, .V = V.buf, .kv_type = (int)kv_type, .pos = ib[0].buf, .slots = ib[1].buf,
                      .q_tab = ib[2].buf, .tables = ib[3].buf, .bs = bs};
        Py_BEGIN_ALLOW_THREADS
        rc = run_layer(L, x.buf, n, &kv, wp);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&x);
    for (int i = 0; i < nb; i++) PyBuffer_Release(&ib[i]);
    if (have_k) PyBuffer_Release(&K);
    if (have_v) PyBuffer_Release(&V);
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
             *d = names_tuple(vec_names, NV), *r = NULL;
    if (a && b && c && d) r = PyTuple_Pack(4, a, b, c, d);
    Py_XDECREF(a); Py_XDECREF(b); Py_XDECREF(c); Py_XDECREF(d);
    return r;
}

PyMethodDef mf_decode_methods[] = {
    {"decode_layer_fields", py_decode_layer_fields, METH_NOARGS,
     "decode_layer_fields() -> (ints, floats, weights, vecs): names of decode_layer_new's slots, in order"},
    {"decode_layer_new", (PyCFunction)(void (*)(void))py_decode_layer_new, METH_FASTCALL,
     "decode_layer_new(ints, floats, vecs) -> layer: a prepared decoder layer (see csrc/decode.c)"},
    {"decode_layer", (PyCFunction)(void (*)(void))py_decode_layer, METH_FASTCALL,
     "decode_layer(layer, x[n_embd], pos, K, V, kv_f16, wq, wk, wv, wo, wg, wu, wd): one token through one "
     "layer, x updated in place, K/V row pos written"},
    {"decode_batch", (PyCFunction)(void (*)(void))py_decode_batch, METH_FASTCALL,
     "decode_batch(layer, x[n, n_embd], pos, slots, q_tab, tables (int32), bs, kv_type, K, V, wq, wk, wv, wo, wg, "
     "wu, wd): n rows through one layer over a paged KV pool; x updated in place, K/V rows slots written"},
    {NULL, NULL, 0, NULL},
};
