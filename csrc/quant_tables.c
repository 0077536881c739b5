/* The lattice tables of the IQ quant types, installed once at import.
 *
 * They are not retyped here: memfit/quant/tables.py takes them from gguf-py (gguf.quants,
 * the package that also serves as the reference dequantizer in the tests), whose
 * IQ2_XXS.grid .. IQ1_S.grid hold ggml-common.h's iq2xxs_grid, iq2xs_grid, iq2s_grid,
 * iq3xxs_grid, iq3s_grid and iq1s_grid value by value, and IQ2_XXS.ksigns ggml's
 * ksigns_iq2xs. set_quant_table(name, bytes) copies one; a kernel of a type whose table is
 * not installed is refused (mf_type_ok), never run on zeros.
 *
 *   set_quant_table(name, data)   name: "iq2xxs" "iq2xs" "iq2s" "iq3xxs" "iq3s" "iq1s" "ksigns"
 */
#include "memfit.h"
#include "quant_common.h"

#include <string.h>

_Alignas(64) int8_t mf_grid_iq2xxs[256 * 8], mf_grid_iq2xs[512 * 8], mf_grid_iq2s[1024 * 8];
_Alignas(64) uint8_t mf_grid_iq3xxs[256 * 4], mf_grid_iq3s[512 * 4];
_Alignas(64) uint8_t mf_iq3s_n01[512], mf_iq3s_n23[512];
_Alignas(64) uint8_t mf_iq3xxs_n01[256], mf_iq3xxs_n23[256];
_Alignas(64) uint8_t mf_iq2xxs_c03[256], mf_iq2xxs_c47[256];

/* IQ3_XXS's grid value v as its code: 4 + 8 c, and 62 as 7 */
static uint8_t iq3xxs_code(uint8_t v) { return (uint8_t)(v >= 60 ? 7 : (v - 4) / 8); }
_Alignas(64) int8_t mf_grid_iq1s[2048 * 8];
_Alignas(64) uint64_t mf_iq1_u[4096];
uint8_t mf_ksigns_iq2xs[128];
_Alignas(64) uint64_t mf_ksign_u64[128];

enum { TB_IQ2XXS, TB_IQ2XS, TB_IQ2S, TB_IQ3XXS, TB_IQ3S, TB_IQ1S, TB_KSIGNS, TB_N };
static const struct { const char *name; void *dst; size_t bytes; } tables[TB_N] = {
    [TB_IQ2XXS] = {"iq2xxs", mf_grid_iq2xxs, sizeof mf_grid_iq2xxs},
    [TB_IQ2XS] = {"iq2xs", mf_grid_iq2xs, sizeof mf_grid_iq2xs},
    [TB_IQ2S] = {"iq2s", mf_grid_iq2s, sizeof mf_grid_iq2s},
    [TB_IQ3XXS] = {"iq3xxs", mf_grid_iq3xxs, sizeof mf_grid_iq3xxs},
    [TB_IQ3S] = {"iq3s", mf_grid_iq3s, sizeof mf_grid_iq3s},
    [TB_IQ1S] = {"iq1s", mf_grid_iq1s, sizeof mf_grid_iq1s},
    [TB_KSIGNS] = {"ksigns", mf_ksigns_iq2xs, sizeof mf_ksigns_iq2xs},
};
static int installed[TB_N];

int mf_tables_ready(int type) {
    switch (type) {
    case T_IQ2_XXS: return installed[TB_IQ2XXS] && installed[TB_KSIGNS];
    case T_IQ2_XS: return installed[TB_IQ2XS] && installed[TB_KSIGNS];
    case T_IQ2_S: return installed[TB_IQ2S];
    case T_IQ3_XXS: return installed[TB_IQ3XXS] && installed[TB_KSIGNS];
    case T_IQ3_S: return installed[TB_IQ3S];
    case T_IQ1_S: case T_IQ1_M: return installed[TB_IQ1S];
    default: return 1;
    }
}

static PyObject *py_set_quant_table(PyObject *self, PyObject *const *a, Py_ssize_t na) {
    const char *name;
    if (na != 2 || !(name = PyUnicode_AsUTF8(a[0])))
        return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_TypeError, "set_quant_table(name, data)");
    for (int t = 0; t < TB_N; t++) {
        if (strcmp(name, tables[t].name)) continue;
        Py_buffer v;
        if (PyObject_GetBuffer(a[1], &v, PyBUF_C_CONTIGUOUS) < 0) return NULL;
        if ((size_t)v.len != tables[t].bytes) {
            PyBuffer_Release(&v);
            return PyErr_Format(PyExc_ValueError, "table %s: %zd bytes, expected %zu", name, v.len, tables[t].bytes);
        }
        memcpy(tables[t].dst, v.buf, tables[t].bytes);
        PyBuffer_Release(&v);
        if (t == TB_IQ3XXS) /* the nibble form of the same rows (quant_common.h) */
            for (int i = 0; i < 256; i++) {
                const uint8_t *g = mf_grid_iq3xxs + 4 * i;
                mf_iq3xxs_n01[i] = (uint8_t)(iq3xxs_code(g[0]) | iq3xxs_code(g[1]) << 4);
                mf_iq3xxs_n23[i] = (uint8_t)(iq3xxs_code(g[2]) | iq3xxs_code(g[3]) << 4);
            }
        if (t == TB_IQ2XXS) /* the 2-bit code form of the same rows (quant_common.h) */
            for (int i = 0; i < 256; i++) {
                const int8_t *g = mf_grid_iq2xxs + 8 * i;
                mf_iq2xxs_c03[i] = mf_iq2xxs_c47[i] = 0;
                for (int k = 0; k < 8; k++) {
                    const int c = g[k] == 8 ? 0 : g[k] == 25 ? 1 : 2; /* the grid's values: 8, 25, 43 */
                    if (k < 4) mf_iq2xxs_c03[i] |= (uint8_t)(c << (2 * k));
                    else mf_iq2xxs_c47[i] |= (uint8_t)(c << (2 * (k - 4)));
                }
            }
        if (t == TB_IQ1S) /* the unsigned form of the same rows (quant_common.h) */
            for (int i = 0; i < 4096; i++) {
                uint64_t v = 0;
                for (int k = 0; k < 8; k++)
                    v |= (uint64_t)(uint8_t)(8 * (mf_grid_iq1s[8 * (i & 2047) + k] + 1) + (i & 2048 ? 0 : 2)) << (8 * k);
                mf_iq1_u[i] = v;
            }
        if (t == TB_KSIGNS) /* the same signs as +-1 bytes (quant_common.h) */
            for (int i = 0; i < 128; i++) {
                uint64_t r = 0;
                for (int k = 0; k < 8; k++) r |= (uint64_t)((mf_ksigns_iq2xs[i] >> k) & 1 ? 0xFF : 0x01) << (8 * k);
                mf_ksign_u64[i] = r;
            }
        if (t == TB_IQ3S) /* the nibble form of the same rows (quant_common.h) */
            for (int i = 0; i < 512; i++) {
                const uint8_t *g = mf_grid_iq3s + 4 * i;
                mf_iq3s_n01[i] = (uint8_t)((g[0] & 15) | g[1] << 4);
                mf_iq3s_n23[i] = (uint8_t)((g[2] & 15) | g[3] << 4);
            }
        installed[t] = 1;
        Py_RETURN_NONE;
    }
    return PyErr_Format(PyExc_ValueError, "unknown quant table %s", name);
}

PyMethodDef mf_table_methods[] = {
    {"set_quant_table", (PyCFunction)(void (*)(void))py_set_quant_table, METH_FASTCALL, "set_quant_table(name, data): install an IQ lattice table"},
    {NULL, NULL, 0, NULL},
};
