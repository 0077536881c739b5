"""IQ3_XXS, IQ3_S, IQ1_S, IQ1_M in the native core (csrc/quant_iq3.c).

Dequantize: bit-exact with gguf-py, including the blocks of extreme codes (every index, sign
and scale bit set or clear). Matmul on every ISA path this CPU runs, against the float64
product of gguf-py's weights and the activations as ggml quantizes them (Q8_K per 256, the
types' vec_dot_type; the scalar path dots in f32 against the unquantized x): odd row counts,
n = 1..33, in decode and prefill mode (the K-quant GEMMs on blocks unpacked with an offset),
and activations that drive every int8 to +-127 (no int16 saturation in the kernels' pair sums:
IQ3_XXS's unpacked codes reach 126). Each row's bits do not depend on the call's other rows in
either mode, and a tiny model of each type prefilled agrees with it token by token.
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
from memfit.quant.random import random_blocks  # noqa: E402
from memfit.quant.types import BY_NAME  # noqa: E402

NAMES = ["IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"]
BOUND = 1e-5


def _deq(t, raw):
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t.id)).reshape(-1).astype(np.float32)


def _extreme_blocks(t, rng):
    """Blocks with all code bytes 0x00, all 0xFF, and alternating 0x55/0xAA, with a valid d."""
    base = random_blocks(t, 4 * 256, rng).reshape(4, t.type_size)
    out = []
    for fill in (0x00, 0xFF, 0x55, 0xAA):
        b = base.copy()
        if t.name == "IQ1_M":  # d lives in the top nibbles of the last 4 u16 words
            b[:, :48] = fill
            w = b[:, 48:56].copy().view("<u2")
            w[:] = (w & np.uint16(0xF000)) | np.uint16((fill << 4 | fill >> 4 | fill << 8) & 0x0FFF)
            b[:, 48:56] = w.view(np.uint8)
        else:  # d: the leading f16
            b[:, 2:] = fill
        out.append(b)
    return np.concatenate(out).reshape(-1)


@pytest.mark.parametrize("name", NAMES)
def test_dequantize_bit_exact_with_extreme_codes(name):
    t = BY_NAME[name]
    rng = np.random.default_rng(t.id)
    for raw in (random_blocks(t, 37 * 256, rng), _extreme_blocks(t, rng)):
        n = raw.size // t.type_size * 256
        ref = _deq(t, raw)
        assert np.isfinite(ref).all() and np.abs(ref).max() > 0
        got = nat.dequantize(t.id, raw, n)
        np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


def _ref(isa, X, Wf):
    xr = X.astype(np.float64) if isa == "scalar" else round_activations(X, 256).astype(np.float64)
    return xr @ Wf.T


@pytest.mark.parametrize("name", NAMES)
def test_matmul_odd_shapes(isa, name):
    t = BY_NAME[name]
    rng = np.random.default_rng(500 + t.id)
    rows, cols = 45, 5 * 256  # rows: not a multiple of 4 or 8
    W = random_blocks(t, rows * cols, rng)
    Wf = _deq(t, W).reshape(rows, cols).astype(np.float64)
    X = rng.standard_normal((33, cols)).astype(np.float32)
    ref = _ref(isa, X, Wf)
    scale = np.abs(ref).max()
    w = QTensor("w", t, (rows, cols), W)
    for n in (1, 2, 3, 5, 8, 9, 16, 17, 33):
        for rowwise in (True, False):
            y = nat.matmul(X[:n], w, rowwise=rowwise)
            err = np.abs(y - ref[:n]).max() / scale
            assert err < BOUND, f"{name} {isa} n={n} rowwise={rowwise}: {err:.2e}"
    for r in (1, 7, 13):  # a few rows alone
        y = nat.matmul(X[:3], QTensor("w", t, (r, cols), W[: r * t.row_bytes(cols)]))
        assert np.abs(y - ref[:3, :r]).max() / scale < BOUND


@pytest.mark.parametrize("name", NAMES)
def test_matmul_saturating_activations(isa, name):
    # every x quantizes to +-127 and the weights use the extreme codes: the largest int16 pair
    # sums the kernels form (grid 62 x 127 x 2 for IQ3_XXS) must not saturate
    t = BY_NAME[name]
    rng = np.random.default_rng(600 + t.id)
    W = _extreme_blocks(t, rng)
    rows = W.size // t.type_size
    Wf = _deq(t, W).reshape(rows, 256).astype(np.float64)
    X = np.stack([np.ones(256), -np.ones(256), np.where(np.arange(256) % 3, 1.0, -1.0)]).astype(np.float32)
    ref = _ref(isa, X, Wf)
    for rowwise in (True, False):
        y = nat.matmul(X, QTensor("w", t, (rows, 256), W), rowwise=rowwise)
        assert np.abs(y - ref).max() / np.abs(ref).max() < BOUND


@pytest.mark.parametrize("name", NAMES)
def test_rows_independent_of_the_call(isa, name):
    # decode (rowwise: the vec-dots) and prefill (the K-quant GEMMs on the unpacked blocks)
    # calls of any n give each X row the bits that mode gives the row alone
    t = BY_NAME[name]
    rng = np.random.default_rng(700 + t.id)
    rows, cols = 37, 2 * 256
    w = QTensor("w", t, (rows, cols), random_blocks(t, rows * cols, rng))
    X = rng.standard_normal((37, cols)).astype(np.float32)
    for rowwise in (True, False):
        alone = np.concatenate([nat.matmul(X[i:i + 1], w, rowwise=rowwise) for i in range(37)])
        for n in (2, 5, 16, 17, 37):
            got = nat.matmul(X[:n], w, rowwise=rowwise)
            np.testing.assert_array_equal(got.view(np.uint32), alone[:n].view(np.uint32))


@pytest.mark.parametrize("name", NAMES)
def test_tiny_model_prefill_equals_token_by_token(tmp_path, name):
    cfg = dict(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, head_dim=64, n_ff=512)
    path = write_tiny_model(tmp_path / "m.gguf", "llama", name, seed=BY_NAME[name].id, **cfg)
    m = load_model(path, ops=get_ops("native"))
    ids = np.array([5, 17, 200, 33, 290, 0, 64, 64, 128, 7], dtype=np.int32)
    full = m.forward(ids, m.new_cache(16), all_logits=True)
    cache = m.new_cache(16)
    steps = [m.forward(ids[:3], cache)] + [m.forward(ids[i:i + 1], cache) for i in range(3, len(ids))]
    step = np.stack(steps)
    assert np.isfinite(full).all() and np.std(full) > 0.1
    # prefill (GEMM) and decode (vec-dot) kernels, attention and the f16 KV differ by f32
    # rounding: measured 2e-7..9e-7 of the largest logit, but where a difference flips one
    # 8-bit activation's rounding in a later matmul, up to 9e-3 (IQ3_XXS, this seed; these
    # models' native logits are 2-4% off float64, as Q4_K's); a wrong row or position is O(1)
    err = np.abs(step - full[2:]).max() / np.abs(full).max()
    assert err < 3e-2, err


@pytest.mark.parametrize("name, isa", [("IQ3_XXS", "avx2"), ("IQ1_S", "avx512vnni"), ("IQ1_M", "avx512vnni")])
def test_gather_and_scalar_load_forms_same_bits(name, isa):
    # the IQ3 and IQ1 kernels gather the grid rows or load them one by one (MEMFIT_GATHER, else
    # by CPU: csrc/pool.c; IQ3_XXS's AVX2 kernels, the AVX-512 ones of IQ1_S and IQ1_M); both
    # must give the same bits, whichever this CPU uses by default
    import subprocess
    import sys
    from memfit import _native
    if isa not in isa_paths():
        pytest.skip(f"no {isa} kernels on this CPU")
    code = ("import numpy as np, sys\n"
            "from memfit import _native\n"
            "from memfit.ops import QTensor\n"
            "from memfit.ops import native as nat\n"
            "from memfit.quant.random import random_blocks\n"
            "from memfit.quant.types import BY_NAME\n"
            f"t = BY_NAME['{name}']; rng = np.random.default_rng(5)\n"
            "w = QTensor('w', t, (37, 768), random_blocks(t, 37 * 768, rng))\n"
            "x = rng.standard_normal((5, 768)).astype(np.float32)\n"
            f"_native.set_isa('{isa}')\n"
            "sys.stdout.write(np.concatenate([nat.matmul(x, w, rowwise=m).ravel() for m in (True, False)]).tobytes().hex())\n")
    outs = []
    for g in ("0", "1"):
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**__import__("os").environ, "MEMFIT_GATHER": g})
        assert p.returncode == 0, p.stderr
        outs.append(p.stdout)
    assert outs[0] == outs[1] and len(outs[0]) > 0
