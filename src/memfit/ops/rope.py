"""RoPE scaling helpers for model code (the rotation itself is ops.rope).

    yarn_corr_dims(n_rot, n_ctx_orig, base, beta_fast, beta_slow) -> (lo, hi)

YaRN's correction range, as ggml_rope_yarn_corr_dims computes it: the pair index at which a
rotation of base^(-2i/n_rot) completes beta turns over the original context is
n_rot * ln(n_ctx_orig / (2 pi beta)) / (2 ln base); lo is that of beta_fast rounded down, hi
that of beta_slow rounded up, clamped to [0, n_rot - 1]. Pairs below lo keep the extrapolated
(unscaled) angle, pairs above hi the interpolated one (ops.rope's ext_factor ramp). ggml
computes in float32; so does this, so the floor/ceil land where ggml's do.
"""

from __future__ import annotations

import numpy as np

_F = np.float32


def _corr_dim(n_rot: int, n_ctx_orig: int, n_rotations: float, base: float) -> np.float32:
    # n_rot * ln(n_ctx_orig / (n_rotations * 2 pi)) / (2 ln base), in float32 as ggml
    turns = _F(n_rotations) * _F(2) * _F(np.pi)
    return _F(n_rot) * np.log(_F(n_ctx_orig) / turns) / (_F(2) * np.log(_F(base)))


def yarn_corr_dims(n_rot: int, n_ctx_orig: int, base: float, beta_fast: float,
                   beta_slow: float) -> tuple[float, float]:
    """(lo, hi) for ops.rope(..., corr_dims=(lo, hi)): ggml_rope_yarn_corr_dims."""
    lo = np.floor(_corr_dim(n_rot, n_ctx_orig, beta_fast, base))
    hi = np.ceil(_corr_dim(n_rot, n_ctx_orig, beta_slow, base))
    return float(max(_F(0), lo)), float(min(_F(n_rot - 1), hi))
