"""The paged KV pool and the kernels that read through block tables: paged attention equals
the reference attention over the same keys gathered contiguously (an f16 cache: the reference of
llama.cpp's flash-attention order, ops.reference.attention_fa16) (odd shapes, GQA, windows,
softcap, f32 and f16 caches, scalar and AVX2 paths, scattered tables); kv_store converts as
numpy does; the pool's block accounting, prefix keys and LRU reuse."""

from __future__ import annotations

import numpy as np
import pytest

from memfit import _native
from memfit.kv import BLOCK_SIZE, KVPool
from memfit.kv.pool import block_key
from memfit.ops import reference


def _isas():
    return ["scalar"] + ([] if _native.isa_hw() == "scalar" else ["avx2"])


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("kv", ["f32", "f16"])
@pytest.mark.parametrize("shape", [(4, 2, 64, 64, 0, 0.0), (6, 3, 40, 24, 5, 0.0),
                                   (2, 1, 80, 80, 0, 30.0), (8, 8, 7, 9, 3, 2.0)])
def test_paged_attention_matches_reference(isa, kv, shape):
    Hq, Hkv, D, Dv, window, softcap = shape
    rng = np.random.default_rng(hash(shape) % 1000)
    bs, n_blocks = 8, 24
    dt, kv_type = (np.float16, 1) if kv == "f16" else (np.float32, 0)
    K = rng.standard_normal((n_blocks * bs, Hkv, D)).astype(dt)
    V = rng.standard_normal((n_blocks * bs, Hkv, Dv)).astype(dt)
    # three sequences with scattered tables; rows: a prefill chunk of seq 0 and decode rows
    tabs = [rng.permutation(n_blocks)[:6], rng.permutation(n_blocks)[:3], rng.permutation(n_blocks)[:9]]
    tables = np.concatenate(tabs).astype(np.int32)
    offs = np.cumsum([0] + [len(t) for t in tabs[:-1]]).astype(np.int32)
    q_pos = np.array([20, 21, 22, 23, 17, 70], np.int32)
    q_seq = np.array([0, 0, 0, 0, 1, 2])
    q_tab = offs[q_seq]
    q = rng.standard_normal((len(q_pos), Hq, D)).astype(np.float32)
    before = _native.isa()
    _native.set_isa(isa)
    try:
        out = np.empty((len(q_pos), Hq, Dv), np.float32)
        qq = q.copy()
        _native.attention_paged(qq, K, V, kv_type, q_pos, q_tab, tables, bs, 0.3, window, softcap, out)
    finally:
        _native.set_isa(before)
    qr = q.astype(np.float16).astype(np.float32) if kv == "f16" else q
    np.testing.assert_array_equal(qq, qr)  # q rounded in place for the f16 cache
    for i, (p, s) in enumerate(zip(q_pos, q_seq)):
        t = np.arange(p + 1)
        phys = tabs[s][t // bs] * bs + t % bs
        if kv == "f16":   # llama.cpp's flash-attention order, f16 accumulator (csrc/ops.c)
            ref = reference.attention_fa16(qr[i:i + 1], K[phys], V[phys], q_pos[i:i + 1],
                                           t.astype(np.int32), 0.3, window, softcap)
            # the f16 accumulator's roundings: an f32 dot order may move one by an ulp (~1e-3)
            np.testing.assert_allclose(out[i:i + 1], ref, rtol=2e-3, atol=2e-3)
            continue
        ref = reference.attention(qr[i:i + 1], K[phys], V[phys], q_pos[i:i + 1], t.astype(np.int32),
                                  0.3, window, softcap)
        np.testing.assert_allclose(out[i:i + 1], ref, rtol=2e-5, atol=2e-6)


def test_paged_attention_identity_table_is_contiguous_attention():
    # one block as long as the cache: the paged kernel gives the contiguous kernel's bits
    rng = np.random.default_rng(1)
    T, Hq, Hkv, D = 100, 4, 2, 64
    K = rng.standard_normal((T, Hkv, D)).astype(np.float16)
    V = rng.standard_normal((T, Hkv, D)).astype(np.float16)
    q = rng.standard_normal((5, Hq, D)).astype(np.float16).astype(np.float32)
    pos = np.array([3, 50, 64, 65, 99], np.int32)
    want = _native.attention(q, K, V, pos, np.arange(T, dtype=np.int32), 0.125)
    out = np.empty_like(want)
    z = np.zeros(5, np.int32)
    _native.attention_paged(q.copy(), K, V, 1, pos, z, z[:1], T, 0.125, 0, 0.0, out)
    np.testing.assert_array_equal(out, want)


def test_paged_attention_rejects_bad_tables():
    K = np.zeros((64, 1, 32), np.float16)
    q = np.zeros((1, 1, 32), np.float32)
    out = np.zeros((1, 1, 32), np.float32)
    one = np.zeros(1, np.int32)
    with pytest.raises(ValueError, match="outside"):
        _native.attention_paged(q, K, K, 1, one, one, np.array([2], np.int32), 32, 1.0, 0, 0.0, out)
    with pytest.raises(ValueError, match="outside"):  # position 40 needs a second table entry
        _native.attention_paged(q, K, K, 1, np.array([40], np.int32), one, one, 32, 1.0, 0, 0.0, out)
    with pytest.raises(ValueError, match="type"):
        _native.attention_paged(q, K, K, 99, one, one, one, 32, 1.0, 0, 0.0, out)


def test_kv_store_converts_like_numpy():
    rng = np.random.default_rng(2)
    pool = np.zeros((16, 3, 5), np.float16)
    x = (rng.standard_normal((4, 15)) * 100).astype(np.float32)
    rows = np.array([7, 0, 15, 3], np.int32)
    _native.kv_store(1, pool, rows, x)
    np.testing.assert_array_equal(pool[rows].reshape(4, 15), x.astype(np.float16))
    with pytest.raises(ValueError, match="outside"):
        _native.kv_store(1, pool, np.array([16], np.int32), x[:1])


def test_pool_blocks_refcounts_and_lru():
    pool = KVPool(2, 4, 1, 8)
    assert pool.n_free == 4 and pool.k[0].shape == (4 * BLOCK_SIZE, 1, 8)
    a, b = pool.allocate(), pool.allocate()
    ka = block_key(None, range(BLOCK_SIZE))
    kb = block_key(ka, range(BLOCK_SIZE, 2 * BLOCK_SIZE))
    pool.register(a, ka)
    pool.register(b, kb)
    assert pool.lookup(ka) == a and pool.ref[a] == 2  # shared
    pool.release([a, b])
    assert pool.n_used == 1 and pool.n_cached == 1  # b unreferenced but still keyed
    pool.release([a])
    assert pool.n_cached == 2 and pool.n_free == 4
    c, d = pool.allocate(), pool.allocate()  # the never-keyed blocks first
    assert {c, d}.isdisjoint({a, b}) and pool.peek(ka) == a
    e = pool.allocate()  # then the least recently freed keyed block: b (freed before a)
    assert e == b and pool.peek(kb) is None and pool.peek(ka) == a
    assert pool.lookup(ka) == a and pool.n_free == 0
    assert block_key(None, [1, 2]) != block_key(ka, [1, 2])  # the parent is part of the key
