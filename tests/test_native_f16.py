"""round_f16 (the f16 KV cache / f16 Q rounding done in C) must equal numpy's
x.astype(float16).astype(float32) bit for bit: ties, subnormals, overflow to inf, random bit
patterns; AVX2 and scalar paths; and the f16 KV pool stores exactly the numpy-rounded values."""

import numpy as np
import pytest

_native = pytest.importorskip("memfit._native")
from memfit.kv import KVPool  # noqa: E402


@pytest.mark.parametrize("isa", ["scalar", "avx2"])
def test_round_f16_matches_numpy(isa):
    if isa == "avx2" and _native.isa_hw() == "scalar":
        pytest.skip("no AVX2")
    rng = np.random.default_rng(0)
    special = np.array([65504, 65519.996, 65520, -65520, 2**-24, 2**-25, 3 * 2**-26, 2**-14,
                        1 + 2**-11, 1 + 3 * 2**-11, 0.0, -0.0, np.inf, -np.inf, 1e-45], np.float32)
    bits = rng.integers(0, 2**32, 200_003, dtype=np.uint64).astype(np.uint32).view(np.float32)
    scaled = np.concatenate([rng.standard_normal(1001).astype(np.float32) * s for s in (1e-7, 1e-5, 1, 3e4)])
    x = np.concatenate([special, bits[np.isfinite(bits)], scaled])
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16).astype(np.float32)
    before = _native.isa()
    _native.set_isa(isa)
    try:
        got = _native.round_f16(x)
        inplace = x.copy()
        _native.round_f16(inplace, inplace)
    finally:
        _native.set_isa(before)
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
    np.testing.assert_array_equal(inplace.view(np.uint32), ref.view(np.uint32))


def test_kv_cache_stores_f16_rounded():
    from memfit.ops import native
    rng = np.random.default_rng(1)
    p = KVPool(2, 1, 3, 64)
    k, v = rng.standard_normal((5, 3, 64), dtype=np.float32), rng.standard_normal((5, 3, 64), dtype=np.float32)
    slots = np.array([7, 0, 31, 3, 12], np.int32)
    native.kv_store(p.kv_type, p.k[1], slots, k)
    native.kv_store(p.kv_type, p.v[1], slots, v)
    assert p.k[1].dtype == np.float16
    np.testing.assert_array_equal(p.k[1][slots].astype(np.float32), k.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(p.v[1][slots].astype(np.float32), v.astype(np.float16).astype(np.float32))
