"""The numpy reference ops against plain float64 definitions (gguf-py as the dequant oracle)."""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest

from memfit.ops import QTensor
from memfit.ops import reference as R
from memfit.quant.random import random_weight
from memfit.quant.types import BY_NAME

rng = np.random.default_rng(0)


def qtensor(tname, rows, cols, seed=0):
    t = BY_NAME[tname]
    raw = random_weight(t, (rows, cols), np.random.default_rng(seed))
    return QTensor("w", t, (rows, cols), raw.reshape(-1))


def oracle(w: QTensor) -> np.ndarray:
    raw = w.data.reshape(w.shape[0], -1)
    return np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(w.type.id)),
                      np.float64).reshape(w.shape)


@pytest.mark.parametrize("tname", ["F32", "F16", "BF16", "Q4_0", "Q5_1", "Q8_0", "Q2_K", "Q4_K",
                                   "Q6_K", "IQ4_XS"])
def test_matmul_and_get_rows(tname):
    w = qtensor(tname, 48, 512)
    x = rng.standard_normal((5, 512)).astype(np.float32)
    ref = x.astype(np.float64) @ oracle(w).T
    y = R.matmul(x, w)
    assert y.shape == (5, 48) and y.dtype == np.float32
    assert np.max(np.abs(y - ref)) <= 1e-5 * np.max(np.abs(ref))
    ids = np.array([47, 0, 3, 3, 20])
    assert np.array_equal(R.get_rows(w, ids), oracle(w)[ids].astype(np.float32))


def test_get_rows_reads_only_the_requested_rows():
    w = qtensor("Q4_K", 8, 256)
    data = w.data.copy().reshape(8, -1)
    data[[0, 1, 2, 4, 5, 6, 7]] = 0xFF  # f16 scales 0xFFFF = NaN in every other row
    r = R.get_rows(QTensor("w", w.type, w.shape, data.reshape(-1)), np.array([3, 3]))
    assert np.isfinite(r).all() and np.array_equal(r[0], oracle(w)[3].astype(np.float32))


def test_rmsnorm():
    x = rng.standard_normal((3, 64)).astype(np.float32) * 7
    wt = rng.standard_normal(64).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt(np.mean(x64 ** 2, -1, keepdims=True) + 1e-5) * wt
    assert np.allclose(R.rmsnorm(x, wt, 1e-5), ref, rtol=1e-5, atol=1e-5)
    assert np.allclose(R.rmsnorm(x, None, 1e-5), ref / wt, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("neox", [False, True])
def test_rope(neox):
    n, h, d, n_rot = 4, 3, 16, 12
    x = rng.standard_normal((n, h, d)).astype(np.float32)
    pos = np.array([0, 1, 7, 300], dtype=np.int32)
    ff = np.linspace(1, 4, n_rot // 2).astype(np.float32)
    y = R.rope(x, pos, n_rot, 500.0, 0.5, neox, freq_factors=ff)
    ang = pos[:, None].astype(np.float64) * 0.5 * 500.0 ** (-np.arange(n_rot // 2) * 2 / n_rot) / ff
    ref = x.astype(np.float64).copy()
    for i in range(n_rot // 2):
        a, b = (i, i + n_rot // 2) if neox else (2 * i, 2 * i + 1)
        c, s = np.cos(ang[:, i])[:, None], np.sin(ang[:, i])[:, None]
        ref[:, :, a] = x[:, :, a] * c - x[:, :, b] * s
        ref[:, :, b] = x[:, :, a] * s + x[:, :, b] * c
    assert np.allclose(y, ref, atol=1e-5)
    assert np.array_equal(y[0], x[0]) and np.array_equal(y[:, :, n_rot:], x[:, :, n_rot:])


def test_softmax_and_gated_activations():
    x = np.array([[1.0, 2.0, -np.inf, 1000.0]], dtype=np.float32)
    p = R.softmax(x)
    assert np.isclose(p.sum(), 1.0) and p[0, 2] == 0.0 and np.isfinite(p).all()
    g = rng.standard_normal((2, 32)).astype(np.float32) * 3
    u = rng.standard_normal((2, 32)).astype(np.float32)
    g64 = g.astype(np.float64)
    assert np.allclose(R.silu_mul(g, u), g64 / (1 + np.exp(-g64)) * u, atol=1e-6)
    gelu = 0.5 * g64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (g64 + 0.044715 * g64 ** 3)))
    assert np.allclose(R.gelu_mul(g, u), gelu * u, atol=1e-6)


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (3, 0.0), (0, 5.0)])
def test_attention_gqa_causal_window(window, softcap):
    n, t, hq, hkv, d, dv = 3, 7, 6, 2, 8, 5
    q = rng.standard_normal((n, hq, d)).astype(np.float32)
    k = rng.standard_normal((t, hkv, d)).astype(np.float32)
    v = rng.standard_normal((t, hkv, dv)).astype(np.float32)
    q_pos, kv_pos = np.array([4, 5, 6], np.int32), np.arange(t, dtype=np.int32)
    out = R.attention(q, k, v, q_pos, kv_pos, 0.3, window, softcap)
    ref = np.zeros((n, hq, dv))
    for i in range(n):
        for h in range(hq):
            kh = h // (hq // hkv)
            s = k[:, kh].astype(np.float64) @ q[i, h] * 0.3
            if softcap:
                s = softcap * np.tanh(s / softcap)
            # llama.cpp: a key at distance >= window is masked
            ok = (kv_pos <= q_pos[i]) & ((q_pos[i] - kv_pos < window) if window else True)
            s = np.where(ok, s, -np.inf)
            e = np.exp(s - s.max())
            ref[i, h] = (e / e.sum()) @ v[:, kh]
    assert np.allclose(out, ref, atol=1e-5)
    if window:  # query at 6 with window 3 sees keys 4, 5, 6 only
        assert np.allclose(out[2], R.attention(q[2:], k[4:], v[4:], q_pos[2:], kv_pos[4:], 0.3),
                           atol=1e-6)
