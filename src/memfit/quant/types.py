"""The GGML tensor type table: id -> (name, elements per block, bytes per block).

Ids and sizes follow ggml.h / gguf-py's GGML_QUANT_SIZES. ``SUPPORTED`` is the set that
memfit can compute with; other known ids are recognised (for `memfit info`) but rejected at
load with an error that names the tensor and the type.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GGMLType:
    id: int
    name: str
    block_size: int  # elements per block
    type_size: int  # bytes per block

    def row_bytes(self, n_elems: int) -> int:
        assert n_elems % self.block_size == 0
        return n_elems // self.block_size * self.type_size


_TABLE = [
    (0, "F32", 1, 4), (1, "F16", 1, 2), (2, "Q4_0", 32, 18), (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22), (7, "Q5_1", 32, 24), (8, "Q8_0", 32, 34), (9, "Q8_1", 32, 40),
    (10, "Q2_K", 256, 84), (11, "Q3_K", 256, 110), (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176), (14, "Q6_K", 256, 210), (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66), (17, "IQ2_XS", 256, 74), (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50), (20, "IQ4_NL", 32, 18), (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82), (23, "IQ4_XS", 256, 136), (24, "I8", 1, 1), (25, "I16", 1, 2),
    (26, "I32", 1, 4), (27, "I64", 1, 8), (28, "F64", 1, 8), (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2), (34, "TQ1_0", 256, 54), (35, "TQ2_0", 256, 66), (39, "MXFP4", 32, 17),
    (40, "NVFP4", 64, 36), (41, "Q1_0", 128, 18),
]

TYPES: dict[int, GGMLType] = {i: GGMLType(i, n, b, s) for i, n, b, s in _TABLE}
BY_NAME: dict[str, GGMLType] = {t.name: t for t in TYPES.values()}

# Types memfit computes with (numpy reference; the native core covers the same set), in the
# order the tests parametrize over them.
SUPPORTED_NAMES: tuple[str, ...] = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
    "IQ2_XXS", "IQ2_XS", "IQ2_S",
    "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M",
    "MXFP4", "NVFP4", "TQ1_0", "TQ2_0",
)
SUPPORTED = frozenset(BY_NAME[n].id for n in SUPPORTED_NAMES)
