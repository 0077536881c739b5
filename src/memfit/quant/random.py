"""Random but valid GGUF tensor data, for tests and synthetic models.

Quant bits are uniform random bytes; every fp16 scale field (d, dmin, m) is then overwritten
with a finite value sized so dequantized weights have a typical magnitude of about `scale`
(like real weights: |w| ~ 0.01..1). Vectorized so multi-GB models generate at disk speed.

    random_blocks(qtype, n_elements, rng, scale=0.05) -> uint8[n_blocks * type_size]
    random_weight(qtype, (rows, cols), rng, scale=0.05) -> uint8[rows, row_bytes]
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..errors import UnsupportedError
from .types import GGMLType

# name -> (offset of d, offset of dmin/m or None, typical |quant * sub-scale| that d multiplies,
# dmin/m as a multiple of d (the block's centre, so values straddle zero)).
_SCALES = {
    "Q4_0": (0, None, 4.0, 0.0),          # |q - 8| ~ 4
    "Q4_1": (0, 2, 8.0, -7.5),            # m = -7.5 d centres q in 0..15
    "Q5_0": (0, None, 8.0, 0.0),          # |q - 16| ~ 8
    "Q5_1": (0, 2, 16.0, -15.5),
    "Q8_0": (0, None, 64.0, 0.0),         # |q| ~ 64
    "Q2_K": (80, 82, 7.5 * 1.5, 1.5),     # sc ~ 7.5, q ~ 1.5; dmin*m ~ d*sc*q
    "Q3_K": (108, None, 16.0 * 2.0, 0.0),  # |sc - 32| ~ 16, |q| ~ 2
    "Q4_K": (0, 2, 32.0 * 7.5, 7.5),      # sc ~ 32, q ~ 7.5
    "Q5_K": (0, 2, 32.0 * 15.5, 15.5),
    "Q6_K": (208, None, 64.0 * 16.0, 0.0),  # |sc| ~ 64, |q - 32| ~ 16
    "IQ4_NL": (0, None, 60.0, 0.0),        # |kvalue| ~ 60
    "IQ4_XS": (0, None, 16.0 * 60.0, 0.0),
    # lattice types: d * (sub-block scale) * grid value * sign (gguf.quants' dequantizers)
    "IQ2_XXS": (0, None, 7.75 * 0.25 * 25.0, 0.0),  # (0.5 + ls) / 4, grid 8/25/43
    "IQ2_XS": (0, None, 7.75 * 0.25 * 25.0, 0.0),
    "IQ2_S": (0, None, 7.75 * 0.25 * 25.0, 0.0),
    "IQ3_XXS": (0, None, 7.75 * 0.5 * 30.0, 0.0),   # (0.5 + ls) / 2, grid 4..62
    "IQ3_S": (0, None, 16.0 * 8.0, 0.0),            # 1 + 2 sc, grid 1..15
    "IQ1_S": (0, None, 8.0 * 0.7, 0.0),             # 2 s + 1, grid -1/0/1 +- 1/8
    "TQ1_0": (52, None, 0.67, 0.0),                 # d * {-1, 0, 1}
    "TQ2_0": (64, None, 0.67, 0.0),
}
# types whose scales are not one fp16 field: filled by _fix_scales
_SPECIAL = ("IQ1_M", "MXFP4", "NVFP4")
_FLOATS = ("F32", "F16", "BF16")
# every type random_blocks writes
WRITABLE: tuple[str, ...] = _FLOATS + tuple(_SCALES) + _SPECIAL


def _check(qtype: GGMLType) -> None:
    if qtype.name not in _SCALES and qtype.name not in _FLOATS and qtype.name not in _SPECIAL:
        raise UnsupportedError(f"cannot generate random data of type {qtype.name}; supported: "
                               f"{', '.join(_FLOATS + tuple(_SCALES) + _SPECIAL)}")


def _random_bytes(n: int, rng: np.random.Generator) -> np.ndarray:
    """n uniform random bytes (writable), from 64-bit draws: ~2 GB/s."""
    words = rng.integers(0, 2**64 - 1, (n + 7) // 8, dtype=np.uint64, endpoint=True)
    return words.view(np.uint8)[:n]


def _u16_table(values: np.ndarray, qtype_name: str) -> np.ndarray:
    """65536 float values -> their bit patterns in the 16-bit storage type (F16 or BF16)."""
    if qtype_name == "BF16":  # round to nearest even on the top half of the fp32
        bits = values.astype(np.float32).view(np.uint32)
        return ((bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    return values.astype(np.float16).view(np.uint16)


@lru_cache(maxsize=1)
def _normal_table() -> np.ndarray:
    # 65536 fixed standard-normal draws: F32/F16/BF16 data takes its values from this set
    return np.sort(np.random.default_rng(0x6d656d66).standard_normal(65536)).astype(np.float32)


def _random_floats(qtype: GGMLType, n: int, rng: np.random.Generator, scale: float) -> np.ndarray:
    # Each element is a normal quantile picked by 16 random bits: vectorized gather, ~1 GB/s.
    idx = _random_bytes(2 * n, rng).view("<u2")
    table = _normal_table() * np.float32(scale)  # (a new array: the cached one is not touched)
    if qtype.name == "F32":
        return table[idx].view(np.uint8)
    return _u16_table(table, qtype.name)[idx].view(np.uint8)


def random_blocks(qtype: GGMLType, n_elements: int, rng: np.random.Generator,
                  scale: float = 0.05) -> np.ndarray:
    """`n_elements` (a multiple of the block size) random valid values of `qtype` as raw bytes."""
    _check(qtype)
    assert n_elements % qtype.block_size == 0, (qtype.name, n_elements)
    if qtype.name in _FLOATS:
        return _random_floats(qtype, n_elements, rng, scale)
    n_blocks = n_elements // qtype.block_size
    blocks = _random_bytes(n_blocks * qtype.type_size, rng)
    if qtype.name in _SPECIAL:
        _fix_scales(qtype.name, blocks.reshape(n_blocks, qtype.type_size), scale)
        return blocks
    d_off, m_off, typical, m_mult = _SCALES[qtype.name]
    # The random bits already in each fp16 scale field pick its value from a table:
    # d uniform in scale/typical * [0.5, 1.5), dmin/m likewise around m_mult * d.
    assert qtype.type_size % 2 == 0 and d_off % 2 == 0
    words = blocks.view("<u2").reshape(n_blocks, qtype.type_size // 2)
    u = np.linspace(0.5, 1.5, 65536, endpoint=False, dtype=np.float32)
    d_table = _u16_table(u * np.float32(scale / typical), "F16")
    words[:, d_off // 2] = d_table[words[:, d_off // 2]]
    if m_off is not None:
        m_table = _u16_table(u * np.float32(scale / typical * m_mult), "F16")
        words[:, m_off // 2] = m_table[words[:, m_off // 2]]
    return blocks


def _fix_scales(name: str, b: np.ndarray, scale: float) -> None:
    """Scale fields of IQ1_M, MXFP4 and NVFP4 blocks b[n_blocks, type_size] (random bits in
    place) set to finite values that make |w| ~ scale, keeping the bits' randomness."""
    u = np.linspace(0.5, 1.5, 65536, endpoint=False, dtype=np.float32)
    if name == "IQ1_M":
        # the fp16 d is the top nibbles of the 4 u16 scale words (bytes 48..55)
        w = b[:, 48:56].copy().view("<u2")  # [n, 4]
        d = _u16_table(u * np.float32(scale / (8.0 * 0.7)), "F16")[w[:, 0] ^ w[:, 1]]
        for k in range(4):
            w[:, k] = (w[:, k] & np.uint16(0x0FFF)) | (((d >> np.uint16(4 * k)) & np.uint16(0xF)) << np.uint16(12))
        b[:, 48:56] = w.view(np.uint8)
    elif name == "MXFP4":
        # e8m0 exponent e: d = 2^(e - 128) (ggml_e8m0_to_fp32_half); |kvalue| ~ 4.6
        e0 = 128 + int(np.round(np.log2(scale / 4.6)))
        b[:, 0] = (e0 - 1 + (b[:, 0] % 3)).astype(np.uint8)
    else:  # NVFP4: 4 unsigned E4M3 scales (bias 7, x 0.5) per 64 values; |kvalue| ~ 4.6
        target = scale / 4.6 / 0.5
        e0 = int(np.clip(np.round(np.log2(target)) + 7, 1, 14))
        exp = (e0 - 1 + (b[:, :4] % 3)).clip(1, 15).astype(np.uint8)
        b[:, :4] = (exp << 3) | (b[:, :4] & np.uint8(7))
        b[:, :4][b[:, :4] == 0x7F] = 0x7E


def random_weight(qtype: GGMLType, shape: tuple[int, int], rng: np.random.Generator,
                  scale: float = 0.05) -> np.ndarray:
    """A random [rows, cols] weight as GGUF bytes: uint8[rows, row_bytes] (what
    GGUFWriter.add_tensor(..., raw_dtype=type) takes)."""
    rows, cols = shape
    _check(qtype)
    if cols % qtype.block_size:
        raise UnsupportedError(f"row length {cols} is not a multiple of {qtype.name}'s block "
                               f"size {qtype.block_size}")
    return random_blocks(qtype, rows * cols, rng, scale).reshape(rows, qtype.row_bytes(cols))
