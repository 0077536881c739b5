"""matmul_multi (one native call over several weights sharing x, used for Q/K/V and gate/up)
must equal separate matmul calls bit for bit: mixed activation formats (Q8 per 32 / per 256 /
f32), decode and prefill row counts, odd row counts, every ISA path (avx512vnni: the K-quant
GEMM's shared X bands beside row-format activations)."""

import numpy as np
import pytest

_native = pytest.importorskip("memfit._native")
from memfit.ops import QTensor  # noqa: E402
from memfit.ops import native as nat  # noqa: E402
from memfit.quant.random import random_blocks  # noqa: E402
from memfit.quant.types import BY_NAME  # noqa: E402

GROUPS = [("Q4_1", "Q4_1", "Q4_1"), ("Q4_K", "Q5_0", "Q6_K"), ("Q8_0", "F16"), ("IQ4_XS", "Q4_0", "F32", "Q2_K")]


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512vnni"])
@pytest.mark.parametrize("group", GROUPS, ids="-".join)
def test_matmul_multi_equals_separate(isa, group):
    order = ["scalar", "avx2", "avx512", "avx512vnni"]
    if order.index(_native.isa_hw()) < order.index(isa):
        pytest.skip(f"CPU lacks {isa}")
    rng = np.random.default_rng(len(group))
    cols = 512
    ws = []
    for i, name in enumerate(group):
        t, rows = BY_NAME[name], 37 + 64 * i
        ws.append(QTensor(name, t, (rows, cols), random_blocks(t, rows * cols, rng)))
    before = _native.isa()
    _native.set_isa(isa)
    try:
        for n in (1, 3, 7, 16, 33):
            x = rng.standard_normal((n, cols), dtype=np.float32)
            got = nat.matmul_multi(x, ws)
            for y, w in zip(got, ws):
                assert y.shape == (n, w.shape[0])
                np.testing.assert_array_equal(y, nat.matmul(x, w), err_msg=f"{w.name} n={n}")
    finally:
        _native.set_isa(before)
