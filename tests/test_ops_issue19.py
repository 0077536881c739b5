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


# ------------------------------------------------------------------------- attention sinks

def attn64(q, k, v, q_pos, kv_pos, scale, window=0, softcap=0.0, sinks=None):
    """softmax over the visible keys and the head's sink (raw: neither scaled nor capped), in
    float64; the sink has no value row. A query that sees nothing gets zeros."""
    n, hq, _ = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = np.zeros((n, hq, v.shape[2]))
    for i in range(n):
        vis = kv_pos <= q_pos[i]
        if window > 0:
            vis &= (q_pos[i] - kv_pos) < window
        if not vis.any():
            continue
        for h in range(hq):
            s = k[vis, h // g].astype(np.float64) @ q[i, h].astype(np.float64) * scale
            if softcap > 0:
                s = softcap * np.tanh(s / softcap)
            m = s.max() if sinks is None else max(s.max(), float(sinks[h]))
            e = np.exp(s - m)
            den = e.sum() + (0.0 if sinks is None else math.exp(float(sinks[h]) - m))
            out[i, h] = (e / den) @ v[vis, h // g].astype(np.float64)
    return out


# n, T, Hq, Hkv, D, Dv, window, softcap
SINK_CASES = [
    (1, 1, 3, 1, 32, 32, 0, 0.0),
    (3, 70, 6, 2, 64, 64, 0, 0.0),
    (7, 133, 5, 5, 40, 24, 0, 30.0),       # Dv != D, odd dims (tails past the 8-lane loops)
    (7, 150, 9, 3, 64, 64, 48, 0.0),       # sliding window (gpt-oss's even layers)
    (3, 90, 6, 3, 64, 64, 17, 20.0),       # window and softcap
]


def _sink_inputs(n, T, Hq, Hkv, D, Dv, seed):
    rng = np.random.default_rng(seed)
    q, k, v = rnd(rng, n, Hq, D), rnd(rng, T, Hkv, D), rnd(rng, T, Hkv, Dv)
    q_pos = np.sort(rng.choice(np.arange(T), n, replace=False)).astype(np.int32)
    q_pos[-1] = T - 1
    kv_pos = np.arange(T, dtype=np.int32)
    # sinks from well below to well above the scores: both branches of m = max(scores, sink)
    sinks = np.linspace(-6.0, 8.0, Hq).astype(np.float32)
    return q, k, v, q_pos, kv_pos, sinks


@pytest.fixture
def f32_numerics():
    # these compare f16 caches with float64 under the f32-accumulating numerics
    # (MEMFIT_ATTN=f32); llama.cpp's order with sinks: test_sinks_in_llamacpp_order
    before = N.attn_numerics("f32")
    yield
    N.attn_numerics(before)


def test_sinks_in_llamacpp_order(isa):
    # the default f16-cache numerics with sinks, against the numpy emulation (sinks after the
    # keys, as ggml's flash attention)
    q, k, v, q_pos, kv_pos, sinks = _sink_inputs(3, 70, 6, 2, 64, 64, 5)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    got = N.attention(q, k16, v16, q_pos, kv_pos, 0.125, 0, 0.0, sinks=sinks)
    want = R.attention_fa16(q, k16, v16, q_pos, kv_pos, 0.125, 0, 0.0, sinks=sinks)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("n,T,Hq,Hkv,D,Dv,window,softcap", SINK_CASES)
def test_attention_sinks_float64(f32_numerics, isa, n, T, Hq, Hkv, D, Dv, window, softcap):
    q, k, v, qp, kp, sk = _sink_inputs(n, T, Hq, Hkv, D, Dv, T + D)
    scale = 1.0 / math.sqrt(D)
    ref = attn64(q, k, v, qp, kp, scale, window, softcap, sk)
    assert np.abs(ref - attn64(q, k, v, qp, kp, scale, window, softcap)).max() > 1e-3  # sinks matter
    close(N.attention(q, k, v, qp, kp, scale, window, softcap, sinks=sk), ref)
    close(R.attention(q, k, v, qp, kp, scale, window, softcap, sinks=sk), ref)
    # f16 rows: the values the cache holds
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    ref16 = attn64(q, k16, v16, qp, kp, scale, window, softcap, sk)
    close(N.attention(q, k16, v16, qp, kp, scale, window, softcap, sinks=sk), ref16)
    # kv cache rows (f32, f16): llama.cpp's loop with the sink after the keys
    for t, kk, vv, r in ((kq.F32, k, v, ref), (kq.F16, k16, v16, None)):
        kr, vr = kq.quantize_ref(t, kk), kq.quantize_ref(t, vv)
        if r is None:  # f16 K: q read as f16, as llama.cpp
            r = attn64(q.astype(np.float16), k16, v16, qp, kp, scale, window, softcap, sk)
        close(NV.attention_kvq(q, kr, vr, qp, kp, scale, window, softcap, t, t, sinks=sk), r)
        close(R.attention_kvq(q, kr, vr, qp, kp, scale, window, softcap, t, t, sinks=sk), r)


@pytest.mark.parametrize("n,T,Hq,Hkv,D,Dv,window,softcap",
                         [c for c in SINK_CASES if c[1] > 1 and c[4] % 32 == 0 and c[5] % 32 == 0])
def test_attention_kvq_quantized_sinks(isa, n, T, Hq, Hkv, D, Dv, window, softcap):
    # q8_0 / q4_0 K and V: the native loop against the numpy reference of llama.cpp's scores
    # (float64 softmax), and the float64 recomputation over the dequantized rows with q in q8_0
    q, k, v, qp, kp, sk = _sink_inputs(n, T, Hq, Hkv, D, Dv, 3 * T)
    scale = 1.0 / math.sqrt(D)
    for tk, tv in ((kq.Q8_0, kq.Q8_0), (kq.Q4_0, kq.Q8_0), (kq.Q8_0, kq.F16)):
        kr, vr = kq.quantize_ref(tk, k), kq.quantize_ref(tv, v)
        got = NV.attention_kvq(q, kr, vr, qp, kp, scale, window, softcap, tk, tv, sinks=sk)
        close(got, R.attention_kvq(q, kr, vr, qp, kp, scale, window, softcap, tk, tv, sinks=sk))
        qr = kq.dequantize_ref(kq.Q8_0, kq.quantize_ref(kq.Q8_0, q), D)
        r64 = attn64(qr, kq.dequantize_ref(tk, kr, D), kq.dequantize_ref(tv, vr, Dv), qp, kp, scale,
                     window, softcap, sk)
        close(got, r64, 1e-4)


def test_sinks_none_is_todays_bits(isa):
    q, k, v, qp, kp, _ = _sink_inputs(5, 80, 6, 2, 64, 64, 9)
    for args in ((0.125,), (0.125, 20, 30.0)):
        a = N.attention(q, k, v, qp, kp, *args)
        np.testing.assert_array_equal(N.attention(q, k, v, qp, kp, *args, sinks=None), a)
        b = R.attention(q, k, v, qp, kp, *args)
        np.testing.assert_array_equal(R.attention(q, k, v, qp, kp, *args, sinks=None), b)
    for t in (kq.F16, kq.Q8_0):
        kr, vr = kq.quantize_ref(t, k), kq.quantize_ref(t, v)
        a = NV.attention_kvq(q, kr, vr, qp, kp, 0.125, 0, 0.0, t, t)
        np.testing.assert_array_equal(NV.attention_kvq(q, kr, vr, qp, kp, 0.125, 0, 0.0, t, t, sinks=None), a)


def test_sink_by_hand(isa):
    # one visible key with score s and V = 1: the output is e^s / (e^s + e^sink) = sigmoid(s -
    # sink); the sink is taken as given (scale and softcap touch only the score)
    q = np.full((1, 2, 8), 0.5, np.float32)
    k = np.ones((1, 1, 8), np.float32)
    v = np.ones((1, 1, 8), np.float32)
    sinks = np.array([0.3, -1.0], np.float32)
    p0 = np.zeros(1, np.int32)
    for scale, cap in ((1.0, 0.0), (0.25, 0.0), (1.0, 2.0)):
        s = 4.0 * scale
        s = cap * math.tanh(s / cap) if cap else s
        want = [1.0 / (1.0 + math.exp(float(sk) - s)) for sk in sinks]
        for got in (N.attention(q, k, v, p0, p0, scale, 0, cap, sinks=sinks),
                    R.attention(q, k, v, p0, p0, scale, 0, cap, sinks=sinks)):
            np.testing.assert_allclose(got[0, :, 0], want, rtol=1e-6)
    # no visible key: zeros, with or without a sink
    got = N.attention(q, k, v, p0, np.array([1], np.int32), 1.0, sinks=sinks)
    assert not got.any()


@pytest.mark.parametrize("cache", ["f16", "q8_0"])
def test_batchkv_attend_sinks(f32_numerics, isa, cache):
    # the engine's path: SeqKV blocks (paged pool), two forwards (a prompt, then one token),
    # native and numpy backends against the float64 recomputation over the rows given (f16:
    # the values stored; q8_0: within its quantization, rotation and all)
    rng = np.random.default_rng(11)
    Hq, Hkv, D = 6, 2, 64
    sinks = rng.uniform(-3, 3, Hq).astype(np.float32)
    outs = {}
    for name, ops in (("native", NV), ("numpy", R)):
        rng = np.random.default_rng(12)
        cache_kv = SeqKV.new(1, 96, Hkv, D, cache_type=cache)
        ks, vs, res = [], [], []
        for n in (37, 1):
            q, k, v = rnd(rng, n, Hq, D), rnd(rng, n, Hkv, D), rnd(rng, n, Hkv, D)
            ks.append(k)
            vs.append(v)
            view = cache_kv.view(n)
            o = view.attend(0, ops, q.copy(), k, v, None, 0.125, 0, 0.0, sinks=sinks)
            o0 = view.attend(0, ops, q.copy(), k, v, None, 0.125, 0, 0.0)  # rewrite: same rows
            assert np.abs(o - o0).max() > 1e-3
            cache_kv.advance(n)
            K, V = np.concatenate(ks), np.concatenate(vs)
            T = K.shape[0]
            qq = q.astype(np.float16).astype(np.float32) if cache == "f16" else q
            if cache == "f16":
                K, V = K.astype(np.float16), V.astype(np.float16)
            ref = attn64(qq, K, V, np.arange(T - n, T, dtype=np.int32), np.arange(T, dtype=np.int32),
                         0.125, 0, 0.0, sinks)
            close(o, ref, TOL if cache != "q8_0" else 3e-2)
            res.append(o)
        outs[name] = res
        cache_kv.close()
    for a, b in zip(outs["native"], outs["numpy"]):
        close(a, b.astype(np.float64), TOL if cache == "f16" else 1e-4)


def test_attention_paged_sinks_identity_table_is_contiguous(isa):
    # the paged kernel with an identity table gives the contiguous kernel's bits, sinks too;
    # a bad sinks length is an error
    q, k, v, qp, kp, sk = _sink_inputs(5, 64, 6, 2, 32, 32, 21)
    out = np.empty((5, 6, 32), np.float32)
    tables = np.arange(2, dtype=np.int32)
    N.attention_paged(q.copy(), k, v, 0, qp, np.zeros(5, np.int32), tables, 32, 0.2, 0, 0.0, out, sinks=sk)
    np.testing.assert_array_equal(out, N.attention(q, k, v, qp, kp, 0.2, sinks=sk))
    out2 = np.empty_like(out)
    N.attention_paged(q.copy(), k, v, 0, qp, np.zeros(5, np.int32), tables, 32, 0.2, 0, 0.0, out2, sk)
    np.testing.assert_array_equal(out2, out)
    with pytest.raises(ValueError, match="sinks"):
        N.attention_paged(q.copy(), k, v, 0, qp, np.zeros(5, np.int32), tables, 32, 0.2, 0, 0.0, out,
                          sinks=sk[:3])
    with pytest.raises(ValueError, match="sinks"):
        N.attention(q, k, v, qp, kp, 0.2, sinks=sk[:5])
    with pytest.raises(TypeError):
        N.attention_paged(q.copy(), k, v, 0, qp, np.zeros(5, np.int32), tables, 32, 0.2, 0, 0.0, out,
                          sink=sk)


# ------------------------------------------------------------------------------ swiglu_oai

def swiglu64(g, u, alpha=1.702, limit=7.0):
    x = np.minimum(g.astype(np.float64), limit)
    y = np.clip(u.astype(np.float64), -limit, limit)
    return x / (1.0 + np.exp(-alpha * x)) * (y + 1.0)


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 33), (5, 2880), (70001,)])
def test_swiglu_oai_float64(isa, shape):
    rng = np.random.default_rng(len(shape) + shape[-1])
    g, u = rnd(rng, *shape, s=6.0), rnd(rng, *shape, s=6.0)  # both clamps in play
    assert (g > 7).any() or g.size < 8
    for alpha, limit in ((1.702, 7.0), (1.0, 3.0)):
        ref = swiglu64(g, u, alpha, limit)
        close(N.swiglu_oai(g, u, alpha, limit), ref)
        close(R.swiglu_oai(g, u, alpha, limit), ref)
    ref = swiglu64(g, u)
    close(N.swiglu_oai(g, u), ref)
    gg = g.copy()
    assert N.swiglu_oai(gg, u, out=gg) is gg  # in place into gate, as the FFN scratch
    close(gg, ref)
    out = np.empty_like(g)
    assert R.swiglu_oai(g, u, out=out) is out
    close(out, ref)


def test_swiglu_oai_edges(isa):
    g = np.array([-200.0, -50.0, 0.0, 7.0, 7.5, 1e30, np.nan, 1.0, 2.0], np.float32)
    u = np.array([0.0, 1.0, -9.0, 9.0, -7.0, 2.0, 1.0, np.nan, -1.0], np.float32)
    got = N.swiglu_oai(g, u)
    with np.errstate(over="ignore"):
        ref = swiglu64(g, u)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    ok = ~np.isnan(ref)
    np.testing.assert_allclose(got[ok], ref[ok], rtol=2e-6, atol=1e-30)
    np.testing.assert_array_equal(np.isnan(R.swiglu_oai(g, u)), np.isnan(ref))


# ------------------------------------------------------------- moe_ffn: act id and biases

def _qt(name, tname, shape, rng):
    t = BY_NAME[tname]
    return QTensor(name, t, shape, random_weight(t, shape, rng, scale=0.1).reshape(-1))


def _act_np(g, u, act):
    return (R.silu_mul, R.gelu_mul, R.swiglu_oai)[act](g, u)


def _act64(g, u, act):
    if act == 2:
        return swiglu64(g, u)
    if act == 1:
        return 0.5 * g * (1.0 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3))) * u
    return g / (1.0 + np.exp(-g)) * u


def _xr(x, t, isa):
    # the activations the kernel dots with (tests/test_native_quant.py _xref)
    if isa == "scalar" or t.block_size == 1:
        return x.astype(np.float64)
    return round_activations(x.astype(np.float32), 256 if t.block_size == 256 else 32).astype(np.float64)


def _moe_setup(tg, td, n_embd, n_ff, n, G, k, seed):
    rng = np.random.default_rng(seed)
    mats = [(_qt("g", tg, (n_ff, n_embd), rng), _qt("u", tg, (n_ff, n_embd), rng),
             _qt("d", td, (n_embd, n_ff), rng)) for _ in range(G)]
    biases = [(rnd(rng, n_ff, s=0.5), rnd(rng, n_ff, s=0.5), rnd(rng, n_embd, s=0.5)) for _ in range(G)]
    biases[1 % G] = (None, biases[1 % G][1], None)  # a group without some biases
    x = rnd(rng, n, n_embd)
    # each row picks k of the G groups; groups in index order, rows ascending within one
    sel = np.stack([rng.choice(G, k, replace=False) for _ in range(n)])
    w = rng.random((n, k)).astype(np.float32)
    order = np.argsort(sel.reshape(-1), kind="stable")
    rows, wts = order // k, np.ascontiguousarray(w.reshape(-1)[order])
    off = np.concatenate([[0], np.cumsum(np.bincount(sel.reshape(-1), minlength=G))]).astype(np.int64)
    return mats, biases, x, off, rows.astype(np.int64), wts


def _moe_ops(x, mats, biases, off, rows, wts, act, rowwise):
    # the same sums op by op on the native backend: kernels and order of the fused call
    out = np.zeros_like(x)
    for g, (wg, wu, wd) in enumerate(mats):
        r, s = rows[off[g]:off[g + 1]], wts[off[g]:off[g + 1]]
        if r.size == 0:
            continue
        xg = np.ascontiguousarray(x[r])
        gg, uu = NV.matmul_multi(xg, [wg, wu], rowwise=rowwise)
        bg, bu, bd = biases[g] if biases is not None else (None, None, None)
        if bg is not None:
            gg = gg + bg
        if bu is not None:
            uu = uu + bu
        h = (NV.silu_mul, NV.gelu_mul, NV.swiglu_oai)[act](gg, uu)
        y = NV.matmul(h, wd, rowwise=rowwise)
        if bd is not None:
            y = y + bd
        for i, row in enumerate(r):
            out[row] += s[i] * y[i]
    return out


def _moe64(x, mats, biases, off, rows, wts, act, isa):
    out = np.zeros(x.shape)
    for g, (wg, wu, wd) in enumerate(mats):
        r, s = rows[off[g]:off[g + 1]], wts[off[g]:off[g + 1]]
        if r.size == 0:
            continue
        xg = _xr(x[r], wg.type, isa)
        gg, uu = xg @ deq(wg).T.astype(np.float64), xg @ deq(wu).T.astype(np.float64)
        bg, bu, bd = biases[g]
        gg = gg + (0 if bg is None else bg)
        uu = uu + (0 if bu is None else bu)
        h = _act64(gg, uu, act)
        y = _xr(h.astype(np.float32), wd.type, isa) @ deq(wd).T.astype(np.float64)
        y = y + (0 if bd is None else bd)
        np.add.at(out, r, s[:, None].astype(np.float64) * y)
    return out


# gate/up type, down type, n_embd, n_ff: gpt-oss ships MXFP4 experts (2880 = 90 blocks of 32)
MOE = [("MXFP4", "MXFP4", 96, 160), ("Q8_0", "Q4_0", 64, 96), ("F16", "F16", 48, 40),
       ("Q4_K", "Q6_K", 256, 512)]


@pytest.mark.parametrize("tg,td,n_embd,n_ff", MOE)
@pytest.mark.parametrize("act", [0, 1, 2])
def test_moe_ffn_act_biases(isa, tg, td, n_embd, n_ff, act):
    for n, rowwise in ((1, True), (3, True), (7, False), (13, False)):
        mats, biases, x, off, rows, wts = _moe_setup(tg, td, n_embd, n_ff, n, 5, min(3, n + 2), n + act)
        got = NV.moe_ffn(x, mats, off, rows, wts, act, np.zeros_like(x), rowwise=rowwise, biases=biases)
        np.testing.assert_array_equal(got, _moe_ops(x, mats, biases, off, rows, wts, act, rowwise))
        close(got, _moe64(x, mats, biases, off, rows, wts, act, isa), 1e-5)
        if n == 7:  # the other kernel family: the same sums within float32
            other = NV.moe_ffn(x, mats, off, rows, wts, act, np.zeros_like(x), rowwise=True, biases=biases)
            close(other, got.astype(np.float64), 1e-5)


def test_moe_ffn_old_arguments_keep_their_bits(isa):
    mats, _, x, off, rows, wts = _moe_setup("Q8_0", "Q8_0", 64, 96, 9, 4, 2, 3)
    for gelu in (False, True):
        for rowwise in (False, True):
            a = NV.moe_ffn(x, mats, off, rows, wts, gelu, np.zeros_like(x), rowwise=rowwise)
            np.testing.assert_array_equal(a, _moe_ops(x, mats, None, off, rows, wts, int(gelu), rowwise))
            for act in (int(gelu), np.bool_(gelu), "gelu" if gelu else "silu"):
                np.testing.assert_array_equal(
                    NV.moe_ffn(x, mats, off, rows, wts, act, np.zeros_like(x), rowwise, None), a)
            # the raw binding's 13-argument form (no decode flag, no biases)
            if not rowwise:
                g0, u0, d0 = mats[0]
                out = np.zeros_like(x)
                N.moe_ffn(x, 9, 64, 96, g0.type.id, u0.type.id, d0.type.id,
                          [q.data for m in mats for q in m], off, rows, wts, gelu, out)
                np.testing.assert_array_equal(out, a)


def test_moe_ffn_bias_and_act_errors():
    mats, biases, x, off, rows, wts = _moe_setup("Q8_0", "Q8_0", 64, 96, 3, 2, 1, 0)
    out = np.zeros_like(x)
    with pytest.raises(ValueError, match="activation"):
        NV.moe_ffn(x, mats, off, rows, wts, 3, out)
    with pytest.raises(ValueError, match="activation"):
        NV.moe_ffn(x, mats, off, rows, wts, "relu", out)
    bad = [(b[0], b[1], b[2]) for b in biases]
    bad[0] = (biases[0][0][:10], None, None)
    with pytest.raises(ValueError, match="bias 0 has 10 values, needs 96"):
        NV.moe_ffn(x, mats, off, rows, wts, 2, out, biases=bad)
    bad[0] = (None, None, np.zeros(96, np.float32))
    with pytest.raises(ValueError, match="needs 64"):
        NV.moe_ffn(x, mats, off, rows, wts, 2, out, biases=bad)
    g0, u0, d0 = mats[0]
    args = (x, 3, 64, 96, g0.type.id, u0.type.id, d0.type.id, [q.data for m in mats for q in m], off,
            rows, wts, 2, out, False)
    with pytest.raises(ValueError, match="per group"):
        N.moe_ffn(*args, [None] * 5)
    with pytest.raises(TypeError, match="float32"):
        N.moe_ffn(*args, [np.zeros(96, np.float64)] + [None] * 5)
    N.moe_ffn(*args, None)  # None: no biases
    N.moe_ffn(*args, [None] * 6)


# ---------------------------------------------------------------------------- matmul_heads

# (type, cols): MLA's 128 / 512 columns; K-quants only where cols is a multiple of 256
HEADS = [("F32", 128), ("F16", 512), ("BF16", 128), ("Q8_0", 128), ("Q8_0", 512), ("Q4_0", 128),
         ("MXFP4", 128), ("Q4_K", 512), ("Q6_K", 512)]


@pytest.mark.parametrize("tname,cols", HEADS)
def test_matmul_heads(isa, tname, cols):
    t = BY_NAME[tname]
    rng = np.random.default_rng(cols + t.id)
    H, rows = 5, 48
    w = QTensor("k_b", t, (H, rows, cols), random_weight(t, (H * rows, cols), rng).reshape(-1))
    W = deq(w).astype(np.float64)
    rb = t.row_bytes(cols)
    heads = [QTensor(f"k_b.{h}", t, (rows, cols), w.data[h * rows * rb:(h + 1) * rows * rb]) for h in range(H)]
    for n in (1, 3, 7, 33):
        x = rnd(rng, n, H, cols)
        ref = np.stack([_xr(x[:, h], t, isa) @ W[h].T for h in range(H)], axis=1)
        for rowwise in (None, True, False):
            y = NV.matmul_heads(x, w, rowwise=rowwise)
            assert y.shape == (n, H, rows) and y.dtype == np.float32
            for h in range(H):  # one head as matmul runs it alone, bit for bit
                np.testing.assert_array_equal(
                    y[:, h], NV.matmul(np.ascontiguousarray(x[:, h]), heads[h], rowwise=rowwise))
            close(y, ref, 1e-5)
        out = np.full((n, H, rows), np.nan, np.float32)
        assert NV.matmul_heads(x, w, out=out) is out
        np.testing.assert_array_equal(out, NV.matmul_heads(x, w))
        plain = np.einsum("nhc,hrc->nhr", x.astype(np.float64), W)
        close(R.matmul_heads(x, w), plain, 1e-5)


def test_matmul_heads_threads_and_errors():
    rng = np.random.default_rng(3)
    t = BY_NAME["Q8_0"]
    H, rows, cols = 3, 20, 128
    w = QTensor("v_b", t, (H, rows, cols), random_weight(t, (H * rows, cols), rng).reshape(-1))
    x = rnd(rng, 6, H, cols)
    a = NV.matmul_heads(x, w, rowwise=False)
    old = NV.get_threads()
    try:
        NV.set_threads(1)
        np.testing.assert_array_equal(NV.matmul_heads(x, w, rowwise=False), a)
    finally:
        NV.set_threads(old)
    np.testing.assert_array_equal(NV.matmul_heads(x[:0], w), np.zeros((0, H, rows), np.float32))
    with pytest.raises(AssertionError):
        NV.matmul_heads(x[:, :2], w)
    with pytest.raises(ValueError, match="too small"):
        N.matmul_heads(t.id, w.data[:100], H, rows, cols, x, 6, np.empty((6, H, rows), np.float32), False)
    with pytest.raises(ValueError, match="multiple of the block size"):
        N.matmul_heads(t.id, w.data, H, rows, 100, x, 6, np.empty((6, H, rows), np.float32), False)
