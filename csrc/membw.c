/* Memory read bandwidth probe: every thread of the pool streams through its share of a
 * buffer with wide loads, so `bytes / time` is the machine's read bandwidth bound that the
 * matvec kernels are compared against (numpy's sum is single-pass scalar-ish and reads less).
 * One pass is one read strategy: the loads' width (scalar, 256 or 512 bits), how many
 * interleaved ascending streams each thread walks, and a software prefetch distance; the bound
 * is the best strategy the machine has (memory/bandwidth.py read_bound), since which one wins
 * differs between CPUs (the Xeons read more with several streams per core). */
#include "memfit.h"

#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

typedef struct {
    const uint8_t *p;
    int64_t n, chunk;
    int streams;  /* each thread's chunk read as this many parts in alternation, 2 KiB at a time */
    int width;    /* 0 scalar, 256 or 512 bit loads */
    int prefetch; /* bytes ahead to prefetch (0: none) */
    uint64_t sums[256];
} bw_ctx;

#if defined(__x86_64__)
#define PF(a) _mm_prefetch((const char *)(a), _MM_HINT_T0)
__attribute__((target("avx512f"))) static uint64_t read_avx512(const uint8_t *p, int64_t n, int pf) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 256 <= n; i += 256) {
        if (pf) {
            PF(p + i + pf); PF(p + i + pf + 64); PF(p + i + pf + 128); PF(p + i + pf + 192);
        }
        a0 = _mm512_xor_si512(a0, _mm512_load_si512((const void *)(p + i)));
        a1 = _mm512_xor_si512(a1, _mm512_load_si512((const void *)(p + i + 64)));
        a2 = _mm512_xor_si512(a2, _mm512_load_si512((const void *)(p + i + 128)));
        a3 = _mm512_xor_si512(a3, _mm512_load_si512((const void *)(p + i + 192)));
    }
    __m512i a = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
    uint64_t out[8];
    memcpy(out, &a, sizeof out);
    uint64_t s = 0;
    for (int k = 0; k < 8; k++) s ^= out[k];
    for (; i < n; i++) s += p[i];
    return s;
}

__attribute__((target("avx2"))) static uint64_t read_avx2(const uint8_t *p, int64_t n, int pf) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 128 <= n; i += 128) {
        if (pf) {
            PF(p + i + pf); PF(p + i + pf + 64);
        }
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

static uint64_t read_range(const bw_ctx *c, const uint8_t *p, int64_t n) {
#if defined(__x86_64__)
    if (c->width == 512 && ((uintptr_t)p & 63) == 0) return read_avx512(p, n, c->prefetch);
    if (c->width >= 256 && ((uintptr_t)p & 31) == 0) return read_avx2(p, n, c->prefetch);
#endif
    return read_scalar(p, n);
}

#define BW_STEP 2048
static void bw_task(void *vctx, int64_t t) {
    bw_ctx *c = vctx;
    int64_t lo = t * c->chunk, hi = lo + c->chunk < c->n ? lo + c->chunk : c->n;
    if (lo >= hi) return;
    uint64_t s = 0;
    if (c->streams <= 1) s = read_range(c, c->p + lo, hi - lo);
    else { /* parts of a multiple of BW_STEP bytes, one step of each in turn */
        const int64_t part = ((hi - lo) / c->streams / BW_STEP + 1) * BW_STEP;
        for (int64_t j = 0; j < part; j += BW_STEP)
            for (int k = 0; k < c->streams; k++) {
                int64_t a = lo + k * part + j, b = a + BW_STEP;
                if (b > lo + (k + 1) * part) b = lo + (k + 1) * part;
                if (b > hi) b = hi;
                if (a < b) s ^= read_range(c, c->p + a, b - a);
            }
    }
    c->sums[t & 255] ^= s;
}

/* read_buffer(buf[, streams[, width[, prefetch[, threads]]]]) -> checksum: one parallel pass
 * over the buffer (64-byte aligned chunks, one per thread; each chunk read as `streams`
 * interleaved ascending streams). width: 0 scalar, 256, 512 (capped by the CPU and the ISA
 * in use; default the widest); prefetch: bytes ahead (0 none); threads: how many of the
 * pool's threads read (default all). */
static PyObject *py_read_buffer(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 5) {
        PyErr_SetString(PyExc_TypeError,
                        "read_buffer(buf[, streams[, width[, prefetch[, threads]]]]) takes a buffer and up to 4 ints");
        return NULL;
    }
    long v[4] = {1, 512, 0, 0};
    for (Py_ssize_t i = 1; i < nargs; i++) {
        v[i - 1] = PyLong_AsLong(args[i]);
        if (v[i - 1] == -1 && PyErr_Occurred()) return NULL;
    }
    const long streams = v[0], width = v[1], prefetch = v[2], threads = v[3];
    if (streams < 1 || streams > 64) return PyErr_Format(PyExc_ValueError, "read_buffer: streams %ld not in 1..64", streams);
    if (width != 0 && width != 256 && width != 512)
        return PyErr_Format(PyExc_ValueError, "read_buffer: width %ld is not 0, 256 or 512", width);
    if (prefetch < 0 || prefetch > (1 << 20) || prefetch % 64)
        return PyErr_Format(PyExc_ValueError, "read_buffer: prefetch %ld not a multiple of 64 in 0..1 MiB", prefetch);
    if (threads < 0) return PyErr_Format(PyExc_ValueError, "read_buffer: threads %ld < 0", threads);
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) < 0) return NULL;
    bw_ctx c;
    memset(&c, 0, sizeof c);
    c.p = b.buf;
    c.n = b.len;
    c.streams = (int)streams;
    c.width = width == 512 && mf_isa >= MF_ISA_AVX512 ? 512 : width >= 256 && mf_isa >= MF_ISA_AVX2 ? 256 : 0;
    c.prefetch = (int)prefetch;
    int64_t tasks = mf_n_threads() > 0 ? mf_n_threads() : 1;
    if (threads > 0 && threads < tasks) tasks = threads;
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
     "read_buffer(buf[, streams[, width[, prefetch[, threads]]]]) -> checksum; one parallel read pass (memory bandwidth probe)"},
    {NULL, NULL, 0, NULL},
};
