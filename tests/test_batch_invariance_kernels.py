"""Batch invariance of the kernels: a row's result depends only on its own input row.

Every type x every ISA path this CPU runs x both kernel families (prefill, decode): an X row's
outputs are the same bits alone, at any position of a call of any row count (1..33: every
threshold the kernels had), with any neighbours, with 1 or 2 threads. This is what lets the
engine give a sequence the same tokens cold, cached, chunked or batched (tests/test_exact.py).
"""

import numpy as np
import pytest
from conftest import isa_paths

_native = pytest.importorskip("memfit._native")
from memfit.ops import QTensor  # noqa: E402
from memfit.ops import native as nat  # noqa: E402
from memfit.quant.random import random_blocks  # noqa: E402
from memfit.quant.types import BY_NAME, SUPPORTED_NAMES  # noqa: E402

NAMES = list(SUPPORTED_NAMES)
NS = (1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 15, 16, 17, 33)
MODES = {"prefill": {"rowwise": False}, "decode": {"rowwise": True}}


@pytest.fixture(params=isa_paths())
def isa(request):
    before, threads = _native.isa(), _native.get_threads()
    _native.set_isa(request.param)
    yield request.param
    _native.set_isa(before)
    _native.set_threads(threads)


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", NAMES)
def test_row_independent_of_call(isa, name, mode):
    kw = MODES[mode]
    t = BY_NAME[name]
    rng = np.random.default_rng(900 + t.id)
    rows, cols = 45, 512  # 8/4-row groups and a remainder; two 256-blocks, sixteen 32-blocks
    w = QTensor("w", t, (rows, cols), random_blocks(t, rows * cols, rng))
    X = rng.standard_normal((40, cols)).astype(np.float32)
    alone = np.stack([nat.matmul(X[i:i + 1], w, **kw)[0] for i in range(40)])
    for nt in (1, 2):
        _native.set_threads(nt)
        for n in NS:
            for start in (0, 40 - n):
                got = nat.matmul(X[start:start + n], w, **kw)
                assert np.array_equal(_bits(got), _bits(alone[start:start + n])), \
                    f"{name} {isa} {mode} n={n} start={start} threads={nt}"


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("names", [("Q4_K", "Q6_K", "Q8_0"), ("Q4_1", "Q4_0", "F16")])
def test_multi_matmul_rows_equal_single(isa, names, mode):
    kw = MODES[mode]
    # weights of different types sharing X (Q/K/V, gate/up) in one call: each result row is
    # the single matmul's row alone
    rng = np.random.default_rng(77)
    cols = 512
    ws = [QTensor(f"w{j}", BY_NAME[nm], (33 + 8 * j, cols),
                  random_blocks(BY_NAME[nm], (33 + 8 * j) * cols, rng)) for j, nm in enumerate(names)]
    X = rng.standard_normal((21, cols)).astype(np.float32)
    for n in (1, 3, 7, 21):
        ys = nat.matmul_multi(X[:n], ws, **kw)
        for w, y in zip(ws, ys):
            for i in range(n):
                assert np.array_equal(_bits(y[i]), _bits(nat.matmul(X[i:i + 1], w, **kw)[0])), \
                    f"{w.type.name} {isa} n={n} row={i}"


@pytest.mark.parametrize("rowwise", [False, True], ids=["prefill", "decode"])
def test_moe_ffn_rows_independent_of_group_size(isa, rowwise):
    # the grouped expert FFN: a token's result is the same whatever other tokens its experts
    # were routed (group sizes 1..n), as alone
    rng = np.random.default_rng(5)
    E, F, ne, n = 256, 512, 4, 13
    mats = []
    for e in range(ne):
        mats.append(tuple(QTensor(f"{m}{e}", BY_NAME["Q4_K"], shp, random_blocks(BY_NAME["Q4_K"], shp[0] * shp[1], rng))
                          for m, shp in (("g", (F, E)), ("u", (F, E)), ("d", (E, F)))))
    x = rng.standard_normal((n, E)).astype(np.float32)
    sel = np.stack([rng.choice(ne, 2, replace=False) for _ in range(n)])
    wts = rng.random((n, 2)).astype(np.float32)

    def run(rows):
        xs = np.ascontiguousarray(x[rows])
        s = sel[rows]
        order = np.argsort(s.reshape(-1), kind="stable")
        r_all, w_all = order // 2, np.ascontiguousarray(wts[rows].reshape(-1)[order])
        counts = np.bincount(s.reshape(-1), minlength=ne)
        off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        out = np.zeros_like(xs)
        nat.moe_ffn(xs, mats, off, r_all.astype(np.int64), w_all, False, out, rowwise=rowwise)
        return out

    full = run(np.arange(n))
    for i in range(n):
        assert np.array_equal(_bits(run(np.array([i]))[0]), _bits(full[i])), f"{isa} token {i}"


def test_hadamard_rotation_rowwise_and_native_equals_numpy():
    # the quantized KV cache's rotation (kv/quant.py rotate): native and numpy butterflies give
    # the same bits, a row's result is its own alone, and it is the Hadamard product
    from memfit.kv import quant as kq
    x = np.random.default_rng(3).standard_normal((9, 4, 128)).astype(np.float32)
    for n in (64, 128):
        got = kq.rotate(x, n)
        native = kq._native_fwht
        try:
            kq._native_fwht = lambda: None
            ref = kq.rotate(x, n)
        finally:
            kq._native_fwht = native
        assert np.array_equal(_bits(got), _bits(ref))
        for i in (0, 4, 8):
            assert np.array_equal(_bits(kq.rotate(x[i:i + 1], n)), _bits(got[i:i + 1]))
        exact = (x.reshape(-1, n).astype(np.float64) @ kq.hadamard(n).astype(np.float64)).reshape(x.shape)
        assert np.abs(got - exact).max() < 1e-5


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q4_K", "Q6_K"])
def test_w_row_independent_of_its_neighbours(isa, name):
    """A W row's prefill results are the same bits alone (a one-row matrix) as inside a matrix
    of 45 rows, where the 32-block types' AVX2 GEMM takes W rows two at a time (mf_bdot2_avx2)
    and the odd one alone."""
    t = BY_NAME[name]
    rng = np.random.default_rng(70 + t.id)
    rows, cols = 45, 512
    w = QTensor("w", t, (rows, cols), random_blocks(t, rows * cols, rng))
    X = rng.standard_normal((21, cols)).astype(np.float32)
    full = nat.matmul(X, w, rowwise=False)
    rb = w.data.size // rows
    for r in range(rows):
        one = nat.matmul(X, QTensor("w", t, (1, cols), w.data[r * rb:(r + 1) * rb]), rowwise=False)
        assert np.array_equal(_bits(one[:, 0]), _bits(full[:, r])), f"{name} {isa} row {r}"
