"""Results of the native kernels do not depend on the thread count: every task split keeps the
same per-row kernel grouping (4-row vec-dot groups, 2-row prefill pairs), so 1, 2, 3 or 5
threads give the same bits, for matmul of every type and for a whole model's forward."""

from __future__ import annotations

import numpy as np
import pytest

from memfit import _native
from memfit.models import load_model
from memfit.models.synthetic import write_tiny_model
from memfit.ops import QTensor, get_ops
from memfit.quant.random import random_weight
from memfit.quant.types import BY_NAME, SUPPORTED_NAMES

TYPES = list(SUPPORTED_NAMES)


@pytest.fixture
def restore_threads():
    n = _native.get_threads()
    yield
    _native.set_threads(n)


@pytest.mark.parametrize("tname", TYPES)
def test_matmul_bits_independent_of_threads(tname, restore_threads):
    ops, rng = get_ops("native"), np.random.default_rng(7)
    qt = BY_NAME[tname]
    for rows, cols in [(37, 512), (301, 768)]:
        w = QTensor("w", qt, (rows, cols), random_weight(qt, (rows, cols), rng).reshape(-1))
        for n in (1, 7, 64):
            x = rng.standard_normal((n, cols)).astype(np.float32)
            outs = []
            for t in (1, 2, 3, 5):
                _native.set_threads(t)
                outs.append(ops.matmul(x, w))
            for o in outs[1:]:
                np.testing.assert_array_equal(outs[0], o, err_msg=f"{tname} {rows}x{cols} n={n}")


def test_forward_bits_independent_of_threads(tmp_path, restore_threads):
    path = write_tiny_model(tmp_path / "g.gguf", "gemma3", "Q4_K", seed=2, sliding_window=4)
    m = load_model(path, ops=get_ops("native"))
    ids = [5, 17, 200, 33, 290, 0, 64]
    runs = []
    for t in (1, 3):
        _native.set_threads(t)
        cache = m.new_cache(16)
        runs.append([m.forward(ids[:4], cache, all_logits=True)]
                    + [m.forward([i], cache) for i in ids[4:]])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
