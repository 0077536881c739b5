"""Quantized KV cache (-ctk/-ctv q8_0, q4_0): the C kernels against the numpy reference in
memfit.kv.quant (which follows ggml's C), on odd shapes, and the block format against the
independent GGUF dequantizer (quant/reference.py)."""

from __future__ import annotations

import numpy as np
import pytest

from memfit.kv import quant as kq
from memfit.quant.reference import dequantize

native = pytest.importorskip("memfit._native")
TYPES = [kq.F16, kq.Q8_0, kq.Q4_0]


def _data(rng, shape, scale=1.0):
    x = rng.standard_normal(shape).astype(np.float32) * np.float32(scale)
    x.reshape(-1)[::97] = 0.0  # zeros, exact ties and an all-zero block
    if x.size >= 64:
        x.reshape(-1)[32:64] = 0.0
        x.reshape(-1)[5] = 2.5
    return x


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("shape", [(1, 32), (7, 3, 64), (5, 96), (2, 2, 256)])
def test_quantize_bit_exact(t, shape):
    rng = np.random.default_rng(hash((t, shape)) % 2**32)
    x = _data(rng, shape, scale=3.0)
    want = kq.quantize_ref(t, x)
    got = np.empty_like(want)
    native.kv_quantize(x, t, got)
    assert np.array_equal(got, want)
    back = np.empty(x.shape, np.float32)
    native.kv_dequantize(got, t, back)
    assert np.array_equal(back, kq.dequantize_ref(t, got, shape[-1]))
    if t != kq.F16:  # the block layout is GGML's: the GGUF tensor dequantizer reads it
        assert np.array_equal(back.reshape(-1), dequantize(t, got.reshape(-1), x.size))


def test_quantize_error_bounds():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 128)).astype(np.float32)
    for t, bound in ((kq.Q8_0, 0.5 / 127), (kq.Q4_0, 1 / 8)):  # q4_0: -amax clips to 7 steps
        raw = np.empty((64, kq.row_bytes(t, 128)), np.uint8)
        native.kv_quantize(x, t, raw)
        back = np.empty_like(x)
        native.kv_dequantize(raw, t, back)
        amax = np.abs(x.reshape(-1, 32)).max(1, keepdims=True)
        err = np.abs(back - x).reshape(-1, 32)
        assert (err <= amax * bound * 1.01 + 1e-3 * amax).all()  # (+ the f16 rounding of d)
    with pytest.raises(ValueError, match="multiple of 32"):
        native.kv_quantize(np.zeros((2, 48), np.float32), kq.Q8_0, np.zeros(100, np.uint8))


def test_row_bytes():
    assert [kq.row_bytes(t, 64) for t in TYPES] == [128, 68, 36]
    assert kq.cache_type("Q8_0") == 8 and kq.cache_type(None) == kq.F16
    from memfit.errors import RequestError
    with pytest.raises(RequestError, match="q5_1"):
        kq.cache_type("q5_1")


def _case(rng, n, T, hq, hkv, D, Dv, tk, tv, paged):
    q = rng.standard_normal((n, hq, D)).astype(np.float32)
    kf = rng.standard_normal((T, hkv, D)).astype(np.float32) * 0.7
    vf = rng.standard_normal((T, hkv, Dv)).astype(np.float32)
    k, v = kq.quantize_ref(tk, kf), kq.quantize_ref(tv, vf)
    table = None
    if paged:  # rows scattered over a pool of blocks in a shuffled order
        nb = (T + 31) // 32
        table = rng.permutation(nb + 2)[:nb].astype(np.int32)
        kp = np.zeros((nb + 2, 32, hkv, k.shape[-1]), np.uint8)
        vp = np.zeros((nb + 2, 32, hkv, v.shape[-1]), np.uint8)
        for t in range(T):
            kp[table[t // 32], t % 32] = k[t]
            vp[table[t // 32], t % 32] = v[t]
        k, v = kp, vp
    kv_pos = np.arange(T, dtype=np.int32)
    q_pos = np.arange(T - n, T, dtype=np.int32)
    return q, k, v, q_pos, kv_pos, table


@pytest.mark.parametrize("tk,tv", [(kq.Q8_0, kq.Q8_0), (kq.Q4_0, kq.Q4_0), (kq.Q8_0, kq.Q4_0),
                                   (kq.F16, kq.Q8_0), (kq.Q4_0, kq.F16)])
@pytest.mark.parametrize("n,T,hq,hkv,D,paged", [(1, 1, 1, 1, 32, False), (3, 37, 6, 2, 64, False),
                                                 (5, 70, 4, 4, 96, True), (2, 33, 9, 3, 64, True)])
def test_attention_matches_reference(tk, tv, n, T, hq, hkv, D, paged):
    rng = np.random.default_rng(n * 1000 + T)
    q, k, v, q_pos, kv_pos, table = _case(rng, n, T, hq, hkv, D, D, tk, tv, paged)
    want = kq.attention_ref(q, k, v, q_pos, kv_pos, 0.125, 0, 0.0, tk, tv, table)
    out = np.empty((n, hq, D), np.float32)
    got = native.attention_kvq(q, k, v, q_pos, kv_pos, 0.125, 0, 0.0, tk, tv, table, out)
    assert got is out
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_attention_window_softcap_and_threads():
    rng = np.random.default_rng(7)
    q, k, v, q_pos, kv_pos, _ = _case(rng, 4, 90, 8, 2, 64, 64, kq.Q8_0, kq.Q4_0, False)
    want = kq.attention_ref(q, k, v, q_pos, kv_pos, 0.2, 16, 30.0, kq.Q8_0, kq.Q4_0)
    outs = []
    for th in (1, 3):
        native.set_threads(th)
        out = np.empty((4, 8, 64), np.float32)
        outs.append(native.attention_kvq(q, k, v, q_pos, kv_pos, 0.2, 16, 30.0, kq.Q8_0, kq.Q4_0, None, out))
    native.set_threads(0)
    np.testing.assert_allclose(outs[0], want, rtol=2e-5, atol=2e-6)
    assert np.array_equal(outs[0], outs[1])  # independent of the thread count


def test_attention_isa_paths_identical():
    """The scalar and AVX2 paths give the same bits (integer block sums, fmaf)."""
    rng = np.random.default_rng(3)
    q, k, v, q_pos, kv_pos, _ = _case(rng, 3, 50, 4, 2, 128, 128, kq.Q4_0, kq.Q8_0, False)
    res = []
    old = native.isa()
    for isa in ("scalar", "avx2"):
        native.set_isa(isa)
        out = np.empty((3, 4, 128), np.float32)
        res.append(native.attention_kvq(q, k, v, q_pos, kv_pos, 0.1, 0, 0.0, kq.Q4_0, kq.Q8_0, None, out))
    native.set_isa(old)
    assert np.array_equal(res[0], res[1])


def test_dot_matches_ggml_order():
    """One visible key: the output is that V row; two keys: the softmax weights follow the
    scores exactly as the reference's emulation of ggml's vec_dot gives them."""
    rng = np.random.default_rng(11)
    q, k, v, q_pos, kv_pos, _ = _case(rng, 1, 2, 1, 1, 64, 64, kq.Q8_0, kq.Q8_0, False)
    s = kq.dot_ref(kq.Q8_0, k[:, 0], kq.quantize_ref(kq.Q8_0, q[0, 0]))
    V = kq.dequantize_ref(kq.Q8_0, v[:, 0], 64)
    out = native.attention_kvq(q, k, v, np.array([1], np.int32), kv_pos, 1.0, 0, 0.0, 8, 8, None,
                               np.empty((1, 1, 64), np.float32))
    m = max(s[0], s[1])
    w = np.exp(np.float32(s - m).astype(np.float64))
    np.testing.assert_allclose(out[0, 0], (w / w.sum()) @ V, rtol=1e-5, atol=1e-6)
