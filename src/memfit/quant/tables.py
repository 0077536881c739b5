"""The IQ types' lattice tables for the native core, taken from gguf-py rather than retyped.

gguf.quants decodes ggml-common.h's grids (iq2xxs_grid .. iq1s_grid) from its own copy of
them into value arrays (``IQ2_XXS.grid`` etc., shape (1, 1, entries, width)) and holds
ggml's ksigns_iq2xs as ``IQ2_XXS.ksigns``. `install(native)` hands those values to
csrc/quant_tables.c once per process; the same package is the tests' reference
dequantizer, so kernels and oracle read one table.
"""

from __future__ import annotations

import numpy as np
from gguf import quants as _q

# native table name -> (gguf-py class, dtype of its values in C)
_GRIDS = {
    "iq2xxs": (_q.IQ2_XXS, np.int8), "iq2xs": (_q.IQ2_XS, np.int8), "iq2s": (_q.IQ2_S, np.int8),
    "iq3xxs": (_q.IQ3_XXS, np.uint8), "iq3s": (_q.IQ3_S, np.uint8), "iq1s": (_q.IQ1_S, np.int8),
}

_done = False


def grid(name: str) -> np.ndarray:
    """The lattice of one table as int8/uint8 [entries, width] (ggml's grid, value by value)."""
    cls, dtype = _GRIDS[name]
    cls.init_grid()
    g = np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
    return np.ascontiguousarray(g.astype(dtype))


def ksigns() -> np.ndarray:
    return np.frombuffer(_q.IQ2_XXS.ksigns, dtype=np.uint8).copy()


def install(native) -> None:
    global _done
    if _done:
        return
    for name in _GRIDS:
        native.set_quant_table(name, grid(name))
    native.set_quant_table("ksigns", ksigns())
    _done = True
