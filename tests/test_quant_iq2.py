"""IQ2_XXS / IQ2_XS / IQ2_S native kernels (csrc/quant_iq2.c) against gguf-py.

Dequantization is bit-exact on blocks of uniformly random bytes (every grid index, sign
pattern and scale occurs; only d is kept finite). The integer paths dot with the activations
rounded as ggml's Q8_K (round_activations), the scalar path with the plain f32 activations;
both modes (prefill: the kblk/kgemm GEMMs over the unpacked lattice, decode: the vec-dots) on
odd shapes, bound 1e-5 of the largest output. One flipped sign bit moves an output by far
more than the bound. A tiny model of each type gives the same logits prefilled as decoded
token by token (different kernels, so not the same bits; within 1e-4).
"""

import gguf
import numpy as np
import pytest
from conftest import isa_paths

_native = pytest.importorskip("memfit._native")
from memfit.models import load_model  # noqa: E402
from memfit.models.synthetic import write_tiny_model  # noqa: E402
from memfit.ops import QTensor, get_ops  # noqa: E402
from memfit.ops import native as nat  # noqa: E402
from memfit.quant.activations import round_activations  # noqa: E402
from memfit.quant.types import BY_NAME  # noqa: E402

NAMES = ["IQ2_XXS", "IQ2_XS", "IQ2_S"]
BOUND = 1e-5


def _blocks(t, nblocks, rng):
    """Random bytes, d a finite f16 of either sign (any other byte pattern is a valid block)."""
    raw = rng.integers(0, 256, size=(nblocks, t.type_size), dtype=np.uint8)
    d = (rng.standard_normal(nblocks) * 1e-2).astype(np.float16)
    raw[:, 0:2] = d.view(np.uint8).reshape(nblocks, 2)
    return raw.reshape(-1)


def _deq(t, raw):
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t.id)).reshape(-1).astype(np.float32)


@pytest.mark.parametrize("name", NAMES)
def test_dequantize_bit_exact_random_bytes(name):
    t = BY_NAME[name]
    rng = np.random.default_rng(t.id)
    for nblocks in (1, 5, 300):
        raw = _blocks(t, nblocks, rng)
        got = nat.dequantize(t.id, raw, nblocks * 256)
        np.testing.assert_array_equal(got.view(np.uint32), _deq(t, raw).view(np.uint32), err_msg=f"{name} {nblocks}")


def _relerr(y, ref):
    return float(np.abs(y - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("name", NAMES)
def test_matmul_both_modes_odd_shapes(isa, name):
    # rows 13 (no multiple of 4 or 8), n 1..33, cols 256 and 768, prefill and decode kernels
    t = BY_NAME[name]
    rng = np.random.default_rng(40 + t.id)
    for cols in (256, 768):
        rows = 13
        W = _blocks(t, rows * cols // 256, rng)
        w = QTensor("w", t, (rows, cols), W)
        Wf = _deq(t, W).reshape(rows, cols).astype(np.float64)
        X = rng.standard_normal((33, cols)).astype(np.float32)
        Xr = X if isa == "scalar" else round_activations(X, 256)
        ref = Xr.astype(np.float64) @ Wf.T
        for n in (1, 2, 5, 16, 17, 33):
            for rowwise in (True, False):
                y = nat.matmul(X[:n], w, rowwise=rowwise)
                err = _relerr(y, ref[:n])
                assert err < BOUND, f"{name} {isa} cols={cols} n={n} rowwise={rowwise}: {err:.2e}"


@pytest.mark.parametrize("name", NAMES)
def test_one_sign_bit_exceeds_bound(name):
    # the bound is tight enough to see a single weight's sign: flip one sign of one 8-group
    t = BY_NAME[name]
    rng = np.random.default_rng(70 + t.id)
    rows, cols = 4, 512
    W = _blocks(t, rows * cols // 256, rng)
    X = rng.standard_normal((2, cols)).astype(np.float32)
    W2 = W.copy()
    # a sign bit of the second block of row 1: XXS bit 0 of the sign word of sub-block 0 (byte
    # 6), XS bit 9 of qs[0] (byte 3), S bit 0 of the first sign byte (byte 34)
    off = t.type_size * 3 + {"IQ2_XXS": 6, "IQ2_XS": 3, "IQ2_S": 34}[name]
    W2[off] ^= {"IQ2_XXS": 1, "IQ2_XS": 2, "IQ2_S": 1}[name]
    a, b = _deq(t, W), _deq(t, W2)
    assert (a != b).sum() >= 1  # ksigns may flip two values (parity bit)
    for rowwise in (True, False):
        ya = nat.matmul(X, QTensor("w", t, (rows, cols), W), rowwise=rowwise)
        yb = nat.matmul(X, QTensor("w", t, (rows, cols), W2), rowwise=rowwise)
        assert _relerr(yb, ya.astype(np.float64)) > 100 * BOUND


@pytest.mark.parametrize("name", NAMES)
def test_tiny_model_prefill_equals_token_by_token(tmp_path, name):
    ids = np.array([5, 17, 200, 33, 290, 0, 64, 64, 128, 7, 255, 1], dtype=np.int32)
    path = write_tiny_model(tmp_path / "m.gguf", "llama", name, seed=2, n_embd=256, n_layer=2, n_head=4,
                            n_head_kv=2, head_dim=64, n_ff=512)
    logits = {}
    for backend in ("native", "numpy"):
        m = load_model(path, ops=get_ops(backend))
        m.kv_f16 = False
        full = m.forward(ids, m.new_cache(32), all_logits=True)
        logits[backend] = full.astype(np.float64)
        if backend == "native":
            # prompt rows one at a time (the prefill kernels, as a prompt chunked to 1 row):
            # the same bits as the whole prompt in one forward
            cache = m.new_cache(32)
            rows = np.concatenate([m.forward(ids[i:i + 1], cache, all_logits=True) for i in range(len(ids))])
            np.testing.assert_array_equal(rows.view(np.uint32), full.view(np.uint32))
            # decode steps (the vec-dots): f32 rounding apart from the GEMM, 1e-7 of the largest
            # logit until a difference flips one 8-bit activation's rounding in a later matmul
            # (which position depends on the CPU's kernel path; then ~2e-2 from there on, as in
            # test_quant_iq3); a wrong scale, sign or grid row is O(1)
            cache = m.new_cache(32)
            steps = np.stack([m.forward(ids[:1], cache)] + [m.forward(np.array([i]), cache) for i in ids[1:]])
            assert np.std(full) > 0.1
            assert _relerr(steps, logits["native"]) < 3e-2
    # native vs numpy (f32 dequantized weights, f32 activations): the 8-bit activations of the
    # integer kernels, measured 3-4e-2 of the largest logit (IQ4_XS: 5e-2) on these random
    # weights; a wrong scale or grid is O(1)
    assert _relerr(logits["native"], logits["numpy"]) < 0.1


@pytest.mark.parametrize("name", NAMES)
def test_vnni_decode_same_bits_as_avx2(name):
    # the avx512vnni vec-dots only negate x under a mask where avx2 multiplies by a +-1 vector:
    # the same int32 sums and float operations, so the same bits
    if "avx512vnni" not in isa_paths():
        pytest.skip("CPU lacks avx512vnni")
    t = BY_NAME[name]
    rng = np.random.default_rng(80 + t.id)
    w = QTensor("w", t, (21, 1024), _blocks(t, 21 * 4, rng))
    X = rng.standard_normal((3, 1024)).astype(np.float32)
    before = _native.isa()
    try:
        ys = []
        for isa in ("avx2", "avx512vnni"):
            _native.set_isa(isa)
            ys.append(nat.matmul(X, w, rowwise=True))
    finally:
        _native.set_isa(before)
    np.testing.assert_array_equal(ys[0].view(np.uint32), ys[1].view(np.uint32))
