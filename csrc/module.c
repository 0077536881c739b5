/* memfit._native: module init; joins the method tables of the binding files. */
#include "memfit.h"

void mf_init_isa(void);  /* pool.c */
void mf_init_pool(void); /* pool.c */

extern PyMethodDef mf_bench_methods[];  /* csrc/membw.c */
extern PyMethodDef mf_decode_methods[]; /* csrc/decode.c */
extern PyMethodDef mf_kv_methods[];     /* csrc/bind_kv.c */
extern PyMethodDef mf_moe_methods[];    /* csrc/moe.c */
extern PyMethodDef mf_kvq_methods[];    /* csrc/bind_kvq.c */
extern PyMethodDef mf_table_methods[];  /* csrc/quant_tables.c */

static PyMethodDef *tables[] = {mf_quant_methods, mf_ops_methods, mf_pool_methods,
                                mf_bench_methods, mf_decode_methods, mf_kv_methods,
                                mf_moe_methods, mf_kvq_methods, mf_table_methods};
static PyMethodDef all_methods[256];

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_native",
                                       "memfit native kernel core", -1, all_methods,
                                       NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) {
    size_t k = 0;
    for (size_t t = 0; t < sizeof(tables) / sizeof(tables[0]); t++)
        for (PyMethodDef *m = tables[t]; m->ml_name; m++) {
            if (k + 1 >= sizeof(all_methods) / sizeof(all_methods[0])) break;
            all_methods[k++] = *m;
        }
    all_methods[k] = (PyMethodDef){NULL, NULL, 0, NULL};
    mf_init_isa();
    mf_init_pool();
    return PyModule_Create(&moduledef);
}
