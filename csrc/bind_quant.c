/* Placeholder: quant bindings (dequantize, matmul, get_rows) land here. */
#include "memfit.h"

PyMethodDef mf_quant_methods[] = {{NULL, NULL, 0, NULL}};
