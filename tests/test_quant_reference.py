"""memfit's numpy dequantization against gguf-py (the ggml-org oracle), bit for bit."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from memfit.errors import UnsupportedError
from memfit.quant.random import random_blocks, random_weight
from memfit.quant.reference import dequantize, dequantize_rows
from memfit.quant.types import BY_NAME, SUPPORTED, TYPES

SUPPORTED_NAMES = sorted(TYPES[i].name for i in SUPPORTED)


def _oracle(name: str, raw: np.ndarray) -> np.ndarray:
    out = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])
    return np.asarray(out, dtype=np.float32).reshape(-1)


@pytest.mark.parametrize("name", SUPPORTED_NAMES)
@pytest.mark.parametrize("n_blocks", [1, 7, 64])
def test_bit_exact_against_gguf(name, n_blocks):
    t = BY_NAME[name]
    # float types have 1-element "blocks": use a few hundred elements
    n = t.block_size * n_blocks if t.block_size > 1 else 37 * n_blocks
    raw = random_blocks(t, n, np.random.default_rng(n_blocks * 1000 + t.id))
    assert raw.dtype == np.uint8 and raw.size == n // t.block_size * t.type_size
    ours = dequantize(t.id, raw, n)
    assert ours.dtype == np.float32 and ours.shape == (n,)
    assert np.isfinite(ours).all()
    assert np.array_equal(ours, _oracle(name, raw))


@pytest.mark.parametrize("name", SUPPORTED_NAMES)
def test_rows_and_inputs(name):
    t = BY_NAME[name]
    rows, cols = 3, 512
    w = random_weight(t, (rows, cols), np.random.default_rng(7), scale=0.02)
    assert w.shape == (rows, t.row_bytes(cols)) and w.dtype == np.uint8
    m = dequantize_rows(t, w, rows, cols)
    assert m.shape == (rows, cols)
    assert np.array_equal(m.reshape(-1), _oracle(name, w.reshape(-1)))
    # bytes and read-only views are accepted; only the first n_elements are decoded
    assert np.array_equal(dequantize(t.id, w.tobytes(), cols), m[0])
    ro = w.reshape(-1).copy()
    ro.flags.writeable = False
    assert np.array_equal(dequantize(t.id, ro, rows * cols), m.reshape(-1))


@pytest.mark.parametrize("name", SUPPORTED_NAMES)
def test_random_values_look_like_weights(name):
    t = BY_NAME[name]
    n = max(t.block_size, 32) * 256
    x = dequantize(t.id, random_blocks(t, n, np.random.default_rng(3)), n)
    mean_abs = float(np.abs(x).mean())
    assert 0.01 < mean_abs < 0.2, mean_abs  # scale=0.05 -> typical |w| of that order
    assert float(np.abs(x).max()) < 1.0
    assert np.unique(x).size > 16  # not constant / zero runs


def test_random_is_deterministic_per_seed():
    t = BY_NAME["Q4_K"]
    a = random_weight(t, (4, 256), np.random.default_rng(5))
    b = random_weight(t, (4, 256), np.random.default_rng(5))
    c = random_weight(t, (4, 256), np.random.default_rng(6))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_random_weight_rejects_partial_block():
    with pytest.raises(UnsupportedError, match="Q4_K"):
        random_weight(BY_NAME["Q4_K"], (2, 100), np.random.default_rng(0))


def _quantizable() -> list[str]:
    out = []
    for name in SUPPORTED_NAMES:
        try:
            gguf.quants.quantize(np.zeros((1, 256), np.float32), gguf.GGMLQuantizationType[name])
        except NotImplementedError:
            continue
        out.append(name)
    return out


@pytest.mark.parametrize("name", _quantizable())
def test_round_trip_through_gguf_quantize(name):
    t = BY_NAME[name]
    x = (np.random.default_rng(11).standard_normal((5, 256)) * 0.05).astype(np.float32)
    raw = np.asarray(gguf.quants.quantize(x, gguf.GGMLQuantizationType[name])).view(np.uint8)
    y = dequantize_rows(t, raw.reshape(-1), 5, 256)
    assert np.array_equal(y.reshape(-1), _oracle(name, raw.reshape(-1)))
    if t.block_size == 1:  # floats: relative rounding of an 8 (BF16) / 11 (F16) bit mantissa
        rel = {"F32": 0.0, "F16": 2.0 ** -11, "BF16": 2.0 ** -8}[name]
        assert np.all(np.abs(y - x) <= np.abs(x) * rel + 2.0 ** -25)  # + F16 subnormal half-step
    else:  # error bounded by the format's step: 4-bit ~ max/8, 5-bit ~ max/16, 8-bit ~ max/127
        # MXFP4 (E2M1 on a power-of-two scale that may clip the block's max by < 2^-1 of it)
        # and the ternary TQ1_0/TQ2_0 (d = max, values -d/0/d): error <= max/2
        bits = {"Q4": 4, "Q5": 5, "Q8": 8, "MX": 2, "NV": 2, "TQ": 2}[name[:2]]
        step = float(np.abs(x).max()) / 2 ** (bits - 1)
        assert float(np.abs(y - x).max()) <= step, (name, step)


def test_hand_made_q4_0_and_q5_0():
    # Q4_0: d = 0.5, element j = low nibble j, element 16+j = high nibble; x = d * (q - 8)
    q = np.arange(32) % 16
    blk = np.concatenate([np.float16(0.5).reshape(1).view(np.uint8),
                          (q[:16] | (q[16:] << 4)).astype(np.uint8)])
    assert np.array_equal(dequantize(BY_NAME["Q4_0"].id, blk, 32), 0.5 * (q - 8))
    # Q5_0: the 5th bit of element j is bit j of the u32 qh; set it for element 3 and 31
    qh = np.array([(1 << 3) | (1 << 31)], "<u4").view(np.uint8)
    blk5 = np.concatenate([np.float16(0.25).reshape(1).view(np.uint8), qh,
                           np.zeros(16, np.uint8)])
    want = np.full(32, -16.0 * 0.25)
    want[[3, 31]] = 0.0
    assert np.array_equal(dequantize(BY_NAME["Q5_0"].id, blk5, 32), want)


def test_hand_made_q8_0_and_bf16():
    blk = np.concatenate([np.float16(0.125).reshape(1).view(np.uint8),
                          np.arange(-16, 16, dtype=np.int8).view(np.uint8)])
    assert np.array_equal(dequantize(BY_NAME["Q8_0"].id, blk, 32), 0.125 * np.arange(-16, 16))
    bf = np.array([0x3F80, 0xC040], "<u2").view(np.uint8)  # 1.0, -3.0
    assert np.array_equal(dequantize(BY_NAME["BF16"].id, bf, 2), [1.0, -3.0])


@pytest.mark.parametrize("type_id,name", [(9, "Q8_1"), (41, "Q1_0"), (99, "99")])
def test_unsupported_types_are_named(type_id, name):
    with pytest.raises(UnsupportedError, match=name):
        dequantize(type_id, np.zeros(1024, np.uint8), 256)


NEW = ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M",
       "MXFP4", "NVFP4", "TQ1_0", "TQ2_0"]


@pytest.mark.parametrize("name", NEW)
def test_random_blocks_of_new_types_are_finite_and_sized(name):
    # random valid blocks: finite values of the requested magnitude, never a run of zeros
    from memfit.quant.random import random_blocks
    t = BY_NAME[name]
    w = dequantize(t.id, random_blocks(t, 256 * 32, np.random.default_rng(3)), 256 * 32)
    assert np.isfinite(w).all() and 0.02 < float(np.abs(w).mean()) < 0.1
    assert np.count_nonzero(w) > w.size // 2
