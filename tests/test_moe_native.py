"""The fused native MoE FFN (csrc/moe.c: one call per layer, tokens grouped by expert) against
the op-by-op native path it replaces (same kernels, same order): bit-identical for every quant
type, odd shapes, groups split by a store's expert_batch_limit, and any thread count."""

from __future__ import annotations

import types

import numpy as np
import pytest

from memfit import _native
from memfit.models import load_model
from memfit.models.synthetic import write_tiny_model
from memfit.ops import get_ops, native
from memfit.quant.types import SUPPORTED_NAMES  # noqa: E402

TYPES = list(SUPPORTED_NAMES)


def _unfused():
    # the native backend without its fused MoE call: Model.moe_ffn runs expert by expert
    return types.SimpleNamespace(**{k: getattr(native, k) for k in dir(native)
                                    if not k.startswith("_") and k != "moe_ffn"})


def _both(path, n=9, seed=0):
    m = load_model(path, ops=get_ops("native"))
    x = np.random.default_rng(seed).standard_normal((n, m.config.n_embd)).astype(np.float32)
    a = [m.moe_ffn(il, x) for il in range(m.config.n_layer)]
    m.ops = _unfused()
    b = [m.moe_ffn(il, x) for il in range(m.config.n_layer)]
    m.ops = get_ops("native")
    return m, x, a, b


@pytest.mark.parametrize("qtype", TYPES)
def test_fused_equals_expert_by_expert(tmp_path, qtype):
    path = write_tiny_model(tmp_path / "m.gguf", "qwen2moe", qtype, seed=TYPES.index(qtype),
                            n_expert=6, n_expert_used=3)
    _, _, a, b = _both(path)
    for x, y in zip(a, b):
        assert np.isfinite(x).all() and np.abs(x).max() > 0
        np.testing.assert_array_equal(x, y)


def test_odd_shapes_threads_and_store_groups(tmp_path):
    # n_embd 96, experts of 160 rows (Q8_0 / Q4_0 blocks of 32), 5 of 7 experts per token
    path = write_tiny_model(tmp_path / "m.gguf", "olmoe", "Q8_0", seed=4, n_embd=96, n_head=3,
                            n_head_kv=3, head_dim=32, n_expert=7, n_expert_used=5, n_ff_exp=160,
                            types={"blk.1.ffn_down_exps.weight": "Q4_0"})
    m, x, a, b = _both(path, n=13)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)
    old = native.get_threads()
    try:
        native.set_threads(1)
        one = [m.moe_ffn(il, x) for il in range(2)]
    finally:
        native.set_threads(old)
    for u, v in zip(a, one):
        np.testing.assert_array_equal(u, v)
    # a store that holds 2 experts at a time: the same sums, asked in groups
    m.weights.expert_batch_limit = 2
    for il in range(2):
        np.testing.assert_array_equal(m.moe_ffn(il, x), a[il])


def test_bad_arguments_are_errors(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "qwen3moe", "Q8_0", seed=1)
    m = load_model(path, ops=get_ops("native"))
    g, u, d = m.weights.get_experts(0, [1])[0]
    x = np.ones((2, 256), np.float32)
    out = np.zeros_like(x)
    off, rows, wts = np.array([0, 2]), np.array([0, 1]), np.ones(2, np.float32)
    args = (x, 2, 256, 256, g.type.id, u.type.id, d.type.id)
    _native.moe_ffn(*args, [g.data, u.data, d.data], off, rows, wts, False, out)
    assert np.abs(out).max() > 0
    with pytest.raises(ValueError, match="do not match"):
        _native.moe_ffn(*args, [g.data, u.data, d.data], off, np.array([0, 2]), wts, False, out)
    with pytest.raises(ValueError, match="gate, up, down"):
        _native.moe_ffn(*args, [g.data, u.data], off, rows, wts, False, out)
    with pytest.raises(ValueError, match="bytes, needs"):
        _native.moe_ffn(*args, [g.data[:100], u.data, d.data], off, rows, wts, False, out)
    with pytest.raises(TypeError, match="int64"):
        _native.moe_ffn(*args, [g.data, u.data, d.data], off.astype(np.int32), rows, wts, False, out)
