/* Python bindings for the quant kernels: raw buffers in, caller-allocated f32 out, GIL released.
 *   dequantize(type, src, n, out)                   out: f32[n]
 *   matmul(type, w, rows, cols, x, n, out)          x: f32[n, cols], out: f32[n, rows]; the
 *                                                  prefill kernels (quant_mm.c) for any n
 *   get_rows(type, w, rows, cols, ids, out)         ids: int64[k], out: f32[k, cols]
 *   matmul_multi(x, n, cols, type1, w1, rows1, out1, ...)  1..4 weights sharing x (prefill)
 *   matmul_rows(same as matmul_multi)              the decode kernels (one-row vec-dots) for any n
 *   matmul_heads(type, w, H, rows, cols, x, n, out, decode)  x: f32[n, H, cols], out: f32[n, H, rows],
 *                                                  head h by the h-th (rows, cols) matrix of w
 * In both modes a row of out depends only on its x row (batch invariance). */
#include "memfit.h"
#include "quant_common.h"

#include <string.h>

int mf_matmul(int type, const uint8_t *w, int64_t rows, int64_t cols, const float *x, int64_t n, float *y);
int mf_matmul_multi(int k, const int *types, const uint8_t *const *ws, const int64_t *rows,
                    int64_t cols, const float *x, int64_t n, float *const *ys);
int mf_matmul_multi_ex(int k, const int *types, const uint8_t *const *ws, const int64_t *rows,
                       int64_t cols, const float *x, int64_t n, float *const *ys, int vec_only);
int mf_matmul_heads(int type, const uint8_t *w, int64_t H, int64_t rows, int64_t cols, const float *x,
                    int64_t n, float *y, int mode);
int mf_get_rows(int type, const uint8_t *w, int64_t cols, const int64_t *ids, int64_t n, float *out);
int mf_dequantize(int type, const uint8_t *src, int64_t n, float *dst);

static int get_buf(PyObject *o, Py_buffer *v, int writable, const char *what) {
    if (PyObject_GetBuffer(o, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous%s buffer", what, writable ? " writable" : "");
        return -1;
    }
    return 0;
}

/* x and out are float32 arrays: refuse e.g. a float64 out that would be silently half-filled */
static int get_f32(PyObject *o, Py_buffer *v, int writable, const char *what) {
    if (get_buf(o, v, writable, what) < 0) return -1;
    const char *f = v->format ? v->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (strcmp(f, "f") != 0 || v->itemsize != 4) {
        PyErr_Format(PyExc_TypeError, "%s must be float32 (got format %s)", what, v->format ? v->format : "B");
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

static int check_type(long type) {
    if (type < 0 || type >= T_MAX || !mf_type_ok((int)type)) {
        PyErr_Format(PyExc_ValueError, "ggml type %ld is not supported by the native kernels", type);
        return -1;
    }
    return 0;
}

static int64_t type_bytes(int type, int64_t n) { return n / mf_qtypes[type].block * mf_qtypes[type].bytes; }

static PyObject *raise_rc(int rc, long type, long long cols) {
    if (rc == -2) return PyErr_Format(PyExc_ValueError, "cols %lld is not a multiple of the block size %d of type %ld", cols, mf_qtypes[type].block, type);
    if (rc == -3) return PyErr_NoMemory();
    return PyErr_Format(PyExc_ValueError, "native kernel failed for type %ld (%d)", type, rc);
}

static PyObject *py_dequantize(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    if (na != 4) return PyErr_Format(PyExc_TypeError, "dequantize(type, src, n, out)");
    long type = PyLong_AsLong(a[0]);
    long long n = PyLong_AsLongLong(a[2]);
    if (PyErr_Occurred() || check_type(type) < 0) return NULL;
    if (n < 0 || n % mf_qtypes[type].block)
        return PyErr_Format(PyExc_ValueError, "n=%lld is not a multiple of the block size %d", n, mf_qtypes[type].block);
    Py_buffer src, out;
    if (get_buf(a[1], &src, 0, "src") < 0) return NULL;
    if (get_f32(a[3], &out, 1, "out") < 0) { PyBuffer_Release(&src); return NULL; }
    int rc = 0;
    if (src.len < type_bytes((int)type, n) || out.len < n * 4) rc = -4;
    else {
        Py_BEGIN_ALLOW_THREADS
        rc = mf_dequantize((int)type, src.buf, n, out.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    if (rc == -4) return PyErr_Format(PyExc_ValueError, "dequantize: src or out buffer too small for n=%lld", n);
    if (rc) return raise_rc(rc, type, n);
    Py_RETURN_NONE;
}

static PyObject *py_matmul(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    if (na != 7) return PyErr_Format(PyExc_TypeError, "matmul(type, w, rows, cols, x, n, out)");
    long type = PyLong_AsLong(a[0]);
    long long rows = PyLong_AsLongLong(a[2]), cols = PyLong_AsLongLong(a[3]), n = PyLong_AsLongLong(a[5]);
    if (PyErr_Occurred() || check_type(type) < 0) return NULL;
    if (rows < 0 || cols <= 0 || n < 0) return PyErr_Format(PyExc_ValueError, "bad matmul shape rows=%lld cols=%lld n=%lld", rows, cols, n);
    if (cols % mf_qtypes[type].block) return raise_rc(-2, type, cols);
    Py_buffer w, x, out;
    if (get_buf(a[1], &w, 0, "w") < 0) return NULL;
    if (get_f32(a[4], &x, 0, "x") < 0) { PyBuffer_Release(&w); return NULL; }
    if (get_f32(a[6], &out, 1, "out") < 0) { PyBuffer_Release(&w); PyBuffer_Release(&x); return NULL; }
    int rc = 0;
    if (w.len < rows * type_bytes((int)type, cols) || x.len < n * cols * 4 || out.len < n * rows * 4) rc = -4;
    else {
        Py_BEGIN_ALLOW_THREADS
        rc = mf_matmul((int)type, w.buf, rows, cols, x.buf, n, out.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&w);
    PyBuffer_Release(&x);
    PyBuffer_Release(&out);
    if (rc == -4) return PyErr_Format(PyExc_ValueError, "matmul: w, x or out buffer too small for rows=%lld cols=%lld n=%lld", rows, cols, n);
    if (rc) return raise_rc(rc, type, cols);
    Py_RETURN_NONE;
}

static PyObject *py_matmul_heads(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    if (na != 9) return PyErr_Format(PyExc_TypeError, "matmul_heads(type, w, H, rows, cols, x, n, out, decode)");
    long type = PyLong_AsLong(a[0]);
    long long H = PyLong_AsLongLong(a[2]), rows = PyLong_AsLongLong(a[3]), cols = PyLong_AsLongLong(a[4]),
              n = PyLong_AsLongLong(a[6]);
    int decode = PyObject_IsTrue(a[8]);
    if (PyErr_Occurred() || decode < 0 || check_type(type) < 0) return NULL;
    if (H < 0 || rows < 0 || cols <= 0 || n < 0)
        return PyErr_Format(PyExc_ValueError, "bad matmul_heads shape H=%lld rows=%lld cols=%lld n=%lld", H, rows, cols, n);
    if (cols % mf_qtypes[type].block) return raise_rc(-2, type, cols);
    Py_buffer w, x, out;
    if (get_buf(a[1], &w, 0, "w") < 0) return NULL;
    if (get_f32(a[5], &x, 0, "x") < 0) { PyBuffer_Release(&w); return NULL; }
    if (get_f32(a[7], &out, 1, "out") < 0) { PyBuffer_Release(&w); PyBuffer_Release(&x); return NULL; }
    int rc = 0;
    if (w.len < H * rows * type_bytes((int)type, cols) || x.len < n * H * cols * 4 || out.len < n * H * rows * 4) rc = -4;
    else {
        Py_BEGIN_ALLOW_THREADS
        rc = mf_matmul_heads((int)type, w.buf, H, rows, cols, x.buf, n, out.buf, decode ? MF_MM_DECODE : MF_MM_PREFILL);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&w);
    PyBuffer_Release(&x);
    PyBuffer_Release(&out);
    if (rc == -4)
        return PyErr_Format(PyExc_ValueError, "matmul_heads: w, x or out buffer too small for H=%lld rows=%lld "
                            "cols=%lld n=%lld", H, rows, cols, n);
    if (rc) return raise_rc(rc, type, cols);
    Py_RETURN_NONE;
}

static PyObject *py_get_rows(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    if (na != 6) return PyErr_Format(PyExc_TypeError, "get_rows(type, w, rows, cols, ids, out)");
    long type = PyLong_AsLong(a[0]);
    long long rows = PyLong_AsLongLong(a[2]), cols = PyLong_AsLongLong(a[3]);
    if (PyErr_Occurred() || check_type(type) < 0) return NULL;
    if (rows < 0 || cols <= 0) return PyErr_Format(PyExc_ValueError, "bad get_rows shape rows=%lld cols=%lld", rows, cols);
    if (cols % mf_qtypes[type].block) return raise_rc(-2, type, cols);
    Py_buffer w, ids, out;
    if (get_buf(a[1], &w, 0, "w") < 0) return NULL;
    if (get_buf(a[4], &ids, 0, "ids") < 0) { PyBuffer_Release(&w); return NULL; }
    if (get_f32(a[5], &out, 1, "out") < 0) { PyBuffer_Release(&w); PyBuffer_Release(&ids); return NULL; }
    int64_t k = ids.len / 8;
    const int64_t *id = ids.buf;
    long long bad = -1;
    int rc = 0;
    if (ids.itemsize != 8 || w.len < rows * type_bytes((int)type, cols) || out.len < k * cols * 4) rc = -4;
    for (int64_t i = 0; rc == 0 && i < k; i++)
        if (id[i] < 0 || id[i] >= rows) { bad = id[i]; rc = -5; }
    if (rc == 0) {
        Py_BEGIN_ALLOW_THREADS
        rc = mf_get_rows((int)type, w.buf, cols, id, k, out.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&w);
    PyBuffer_Release(&ids);
    PyBuffer_Release(&out);
    if (rc == -4) return PyErr_Format(PyExc_ValueError, "get_rows: ids must be int64 and w/out large enough (rows=%lld cols=%lld)", rows, cols);
    if (rc == -5) return PyErr_Format(PyExc_IndexError, "row id %lld out of range [0, %lld)", bad, rows);
    if (rc) return raise_rc(rc, type, cols);
    Py_RETURN_NONE;
}

static PyObject *matmul_multi_args(PyObject *const *a, Py_ssize_t na, int vec_only) {
    if (na < 7 || na > 19 || (na - 3) % 4)
        return PyErr_Format(PyExc_TypeError, "matmul_multi(x, n, cols, type, w, rows, out, ...) takes 1..4 weights");
    const int k = (int)((na - 3) / 4);
    long long n = PyLong_AsLongLong(a[1]), cols = PyLong_AsLongLong(a[2]);
    int types[4];
    int64_t rows[4];
    for (int j = 0; j < k; j++) {
        long t = PyLong_AsLong(a[3 + 4 * j]);
        long long r = PyLong_AsLongLong(a[5 + 4 * j]);
        if (PyErr_Occurred() || check_type(t) < 0) return NULL;
        if (r < 0) return PyErr_Format(PyExc_ValueError, "bad matmul_multi rows=%lld", r);
        if (cols % mf_qtypes[t].block) return raise_rc(-2, t, cols);
        types[j] = (int)t;
        rows[j] = r;
    }
    if (PyErr_Occurred()) return NULL;
    if (cols <= 0 || n < 0) return PyErr_Format(PyExc_ValueError, "bad matmul_multi shape cols=%lld n=%lld", cols, n);
    Py_buffer x, w[4], out[4];
    int got = 0, rc = 0;
    if (get_f32(a[0], &x, 0, "x") < 0) return NULL;
    for (; got < k; got++) {
        if (get_buf(a[4 + 4 * got], &w[got], 0, "w") < 0) { rc = -9; break; }
        if (get_f32(a[6 + 4 * got], &out[got], 1, "out") < 0) { PyBuffer_Release(&w[got]); rc = -9; break; }
    }
    const uint8_t *wp[4];
    float *yp[4];
    if (rc == 0) {
        if (x.len < n * cols * 4) rc = -4;
        for (int j = 0; j < k; j++) {
            if (w[j].len < rows[j] * type_bytes(types[j], cols) || out[j].len < n * rows[j] * 4) rc = -4;
            wp[j] = w[j].buf;
            yp[j] = out[j].buf;
        }
    }
    if (rc == 0) {
        Py_BEGIN_ALLOW_THREADS
        rc = mf_matmul_multi_ex(k, types, wp, rows, cols, x.buf, n, yp, vec_only);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&x);
    for (int j = 0; j < got; j++) { PyBuffer_Release(&w[j]); PyBuffer_Release(&out[j]); }
    if (rc == -9) return NULL;
    if (rc == -4) return PyErr_Format(PyExc_ValueError, "matmul_multi: w, x or out buffer too small for cols=%lld n=%lld", cols, n);
    if (rc) return raise_rc(rc, types[0], cols);
    Py_RETURN_NONE;
}

static PyObject *py_matmul_multi(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    return matmul_multi_args(a, na, 0);
}

static PyObject *py_matmul_rows(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    return matmul_multi_args(a, na, MF_MM_DECODE);
}

PyMethodDef mf_quant_methods[] = {
    {"dequantize", (PyCFunction)(void (*)(void))py_dequantize, METH_FASTCALL, "dequantize(type, src, n, out)"},
    {"matmul", (PyCFunction)(void (*)(void))py_matmul, METH_FASTCALL, "matmul(type, w, rows, cols, x, n, out): out[n, rows] = x[n, cols] @ W^T (prefill kernels)"},
    {"matmul_multi", (PyCFunction)(void (*)(void))py_matmul_multi, METH_FASTCALL, "matmul_multi(x, n, cols, type, w, rows, out, ...): out_j = x @ W_j^T for 1..4 weights (prefill kernels)"},
    {"matmul_rows", (PyCFunction)(void (*)(void))py_matmul_rows, METH_FASTCALL, "matmul_rows(x, n, cols, type, w, rows, out, ...): matmul_multi with the decode kernels"},
    {"matmul_heads", (PyCFunction)(void (*)(void))py_matmul_heads, METH_FASTCALL,
     "matmul_heads(type, w, H, rows, cols, x, n, out, decode): out[n, H, rows] = per head h x[:, h] @ W_h^T, "
     "W_h the h-th of H consecutive (rows, cols) matrices of w; each head's bits are matmul's (decode: matmul_rows') "
     "of x[:, h] alone; one pool job over the heads"},
    {"get_rows", (PyCFunction)(void (*)(void))py_get_rows, METH_FASTCALL, "get_rows(type, w, rows, cols, ids int64, out)"},
    {NULL, NULL, 0, NULL},
};
