"""glm-dsa (GLM-5) DeepSeek sparse attention: the lightning indexer picks each query row's top
K_idx keys and MLA attends over those only (models/glmdsa.py). Tiny random files with a small
top-k (16) against an independent float64 recomputation (gguf-py reader, MLA in the
decompressed per-head form, the indexer's selection by float64 scores), prefill == token by
token, the engine's exactness battery (cached, chunked, batched, preempted), shared indexer
layers, the indexer key cache in the KV pool (bytes, sessions), and no context cap."""

from __future__ import annotations

import json

import numpy as np
import pytest

from memfit.models import ModelConfig, load_model
from memfit.models.synthetic import write_tiny_model
from memfit.ops import get_ops
from test_deepseek2 import _rope_norm
from test_glm4moe import ref_route
from test_moe_models import _rms, _silu, _weights, rel_err

# the tiny writer's glm-dsa defaults (models/synthetic.py), written out for the reference
CFG = dict(n_embd=256, n_layer=3, n_head=4, C=256, R=32, Dn=64, Dv=64, n_expert=8, k=2,
           dense=1, scale=1.0, rope_base=10000.0, Hi=2, Di=64)
IDS = np.array([(5 + 37 * i) % 290 for i in range(40)], dtype=np.int32)


def _tiny(tmp_path, qtype="F32", seed=21, top_k=16, **kw):
    return write_tiny_model(tmp_path / f"dsa-{qtype}-{top_k}.gguf", "glm-dsa", qtype, seed=seed,
                            indexer=(2, 64, top_k), **kw)


def _layer_norm(x, w, b, eps=1e-6):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def reference_logits(path, ids, top_k, types=None, cfg=CFG):
    """float64 logits [n, n_vocab] and per layer the kept-key mask [n, n] (None: all)."""
    W = _weights(path)
    H, C, R, Dn, Dv, Hi, Di = (cfg[k] for k in ("n_head", "C", "R", "Dn", "Dv", "Hi", "Di"))
    n = len(ids)
    types = types or [1] * cfg["n_layer"]
    pos = np.arange(n, dtype=np.float64)
    t = np.arange(n)
    causal = t[None, :] <= t[:, None]
    x = W["token_embd.weight"][ids]
    keep, kept = causal, []
    for il in range(cfg["n_layer"]):
        p = f"blk.{il}."
        h = _rms(x, W[p + "attn_norm.weight"])
        qr = _rms(h @ W[p + "attn_q_a.weight"].T, W[p + "attn_q_a_norm.weight"])
        if types[il]:
            # the lightning indexer
            iq = (qr @ W[p + "indexer.attn_q_b.weight"].T).reshape(n, Hi, Di)
            iq[..., :R] = _rope_norm(iq[..., :R], pos, cfg["rope_base"])
            ik = _layer_norm(h @ W[p + "indexer.attn_k.weight"].T, W[p + "indexer.k_norm.weight"],
                             W[p + "indexer.k_norm.bias"])
            ik[:, :R] = _rope_norm(ik[:, None, :R], pos, cfg["rope_base"])[:, 0]
            w = (h @ W[p + "indexer.proj.weight"].T) / np.sqrt(Di * Hi)
            d = np.maximum(np.einsum("ihd,td->iht", iq, ik), 0.0)
            s = np.einsum("iht,ih->it", d, w)
            keep = np.zeros((n, n), bool)
            for i in range(n):
                if i + 1 <= top_k:
                    keep[i, :i + 1] = True
                else:   # best scores, ties: the lower position first
                    order = np.lexsort((t[:i + 1], -s[i, :i + 1]))
                    keep[i, order[:top_k]] = True
        kept.append(keep)
        q = (qr @ W[p + "attn_q_b.weight"].T).reshape(n, H, Dn + R)
        ckv = h @ W[p + "attn_kv_a_mqa.weight"].T
        c = _rms(ckv[:, :C], W[p + "attn_kv_a_norm.weight"])
        k_pe = _rope_norm(ckv[:, None, C:], pos, cfg["rope_base"])[:, 0]
        q_pe = _rope_norm(q[..., Dn:], pos, cfg["rope_base"])
        k_nope = np.einsum("hcd,tc->thd", W[p + "attn_k_b.weight"], c)
        v = np.einsum("hvc,tc->thv", W[p + "attn_v_b.weight"], c)
        o = np.zeros((n, H, Dv))
        mask = np.where(keep, 0.0, -np.inf)
        for hh in range(H):
            sc = (q[:, hh, :Dn] @ k_nope[:, hh].T + q_pe[:, hh] @ k_pe.T) / np.sqrt(Dn + R) + mask
            sc = np.exp(sc - sc.max(-1, keepdims=True))
            o[:, hh] = (sc / sc.sum(-1, keepdims=True)) @ v[:, hh]
        x = x + o.reshape(n, H * Dv) @ W[p + "attn_output.weight"].T
        h = _rms(x, W[p + "ffn_norm.weight"])

        def glu(sfx, hh=h):
            return (_silu(hh @ W[p + f"ffn_gate{sfx}.weight"].T) * (hh @ W[p + f"ffn_up{sfx}.weight"].T)) \
                @ W[p + f"ffn_down{sfx}.weight"].T
        if il < cfg["dense"]:
            x = x + glu("")
            continue
        sel, wt = ref_route(h @ W[p + "ffn_gate_inp.weight"].T, cfg["k"], "sigmoid",
                            W[p + "exp_probs_b.bias"], True, cfg["scale"], 0, 0)
        G, U, Dd = (W[p + f"ffn_{m}_exps.weight"] for m in ("gate", "up", "down"))
        f = np.zeros_like(h)
        for tt in range(n):
            for j, e in enumerate(sel[tt]):
                f[tt] += wt[tt, j] * (Dd[e] @ (_silu(G[e] @ h[tt]) * (U[e] @ h[tt])))
        x = x + f + glu("_shexp")
    out = W.get("output.weight", W["token_embd.weight"])
    return _rms(x, W["output_norm.weight"]) @ out.T, kept


def _steps(m, ids, split):
    cache = m.new_cache(64)
    rows = [m.forward(ids[:split], cache, all_logits=True)]
    for t in ids[split:]:
        rows.append(m.forward(np.array([t]), cache, all_logits=True))
    return np.concatenate(rows)


@pytest.mark.parametrize("backend", ["numpy", "native"])
def test_indexer_matches_float64(tmp_path, backend):
    path = _tiny(tmp_path)
    m = load_model(path, ops=get_ops(backend))
    m.kv_f16 = False
    c = m.config
    assert (c.indexer, c.indexer_full, c.max_ctx, c.norm_eps) == ((2, 64, 16), (1, 1, 1), 0, 1e-6)
    ref, kept = reference_logits(path, IDS, 16)
    assert np.std(ref) > 0.1
    # the selection prunes: rows past 16 keep 16 of their keys, and not always the last 16
    assert all((k.sum(1) == np.minimum(np.arange(40) + 1, 16)).all() for k in kept)
    assert any(not k[30, 15:31].all() for k in kept)
    m.selection_log = []
    full = m.forward(IDS, m.new_cache(64), all_logits=True)
    assert rel_err(full, ref) <= 1e-4, rel_err(full, ref)
    assert [il for il, _, _ in m.selection_log] == [0, 1, 2]
    for _, k, vis in m.selection_log:
        np.testing.assert_array_equal(k, np.minimum(vis, 16))
    # dense reference (no pruning) is measurably different: the selection matters
    dense, _ = reference_logits(path, IDS, 64)
    assert rel_err(dense, ref) > 1e-3


@pytest.mark.parametrize("backend", ["numpy", "native"])
def test_top_k_at_least_the_prompt_is_dense_mla(tmp_path, backend):
    # K_idx >= every row's keys: the indexer keeps all, the dense path (no scores) runs, and
    # it equals the float64 dense MLA; with K_idx 16 on the same weights it differs
    path = _tiny(tmp_path, top_k=64)
    m = load_model(path, ops=get_ops(backend))
    m.kv_f16 = False
    ref, _ = reference_logits(path, IDS, 64)
    full = m.forward(IDS, m.new_cache(64), all_logits=True)
    assert rel_err(full, ref) <= 1e-4, rel_err(full, ref)


def test_selection_of_every_key_is_the_dense_result_bit_for_bit(tmp_path):
    # attend_keys with each row's whole key list in order: the dense kernels' bits (native)
    path = _tiny(tmp_path, qtype="Q8_0")
    m = load_model(path, ops=get_ops("native"))
    cache = m.new_cache(64)
    kv = cache.view(40)
    rng = np.random.default_rng(0)
    C, R = 256, 32
    q = rng.standard_normal((40, 4, C + R)).astype(np.float32)
    k = rng.standard_normal((40, 1, C + R)).astype(np.float32)
    dense = kv.attend(0, m.ops, q.copy(), k, k[..., :C], None, 0.1, 0, 0.0)
    starts = np.concatenate([[0], np.cumsum(np.arange(1, 41))])
    keys = np.concatenate([kv.slots[:i + 1] for i in range(40)])
    sparse = kv.attend_keys(0, m.ops, q.copy(), k, k[..., :C], None, 0.1, starts, keys)
    np.testing.assert_array_equal(dense, sparse)


@pytest.mark.parametrize("backend,kv_f16", [("numpy", False), ("native", False), ("native", True)])
def test_prefill_equals_token_by_token(tmp_path, backend, kv_f16):
    path = _tiny(tmp_path)
    m = load_model(path, ops=get_ops(backend))
    m.kv_f16 = kv_f16
    m.selection_log = []
    full = m.forward(IDS, m.new_cache(64), all_logits=True)
    assert any((k < vis).any() for _, k, vis in m.selection_log)    # keys were pruned
    steps = _steps(m, IDS, 5)
    assert rel_err(steps, full.astype(np.float64)) <= 1e-4, rel_err(steps, full)
    if kv_f16:   # the indexer cache is float16 next to an f16 K cache
        assert m.new_cache(8).pool.aux[0].dtype == np.float16


@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_engine_exact_with_sparse_attention(tmp_path, kv):
    # the exactness battery of test_exact (prefix-cache hits, chunked prefill, batched with
    # other sequences, preemption and recompute) with K_idx 16 < the prompts (33..70 tokens)
    from memfit.gguf import open_gguf
    from memfit.tokenizer import Tokenizer
    from test_exact import PROMPTS, _alone, _battery
    f = open_gguf(_tiny(tmp_path, qtype="Q4_K", seed=31))
    tok = Tokenizer.from_metadata(f.metadata)
    tok.eog_ids = set()
    model = load_model(f, ops=get_ops("native"))
    model.selection_log = []
    cold = [_alone(model, tok, kv, p) for p in PROMPTS]
    assert any((k < vis).any() for _, k, vis in model.selection_log)
    model.selection_log = None
    _battery(model, tok, kv, cold, f"glm-dsa {kv}")


def test_shared_layers_reuse_the_last_full_selection(tmp_path):
    # attention.indexer.types [1, 0, 1]: layer 1 runs no indexer (it has no indexer tensors)
    # and attends over layer 0's selection
    skip = [f"blk.1.indexer.{t}" for t in ("k_norm.weight", "k_norm.bias", "proj.weight",
                                           "attn_k.weight", "attn_q_b.weight")]
    path = _tiny(tmp_path, skip=skip, metadata={"glm-dsa.attention.indexer.types": [1, 0, 1]})
    m = load_model(path, ops=get_ops("numpy"))
    m.kv_f16 = False
    assert m.config.indexer_full == (1, 0, 1)
    ref, kept = reference_logits(path, IDS, 16, types=[1, 0, 1])
    assert (kept[1] == kept[0]).all() and not (kept[2] == kept[0]).all()
    m.selection_log = []
    full = m.forward(IDS, m.new_cache(64), all_logits=True)
    assert rel_err(full, ref) <= 1e-4, rel_err(full, ref)
    assert [il for il, _, _ in m.selection_log] == [0, 2]
    # only the full layers hold indexer keys
    pool = m.new_cache(8).pool
    assert [a is not None for a in pool.aux] == [True, False, True]
    # prefill == token by token through the shared layer too
    assert rel_err(_steps(m, IDS, 3), full.astype(np.float64)) <= 1e-4


def _md(**kw):
    from test_deepseek2 import _md as mla_md
    return mla_md("glm-dsa", **{"block_count": 10, "expert_shared_count": 1,
                                "attention.indexer.head_count": 2,
                                "attention.indexer.key_length": 64, "attention.indexer.top_k": 16,
                                "context_length": 4096, **kw})


def test_indexer_types_metadata():
    from memfit.errors import ModelError
    assert ModelConfig.from_metadata(_md()).indexer_full == (1,) * 10
    # GLM-5.2 (a 1M context) without the key: llama.cpp's default pattern
    c = ModelConfig.from_metadata(_md(context_length=1048576))
    assert c.indexer_full == (1, 1, 1, 0, 0, 0, 1, 0, 0, 0)
    c = ModelConfig.from_metadata(_md(**{"attention.indexer.types": [1, 0] * 5,
                                         "attention.layer_norm_epsilon": 1e-5}))
    assert c.indexer_full == (1, 0) * 5 and c.norm_eps == 1e-5
    with pytest.raises(ModelError, match="layer 0 is a shared"):
        ModelConfig.from_metadata(_md(**{"attention.indexer.types": [0, 1] * 5}))
    with pytest.raises(ModelError, match="indexer.types"):
        ModelConfig.from_metadata(_md(**{"attention.indexer.types": [1, 1]}))


def test_indexer_cache_in_the_kv_bytes_and_no_context_cap(tmp_path, capsys):
    from memfit.gguf import open_gguf
    from memfit.kv.storage import kv_layout
    from memfit.memory.planner import ModelDesc
    from memfit.runtime import Runtime
    path = _tiny(tmp_path, qtype="Q8_0")
    c = ModelConfig.from_metadata(open_gguf(path).metadata)
    L = kv_layout(c)
    assert (L.aux_dim, L.aux_layers, L.aux) == (64, (0, 1, 2), 192)
    # per token: K (288 values) of 3 layers + the indexer key (64) of 3 layers, f16
    assert L.bytes_per_token("f16") == 3 * 288 * 2 + 3 * 64 * 2
    assert L.bytes_per_token("f32") == 3 * 288 * 4 + 3 * 64 * 4
    desc = ModelDesc.from_gguf(open_gguf(path))
    assert desc.kv_aux == 192
    assert desc.kv_cache_bytes(100, "f16", "f16") == 100 * (3 * 288 + 192) * 2
    # memfit plan: the KV line counts (and names) the indexer keys
    from memfit.cli import main
    assert main(["plan", str(path), "--ctx-size", "512", "--no-measure", "--json"]) in (0, None)
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_aux"] == 192 and plan["kv_bytes"] == 512 * L.bytes_per_token("f16")
    m = load_model(path)
    assert m.new_cache(64).nbytes == 64 * L.bytes_per_token("f16")
    # 256 tokens > K_idx 16: no cap any more
    rt = Runtime(str(path), n_ctx=256, mem_budget="1GiB", quiet=True)
    try:
        assert rt.n_ctx == 256
        assert rt.summary()["kv_bytes"] >= 256 * L.bytes_per_token("f16")
    finally:
        rt.close()


def test_session_save_restore_carries_the_indexer_cache(tmp_path):
    # save after a prompt longer than K_idx, restore into a fresh model: the continuation
    # equals the uninterrupted one (the restored blocks' indexer keys steer the selection)
    import memfit
    path = _tiny(tmp_path, qtype="Q8_0")
    prompt = [int(i) for i in IDS[:36]] + [7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31, 33]
    greedy = dict(temperature=0)
    with memfit.load(str(path), n_ctx=160, mem_budget="1GiB") as a:
        want = a.generate(prompt, max_tokens=6, **greedy)
        a.save_state(tmp_path / "s.mfs", prompt)
    with memfit.load(str(path), n_ctx=160, mem_budget="1GiB") as b:
        ids, _ = b.load_state(tmp_path / "s.mfs")
        assert ids == prompt
        got = b.generate(prompt, max_tokens=6, **greedy)
        assert got.timings.cache_n == 32
        # the file's "V rows" are the indexer keys (64 f16 values per token and layer)
        assert b._kv_geometry()["row_bytes_v"] == 128
    assert got.ids == want.ids


def test_indexer_yarn_matches_float64(tmp_path, monkeypatch):
    # YaRN (factor 40, magnitude 1): the indexer's q and k take the model's rope, ramp and all
    import test_glm_dsa_indexer as T
    from memfit.ops.rope import yarn_corr_dims
    f, orig = 40.0, 64
    path = _tiny(tmp_path, rope_scaling="yarn", rope_freq_scale=1 / f, n_ctx_orig=orig,
                 metadata={"glm-dsa.rope.scaling.yarn_log_multiplier": 1.0})
    m = load_model(path, ops=get_ops("native"))
    m.kv_f16 = False
    lo, hi = yarn_corr_dims(CFG["R"], orig, CFG["rope_base"], 32.0, 1.0)
    assert m.config.yarn and 0 < hi < CFG["R"] // 2

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
    monkeypatch.setattr(T, "_rope_norm", rope)
    ref, kept = reference_logits(path, IDS, 16)
    m.config.attn_scale = 1 / np.sqrt(96)   # the reference's scale (yarn's mscale^2 aside)
    m.selection_log = []
    full = m.forward(IDS, m.new_cache(64), all_logits=True)
    assert rel_err(full, ref) <= 1e-4, rel_err(full, ref)
    assert any((k < vis).any() for _, k, vis in m.selection_log)


def test_storage_carries_the_indexer_rows():
    # aux rows in the full layers only, copied on write, read and written with K (sessions)
    from memfit.kv.storage import KVStorage
    st = KVStorage(3, 4, 1, 288, 256, "f16", v_in_k=True, aux_dim=64, aux_layers=(0, 2))
    assert st.aux[1] is None and st.aux[0].shape == (128, 64) and st.aux[0].dtype == np.float16
    assert st.nbytes == 128 * st.bytes_per_token == 128 * (3 * 288 * 2 + 2 * 64 * 2)
    rng = np.random.default_rng(0)
    for il in (0, 2):
        st.aux[il][:32] = rng.standard_normal((32, 64))
    st.k[0][:32] = rng.standard_normal((32, 1, 288))
    st.copy_rows(0, 1, 20)
    assert (st.aux[2][32:52] == st.aux[2][:20]).all() and not st.aux[2][52:64].any()
    assert (st.k[0][32:52] == st.k[0][:20]).all()
    k, v = st.read_blocks([0])
    assert v[0].shape == (32, 1, 128) and not v[1].any()
    st.write_block(3, k, v)
    for il in (0, 2):
        assert (st.aux[il][96:] == st.aux[il][:32]).all()
    assert (st.k[0][96:] == st.k[0][:32]).all()
    assert KVStorage(3, 4, 1, 288, 256, "f32", v_in_k=True, aux_dim=64,
                     aux_layers=(0,)).aux[0].dtype == np.float32
