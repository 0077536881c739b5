/* Python bindings of csrc/ops.c: METH_FASTCALL, buffer protocol, GIL released around the work.
 * Every op takes an optional preallocated `out` (float32, C-contiguous, right shape) and
 * returns it; without one a fresh numpy array is made. */
#include "memfit.h"
#include "ops.h"

#include <string.h>

/* ---- argument parsing: positional or keyword, names in order ---------------------------- */

static int parse_args(const char *fn, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                      const char *const *names, int nreq, int nmax, PyObject **out) {
    for (int i = 0; i < nmax; i++) out[i] = NULL;
    if (nargs > nmax) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d arguments (%zd given)", fn, nmax, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) out[i] = args[i];
    const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        const char *key = PyUnicode_AsUTF8(PyTuple_GET_ITEM(kwnames, k));
        if (!key) return -1;
        int found = -1;
        for (int i = 0; i < nmax; i++)
            if (strcmp(key, names[i]) == 0) found = i;
        if (found < 0) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%s'", fn, key);
            return -1;
        }
        if (out[found]) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fn, key);
            return -1;
        }
        out[found] = args[nargs + k];
    }
    for (int i = 0; i < nreq; i++)
        if (!out[i]) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fn, names[i]);
            return -1;
        }
    for (int i = nreq; i < nmax; i++)
        if (out[i] == Py_None) out[i] = NULL;
    return 0;
}

/* ---- buffers ------------------------------------------------------------------------------ */

#define MAXBUF 8
typedef struct {
    Py_buffer b[MAXBUF];
    int n;
} bufs;

static void release(bufs *bs) {
    for (int i = 0; i < bs->n; i++) PyBuffer_Release(&bs->b[i]);
    bs->n = 0;
}

/* format string of a single native/little-endian scalar of kind c ('f' or 'i') */
static int fmt_is(const char *f, char c) {
    if (!f) return c == 'B';
    if (*f == '@' || *f == '=' || *f == '<') f++;
    if (c == 'i' && sizeof(long) == 4 && f[0] == 'l' && !f[1]) return 1;
    return f[0] == c && !f[1];
}

static const char *shape_str(const Py_buffer *b, char *s, size_t cap) {
    size_t k = (size_t)snprintf(s, cap, "(");
    for (int d = 0; d < b->ndim && k < cap; d++)
        k += (size_t)snprintf(s + k, cap - k, d ? ", %zd" : "%zd", b->shape[d]);
    if (k < cap) snprintf(s + k, cap - k, b->ndim == 1 ? ",)" : ")");
    return s;
}

/* Gets a C-contiguous buffer of float32 (kind 'f') or int32 (kind 'i') with ndim in
 * [ndmin, ndmax]; returns its pointer or NULL with an exception set. */
static Py_buffer *get_buf(bufs *bs, PyObject *o, const char *fn, const char *name, char kind,
                          int writable, int ndmin, int ndmax) {
    Py_buffer *b = &bs->b[bs->n];
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(o, b, flags) < 0) {
        PyErr_Clear();
        /* a buffer that exists but is strided or read-only is a ValueError; no buffer: TypeError */
        PyErr_Format(PyObject_CheckBuffer(o) ? PyExc_ValueError : PyExc_TypeError,
                     "%s: %s must be a C-contiguous%s %s array (got %.100s)", fn, name,
                     writable ? " writable" : "", kind == 'f' ? "float32" : "int32", Py_TYPE(o)->tp_name);
        return NULL;
    }
    bs->n++;
    /* kind 'k': float32 or float16 (a K/V cache) */
    const int ok = kind == 'k' ? (b->itemsize == 4 && fmt_is(b->format, 'f')) || (b->itemsize == 2 && fmt_is(b->format, 'e'))
                               : b->itemsize == 4 && fmt_is(b->format, kind);
    if (!ok) {
        const char *want = kind == 'f' ? "float32" : kind == 'k' ? "float32 or float16" : "int32";
        PyErr_Format(PyExc_TypeError, "%s: %s must have dtype %s (got buffer format '%s'); convert with "
                     "np.ascontiguousarray(x, dtype=np.%s)", fn, name, want,
                     b->format ? b->format : "B", kind == 'i' ? "int32" : "float32");
        return NULL;
    }
    if (b->ndim < ndmin || b->ndim > ndmax) {
        char s[128];
        if (ndmin == ndmax)
            PyErr_Format(PyExc_ValueError, "%s: %s must have %d dimensions, got shape %s", fn, name, ndmin,
                         shape_str(b, s, sizeof s));
        else
            PyErr_Format(PyExc_ValueError, "%s: %s must have at least %d dimension(s), got shape %s", fn,
                         name, ndmin, shape_str(b, s, sizeof s));
        return NULL;
    }
    return b;
}

static int same_shape(const Py_buffer *a, const Py_buffer *b) {
    if (a->ndim != b->ndim) return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d]) return 0;
    return 1;
}

static int check_same(const Py_buffer *ref, const Py_buffer *b, const char *fn, const char *rn, const char *bn) {
    if (same_shape(ref, b)) return 0;
    char s1[128], s2[128];
    PyErr_Format(PyExc_ValueError, "%s: %s must have the shape of %s %s, got %s", fn, bn, rn,
                 shape_str(ref, s1, sizeof s1), shape_str(b, s2, sizeof s2));
    return -1;
}

/* numpy.empty(shape, dtype=float32) through the Python API (no numpy headers at build time) */
static PyObject *np_empty_f32(int ndim, const Py_ssize_t *shape) {
    static PyObject *empty = NULL, *f32 = NULL;
    if (!empty) {
        PyObject *np = PyImport_ImportModule("numpy");
        if (!np) return NULL;
        empty = PyObject_GetAttrString(np, "empty");
        f32 = PyObject_GetAttrString(np, "float32");
        Py_DECREF(np);
        if (!empty || !f32) return NULL;
    }
    PyObject *t = PyTuple_New(ndim);
    if (!t) return NULL;
    for (int d = 0; d < ndim; d++) {
        PyObject *v = PyLong_FromSsize_t(shape[d]);
        if (!v) { Py_DECREF(t); return NULL; }
        PyTuple_SET_ITEM(t, d, v);
    }
    PyObject *a[2] = {t, f32};
    PyObject *r = PyObject_Vectorcall(empty, a, 2, NULL);
    Py_DECREF(t);
    return r;
}

/* Output: the caller's `out` (checked against shape) or a new array. Sets *res (new ref). */
static Py_buffer *get_out(bufs *bs, PyObject *out, const char *fn, int ndim, const Py_ssize_t *shape,
                          PyObject **res) {
    *res = NULL;
    PyObject *o = out;
    if (!o) {
        o = np_empty_f32(ndim, shape);
        if (!o) return NULL;
    } else {
        Py_INCREF(o);
    }
    Py_buffer *b = get_buf(bs, o, fn, "out", 'f', 1, ndim, ndim);
    if (!b) { Py_DECREF(o); return NULL; }
    for (int d = 0; d < ndim; d++)
        if (b->shape[d] != shape[d]) {
            char s1[128], s2[128];
            Py_buffer want = *b;
            want.shape = (Py_ssize_t *)shape;
            PyErr_Format(PyExc_ValueError, "%s: out must have shape %s, got %s", fn,
                         shape_str(&want, s1, sizeof s1), shape_str(b, s2, sizeof s2));
            Py_DECREF(o);
            return NULL;
        }
    *res = o;
    return b;
}

static int get_double(PyObject *o, const char *fn, const char *name, double *v) {
    *v = PyFloat_AsDouble(o);
    if (*v == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: %s must be a number (got %.100s)", fn, name, Py_TYPE(o)->tp_name);
        return -1;
    }
    return 0;
}

static int get_int(PyObject *o, const char *fn, const char *name, long long *v) {
    *v = PyLong_AsLongLong(o);
    if (*v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: %s must be an integer (got %.100s)", fn, name, Py_TYPE(o)->tp_name);
        return -1;
    }
    return 0;
}

static int64_t numel(const Py_buffer *b) { return (int64_t)(b->len / b->itemsize); }

/* ---- rmsnorm(x, weight, eps, out=None) ---------------------------------------------------- */

static PyObject *py_rmsnorm(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kw) {
    static const char *const names[] = {"x", "weight", "eps", "out"};
    const char *fn = "rmsnorm";
    PyObject *a[4], *res = NULL;
    bufs bs = {.n = 0};
    double eps;
    if (parse_args(fn, args, nargs, kw, names, 2, 4, a) < 0) return NULL;
    if (a[1] == Py_None) a[1] = NULL;
    if (!a[2]) { PyErr_Format(PyExc_TypeError, "%s() missing required argument 'eps'", fn); return NULL; }
    if (get_double(a[2], fn, "eps", &eps) < 0) return NULL;
    Py_buffer *x = get_buf(&bs, a[0], fn, "x", 'f', 0, 1, 64), *w = NULL, *o;
    if (!x) goto done;
    const int64_t d = x->shape[x->ndim - 1];
    if (a[1]) {
        if (!(w = get_buf(&bs, a[1], fn, "weight", 'f', 0, 1, 1))) goto done;
        if (w->shape[0] != d) {
            PyErr_Format(PyExc_ValueError, "%s: weight has %zd values but x rows have %lld", fn, w->shape[0],
                         (long long)d);
            goto done;
        }
    }
    if (d == 0) { PyErr_Format(PyExc_ValueError, "%s: x rows are empty", fn); goto done; }
    if (!(o = get_out(&bs, a[3], fn, x->ndim, x->shape, &res))) goto done;
    {
        const float *xp = x->buf, *wp = w ? w->buf : NULL;
        float *op = o->buf;
        const int64_t rows = numel(x) / d;
        Py_BEGIN_ALLOW_THREADS
        mf_rmsnorm_f32(xp, wp, op, rows, d, (float)eps);
        Py_END_ALLOW_THREADS
    }
    release(&bs);
    return res;
done:
    release(&bs);
    Py_XDECREF(res);
    return NULL;
}

/* ---- rope(x, pos, n_rot, theta_base, freq_scale, neox, freq_factors=None, out=None,
 *           ext_factor=0.0, attn_factor=1.0, corr_dims=(0.0, 0.0)) ----------------------- */

static PyObject *py_rope(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kw) {
    static const char *const names[] = {"x", "pos", "n_rot", "theta_base", "freq_scale", "neox",
                                        "freq_factors", "out", "ext_factor", "attn_factor", "corr_dims"};
    const char *fn = "rope";
    PyObject *a[11], *res = NULL;
    bufs bs = {.n = 0};
    long long n_rot;
    double base, fscale, ext = 0.0, attn = 1.0, corr[2] = {0.0, 0.0};
    int neox;
    if (parse_args(fn, args, nargs, kw, names, 6, 11, a) < 0) return NULL;
    if (get_int(a[2], fn, "n_rot", &n_rot) < 0 || get_double(a[3], fn, "theta_base", &base) < 0 ||
        get_double(a[4], fn, "freq_scale", &fscale) < 0)
        return NULL;
    if ((neox = PyObject_IsTrue(a[5])) < 0) return NULL;
    if ((a[8] && get_double(a[8], fn, "ext_factor", &ext) < 0) ||
        (a[9] && get_double(a[9], fn, "attn_factor", &attn) < 0))
        return NULL;
    if (a[10]) {
        PyObject *cd = PySequence_Fast(a[10], "rope: corr_dims must be a pair (lo, hi)");
        if (!cd) return NULL;
        const int ok = PySequence_Fast_GET_SIZE(cd) == 2 &&
                       get_double(PySequence_Fast_GET_ITEM(cd, 0), fn, "corr_dims[0]", &corr[0]) == 0 &&
                       get_double(PySequence_Fast_GET_ITEM(cd, 1), fn, "corr_dims[1]", &corr[1]) == 0;
        Py_DECREF(cd);
        if (!ok) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%s: corr_dims must be a pair (lo, hi)", fn);
            return NULL;
        }
    }
    Py_buffer *x = get_buf(&bs, a[0], fn, "x", 'f', 0, 3, 3), *pos, *ff = NULL, *o;
    if (!x) goto done;
    if (!(pos = get_buf(&bs, a[1], fn, "pos", 'i', 0, 1, 1))) goto done;
    const int64_t n = x->shape[0], heads = x->shape[1], hd = x->shape[2];
    if (pos->shape[0] != n) {
        PyErr_Format(PyExc_ValueError, "%s: pos has %zd positions but x has %lld rows", fn, pos->shape[0],
                     (long long)n);
        goto done;
    }
    if (n_rot <= 0 || n_rot % 2 || n_rot > hd || n_rot > MF_ROPE_MAX_ROT) {
        PyErr_Format(PyExc_ValueError, "%s: n_rot=%lld must be even, > 0 and <= head_dim (%lld) and <= %d", fn,
                     n_rot, (long long)hd, MF_ROPE_MAX_ROT);
        goto done;
    }
    if (!(base > 0.0) || !(fscale > 0.0)) {
        PyErr_Format(PyExc_ValueError, "%s: theta_base (%g) and freq_scale (%g) must be > 0", fn, base, fscale);
        goto done;
    }
    if (a[6]) {
        if (!(ff = get_buf(&bs, a[6], fn, "freq_factors", 'f', 0, 1, 1))) goto done;
        if (ff->shape[0] != n_rot / 2) {
            PyErr_Format(PyExc_ValueError, "%s: freq_factors must have n_rot/2 = %lld values, got %zd", fn,
                         n_rot / 2, ff->shape[0]);
            goto done;
        }
    }
    if (!(o = get_out(&bs, a[7], fn, 3, x->shape, &res))) goto done;
    {
        const float *xp = x->buf, *ffp = ff ? ff->buf : NULL;
        const int32_t *pp = pos->buf;
        float *op = o->buf;
        Py_BEGIN_ALLOW_THREADS
        mf_rope_yarn_f32(xp, op, pp, n, heads, hd, n_rot, base, fscale, neox, ffp, ext, attn, corr[0], corr[1]);
        Py_END_ALLOW_THREADS
    }
    release(&bs);
    return res;
done:
    release(&bs);
    Py_XDECREF(res);
    return NULL;
}

/* ---- softmax(x, out=None) ------------------------------------------------------------------ */

static PyObject *py_softmax(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kw) {
    static const char *const names[] = {"x", "out"};
    const char *fn = "softmax";
    PyObject *a[2], *res = NULL;
    bufs bs = {.n = 0};
    if (parse_args(fn, args, nargs, kw, names, 1, 2, a) < 0) return NULL;
    Py_buffer *x = get_buf(&bs, a[0], fn, "x", 'f', 0, 1, 64), *o;
    if (!x) goto done;
    const int64_t k = x->shape[x->ndim - 1];
    if (k == 0) { PyErr_Format(PyExc_ValueError, "%s: last axis of x is empty", fn); goto done; }
    if (!(o = get_out(&bs, a[1], fn, x->ndim, x->shape, &res))) goto done;
    {
        const float *xp = x->buf;
        float *op = o->buf;
        const int64_t rows = numel(x) / k;
        Py_BEGIN_ALLOW_THREADS
        mf_softmax_f32(xp, op, rows, k);
        Py_END_ALLOW_THREADS
    }
    release(&bs);
    return res;
done:
    release(&bs);
    Py_XDECREF(res);
    return NULL;
}

/* ---- elementwise float32 maps: fn(x, out=None) -> out (out may be x) ------------------- */
static PyObject *unary_f32(const char *fn, void (*op)(const float *, float *, int64_t),
                           PyObject *const *args, Py_ssize_t nargs, PyObject *kw) {
    static const char *const names[] = {"x", "out"};
    PyObject *a[2], *res = NULL;
    bufs bs = {.n = 0};
    if (parse_args(fn, args, nargs, kw, names, 1, 2, a) < 0) return NULL;
    Py_buffer *x = get_buf(&bs, a[0], fn, "x", 'f', 0, 1, 64), *o;
    if (!x) goto done;
    if (!(o = get_out(&bs, a[1], fn, x->ndim, x->shape, &res))) goto done;
    {
        const float *xp = x->buf;
        float *op_ = o->buf;
        const int64_t n = numel(x);
        Py_BEGIN_ALLOW_THREADS
        op(xp, op_, n);
        Py_END_ALLOW_THREADS
    }
    release(&bs);
    return res;
done:
    release(&bs);
    Py_XDECREF(res);
    return NULL;
}

/* sigmoid(x, out=None) */
static PyObject *py_sigmoid(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kw) {
    return unary_f32("sigmoid", mf_sigmoid_f32, args, nargs, kw);
}

/* ---- silu_mul(gate, up, out=None), gelu_mul(gate, up, out=None),
 *      swiglu_oai(gate, up, alpha=1.702, limit=7.0, out=None) ---------------------------------- */

enum { GATED_SILU, GATED_GELU, GATED_SWIGLU_OAI };

static PyObject *gated(const char *fn, int act, PyObject *const *args, Py_ssize_t nargs, PyObject *kw) {
    static const char *const names2[] = {"gate", "up", "out"};
    static const char *const names5[] = {"gate", "up", "alpha", "limit", "out"};
    const int oai = act == GATED_SWIGLU_OAI, n_names = oai ? 5 : 3;
    PyObject *a[5], *res = NULL;
    bufs bs = {.n = 0};
    double alpha = 1.702, limit = 7.0;
    if (parse_args(fn, args, nargs, kw, oai ? names5 : names2, 2, n_names, a) < 0) return NULL;
    if (oai && ((a[2] && get_double(a[2], fn, "alpha", &alpha) < 0) ||
                (a[3] && get_double(a[3], fn, "limit", &limit) < 0)))
        return NULL;
    Py_buffer *g = get_buf(&bs, a[0], fn, "gate", 'f', 0, 1, 64), *u, *o;
    if (!g) goto done;
    if (!(u = get_buf(&bs, a[1], fn, "up", 'f', 0, 1, 64))) goto done;
    if (check_same(g, u, fn, "gate", "up") < 0) goto done;
    if (!(o = get_out(&bs, a[n_names - 1], fn, g->ndim, g->shape, &res))) goto done;
    {
        const float *gp = g->buf, *up = u->buf;
        float *op = o->buf;
        const int64_t n = numel(g);
        Py_BEGIN_ALLOW_THREADS
        if (act == GATED_GELU)
            mf_gelu_mul_f32(gp, up, op, n);
        else if (act == GATED_SILU)
            mf_silu_mul_f32(gp, up, op, n);
        else
            mf_swiglu_oai_f32(gp, up, op, n, (float)alpha, (float)limit);
        Py_END_ALLOW_THREADS
    }
    release(&bs);
    return res;
done:
    release(&bs);
    Py_XDECREF(res);
    return NULL;
}

static PyObject *py_silu_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kw) {
    return gated("silu_mul", GATED_SILU, args, nargs, kw);
}

static PyObject *py_gelu_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kw) {
    return gated("gelu_mul", GATED_GELU, args, nargs, kw);
}

static PyObject *py_swiglu_oai(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kw) {
    return gated("swiglu_oai", GATED_SWIGLU_OAI, args, nargs, kw);
}

/* ---- fwht(x, n, scale, out=None): rows of n values times the Walsh-Hadamard matrix ------- */

static PyObject *py_fwht(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kw) {
    static const char *const names[] = {"x", "n", "scale", "out"};
    const char *fn = "fwht";
    PyObject *a[4], *res = NULL;
    bufs bs = {.n = 0};
    if (parse_args(fn, args, nargs, kw, names, 3, 4, a) < 0) return NULL;
    const long long n = PyLong_AsLongLong(a[1]);
    const double scale = PyFloat_AsDouble(a[2]);
    if (PyErr_Occurred()) return NULL;
    if (n < 1 || (n & (n - 1))) return PyErr_Format(PyExc_ValueError, "fwht: n must be a power of two, got %lld", n);
    Py_buffer *x = get_buf(&bs, a[0], fn, "x", 'f', 0, 1, 64), *o;
    if (!x) goto done;
    if (numel(x) % n) { PyErr_Format(PyExc_ValueError, "fwht: %lld values are not rows of %lld", (long long)numel(x), n); goto done; }
    if (!(o = get_out(&bs, a[3], fn, x->ndim, x->shape, &res))) goto done;
    {
        const float *xp = x->buf;
        float *op = o->buf;
        const int64_t rows = numel(x) / n;
        Py_BEGIN_ALLOW_THREADS
        mf_fwht_f32(xp, op, rows, n, (float)scale);
        Py_END_ALLOW_THREADS
    }
    release(&bs);
    return res;
done:
    release(&bs);
    return NULL;
}

/* ---- round_f16(x, out=None): x rounded to float16 precision, kept as float32 ------------- */
static PyObject *py_round_f16(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kw) {
    return unary_f32("round_f16", mf_round_f16_f32, args, nargs, kw);
}

/* ---- f32_to_f16(x, out): float16 bits, the K/V cache's store conversion ------------------ */

static PyObject *py_f32_to_f16(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "f32_to_f16(x float32, out float16) takes 2 arguments");
    bufs bs = {.n = 0};
    Py_buffer *x = get_buf(&bs, args[0], "f32_to_f16", "x", 'f', 0, 1, 64), *o;
    if (!x) goto done;
    if (!(o = get_buf(&bs, args[1], "f32_to_f16", "out", 'k', 1, 1, 64))) goto done;
    if (o->itemsize != 2 || o->len != x->len / 2) {
        PyErr_SetString(PyExc_ValueError, "f32_to_f16: out must be float16 with as many values as x");
        goto done;
    }
    {
        const float *xp = x->buf;
        uint16_t *op = o->buf;
        const int64_t n = numel(x);
        Py_BEGIN_ALLOW_THREADS
        mf_f32_to_f16(xp, op, n);
        Py_END_ALLOW_THREADS
    }
    release(&bs);
    Py_RETURN_NONE;
done:
    release(&bs);
    return NULL;
}

/* ---- attention(q, k, v, q_pos, kv_pos, scale, window=0, softcap=0.0, out=None, sinks=None) */

static PyObject *py_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kw) {
    static const char *const names[] = {"q", "k", "v", "q_pos", "kv_pos", "scale", "window", "softcap", "out",
                                        "sinks"};
    const char *fn = "attention";
    PyObject *a[10], *res = NULL;
    bufs bs = {.n = 0};
    double scale, softcap = 0.0;
    long long window = 0;
    char s1[128], s2[128];
    if (parse_args(fn, args, nargs, kw, names, 6, 10, a) < 0) return NULL;
    if (get_double(a[5], fn, "scale", &scale) < 0) return NULL;
    if (a[6] && get_int(a[6], fn, "window", &window) < 0) return NULL;
    if (a[7] && get_double(a[7], fn, "softcap", &softcap) < 0) return NULL;
    if (window < 0 || softcap < 0.0) {
        PyErr_Format(PyExc_ValueError, "%s: window (%lld) and softcap (%g) must be >= 0 (0 = off)", fn, window,
                     softcap);
        return NULL;
    }
    Py_buffer *q = get_buf(&bs, a[0], fn, "q", 'f', 0, 3, 3), *k, *v, *qp, *kp, *o, *sk = NULL;
    if (!q) goto done;
    if (!(k = get_buf(&bs, a[1], fn, "k", 'k', 0, 3, 3))) goto done;
    if (!(v = get_buf(&bs, a[2], fn, "v", 'k', 0, 3, 3))) goto done;
    if (k->itemsize != v->itemsize) {
        PyErr_Format(PyExc_TypeError, "%s: k and v must have the same dtype (float32 or float16)", fn);
        goto done;
    }
    if (!(qp = get_buf(&bs, a[3], fn, "q_pos", 'i', 0, 1, 1))) goto done;
    if (!(kp = get_buf(&bs, a[4], fn, "kv_pos", 'i', 0, 1, 1))) goto done;
    const int64_t n = q->shape[0], Hq = q->shape[1], D = q->shape[2];
    const int64_t T = k->shape[0], Hkv = k->shape[1], Dv = v->shape[2];
    if (k->shape[2] != D || v->shape[0] != T || v->shape[1] != Hkv) {
        PyErr_Format(PyExc_ValueError, "%s: k must be [T, Hkv, D=%lld] and v [T, Hkv, Dv]; got k %s, v %s", fn,
                     (long long)D, shape_str(k, s1, sizeof s1), shape_str(v, s2, sizeof s2));
        goto done;
    }
    if (Hkv == 0 || Hq % Hkv) {
        PyErr_Format(PyExc_ValueError, "%s: q heads (%lld) must be a multiple of kv heads (%lld)", fn,
                     (long long)Hq, (long long)Hkv);
        goto done;
    }
    if (D > MF_ATTN_MAX_DIM || Dv > MF_ATTN_MAX_DIM) {
        PyErr_Format(PyExc_ValueError, "%s: head dims D=%lld, Dv=%lld exceed the supported %d", fn, (long long)D,
                     (long long)Dv, MF_ATTN_MAX_DIM);
        goto done;
    }
    if (qp->shape[0] != n || kp->shape[0] != T) {
        PyErr_Format(PyExc_ValueError, "%s: q_pos must have n=%lld and kv_pos T=%lld values; got %zd and %zd", fn,
                     (long long)n, (long long)T, qp->shape[0], kp->shape[0]);
        goto done;
    }
    if (a[9]) {
        if (!(sk = get_buf(&bs, a[9], fn, "sinks", 'f', 0, 1, 1))) goto done;
        if (sk->shape[0] != Hq) {
            PyErr_Format(PyExc_ValueError, "%s: sinks must have one value per q head (%lld), got %zd", fn,
                         (long long)Hq, sk->shape[0]);
            goto done;
        }
    }
    Py_ssize_t oshape[3] = {n, Hq, Dv};
    if (!(o = get_out(&bs, a[8], fn, 3, oshape, &res))) goto done;
    {
        mf_attn_args at = {.q = q->buf, .k = k->buf, .v = v->buf, .out = o->buf, .q_pos = qp->buf,
                           .kv_pos = kp->buf, .n = n, .T = T, .Hq = Hq, .Hkv = Hkv, .D = D, .Dv = Dv,
                           .scale = (float)scale, .softcap = (float)softcap, .window = window,
                           .kv_f16 = k->itemsize == 2, .sinks = sk ? sk->buf : NULL};
        Py_BEGIN_ALLOW_THREADS
        mf_attention_f32(&at);
        Py_END_ALLOW_THREADS
    }
    release(&bs);
    return res;
done:
    release(&bs);
    Py_XDECREF(res);
    return NULL;
}

#define FC (METH_FASTCALL | METH_KEYWORDS)
PyMethodDef mf_ops_methods[] = {
    {"rmsnorm", (PyCFunction)(void (*)(void))py_rmsnorm, FC,
     "rmsnorm(x[..., d] f32, weight[d] f32 | None, eps, out=None) -> out: x / sqrt(mean(x^2) + eps) * weight"},
    {"rope", (PyCFunction)(void (*)(void))py_rope, FC,
     "rope(x[n, heads, head_dim] f32, pos[n] i32, n_rot, theta_base, freq_scale, neox, freq_factors=None, "
     "out=None, ext_factor=0.0, attn_factor=1.0, corr_dims=(0.0, 0.0)) -> out\ntheta_i = pos * freq_scale * "
     "theta_base^(-2i/n_rot) / freq_factors[i]; normal rotates (2i, 2i+1), neox (i, i + n_rot/2); dims >= n_rot "
     "pass through. out may be x. ext_factor != 0: YaRN (ggml's rope_yarn) mixes in the unscaled angle by "
     "ramp_i = (1 - clamp((i - lo) / max(0.001, hi - lo), 0, 1)) * ext_factor and scales cos/sin by "
     "attn_factor * (1 + 0.1 ln(1/freq_scale)); else by attn_factor."},
    {"softmax", (PyCFunction)(void (*)(void))py_softmax, FC,
     "softmax(x[..., k] f32, out=None) -> out: softmax over the last axis. out may be x."},
    {"sigmoid", (PyCFunction)(void (*)(void))py_sigmoid, FC,
     "sigmoid(x f32, out=None) -> 1 / (1 + exp(-x)) (scalar expf; the routers' gates). out may be x."},
    {"round_f16", (PyCFunction)(void (*)(void))py_round_f16, FC,
     "round_f16(x f32, out=None) -> out: x rounded to the nearest float16 (ties to even), as float32. out may be x."},
    {"silu_mul", (PyCFunction)(void (*)(void))py_silu_mul, FC,
     "silu_mul(gate f32, up f32 (same shape), out=None) -> silu(gate) * up"},
    {"gelu_mul", (PyCFunction)(void (*)(void))py_gelu_mul, FC,
     "gelu_mul(gate f32, up f32 (same shape), out=None) -> gelu_tanh(gate) * up"},
    {"swiglu_oai", (PyCFunction)(void (*)(void))py_swiglu_oai, FC,
     "swiglu_oai(gate f32, up f32 (same shape), alpha=1.702, limit=7.0, out=None) -> gpt-oss's clamped SwiGLU: "
     "x = min(gate, limit), y = clip(up, -limit, limit), x / (1 + exp(-alpha x)) * (y + 1). out may be gate."},
    {"fwht", (PyCFunction)(void (*)(void))py_fwht, FC,
     "fwht(x f32, n, scale, out=None) -> each row of n values (a power of two) scaled, then times "
     "the Sylvester Walsh-Hadamard matrix (butterflies; a row's bits never depend on the others)"},
    {"f32_to_f16", (PyCFunction)(void (*)(void))py_f32_to_f16, METH_FASTCALL,
     "f32_to_f16(x f32, out f16): out = x rounded to float16 (ties to even), as x.astype(float16)"},
    {"attention", (PyCFunction)(void (*)(void))py_attention, FC,
     "attention(q[n, Hq, D], k[T, Hkv, D], v[T, Hkv, Dv] (k, v: both float32 or both float16), "
     "q_pos[n] i32, kv_pos[T] i32, scale, window=0, "
     "softcap=0.0, out=None, sinks=None) -> out[n, Hq, Dv]\nkey t visible to query i iff kv_pos[t] <= q_pos[i] and "
     "(window == 0 or q_pos[i] - kv_pos[t] < window); score = scale * q.k, softcap * tanh(score / softcap) "
     "when softcap > 0; GQA: q head h uses kv head h // (Hq // Hkv). sinks f32[Hq]: a logit per q head in the "
     "softmax denominator only (not scaled, not capped, no value). A query with no visible key gets 0. "
     "out must not overlap the inputs."},
    {NULL, NULL, 0, NULL},
};
