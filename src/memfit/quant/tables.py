"""The IQ types' lattice tables for the native core, taken from gguf-py rather than retyped.

gguf.quants decodes ggml-common.h's grids (iq2xxs_grid .. iq1s_grid) from its own copy of
them into value arrays (``IQ2_XXS.grid`` etc., shape (1, 1, entries, width)) and holds
ggml's ksigns_iq2xs as ``IQ2_XXS.ksigns``. `install(native)` hands those values to
csrc/quant_tables.c once per process; the same package is the tests' reference
dequantizer, so kernels and oracle read one table. Installed on first need (a model or a
call with one of these types: `ensure`), so a process that never meets them does not import
gguf-py (~3 MiB of RSS).
"""

from __future__ import annotations

import numpy as np

# native table name -> (gguf-py class name, dtype of its values in C)
_GRIDS = {
    "iq2xxs": ("IQ2_XXS", np.int8), "iq2xs": ("IQ2_XS", np.int8), "iq2s": ("IQ2_S", np.int8),
    "iq3xxs": ("IQ3_XXS", np.uint8), "iq3s": ("IQ3_S", np.uint8), "iq1s": ("IQ1_S", np.int8),
}

# the types whose kernels read these tables
LATTICE_TYPES = frozenset((16, 17, 18, 19, 21, 22, 29))  # IQ2_XXS IQ2_XS IQ3_XXS IQ1_S IQ3_S IQ2_S IQ1_M

_done = False


def grid(name: str) -> np.ndarray:
    """The lattice of one table as int8/uint8 [entries, width] (ggml's grid, value by value)."""
    from gguf import quants
    cls_name, dtype = _GRIDS[name]
    cls = getattr(quants, cls_name)
    cls.init_grid()
    g = np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
    return np.ascontiguousarray(g.astype(dtype))


def ksigns() -> np.ndarray:
    from gguf import quants
    return np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8).copy()


def ensure(type_id: int) -> None:
    """Install the tables if the type needs them (cheap once done)."""
    if not _done and type_id in LATTICE_TYPES:
        install()


def install(native=None) -> None:
    global _done
    if _done:
        return
    if native is None:
        from .. import _native as native
    for name in _GRIDS:
        native.set_quant_table(name, grid(name))
    native.set_quant_table("ksigns", ksigns())
    _done = True
