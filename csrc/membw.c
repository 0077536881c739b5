/* Memory read bandwidth probe: every thread of the pool streams through its share of a
 * buffer with wide loads, so `bytes / time` is the machine's read bandwidth bound that the
 * matvec kernels are compared against (numpy's sum is single-pass scalar-ish and reads less). */
#include "memfit.h"

#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

typedef struct {
    const uint8_t *p;
    int64_t n, chunk;
    int streams; /* each thread's chunk read as this many parts in alternation, 2 KiB at a time */
    uint64_t sums[256];
} bw_ctx;

#if defined(__x86_64__)
__attribute__((target("avx2"))) static uint64_t read_avx2(const uint8_t *p, int64_t n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 128 <= n; i += 128) {
        a0 = _mm256_xor_si256(a0, _mm256_load_si256((const __m256i *)(p + i)));
        a1 = _mm256_xor_si256(a1, _mm256_load_si256((const __m256i *)(p + i + 32)));
        a2 = _mm256_xor_si256(a2, _mm256_load_si256((const __m256i *)(p + i + 64)));
        a3 = _mm256_xor_si256(a3, _mm256_load_si256((const __m256i *)(p + i + 96)));
    }
    __m256i a = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    uint64_t out[4];
    memcpy(out, &a, sizeof out);
    uint64_t s = out[0] ^ out[1] ^ out[2] ^ out[3];
    for (; i < n; i++) s += p[i];
    return s;
}
#endif

static uint64_t read_scalar(const uint8_t *p, int64_t n) {
    uint64_t s = 0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v;
        memcpy(&v, p + i, 8);
        s ^= v;
    }
    for (; i < n; i++) s += p[i];
    return s;
}

static uint64_t read_range(const uint8_t *p, int64_t n) {
#if defined(__x86_64__)
    if (mf_isa >= MF_ISA_AVX2 && ((uintptr_t)p & 31) == 0) return read_avx2(p, n);
#endif
    return read_scalar(p, n);
}

#define BW_STEP 2048
static void bw_task(void *vctx, int64_t t) {
    bw_ctx *c = vctx;
    int64_t lo = t * c->chunk, hi = lo + c->chunk < c->n ? lo + c->chunk : c->n;
    if (lo >= hi) return;
    uint64_t s = 0;
    if (c->streams <= 1) s = read_range(c->p + lo, hi - lo);
    else { /* parts of a multiple of BW_STEP bytes, one step of each in turn */
        const int64_t part = ((hi - lo) / c->streams / BW_STEP + 1) * BW_STEP;
        for (int64_t j = 0; j < part; j += BW_STEP)
            for (int k = 0; k < c->streams; k++) {
                int64_t a = lo + k * part + j, b = a + BW_STEP;
                if (b > lo + (k + 1) * part) b = lo + (k + 1) * part;
                if (b > hi) b = hi;
                if (a < b) s ^= read_range(c->p + a, b - a);
            }
    }
    c->sums[t & 255] ^= s;
}

/* read_buffer(buf[, streams]) -> checksum: one parallel pass over the buffer (64-byte aligned
 * chunks, one per thread; each chunk read as `streams` interleaved ascending streams). */
static PyObject *py_read_buffer(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1 && nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "read_buffer(buf[, streams]) takes a buffer and an optional stream count");
        return NULL;
    }
    long streams = nargs == 2 ? PyLong_AsLong(args[1]) : 1;
    if (streams == -1 && PyErr_Occurred()) return NULL;
    if (streams < 1 || streams > 64) return PyErr_Format(PyExc_ValueError, "read_buffer: streams %ld not in 1..64", streams);
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) < 0) return NULL;
    bw_ctx c;
    memset(&c, 0, sizeof c);
    c.p = b.buf;
    c.n = b.len;
    c.streams = (int)streams;
    int64_t tasks = mf_n_threads() > 0 ? mf_n_threads() : 1;
    if (tasks > 256) tasks = 256;
    c.chunk = ((c.n / tasks) + 63) & ~(int64_t)63;
    if (c.chunk == 0) c.chunk = 64;
    Py_BEGIN_ALLOW_THREADS
    mf_parallel_for(tasks, bw_task, &c);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    uint64_t s = 0;
    for (int i = 0; i < 256; i++) s ^= c.sums[i];
    return PyLong_FromUnsignedLongLong(s);
}

PyMethodDef mf_bench_methods[] = {
    {"read_buffer", (PyCFunction)(void (*)(void))py_read_buffer, METH_FASTCALL,
     "read_buffer(buf[, streams]) -> checksum; one parallel read pass (memory bandwidth probe)"},
    {NULL, NULL, 0, NULL},
};
