"""Native quant kernels vs gguf-py (dequantize, bit-exact) and a float64 product (matmul).

Every ISA path this CPU can run is exercised in-process through _native.set_isa. The integer
paths (avx2, avx512vnni) quantize activations to 8 bits per block as ggml does (Q8_0/Q8_1 per
32, Q8_K per 256), so they are compared with the float64 product of the dequantized weights and
the activations rounded the same way (memfit.quant.activations): measured 5e-8..2e-7 of the
largest output for every type, bound 1e-5. The scalar path dots in f32 against the plain
product (measured ~4e-7, bound 1e-5). One 32-value sub-block zeroed in one row moves the
output by >= 6e-2 of its largest value (test_bound_catches_a_zeroed_subblock), 6000x the bound.

ASan/UBSan (documented command, not run in CI): build a sanitized copy outside the tree and
put it first on PYTHONPATH:
  cp -r setup.py csrc /tmp/asan && cd /tmp/asan && MEMFIT_SANITIZE=1 python setup.py build_ext \
      --build-lib out --build-temp tmp && mkdir pkg && cp -r /work/main/src/memfit pkg/ && \
      cp out/memfit/_native*.so pkg/memfit/ && cd /work/main && \
  LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)" \
  ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  PYTHONPATH=/tmp/asan/pkg python -m pytest -s -p no:cacheprovider tests/test_native_quant.py \
      tests/test_native_pool.py
(-s: a sanitizer report is written to fd 2, which pytest would otherwise swallow on abort.)
"""

import gguf
import numpy as np
import pytest
from conftest import isa_paths

_native = pytest.importorskip("memfit._native")
from memfit.ops import QTensor  # noqa: E402
from memfit.ops import native as nat  # noqa: E402
from memfit.quant.activations import round_activations  # noqa: E402
from memfit.quant.random import random_blocks  # noqa: E402
from memfit.quant.types import BY_NAME, SUPPORTED_NAMES  # noqa: E402

NAMES = list(SUPPORTED_NAMES)
ISAS = ["scalar", "avx2", "avx512", "avx512vnni"]
BOUND = 1e-5  # every type and ISA, against the reference with the kernel's own activations


def _gguf_deq(t, raw):
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t.id)).reshape(-1).astype(np.float32)


@pytest.fixture(params=isa_paths())
def isa(request):
    name = request.param
    before = _native.isa()
    _native.set_isa(name)
    yield name
    _native.set_isa(before)


@pytest.mark.parametrize("name", NAMES)
def test_dequantize_bit_exact(name):
    t = BY_NAME[name]
    rng = np.random.default_rng(t.id)
    counts = (1, 3, 1001) if t.block_size == 1 else (1, 7, 301)
    for nblocks in counts:
        n = nblocks * t.block_size
        raw = random_blocks(t, n, rng)
        ref = _gguf_deq(t, raw)
        got = nat.dequantize(t.id, raw, n)
        assert got.shape == (n,)
        np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32), err_msg=f"{name} n={n}")


def _xref(isa, t, X):
    """The activations the kernel of this ISA dots with: f32 as given on the scalar path and
    for float weights, else rounded to 8 bits per block as ggml's vec_dot_type."""
    if isa == "scalar" or t.block_size == 1:
        return X.astype(np.float64)
    return round_activations(X, t.block_size if t.block_size == 256 else 32).astype(np.float64)


def _relerr(y, ref, scale=None):
    # max abs error over the output magnitude (scale: max |ref| of the full product, so a
    # 1-element slice is judged against the typical output size, not its own value)
    scale = np.abs(ref).max() if scale is None else scale
    return float(np.abs(y - ref).max() / max(scale, 1e-30))


@pytest.mark.parametrize("name", NAMES)
def test_matmul_shapes(isa, name):
    # rows 1/3/37/129 (not multiples of threads or tiles) x n 1/2/7/64/512, one 3-block width
    t = BY_NAME[name]
    rng = np.random.default_rng(100 + t.id)
    cols = 3 * max(t.block_size, 32)  # 3 blocks (NVFP4: 64 values)
    rb = t.row_bytes(cols)
    W = random_blocks(t, 129 * cols, rng)
    Wf = _gguf_deq(t, W).reshape(129, cols).astype(np.float64)
    X = rng.standard_normal((512, cols)).astype(np.float32)
    ref = _xref(isa, t, X) @ Wf.T
    for rows in (1, 3, 37, 129):
        w = QTensor("w", t, (rows, cols), W[: rows * rb])
        for n in (1, 2, 7, 64, 512):
            y = nat.matmul(X[:n], w)
            assert y.shape == (n, rows) and y.dtype == np.float32
            err = _relerr(y, ref[:n, :rows], np.abs(ref).max())
            assert err < BOUND, f"{name} {isa} rows={rows} n={n}: rel err {err:.2e}"


@pytest.mark.parametrize("name", NAMES)
def test_matmul_widths(isa, name):
    # one block, two blocks and a wide row (4096) with a reused out= array
    t = BY_NAME[name]
    rng = np.random.default_rng(200 + t.id)
    bs = max(t.block_size, 32)
    widths = (bs, 2 * bs, 4096) + ((37, 1) if t.block_size == 1 else ())  # float tails
    for cols in widths:
        rows = 37
        W = random_blocks(t, rows * cols, rng)
        Wf = _gguf_deq(t, W).reshape(rows, cols).astype(np.float64)
        X = rng.standard_normal((7, cols)).astype(np.float32)  # 7: 4-row kernel + remainder
        out = np.full((7, rows), np.nan, dtype=np.float32)
        y = nat.matmul(X, QTensor("w", t, (rows, cols), W), out=out)
        assert y is out
        err = _relerr(y, _xref(isa, t, X) @ Wf.T)
        assert err < BOUND, f"{name} {isa} cols={cols}: rel err {err:.2e}"


@pytest.mark.parametrize("name", [n for n in NAMES if BY_NAME[n].block_size > 1])
def test_bound_catches_a_zeroed_subblock(name):
    # a kernel that dropped one 32-value sub-block of one row (a scale or offset bug) would
    # miss the reference by far more than BOUND on every type (measured >= 6e-2)
    t = BY_NAME[name]
    rng = np.random.default_rng(400 + t.id)
    rows, cols = 37, 3 * max(t.block_size, 32)
    W = random_blocks(t, rows * cols, rng)
    Wf = _gguf_deq(t, W).reshape(rows, cols).astype(np.float64)
    X = rng.standard_normal((7, cols)).astype(np.float32)
    isa = _native.isa()
    y = nat.matmul(X, QTensor("w", t, (rows, cols), W))
    ref = _xref(isa, t, X) @ Wf.T
    assert _relerr(y, ref) < BOUND
    Wf[5, 32:64] = 0
    assert _relerr(y, _xref(isa, t, X) @ Wf.T, np.abs(ref).max()) > 1000 * BOUND


@pytest.mark.parametrize("name", ["F16", "Q4_0", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS"])
def test_get_rows(name):
    t = BY_NAME[name]
    rng = np.random.default_rng(300 + t.id)
    rows, cols = 50, 512
    W = random_blocks(t, rows * cols, rng)
    Wf = _gguf_deq(t, W).reshape(rows, cols)
    ids = np.array([0, 49, 7, 7, 23], dtype=np.int32)
    got = nat.get_rows(QTensor("w", t, (rows, cols), W), ids)
    np.testing.assert_array_equal(got, Wf[ids])
    with pytest.raises(IndexError, match="50"):
        nat.get_rows(QTensor("w", t, (rows, cols), W), np.array([1, 50]))


def test_bad_shapes_raise():
    t = BY_NAME["Q4_K"]
    W = random_blocks(t, 2 * 256, np.random.default_rng(0))
    out = np.empty((1, 2), np.float32)
    with pytest.raises(ValueError, match="multiple of the block size"):
        _native.matmul(t.id, W, 2, 128, np.zeros((1, 128), np.float32), 1, out)
    with pytest.raises(ValueError, match="too small"):
        _native.matmul(t.id, W, 3, 256, np.zeros((1, 256), np.float32), 1, np.empty((1, 3), np.float32))
    with pytest.raises(ValueError, match="not supported"):
        _native.dequantize(9, W, 32, np.empty(32, np.float32))  # Q8_1: no kernel
    with pytest.raises(TypeError, match="float32"):
        _native.matmul(t.id, W, 2, 256, np.zeros((1, 256), np.float32), 1, np.empty((1, 2), np.float64))


# (type, row counts n): the VNNI decode kernels that only fuse integer steps of an AVX2 kernel
# (vpdpbusd for maddubs + madd) keep its lanes and float order (32-element types). Not Q4_0:
# its 4- and 8-row decode kernels take two blocks per 512-bit step
# (test_q4_0_decode_groups_same_bits); not the K-quants (512-bit decode) nor any prefill kernel
# (the VNNI GEMMs have their own float order). Those are checked against the reference bound
# (test_matmul_shapes, test_b32_gemm_*, test_kgemm_rows_*) and for batch invariance
# (tests/test_batch_invariance_kernels.py).
VNNI_SAME_BITS = [("Q4_1", (1, 2, 3, 4, 7)), ("Q5_0", (1, 2, 3, 4, 7)), ("Q5_1", (1, 2, 3, 4, 7))]


@pytest.mark.parametrize("name, ns", VNNI_SAME_BITS, ids=[n for n, _ in VNNI_SAME_BITS])
def test_vnni_kernels_bit_identical_to_avx2(name, ns):
    if ISAS.index(_native.isa_hw()) < ISAS.index("avx512vnni"):
        pytest.skip("CPU lacks avx512vnni")
    t = BY_NAME[name]
    rng = np.random.default_rng(500 + t.id)
    rows, cols = 37, 512  # 37 rows: 4-row groups and a 1-row remainder
    w = QTensor("w", t, (rows, cols), random_blocks(t, rows * cols, rng))
    before = _native.isa()
    try:
        for n in ns:
            x = rng.standard_normal((n, cols)).astype(np.float32)
            got = {}
            for isa in ("avx2", "avx512vnni"):
                _native.set_isa(isa)
                got[isa] = nat.matmul(x, w, rowwise=True)
            np.testing.assert_array_equal(got["avx2"], got["avx512vnni"], err_msg=f"{name} n={n}")
    finally:
        _native.set_isa(before)



B32 = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"]


@pytest.fixture
def vnni():
    """The avx512vnni kernels for one test (skipped on CPUs without them); ISA and thread count
    restored after."""
    if ISAS.index(_native.isa_hw()) < ISAS.index("avx512vnni"):
        pytest.skip("CPU lacks avx512vnni")
    before, threads = _native.isa(), _native.get_threads()
    _native.set_isa("avx512vnni")
    yield
    _native.set_isa(before)
    _native.set_threads(threads)


@pytest.mark.parametrize("name", B32)
def test_b32_gemm_bound_wide(name, vnni):
    # the avx512vnni banded GEMM (n >= 16) at a 7B-like width, rows not a multiple of 8
    # (8-row groups + 1-row remainder) and n not a multiple of 16 (a zero-padded band)
    t = BY_NAME[name]
    rng = np.random.default_rng(600 + t.id)
    rows, cols = 45, 4096
    W = random_blocks(t, rows * cols, rng)
    Wf = _gguf_deq(t, W).reshape(rows, cols).astype(np.float64)
    X = rng.standard_normal((35, cols)).astype(np.float32)
    y = nat.matmul(X, QTensor("w", t, (rows, cols), W))
    err = _relerr(y, _xref("avx512vnni", t, X) @ Wf.T)
    assert err < BOUND, f"{name}: rel err {err:.2e}"


@pytest.mark.parametrize("name", B32)
def test_b32_gemm_row_independent_of_n_and_threads(name, vnni):
    # one X row's outputs are the same bits inside batches of 17, 33 and 512 rows (other
    # band position, other neighbours, padded or full bands) and with 1 or 2 threads (205
    # rows: 64-row tasks on 1 thread, 16-row tasks on 2; a 5-row remainder)
    t = BY_NAME[name]
    rng = np.random.default_rng(700 + t.id)
    rows, cols = 205, 576
    w = QTensor("w", t, (rows, cols), random_blocks(t, rows * cols, rng))
    X = rng.standard_normal((512, cols)).astype(np.float32)
    x0 = X[300]
    outs = []
    for nt in (1, 2):
        _native.set_threads(nt)
        for n, at in ((17, 16), (33, 5), (512, 300)):
            Xb = X[:n].copy()
            Xb[at] = x0
            outs.append(nat.matmul(Xb, w)[at])
    for o in outs[1:]:
        np.testing.assert_array_equal(o.view(np.uint32), outs[0].view(np.uint32), err_msg=name)


KQUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("name", KQUANTS)
def test_kgemm_rows_independent_of_batch_and_threads(name, vnni):
    # avx512vnni K-quant GEMM (n >= 10): an X row's outputs are the same bits whichever rows
    # share its 16-row band (n = 17, 33, 512: bands padded with zero rows), at any position,
    # and for 1 or 2 threads; rows = 45: 8-row groups and a 5-row remainder, task splits
    t = BY_NAME[name]
    rng = np.random.default_rng(700 + t.id)
    rows, cols = 45, 768
    W = random_blocks(t, rows * cols, rng)
    w = QTensor("w", t, (rows, cols), W)
    X = rng.standard_normal((512, cols)).astype(np.float32)
    full = nat.matmul(X, w)
    ref = _xref("avx512vnni", t, X) @ _gguf_deq(t, W).reshape(rows, cols).astype(np.float64).T
    assert _relerr(full, ref) < BOUND
    for n in (17, 33):
        for start in (0, 5, 512 - n):
            np.testing.assert_array_equal(nat.matmul(X[start:start + n], w), full[start:start + n],
                                          err_msg=f"{name} n={n} start={start}")
    for nt in (1, 2):
        _native.set_threads(nt)
        np.testing.assert_array_equal(nat.matmul(X, w), full, err_msg=f"{name} threads={nt}")


def test_q8_0_decode_long_rows_4row_kernel(vnni):
    # Q8_0 decode with rows of >= 2 KiB runs the 4-row avx512vnni kernel (csrc/quant_mm.c
    # MF_Q8_VD4_MIN_RB): 45 rows = 11 groups of 4 and one row alone; within the bound, and a
    # row's bits do not depend on the other X rows (n = 1..3) or the thread count
    t = BY_NAME["Q8_0"]
    rng = np.random.default_rng(812)
    rows, cols = 45, 4096
    W = random_blocks(t, rows * cols, rng)
    w = QTensor("w", t, (rows, cols), W)
    X = rng.standard_normal((3, cols)).astype(np.float32)
    ref = _xref("avx512vnni", t, X) @ _gguf_deq(t, W).reshape(rows, cols).astype(np.float64).T
    full = nat.matmul(X, w, rowwise=True)
    assert _relerr(full, ref) < BOUND
    for i in range(3):
        np.testing.assert_array_equal(nat.matmul(X[i:i + 1], w, rowwise=True)[0], full[i])
    _native.set_threads(1)
    np.testing.assert_array_equal(nat.matmul(X, w, rowwise=True), full)


def _decode_within_bound(t, rows, cols, n, seed):
    """A random (rows, cols) matrix of type t and n X rows, their product checked against the
    reference bound: (rows_of(a, b) -> QTensor of rows [a, b), X, product)."""
    rng = np.random.default_rng(seed)
    W = random_blocks(t, rows * cols, rng)
    rb = len(W) // rows
    X = rng.standard_normal((n, cols)).astype(np.float32)
    ref = _xref("avx512vnni", t, X) @ _gguf_deq(t, W).reshape(rows, cols).astype(np.float64).T
    full = nat.matmul(X, QTensor("w", t, (rows, cols), W), rowwise=True)
    assert _relerr(full, ref) < BOUND
    return (lambda a, b: QTensor("w", t, (b - a, cols), W[a * rb:b * rb])), X, full


def _same_bits(a, b, msg):
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32), err_msg=msg)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_strided_decode_rows_independent_of_split(name, vnni):
    # decode of rows <= 3 KiB with the 4/8-row kernels groups a task's rows a part apart
    # (csrc/quant_mm.c vec_rows_strided): the parts follow the task size, which follows the
    # thread count; a row's bits must not. 203 rows: tasks of 116 or 104 rows, a 3-row
    # remainder at the matrix end; rows 40-139 as their own matrix (other parts, other groups)
    t = BY_NAME[name]
    rows, cols = 203, 1024
    rows_of, X, full = _decode_within_bound(t, rows, cols, 3, 960 + t.id)
    for nt in (1, 2):
        _native.set_threads(nt)
        _same_bits(nat.matmul(X, rows_of(0, rows), rowwise=True), full, f"{name} threads={nt}")
        _same_bits(nat.matmul(X, rows_of(40, 140), rowwise=True), full[:, 40:140], f"{name} threads={nt}")
        for i in range(3):
            _same_bits(nat.matmul(X[i:i + 1], rows_of(0, rows), rowwise=True), full[i:i + 1], f"{name} x row {i}")


@pytest.mark.parametrize("cols", [96, 160, 4096])
def test_q4_0_decode_groups_same_bits(cols, vnni):
    # Q4_0 decode on avx512vnni: 8-row groups, then 4-row groups from a multiple of 4 rows,
    # two blocks per 512-bit step (odd block counts: a half step). A row's bits must not
    # depend on its group (8 or 4 rows: the split into tasks follows the thread count) and
    # stay within the bound. 13 rows: 0-7 in an 8-row group, 8-11 in a 4-row one, 12 alone;
    # rows 4-11 as their own matrix: 8 rows split into 4-row tasks by 2 threads.
    rows_of, X, full = _decode_within_bound(BY_NAME["Q4_0"], 13, cols, 2, 950 + cols)
    for nt in (1, 2):
        _native.set_threads(nt)
        _same_bits(nat.matmul(X, rows_of(4, 12), rowwise=True), full[:, 4:12], f"threads={nt}")
        _same_bits(nat.matmul(X, rows_of(8, 12), rowwise=True), full[:, 8:12], f"threads={nt}")


@pytest.mark.parametrize("name, cols", [("Q4_K", 11008), ("Q5_K", 9216), ("Q6_K", 7680), ("IQ4_XS", 12288),
                                        ("Q3_K", 11008), ("Q2_K", 11008), ("Q8_0", 2048)])
def test_4row_decode_same_bits_as_1row(name, cols, vnni):
    # rows of >= 6 KiB (Q4_K/Q5_K/Q6_K; Q2_K/Q3_K/IQ4_XS: as many values) / 2 KiB (Q8_0) decode
    # 4 (or 8) rows at a time on avx512vnni; the 256-value types' rows keep the 1-row kernel's
    # bits exactly (a row alone in a 1-row matrix takes the 1-row kernel): rows 0-7 in 4- or
    # 8-row groups, row 8 alone
    t = BY_NAME[name]
    rng = np.random.default_rng(900 + t.id)
    rows = 9
    W = random_blocks(t, rows * cols, rng)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    full = nat.matmul(x, QTensor("w", t, (rows, cols), W), rowwise=True)[0]
    rb = len(W) // rows
    alone = np.array([nat.matmul(x, QTensor("w", t, (1, cols), W[r * rb:(r + 1) * rb]), rowwise=True)[0, 0] for r in range(rows)])
    if name == "Q8_0":  # its 4-row kernel sums in another order: within the bound
        ref = _xref("avx512vnni", t, x) @ _gguf_deq(t, W).reshape(rows, cols).astype(np.float64).T
        assert _relerr(full[None], ref) < BOUND and _relerr(alone[None], ref) < BOUND
    else:
        np.testing.assert_array_equal(full.view(np.uint32), alone.view(np.uint32))
