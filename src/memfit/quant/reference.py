"""Numpy reference dequantization: the readable definition of every supported type.

One function per type, ``(n_blocks, type_size) uint8 -> (n_blocks, block_size) float32``,
with the block layout (ggml-common.h) in its comment. Float operations follow ggml-quants.c's
order so results equal ``gguf.quants.dequantize`` (the independent oracle) bit for bit.

    dequantize(type_id, raw_uint8, n_elements) -> float32[n_elements]
    dequantize_rows(qtype, raw, n_rows, n_cols) -> float32[n_rows, n_cols]
"""

from __future__ import annotations

import numpy as np

from ..errors import UnsupportedError
from .types import TYPES, GGMLType

QK_K = 256
# IQ4_NL / IQ4_XS non-linear 4-bit codebook (kvalues_iq4nl in ggml-common.h).
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10,
                          1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def _f16(blocks: np.ndarray, off: int) -> np.ndarray:
    """The little-endian fp16 at byte `off` of every block -> float32[n_blocks, 1]."""
    return np.ascontiguousarray(blocks[:, off:off + 2]).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, k] bytes -> [n, 2k]: the k low nibbles, then the k high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(b: np.ndarray) -> np.ndarray:
    """[n, k] bytes -> [n, 8, k]: bit i of every byte in row i."""
    return (b[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1


def _f32(blocks: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(blocks).view("<f4")


def _f16_type(blocks: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(blocks).view("<f2").astype(np.float32)


def _bf16(blocks: np.ndarray) -> np.ndarray:
    # bf16 is the top half of an fp32
    return (np.ascontiguousarray(blocks).view("<u2").astype(np.uint32) << 16).view(np.float32)


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    # 18 B: d f16 | qs[16]: element j = low nibble of qs[j], element j+16 = high nibble; x = d*(q-8)
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:18]).astype(np.float32) - 8
    return d * q


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    # 20 B: d f16 | m f16 | qs[16] as Q4_0; x = d*q + m
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 4:20]).astype(np.float32)
    return d * q + m


def _q5(blocks_qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    # 5-bit quants: qh is a little-endian u32 whose bit j is the 5th bit of element j
    hi = _bits(blocks_qh).transpose(0, 2, 1).reshape(-1, 32)  # byte k bit i -> element 8k+i
    return _nibbles(qs) | (hi << 4)


def _q5_0(blocks: np.ndarray) -> np.ndarray:
    # 22 B: d f16 | qh[4] | qs[16]; x = d*(q-16)
    d = _f16(blocks, 0)
    q = _q5(blocks[:, 2:6], blocks[:, 6:22]).astype(np.float32) - 16
    return d * q


def _q5_1(blocks: np.ndarray) -> np.ndarray:
    # 24 B: d f16 | m f16 | qh[4] | qs[16]; x = d*q + m
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _q5(blocks[:, 4:8], blocks[:, 8:24]).astype(np.float32)
    return d * q + m


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    # 34 B: d f16 | qs[32] int8; x = d*q
    d = _f16(blocks, 0)
    return blocks[:, 2:34].view(np.int8).astype(np.float32) * d


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """[n, 64] bytes -> [n, 256] 2-bit values: per 32-byte half h, shift s: element 128h+32s+l."""
    n = qs.shape[0]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    return ((qs.reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, QK_K)


def _q2_k(blocks: np.ndarray) -> np.ndarray:
    # 84 B: scales[16] (lo nibble scale, hi nibble min, one per 16 elements) | qs[64] 2-bit
    # | d f16 | dmin f16; x = d*sc*q - dmin*m
    n = blocks.shape[0]
    sc = blocks[:, 0:16]
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    dl = (d * (sc & 0x0F).astype(np.float32))[:, :, None]
    ml = (dmin * (sc >> 4).astype(np.float32))[:, :, None]
    q = _crumbs(blocks[:, 16:80]).reshape(n, 16, 16).astype(np.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(blocks: np.ndarray) -> np.ndarray:
    # 110 B: hmask[32] (bit j of hmask[l] = high bit of element 32j+l; clear bit means -4)
    # | qs[64] 2-bit as Q2_K | scales[12] (16 x 6-bit, biased by 32) | d f16; x = d*(sc-32)*q
    n = blocks.shape[0]
    d = _f16(blocks, 108)
    s = blocks[:, 96:108]
    lo = _nibbles(s[:, 0:8])  # low 4 bits of scales 0..15
    hi = ((s[:, None, 8:12] >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, :, None]) & 3).reshape(n, 16)
    sc = (lo | (hi << 4)).astype(np.float32) - 32
    dl = (d * sc)[:, :, None]
    hbit = _bits(blocks[:, 0:32]).reshape(n, QK_K)
    q = _crumbs(blocks[:, 32:96]).astype(np.int8) - ((hbit ^ 1) << 2).astype(np.int8)
    return (dl * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 12-byte packing of 8 (scale, min) 6-bit pairs -> two [n, 8] float32."""
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    # pairs 0..3: low 6 bits of a (scale) and b (min); 4..7: nibbles of c + top 2 bits of a / b
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    # 144 B: d f16 | dmin f16 | scales[12] | qs[128]: each 32 bytes hold sub-blocks 2c (low
    # nibbles) and 2c+1 (high nibbles) of 32 elements; x = d*sc*q - dmin*m
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    dl, ml = (d * sc)[:, :, None], (dmin * mn)[:, :, None]
    q = _nibbles(blocks[:, 16:144].reshape(n * 4, 32)).reshape(n, 8, 32).astype(np.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    # 176 B: d f16 | dmin f16 | scales[12] | qh[32] (bit j of qh[l]: 5th bit of element 32j+l)
    # | qs[128] as Q4_K; x = d*sc*q - dmin*m
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    dl, ml = (d * sc)[:, :, None], (dmin * mn)[:, :, None]
    lo = _nibbles(blocks[:, 48:176].reshape(n * 4, 32)).reshape(n, 8, 32)
    q = (lo | (_bits(blocks[:, 16:48]) << 4)).astype(np.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    # 210 B: ql[128] (4 low bits) | qh[64] (2 high bits) | scales[16] int8 | d f16;
    # per 128-half h: ql[64h+l] lo/hi nibble -> elements l, l+64 (l < 64); qh[32h+l] bits
    # 2s..2s+1 -> element 32s+l. x = d*sc*(q-32), one scale per 16 elements
    n = blocks.shape[0]
    d = _f16(blocks, 208)
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
    lo = _nibbles(blocks[:, 0:128].reshape(n * 2, 64))  # [2n, 128]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[None, :, None]
    hi = ((blocks[:, 128:192].reshape(n * 2, 1, 32) >> shifts) & 3).reshape(n * 2, 128)
    q = (lo | (hi << 4)).astype(np.int8) - np.int8(32)
    dl = (d * sc)[:, :, None]
    return (dl * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


def _iq4_nl(blocks: np.ndarray) -> np.ndarray:
    # 18 B: d f16 | qs[16] as Q4_0, nibble indexes the kvalues codebook; x = d*kvalues[q]
    d = _f16(blocks, 0)
    return d * KVALUES_IQ4NL[_nibbles(blocks[:, 2:18])]


def _iq4_xs(blocks: np.ndarray) -> np.ndarray:
    # 136 B: d f16 | scales_h u16 (2 bits per sub-block) | scales_l[4] (nibble per sub-block)
    # | qs[128]: 16 bytes per 32-element sub-block as IQ4_NL; x = d*(ls-32)*kvalues[q]
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    sh = np.ascontiguousarray(blocks[:, 2:4]).view("<u2")  # [n, 1]
    sh = ((sh >> np.arange(0, 16, 2, dtype=np.uint16)) & 3).astype(np.uint8)  # [n, 8]
    sl = _nibbles(blocks[:, 4:8]).reshape(n, 2, 4).transpose(0, 2, 1).reshape(n, 8)
    ls = (sl | (sh << 4)).astype(np.float32) - 32
    dl = (d * ls)[:, :, None]
    q = _nibbles(blocks[:, 8:136].reshape(n * 8, 16)).reshape(n, 8, 32)
    return (dl * KVALUES_IQ4NL[q]).reshape(n, QK_K)


_DEQUANT = {
    "F32": _f32, "F16": _f16_type, "BF16": _bf16,
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs,
}


def _from_gguf(name: str):
    """The lattice, ternary and FP4 types: gguf-py's own dequantizer (gguf.quants) is their
    readable definition and the oracle; not rewritten here."""
    def dq(blocks: np.ndarray) -> np.ndarray:
        from gguf import GGMLQuantizationType, quants  # only when used (~3 MiB of RSS)
        qt = GGMLQuantizationType[name]
        return quants.dequantize(np.ascontiguousarray(blocks), qt).astype(np.float32, copy=False)
    return dq


for _n in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M",
           "MXFP4", "NVFP4", "TQ1_0", "TQ2_0"):
    _DEQUANT[_n] = _from_gguf(_n)


def _type(type_id: int) -> GGMLType:
    t = TYPES.get(int(type_id))
    if t is None:
        raise UnsupportedError(f"unknown GGML tensor type id {type_id}; memfit supports "
                               f"{', '.join(_DEQUANT)}")
    if t.name not in _DEQUANT:
        raise UnsupportedError(f"tensor type {t.name} (id {t.id}) is not supported; memfit "
                               f"supports {', '.join(_DEQUANT)} (requantize the model)")
    return t


def dequantize(type_id: int, raw: np.ndarray, n_elements: int) -> np.ndarray:
    """The first `n_elements` values stored in `raw` (GGUF bytes of type `type_id`) as float32.
    For F32 this is a view of `raw` (read-only if raw is): never write into the result."""
    t = _type(type_id)
    assert n_elements % t.block_size == 0, (t.name, n_elements)
    n_blocks = n_elements // t.block_size
    raw = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw.view(np.uint8)
    raw = raw.reshape(-1)
    assert raw.size >= n_blocks * t.type_size, (t.name, raw.size, n_blocks * t.type_size)
    blocks = raw[:n_blocks * t.type_size].reshape(n_blocks, t.type_size)
    out = _DEQUANT[t.name](blocks)
    assert out.dtype == np.float32 and out.size == n_elements
    return out.reshape(n_elements)


def dequantize_rows(qtype: GGMLType, raw: np.ndarray, n_rows: int, n_cols: int) -> np.ndarray:
    """A [n_rows, n_cols] matrix stored row by row in `raw` -> float32[n_rows, n_cols]."""
    return dequantize(qtype.id, raw, n_rows * n_cols).reshape(n_rows, n_cols)
