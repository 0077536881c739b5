/* The routed-expert FFN of one MoE layer in one call (models/layers.py Model.moe_ffn): tokens
 * grouped by expert; per group the rows of x are gathered, gate and up run as one
 * multi-matmul (+ their biases), then SiLU, GELU or gpt-oss's SwiGLU of gate and up, down
 * (+ its bias), and each row's result times its routing weight is added to out[row]. Groups
 * run in the order given (the model gives experts in index order), so a row's sum is
 * independent of the other rows and equals the op-by-op path (same kernels, same order) bit
 * for bit. */
#include "memfit.h"
#include "ops.h"
#include "quant_common.h"

#include <stdlib.h>
#include <string.h>

/* csrc/quant_mm.c */
int mf_matmul_multi_ex(int k, const int *types, const uint8_t *const *ws, const int64_t *rows,
                       int64_t cols, const float *x, int64_t n, float *const *ys, int vec_only);

/* activations of the gated FFN (act): 0 silu, 1 gelu, 2 swiglu_oai with gpt-oss's alpha and
 * limit (ops.h MF_OAI_*) */
#define MF_ACT_SILU 0
#define MF_ACT_GELU 1
#define MF_ACT_SWIGLU_OAI 2

/* y[m, d] += b[d] per row */
static void add_bias(float *y, const float *b, int64_t m, int64_t d) {
    for (int64_t i = 0; i < m; i++)
        for (int64_t c = 0; c < d; c++) y[i * d + c] += b[c];
}

/* x[n, n_embd]; w[3 * g + {0, 1, 2}]: expert g's gate (n_ff, n_embd), up (n_ff, n_embd), down
 * (n_embd, n_ff) bytes of types[0..2]; group g is rows[off[g] .. off[g + 1]) with weights
 * wts[same]; out[n, n_embd] accumulates. bias (NULL: none) holds 3 per group as w does: gate and
 * up f32[n_ff] added before the activation, down f32[n_embd] before the routing weight
 * (out[row] += wt * (down(h) + b)), each NULL where absent. act: MF_ACT_*. decode: the decode
 * kernels, else the prefill ones (quant_mm.c: either way a row's result does not depend on how
 * many rows share its group). Returns 0, or the matmul's error (-1 type, -2 cols, -3 out of
 * memory). Call without the GIL. */
/* Expert groups of fewer than this many prompt rows take the decode kernels (0: never, the
 * default). Not batch invariant: a prompt row's bits then depend on how many rows of its step
 * chose the same expert. MEMFIT_BATCH_INVARIANT=0 sets 8 (ops/native.py), trading exactness
 * for MoE prefill speed (measured in BENCHMARKS.md). */
int mf_moe_vecdot_below = 0;

int mf_moe_ffn(const float *x, int64_t n_embd, int64_t n_ff, const int *types, int64_t n_groups,
               const uint8_t *const *w, const float *const *bias, const int64_t *off, const int64_t *rows,
               const float *wts, int act, float *out, int decode) {
    int64_t maxg = 0;
    for (int64_t g = 0; g < n_groups; g++)
        if (off[g + 1] - off[g] > maxg) maxg = off[g + 1] - off[g];
    if (maxg == 0) return 0;
    /* a fixed family for every group (a row's bits never depend on its group's size); the
     * narrow 4-X-row kernels measured 0.87x (pp64) and 0.76x (pp512) of this on the 2 GB
     * qwen3moe synth file, quiet (docs/NOTES.md); mf_moe_vecdot_below opts out */
    const int base_mode = decode ? MF_MM_DECODE : MF_MM_PREFILL;
    /* xg[maxg, n_embd], gate and up [maxg, n_ff], y[maxg, n_embd] */
    float *buf = malloc(sizeof(float) * (size_t)maxg * (size_t)(2 * n_embd + 2 * n_ff));
    if (!buf) return -3;
    float *xg = buf, *ga = xg + maxg * n_embd, *up = ga + maxg * n_ff, *y = up + maxg * n_ff;
    int rc = 0;
    for (int64_t g = 0; g < n_groups && rc == 0; g++) {
        const int64_t m = off[g + 1] - off[g], *r = rows + off[g];
        if (m == 0) continue;
        const int mode = m < mf_moe_vecdot_below ? MF_MM_DECODE : base_mode;
        for (int64_t i = 0; i < m; i++)
            memcpy(xg + i * n_embd, x + r[i] * n_embd, sizeof(float) * (size_t)n_embd);
        const uint8_t *gu[2] = {w[3 * g], w[3 * g + 1]};
        const int64_t nr[2] = {n_ff, n_ff};
        float *ys[2] = {ga, up};
        rc = mf_matmul_multi_ex(2, types, gu, nr, n_embd, xg, m, ys, mode);
        if (rc) break;
        if (bias && bias[3 * g]) add_bias(ga, bias[3 * g], m, n_ff);
        if (bias && bias[3 * g + 1]) add_bias(up, bias[3 * g + 1], m, n_ff);
        if (act == MF_ACT_SWIGLU_OAI)
            mf_swiglu_oai_f32(ga, up, ga, m * n_ff, MF_OAI_ALPHA, MF_OAI_LIMIT);
        else if (act == MF_ACT_GELU)
            mf_gelu_mul_f32(ga, up, ga, m * n_ff);
        else
            mf_silu_mul_f32(ga, up, ga, m * n_ff);
        rc = mf_matmul_multi_ex(1, &types[2], &w[3 * g + 2], &n_embd, n_ff, ga, m, &y, mode);
        if (rc == 0 && bias && bias[3 * g + 2]) add_bias(y, bias[3 * g + 2], m, n_embd);
        for (int64_t i = 0; i < m && rc == 0; i++) {
            const float s = wts[off[g] + i], *yi = y + i * n_embd;
            float *o = out + r[i] * n_embd;
            for (int64_t c = 0; c < n_embd; c++) o[c] += s * yi[c];
        }
    }
    free(buf);
    return rc;
}

/* ---- moe_ffn(x, n, n_embd, n_ff, tg, tu, td, ws, off, rows, wts, act, out[, decode[, bs]]) - */
static int buf_of(PyObject *o, Py_buffer *v, int writable, const char *fmt, const char *what) {
    if (PyObject_GetBuffer(o, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Format(PyExc_TypeError, "moe_ffn: %s must be a C-contiguous%s buffer", what,
                     writable ? " writable" : "");
        return -1;
    }
    if (fmt) {
        const char *f = v->format ? v->format : "B";
        if (*f == '<' || *f == '=' || *f == '@') f++;
        int ok = strcmp(fmt, "f") == 0 ? (strcmp(f, "f") == 0 && v->itemsize == 4)
                                       : ((strcmp(f, "q") == 0 || strcmp(f, "l") == 0) && v->itemsize == 8);
        if (!ok) {
            PyErr_Format(PyExc_TypeError, "moe_ffn: %s must be %s", what,
                         strcmp(fmt, "f") == 0 ? "float32" : "int64");
            PyBuffer_Release(v);
            return -1;
        }
    }
    return 0;
}

static PyObject *py_moe_ffn(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    if (na < 13 || na > 15)
        return PyErr_Format(PyExc_TypeError, "moe_ffn(x, n, n_embd, n_ff, tg, tu, td, ws, off, rows, wts, act, out"
                            "[, decode[, biases]])");
    long long n = PyLong_AsLongLong(a[1]), E = PyLong_AsLongLong(a[2]), F = PyLong_AsLongLong(a[3]);
    int types[3];
    for (int j = 0; j < 3; j++) types[j] = (int)PyLong_AsLong(a[4 + j]);
    /* act: 0 silu, 1 gelu, 2 swiglu_oai; the bool of before (gelu) reads as 0 / 1 */
    const long act = PyLong_AsLong(a[11]);
    int decode = na >= 14 ? PyObject_IsTrue(a[13]) : 0;
    if (PyErr_Occurred() || decode < 0) return NULL;
    if (act < MF_ACT_SILU || act > MF_ACT_SWIGLU_OAI)
        return PyErr_Format(PyExc_ValueError, "moe_ffn: act %ld is not 0 (silu), 1 (gelu) or 2 (swiglu_oai)", act);
    PyObject *bo = na == 15 && a[14] != Py_None ? a[14] : NULL;
    for (int j = 0; j < 3; j++)
        if (types[j] < 0 || types[j] >= T_MAX || !mf_type_ok(types[j]))
            return PyErr_Format(PyExc_ValueError, "ggml type %d is not supported by the native kernels", types[j]);
    if (n < 0 || E <= 0 || F <= 0 || E % mf_qtypes[types[0]].block || E % mf_qtypes[types[1]].block
        || F % mf_qtypes[types[2]].block)
        return PyErr_Format(PyExc_ValueError, "moe_ffn: bad shape n=%lld n_embd=%lld n_ff=%lld", n, E, F);
    PyObject *seq = PySequence_Fast(a[7], "moe_ffn: ws must be a sequence of buffers");
    if (!seq) return NULL;
    PyObject *bseq = bo ? PySequence_Fast(bo, "moe_ffn: biases must be a sequence of float32 arrays or None") : NULL;
    if (bo && !bseq) { Py_DECREF(seq); return NULL; }
    const Py_ssize_t nw = PySequence_Fast_GET_SIZE(seq);
    const int64_t G = nw / 3;
    Py_buffer x, offb, rowsb, wtsb, outb;
    Py_buffer *wb = PyMem_Calloc((size_t)nw + 1, sizeof(Py_buffer));
    const uint8_t **wp = PyMem_Calloc((size_t)nw + 1, sizeof(uint8_t *));
    Py_buffer *bb = bseq ? PyMem_Calloc((size_t)nw + 1, sizeof(Py_buffer)) : NULL;
    const float **bp = bseq ? PyMem_Calloc((size_t)nw + 1, sizeof(float *)) : NULL;
    int have = 0, held = 0, bheld = 0, bad = 1;
    if (!wb || !wp || (bseq && (!bb || !bp)))
        PyErr_NoMemory();
    else if (nw % 3)
        PyErr_Format(PyExc_ValueError, "moe_ffn: ws must hold gate, up, down per group");
    else if (bseq && PySequence_Fast_GET_SIZE(bseq) != nw)
        PyErr_Format(PyExc_ValueError, "moe_ffn: biases must hold gate, up, down (or None) per group: %zd for %zd "
                     "weights", PySequence_Fast_GET_SIZE(bseq), nw);
    else
        bad = 0;
    if (!bad) {
        if (buf_of(a[0], &x, 0, "f", "x") == 0) have = 1;
        if (have == 1 && buf_of(a[8], &offb, 0, "q", "off") == 0) have = 2;
        if (have == 2 && buf_of(a[9], &rowsb, 0, "q", "rows") == 0) have = 3;
        if (have == 3 && buf_of(a[10], &wtsb, 0, "f", "wts") == 0) have = 4;
        if (have == 4 && buf_of(a[12], &outb, 1, "f", "out") == 0) have = 5;
        bad = have < 5;
    }
    for (; !bad && held < nw; held++) {
        if (buf_of(PySequence_Fast_GET_ITEM(seq, held), &wb[held], 0, NULL, "an expert weight") < 0) {
            bad = 1;
            break;
        }
        const int j = held % 3;
        const int64_t need = j < 2 ? F * (E / mf_qtypes[types[j]].block) * mf_qtypes[types[j]].bytes
                                   : E * (F / mf_qtypes[types[2]].block) * mf_qtypes[types[2]].bytes;
        wp[held] = wb[held].buf;
        if (wb[held].len < need) {
            PyErr_Format(PyExc_ValueError, "moe_ffn: expert weight %zd is %zd bytes, needs %lld",
                         held, wb[held].len, (long long)need);
            held++;
            bad = 1;
        }
    }
    /* biases: float32 [n_ff] (gate, up) or [n_embd] (down), None where absent */
    for (Py_ssize_t i = 0; !bad && bseq && i < nw; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(bseq, i);
        if (o == Py_None) continue;
        if (buf_of(o, &bb[i], 0, "f", "a bias") < 0) {
            bad = 1;
            break;
        }
        bheld = (int)i + 1; /* released below: every held entry up to here (None ones have no buffer) */
        bp[i] = bb[i].buf;
        const int64_t need = i % 3 < 2 ? F : E;
        if (bb[i].len != need * 4) {
            PyErr_Format(PyExc_ValueError, "moe_ffn: bias %zd has %zd values, needs %lld", i, bb[i].len / 4,
                         (long long)need);
            bad = 1;
        }
    }
    int rc = 0;
    if (!bad) {
        const int64_t *off = offb.buf, *rows = rowsb.buf;
        const int64_t nr = rowsb.len / 8;
        if (x.len < n * E * 4 || outb.len < n * E * 4 || offb.len < (G + 1) * 8 || wtsb.len < nr * 4) bad = 1;
        for (int64_t g = 0; !bad && g < G; g++)
            if (off[g] < 0 || off[g + 1] < off[g] || off[g + 1] > nr) bad = 1;
        for (int64_t i = 0; !bad && i < nr; i++)
            if (rows[i] < 0 || rows[i] >= n) bad = 1;
        if (bad) PyErr_Format(PyExc_ValueError, "moe_ffn: x, out, off, rows or wts do not match n=%lld n_embd=%lld", n, E);
    }
    if (!bad) {
        Py_BEGIN_ALLOW_THREADS
        rc = mf_moe_ffn(x.buf, E, F, types, G, wp, bp, offb.buf, rowsb.buf, wtsb.buf, (int)act, outb.buf, decode);
        Py_END_ALLOW_THREADS
        if (rc == -3) PyErr_NoMemory();
        else if (rc) PyErr_Format(PyExc_ValueError, "moe_ffn: native kernel failed (%d)", rc);
    }
    for (int i = 0; i < held; i++) PyBuffer_Release(&wb[i]);
    for (int i = 0; i < bheld; i++)
        if (bp[i]) PyBuffer_Release(&bb[i]);
    if (have >= 5) PyBuffer_Release(&outb);
    if (have >= 4) PyBuffer_Release(&wtsb);
    if (have >= 3) PyBuffer_Release(&rowsb);
    if (have >= 2) PyBuffer_Release(&offb);
    if (have >= 1) PyBuffer_Release(&x);
    PyMem_Free(wb);
    PyMem_Free((void *)wp);
    PyMem_Free(bb);
    PyMem_Free((void *)bp);
    Py_DECREF(seq);
    Py_XDECREF(bseq);
    if (bad || rc) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_set_moe_vecdot_below(PyObject *self, PyObject *arg) {
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred()) return NULL;
    if (v < 0 || v > 64) return PyErr_Format(PyExc_ValueError, "set_moe_vecdot_below: %ld not in 0..64", v);
    long before = mf_moe_vecdot_below;
    mf_moe_vecdot_below = (int)v;
    return PyLong_FromLong(before);
}

PyMethodDef mf_moe_methods[] = {
    {"set_moe_vecdot_below", py_set_moe_vecdot_below, METH_O,
     "set_moe_vecdot_below(n) -> previous: expert groups of fewer than n prompt rows take the decode "
     "kernels (0: never; not batch invariant otherwise)"},
    {"moe_ffn", (PyCFunction)(void (*)(void))py_moe_ffn, METH_FASTCALL,
     "moe_ffn(x, n, n_embd, n_ff, tg, tu, td, ws, off int64, rows int64, wts f32, act, out[, decode[, biases]]): "
     "out[rows] += wts * (down(act(gate x + bg, up x + bu)) + bd) per expert group; act 0 silu, 1 gelu (a bool "
     "reads as these), 2 swiglu_oai (alpha 1.702, limit 7); biases: None or one f32 array or None per weight in "
     "ws (gate and up [n_ff], down [n_embd]); decode: the decode kernels"},
    {NULL, NULL, 0, NULL},
};
