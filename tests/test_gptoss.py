"""gpt-oss: tiny random files (MXFP4 experts as published, and F32/Q8_0) against an
independent float64 recomputation: attention sinks, the sliding window on even layers, NeoX
RoPE with YaRN (ggml's rope_yarn written out), Q/K/V/output biases, the router bias, the
softmax over the chosen experts, expert biases and the clamped SwiGLU; prefill == token by
token; sliding-window and sink edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from memfit.models import ModelConfig, load_model
from memfit.models.synthetic import write_tiny_model
from memfit.ops import get_ops
from memfit.ops.rope import yarn_corr_dims
from test_moe_models import _rms, _weights, check_logits, rel_err, run_steps

# the tiny writer's gpt-oss defaults (models/synthetic.py), written out for the reference
CFG = dict(n_layer=2, n_head=4, n_head_kv=2, D=64, window=4, k=2, base=150000.0, factor=32.0,
           n_ctx_orig=128)
IDS = np.array([5, 17, 200, 33, 290, 0, 64, 64, 128, 7, 255, 1], dtype=np.int32)
MXFP4 = {f"blk.{i}.ffn_{m}_exps.weight": "MXFP4" for i in range(2) for m in ("gate", "up", "down")}


def _rope_yarn(x, pos, cfg):
    # NeoX pairs (i, i + D/2), ggml's rope_yarn: ramp between extrapolated and interpolated
    # angles over the correction dims, magnitude 1 + 0.1 ln(factor)
    d = x.shape[-1]
    lo, hi = yarn_corr_dims(d, cfg["n_ctx_orig"], cfg["base"], 32.0, 1.0)
    i = np.arange(d // 2)
    extrap = pos[:, None] * cfg["base"] ** (-2.0 * i / d)
    interp = extrap / cfg["factor"]
    ramp = 1 - np.clip((i - lo) / max(0.001, hi - lo), 0, 1)
    theta = interp * (1 - ramp) + extrap * ramp
    m = 1 + 0.1 * math.log(cfg["factor"])
    z = (x[..., : d // 2] + 1j * x[..., d // 2:]) * (m * np.exp(1j * theta))[:, None, :]
    return np.concatenate([z.real, z.imag], axis=-1)


def _swiglu_oai(g, u):
    x = np.minimum(g, 7.0)
    y = np.clip(u, -7.0, 7.0)
    return x / (1 + np.exp(-1.702 * x)) * (y + 1)


def reference_logits(path, ids, cfg=CFG):
    W = _weights(path)
    H, Hkv, D = cfg["n_head"], cfg["n_head_kv"], cfg["D"]
    n = len(ids)
    pos = np.arange(n, dtype=np.float64)
    x = W["token_embd.weight"][ids]
    for il in range(cfg["n_layer"]):
        p = f"blk.{il}."
        h = _rms(x, W[p + "attn_norm.weight"])
        q = (h @ W[p + "attn_q.weight"].T + W[p + "attn_q.bias"]).reshape(n, H, D)
        kk = (h @ W[p + "attn_k.weight"].T + W[p + "attn_k.bias"]).reshape(n, Hkv, D)
        v = (h @ W[p + "attn_v.weight"].T + W[p + "attn_v.bias"]).reshape(n, Hkv, D)
        q, kk = _rope_yarn(q, pos, cfg), _rope_yarn(kk, pos, cfg)
        qp, kp = pos[:, None], pos[None, :]
        allowed = kp <= qp
        if il % 2 == 0:                       # sliding layers: q - k < window
            allowed &= (qp - kp) < cfg["window"]
        o = np.zeros((n, H, D))
        sinks = W[p + "attn_sinks.weight"]
        for hh in range(H):
            kv = hh // (H // Hkv)
            s = np.where(allowed, q[:, hh] @ kk[:, kv].T / math.sqrt(D), -np.inf)
            m = np.maximum(s.max(-1, keepdims=True), sinks[hh])
            e = np.exp(s - m)
            o[:, hh] = (e / (e.sum(-1, keepdims=True) + np.exp(sinks[hh] - m))) @ v[:, kv]
        x = x + o.reshape(n, H * D) @ W[p + "attn_output.weight"].T + W[p + "attn_output.bias"]
        h = _rms(x, W[p + "post_attention_norm.weight"])
        logits = h @ W[p + "ffn_gate_inp.weight"].T + W[p + "ffn_gate_inp.bias"]
        G, U, Dn = (W[p + f"ffn_{mm}_exps.weight"] for mm in ("gate", "up", "down"))
        bg, bu, bd = (W[p + f"ffn_{mm}_exps.bias"] for mm in ("gate", "up", "down"))
        f = np.zeros_like(h)
        for t in range(n):
            sel = sorted(range(logits.shape[1]), key=lambda e: (-logits[t, e], e))[:cfg["k"]]
            w = np.exp(logits[t, sel] - logits[t, sel].max())
            w /= w.sum()
            for j, e in enumerate(sel):
                a = _swiglu_oai(G[e] @ h[t] + bg[e], U[e] @ h[t] + bu[e])
                f[t] += w[j] * (Dn[e] @ a + bd[e])
        x = x + f
    out = W.get("output.weight", W["token_embd.weight"])
    return _rms(x, W["output_norm.weight"]) @ out.T


@pytest.mark.parametrize("backend,qtype,types,tol", [
    ("numpy", "F32", {}, 1e-4), ("numpy", "Q8_0", MXFP4, 1e-4), ("native", "F32", {}, 1e-4)])
def test_gptoss_matches_float64(tmp_path, backend, qtype, types, tol):
    path = write_tiny_model(tmp_path / "go.gguf", "gpt-oss", qtype, seed=21, types=types)
    m = load_model(path, ops=get_ops(backend))
    m.kv_f16 = False
    c = m.config
    assert (c.sliding_window, c.swa_pattern, c.yarn, c.expert_gating_func) == (4, 2, True, "softmax_weight")
    assert [c.is_swa(il) for il in range(2)] == [True, False]
    ref = reference_logits(path, IDS)
    assert np.std(ref) > 0.1
    check_logits(m, IDS, ref, tol)


def test_sinks_and_window_edges(tmp_path):
    # a sink far below every score changes nothing; a very high sink drains the attention to
    # (almost) zero; a window of 1 sees only the token itself
    base = write_tiny_model(tmp_path / "a.gguf", "gpt-oss", "F32", seed=22)
    m = load_model(base, ops=get_ops("numpy"))
    m.kv_f16 = False
    ref = m.forward(IDS[:6], m.new_cache(8), all_logits=True)
    for il in range(2):
        m.vec[f"blk.{il}.attn_sinks.weight"] = np.full(4, -1e4, np.float32)
    low = m.forward(IDS[:6], m.new_cache(8), all_logits=True)
    sinks = {il: m.vec.pop(f"blk.{il}.attn_sinks.weight") for il in range(2)}
    none = m.forward(IDS[:6], m.new_cache(8), all_logits=True)    # no sinks at all
    np.testing.assert_allclose(low, none, rtol=1e-6, atol=1e-6)
    m.vec.update({f"blk.{il}.attn_sinks.weight": v for il, v in sinks.items()})
    for il in range(2):
        m.vec[f"blk.{il}.attn_sinks.weight"] = np.full(4, 1e4, np.float32)
    high = m.forward(IDS[:6], m.new_cache(8), all_logits=True)
    assert not np.allclose(high, ref)
    # with the sinks at +1e4 every attention output is ~0: the result no longer depends on
    # the keys, so two prompts that end in the same token agree
    other = m.forward(np.array([9, 9, 9, 9, 9, IDS[5]]), m.new_cache(8), all_logits=True)
    np.testing.assert_allclose(other[-1], high[-1], rtol=1e-5, atol=1e-5)
    w1 = write_tiny_model(tmp_path / "w1.gguf", "gpt-oss", "F32", seed=22, sliding_window=1)
    assert load_model(w1).config.sliding_window == 1
    r1 = reference_logits(w1, IDS[:6], {**CFG, "window": 1})
    m1 = load_model(w1, ops=get_ops("numpy"))
    m1.kv_f16 = False
    assert rel_err(m1.forward(IDS[:6], m1.new_cache(8), all_logits=True), r1) <= 1e-4


def test_gptoss_routing_is_fixed_by_the_graph():
    a = "gpt-oss"
    md = {"general.architecture": a, f"{a}.block_count": 2, f"{a}.embedding_length": 256,
          f"{a}.attention.head_count": 4, f"{a}.attention.head_count_kv": 2,
          f"{a}.attention.key_length": 64, f"{a}.attention.value_length": 64,
          f"{a}.vocab_size": 300, f"{a}.expert_count": 8, f"{a}.expert_used_count": 2,
          f"{a}.expert_feed_forward_length": 256, f"{a}.attention.sliding_window": 128,
          f"{a}.expert_gating_func": 2, f"{a}.expert_weights_norm": True}
    c = ModelConfig.from_metadata(md)
    assert (c.expert_gating_func, c.expert_weights_norm, c.sliding_window) == ("softmax_weight", False, 128)
    assert not c.yarn and c.attn_scale == pytest.approx(0.125)


def test_fused_experts_with_biases_equal_expert_by_expert(tmp_path):
    # csrc/moe.c with the clamped SwiGLU and the expert biases against the op-by-op path
    from test_moe_native import _both
    path = write_tiny_model(tmp_path / "go.gguf", "gpt-oss", "Q8_0", seed=23, types=MXFP4)
    _, _, a, b = _both(path, n=9)
    for x, y in zip(a, b):
        assert np.isfinite(x).all() and np.abs(x).max() > 0
        np.testing.assert_array_equal(x, y)
