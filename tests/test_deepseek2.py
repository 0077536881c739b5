"""deepseek2 (DeepSeek-V2/V3/R1, Kimi K2): tiny random files against an independent float64
recomputation in the decompressed (naive, per-head K and V) form of multi-head latent
attention -- so the absorbed MLA that memfit runs is checked against the naive one --, with
the low-rank q or a plain attn_q, the older attn_kv_b files, a dense leading layer, sigmoid
routing with exp_probs_b and group-limited choice, the shared expert; prefill == token by
token (decode runs the absorbed form row by row); the cache holds C + R values per token."""

from __future__ import annotations

import numpy as np
import pytest

from memfit.errors import ModelError, UnsupportedError
from memfit.models import ModelConfig, load_model
from memfit.models.synthetic import write_tiny_model
from memfit.ops import get_ops
from test_glm4moe import ref_route
from test_moe_models import _rms, _silu, _weights, check_logits, rel_err, run_steps

# the tiny writer's deepseek2 defaults (models/synthetic.py), written out for the reference
CFG = dict(n_embd=256, n_layer=3, n_head=4, C=256, R=32, Dn=64, Dv=64, Q=256, n_expert=8, k=2,
           groups=(4, 2), dense=1, scale=2.5, rope_base=10000.0)
IDS = np.array([5, 17, 200, 33, 290, 0, 64, 64, 128, 7, 255, 1], dtype=np.int32)


def _rope_norm(x, pos, base):
    # adjacent pairs (2i, 2i+1) over all of x's last axis
    d = x.shape[-1]
    ang = np.exp(1j * pos[:, None, None] * base ** (-np.arange(d // 2) * 2.0 / d))
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * ang
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def reference_logits(path, ids, cfg, q_lora=True, legacy=False):
    W = _weights(path)
    H, C, R, Dn, Dv = cfg["n_head"], cfg["C"], cfg["R"], cfg["Dn"], cfg["Dv"]
    n = len(ids)
    pos = np.arange(n, dtype=np.float64)
    x = W["token_embd.weight"][ids]
    for il in range(cfg["n_layer"]):
        p = f"blk.{il}."
        h = _rms(x, W[p + "attn_norm.weight"])
        if q_lora:
            q = _rms(h @ W[p + "attn_q_a.weight"].T, W[p + "attn_q_a_norm.weight"]) @ W[p + "attn_q_b.weight"].T
        else:
            q = h @ W[p + "attn_q.weight"].T
        q = q.reshape(n, H, Dn + R)
        ckv = h @ W[p + "attn_kv_a_mqa.weight"].T
        c = _rms(ckv[:, :C], W[p + "attn_kv_a_norm.weight"])
        k_pe = _rope_norm(ckv[:, None, C:], pos, cfg["rope_base"])[:, 0]
        q_pe = _rope_norm(q[..., Dn:], pos, cfg["rope_base"])
        # decompress the latent per head: k_nope = W_kb[h]^T c, v = W_vb[h] c
        if legacy:
            kv = (c @ W[p + "attn_kv_b.weight"].T).reshape(n, H, Dn + Dv)
            k_nope, v = kv[..., :Dn], kv[..., Dn:]
        else:
            k_nope = np.einsum("hcd,tc->thd", W[p + "attn_k_b.weight"], c)
            v = np.einsum("hvc,tc->thv", W[p + "attn_v_b.weight"], c)
        o = np.zeros((n, H, Dv))
        mask = np.triu(np.full((n, n), -np.inf), 1)
        for hh in range(H):
            s = (q[:, hh, :Dn] @ k_nope[:, hh].T + q_pe[:, hh] @ k_pe.T) / np.sqrt(Dn + R) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            o[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, hh]
        x = x + o.reshape(n, H * Dv) @ W[p + "attn_output.weight"].T
        h = _rms(x, W[p + "ffn_norm.weight"])

        def glu(sfx, hh=h):
            return (_silu(hh @ W[p + f"ffn_gate{sfx}.weight"].T) * (hh @ W[p + f"ffn_up{sfx}.weight"].T)) \
                @ W[p + f"ffn_down{sfx}.weight"].T
        if il < cfg["dense"]:
            x = x + glu("")
            continue
        sel, w = ref_route(h @ W[p + "ffn_gate_inp.weight"].T, cfg["k"], "sigmoid",
                           W[p + "exp_probs_b.bias"], True, cfg["scale"], *cfg["groups"])
        G, U, Dd = (W[p + f"ffn_{m}_exps.weight"] for m in ("gate", "up", "down"))
        f = np.zeros_like(h)
        for t in range(n):
            for j, e in enumerate(sel[t]):
                f[t] += w[t, j] * (Dd[e] @ (_silu(G[e] @ h[t]) * (U[e] @ h[t])))
        x = x + f + glu("_shexp")
    out = W.get("output.weight", W["token_embd.weight"])
    return _rms(x, W["output_norm.weight"]) @ out.T


def _tiny(tmp_path, qtype="F32", seed=0, q_lora=True, legacy=False, **kw):
    extra = dict(optional=("exp_probs_b.bias",))
    if not q_lora:
        extra["q_lora_rank"] = 0
    if legacy:   # per-head K (nope + rope) and V in the cache: MHA
        extra.update(head_dim_k_mla=0, head_dim_v_mla=0, head_dim_k=96, head_dim_v=64, n_head_kv=4)
    return write_tiny_model(tmp_path / "ds.gguf", "deepseek2", qtype, seed=seed, **{**extra, **kw})


# F32 weights on the native backend run its float kernels (matmul_heads, MLA attention) at
# float32 precision. Quantized types there quantize activations to 8 bits (as llama.cpp):
# through MLA's chain of projections a sigmoid router's choice of these tiny random files
# flips for some tokens (2-30% max difference), so those are checked for self-consistency
# (test_exact, test_budget_archs), not against float64.
@pytest.mark.parametrize("backend,qtype,tol", [("numpy", "F32", 1e-4), ("numpy", "Q8_0", 1e-4),
                                               ("native", "F32", 1e-4)])
@pytest.mark.parametrize("form", ["mla", "mla-no-qlora", "legacy"])
def test_deepseek2_matches_float64(tmp_path, backend, qtype, tol, form):
    q_lora, legacy = form != "mla-no-qlora", form == "legacy"
    path = _tiny(tmp_path, qtype, seed=11, q_lora=q_lora, legacy=legacy)
    m = load_model(path, ops=get_ops(backend))
    m.kv_f16 = False
    c = m.config
    assert (c.n_layer_dense_lead, c.expert_group_count, c.expert_gating_func) == (1, 4, "sigmoid")
    assert c.attn_scale == pytest.approx(1 / np.sqrt(96))
    if not legacy:   # one KV head of latent + rope: the cache's K row
        assert (c.n_head_kv, c.head_dim_k, c.head_dim_v) == (1, 288, 256)
    ref = reference_logits(path, IDS, CFG, q_lora, legacy)
    assert np.std(ref) > 0.1
    check_logits(m, IDS, ref, tol)


def test_mla_prefill_rows_equal_whole_prompt_bit_for_bit(tmp_path):
    # the prefill kernels row by row against the whole prompt, on the native backend: one
    # reduction order per row (batch invariance) holds through the absorbed MLA
    from memfit.models.batch import Batch
    path = _tiny(tmp_path, "Q4_K", seed=2)
    m = load_model(path, ops=get_ops("native"))
    whole = m.forward(IDS, m.new_cache(32), all_logits=True)
    cache = m.new_cache(32)
    rows = []
    for t in IDS:
        kv = cache.view(1)
        b = Batch(np.array([t]), kv.pos, m._zero_seq(1), np.array([0]), kv, decode=False)
        rows.append(m._forward(b)[0])
        cache.advance(1)
    np.testing.assert_array_equal(np.stack(rows), whole)


def _md(arch="deepseek2", **kw):
    """An MLA file's metadata (deepseek2 keys; glm-dsa's tests add theirs)."""
    a = arch
    md = {"general.architecture": a, f"{a}.block_count": 4, f"{a}.embedding_length": 256,
          f"{a}.attention.head_count": 4, f"{a}.attention.head_count_kv": 1,
          f"{a}.feed_forward_length": 512, f"{a}.vocab_size": 300, f"{a}.expert_count": 8,
          f"{a}.expert_used_count": 2, f"{a}.expert_feed_forward_length": 128,
          f"{a}.expert_shared_count": 2, f"{a}.attention.key_length": 288,
          f"{a}.attention.value_length": 256, f"{a}.attention.key_length_mla": 96,
          f"{a}.attention.value_length_mla": 64, f"{a}.attention.kv_lora_rank": 256,
          f"{a}.attention.q_lora_rank": 128, f"{a}.rope.dimension_count": 32}
    md.update({f"{a}.{k}": v for k, v in kw.items()})
    return {k: v for k, v in md.items() if v is not None}


def test_deepseek2_metadata():
    c = ModelConfig.from_metadata(_md())
    assert (c.q_lora_rank, c.kv_lora_rank, c.n_ff_shexp, c.expert_gating_func) == (128, 256, 256, "softmax")
    # DeepSeek-V2-Lite (27 layers): llama.cpp reads no q_lora_rank, whatever the file says
    assert ModelConfig.from_metadata(_md(block_count=27)).q_lora_rank == 0
    # YaRN as DeepSeek-V3: factor 40, log multiplier 0.1 (x 1/0.1 = 1): rope magnitude 1 and
    # kq_scale = (1 + 0.1 ln 40)^2 / sqrt(96)
    y = ModelConfig.from_metadata(_md(**{"rope.scaling.type": "yarn", "rope.scaling.factor": 40.0,
                                         "rope.scaling.original_context_length": 4096,
                                         "rope.scaling.yarn_log_multiplier": 0.1}))
    assert y.yarn and y.yarn_log_mul == pytest.approx(1.0) and y.n_ctx_orig == 4096
    assert y.yarn_attn_factor * (1 + 0.1 * np.log(40)) == pytest.approx(1.0)
    assert y.attn_scale == pytest.approx((1 + 0.1 * np.log(40)) ** 2 / np.sqrt(96))
    with pytest.raises(ModelError, match="MLA file"):
        ModelConfig.from_metadata(_md(**{"attention.key_length": 256}))
    with pytest.raises(UnsupportedError, match="temperature"):
        ModelConfig.from_metadata(_md(**{"attention.temperature_scale": 0.1}))
    with pytest.raises(ModelError, match="kv_lora_rank"):
        ModelConfig.from_metadata(_md(**{"attention.kv_lora_rank": None,
                                         "attention.key_length_mla": None,
                                         "attention.value_length_mla": None,
                                         "attention.key_length": 96, "attention.value_length": 64,
                                         "attention.head_count_kv": 4}))


@pytest.mark.parametrize("backend,qtype,tol", [("numpy", "Q8_0", 1e-4), ("native", "F32", 1e-4)])
def test_glm_dsa_is_dense_mla_up_to_the_indexer_top_k(tmp_path, backend, qtype, tol):
    # glm-dsa (GLM-5): the deepseek2 layer, sigmoid routing, a NextN layer, an indexer whose
    # top-k (64 here) keeps every key of these short prompts: exactly dense MLA (the indexer
    # beyond top-k: tests/test_glm_dsa_indexer.py)
    path = write_tiny_model(tmp_path / "g5.gguf", "glm-dsa", qtype, seed=12)
    m = load_model(path, ops=get_ops(backend))
    m.kv_f16 = False
    c = m.config
    assert (c.n_layer, c.n_layer_nextn, c.indexer, c.max_ctx) == (3, 1, (2, 64, 64), 0)
    ref = reference_logits(path, IDS, {**CFG, "groups": (0, 0), "scale": 1.0})
    full = m.forward(IDS, m.new_cache(32), all_logits=True)
    assert rel_err(full, ref) <= tol, rel_err(full, ref)
    assert rel_err(run_steps(m, IDS, 4), ref[3:]) <= tol


def test_deepseek2_yarn_matches_float64(tmp_path):
    # YaRN as DeepSeek-V3 writes it (factor 40, log multiplier 0.1 x 1/0.1): ggml's rope_yarn
    # on q_pe / k_pe (adjacent pairs) with magnitude 1, and kq_scale (1 + 0.1 ln 40)^2 / sqrt(96)
    from memfit.ops.rope import yarn_corr_dims
    f, orig = 40.0, 64
    path = _tiny(tmp_path, "F32", seed=14, rope_scaling="yarn", rope_freq_scale=1 / f,
                 n_ctx_orig=orig, metadata={"deepseek2.rope.scaling.yarn_log_multiplier": 0.1})
    m = load_model(path, ops=get_ops("native"))
    m.kv_f16 = False
    assert m.config.yarn and m.config.yarn_log_mul == pytest.approx(1.0)
    lo, hi = yarn_corr_dims(CFG["R"], orig, CFG["rope_base"], 32.0, 1.0)
    assert 0 < hi < CFG["R"] // 2   # the ramp runs inside the rotated pairs

    def rope(x, pos, base):
        d = x.shape[-1]
        i = np.arange(d // 2)
        extrap = pos[:, None] * base ** (-2.0 * i / d)
        ramp = 1 - np.clip((i - lo) / max(0.001, hi - lo), 0, 1)
        theta = extrap / f * (1 - ramp) + extrap * ramp
        z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * theta)[:, None, :]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
        return out
    import test_deepseek2 as T
    old = T._rope_norm
    T._rope_norm = rope
    try:
        ref = reference_logits(path, IDS, CFG)
    finally:
        T._rope_norm = old
    # the reference scores with 1/sqrt(96): yarn's mscale^2 is the only difference in scale
    ms = (1 + 0.1 * np.log(f)) ** 2
    assert m.config.attn_scale == pytest.approx(ms / np.sqrt(96))
    m.config.attn_scale = 1 / np.sqrt(96)
    full = m.forward(IDS, m.new_cache(32), all_logits=True)
    assert rel_err(full, ref) <= 1e-4, rel_err(full, ref)
