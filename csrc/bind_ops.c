/* Placeholder until the ops bindings land: an empty method table. */
#include "memfit.h"

PyMethodDef mf_ops_methods[] = {{NULL, NULL, 0, NULL}};
