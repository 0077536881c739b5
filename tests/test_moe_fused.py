"""The fused MoE decode layer (csrc/decode.c moe_layer_new) against the op-by-op block it
replaces: the same bits for every MoE architecture it covers (softmax top-k with and without
renormalization, sigmoid + exp_probs_b + scale, the gated and the ungated shared expert, full
Q/K norm, a leading dense layer; gpt-oss's YaRN, attention sinks, sliding layers, expert
biases, softmax over the chosen and clamped SwiGLU, with MXFP4 experts), on every ISA, for 1..8 sequences decoding together (the
batch's expert union), with tied router scores, and under a budget that streams experts (those
layers run fused in two calls around the store). Bad arguments are one clear error."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import isa_paths
from memfit import _native
from memfit.engine.engine import Engine
from memfit.engine.sampler import SamplingParams
from memfit.gguf import open_gguf
from memfit.models import load_model
from memfit.models.synthetic import write_tiny_model
from memfit.ops import get_ops
from memfit.tokenizer import Tokenizer

ARCHS = ["qwen3moe", "qwen2moe", "olmoe", "mixtral", "glm4moe", "gpt-oss"]
PROMPTS = [[5, 17, 200], [101], [3, 9, 27, 81, 243], [64, 64, 128, 7], [255, 1], [42] * 6,
           [11, 22, 33, 44, 55, 66, 77], [200, 100]]
N_GEN = 6


def _model(path):
    f = open_gguf(path)
    tok = Tokenizer.from_metadata(f.metadata)
    tok.eog_ids = set()
    return load_model(f, ops=get_ops("native")), tok


def _generate(model, tok, n_seq, kv="f16"):
    """n_seq prompts decoding together on one engine -> per sequence (tokens, logits bits)."""
    eng = Engine(model, tok, n_ctx=64, n_parallel=n_seq, n_batch=64, cache_type=kv, cache_type_v=kv)
    logits, toks = {}, {}
    sample = eng._sample

    def keep(s, lg):
        logits.setdefault(s.request_id, []).append(lg.copy())
        return sample(s, lg)
    eng._sample = keep
    rids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=N_GEN)) for p in PROMPTS[:n_seq]]
    while eng.has_unfinished():
        for o in eng.step():
            if o.token is not None:
                toks.setdefault(o.request_id, []).append(o.token)
    return [(toks[r], np.stack(logits[r]).view(np.uint32)) for r in rids]


class _Count:
    """Counts the backend's decode_batch calls with a MoE layer (monkeypatched in)."""

    def __init__(self, ops, monkeypatch):
        self.moe = 0
        inner = ops.decode_batch
        moe_layers = set()

        def counted(layer, *a):
            self.moe += id(layer) in moe_layers
            return inner(layer, *a)
        monkeypatch.setattr(ops, "decode_batch", counted)
        orig = ops.moe_layer

        def made(p):
            r = orig(p)
            moe_layers.add(id(r[0]))
            return r
        monkeypatch.setattr(ops, "moe_layer", made)


def _fused_vs_blocks(path, n_seqs, monkeypatch, kv="f16", fused_runs=True):
    model, tok = _model(path)
    count = _Count(model.ops, monkeypatch)
    model._fused = None
    fused = {n: _generate(model, tok, n, kv) for n in n_seqs}
    assert (count.moe > 0) == fused_runs, count.moe
    model._fused = []          # every layer op by op (block())
    calls = count.moe
    blocks = {n: _generate(model, tok, n, kv) for n in n_seqs}
    assert count.moe == calls
    for n in n_seqs:
        for i, (a, b) in enumerate(zip(fused[n], blocks[n])):
            assert a[0] == b[0], f"{n} sequences, #{i}: tokens {a[0]} != {b[0]}"
            assert np.array_equal(a[1], b[1]), f"{n} sequences, #{i}: logits differ"
    # a sequence's bits do not depend on how many decode with it
    for n in n_seqs:
        for i in range(n):
            assert np.array_equal(fused[n][i][1], fused[max(n_seqs)][i][1][:len(fused[n][i][1])])
    return fused


@pytest.mark.parametrize("isa", isa_paths())
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_moe_layer_equals_blocks(tmp_path, arch, isa, monkeypatch):
    # gpt-oss: MXFP4 experts, as its files ship
    mx = {f"blk.{i}.ffn_{m}_exps.weight": "MXFP4" for i in range(16) for m in ("gate", "up", "down")}
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, "Q4_K", seed=7,
                            **({"types": mx} if arch == "gpt-oss" else {}))
    old = _native.isa()
    _native.set_isa(isa)
    try:
        _fused_vs_blocks(path, (1, 2, 3, 5, 7, 8), monkeypatch)
    finally:
        _native.set_isa(old)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K", "IQ4_XS", "F16"])
def test_fused_moe_layer_types_and_q8_cache(tmp_path, qtype, monkeypatch):
    # other weight types; a q8_0 KV cache is not fusable (it rotates q/k/v): op by op, same bits
    path = write_tiny_model(tmp_path / "m.gguf", "qwen2moe", qtype, seed=11)
    _fused_vs_blocks(path, (1, 3), monkeypatch)
    _fused_vs_blocks(path, (1, 3), monkeypatch, kv="q8_0", fused_runs=False)


def test_fused_moe_layer_ties_and_routing_variants(tmp_path, monkeypatch):
    # tied router rows (equal probabilities: the lower expert wins, as numpy's stable argsort);
    # sigmoid gating with exp_probs_b, renormalized and scaled; gelu is not a MoE option of the
    # synthetic families, softmax without renormalization is olmoe/qwen2moe's (above)
    rng = np.random.default_rng(0)
    arrays = {}
    for il in (1, 2):
        r = rng.standard_normal((8, 256)).astype(np.float32) * 0.05
        r[5] = r[2]
        r[6] = r[2]
        r[3] = r[1]
        arrays[f"blk.{il}.ffn_gate_inp.weight"] = r
        arrays[f"blk.{il}.exp_probs_b.bias"] = np.array([0, .1, 0, .1, 0, 0, 0, .3], np.float32)
    path = write_tiny_model(tmp_path / "g.gguf", "glm4moe", "Q4_K", seed=2, arrays=arrays,
                            n_expert_used=3)
    model, _ = _model(path)
    # the routes really tie: experts 2, 5, 6 score the same on any input
    x = rng.standard_normal((4, 256)).astype(np.float32)
    lg = model.router_logits(1, x)
    assert np.array_equal(lg[:, 2], lg[:, 5]) and np.array_equal(lg[:, 2], lg[:, 6])
    _fused_vs_blocks(path, (1, 4, 7), monkeypatch)


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_fused_moe_layer_under_a_budget(tmp_path, monkeypatch, arch):
    # experts streamed through the store's cache: those layers run fused in two calls around
    # get_experts (StreamedMoeLayer; tests/test_moe_stream_fused.py); everything pinned: fused
    # in place; both the bits of the mapped file (gpt-oss: the streamed experts' biases are
    # found by expert id)
    from memfit.models.layers import StreamedMoeLayer
    from memfit.memory.bandwidth import Bandwidth
    from memfit.memory.ledger import Ledger
    from memfit.memory.planner import ModelDesc, plan
    from memfit.memory.store import WeightStore

    mx = {f"blk.{i}.ffn_{m}_exps.weight": "MXFP4" for i in range(3) for m in ("gate", "up", "down")}
    path = write_tiny_model(tmp_path / "m.gguf", arch, "Q4_0", seed=3, n_layer=3,
                            **({"types": mx} if arch == "gpt-oss" else {}))
    ref = _fused_vs_blocks(path, (1, 3), monkeypatch)
    f = open_gguf(path)
    desc = ModelDesc.from_gguf(f)
    bw = Bandwidth(10e9, 1e9, "test")
    floor = plan(desc, 1 << 40, 64, 3, bw, baseline_bytes=0, n_batch=64).min_budget_bytes
    for budget, in_place in ((floor, False), (1 << 40, True)):
        p = plan(desc, budget, 64, 3, bw, baseline_bytes=0, n_batch=64)
        store = WeightStore(f, p, Ledger(None, debug=""))
        try:
            model = load_model(f, weights=store, ops=get_ops("native"))
            tok = Tokenizer.from_metadata(f.metadata)
            tok.eog_ids = set()
            layers = model._decode_layers()
            assert layers is not None and all(layers), layers
            assert all(isinstance(f, StreamedMoeLayer) != in_place for f in layers), layers
            got = _generate(model, tok, 3)
            for a, b in zip(got, ref[3]):
                assert a[0] == b[0] and np.array_equal(a[1], b[1])
        finally:
            store.close()
    f.close()


def test_moe_layer_rejects_bad_arguments(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "qwen2moe", "Q4_0")
    model, _ = _model(path)
    layers = model._decode_layers()
    layer, names = layers[0]
    assert len(names) == 11          # attention 4, router, 3 experts, 3 shared
    w = [model.weights.get(n).data for n in names]
    cache = model.new_cache(4)
    kv = (np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32),
          np.zeros(1, np.int32), 4, 1, cache.pool.k[0][:4], cache.pool.v[0][:4])
    x = np.zeros((1, model.config.n_embd), np.float32)
    _native.decode_batch(layer, x, *kv, *w)   # well formed: runs
    assert np.isfinite(x).all()
    with pytest.raises(TypeError, match="11 weights"):
        _native.decode_batch(layer, x, *kv, *w[:8])
    with pytest.raises(ValueError, match="smaller than"):
        _native.decode_batch(layer, x, *kv, *w[:5], w[5][:-1], *w[6:])
    with pytest.raises(TypeError, match="decode_batch"):
        _native.decode_layer(layer, x[0], 0, cache.pool.k[0], cache.pool.v[0], True, *w[:7])
    fields = _native.moe_layer_fields()
    ints = dict.fromkeys(fields[0], 1) | dict(n_embd=256, n_head=4, n_head_kv=2, head_dim_k=64,
                                               head_dim_v=64, n_rot=64, window=0, n_expert=8,
                                               n_expert_used=9, n_ff_exp=256, n_ff_shexp=0,
                                               shexp_gated=0, qk_norm_full=0, swiglu_oai=0,
                                               softmax_weight=0)
    iv = tuple(ints[k] for k in fields[0]) + (2,) * 8 + (-1,) * 3
    vecs = (np.ones(256, np.float32),) + (None,) * 3 + (np.ones(256, np.float32),) + (None,) * 13
    FLOATS = (1e4, 1.0, 1e-6, 0.125, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="inconsistent"):
        _native.moe_layer_new(iv, FLOATS, vecs)
    ints["n_expert_used"] = 2
    iv = tuple(ints[k] for k in fields[0]) + (2,) * 8 + (-1,) * 3
    _native.moe_layer_new(iv, FLOATS, vecs)
    with pytest.raises(ValueError, match="ffn_norm is required"):
        _native.moe_layer_new(iv, FLOATS, vecs[:4] + (None,) * 14)
    with pytest.raises(ValueError, match="router_bias has 7 values"):
        _native.moe_layer_new(iv, FLOATS,
                              vecs[:11] + (np.ones(7, np.float32),) + (None,) * 6)
