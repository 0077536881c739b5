"""The fused MoE decode layer for experts the store streams (csrc/decode.c decode_batch_route +
decode_batch_experts, models/layers.py Model._streamed_moe): under a budget whose expert cache
holds only part of the experts, decode gives the same bits as the op-by-op path
(MEMFIT_FUSED_MOE=0) and as the resident run (experts in place), on every ISA, for 1 and 4
sequences at once; the store really streamed (misses, reads) and the streamed layers really ran
fused; the expert cache sees the same requests, hits and prefetches either way (look-ahead on);
a batch whose experts outnumber the cache's slots runs that layer op by op, same bits; a wrong
call is one clear Python error."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from conftest import isa_paths
from memfit import _native
from memfit.gguf import open_gguf
from memfit.memory.bandwidth import Bandwidth
from memfit.memory.ledger import Ledger
from memfit.memory.planner import ModelDesc, plan
from memfit.memory.store import WeightStore
from memfit.models import load_model
from memfit.models.layers import StreamedMoeLayer
from memfit.ops import get_ops
from memfit.tokenizer import Tokenizer

from test_moe_fused import _generate

# one with a gated shared expert (qwen2moe), one with an ungated one, sigmoid routing and a
# dense leading layer (glm4moe), full Q/K norm (olmoe)
ARCHS = ["qwen3moe", "qwen2moe", "glm4moe", "olmoe"]
N_SEQS = (1, 4)
X, K = 16, 2
# what the expert cache is asked and predicted (hits against prefetch hits, and so misses,
# depend on when the background reads finish: not compared)
EXPERT_CALLS = ("expert_requests", "prefetch_routed", "prefetch_routed_predicted")


def _write(tmp_path, arch, seed=5):
    from memfit.models.synthetic import write_tiny_model
    n_layer = 4 if arch == "glm4moe" else 3   # glm4moe: dense layer 0, NextN layer last
    return write_tiny_model(tmp_path / f"{arch}.gguf", arch, "Q4_K", seed=seed, n_expert=X,
                            n_expert_used=K, n_layer=n_layer)


def _plan(f, slots: int | None):
    """A plan whose expert cache has at least `slots` slots (None: the floor's) but does not
    hold every expert."""
    desc = ModelDesc.from_gguf(f)
    bw = Bandwidth(10e9, 1e9, "test")
    kw = dict(baseline_bytes=0, n_batch=64, n_parallel=max(N_SEQS))
    floor = plan(desc, 1 << 40, 64, 2, bw, **kw).min_budget_bytes
    budget = floor
    for _ in range(64):
        p = plan(desc, budget, 64, 2, bw, **kw)
        assert 0 < p.cache_slots < p.n_expert * p.n_layer_moe and not p.hot_experts
        if slots is None or p.cache_slots >= slots:
            return p
        budget += p.cache_slot_bytes
    raise AssertionError(f"no budget gives {slots} expert slots")


def _tok(f):
    tok = Tokenizer.from_metadata(f.metadata)
    tok.eog_ids = set()
    return tok


def _resident(path):
    f = open_gguf(path)
    model = load_model(f, ops=get_ops("native"))
    layers = model._decode_layers()
    assert layers and not any(isinstance(layer, StreamedMoeLayer) for layer in layers)
    return {n: _generate(model, _tok(f), n) for n in N_SEQS}


def _budgeted(path, p, fused: bool, monkeypatch):
    """Decode under plan p -> (per n: per sequence (tokens, logits bits), store stats, model)."""
    if fused:
        monkeypatch.delenv("MEMFIT_FUSED_MOE", raising=False)
    else:
        monkeypatch.setenv("MEMFIT_FUSED_MOE", "0")
    f = open_gguf(path)
    store = WeightStore(f, p, Ledger(None, debug=""))
    try:
        model = load_model(f, weights=store, ops=get_ops("native"))
        layers = model._decode_layers()
        if fused:
            assert any(isinstance(layer, StreamedMoeLayer) for layer in layers), layers
        else:
            assert layers is None
        got = {n: _generate(model, _tok(f), n) for n in N_SEQS}
        return got, store.stats(), model
    finally:
        store.close()
        f.close()


@contextlib.contextmanager
def _streamed_layer(tmp_path, arch, seed, monkeypatch):
    """(store, model, il, the StreamedMoeLayer of il): a tiny model under a plan that streams
    its experts (an 8-slot cache), il its first streamed MoE layer."""
    monkeypatch.delenv("MEMFIT_FUSED_MOE", raising=False)
    f = open_gguf(_write(tmp_path, arch, seed=seed))
    store = WeightStore(f, _plan(f, 8), Ledger(None, debug=""))
    try:
        model = load_model(f, weights=store, ops=get_ops("native"))
        layers = model._decode_layers()
        il = next(i for i, layer in enumerate(layers) if isinstance(layer, StreamedMoeLayer))
        yield store, model, il, layers[il]
    finally:
        store.close()
        f.close()


def _same(a, b, what):
    for n in N_SEQS:
        for i, (x, y) in enumerate(zip(a[n], b[n])):
            assert x[0] == y[0], f"{what}, {n} sequences, #{i}: tokens {x[0]} != {y[0]}"
            assert np.array_equal(x[1], y[1]), f"{what}, {n} sequences, #{i}: logits differ"


@pytest.mark.parametrize("lookahead", ["1", "0"])
@pytest.mark.parametrize("isa", isa_paths())
@pytest.mark.parametrize("arch", ARCHS)
def test_streamed_fused_equals_op_by_op_and_resident(tmp_path, arch, isa, lookahead, monkeypatch):
    path = _write(tmp_path, arch)
    f = open_gguf(path)
    p = _plan(f, K * max(N_SEQS))   # a 4-row batch's experts fit in the cache at once
    f.close()
    # the look-ahead always on (prefetches happen, and both paths make the same ones; the
    # fused layer runs in two calls around the store) or off (one call where every expert
    # is at hand in the store's table, decode_batch_moe)
    monkeypatch.setenv("MEMFIT_EXPERT_LOOKAHEAD", lookahead)
    old = _native.isa()
    _native.set_isa(isa)
    try:
        ref = _resident(path)
        fused, st_f, m_f = _budgeted(path, p, True, monkeypatch)
        ops, st_o, m_o = _budgeted(path, p, False, monkeypatch)
    finally:
        _native.set_isa(old)
    _same(fused, ref, "streamed fused vs resident")
    _same(ops, ref, "op by op (MEMFIT_FUSED_MOE=0) vs resident")
    # the experts were streamed, and the streamed layers ran fused (never op by op)
    assert st_f["expert_misses"] > 0 and st_f["expert_reads"] > 0 and st_f["expert_hit_rate"] < 1
    ms = m_f.moe_stream_stats
    assert ms["fused"] > 0 and ms["op_by_op"] == 0
    assert not any(m_o.moe_stream_stats.values())
    # layers with misses ran the experts at hand while the misses loaded (in two pieces)
    assert ms["overlapped"] > 0
    if lookahead == "1":
        assert ms["one_call"] == 0
        # the same look-ahead predictions either way
        assert st_f["prefetched_experts"] > 0 and st_f["prefetch_routed"] > 0
    else:
        # both forms ran: layers whose experts were all at hand, layers that read some
        assert 0 < ms["one_call"] < ms["fused"]
        assert st_f["prefetched_experts"] == 0
    # the expert cache saw the same calls either way (one-call layers are counted as hits)
    assert {k: st_f[k] for k in EXPERT_CALLS} == {k: st_o[k] for k in EXPERT_CALLS}
    assert st_f["expert_requests"] == st_f["expert_hits"] + st_f["expert_misses"] \
        + st_f["expert_prefetch_hits"] + st_f.get("expert_hot_hits", 0)


def test_batch_beyond_the_cache_runs_that_layer_op_by_op(tmp_path, monkeypatch):
    # at the floor the cache holds one token's k experts: a 4-sequence batch's union is
    # larger at some layers (those run op by op, asking in groups), a 1-sequence one never
    path = _write(tmp_path, "qwen2moe", seed=9)
    f = open_gguf(path)
    p = _plan(f, None)
    f.close()
    assert p.cache_slots == K
    ref = _resident(path)
    got, st, model = _budgeted(path, p, True, monkeypatch)
    _same(got, ref, "streamed at the floor vs resident")
    assert model.moe_stream_stats["op_by_op"] > 0 and model.moe_stream_stats["fused"] > 0
    assert st["expert_misses"] > 0


def test_streamed_calls_reject_bad_arguments(tmp_path, monkeypatch):
    monkeypatch.delenv("MEMFIT_FUSED_MOE", raising=False)
    path = _write(tmp_path, "qwen2moe", seed=3)
    f = open_gguf(path)
    store = WeightStore(f, _plan(f, 8), Ledger(None, debug=""))
    try:
        model = load_model(f, weights=store, ops=get_ops("native"))
        layers = model._decode_layers()
        il = next(i for i, layer in enumerate(layers) if isinstance(layer, StreamedMoeLayer))
        fl, w, E = layers[il], store, model.config.n_embd
        assert len(fl.route) == 5 and len(fl.experts) == 4   # attention + router; router + shared
        cache = model.new_cache(4)
        kv = (np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32),
              np.zeros(1, np.int32), 4, 1, cache.pool.k[il][:4], cache.pool.v[il][:4])
        x = (np.random.default_rng(0).standard_normal((1, E)) * 0.5).astype(np.float32)
        x_in = x.copy()
        sel, h, lg = np.empty((1, K), np.int64), np.empty((1, E), np.float32), np.empty((1, X), np.float32)
        route_w = [w.get(n).data for n in fl.route]
        _native.decode_batch_route(fl.layer, x, *kv, sel, h, lg, *route_w)
        assert not np.array_equal(x, x_in)          # the attention's residual was added
        # the routing out is the op-by-op one of the FFN-normed rows
        model._decode = True      # decode kernels, as in a decode forward
        model._rows_seq, model._rows_pos = np.zeros(1, np.int32), np.zeros(1, np.int32)
        h_ref = model.norm(x, f"blk.{il}.ffn_norm.weight")
        assert np.array_equal(h, h_ref)
        assert np.array_equal(lg, model.router_logits(il, h_ref))
        assert np.array_equal(sel, model.route(il, h_ref)[0])
        # h and logits may be left out
        sel2 = np.empty_like(sel)
        _native.decode_batch_route(fl.layer, x_in.copy(), *kv, sel2, None, None, *route_w)
        assert np.array_equal(sel, sel2)

        experts = np.unique(sel)
        mats = [q.data for m in w.get_experts(il, experts.tolist()) for q in m]
        dense = [w.get(n).data for n in fl.experts]
        x0 = x.copy()
        bad = [
            ((experts[:1], mats[:3]), ValueError, "not given"),
            ((experts, mats[:2] + [mats[2][:-1]] + mats[3:]), ValueError, "one expert's bytes"),
            ((experts, mats[:-1]), ValueError, "3 buffers"),
            ((np.concatenate([experts[:1], experts[:1]]), mats[:3] * 2), ValueError, "twice"),
            ((np.array([X]), mats[:3]), ValueError, "outside the layer's experts"),
            ((experts.astype(np.int32), mats), TypeError, "int64"),
            ((experts, [None] * len(mats)), TypeError, None),
        ]
        for (ex, ms), err, msg in bad:
            with pytest.raises(err, match=msg):
                _native.decode_batch_experts(fl.layer, x, ex, ms, *dense)
            assert np.array_equal(x, x0), msg        # a refused call writes nothing
        with pytest.raises(TypeError, match="decode_batch_experts"):
            _native.decode_batch_experts(fl.layer, x, experts, mats, *dense[:1])
        with pytest.raises(ValueError, match="smaller than"):
            _native.decode_batch_experts(fl.layer, x, experts, mats, dense[0][:-1], *dense[1:])
        with pytest.raises(ValueError, match="sel, h and logits"):
            _native.decode_batch_route(fl.layer, x_in.copy(), *kv, np.empty((1, K + 1), np.int64), h, lg,
                                       *route_w)
        with pytest.raises(TypeError, match="sel must be int64"):
            _native.decode_batch_route(fl.layer, x_in.copy(), *kv, sel.astype(np.int32), h, lg, *route_w)
        with pytest.raises(TypeError, match="decode_batch_route"):
            _native.decode_batch_route(fl.layer, x_in.copy(), *kv, sel, h, lg, *route_w[:4])
        # a dense layer has no routing
        dense_layer = next((layer for layer in layers if isinstance(layer, tuple)), None)
        if dense_layer is not None:
            with pytest.raises(TypeError, match="MoE layer"):
                _native.decode_batch_route(dense_layer[0], x_in.copy(), *kv, sel, h, lg, *route_w)
        # well formed: runs, and x gets the experts' sum
        _native.decode_batch_experts(fl.layer, x, experts, mats, *dense)
        assert np.isfinite(x).all() and not np.array_equal(x, x0)
        # the op-by-op MoE half of the same residual: the same bits
        assert np.array_equal(x, model._moe_half(il, x0))
    finally:
        store.close()
        f.close()


def test_table_calls_equal_the_two_calls_and_reject_bad_tables(tmp_path, monkeypatch):
    # decode_batch_moe / decode_batch_experts_at read the experts through the store's table
    # (expert_table: one buffer, each expert's offsets or -1)
    with _streamed_layer(tmp_path, "qwen2moe", 4, monkeypatch) as (store, model, il, fl):
        w, E = store, model.config.n_embd
        xbuf, xoff = store.expert_table
        xo = xoff[il]
        assert xo.shape == (X, 3) and (xo == -1).all()      # nothing read yet, no hot set
        cache = model.new_cache(4)
        kv = (np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32),
              np.zeros(1, np.int32), 4, 1, cache.pool.k[il][:4], cache.pool.v[il][:4])
        x_in = (np.random.default_rng(1).standard_normal((1, E)) * 0.5).astype(np.float32)
        route_w = [w.get(n).data for n in fl.route]
        dense = [w.get(n).data for n in fl.experts]
        both = [w.get(n).data for n in fl.both]
        x1, sel = x_in.copy(), np.empty((1, K), np.int64)
        _native.decode_batch_route(fl.layer, x1, *kv, sel, None, None, *route_w)
        experts = np.unique(sel)
        # a chosen expert is not at hand: routed only (the route call's x and selection)
        x2, sel2 = x_in.copy(), np.empty_like(sel)
        assert _native.decode_batch_moe(fl.layer, x2, *kv, sel2, None, None, xbuf, xo, *both) is False
        assert np.array_equal(x2, x1) and np.array_equal(sel2, sel)
        with pytest.raises(ValueError, match="not given"):
            _native.decode_batch_experts_at(fl.layer, x2, xbuf, xo, *dense)
        assert np.array_equal(x2, x1)
        # the store puts them there; then both forms give the op-by-op MoE half's bits
        assert store.get_experts(il, experts.tolist(), views=False) is None
        assert (xo[experts] >= 0).all() and (np.delete(xo, experts, 0) == -1).all()
        model._decode = True      # decode kernels, as in a decode forward
        model._rows_seq, model._rows_pos = np.zeros(1, np.int32), np.zeros(1, np.int32)
        want = model._moe_half(il, x1.copy())
        _native.decode_batch_experts_at(fl.layer, x2, xbuf, xo, *dense)
        assert np.array_equal(x2, want)
        x3 = x_in.copy()
        assert _native.decode_batch_moe(fl.layer, x3, *kv, sel2, None, None, xbuf, xo, *both) is True
        assert np.array_equal(x3, want) and np.array_equal(sel2, sel)
        # and the views the store gives are the bytes the table points at
        for e, mats in zip(experts.tolist(), store.get_experts(il, experts.tolist())):
            for j, q in enumerate(mats):
                assert np.shares_memory(q.data, xbuf)
                assert q.data.ctypes.data == xbuf.ctypes.data + int(xo[e, j])
        bad = xo.copy()
        bad[experts[0], 1] = len(xbuf)
        far = xo.copy()
        far[experts[0]] = [-1, 0, 0]
        cases = [(xo.astype(np.int32), TypeError, "int64"),
                 (xo[:, :2].copy(), ValueError, r"\[n_expert, 3\]"),
                 (bad, ValueError, "outside xbuf"),
                 (far, ValueError, "outside xbuf")]
        for t, err, msg in cases:
            x4 = x1.copy()
            with pytest.raises(err, match=msg):
                _native.decode_batch_experts_at(fl.layer, x4, xbuf, t, *dense)
            with pytest.raises(err, match=msg):
                _native.decode_batch_moe(fl.layer, x4, *kv, sel2, None, None, xbuf, t, *both)
            assert np.array_equal(x4, x1), msg       # a refused call writes nothing
        with pytest.raises(TypeError, match="decode_batch_moe"):
            _native.decode_batch_moe(fl.layer, x_in.copy(), *kv, sel2, None, None, xbuf, xo, *route_w)
        with pytest.raises(TypeError, match="decode_batch_experts_at"):
            _native.decode_batch_experts_at(fl.layer, x2, xbuf, xo, *dense[:1])
        # the route call's h and logits passed on: the experts call takes them instead of
        # routing again (the same bits), and uses them (other logits, other experts' sum)
        h = np.empty((1, E), np.float32)
        lg = np.empty((1, X), np.float32)
        x5 = x_in.copy()
        _native.decode_batch_route(fl.layer, x5, *kv, sel2, h, lg, *route_w)
        _native.decode_batch_experts_at(fl.layer, x5, xbuf, xo, *dense, h, lg)
        assert np.array_equal(x5, want)
        x6, lg2 = x1.copy(), lg.copy()
        lg2[0, experts] += 0.5    # the same experts stay chosen; their weights move
        _native.decode_batch_experts_at(fl.layer, x6, xbuf, xo, *dense, h, lg2)
        assert not np.array_equal(x6, want)
        for hh, ll, msg in ((h[:, :-1].copy(), lg, r"h must be \[n, n_embd\]"),
                            (h, lg[:, :-1].copy(), r"logits must be \[n, n_expert\]"),
                            (h.astype(np.float64), lg, "float32")):
            x7 = x1.copy()
            with pytest.raises((ValueError, TypeError), match=msg):
                _native.decode_batch_experts_at(fl.layer, x7, xbuf, xo, *dense, hh, ll)
            assert np.array_equal(x7, x1), msg
        with pytest.raises(TypeError, match="decode_batch_experts_at"):
            _native.decode_batch_experts_at(fl.layer, x1.copy(), xbuf, xo, *dense, h)


def test_route_ahead_keeps_and_predicts_as_router_lookahead(tmp_path, monkeypatch):
    # decode_batch_route_ahead's observe/predict on RouterLookahead's arrays: the same state
    # and the same experts as models/lookahead.py computes, row by row, over a few positions
    from memfit.models.lookahead import RouterLookahead
    with _streamed_layer(tmp_path, "qwen3moe", 6, monkeypatch) as (store, model, il, fl):
        assert il + 1 < model.config.n_layer and model.config.is_moe(il + 1)
        w, E = store, model.config.n_embd
        route_w = [w.get(n).data for n in fl.route]
        nq = w.get(f"blk.{il + 1}.ffn_gate_inp.weight")
        c = model.config
        la_c, la_py = RouterLookahead(c.n_layer, X), RouterLookahead(c.n_layer, X)
        model._decode = True
        rng = np.random.default_rng(2)
        n, pool = 2, model.new_cache(8)
        delta_rows = 0
        for p in range(4):
            seq, pos = np.array([0, 1], np.int32), np.full(n, p, np.int32)
            la_c.ensure(seq)
            kv = (pos, (seq * 4 + p).astype(np.int32), seq.copy(), np.arange(2, dtype=np.int32),
                  4, 1, pool.pool.k[il][:8], pool.pool.v[il][:8])
            x = (rng.standard_normal((n, E)) * 0.5).astype(np.float32)
            sel, h, lg = np.empty((n, K), np.int64), np.empty((n, E), np.float32), np.empty((n, X), np.float32)
            pred = np.empty((n, K), np.int64)
            _native.decode_batch_route_ahead(fl.layer, x, *kv, sel, h, lg, seq, la_c.real, la_c.real_pos,
                                             la_c.look, la_c.look_pos, il, nq.data, nq.type.id, None, pred,
                                             *route_w)
            # the same by models/lookahead.py (Model._predict_experts' steps)
            la_py.observe(il, lg, seq, pos)
            delta_rows += int(((la_py.real_pos[il + 1, seq] == p - 1)
                               & (la_py.look_pos[il + 1, seq] == p - 1)).sum())
            score = la_py.predict(il + 1, model.router_logits(il + 1, h), seq, pos)
            want = np.argsort(-score, axis=1, kind="stable")[:, :K]
            assert np.array_equal(pred, want), p
            for a in ("real", "look", "real_pos", "look_pos"):
                assert np.array_equal(getattr(la_c, a), getattr(la_py, a)), (a, p)
            # the next step's layer il + 1 real logits (as that layer's own route would keep)
            nxt = (rng.standard_normal((n, X))).astype(np.float32)
            la_c.observe(il + 1, nxt, seq, pos)
            la_py.observe(il + 1, nxt, seq, pos)
        assert delta_rows > 0   # the delta form was taken, not only the plain look-ahead
        # wrong state shapes, slots, layers and types are one clear error
        seq = np.array([0, 1], np.int32)
        kv = (np.zeros(n, np.int32), np.array([0, 4], np.int32), seq.copy(), np.arange(2, dtype=np.int32),
              4, 1, pool.pool.k[il][:8], pool.pool.v[il][:8])
        x = np.zeros((n, E), np.float32)
        sel, h, lg, pred = (np.empty((n, K), np.int64), np.empty((n, E), np.float32),
                            np.empty((n, X), np.float32), np.empty((n, K), np.int64))
        la = la_c
        base = [seq, la.real, la.real_pos, la.look, la.look_pos, il, nq.data, nq.type.id, None, pred]
        cases = [({0: np.array([0, 9], np.int32)}, "sequence slot"),
                 ({1: la.real[:, :, :2].copy()}, "real, look must be"),
                 ({5: c.n_layer}, "il is outside"),
                 ({5: c.n_layer - 1}, "no layer after il"),
                 ({7: 99}, "next_type"),
                 ({6: nq.data[:-1]}, "smaller than"),
                 ({9: pred[:, :1].copy()}, "pred must be")]
        for change, msg in cases:
            args = list(base)
            for i, v in change.items():
                args[i] = v
            with pytest.raises(ValueError, match=msg):
                _native.decode_batch_route_ahead(fl.layer, x.copy(), *kv, sel, h, lg, *args, *route_w)
        with pytest.raises(ValueError, match="needs h and logits"):
            _native.decode_batch_route_ahead(fl.layer, x.copy(), *kv, sel, None, lg, *base, *route_w)
        with pytest.raises(TypeError, match="decode_batch_route_ahead"):
            _native.decode_batch_route_ahead(fl.layer, x.copy(), *kv, sel, h, lg, *base[:-1], *route_w)


@pytest.mark.parametrize("name", ["MEMFIT_EXPERT_TABLE", "MEMFIT_EXPERT_OVERLAP"])
def test_switch_with_a_bad_value_fails_the_load(tmp_path, monkeypatch, name):
    from memfit.errors import RequestError
    monkeypatch.setenv(name, "yes")
    f = open_gguf(_write(tmp_path, "qwen3moe", seed=7))
    try:
        with pytest.raises(RequestError, match=f"{name}='yes' is not 0 or 1"):
            load_model(f, ops=get_ops("native"))
    finally:
        f.close()


def test_profile_times_the_streamed_layer_and_keeps_its_results(tmp_path, monkeypatch):
    """`bench --profile` wraps the fused calls to time them: the streamed MoE layer's calls
    (decode_batch_moe's answer decides whether the experts still run) must give the same
    logits as an unprofiled decode, count as fused layers, and the store's read waits are
    their own part of the token."""
    from memfit.bench.profile import profile_decode
    monkeypatch.setenv("MEMFIT_EXPERT_LOOKAHEAD", "0")
    with _streamed_layer(tmp_path, "qwen3moe", 5, monkeypatch) as (store, model, il, layer):
        ids = [5, 9, 3, 17, 4, 8, 11, 2, 6, 13]
        cache = model.new_cache(16)
        want = [np.array(model.forward([t], cache), copy=True) for t in ids]
        p = profile_decode(model, n_gen=4, n_prompt=3, probe_gb_per_s=10.0)
        assert p["fused_layers"] and p["layer_rest_ms"] > 0 and p["io_stall_ms"] >= 0
        parts = p["layer_matvec_ms"] + p["layer_rest_ms"] + p["output_ms"] + p["io_stall_ms"] + p["other_ms"]
        assert parts == pytest.approx(p["ms_per_token"], rel=1e-9)
        assert model.moe_stream_stats["one_call"] > 0   # decode_batch_moe ran (and was timed)
        cache = model.new_cache(16)
        got = [np.array(model.forward([t], cache), copy=True) for t in ids]
    for i, (a, b) in enumerate(zip(want, got)):
        assert np.array_equal(a, b), f"token {i}: the profiled model's logits changed"
