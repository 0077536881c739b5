/* Python bindings of the paged KV kernels (ops.h): attention_paged and kv_store.
 *
 *   attention_paged(q[n, Hq, D] f32 (rounded in place for the cache type), K, V (pools of
 *                   physical rows; V None: V inside K, Dv from out), kv_type, q_pos, q_tab,
 *                   tables (int32), bs, scale, window, softcap, out[n, Hq, Dv] f32,
 *                   sinks=None (f32 [Hq]))
 *   kv_store(kv_type, pool, rows int32[n], x[n, elems] f32)
 * Shapes are checked here; the kernels trust them. */
#include "memfit.h"
#include "ops.h"

#include <string.h>

static int get(PyObject *o, Py_buffer *b, int writable, char fmt, const char *what) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    const char *f = b->format ? b->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    int ok = fmt == 'f' ? (strcmp(f, "f") == 0 && b->itemsize == 4)
           : fmt == 'i' ? ((strcmp(f, "i") == 0 || strcmp(f, "l") == 0) && b->itemsize == 4)
                        : 1; /* any bytes */
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s must be %s, C-contiguous%s", what,
                     fmt == 'f' ? "float32" : "int32", writable ? " and writable" : "");
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

/* sinks: the 13th positional or the keyword `sinks`; None or float32 [Hq] */
static int sinks_arg(PyObject *const *a, Py_ssize_t na, PyObject *kw, PyObject **sinks) {
    *sinks = na == 13 ? a[12] : NULL;
    const Py_ssize_t nkw = kw ? PyTuple_GET_SIZE(kw) : 0;
    for (Py_ssize_t i = 0; i < nkw; i++) {
        const char *key = PyUnicode_AsUTF8(PyTuple_GET_ITEM(kw, i));
        if (!key) return -1;
        if (strcmp(key, "sinks") != 0 || *sinks) {
            PyErr_Format(PyExc_TypeError, "attention_paged: unexpected keyword or repeated argument '%s'", key);
            return -1;
        }
        *sinks = a[na + i];
    }
    if (*sinks == Py_None) *sinks = NULL;
    return 0;
}

static PyObject *py_attention_paged(PyObject *self, PyObject *const *a, Py_ssize_t na, PyObject *kw) {
    if (na != 12 && na != 13)
        return PyErr_Format(PyExc_TypeError, "attention_paged(q, K, V, kv_type, q_pos, q_tab, tables, bs, scale, "
                            "window, softcap, out, sinks=None)");
    PyObject *so;
    if (sinks_arg(a, na, kw, &so) < 0) return NULL;
    Py_buffer b[8];
    int nb = 0;
    const char *bad = NULL;
    long long kv_type = PyLong_AsLongLong(a[3]), bs = PyLong_AsLongLong(a[7]), window = PyLong_AsLongLong(a[9]);
    double scale = PyFloat_AsDouble(a[8]), softcap = PyFloat_AsDouble(a[10]);
    if (PyErr_Occurred()) return NULL;
    static const int idx[8] = {0, 1, 2, 4, 5, 6, 11, -1};
    static const char fmts[8] = {'f', 'b', 'b', 'i', 'i', 'i', 'f', 'f'};
    static const int wr[8] = {1, 0, 0, 0, 0, 0, 1, 0};
    static const char *names[8] = {"q", "K", "V", "q_pos", "q_tab", "tables", "out", "sinks"};
    const int nbuf = so ? 8 : 7, v_in_k = a[2] == Py_None; /* V None: V inside K */
    for (; nb < nbuf; nb++) {
        if (nb == 2 && v_in_k) { memset(&b[nb], 0, sizeof b[nb]); continue; }
        if (get(nb == 7 ? so : a[idx[nb]], &b[nb], wr[nb], fmts[nb], names[nb]) < 0) { bad = ""; break; }
    }
    if (!bad) {
        Py_buffer *q = &b[0], *K = &b[1], *V = v_in_k ? NULL : &b[2], *qp = &b[3], *qt = &b[4], *tab = &b[5],
                  *out = &b[6];
        if (q->ndim != 3 || out->ndim != 3 || K->ndim != 3 || (V && V->ndim != 3)) bad = "q, K, V and out must be 3-D";
        else {
            const int64_t n = q->shape[0], Hq = q->shape[1], D = q->shape[2], Hkv = K->shape[1],
                          Dv = V ? V->shape[2] : out->shape[2];
            const int64_t rows = K->shape[0], rbk = mf_kv_row_bytes((int)kv_type, Hkv * D),
                          rbv = mf_kv_row_bytes((int)kv_type, Hkv * Dv), nt = tab->len / 4;
            const int32_t *p = qp->buf, *t = qt->buf, *tb = tab->buf;
            if (rbk == 0 || rbv == 0) bad = "unsupported KV cache type";
            else if (Hkv < 1 || Hq % Hkv || D > MF_ATTN_MAX_DIM || Dv > MF_ATTN_MAX_DIM) bad = "bad head shapes";
            else if (!V && (Dv > D || Dv < 1 || mf_kv_row_bytes((int)kv_type, Dv) == 0))
                bad = "V inside K needs 1 <= Dv <= D (whole blocks of the cache type)";
            else if (K->len != rows * rbk || (V && (V->shape[0] != rows || V->shape[1] != Hkv || V->len != rows * rbv)))
                bad = "K and V must be [rows, Hkv, D] pools of the cache type";
            else if (out->shape[0] != n || out->shape[1] != Hq || out->shape[2] != Dv) bad = "out must be [n, Hq, Dv]";
            else if (qp->len != n * 4 || qt->len != n * 4) bad = "q_pos and q_tab need n values";
            else if (bs < 1 || rows % bs || window < 0 || softcap < 0) bad = "bad bs, window or softcap";
            else if (so && b[7].len != Hq * 4) bad = "sinks must be float32 [Hq]";
            for (int64_t i = 0; !bad && i < nt; i++)
                if (tb[i] < 0 || tb[i] >= rows / bs) bad = "a block table entry is outside the pool";
            for (int64_t i = 0; !bad && i < n; i++)
                if (p[i] < 0 || t[i] < 0 || t[i] + p[i] / bs >= nt) bad = "a row's position or table is outside tables";
            if (!bad) {
                mf_paged_args at = {.q = q->buf, .k = K->buf, .v = V ? V->buf : NULL, .out = out->buf, .q_pos = p, .q_tab = t,
                                    .tables = tb, .n = n, .Hq = Hq, .Hkv = Hkv, .D = D, .Dv = Dv, .bs = bs,
                                    .scale = (float)scale, .softcap = (float)softcap, .window = window,
                                    .kv_type = (int)kv_type, .sinks = so ? b[7].buf : NULL};
                Py_BEGIN_ALLOW_THREADS
                mf_attention_paged(&at);
                Py_END_ALLOW_THREADS
            }
        }
    }
    for (int i = 0; i < nb; i++)
        if (!(i == 2 && v_in_k)) PyBuffer_Release(&b[i]);
    if (bad && *bad) return PyErr_Format(PyExc_ValueError, "attention_paged: %s", bad);
    if (bad) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_kv_store(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    if (na != 4) return PyErr_Format(PyExc_TypeError, "kv_store(kv_type, pool, rows, x)");
    long long kv_type = PyLong_AsLongLong(a[0]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer pool, rows, x;
    if (get(a[1], &pool, 1, 'b', "pool") < 0) return NULL;
    if (get(a[2], &rows, 0, 'i', "rows") < 0) { PyBuffer_Release(&pool); return NULL; }
    if (get(a[3], &x, 0, 'f', "x") < 0) { PyBuffer_Release(&pool); PyBuffer_Release(&rows); return NULL; }
    const char *bad = NULL;
    const int64_t n = rows.len / 4, elems = n ? x.len / 4 / n : 0, rb = mf_kv_row_bytes((int)kv_type, elems);
    const int32_t *r = rows.buf;
    if (n && (rb == 0 || x.len != n * elems * 4 || pool.len % rb)) bad = "x must be [n, row] and pool whole rows of the cache type";
    for (int64_t i = 0; !bad && i < n; i++)
        if (r[i] < 0 || r[i] >= pool.len / rb) bad = "a row is outside the pool";
    if (!bad && n) {
        Py_BEGIN_ALLOW_THREADS
        mf_kv_store((int)kv_type, pool.buf, r, x.buf, n, elems);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&pool);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&x);
    if (bad) return PyErr_Format(PyExc_ValueError, "kv_store: %s", bad);
    Py_RETURN_NONE;
}

/* attn_numerics(mode=None) -> the mode before: "llama" (an f16 cache in llama.cpp's flash
 * attention order, f16 accumulator) or "f32" (f32 accumulation) */
static PyObject *py_attn_numerics(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    if (na > 1) return PyErr_Format(PyExc_TypeError, "attn_numerics(mode=None)");
    PyObject *before = PyUnicode_FromString(mf_attn_ggml_fa ? "llama" : "f32");
    if (na == 1 && a[0] != Py_None) {
        const char *m = PyUnicode_AsUTF8(a[0]);
        if (!m) { Py_XDECREF(before); return NULL; }
        if (strcmp(m, "llama") && strcmp(m, "f32")) {
            Py_XDECREF(before);
            return PyErr_Format(PyExc_ValueError, "attn_numerics: mode must be 'llama' or 'f32', got '%s'", m);
        }
        mf_attn_ggml_fa = strcmp(m, "llama") == 0;
    }
    return before;
}

PyMethodDef mf_kv_methods[] = {
    {"attn_numerics", (PyCFunction)(void (*)(void))py_attn_numerics, METH_FASTCALL,
     "attn_numerics(mode=None) -> mode before: 'llama' (f16 cache in llama.cpp's flash-attention order) or 'f32'"},
    {"attention_paged", (PyCFunction)(void (*)(void))py_attention_paged, METH_FASTCALL | METH_KEYWORDS,
     "attention_paged(q, K, V, kv_type, q_pos, q_tab, tables, bs, scale, window, softcap, out, sinks=None): causal "
     "attention over a paged KV pool (see csrc/ops.h mf_paged_args; V None: each K row's first Dv values, Dv from "
     "out); q is rounded in place for the cache type; "
     "sinks f32[Hq]: a logit per q head in the softmax denominator only"},
    {"kv_store", (PyCFunction)(void (*)(void))py_kv_store, METH_FASTCALL,
     "kv_store(kv_type, pool, rows int32[n], x f32[n, row]): x converted to the cache type into pool rows"},
    {NULL, NULL, 0, NULL},
};
