/* Python bindings of csrc/kv_quant.c: quantized K/V rows and the attention that reads them. */
#include "memfit.h"
#include "ops.h"
#include "kv_quant.h"

#include <string.h>

static int kv_type_ok(long t) { return t == MF_KVT_F16 || t == MF_KVT_Q8_0 || t == MF_KVT_Q4_0 || t == MF_KVT_F32; }

/* a C-contiguous buffer whose format is `fmt` ('f' float32, 'i' int32, 'B' bytes: any format) */
static int getb(PyObject *o, Py_buffer *b, const char *fn, const char *name, char fmt, int writable) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: %s must be a C-contiguous%s array", fn, name, writable ? " writable" : "");
        return -1;
    }
    const char *f = b->format ? b->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    int ok = fmt == 'B' ? 1 : (b->itemsize == 4 && (f[0] == fmt || (fmt == 'i' && f[0] == 'l' && sizeof(long) == 4)) && !f[1]);
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be %s (got format '%s')", fn, name,
                     fmt == 'f' ? "float32" : "int32", b->format ? b->format : "B");
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

/* kv_quantize(x f32 [..., n], type, out u8 [..., row_bytes]): rows of x in the cache type */
static PyObject *py_kv_quantize(PyObject *self, PyObject *args) {
    PyObject *xo, *oo;
    long type;
    if (!PyArg_ParseTuple(args, "OlO:kv_quantize", &xo, &type, &oo)) return NULL;
    if (!kv_type_ok(type)) return PyErr_Format(PyExc_ValueError, "kv_quantize: unknown kv type %ld", type);
    Py_buffer x, o;
    if (getb(xo, &x, "kv_quantize", "x", 'f', 0) < 0) return NULL;
    if (getb(oo, &o, "kv_quantize", "out", 'B', 1) < 0) { PyBuffer_Release(&x); return NULL; }
    const int64_t n = x.ndim ? x.shape[x.ndim - 1] : 1, rows = n ? (int64_t)(x.len / 4) / n : 0;
    const int64_t rb = mf_kvq_row_bytes((int)type, n);
    if ((type == MF_KVT_Q8_0 || type == MF_KVT_Q4_0) && n % MF_KV_QK) {
        PyErr_Format(PyExc_ValueError, "kv_quantize: row length %lld is not a multiple of %d", (long long)n, MF_KV_QK);
    } else if (o.len != rows * rb) {
        PyErr_Format(PyExc_ValueError, "kv_quantize: out has %zd bytes, %lld rows of %lld need %lld", o.len,
                     (long long)rows, (long long)rb, (long long)(rows * rb));
    } else {
        Py_BEGIN_ALLOW_THREADS
        mf_kv_quantize((int)type, x.buf, o.buf, rows, n);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&o);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* kv_dequantize(raw u8, type, out f32 [..., n]) */
static PyObject *py_kv_dequantize(PyObject *self, PyObject *args) {
    PyObject *ro, *oo;
    long type;
    if (!PyArg_ParseTuple(args, "OlO:kv_dequantize", &ro, &type, &oo)) return NULL;
    if (!kv_type_ok(type)) return PyErr_Format(PyExc_ValueError, "kv_dequantize: unknown kv type %ld", type);
    Py_buffer r, o;
    if (getb(ro, &r, "kv_dequantize", "raw", 'B', 0) < 0) return NULL;
    if (getb(oo, &o, "kv_dequantize", "out", 'f', 1) < 0) { PyBuffer_Release(&r); return NULL; }
    const int64_t n = o.ndim ? o.shape[o.ndim - 1] : 1, rows = n ? (int64_t)(o.len / 4) / n : 0;
    const int64_t rb = mf_kvq_row_bytes((int)type, n);
    if ((type == MF_KVT_Q8_0 || type == MF_KVT_Q4_0) && n % MF_KV_QK) {
        PyErr_Format(PyExc_ValueError, "kv_dequantize: row length %lld is not a multiple of %d", (long long)n, MF_KV_QK);
    } else if (r.len != rows * rb) {
        PyErr_Format(PyExc_ValueError, "kv_dequantize: raw has %zd bytes, %lld rows of %lld need %lld", r.len,
                     (long long)rows, (long long)rb, (long long)(rows * rb));
    } else {
        Py_BEGIN_ALLOW_THREADS
        mf_kv_dequantize((int)type, r.buf, o.buf, rows, n);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&r);
    PyBuffer_Release(&o);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

/* sinks: None or float32 [Hq] into b (returns its pointer, NULL for None; -1 on error) */
static int get_sinks(PyObject *o, Py_buffer *b, const char *fn, int64_t Hq, const float **p) {
    *p = NULL;
    if (!o || o == Py_None) return 0;
    if (getb(o, b, fn, "sinks", 'f', 0) < 0) return -1;
    if (b->len != Hq * 4) {
        PyErr_Format(PyExc_ValueError, "%s: sinks must have one value per q head (%lld), got %zd", fn,
                     (long long)Hq, b->len / 4);
        PyBuffer_Release(b);
        return -1;
    }
    *p = b->buf;
    return 1;
}

/* attention_kvq(q, k, v, q_pos, kv_pos, scale, window, softcap, type_k, type_v, table, out, sinks=None) */
static PyObject *py_attention_kvq(PyObject *self, PyObject *args) {
    PyObject *qo, *ko, *vo, *qpo, *kpo, *to, *oo, *so = NULL;
    double scale, softcap;
    long long window;
    long tk, tv;
    if (!PyArg_ParseTuple(args, "OOOOOdLdllOO|O:attention_kvq", &qo, &ko, &vo, &qpo, &kpo, &scale, &window,
                          &softcap, &tk, &tv, &to, &oo, &so))
        return NULL;
    if (!kv_type_ok(tk) || !kv_type_ok(tv))
        return PyErr_Format(PyExc_ValueError, "attention_kvq: unknown kv types %ld, %ld", tk, tv);
    Py_buffer b[8];
    int nb = 0;
    const char *fn = "attention_kvq";
#define GET(o, name, fmt, w) do { if (getb(o, &b[nb], fn, name, fmt, w) < 0) goto fail; nb++; } while (0)
    /* v None: V inside K (each K row's first Dv values, type_v == type_k) */
    const int v_in_k = vo == Py_None;
    GET(qo, "q", 'f', 0);
    GET(ko, "k", 'B', 0);
    GET(v_in_k ? ko : vo, "v", 'B', 0);
    GET(qpo, "q_pos", 'i', 0);
    GET(kpo, "kv_pos", 'i', 0);
    GET(oo, "out", 'f', 1);
    Py_buffer *q = &b[0], *k = &b[1], *v = &b[2], *qp = &b[3], *kp = &b[4], *o = &b[5], *tb = NULL;
    if (to != Py_None) {
        GET(to, "table", 'i', 0);
        tb = &b[6];
    }
#undef GET
    if (q->ndim != 3 || k->ndim < 3 || v->ndim < 3 || o->ndim != 3) {
        PyErr_Format(PyExc_ValueError, "%s: q [n, Hq, D], out [n, Hq, Dv], k and v [..., Hkv, row bytes]", fn);
        goto fail;
    }
    const int64_t n = q->shape[0], Hq = q->shape[1], D = q->shape[2], Dv = o->shape[2];
    const int64_t Hkv = k->shape[k->ndim - 2], T = (int64_t)(kp->len / 4);
    const int64_t rbk = mf_kvq_row_bytes((int)tk, D), rbv = v_in_k ? rbk : mf_kvq_row_bytes((int)tv, Dv);
    if (v_in_k && (tv != tk || Dv > D || Dv < 1)) {
        PyErr_Format(PyExc_ValueError, "%s: V inside K (v None) needs type_v == type_k and 1 <= Dv <= D", fn);
        goto fail;
    }
    if (k->shape[k->ndim - 1] * k->itemsize != rbk || v->shape[v->ndim - 1] * v->itemsize != rbv ||
        v->shape[v->ndim - 2] != Hkv || ((tk == MF_KVT_Q8_0 || tk == MF_KVT_Q4_0) && D % MF_KV_QK) ||
        ((tv == MF_KVT_Q8_0 || tv == MF_KVT_Q4_0) && Dv % MF_KV_QK)) {
        PyErr_Format(PyExc_ValueError, "%s: k rows must be %lld bytes and v rows %lld (D=%lld, Dv=%lld; block types "
                     "need multiples of 32)", fn, (long long)rbk, (long long)rbv, (long long)D, (long long)Dv);
        goto fail;
    }
    if (Hkv == 0 || Hq % Hkv || D > MF_ATTN_MAX_DIM || Dv > MF_ATTN_MAX_DIM || o->shape[0] != n ||
        o->shape[1] != Hq || (int64_t)(qp->len / 4) != n) {
        PyErr_Format(PyExc_ValueError, "%s: inconsistent shapes (n=%lld Hq=%lld Hkv=%lld D=%lld Dv=%lld)", fn,
                     (long long)n, (long long)Hq, (long long)Hkv, (long long)D, (long long)Dv);
        goto fail;
    }
    const int64_t krows = k->len / (Hkv * rbk), vrows = v->len / (Hkv * rbv);
    const int32_t *qpos = qp->buf;
    if (tb) { /* one sequence in a pool of 32-row blocks: query i sees logical keys 0..q_pos[i] */
        const int32_t *t = tb->buf;
        const int64_t nt = tb->len / 4;
        if (nt * MF_KV_QK < T) {
            PyErr_Format(PyExc_ValueError, "%s: table has %lld blocks, %lld keys need %lld", fn, (long long)nt,
                         (long long)T, (long long)((T + MF_KV_QK - 1) / MF_KV_QK));
            goto fail;
        }
        for (int64_t j = 0; j < nt; j++)
            if (t[j] < 0 || ((int64_t)t[j] + 1) * MF_KV_QK > krows || ((int64_t)t[j] + 1) * MF_KV_QK > vrows) {
                PyErr_Format(PyExc_ValueError, "%s: table[%lld] = %d is outside the pool", fn, (long long)j, t[j]);
                goto fail;
            }
        for (int64_t i = 0; i < n; i++)
            if (qpos[i] < 0 || qpos[i] >= nt * MF_KV_QK) {
                PyErr_Format(PyExc_ValueError, "%s: q_pos[%lld] = %d is outside the table", fn, (long long)i, qpos[i]);
                goto fail;
            }
    } else if (krows < T || vrows < T) {
        PyErr_Format(PyExc_ValueError, "%s: k/v hold %lld/%lld rows, kv_pos has %lld", fn, (long long)krows,
                     (long long)vrows, (long long)T);
        goto fail;
    }
    {
        const float *sp;
        const int got = get_sinks(so, &b[nb], fn, Hq, &sp);
        if (got < 0) goto fail;
        nb += got;
        mf_attnq_args a = {.q = q->buf, .k = k->buf, .v = v_in_k ? NULL : v->buf, .out = o->buf, .q_pos = qp->buf,
                           .kv_pos = kp->buf, .tables = tb ? tb->buf : NULL, .q_tab = NULL, .bs = MF_KV_QK, .n = n, .T = T, .Hq = Hq,
                           .Hkv = Hkv, .D = D, .Dv = Dv, .scale = (float)scale, .softcap = (float)softcap,
                           .window = window, .type_k = (int)tk, .type_v = (int)tv, .sinks = sp};
        Py_BEGIN_ALLOW_THREADS
        mf_attention_kvq(&a);
        Py_END_ALLOW_THREADS
    }
    for (int i = 0; i < nb; i++) PyBuffer_Release(&b[i]);
    Py_INCREF(oo);
    return oo;
fail:
    for (int i = 0; i < nb; i++) PyBuffer_Release(&b[i]);
    return NULL;
}

/* attention_paged_kvq(q, K, V, type_k, type_v, q_pos, q_tab, tables, bs, scale, window, softcap,
 * out, sinks=None): csrc/bind_kv.c's attention_paged with a cache type for K and one for V */
static PyObject *py_attention_paged_kvq(PyObject *self, PyObject *args) {
    PyObject *qo, *ko, *vo, *qpo, *qto, *tbo, *oo, *so = NULL;
    long tk, tv;
    long long bs, window;
    double scale, softcap;
    if (!PyArg_ParseTuple(args, "OOOllOOOLdLdO|O:attention_paged_kvq", &qo, &ko, &vo, &tk, &tv, &qpo, &qto, &tbo,
                          &bs, &scale, &window, &softcap, &oo, &so))
        return NULL;
    if (!kv_type_ok(tk) || !kv_type_ok(tv))
        return PyErr_Format(PyExc_ValueError, "attention_paged_kvq: unknown kv types %ld, %ld", tk, tv);
    Py_buffer b[8];
    int nb = 0;
    const char *fn = "attention_paged_kvq";
    const int v_in_k = vo == Py_None; /* V inside K: each K row's first Dv values (type_v == type_k) */
    PyObject *objs[7] = {qo, ko, v_in_k ? ko : vo, qpo, qto, tbo, oo};
    static const char fmts[7] = {'f', 'B', 'B', 'i', 'i', 'i', 'f'};
    static const char *names[7] = {"q", "K", "V", "q_pos", "q_tab", "tables", "out"};
    for (; nb < 7; nb++)
        if (getb(objs[nb], &b[nb], fn, names[nb], fmts[nb], nb == 6) < 0) goto fail;
    {
        Py_buffer *q = &b[0], *k = &b[1], *v = &b[2], *qp = &b[3], *qt = &b[4], *tb = &b[5], *o = &b[6];
        if (q->ndim != 3 || o->ndim != 3 || k->ndim < 2 || v->ndim < 2) {
            PyErr_Format(PyExc_ValueError, "%s: q [n, Hq, D], out [n, Hq, Dv], K and V [rows, Hkv, row bytes]", fn);
            goto fail;
        }
        const int64_t n = q->shape[0], Hq = q->shape[1], D = q->shape[2], Dv = o->shape[2];
        const int64_t Hkv = k->shape[k->ndim - 2];
        const int64_t rbk = mf_kvq_row_bytes((int)tk, D), rbv = v_in_k ? rbk : mf_kvq_row_bytes((int)tv, Dv);
        if (v_in_k && (tv != tk || Dv > D || Dv < 1)) {
            PyErr_Format(PyExc_ValueError, "%s: V inside K (V None) needs type_v == type_k and 1 <= Dv <= D", fn);
            goto fail;
        }
        if (Hkv < 1 || Hq % Hkv || D > MF_ATTN_MAX_DIM || Dv > MF_ATTN_MAX_DIM || o->shape[0] != n ||
            o->shape[1] != Hq || qp->len != n * 4 || qt->len != n * 4 || bs < 1 || window < 0 || softcap < 0 ||
            k->shape[k->ndim - 1] * k->itemsize != rbk || v->shape[v->ndim - 1] * v->itemsize != rbv ||
            v->shape[v->ndim - 2] != Hkv || ((tk == MF_KVT_Q8_0 || tk == MF_KVT_Q4_0) && D % MF_KV_QK) ||
            ((tv == MF_KVT_Q8_0 || tv == MF_KVT_Q4_0) && Dv % MF_KV_QK)) {
            PyErr_Format(PyExc_ValueError, "%s: inconsistent shapes or arguments", fn);
            goto fail;
        }
        const int64_t rows = k->len / (Hkv * rbk), nt = tb->len / 4;
        if (v->len / (Hkv * rbv) != rows || rows % bs) {
            PyErr_Format(PyExc_ValueError, "%s: K and V must be pools of the same whole blocks", fn);
            goto fail;
        }
        const int32_t *p = qp->buf, *t = qt->buf, *tab = tb->buf;
        for (int64_t i = 0; i < nt; i++)
            if (tab[i] < 0 || tab[i] >= rows / bs) {
                PyErr_Format(PyExc_ValueError, "%s: a block table entry is outside the pool", fn);
                goto fail;
            }
        for (int64_t i = 0; i < n; i++)
            if (p[i] < 0 || t[i] < 0 || t[i] + p[i] / bs >= nt) {
                PyErr_Format(PyExc_ValueError, "%s: a row's position or table is outside tables", fn);
                goto fail;
            }
        const float *sp;
        const int got = get_sinks(so, &b[nb], fn, Hq, &sp);
        if (got < 0) goto fail;
        nb += got;
        mf_attnq_args a = {.q = q->buf, .k = k->buf, .v = v_in_k ? NULL : v->buf, .out = o->buf, .q_pos = p, .q_tab = t,
                           .tables = tab, .bs = bs, .n = n, .Hq = Hq, .Hkv = Hkv, .D = D, .Dv = Dv,
                           .scale = (float)scale, .softcap = (float)softcap, .window = window,
                           .type_k = (int)tk, .type_v = (int)tv, .sinks = sp};
        Py_BEGIN_ALLOW_THREADS
        mf_attention_kvq(&a);
        Py_END_ALLOW_THREADS
    }
    for (int i = 0; i < nb; i++) PyBuffer_Release(&b[i]);
    Py_INCREF(oo);
    return oo;
fail:
    for (int i = 0; i < nb; i++) PyBuffer_Release(&b[i]);
    return NULL;
}

PyMethodDef mf_kvq_methods[] = {
    {"attention_paged_kvq", py_attention_paged_kvq, METH_VARARGS,
     "attention_paged_kvq(q, K, V, type_k, type_v, q_pos, q_tab, tables, bs, scale, window, softcap, out, "
     "sinks=None) -> out: attention_paged with separate K and V cache types (f16, q8_0, q4_0), llama.cpp's numerics; "
     "V None: V inside K (each K row's first Dv values, type_v == type_k)"},
    {"kv_quantize", py_kv_quantize, METH_VARARGS,
     "kv_quantize(x f32 [..., n], type, out u8): rows of x in KV cache type (1 f16, 8 q8_0, 2 q4_0) as llama.cpp stores them"},
    {"kv_dequantize", py_kv_dequantize, METH_VARARGS,
     "kv_dequantize(raw u8, type, out f32 [..., n]): rows of a KV cache type back to float32"},
    {"attention_kvq", py_attention_kvq, METH_VARARGS,
     "attention_kvq(q[n,Hq,D] f32, k u8[..., Hkv, rbk], v u8[..., Hkv, rbv], q_pos i32[n], kv_pos i32[T], scale, "
     "window, softcap, type_k, type_v, table i32 | None, out f32[n,Hq,Dv], sinks=None) -> out: llama.cpp's CPU "
     "flash attention over K/V rows of the given cache types; with a table (one sequence in a pool of 32-row "
     "blocks), query i sees logical keys 0..q_pos[i], key t at row table[t//32]*32 + t%32 (kv_pos unused); "
     "sinks f32[Hq]: a logit per q head in the softmax denominator only (after the keys, as ggml); v None: V inside K "
     "(each K row's first Dv values, type_v == type_k)"},
    {NULL, NULL, 0, NULL},
};
