"""Tiny random mixture-of-experts models (qwen3moe, qwen2moe, Mixtral = llama with experts,
olmoe) x quant types: memfit's forward against an independent float64 recomputation (gguf-py
reader + gguf.quants.dequantize, routing written out per token), prefill == token by token,
routing edge cases (ties, k = n_expert, sigmoid gating and scale, the shared expert), the
expert interface (one get_experts per layer with the union, router look-ahead prefetch) and
the metadata / shape errors."""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest

from memfit.errors import ModelError, UnsupportedError
from memfit.models import REGISTRY, GGUFWeights, ModelConfig, load_model
from memfit.models.layers import Model
from memfit.models.spec import ArchSpec
from memfit.models.synthetic import write_tiny_model
from memfit.ops import get_ops
from memfit.quant.types import SUPPORTED_NAMES  # noqa: E402

ARCHS = ["qwen3moe", "qwen2moe", "mixtral", "olmoe"]
TYPES = list(SUPPORTED_NAMES)
# what each tiny model is written with (explicit, so the reference does not read the file's
# metadata back)
CFG = {
    "qwen3moe": dict(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, head_dim=128, rope_base=1e6,
                     n_expert=8, n_expert_used=2, n_ff_exp=256),
    "qwen2moe": dict(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, head_dim=64, rope_base=1e6,
                     n_expert=8, n_expert_used=2, n_ff_exp=256, n_ff_shexp=512),
    "mixtral": dict(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, head_dim=64, rope_base=1e4,
                    n_expert=4, n_expert_used=2, n_ff_exp=256),
    "olmoe": dict(n_embd=256, n_layer=2, n_head=4, n_head_kv=4, head_dim=64, rope_base=1e4,
                  n_expert=8, n_expert_used=3, n_ff_exp=256),
}
# routing rules per architecture as llama.cpp's graphs call build_moe_ffn
NORM = {"qwen3moe": True, "qwen2moe": False, "mixtral": True, "olmoe": False}
EPS = 1e-6
IDS = np.array([5, 17, 200, 33, 290, 0, 64, 64, 128, 7, 255, 1], dtype=np.int32)


def _weights(path) -> dict[str, np.ndarray]:
    r = gguf.GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        out[t.name] = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float64).reshape(shape)
    return out


def _rms(x, w):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * w


def _rope(x, pos, base, neox):
    d = x.shape[-1]
    ang = np.exp(1j * pos[:, None, None] * base ** (-np.arange(d // 2) * 2.0 / d))
    if neox:
        z = (x[..., : d // 2] + 1j * x[..., d // 2:]) * ang
        return np.concatenate([z.real, z.imag], axis=-1)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * ang
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def _silu(g):
    return g / (1 + np.exp(-g))


def ref_moe(h, W, p, k, norm, gating="softmax", scale=1.0, shared=False):
    """One token at a time: router probabilities, top-k (ties: lower index), weights, experts."""
    logits = h @ W[p + "ffn_gate_inp.weight"].T
    if gating == "softmax":
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
    else:
        probs = 1 / (1 + np.exp(-logits))
    out = np.zeros_like(h)
    G, U, D = (W[p + f"ffn_{m}_exps.weight"] for m in ("gate", "up", "down"))
    for t in range(h.shape[0]):
        sel = sorted(range(probs.shape[1]), key=lambda e: (-probs[t, e], e))[:k]
        w = probs[t, sel]
        if norm:
            w = w / w.sum()
        w = w * scale
        for j, e in enumerate(sel):
            out[t] += w[j] * (D[e] @ (_silu(G[e] @ h[t]) * (U[e] @ h[t])))
    if shared:
        s = (_silu(h @ W[p + "ffn_gate_shexp.weight"].T) * (h @ W[p + "ffn_up_shexp.weight"].T)) \
            @ W[p + "ffn_down_shexp.weight"].T
        out += s / (1 + np.exp(-(h @ W[p + "ffn_gate_inp_shexp.weight"])))[:, None]
    return out


def reference_logits(path, arch, ids, cfg, gating="softmax", scale=1.0, norm=None):
    W = _weights(path)
    E, H, Hkv, D, k = cfg["n_embd"], cfg["n_head"], cfg["n_head_kv"], cfg["head_dim"], cfg["n_expert_used"]
    norm = NORM[arch] if norm is None else norm
    n = len(ids)
    pos = np.arange(n, dtype=np.float64)
    x = W["token_embd.weight"][ids]
    for il in range(cfg["n_layer"]):
        p = f"blk.{il}."
        h = _rms(x, W[p + "attn_norm.weight"])
        q = h @ W[p + "attn_q.weight"].T + W.get(p + "attn_q.bias", 0.0)
        kk = h @ W[p + "attn_k.weight"].T + W.get(p + "attn_k.bias", 0.0)
        v = h @ W[p + "attn_v.weight"].T + W.get(p + "attn_v.bias", 0.0)
        if arch == "olmoe":  # norm over the whole projected vector
            q, kk = _rms(q, W[p + "attn_q_norm.weight"]), _rms(kk, W[p + "attn_k_norm.weight"])
        q, kk, v = q.reshape(n, H, D), kk.reshape(n, Hkv, D), v.reshape(n, Hkv, D)
        if arch == "qwen3moe":  # per head
            q, kk = _rms(q, W[p + "attn_q_norm.weight"]), _rms(kk, W[p + "attn_k_norm.weight"])
        neox = arch != "mixtral"
        q, kk = _rope(q, pos, cfg["rope_base"], neox), _rope(kk, pos, cfg["rope_base"], neox)
        o = np.zeros((n, H, D))
        mask = np.triu(np.full((n, n), -np.inf), 1)
        for hh in range(H):
            kv = hh // (H // Hkv)
            s = q[:, hh] @ kk[:, kv].T / math.sqrt(D) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            o[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + o.reshape(n, H * D) @ W[p + "attn_output.weight"].T
        h = _rms(x, W[p + "ffn_norm.weight"])
        x = x + ref_moe(h, W, p, k, norm, gating, scale, shared=arch == "qwen2moe")
    out = W.get("output.weight", W["token_embd.weight"])
    return _rms(x, W["output_norm.weight"]) @ out.T


def rel_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def check_logits(m, ids, ref, tol, split=4):
    """m's logits of ids (all at once, then split tokens + one at a time) against ref."""
    full = m.forward(ids, m.new_cache(32), all_logits=True)
    assert rel_err(full, ref) <= tol, rel_err(full, ref)
    steps = run_steps(m, ids, split)
    assert rel_err(steps, ref[split - 1:]) <= tol
    assert rel_err(steps, full[split - 1:].astype(np.float64)) <= tol
    return full


def run_steps(m, ids, split):
    cache = m.new_cache(len(ids))
    steps = [m.forward(ids[:split], cache)]
    for t in ids[split:]:
        steps.append(m.forward(np.array([t]), cache))
    return np.stack(steps)


def check_model(path, arch, cfg, ids=IDS, split=4, tol=1e-4, backend="numpy", **ref_kw):
    m = load_model(path, ops=get_ops(backend))
    m.kv_f16 = False  # exact float32 math against the float64 recomputation
    ref = reference_logits(path, arch, ids, cfg, **ref_kw)
    full = m.forward(ids, m.new_cache(32), all_logits=True)
    assert full.shape == ref.shape and full.dtype == np.float32
    assert rel_err(full, ref) <= tol, rel_err(full, ref)
    steps = run_steps(m, ids, split)
    assert rel_err(steps, ref[split - 1:]) <= tol
    assert rel_err(steps, full[split - 1:].astype(np.float64)) <= tol
    return m, ref


def _tiny(tmp_path, arch, qtype="Q8_0", seed=0, **kw):
    return write_tiny_model(tmp_path / f"{arch}.gguf", arch, qtype, seed=seed, **{**CFG[arch], **kw})


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_moe_forward_matches_float64(tmp_path, arch, qtype):
    path = _tiny(tmp_path, arch, qtype, seed=TYPES.index(qtype) + 10 * ARCHS.index(arch))
    m, ref = check_model(path, arch, CFG[arch])
    assert np.std(ref) > 0.1
    c = m.config
    assert (c.n_expert, c.n_expert_used, c.expert_weights_norm) == \
        (CFG[arch]["n_expert"], CFG[arch]["n_expert_used"], NORM[arch])
    assert m._decode_layers() is None  # the fused dense decode layer is not used for experts


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_native_backend(tmp_path, arch):
    # the native kernels quantize activations to 8 bits: the dense tiny models' native logits
    # are within 1.2-2.6% of float64 here, so the same spread is allowed for experts
    path = _tiny(tmp_path, arch, "Q4_K", seed=7)
    check_model(path, arch, CFG[arch], tol=4e-2, backend="native")


def test_routing_is_not_trivial(tmp_path):
    # the tiny models really route: different tokens pick different experts, all are used
    path = _tiny(tmp_path, "olmoe", "Q8_0", seed=3)
    m = load_model(path, ops=get_ops("numpy"))
    x = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    sel, w = m.route(0, x)
    assert sel.shape == (64, 3) and len(np.unique(sel)) == 8
    assert all(len(set(r)) == 3 for r in sel.tolist())
    assert np.all(w > 0) and np.all(np.diff(w, axis=1) <= 0)  # sorted by probability


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_ties_pick_the_lower_expert_index(tmp_path, arch):
    # a zero router: every expert has probability 1/n_expert; top-k is experts 0..k-1
    cfg = CFG[arch]
    zero = {f"blk.{il}.ffn_gate_inp.weight": np.zeros((cfg["n_expert"], cfg["n_embd"])) for il in range(2)}
    path = _tiny(tmp_path, arch, "Q8_0", seed=1, arrays=zero)
    m, _ = check_model(path, arch, cfg)
    sel, w = m.route(0, np.ones((3, cfg["n_embd"]), np.float32))
    assert sel.tolist() == [[0, 1]] * 3
    expect = 1 / 2 if NORM[arch] else 1 / cfg["n_expert"]
    np.testing.assert_allclose(w, expect, rtol=1e-6)
    # two experts with the same router row: a tie between them goes to the lower index
    r = np.random.default_rng(2).standard_normal((cfg["n_expert"], cfg["n_embd"])).astype(np.float32)
    r[6] = r[3] = r[3] * 4
    m2 = load_model(_tiny(tmp_path, arch, "Q8_0", seed=1, arrays={"blk.0.ffn_gate_inp.weight": r}),
                    ops=get_ops("numpy"))
    xs = np.abs(r[3:4]) * np.sign(r[3:4])   # aligned with rows 3 and 6
    sel, _ = m2.route(0, np.ascontiguousarray(xs))
    assert sel.tolist() == [[3, 6]]


def test_k_equals_n_expert(tmp_path):
    cfg = dict(CFG["mixtral"], n_expert_used=4)
    path = _tiny(tmp_path, "mixtral", "Q6_K", seed=4, n_expert_used=4)
    m, _ = check_model(path, "mixtral", cfg)
    sel, w = m.route(0, np.random.default_rng(0).standard_normal((5, 256)).astype(np.float32))
    assert sorted(sel[0].tolist()) == [0, 1, 2, 3]
    np.testing.assert_allclose(w.sum(1), 1.0, rtol=1e-6)  # renormalized: the softmax itself


class SigmoidMoe(Model):
    # a deepseek-style spec that reads the routing keys from the file (llama.cpp's qwen3moe,
    # qwen2moe, olmoe and llama graphs fix softmax, their norm rule and no scale)
    spec = ArchSpec("sigmoe", rope_neox=True, qk_norm="head", moe="always", routing_keys=True)


def test_sigmoid_gating_and_weights_scale(tmp_path, monkeypatch):
    monkeypatch.setitem(REGISTRY, "sigmoe", SigmoidMoe)
    cfg = CFG["qwen3moe"]
    path = write_tiny_model(tmp_path / "s.gguf", "sigmoe", "Q4_K", seed=5, gating="sigmoid",
                            expert_weights_scale=2.5, expert_weights_norm=False, **cfg)
    m, ref = check_model(path, "qwen3moe", cfg, gating="sigmoid", scale=2.5, norm=False)
    assert (m.config.expert_gating_func, m.config.expert_weights_scale) == ("sigmoid", 2.5)
    plain = reference_logits(path, "qwen3moe", IDS, cfg)
    assert rel_err(plain, ref) > 1e-2   # the gating and scale were really exercised
    # renormalized sigmoid weights
    path = write_tiny_model(tmp_path / "n.gguf", "sigmoe", "Q8_0", seed=6, gating="sigmoid",
                            expert_weights_norm=True, **cfg)
    check_model(path, "qwen3moe", cfg, gating="sigmoid", norm=True)


def test_fixed_routing_rules_ignore_the_file_keys(tmp_path):
    # as llama.cpp: qwen3moe is softmax + renormalized + unscaled whatever the keys say
    cfg = CFG["qwen3moe"]
    path = _tiny(tmp_path, "qwen3moe", "Q8_0", seed=9, metadata={
        "qwen3moe.expert_gating_func": 2, "qwen3moe.expert_weights_norm": False,
        "qwen3moe.expert_weights_scale": 3.0})
    m, _ = check_model(path, "qwen3moe", cfg)
    c = m.config
    assert (c.expert_gating_func, c.expert_weights_norm, c.expert_weights_scale) == ("softmax", True, 1.0)


def test_shared_expert_contributes(tmp_path):
    cfg = CFG["qwen2moe"]
    path = _tiny(tmp_path, "qwen2moe", "Q5_K", seed=6)
    m, ref = check_model(path, "qwen2moe", cfg)
    assert m.config.n_ff_shexp == 512
    W = _weights(path)
    h = _rms(W["token_embd.weight"][IDS], W["blk.0.ffn_norm.weight"])
    with_s = ref_moe(h, W, "blk.0.", 2, False, shared=True)
    without = ref_moe(h, W, "blk.0.", 2, False, shared=False)
    got = m.moe_ffn(0, h.astype(np.float32))
    assert rel_err(got, with_s) <= 1e-4 and rel_err(without, with_s) > 1e-2


class Recording(GGUFWeights):
    """The plain GGUF weights, recording the expert calls and asking for look-ahead hints."""

    wants_expert_prediction = True

    def __init__(self, f):
        super().__init__(f)
        self.calls, self.hints = [], []

    def get_experts(self, il, experts):
        self.calls.append((il, list(experts)))
        return super().get_experts(il, experts)

    def prefetch_experts(self, il, experts):
        self.hints.append((il, list(experts)))


def test_expert_interface_one_call_per_layer_and_prefetch(tmp_path):
    from memfit.gguf import open_gguf
    path = _tiny(tmp_path, "qwen3moe", "Q4_0", seed=8)
    with open_gguf(path) as f:
        w = Recording(f)
        m = load_model(f, weights=w, ops=get_ops("numpy"))
        m.forward(IDS[:6], m.new_cache(16))
        assert [il for il, _ in w.calls] == [0, 1]
        # the union of the batch's choices, each expert once, sorted
        x = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
        for il, ex in w.calls:
            assert ex == sorted(set(ex)) and 2 <= len(ex) <= 8
        assert [il for il, _ in w.hints] == [1]   # layer 0 predicts layer 1; no layer 2
        # expert views are the stacked tensors' byte ranges
        g, u, d = w.get_experts(1, [5])[0]
        st = f.tensor_data("blk.1.ffn_down_exps.weight")
        nb = st.size // 8
        assert d.shape == (256, 256) and np.shares_memory(d.data, st)
        assert d.data.ctypes.data == st.ctypes.data + 5 * nb
        del x, g, u


def _md(arch="qwen3moe", **kw):
    md = {"general.architecture": arch, f"{arch}.block_count": 2, f"{arch}.embedding_length": 256,
          f"{arch}.attention.head_count": 4, f"{arch}.feed_forward_length": 512,
          f"{arch}.vocab_size": 300, f"{arch}.expert_count": 8, f"{arch}.expert_used_count": 2,
          f"{arch}.expert_feed_forward_length": 128}
    md.update({f"{arch}.{k}": v for k, v in kw.items()})
    return {k: v for k, v in md.items() if v is not None}


def test_metadata_errors():
    assert ModelConfig.from_metadata(_md()).n_ff_exp == 128
    with pytest.raises(UnsupportedError, match="expert_gating_func 7"):
        ModelConfig.from_metadata(_md(expert_gating_func=7))
    # qwen3moe's router is softmax in llama.cpp whatever the key says (a valid value)
    assert ModelConfig.from_metadata(_md(expert_gating_func=2)).expert_gating_func == "softmax"
    with pytest.raises(ModelError, match="expert_used_count = 9"):
        ModelConfig.from_metadata(_md(expert_used_count=9))
    with pytest.raises(ModelError, match="expert_used_count = 0"):
        ModelConfig.from_metadata(_md(expert_used_count=0))
    with pytest.raises(ModelError, match="expert_count = 0"):
        ModelConfig.from_metadata(_md(expert_count=0))
    with pytest.raises(ModelError, match="key_length = 0"):
        ModelConfig.from_metadata(_md(**{"attention.key_length": 0}))
    with pytest.raises(ModelError, match="rope.dimension_count = -2"):
        ModelConfig.from_metadata(_md(**{"rope.dimension_count": -2}))
    with pytest.raises(ModelError, match="n_head = 0"):
        ModelConfig.from_metadata(_md(**{"attention.head_count": 0}))
    with pytest.raises(ModelError, match="head_count = 300 does not divide"):
        ModelConfig.from_metadata(_md(**{"attention.head_count": 300}))
    with pytest.raises(ModelError, match="block_count = 'x'"):
        ModelConfig.from_metadata(_md(block_count="x"))
    with pytest.raises(ModelError, match="expert_weights_scale = -1"):
        ModelConfig(arch="x", n_layer=1, n_embd=64, n_head=1, n_head_kv=1, n_ff=64, n_vocab=9,
                    rms_eps=1e-6, n_expert=2, n_expert_used=1, n_ff_exp=32,
                    expert_weights_scale=-1.0)
    with pytest.raises(UnsupportedError, match="expert_count 8 > 0.*only dense"):
        ModelConfig.from_metadata(_md("qwen3"))
    # qwen2moe without expert_feed_forward_length: n_ff / n_expert_used (llama.cpp's rule)
    c = ModelConfig.from_metadata(_md("qwen2moe", expert_feed_forward_length=None))
    assert (c.n_ff_exp, c.n_ff_shexp) == (256, 512)
    # Mixtral (llama + experts): expert rows are feed_forward_length, weights renormalized
    c = ModelConfig.from_metadata(_md("llama", expert_feed_forward_length=None))
    assert (c.n_ff_exp, c.expert_weights_norm) == (512, True)
    assert ModelConfig.from_metadata(_md("llama", expert_count=None)).n_expert == 0


def test_wrong_stacked_shape_and_type(tmp_path):
    path = _tiny(tmp_path, "qwen3moe", "Q4_0", shapes={"blk.1.ffn_up_exps.weight": (8, 256, 512)})
    with pytest.raises(ModelError, match=r"blk\.1\.ffn_up_exps\.weight.*\(8, 256, 512\).*"
                                         r"\(8, 256, 256\).*stacked experts"):
        load_model(path)
    path = _tiny(tmp_path, "olmoe", "Q4_0", skip={"blk.0.ffn_gate_inp.weight"})
    with pytest.raises(ModelError, match=r"blk\.0\.ffn_gate_inp\.weight is missing"):
        load_model(path)
    path = _tiny(tmp_path, "mixtral", "Q4_K", types={"blk.0.ffn_down_exps.weight": "Q8_1"})
    with pytest.raises(UnsupportedError, match=r"blk\.0\.ffn_down_exps\.weight.*Q8_1"):
        load_model(path)
