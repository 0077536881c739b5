"""Numpy reference dequantization: the readable definition of every supported type.

TEMPORARY: delegates to gguf.quants.dequantize until memfit's own numpy reference lands.
Interface (stable): dequantize(type_id, raw_uint8, n_elements) -> float32[n_elements].
"""

from __future__ import annotations

import numpy as np


def dequantize(type_id: int, raw: np.ndarray, n_elements: int) -> np.ndarray:
    import gguf
    out = gguf.quants.dequantize(np.asarray(raw, dtype=np.uint8), gguf.GGMLQuantizationType(type_id))
    return np.asarray(out, dtype=np.float32).reshape(-1)[:n_elements]
