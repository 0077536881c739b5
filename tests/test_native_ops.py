"""Native forward ops (csrc/ops.c via memfit._native) against the numpy reference
(memfit.ops.reference), on every ISA path this CPU runs (scalar included, via set_isa).

Tolerance: |native - reference| <= 1e-5 * |reference| + 1e-5 * max|reference| elementwise
(float32 rounding of different summation orders and of the vectorized exp). Shapes are large
enough in places to go through the thread pool (work above ops.c's PAR_MIN)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import isa_paths

N = pytest.importorskip("memfit._native")
from memfit.ops import reference as R  # noqa: E402

assert hasattr(N, "attention"), "memfit._native is stale: rebuild it (pip install -e .)"

RTOL = 1e-5


@pytest.fixture(params=isa_paths(), autouse=True)
def isa(request):
    prev = N.isa()
    N.set_isa(request.param)
    yield request.param
    N.set_isa(prev)


def close(a: np.ndarray, b: np.ndarray, rtol: float = RTOL) -> None:
    assert a.dtype == np.float32 and a.shape == b.shape, (a.dtype, a.shape, b.shape)
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    # floor 1e-30: results under float32's normal range (denormals) may flush to 0
    np.testing.assert_allclose(a, b, rtol=rtol, atol=max(rtol * scale, 1e-30))


def rnd(rng, *shape, s=1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * s).astype(np.float32)


# ---------------------------------------------------------------------------------- rmsnorm

@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (3, 77), (2, 4096), (100, 1000), (2, 3, 50)])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rmsnorm(shape, with_weight):
    rng = np.random.default_rng(1)
    x = rnd(rng, *shape, s=3.0)
    w = rnd(rng, shape[-1]) if with_weight else None
    close(N.rmsnorm(x, w, 1e-6), R.rmsnorm(x, w, 1e-6))
    close(N.rmsnorm(x, w, eps=0.5), R.rmsnorm(x, w, 0.5))


def test_rmsnorm_in_place_and_out():
    rng = np.random.default_rng(2)
    x = rnd(rng, 9, 130)
    w = rnd(rng, 130)
    ref = R.rmsnorm(x, w, 1e-5)
    out = np.empty_like(x)
    assert N.rmsnorm(x, w, 1e-5, out) is out
    close(out, ref)
    assert N.rmsnorm(x, w, 1e-5, out=x) is x
    close(x, ref)


# ---------------------------------------------------------------------------------- rope

@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("n,heads,head_dim,n_rot,base,fscale", [
    (1, 1, 64, 64, 10000.0, 1.0),
    (5, 3, 80, 64, 10000.0, 0.25),        # n_rot < head_dim: dims 64..79 pass through
    (37, 4, 128, 128, 1e6, 1.0),          # through the pool
    (2, 2, 256, 256, 1e6, 0.125),
    (3, 9, 64, 32, 500000.0, 2.0),
])
def test_rope(neox, n, heads, head_dim, n_rot, base, fscale):
    rng = np.random.default_rng(3)
    x = rnd(rng, n, heads, head_dim)
    pos = rng.integers(0, 40000, n).astype(np.int32)
    pos[0] = 0
    y = N.rope(x, pos, n_rot, base, fscale, neox)
    close(y, R.rope(x, pos, n_rot, base, fscale, neox))
    assert np.array_equal(y[..., n_rot:], x[..., n_rot:])
    assert np.array_equal(y[0], x[0])  # position 0 is the identity


def test_rope_freq_factors_and_in_place():
    rng = np.random.default_rng(4)
    x = rnd(rng, 6, 4, 64)
    pos = np.arange(100, 106, dtype=np.int32)
    ff = (1.0 + rng.random(32) * 7.0).astype(np.float32)
    for neox in (False, True):
        ref = R.rope(x, pos, 64, 500000.0, 1.0, neox, freq_factors=ff)
        close(N.rope(x, pos, 64, 500000.0, 1.0, neox, freq_factors=ff), ref)
        close(N.rope(x, pos, 64, 500000.0, 1.0, neox, ff), ref)  # positional, as in reference.rope
        xc = x.copy()
        assert N.rope(xc, pos, 64, 500000.0, 1.0, neox, out=xc) is xc
        close(xc, R.rope(x, pos, 64, 500000.0, 1.0, neox))


def test_rope_styles_differ_as_defined():
    # one pair rotated by 90 degrees: normal moves x[0] into x[1], neox moves x[0] into x[half]
    x = np.zeros((1, 1, 8), np.float32)
    x[0, 0, 0] = 1.0
    pos = np.array([1], np.int32)
    base = 10000.0
    fs = (np.pi / 2)  # theta_0 = pos * freq_scale = pi/2
    y = N.rope(x, pos, 8, base, fs, False)
    np.testing.assert_allclose(y[0, 0], [0, 1, 0, 0, 0, 0, 0, 0], atol=1e-6)
    y = N.rope(x, pos, 8, base, fs, True)
    np.testing.assert_allclose(y[0, 0], [0, 0, 0, 0, 1, 0, 0, 0], atol=1e-6)


# ---------------------------------------------------------------------------------- softmax

@pytest.mark.parametrize("shape,s", [((1, 1), 1.0), ((1, 5), 1.0), ((4, 33), 10.0), ((2, 3, 1000), 30.0),
                                     ((80, 1000), 3.0), ((7,), 1.0)])
def test_softmax(shape, s):
    rng = np.random.default_rng(5)
    x = rnd(rng, *shape, s=s)
    y = N.softmax(x)
    close(y, R.softmax(x))
    np.testing.assert_allclose(y.sum(-1), 1.0, rtol=1e-5)


def test_softmax_masked_entries_and_in_place():
    rng = np.random.default_rng(6)
    x = rnd(rng, 3, 21, s=5.0)
    x[:, ::3] = -np.inf
    ref = R.softmax(x)
    assert N.softmax(x, out=x) is x
    close(x, ref)
    assert np.all(x[:, ::3] == 0.0)


# ---------------------------------------------------------------------------------- gated

def gelu64(g):
    # 0.5 g (1 + tanh(y)) == g / (1 + exp(-2y)): the same tanh approximation, without the
    # cancellation of 1 + tanh(y) for g << 0
    g = g.astype(np.float64)
    y = np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3)
    return g / (1.0 + np.exp(-2.0 * y))


@pytest.mark.parametrize("shape", [(1, 1), (1, 9), (3, 1537), (70, 1000)])
def test_silu_gelu_mul(shape):
    rng = np.random.default_rng(7)
    g = rnd(rng, *shape, s=4.0)
    g.flat[:3] = [-100.0, 100.0, 0.0][: g.size]
    u = rnd(rng, *shape)
    with np.errstate(over="ignore"):
        close(N.silu_mul(g, u), R.silu_mul(g, u))
        close(N.gelu_mul(g, u), R.gelu_mul(g, u))
    # float64 oracle of the tanh approximation (llama.cpp's gelu), elementwise relative
    with np.errstate(over="ignore"):
        silu64 = g.astype(np.float64) / (1.0 + np.exp(-g.astype(np.float64))) * u
        close(N.gelu_mul(g, u), gelu64(g) * u, rtol=2e-6)
    close(N.silu_mul(g, u), silu64, rtol=2e-6)


def test_gated_out_aliases_gate():
    rng = np.random.default_rng(8)
    g, u = rnd(rng, 4, 100), rnd(rng, 4, 100)
    ref = R.silu_mul(g, u)
    assert N.silu_mul(g, u, out=g) is g
    close(g, ref)


# ---------------------------------------------------------------------------------- attention

ATTN_CASES = [
    # n, T, Hq, Hkv, D, Dv, window, softcap
    (1, 1, 1, 1, 64, 64, 0, 0.0),          # first decode step
    (1, 700, 8, 2, 128, 128, 0, 0.0),      # long decode, GQA 4
    (1, 700, 4, 1, 256, 256, 512, 0.0),    # gemma3-like SWA decode, window < T
    (33, 33, 4, 1, 256, 256, 10, 0.0),     # prefill, window
    (17, 80, 9, 3, 64, 64, 0, 1.5),        # prefill after a prefix, softcap on
    (5, 40, 2, 2, 80, 80, 7, 2.0),         # window + softcap
    (6, 50, 8, 8, 20, 12, 0, 0.0),         # odd head dims, D != Dv
    (64, 64, 8, 4, 64, 64, 0, 0.0),        # bigger prefill, through the pool
    (1, 300, 9, 3, 64, 64, 0, 0.0),        # smollm2 decode: head groups split unevenly per task
    (3, 40, 8, 1, 64, 64, 0, 0.0),         # GQA 8: more heads per kv head than one task takes
]


def qkv(rng, n, T, Hq, Hkv, D, Dv):
    return rnd(rng, n, Hq, D, s=2.0), rnd(rng, T, Hkv, D), rnd(rng, T, Hkv, Dv)


@pytest.mark.parametrize("n,T,Hq,Hkv,D,Dv,window,softcap", ATTN_CASES)
def test_attention(n, T, Hq, Hkv, D, Dv, window, softcap):
    rng = np.random.default_rng(9)
    q, k, v = qkv(rng, n, T, Hq, Hkv, D, Dv)
    kv_pos = np.arange(T, dtype=np.int32)
    q_pos = np.arange(T - n, T, dtype=np.int32)
    scale = 1.0 / np.sqrt(D)
    ref = R.attention(q, k, v, q_pos, kv_pos, scale, window, softcap)
    out = np.full((n, Hq, Dv), np.nan, np.float32)
    assert N.attention(q, k, v, q_pos, kv_pos, scale, window, softcap, out) is out
    close(out, ref)
    close(N.attention(q, k, v, q_pos, kv_pos, scale, window=window, softcap=softcap), ref)


@pytest.fixture
def f32_numerics():
    # the f32-accumulating attention for f16 caches (MEMFIT_ATTN=f32); the default is
    # llama.cpp's flash-attention order (test_attention_f16_cache_in_llamacpp_order)
    before = N.attn_numerics("f32")
    yield
    N.attn_numerics(before)


@pytest.mark.parametrize("n,T,Hq,Hkv,D,Dv,window,softcap", ATTN_CASES)
def test_attention_f16_cache_in_llamacpp_order(n, T, Hq, Hkv, D, Dv, window, softcap):
    # the default numerics of an f16 cache: llama.cpp's CPU flash attention (per-key max and
    # sum, an f16 accumulator), against its numpy emulation
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng, n, T, Hq, Hkv, D, Dv)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    kv_pos = np.arange(T, dtype=np.int32)
    q_pos = np.arange(T - n, T, dtype=np.int32)
    args = (q_pos, kv_pos, 1.0 / np.sqrt(D), window, softcap)
    assert N.attn_numerics() == "llama"
    a = N.attention(q, k16, v16, *args)
    np.testing.assert_allclose(a, R.attention_fa16(q, k16, v16, *args), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("n,T,Hq,Hkv,D,Dv,window,softcap", ATTN_CASES)
def test_attention_f16_cache_equals_same_values_f32(f32_numerics, n, T, Hq, Hkv, D, Dv, window, softcap):
    # an f16 K/V cache is read as the f32 values it holds: bit-identical results
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng, n, T, Hq, Hkv, D, Dv)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    kv_pos = np.arange(T, dtype=np.int32)
    q_pos = np.arange(T - n, T, dtype=np.int32)
    args = (q_pos, kv_pos, 1.0 / np.sqrt(D), window, softcap)
    a = N.attention(q, k16, v16, *args)
    np.testing.assert_array_equal(a, N.attention(q, k16.astype(np.float32), v16.astype(np.float32), *args))
    close(a, R.attention(q, k16, v16, *args))
    with pytest.raises(TypeError, match="same dtype"):
        N.attention(q, k16, v, *args)


def test_f32_to_f16_matches_numpy():
    rng = np.random.default_rng(3)
    edge = np.array([0.0, -0.0, 1.0, 65504.0, 65519.99, 65520.0, -70000.0, np.inf, -np.inf,
                     6.1e-5, 6.0e-5, 5.96e-8, 2.98e-8, 2.99e-8, 1e-9, 1.00048828125,
                     1.000732421875, 0.333333], np.float32)
    x = np.concatenate([edge, rng.standard_normal(1000).astype(np.float32) * 100,
                        (rng.standard_normal(333) * 1e-5).astype(np.float32)])
    out = np.empty(x.size, np.float16)
    N.f32_to_f16(x, out)
    with np.errstate(over="ignore"):  # 65520 and beyond round to inf, as intended
        want = x.astype(np.float16)
    np.testing.assert_array_equal(out.view(np.uint16), want.view(np.uint16))


def test_attention_masks_by_position_not_index():
    # shuffled cache slots (paged KV): only positions decide visibility
    rng = np.random.default_rng(10)
    n, T = 4, 30
    q, k, v = qkv(rng, n, T, 4, 2, 64, 64)
    kv_pos = rng.permutation(T).astype(np.int32)
    q_pos = np.array([3, 29, 12, 20], np.int32)
    for window, softcap in [(0, 0.0), (6, 0.0), (4, 3.0)]:
        close(N.attention(q, k, v, q_pos, kv_pos, 0.125, window, softcap),
              R.attention(q, k, v, q_pos, kv_pos, 0.125, window, softcap))


def test_attention_window_by_hand():
    # q_pos 4, window 2: keys at positions 3 and 4 only (llama.cpp masks q_pos - kv_pos >= window);
    # equal scores, so the output is the mean of their one-hot values
    T = 5
    q = np.zeros((1, 1, 8), np.float32)
    k = np.ones((T, 1, 8), np.float32)
    v = np.eye(T, dtype=np.float32)[:, None, :]
    pos = np.arange(T, dtype=np.int32)
    y = N.attention(q, k, v, np.array([4], np.int32), pos, 1.0, 2)
    np.testing.assert_allclose(y[0, 0], [0, 0, 0, 0.5, 0.5], atol=1e-7)
    y = N.attention(q, k, v, np.array([2], np.int32), pos, 1.0)  # causal only
    np.testing.assert_allclose(y[0, 0], [1 / 3, 1 / 3, 1 / 3, 0, 0], atol=1e-7)


def test_attention_softcap_bounds_scores():
    # with softcap c the largest score gap is < 2c, so a huge q cannot make softmax one-hot
    q = np.zeros((1, 1, 4), np.float32)
    q[0, 0, 0] = 1e4
    k = np.zeros((2, 1, 4), np.float32)
    k[0, 0, 0] = 1.0
    v = np.eye(2, dtype=np.float32)[:, None, :]
    pos = np.array([0, 1], np.int32)
    y = N.attention(q, k, v, np.array([1], np.int32), pos, 1.0, 0, 1.0)
    w0 = 1.0 / (1.0 + np.exp(-np.tanh(1e4)))  # softmax([tanh(1e4), 0])[0]
    np.testing.assert_allclose(y[0, 0], [w0, 1 - w0], rtol=1e-6)


def test_attention_no_visible_key_gives_zeros():
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng, 2, 3, 2, 1, 16, 16)
    y = N.attention(q, k, v, np.array([1, 9], np.int32), np.array([5, 6, 7], np.int32), 0.25, 2)
    assert np.all(y == 0.0)
    y = N.attention(q, k[:0], v[:0], np.array([1, 9], np.int32), np.zeros(0, np.int32), 0.25)
    assert y.shape == (2, 2, 16) and np.all(y == 0.0)


# ---------------------------------------------------------------------------------- boundary

def test_argument_errors():
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(TypeError, match="float32"):
        N.rmsnorm(x.astype(np.float64), None, 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        N.softmax(np.zeros((8, 8), np.float32)[:, ::2])
    with pytest.raises(TypeError, match="float32"):
        N.softmax([1.0, 2.0])
    with pytest.raises(ValueError, match="weight"):
        N.rmsnorm(x, np.ones(7, np.float32), 1e-5)
    with pytest.raises(ValueError, match="out"):
        N.softmax(x, out=np.zeros((2, 9), np.float32))
    with pytest.raises(ValueError, match="up"):
        N.silu_mul(x, np.zeros((2, 9), np.float32))
    x3 = np.zeros((2, 1, 8), np.float32)
    with pytest.raises(ValueError, match="n_rot"):
        N.rope(x3, np.zeros(2, np.int32), 7, 1e4, 1.0, False)
    with pytest.raises(TypeError, match="int32"):
        N.rope(x3, np.zeros(2, np.int64), 8, 1e4, 1.0, False)
    with pytest.raises(ValueError, match="pos"):
        N.rope(x3, np.zeros(3, np.int32), 8, 1e4, 1.0, False)
    q, k = np.zeros((1, 3, 8), np.float32), np.zeros((4, 2, 8), np.float32)
    p1, p4 = np.zeros(1, np.int32), np.zeros(4, np.int32)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        N.attention(q, k, k, p1, p4, 1.0)
    with pytest.raises(ValueError, match="k must be"):
        N.attention(q[:, :2], np.ascontiguousarray(k[..., :4]), k, p1, p4, 1.0)
    with pytest.raises(ValueError, match="kv_pos"):
        N.attention(q[:, :2], k, k, p1, p4[:3], 1.0)
    with pytest.raises(TypeError, match="missing"):
        N.attention(q, k, k, p1, p4)
    with pytest.raises(TypeError, match="unexpected keyword"):
        N.softmax(x, outt=x)
