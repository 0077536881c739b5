"""The kernels of gpt-oss, deepseek2 and glm-dsa (issue 19), on both backends and every ISA
path: YaRN rope, attention sinks, swiglu_oai and the grouped MoE FFN with its activation id and
biases, per-head matmuls. Each is checked against a float64 recomputation written here from
ggml's definitions (odd shapes, heads that are not powers of two), and the new arguments at
their defaults against the calls of before (bit for bit).

Bounds: elementwise ops and attention over f32/f16 rows, |got - ref| <= 2e-5 * max|ref| (float32
rounding; the vectorized exp is within 2 ulp); matmuls and the fused MoE against the float64
product with the activations rounded as the ISA's kernel rounds them (memfit.quant.activations;
the MoE's hidden state too, before down) 1e-5 of the largest output, as
tests/test_native_quant.py (measured 1e-7..4e-7)."""

from __future__ import annotations

import math

import numpy as np
import pytest

N = pytest.importorskip("memfit._native")
from memfit.kv import quant as kq  # noqa: E402
from memfit.kv.seq import SeqKV  # noqa: E402
from memfit.ops import QTensor  # noqa: E402
from memfit.ops import native as NV  # noqa: E402
from memfit.ops import reference as R  # noqa: E402
from memfit.ops.rope import yarn_corr_dims  # noqa: E402
from memfit.quant.activations import round_activations  # noqa: E402
from memfit.quant.random import random_weight  # noqa: E402
from memfit.quant.reference import dequantize  # noqa: E402
from memfit.quant.types import BY_NAME  # noqa: E402

TOL = 2e-5


def close(got: np.ndarray, ref: np.ndarray, tol: float = TOL) -> None:
    assert got.dtype == np.float32 and got.shape == ref.shape, (got.dtype, got.shape, ref.shape)
    scale = max(float(np.abs(ref).max()), 1e-30)
    err = float(np.abs(got.astype(np.float64) - ref).max()) / scale
    assert err <= tol, f"max error {err:.3g} of max |ref| (bound {tol:g})"


def rnd(rng, *shape, s=1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * s).astype(np.float32)


def deq(w: QTensor) -> np.ndarray:
    return dequantize(w.type.id, w.data.reshape(-1), math.prod(w.shape)).reshape(w.shape)


# ------------------------------------------------------------------------------- YaRN rope

def rope64(x, pos, n_rot, base, freq_scale, neox, ff=None, ext_factor=0.0, attn_factor=1.0,
           corr_dims=(0.0, 0.0)):
    """ggml's rope_yarn in float64: theta_extrap = p base^(-2i/n_rot) / ff_i, theta_interp =
    freq_scale theta_extrap, ramp on i0 / 2 = i, mscale only with ext_factor."""
    x = x.astype(np.float64)
    half = n_rot // 2
    out = x.copy()
    for r, p in enumerate(pos):
        for i in range(half):
            te = p * base ** (-2.0 * i / n_rot) / (1.0 if ff is None else float(ff[i]))
            ti = freq_scale * te
            th, ms = ti, attn_factor
            if ext_factor != 0.0:
                y = (i - corr_dims[0]) / max(0.001, corr_dims[1] - corr_dims[0])
                mix = (1.0 - min(1.0, max(0.0, y))) * ext_factor
                th = ti * (1.0 - mix) + te * mix
                ms = attn_factor * (1.0 + 0.1 * math.log(1.0 / freq_scale))
            c, s = math.cos(th) * ms, math.sin(th) * ms
            a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
            x0, x1 = x[r, :, a], x[r, :, b]
            out[r, :, a], out[r, :, b] = x0 * c - x1 * s, x0 * s + x1 * c
    return out


def test_yarn_corr_dims_as_ggml():
    # DeepSeek-V2's yarn: n_rot 64, original context 4096, base 10000, beta 32 / 1
    assert yarn_corr_dims(64, 4096, 10000.0, 32.0, 1.0) == (10.0, 23.0)
    for n_rot, ctx, base, bf, bs in [(64, 4096, 10000.0, 32.0, 1.0), (128, 8192, 500000.0, 32.0, 1.0),
                                     (64, 4096, 150000.0, 32.0, 1.0), (96, 2048, 10000.0, 16.0, 2.0)]:
        def dim(beta):
            return n_rot * math.log(ctx / (beta * 2 * math.pi)) / (2 * math.log(base))
        lo, hi = yarn_corr_dims(n_rot, ctx, base, bf, bs)
        assert lo == max(0.0, math.floor(dim(bf))) and hi == min(n_rot - 1.0, math.ceil(dim(bs)))
        assert isinstance(lo, float) and isinstance(hi, float)
    # clamped: a tiny context puts lo below 0, a huge one hi above n_rot - 1
    assert yarn_corr_dims(64, 16, 10000.0, 32.0, 1.0)[0] == 0.0
    assert yarn_corr_dims(64, 10**9, 10000.0, 32.0, 1.0)[1] == 63.0


# n, heads, head_dim, n_rot, base, freq_scale, ext_factor, attn_factor (odd counts; n_rot <
# head_dim passes dims through)
YARN = [
    (1, 3, 64, 64, 10000.0, 0.25, 1.0, 1.0),
    (3, 5, 80, 64, 10000.0, 0.025, 1.0, 0.7),
    (7, 3, 96, 96, 1e6, 0.125, 0.5, 1.0),
    (5, 1, 64, 32, 50000.0, 0.5, 0.0, 0.8),     # no ext_factor: only the attn_factor scale
    (37, 6, 128, 64, 10000.0, 0.1, 1.0, 1.2),   # through the pool
]


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("n,heads,hd,n_rot,base,fs,ext,attn", YARN)
def test_rope_yarn_float64(isa, neox, n, heads, hd, n_rot, base, fs, ext, attn):
    rng = np.random.default_rng(n * 7 + hd)
    x = rnd(rng, n, heads, hd, s=2.0)
    pos = rng.integers(0, 20000, n).astype(np.int32)
    pos[0] = 4097
    cd = yarn_corr_dims(n_rot, 4096, base, 32.0, 1.0)
    assert any(cd[0] < i < cd[1] for i in range(n_rot // 2)), cd  # the ramp is exercised
    ff = (1.0 + rng.random(n_rot // 2) * 3).astype(np.float32) if n == 3 else None
    kw = dict(ext_factor=ext, attn_factor=attn, corr_dims=cd)
    ref = rope64(x, pos, n_rot, base, fs, neox, ff, **kw)
    close(N.rope(x, pos, n_rot, base, fs, neox, ff, **kw), ref)
    close(R.rope(x, pos, n_rot, base, fs, neox, ff, **kw), ref)
    # in place, and the two backends within float32 rounding of each other
    y = x.copy()
    assert N.rope(y, pos, n_rot, base, fs, neox, ff, out=y, **kw) is y
    close(y, ref)


def test_rope_defaults_are_todays_bits(isa):
    rng = np.random.default_rng(5)
    x = rnd(rng, 9, 3, 96)
    pos = rng.integers(0, 100000, 9).astype(np.int32)
    ff = (1.0 + rng.random(32)).astype(np.float32)
    for neox in (False, True):
        for fs in (1.0, 0.25):
            for f in (None, ff):
                d = dict(ext_factor=0.0, attn_factor=1.0, corr_dims=(0.0, 0.0))
                for be in (N, R):
                    a = be.rope(x, pos, 64, 10000.0, fs, neox, f)
                    np.testing.assert_array_equal(be.rope(x, pos, 64, 10000.0, fs, neox, f, **d), a)
                # the default path is the formula of before: float64 angle, cos/sin rounded once
                close(N.rope(x, pos, 64, 10000.0, fs, neox, f), rope64(x, pos, 64, 10000.0, fs, neox, f))
    # corr_dims is ignored without ext_factor; a NumPy pair works as a tuple
    a = N.rope(x, pos, 64, 1e4, 0.5, True, attn_factor=0.9)
    np.testing.assert_array_equal(a, N.rope(x, pos, 64, 1e4, 0.5, True, attn_factor=0.9,
                                            corr_dims=np.array([3.0, 9.0])))


def test_rope_yarn_argument_errors():
    x = np.zeros((1, 1, 8), np.float32)
    p = np.zeros(1, np.int32)
    with pytest.raises(ValueError, match="corr_dims"):
        N.rope(x, p, 8, 1e4, 1.0, False, ext_factor=1.0, corr_dims=(1.0,))
    with pytest.raises(TypeError, match="ext_factor"):
        N.rope(x, p, 8, 1e4, 1.0, False, ext_factor="a")


