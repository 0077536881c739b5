/* memfit native core: shared declarations.
 * Kernels work on raw buffers + shapes; Python bindings (CPython C API, METH_FASTCALL,
 * buffer protocol) release the GIL around the work. */
#ifndef MEMFIT_H
#define MEMFIT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>

/* Method tables contributed by each binding file; module.c concatenates them. */
extern PyMethodDef mf_quant_methods[]; /* csrc/bind_quant.c : dequantize, matmul, get_rows, ... */
extern PyMethodDef mf_ops_methods[];   /* csrc/bind_ops.c   : rmsnorm, rope, attention, ... */
extern PyMethodDef mf_pool_methods[];  /* csrc/pool.c       : set_threads, get_threads, isa */

/* Persistent thread pool (csrc/pool.c). fn(ctx, i) is called for i in [0, n) across workers;
 * returns when all are done. Must be called without the GIL held. */
typedef void (*mf_task_fn)(void *ctx, int64_t i);
void mf_parallel_for(int64_t n, mf_task_fn fn, void *ctx);
void mf_parallel_for_ranged(int64_t n, mf_task_fn fn, void *ctx); /* one ascending range per thread first */
int mf_n_threads(void);

/* Runtime ISA selected once at import: MEMFIT_ISA=scalar|avx2|avx512 may force a lower one. */
enum mf_isa { MF_ISA_SCALAR = 0, MF_ISA_AVX2 = 1, MF_ISA_AVX512 = 2, MF_ISA_AVX512VNNI = 3 };
extern int mf_isa;

#endif
