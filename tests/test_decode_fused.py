"""The fused native decode layer (csrc/decode.c) against the op-by-op block it replaces:
one-token decode logits and KV cache contents must be bit-identical, for every architecture,
every quant type, with and without the f16 KV rounding, softcap, rope frequency factors and
sliding windows."""

from __future__ import annotations

import numpy as np
import pytest

from memfit import _native
from memfit.models import load_model
from memfit.models.synthetic import write_tiny_model
from memfit.ops import get_ops
from memfit.quant.types import SUPPORTED_NAMES  # noqa: E402

ARCHS = ["llama", "qwen2", "qwen3", "gemma3"]
TYPES = list(SUPPORTED_NAMES)
IDS = [5, 17, 200, 33, 290, 0, 64, 64, 128, 7, 255, 1]
SPLIT = 3  # prefill this many, then one token at a time


def _decode(path, fused: bool, kv_f16: bool, tweak=None):
    m = load_model(path, ops=get_ops("native"))
    m.kv_f16 = kv_f16
    if tweak:
        tweak(m)
    if not fused:
        m._fused = []  # op-by-op block()
    assert (m._decode_layers() is not None) == fused
    cache = m.new_cache(32)
    out = [m.forward(IDS[:SPLIT], cache)]
    out += [m.forward([t], cache) for t in IDS[SPLIT:]]
    return np.stack(out), cache


def _same(path, kv_f16=True, tweak=None):
    a, ca = _decode(path, True, kv_f16, tweak)
    b, cb = _decode(path, False, kv_f16, tweak)
    assert np.isfinite(a).all()
    np.testing.assert_array_equal(a, b)
    for il in range(len(ca.k)):
        np.testing.assert_array_equal(ca.k[il][:ca.offset], cb.k[il][:cb.offset])
        np.testing.assert_array_equal(ca.v[il][:ca.offset], cb.v[il][:cb.offset])


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_decode_equals_blocks(tmp_path, arch, qtype):
    kw = {"sliding_window": 4} if arch == "gemma3" else {}
    path = write_tiny_model(tmp_path / f"{arch}-{qtype}.gguf", arch, qtype, seed=3, **kw)
    _same(path, kv_f16=qtype in ("Q4_K", "F16", "Q8_0"))


@pytest.mark.parametrize("isa", ["scalar", _native.isa()])
def test_fused_decode_mixed_types_softcap_freq_factors(tmp_path, isa):
    # a llama3-style file: per-dim rope frequency factors; Gemma-2-style attention softcap;
    # a mix of types as quantizers write them (Q4_K body, Q6_K attn_v / ffn_down)
    types = {f"blk.{il}.{n}.weight": "Q6_K" for il in range(2) for n in ("attn_v", "ffn_down")}
    path = write_tiny_model(tmp_path / "mix.gguf", "llama", "Q4_K", seed=5, types=types)
    ff = (1.0 + 4.0 * np.random.default_rng(0).random(32)).astype(np.float32)

    def tweak(m):
        m.config.attn_softcap = 5.0
        m.vec["rope_freqs.weight"] = ff[:m.config.n_rot // 2]

    old = _native.isa()
    _native.set_isa(isa)
    try:
        _same(path, tweak=tweak)
    finally:
        _native.set_isa(old)


def test_decode_layer_rejects_bad_buffers(tmp_path):
    path = write_tiny_model(tmp_path / "t.gguf", "llama", "Q4_0")
    m = load_model(path, ops=get_ops("native"))
    layer, names = m._decode_layers()[0]
    w = [m.weights.get(n).data for n in names]
    cache = m.new_cache(4)
    K, V = cache.pool.k[0][:4], cache.pool.v[0][:4]  # the rows of 4 positions
    x = np.zeros(m.config.n_embd, np.float32)
    with pytest.raises(ValueError, match="pos is outside"):
        _native.decode_layer(layer, x, 4, K, V, True, *w)
    with pytest.raises(ValueError, match="n_embd"):
        _native.decode_layer(layer, x[:-1], 0, K, V, True, *w)
    with pytest.raises(ValueError, match="smaller than"):
        _native.decode_layer(layer, x, 0, K, V, True, *w[:6], w[6][:-1])
    with pytest.raises(TypeError, match="float32"):
        _native.decode_layer(layer, x.astype(np.float64), 0, K, V, True, *w)
    with pytest.raises(ValueError, match="inconsistent"):
        _native.decode_layer_new((256, 3, 2, 64, 64, 512, 64, 0, 0, 0) + (2,) * 7,
                                 (1e4, 1.0, 1e-6, 0.125, 0.0), (None,) * 11)
