"""How the native integer kernels round activations before a quantized matmul, in numpy.

llama.cpp quantizes each activation row to its weight type's vec_dot_type before dotting in
integers; memfit's kernels do the same (csrc/quant_avx2.c, quant_avx512.c):

- 32-element weight types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL): Q8_0/Q8_1 blocks of 32,
  d = amax / 127 in f32, q = round_half_even(x * (1 / d)), d stored rounded to f16 (the
  Q8_1 sum s = d * sum(q) is taken with that rounded d, so it equals the sum of the values).
- 256-element K-quants and IQ4_XS: Q8_K blocks of 256, iscale = 127 / amax, d = 1 / iscale,
  both f32.

    round_activations(x[n, cols] f32, block) -> f32[n, cols]: the values the kernel dots with

The float64 product of these values with the dequantized weights is what the kernels compute
up to f32 rounding of the block sums (~1e-7 relative), so tests can bound the kernels tightly.
"""

from __future__ import annotations

import numpy as np


def round_activations(x: np.ndarray, block: int) -> np.ndarray:
    assert block in (32, 256) and x.ndim == 2 and x.shape[1] % block == 0, (x.shape, block)
    n, cols = x.shape
    b = np.ascontiguousarray(x, dtype=np.float32).reshape(n, cols // block, block)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    nz = amax != 0
    safe = np.where(nz, amax, np.float32(1))
    if block == 256:
        iscale = np.where(nz, np.float32(127) / safe, np.float32(0)).astype(np.float32)
        d = np.where(nz, np.float32(1) / np.where(nz, iscale, np.float32(1)), np.float32(0))
    else:
        d32 = (amax / np.float32(127)).astype(np.float32)
        iscale = np.where(nz, np.float32(1) / np.where(nz, d32, np.float32(1)), np.float32(0))
        d = d32.astype(np.float16).astype(np.float32)
    q = np.rint(b * iscale.astype(np.float32))
    return (q * d.astype(np.float32)).astype(np.float32).reshape(n, cols)
