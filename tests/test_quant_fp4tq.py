"""MXFP4, NVFP4, TQ1_0, TQ2_0 (csrc/quant_fp4tq.c): dequantize bit-exact with gguf-py on every
scale/code value, matmul on every ISA path against the reference on the activations as ggml
quantizes them (Q8_0 for the FP4 types, Q8_K for the ternary ones), decode rows independent
of the other rows / X rows / threads, and prefill == token by token on a tiny model."""

import gguf
import numpy as np
import pytest

_native = pytest.importorskip("memfit._native")
from memfit.engine.engine import Engine  # noqa: E402
from memfit.engine.sampler import SamplingParams  # noqa: E402
from memfit.gguf import open_gguf  # noqa: E402
from memfit.models import load_model  # noqa: E402
from memfit.models.synthetic import write_tiny_model  # noqa: E402
from memfit.ops import QTensor, get_ops  # noqa: E402
from memfit.ops import native as nat  # noqa: E402
from memfit.quant.activations import round_activations  # noqa: E402
from memfit.quant.random import random_blocks  # noqa: E402
from memfit.quant.types import BY_NAME  # noqa: E402
from memfit.tokenizer import Tokenizer  # noqa: E402

NAMES = ["MXFP4", "NVFP4", "TQ1_0", "TQ2_0"]
BOUND = 1e-5


def _gguf_deq(t, raw):
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t.id)).reshape(-1).astype(np.float32)


def _all_codes(name):
    """Blocks whose scale bytes take every value 0..255 (MXFP4's e8m0 incl. the subnormal 0/1
    and 255; NVFP4's UE4M3 incl. 0x7F, the NaN code read as 0, and bit 7 set) and whose quant
    bytes take every value (TQ1_0: also the bytes > 242 no quantizer writes)."""
    t = BY_NAME[name]
    rng = np.random.default_rng(5)
    b = random_blocks(t, 256 * t.block_size, rng).reshape(256, t.type_size).copy()
    codes = np.arange(256, dtype=np.uint8)
    if name == "MXFP4":
        b[:, 0] = codes
    elif name == "NVFP4":
        b[:, :4] = np.stack([codes, codes[::-1], np.roll(codes, 7), np.roll(codes, 100)], axis=1)
    else:  # quant bytes: a rotation of 0..255 per block
        nq = t.type_size - 2
        b[:, :nq] = (codes[:, None] + np.arange(nq, dtype=np.uint8)[None, :]).astype(np.uint8)
    return t, b.reshape(-1)


@pytest.mark.parametrize("name", NAMES)
def test_dequantize_every_code_bit_exact(name):
    t, raw = _all_codes(name)
    n = raw.size // t.type_size * t.block_size
    with np.errstate(over="ignore"):  # MXFP4 e = 255: 12 * 2^127 is inf in gguf-py too
        ref = _gguf_deq(t, raw)
    got = nat.dequantize(t.id, raw, n)
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


def _xref(isa, t, X):
    if isa == "scalar":
        return X.astype(np.float64)
    return round_activations(X, 256 if t.block_size == 256 else 32).astype(np.float64)


@pytest.mark.parametrize("name", NAMES)
def test_matmul_odd_shapes_every_isa(isa, name):
    # 13 rows (not a multiple of 4 or 8), n = 1..33 in decode and prefill mode, 2 widths
    t = BY_NAME[name]
    rng = np.random.default_rng(40 + t.id)
    for cols in (t.block_size if t.block_size == 256 else 4 * t.block_size, 2 * 256 + (256 if t.block_size == 256 else 64)):
        rows = 13
        W = random_blocks(t, rows * cols, rng)
        Wf = _gguf_deq(t, W).reshape(rows, cols).astype(np.float64)
        X = rng.standard_normal((33, cols)).astype(np.float32)
        ref = _xref(isa, t, X) @ Wf.T
        scale = np.abs(ref).max()
        w = QTensor("w", t, (rows, cols), W)
        for n in (1, 2, 3, 5, 8, 17, 33):
            for rowwise in (True, False):
                y = nat.matmul(X[:n], w, rowwise=rowwise)
                err = float(np.abs(y - ref[:n]).max() / scale)
                assert err < BOUND, f"{name} {isa} cols={cols} n={n} rowwise={rowwise}: {err:.2e}"


def _bits(a, b, msg):
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32), err_msg=msg)


@pytest.mark.parametrize("cols", [1024, 13056])
@pytest.mark.parametrize("name", NAMES)
def test_rows_independent_of_batch_split_and_threads(name, cols):
    # on the fastest path, decode and prefill mode each: a W row alone, X rows alone or in
    # another batch, 1 or 2 threads give the same bits. Decode: TQ2_0 on avx512vnni takes 4
    # rows at a time, a task part apart (short rows, 1024) or adjacent (13056). Prefill: MXFP4
    # runs the b32 GEMM, NVFP4 its form with two scales per 32 values (avx512vnni; on avx2 the
    # next test), TQ1_0/TQ2_0 the K-quant GEMM. 37 rows: 4/8-row groups and a remainder
    _rows_independent(name, cols)


@pytest.mark.parametrize("cols", [1024, 13056])
def test_nvfp4_prefill_rows_independent_every_isa(isa, cols):
    # NVFP4's prefill on each ISA path: avx512vnni's b32 GEMM, avx2's b32 GEMM of half-scaled
    # 32-value blocks (quant_avx2.c BDOT), the scalar vec-dots
    _rows_independent("NVFP4", cols)


def _rows_independent(name, cols):
    t = BY_NAME[name]
    rng = np.random.default_rng(60 + t.id)
    rows = 37
    W = random_blocks(t, rows * cols, rng)
    rb = len(W) // rows
    w = QTensor("w", t, (rows, cols), W)
    X = rng.standard_normal((9, cols)).astype(np.float32)
    full = {m: nat.matmul(X, w, rowwise=m) for m in (True, False)}
    threads = _native.get_threads()
    try:
        for nt in (1, 2):
            _native.set_threads(nt)
            for m in (True, False):
                what = f"{name} threads={nt} rowwise={m}"
                _bits(nat.matmul(X, w, rowwise=m), full[m], what)
                for a, b in ((0, 1), (8, 9), (2, 7)):
                    _bits(nat.matmul(X[a:b], w, rowwise=m), full[m][a:b], what)
                for r in (0, 17, 36):
                    one = nat.matmul(X, QTensor("w", t, (1, cols), W[r * rb:(r + 1) * rb]), rowwise=m)
                    _bits(one[:, 0], full[m][:, r], what)
    finally:
        _native.set_threads(threads)


def test_mxfp4_decode_same_bits_on_avx2_and_avx512vnni():
    # the avx512vnni MXFP4 decode kernels (1, 4 and 8 rows, two blocks per step) keep the AVX2
    # kernel's int32 lanes and float steps: the same bits, odd block counts included
    if _native.isa_hw() != "avx512vnni":
        pytest.skip("no AVX-512 VNNI on this CPU")
    t = BY_NAME["MXFP4"]
    rng = np.random.default_rng(77)
    before = _native.isa()
    try:
        for rows, cols in ((37, 32 * 91), (13, 32 * 3), (8, 32), (64, 32 * 128)):
            w = QTensor("w", t, (rows, cols), random_blocks(t, rows * cols, rng))
            X = rng.standard_normal((3, cols)).astype(np.float32)
            got = {}
            for isa in ("avx2", "avx512vnni"):
                _native.set_isa(isa)
                got[isa] = nat.matmul(X, w, rowwise=True)
            _bits(got["avx512vnni"], got["avx2"], f"{rows}x{cols}")
    finally:
        _native.set_isa(before)


@pytest.mark.parametrize("name", NAMES)
def test_tiny_model_prefill_equals_token_by_token(tmp_path, name):
    # a llama of the type (norms F32): one 20-token prefill vs the prompt fed 1 token per step
    path = write_tiny_model(tmp_path / f"{name}.gguf", "llama", name, seed=3)
    f = open_gguf(path)
    tok = Tokenizer.from_metadata(f.metadata)
    tok.eog_ids = set()
    model = load_model(f, ops=get_ops("native"))
    prompt = [3 + (i * 7) % 200 for i in range(20)]

    def run(n_batch):
        eng = Engine(model, tok, n_ctx=64, n_parallel=1, n_batch=n_batch)
        logits = []
        sample = eng._sample
        eng._sample = lambda s, lg: (logits.append(lg.copy()), sample(s, lg))[1]
        eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=4))
        toks = [o.token for _ in range(200) if eng.has_unfinished() for o in eng.step() if o.token is not None]
        return toks, np.stack(logits)

    a, b = run(512), run(1)
    assert a[0] == b[0] and len(a[0]) == 4
    np.testing.assert_array_equal(a[1].view(np.uint32), b[1].view(np.uint32))
    assert np.isfinite(a[1]).all() and np.abs(a[1]).max() > 0
