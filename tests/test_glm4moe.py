"""glm4moe (GLM-4.5/4.6/4.7, GLM-4.5-Air): tiny random files against an independent float64
recomputation (gguf-py reader + dequantize; partial NeoX RoPE, Q/K/V biases, the optional
per-head Q/K norm, a dense leading layer, sigmoid routing with the exp_probs_b correction
bias, renormalized and scaled weights, the ungated shared expert), prefill == token by token,
the NextN layer in the file but out of the forward pass and out of the plan, and the backend's
routing (groups, ties, softmax_weight) written out per token."""

from __future__ import annotations

import math

import numpy as np
import pytest

from memfit.errors import ModelError, UnsupportedError
from memfit.models import ModelConfig, load_model
from memfit.models.synthetic import write_tiny_model
from memfit.ops import get_ops
from memfit.ops.backend import RouteSpec
from test_moe_models import _rms, _silu, _weights, check_logits, rel_err, run_steps

CFG = dict(n_embd=256, n_layer=3, n_head=4, n_head_kv=2, head_dim=64, n_rot=32, rope_base=1e6,
           n_expert=8, n_expert_used=2, n_ff_exp=256, n_ff_shexp=256, n_ff=512,
           n_layer_dense_lead=1, n_layer_nextn=1, expert_weights_scale=1.5)
IDS = np.array([5, 17, 200, 33, 290, 0, 64, 64, 128, 7, 255, 1], dtype=np.int32)


def ref_route(logits, k, gating="sigmoid", bias=None, norm=True, scale=1.0, n_group=0,
              n_group_used=0):
    """llama.cpp's build_moe_ffn choice written out token by token (float64)."""
    logits = np.asarray(logits, np.float64)
    sels, ws = [], []
    for row in logits:
        if gating == "softmax":
            p = np.exp(row - row.max())
            p /= p.sum()
        elif gating == "sigmoid":
            p = 1 / (1 + np.exp(-row))
        else:
            p = row.copy()
        s = p + (0 if bias is None else bias)
        X = len(row)
        if n_group > 1:
            gs = X // n_group
            score = [sum(sorted(s[g * gs:(g + 1) * gs])[-2:]) for g in range(n_group)]
            keep = sorted(range(n_group), key=lambda g: (-score[g], g))[:n_group_used]
            s = np.array([s[e] if e // gs in keep else -np.inf for e in range(X)])
        sel = sorted(range(X), key=lambda e: (-s[e], e))[:k]
        w = p[sel]
        if gating == "softmax_weight":
            w = np.exp(w - w.max())
            w /= w.sum()
        if norm:
            w = w / max(w.sum(), 6.103515625e-5)
        sels.append(sel)
        ws.append(w * scale)
    return np.array(sels), np.array(ws)


def _rope_partial(x, pos, base, n_rot):
    # NeoX pairs (i, i + n_rot/2) over the first n_rot dims; the rest pass
    d = n_rot
    ang = np.exp(1j * pos[:, None, None] * base ** (-np.arange(d // 2) * 2.0 / d))
    z = (x[..., : d // 2] + 1j * x[..., d // 2:d]) * ang
    return np.concatenate([z.real, z.imag, x[..., d:]], axis=-1)


def reference_logits(path, ids, cfg, qk_norm=False):
    W = _weights(path)
    E, H, Hkv, D = cfg["n_embd"], cfg["n_head"], cfg["n_head_kv"], cfg["head_dim"]
    n = len(ids)
    pos = np.arange(n, dtype=np.float64)
    x = W["token_embd.weight"][ids]
    for il in range(cfg["n_layer"]):
        p = f"blk.{il}."
        h = _rms(x, W[p + "attn_norm.weight"])
        q = (h @ W[p + "attn_q.weight"].T + W[p + "attn_q.bias"]).reshape(n, H, D)
        kk = (h @ W[p + "attn_k.weight"].T + W[p + "attn_k.bias"]).reshape(n, Hkv, D)
        v = (h @ W[p + "attn_v.weight"].T + W[p + "attn_v.bias"]).reshape(n, Hkv, D)
        if qk_norm:
            q, kk = _rms(q, W[p + "attn_q_norm.weight"]), _rms(kk, W[p + "attn_k_norm.weight"])
        q = _rope_partial(q, pos, cfg["rope_base"], cfg["n_rot"])
        kk = _rope_partial(kk, pos, cfg["rope_base"], cfg["n_rot"])
        o = np.zeros((n, H, D))
        mask = np.triu(np.full((n, n), -np.inf), 1)
        for hh in range(H):
            kv = hh // (H // Hkv)
            s = q[:, hh] @ kk[:, kv].T / math.sqrt(D) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            o[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + o.reshape(n, H * D) @ W[p + "attn_output.weight"].T
        h = _rms(x, W[p + "post_attention_norm.weight"])

        def glu(sfx, hh=h):
            return (_silu(hh @ W[p + f"ffn_gate{sfx}.weight"].T) * (hh @ W[p + f"ffn_up{sfx}.weight"].T)) \
                @ W[p + f"ffn_down{sfx}.weight"].T
        if il < cfg["n_layer_dense_lead"]:
            x = x + glu("")
            continue
        sel, w = ref_route(h @ W[p + "ffn_gate_inp.weight"].T, cfg["n_expert_used"],
                           bias=W[p + "exp_probs_b.bias"], scale=cfg["expert_weights_scale"])
        G, U, Dn = (W[p + f"ffn_{m}_exps.weight"] for m in ("gate", "up", "down"))
        f = np.zeros_like(h)
        for t in range(n):
            for j, e in enumerate(sel[t]):
                f[t] += w[t, j] * (Dn[e] @ (_silu(G[e] @ h[t]) * (U[e] @ h[t])))
        x = x + f + glu("_shexp")
    out = W.get("output.weight", W["token_embd.weight"])
    return _rms(x, W["output_norm.weight"]) @ out.T


def _tiny(tmp_path, qtype="F32", seed=0, **kw):
    return write_tiny_model(tmp_path / "glm.gguf", "glm4moe", qtype, seed=seed, **{**CFG, **kw})


# (quantized types on the native backend: see test_deepseek2's note; checked by test_exact)
@pytest.mark.parametrize("backend,qtype,tol", [("numpy", "F32", 1e-4), ("numpy", "Q8_0", 1e-4),
                                               ("native", "F32", 1e-4)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_glm4moe_matches_float64(tmp_path, backend, qtype, tol, qk_norm):
    extra = {"optional": ("attn_q_norm.weight", "attn_k_norm.weight")} if qk_norm else {}
    path = _tiny(tmp_path, qtype, seed=3 + qk_norm, **extra)
    m = load_model(path, ops=get_ops(backend))
    m.kv_f16 = False
    c = m.config
    assert (c.n_layer, c.n_layer_nextn, c.n_layer_dense_lead, c.n_rot, c.n_ff_shexp) == (3, 1, 1, 32, 256)
    assert (c.expert_gating_func, c.expert_weights_norm, c.expert_weights_scale) == ("sigmoid", True, 1.5)
    assert ("blk.0.attn_q_norm.weight" in m.vec) == qk_norm
    ref = reference_logits(path, IDS, CFG, qk_norm)
    assert np.std(ref) > 0.1
    check_logits(m, IDS, ref, tol)


def test_nextn_layer_is_in_the_file_not_the_forward_or_the_plan(tmp_path):
    from memfit.gguf import open_gguf
    from memfit.memory.planner import ModelDesc
    from memfit.models import tensor_roles
    path = _tiny(tmp_path, "Q8_0", seed=5)
    with open_gguf(path) as f:
        nextn = [n for n in f.tensors if n.startswith("blk.3.")]
        assert "blk.3.nextn.eh_proj.weight" in nextn and "blk.3.ffn_gate_exps.weight" in nextn
        roles = tensor_roles(f)
        assert {roles[n] for n in nextn} == {"skip"}
        desc = ModelDesc.from_gguf(f)
        assert not any(t.name.startswith("blk.3.") for t in desc.tensors)
        assert desc.skipped_bytes == sum(f.tensors[n].nbytes for n in nextn) > 0
        assert desc.n_layer == 3
    # the NextN layer's weights never reach the forward
    m = load_model(path, ops=get_ops("native"))
    got = []
    m.weights.get = (lambda g: (lambda name: (got.append(name), g(name))[1]))(m.weights.get)
    m.forward(IDS[:3], m.new_cache(8))
    assert got and not any(n.startswith("blk.3.") for n in got)


def test_glm4moe_metadata_errors(tmp_path):
    md = {"general.architecture": "glm4moe", "glm4moe.block_count": 4, "glm4moe.embedding_length": 256,
          "glm4moe.attention.head_count": 4, "glm4moe.feed_forward_length": 512,
          "glm4moe.vocab_size": 300, "glm4moe.expert_count": 8, "glm4moe.expert_used_count": 2,
          "glm4moe.expert_feed_forward_length": 128, "glm4moe.expert_shared_count": 1,
          "glm4moe.nextn_predict_layers": 1, "glm4moe.leading_dense_block_count": 1}
    c = ModelConfig.from_metadata(md)
    assert (c.n_layer, c.n_layer_nextn, c.expert_gating_func, c.n_ff_shexp) == (3, 1, "sigmoid", 128)
    with pytest.raises(ModelError, match="nextn_predict_layers = 4"):
        ModelConfig.from_metadata({**md, "glm4moe.nextn_predict_layers": 4})
    with pytest.raises(ModelError, match="leading_dense_block_count = 5"):
        ModelConfig.from_metadata({**md, "glm4moe.leading_dense_block_count": 5})
    with pytest.raises(UnsupportedError, match="rope.dimension_sections"):
        ModelConfig.from_metadata({**md, "glm4moe.rope.dimension_sections": [8, 12, 12, 0]})
    with pytest.raises(ModelError, match="expert_group_count"):
        ModelConfig.from_metadata({**md, "glm4moe.expert_group_count": 3,
                                   "glm4moe.expert_group_used_count": 1})
    with pytest.raises(ModelError, match="expert_group_used_count = 0"):
        ModelConfig.from_metadata({**md, "glm4moe.expert_group_count": 4,
                                   "glm4moe.expert_group_used_count": 0})


@pytest.mark.parametrize("backend", ["numpy", "native"])
@pytest.mark.parametrize("gating,groups,bias", [
    ("softmax", (0, 0), False), ("sigmoid", (0, 0), True), ("sigmoid", (4, 2), True),
    ("softmax", (8, 3), False), ("softmax_weight", (0, 0), False)])
def test_backend_route_matches_written_out_routing(backend, gating, groups, bias):
    rng = np.random.default_rng(7)
    X, k = 32, 4
    logits = rng.standard_normal((9, X)).astype(np.float32)
    b = rng.standard_normal(X).astype(np.float32) * 0.5 if bias else None
    spec = RouteSpec(k=k, gating=gating, norm=gating == "sigmoid", scale=2.5 if bias else 1.0,
                     n_group=groups[0], n_group_used=groups[1])
    sel, w = get_ops(backend).route(logits, spec, b)
    rs, rw = ref_route(logits, k, gating, b, spec.norm, spec.scale, *groups)
    np.testing.assert_array_equal(sel, rs)
    np.testing.assert_allclose(w, rw, rtol=2e-6, atol=1e-7)
    if groups[0] > 1:   # every choice lies in the groups kept
        gs = X // groups[0]
        assert all(len({e // gs for e in row}) <= groups[1] for row in sel)


def test_route_ties_and_groups_go_to_the_lower_index():
    ops = get_ops("numpy")
    # all logits equal: experts 0..k-1, and with groups the first groups win the tie
    z = np.zeros((2, 16), np.float32)
    sel, w = ops.route(z, RouteSpec(k=3, gating="sigmoid", norm=True))
    assert sel.tolist() == [[0, 1, 2]] * 2 and np.allclose(w, 1 / 3)
    sel, _ = ops.route(z, RouteSpec(k=3, gating="sigmoid", n_group=4, n_group_used=1))
    assert sel.tolist() == [[0, 1, 2]] * 2
    # group 2 has the best expert, but group 1's two best sum higher: group 1 is chosen
    x = np.full((1, 16), -5.0, np.float32)
    x[0, 9] = 3.0                      # group 2 (experts 8..11): 3 + (-5)
    x[0, 4], x[0, 5] = 1.0, 1.0        # group 1 (experts 4..7): 1 + 1
    sel, _ = ops.route(x, RouteSpec(k=2, gating="softmax_weight", n_group=4, n_group_used=1))
    assert sel.tolist() == [[4, 5]]
    sel, _ = ops.route(x, RouteSpec(k=2, gating="softmax_weight"))
    assert sel.tolist() == [[9, 4]]
