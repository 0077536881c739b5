"""Sliding-window layers' KV bounded by the window (kv/manager.py WindowBlocks): gpt-oss and
gemma3 keep only their window layers' last blocks in a group of their own, and every result is
the bits of the old layout (those layers holding the whole context, masked to the window):
prompts several windows long, at once / chunked / token by token, batched with neighbours,
speculative rollbacks, preemption, prefix-cache hits (and a hit whose window blocks are gone),
saved sessions; the group's blocks in use stay bounded; the plan counts window-bounded bytes."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import isa_paths

import memfit
from memfit.engine.engine import Engine
from memfit.engine.sampler import SamplingParams
from memfit.kv import BLOCK_SIZE as BS
from memfit.kv.manager import BlockManager, SeqBlocks, WindowBlocks, window_span
from memfit.kv.seq import SeqKV
from memfit.kv.storage import kv_layout, kv_pool_blocks, kv_swa_pool_blocks
from memfit.models import load_model
from memfit.models.synthetic import write_tiny_model
from memfit.ops import get_ops
from memfit.tokenizer import Tokenizer

ARCHS = ["gpt-oss", "gemma3"]
WINDOW = {"gpt-oss": 12, "gemma3": 16}


def _file(tmp_path, arch, quant="Q8_0", window=None, **kw):
    return write_tiny_model(tmp_path / f"{arch}-{quant}.gguf", arch, quant, seed=41,
                            sliding_window=window or WINDOW[arch], n_ctx=2048, **kw)


def _tiny(tmp_path, arch, quant="Q8_0", backend="native"):
    from memfit.gguf import open_gguf
    f = open_gguf(_file(tmp_path, arch, quant))
    tok = Tokenizer.from_metadata(f.metadata)
    tok.eog_ids = set()
    return load_model(f, ops=get_ops(backend)), tok


def _prompt(n, seed):
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(3, 250, size=n)]


def _at_rest_bound(w):
    # blocks a sequence holds between steps: those its next query's window reads
    return window_span(max(w - 1, 1), BS)


def _run(model, tok, prompts, window_kv, n=40, add_at=None, check=None, setup=None, **kw):
    """(per prompt [(token, logprob, top)], engine, the window group's peak use)."""
    eng = Engine(model, tok, window_kv=window_kv, **{"n_ctx": 512, "n_parallel": 3, **kw})
    if setup is not None:
        setup(eng)
    add_at = add_at or [0] * len(prompts)
    rids, out, step, peak = {}, {}, 0, 0
    while len(rids) < len(prompts) or eng.has_unfinished():
        for i, p in enumerate(prompts):
            if i not in rids and add_at[i] <= step:
                rids[i] = eng.add_request(p, SamplingParams(temperature=0, max_tokens=n), n_top=4)
                out[rids[i]] = []
        for o in eng.step():
            if o.token is not None:
                out[o.request_id].append((o.token, o.logprob, o.top))
        peak = max(peak, eng.pool.n_swa_used)
        if check is not None:
            check(eng)
        step += 1
    assert eng.pool.n_used == 0 and eng.pool.n_swa_used == 0
    return [out[rids[i]] for i in range(len(prompts))], eng, peak


def _held(eng, w):
    # at rest every running sequence holds at most its next query's window blocks
    for s in eng.scheduler.running:
        held = [b for b in s.swa_table if b >= 0]
        assert len(held) <= _at_rest_bound(w), (s.n_computed, s.swa_table)
        assert all(b < 0 for b in s.swa_table[:eng.pool.swa.lo(s.n_computed)])


# --- the manager, in integers -------------------------------------------------------------

def test_window_blocks_reserve_slide_rollback_and_hits():
    W = 40
    m = BlockManager(64, BS)
    m.swa = w = WindowBlocks(8, BS, W)
    s, toks = SeqBlocks(), list(range(1000, 1300))
    held_max = 0
    for k in (50, 1, 1, 70, 3, 100, 20):          # prefill chunks and decode rows
        assert m.allocate_for(s, k) and w.reserve(s, k)
        held_max = max(held_max, w.blocks.n_used)
        m.commit(s, k, toks)
        assert sum(b >= 0 for b in s.swa_table) <= window_span(W - 1, BS)
        assert all(b < 0 for b in s.swa_table[:w.lo(s.n_computed)])
    assert s.n_computed == 245 and held_max <= window_span(W - 1 + 100, BS)
    # the blocks given back stay keyed (cached) until the allocator needs them
    assert w.blocks.n_used == sum(b >= 0 for b in s.swa_table) and w.blocks.n_cached > 0
    # a rollback inside the held window stops where asked; past it, the whole sequence goes
    n, copies = m.rollback(s, 10)
    assert (n, copies) == (10, []) and s.n_computed == 235 and w.covered(s, 235)
    n, _ = m.rollback(s, 100)   # 135: its window (96..134) was given back
    assert n == 235 and s.n_computed == 0 and s.block_table == [] and s.swa_table == []
    assert m.n_used == 0 and w.blocks.n_used == 0
    # a prefix hit is only as long as its window blocks are cached: blocks 0..6 were keyed in
    # both groups; the group of 8 blocks kept the last ones (5 and 6 were given back last)
    keys_full = [k for k in m.match_prefix(toks[:230] + [0])]
    assert len(keys_full) <= 7
    h = len(keys_full)
    assert h == 0 or all(w.blocks.peek(k) is not None for k in keys_full[w.lo(h * BS):h])
    # with the window blocks evicted, no hit at all though the full group has every block
    other = SeqBlocks()
    assert m.allocate_for(other, 256) and w.reserve(other, 8 * BS)   # takes the whole group
    m.free(other)
    assert m.match_prefix(toks[:230] + [0]) == []


def test_pool_sizing_bound_and_group_choice(tmp_path):
    model, _ = _tiny(tmp_path, "gpt-oss")
    L = kv_layout(model.config)
    assert L.swa_layers == (0,) and L.window == 12            # even layers slide (pattern 2)
    g = kv_layout(_tiny(tmp_path, "gemma3")[0].config)
    assert g.swa_layers == (0, 1) and g.window == 16           # pattern 6: layers 0-4 of 6
    # a group only when smaller than the context's blocks
    assert L.swa_blocks(512, 3, 48) == kv_swa_pool_blocks(12, 3, 48) < kv_pool_blocks(512, 3)
    assert L.swa_blocks(64, 1, 512) is None
    # pool bytes: the full layer for every position, the window layer for its group
    full = L.pool_bytes(8192, 1, 512)
    per_layer = L.bytes_per_token() // L.n_layer
    assert full == per_layer * (8192 + kv_swa_pool_blocks(12, 1, 512) * BS)
    assert full < 0.6 * L.bytes_per_token() * 8192


# --- one sequence: at once, chunked, token by token ------------------------------------------

def _seq_cache(model, n_ctx, chunk):
    L = kv_layout(model.config)
    t = "f16" if model.kv_f16 else "f32"
    return SeqKV.new(L.n_layer, n_ctx, L.n_head_kv, L.head_dim_k, L.head_dim_v, t, t,
                     swa_layers=L.swa_layers, window=L.window,
                     n_blocks_swa=kv_swa_pool_blocks(L.window, 1, chunk))


def _feed(model, ids, cache, chunk, w):
    out = []
    for b in range(0, len(ids), chunk):
        out.append(model.forward(np.asarray(ids[b:b + chunk]), cache, all_logits=True))
        if cache.pool.swa is not None:
            assert sum(x >= 0 for x in cache.state.swa_table) <= _at_rest_bound(w)
    return np.concatenate(out)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backend", ["native", "numpy"])
def test_logits_bits_equal_old_layout_any_chunking(tmp_path, arch, backend):
    model, _ = _tiny(tmp_path, arch, backend=backend)
    w = WINDOW[arch]
    ids = _prompt(150 if backend == "native" else 90, 1)
    for chunk in ((1, 7, 32, 150) if backend == "native" else (1, 13, 90)):
        old = _feed(model, ids, model.new_cache(len(ids)), chunk, w)   # masked whole context
        cache = _seq_cache(model, len(ids), chunk)
        assert cache.pool.swa is not None
        new = _feed(model, ids, cache, chunk, w)
        assert new.tobytes() == old.tobytes(), chunk
        # blocks of the window layers were given back: far fewer than the context's
        assert cache.pool.n_swa_used <= _at_rest_bound(w) < -(-len(ids) // BS)
        cache.close()


def test_gptoss_window_group_matches_float64(tmp_path):
    from test_gptoss import CFG, reference_logits
    path = _file(tmp_path, "gpt-oss", "F32")
    m = load_model(path, ops=get_ops("native"))
    m.kv_f16 = False
    ids = np.asarray(_prompt(80, 2), np.int32)
    ref = reference_logits(path, ids, {**CFG, "window": WINDOW["gpt-oss"]})
    for chunk in (1, 16, 80):
        got = _feed(m, ids, _seq_cache(m, len(ids), chunk), chunk, WINDOW["gpt-oss"])
        err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
        assert err <= 1e-4, (chunk, err)


# --- the engine --------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("n_batch", [16, 48, 512])
def test_engine_batched_chunked_equal_old_layout(tmp_path, arch, n_batch):
    model, tok = _tiny(tmp_path, arch)
    w = WINDOW[arch]
    prompts = [_prompt(n, i) for i, n in enumerate((150, 61, 201))]
    add_at = [0, 3, 9]    # neighbours come and go mid-prefill and mid-decode
    old, eo, _ = _run(model, tok, prompts, False, add_at=add_at, n_batch=n_batch)
    new, en, peak = _run(model, tok, prompts, True, add_at=add_at, n_batch=n_batch,
                         check=lambda e: _held(e, w))
    assert eo.pool.swa is None and en.pool.swa is not None
    assert new == old
    assert peak <= en.pool.n_swa_blocks == kv_swa_pool_blocks(w, 3, n_batch)
    assert en.pool.nbytes < eo.pool.nbytes
    # each alone gives the same tokens as batched
    for p, o in zip(prompts, new):
        assert _run(model, tok, [p], True, n_parallel=1, n_batch=n_batch)[0][0] == o


@pytest.mark.parametrize("arch", ARCHS)
def test_speculative_rollbacks_equal(tmp_path, arch):
    from test_spec import Mixed, Wrong, _spec
    model, tok = _tiny(tmp_path, arch)
    nv = model.config.n_vocab
    loop = [5 + (i % 7) * 13 for i in range(60)]
    prompts = [loop, _prompt(90, 3)]
    base, _, _ = _run(model, tok, prompts, False, n=80, n_batch=64)
    for proposer in (Mixed(nv), Wrong(nv)):
        spec = _spec(proposer, draft_max=12)
        rolls = []

        def spy(eng):   # every rollback stops where asked: no window block was given back
            orig = eng.pool.rollback
            eng.pool.rollback = lambda s, n: rolls.append((n, orig(s, n))) or rolls[-1][1]
        got, eng, _ = _run(model, tok, prompts, True, n=80, n_batch=64, spec=spec,
                           check=lambda e: _held(e, WINDOW[arch]), setup=spy)
        tot = spec.stats.totals()
        assert tot.rejections > 0 and eng.pool.swa is not None
        assert sum(n for n, _ in rolls) > 20 and all(a == b for a, b in rolls)
        assert [[t for t, _, _ in o] for o in got] == [[t for t, _, _ in o] for o in base]
        assert got == base


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_recompute_equal(tmp_path, arch):
    model, tok = _tiny(tmp_path, arch)
    prompts = [_prompt(n, 10 + i) for i, n in enumerate((120, 100, 90))]
    kw = dict(n_ctx=256, n_batch=32, n_blocks=14, n=60)   # 3 x 6 blocks wanted: preempts
    old, eo, _ = _run(model, tok, prompts, False, **kw)
    new, en, _ = _run(model, tok, prompts, True, **kw)
    assert en.scheduler.n_preempted > 0 and en.pool.swa is not None
    assert new == old


def _gen(eng, ids, n):
    rid = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=n), n_top=3)
    toks, last = [], None
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid and o.token is not None:
                toks.append((o.token, o.logprob, o.top))
                last = o
    return toks, last


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_hits_only_with_their_window(tmp_path, arch):
    model, tok = _tiny(tmp_path, arch)
    kw = dict(n_ctx=512, n_parallel=1, n_batch=32)
    eng = Engine(model, tok, **kw)
    assert eng.pool.swa is not None
    turn1 = _prompt(150, 20)
    out1, _ = _gen(eng, turn1, 20)
    turn2 = turn1 + [t for t, _, _ in out1] + _prompt(30, 21)
    out2, last2 = _gen(eng, turn2, 20)
    # turn 1's prompt blocks (not the one holding its generated tokens) are reused: far
    # more than the window, so the window layers' blocks before them had been given back
    assert last2.cache_n == len(turn1) // BS * BS == 128 > WINDOW[arch]
    cold = Engine(model, tok, **kw, window_kv=False)
    assert out2 == _gen(cold, turn2, 20)[0]
    # another long prompt churns the small window group: turn 2's window blocks are evicted
    # though the full layers still cache every block; the hit is then refused, not wrong
    _gen(eng, _prompt(300, 22), 4)
    m = eng.pool.manager
    turn3 = turn2 + [t for t, _, _ in out2] + [7, 8, 9]
    full_hits = 0
    key = None
    from memfit.kv.manager import _key_at
    for i in range((len(turn3) - 1) // BS):
        key = _key_at(key, turn3, i, BS, len(turn3))
        if m.peek(key) is None:
            break
        full_hits += 1
    assert full_hits >= 4 and len(m.match_prefix(turn3, n_prompt=len(turn3))) < full_hits
    out3, last3 = _gen(eng, turn3, 12)
    assert last3.cache_n < full_hits * BS
    assert out3 == _gen(Engine(model, tok, **kw, window_kv=False), turn3, 12)[0]


def test_shared_prefix_shares_window_blocks(tmp_path):
    model, tok = _tiny(tmp_path, "gpt-oss")
    eng = Engine(model, tok, n_ctx=512, n_parallel=3, n_batch=64)
    system = _prompt(3 * BS, 30)
    _gen(eng, system + [5], 1)
    p = SamplingParams(temperature=0, max_tokens=4)
    rids = [eng.add_request(system + [7 + i, 9], p) for i in range(3)]
    seqs = [eng.sequence(r) for r in rids]
    eng.step()
    assert all(s.cache_n == 3 * BS for s in seqs)
    # one copy of the window blocks before position 96, three readers
    lo = eng.pool.swa.lo(3 * BS)
    assert seqs[0].swa_table[lo:3] == seqs[1].swa_table[lo:3] == seqs[2].swa_table[lo:3]
    assert all(b >= 0 for b in seqs[0].swa_table[lo:3])
    while eng.has_unfinished():
        eng.step()


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512vnni"])
def test_equal_on_every_isa(tmp_path, isa):
    from memfit import _native
    if isa not in isa_paths():
        pytest.skip(f"no {isa} kernels on this CPU")
    before = _native.isa()
    _native.set_isa(isa)
    try:
        model, tok = _tiny(tmp_path, "gpt-oss")
        prompts = [_prompt(n, 40 + i) for i, n in enumerate((110, 70))]
        old, _, _ = _run(model, tok, prompts, False, n=24, n_batch=32)
        new, en, _ = _run(model, tok, prompts, True, n=24, n_batch=32)
        assert en.pool.swa is not None and new == old
    finally:
        _native.set_isa(before)


@pytest.mark.parametrize("kv", ["q8_0", "f32"])
def test_other_cache_types_equal(tmp_path, kv):
    model, tok = _tiny(tmp_path, "gpt-oss")
    prompts = [_prompt(n, 50 + i) for i, n in enumerate((130, 75))]
    kw = dict(n=30, n_batch=48, cache_type=kv, cache_type_v=kv)
    old, _, _ = _run(model, tok, prompts, False, **kw)
    new, en, _ = _run(model, tok, prompts, True, **kw)
    assert en.pool.swa is not None and new == old


# --- sessions, the API, the plan ---------------------------------------------------------

def test_session_round_trip(tmp_path):
    path = _file(tmp_path, "gpt-oss")
    ids = _prompt(170, 60)
    kw = dict(n_ctx=1024)
    with memfit.load(path, **kw, spec="off") as m:
        assert m.engine.pool.swa is not None
        a1 = m.generate(ids, max_tokens=10, temperature=0)
        a2 = m.generate(a1.prompt_ids + a1.ids, max_tokens=10, temperature=0)
    with memfit.load(path, **kw, spec="off") as m:
        b1 = m.generate(ids, max_tokens=10, temperature=0)
        assert b1.ids == a1.ids
        m.save_state(tmp_path / "s.mfs", b1.prompt_ids + b1.ids)
    with memfit.load(path, **kw, spec="off") as m:
        got, _ = m.load_state(tmp_path / "s.mfs")
        c2 = m.generate(got, max_tokens=10, temperature=0)
        # every whole block restored, far past the window (its window blocks came back too)
        assert c2.timings.cache_n == (len(got) - 1) // BS * BS > WINDOW["gpt-oss"]
    assert c2.ids == a2.ids


def test_plan_counts_window_bounded_kv(tmp_path):
    from memfit.gguf import open_gguf
    from memfit.memory.planner import ModelDesc
    f = open_gguf(_file(tmp_path, "gpt-oss"))
    m = ModelDesc.from_gguf(f)
    assert m.kv_swa_layers == (0,) and m.kv_window == 12
    L = kv_layout(load_model(f).config)
    for ctx in (8192, 32768):
        now = m.kv_pool_bytes(ctx, 1, 512)
        before = m.kv_pool_bytes(ctx, 1, 512, window_group=False)
        assert now == L.pool_bytes(ctx, 1, 512)
        assert before / 2 < now < 0.55 * before    # one of the two layers holds a window
    # a short context gains less; one shorter than the group keeps the old layout
    assert m.kv_pool_bytes(1024, 1, 512) < m.kv_pool_bytes(1024, 1, 512, window_group=False)
    assert m.kv_pool_bytes(512, 1, 512) == m.kv_pool_bytes(512, 1, 512, window_group=False)
    f.close()


def test_budgeted_runtime_ledger_and_plan_report(tmp_path, capsys):
    from memfit.cli import main
    path = _file(tmp_path, "gpt-oss")
    with memfit.load(path, n_ctx=2048, mem_budget="2GiB", spec="off") as m:
        pool = m.engine.pool
        assert pool.swa is not None
        assert m.ledger.items("kv")["kv_pool"] == pool.nbytes <= m.plan.kv_bytes
        assert m.plan.kv_swa_layers == 1 and m.plan.kv_window == 12
        r = m.generate(_prompt(300, 70), max_tokens=8, temperature=0)
        assert len(r.ids) == 8
    assert main(["plan", str(path), "--ctx-size", "2048", "--mem-budget", "2GiB"]) == 0
    out = capsys.readouterr().out
    assert "1 of 2 layers hold only their 12-token window" in out


@pytest.mark.realmodel
def test_real_gemma3_long_prompt_equal(gemma_path):
    # Gemma-3-270M: 15 of 18 layers slide over 512 tokens; a prompt of 1100 tokens (two
    # windows and more) gives the same tokens and log-probabilities with a smaller pool
    with memfit.load(gemma_path, n_ctx=2048, spec="off") as m:
        ids = _prompt(1100, 80)
        outs = []
        for window_kv in (False, True):
            eng = Engine(m.model, m.tokenizer, 2048, 1, m.n_batch, window_kv=window_kv)
            rid = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=6), n_top=3,
                                  ignore_eos=True)
            got = []
            while eng.has_unfinished():
                got += [(o.token, o.logprob, o.top) for o in eng.step() if o.token is not None]
                if window_kv:
                    assert eng.pool.n_swa_used <= _at_rest_bound(512)
            outs.append((got, eng.pool.nbytes, eng.pool.swa is not None))
            del rid
        (old, b_old, g_old), (new, b_new, g_new) = outs
        assert not g_old and g_new and new == old and len(new) == 6
        assert b_new == kv_layout(m.config).pool_bytes(2048, 1, m.n_batch) < 0.85 * b_old


def test_single_sequence_path_on_the_engine_pool(tmp_path):
    # SeqKV on the engine's pool (logprobs, perplexity, bench): n_batch pieces fit beside
    # running sequences; one forward longer than the group holds is a clear error
    from memfit.bench.llama_bench import run_bench
    from memfit.errors import RequestError
    model, tok = _tiny(tmp_path, "gpt-oss")
    eng = Engine(model, tok, n_ctx=1024, n_parallel=2, n_batch=64)
    for i in range(2):   # both slots running, at rest between steps
        eng.add_request(_prompt(200, 90 + i), SamplingParams(temperature=0, max_tokens=50))
    for _ in range(12):
        eng.step()
    assert len(eng.scheduler.running) == 2 and eng.pool.n_swa_used > 0
    ids = _prompt(300, 92)
    old = _feed(model, ids, model.new_cache(len(ids)), 64, WINDOW["gpt-oss"])
    with SeqKV(eng.pool, len(ids)) as cache:
        assert _feed(model, ids, cache, 64, WINDOW["gpt-oss"]).tobytes() == old.tobytes()
    with SeqKV(eng.pool, len(ids)) as cache, pytest.raises(RequestError, match="n_batch"):
        model.forward(np.asarray(ids), cache)
    while eng.has_unfinished():
        eng.step()
    # the bench feeds a long prompt in n_batch pieces on such a pool
    r = run_bench(model, "tiny", model.config.n_vocab, 300, 4, 1, 1, progress=False,
                  pool=eng.pool, n_batch=64)
    assert [x.test for x in r] == ["pp300", "tg4"] and eng.pool.n_swa_used == 0
