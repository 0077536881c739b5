"""Speculative decoding (memfit/spec): the output with speculation is the output without it,
token for token (greedy and seeded sampling), for every architecture, KV cache type, the real
models and under a budget that streams; rejected rows leave the KV cache and never reach the
prefix cache; sampled tokens follow the target's distribution.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import isa_paths

from memfit.engine.engine import Engine
from memfit.engine.sampler import SamplingParams
from memfit.models import load_model
from memfit.models.synthetic import write_tiny_model
from memfit.ops import get_ops
from memfit.spec import CostModel, NGramProposer, Proposer, SpecConfig, Speculator
from memfit.tokenizer import Tokenizer

ARCHS = ["llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "qwen2moe", "mixtral", "olmoe",
         "glm4moe", "deepseek2", "gpt-oss"]
# a prompt that repeats (n-gram proposals get accepted) and one that does not
LOOP = [5 + (i % 7) * 13 for i in range(40)]
PLAIN = [3 + (i * 11) % 240 for i in range(37)]


def _tiny(tmp_path, arch, quant="Q4_K", seed=31):
    from memfit.gguf import open_gguf
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, quant, seed=seed)
    f = open_gguf(path)
    tok = Tokenizer.from_metadata(f.metadata)
    tok.eog_ids = set()
    return load_model(f, ops=get_ops("native")), tok


class Wrong(Proposer):
    """Proposes tokens the target will not pick (every proposal rejected at its first token,
    or accepted by chance): rows to take back, blocks filled with rejected tokens."""
    name = "wrong"

    def __init__(self, n_vocab):
        self.n_vocab = n_vocab

    def propose(self, seqs, ks):
        return [[(s.tokens[-1] * 7 + 11 * i + 1) % self.n_vocab for i in range(k)]
                for s, k in zip(seqs, ks)]


class Mixed(Proposer):
    """n-gram proposals with a wrong token spliced in: partly accepted passes."""
    name = "mixed"

    def __init__(self, n_vocab):
        self.ng, self.n_vocab = NGramProposer(1, 3), n_vocab

    def propose(self, seqs, ks):
        out = []
        for s, d in zip(seqs, self.ng.propose(seqs, ks)):
            d = list(d)
            if len(d) >= 3 and len(s.tokens) % 3 == 0:
                d[2] = (d[2] + 1) % self.n_vocab
            out.append(d)
        return out

    def release(self, rid):
        self.ng.release(rid)


def _spec(mode_or_proposer, draft_max=8):
    if isinstance(mode_or_proposer, str):
        return Speculator(SpecConfig(mode=mode_or_proposer, draft_max=draft_max))
    return Speculator(SpecConfig(mode="ngram", draft_max=draft_max), [mode_or_proposer])


def _run(model, tok, prompts, spec=None, kv="f16", n=24, n_parallel=1, params=None,
         add_at=None, n_ctx=192):
    """Tokens per prompt; prompts added at steps add_at[i] (default all at once)."""
    eng = Engine(model, tok, n_ctx=n_ctx, n_parallel=n_parallel, cache_type=kv,
                 cache_type_v=kv, spec=spec)
    add_at = add_at or [0] * len(prompts)
    params = params or [SamplingParams(temperature=0, max_tokens=n)] * len(prompts)
    rids, toks, step = {}, {}, 0
    while len(rids) < len(prompts) or eng.has_unfinished():
        for i, p in enumerate(prompts):
            if i not in rids and add_at[i] <= step:
                rids[i] = eng.add_request(p, params[i])
                toks[rids[i]] = []
        for o in eng.step():
            if o.token is not None:
                toks[o.request_id].append(o.token)
        step += 1
    assert eng.pool.n_used == 0
    return [toks[rids[i]] for i in range(len(prompts))], eng


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equal_every_arch(tmp_path, arch):
    model, tok = _tiny(tmp_path, arch)
    nv = model.config.n_vocab
    base, _ = _run(model, tok, [LOOP, PLAIN])
    for prop in ("ngram", Wrong(nv), Mixed(nv)):
        got, eng = _run(model, tok, [LOOP, PLAIN], _spec(prop))
        assert got == base, (arch, prop)
        st = eng.stats()["spec"]
        assert st["proposed"] > 0, st  # speculation really ran


@pytest.mark.parametrize("kv", ["f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("arch", ["llama", "qwen3moe", "gemma3"])
def test_greedy_equal_kv_types_batched_at_random_steps(tmp_path, arch, kv):
    """Property: requests join at random steps beside speculating ones; each equals alone
    without speculation."""
    model, tok = _tiny(tmp_path, arch)
    rng = np.random.default_rng(7)
    prompts = [LOOP, PLAIN, LOOP[:33], PLAIN[:5] + LOOP[:20], [101], LOOP[3:39]]
    alone = [_run(model, tok, [p], kv=kv)[0][0] for p in prompts]
    for trial in range(2):
        at = [int(x) for x in rng.integers(0, 12, len(prompts))]
        got, eng = _run(model, tok, prompts, _spec(Mixed(model.config.n_vocab)), kv=kv,
                        n_parallel=4, add_at=at)
        assert got == alone, (arch, kv, at)
        assert eng.stats()["spec"]["accepted"] > 0


def test_seeded_sampling_equal_and_cost_independent(tmp_path):
    """Seeded sampling gives the same tokens with and without speculation, whatever the
    proposals (the target draws its own token per row)."""
    model, tok = _tiny(tmp_path, "llama")
    params = [SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=s,
                             max_tokens=20) for s in range(6)]
    prompts = [LOOP] * 6
    base, _ = _run(model, tok, prompts, params=params, n_parallel=3)
    for prop in ("ngram", Wrong(model.config.n_vocab), Mixed(model.config.n_vocab)):
        got, _ = _run(model, tok, prompts, _spec(prop), params=params, n_parallel=3)
        assert got == base


def test_kv_after_rejection_equals_accepted_alone(tmp_path):
    """Mid-generation, after rejections: the sequence's K/V rows are the bits a run without
    speculation computed for the same tokens; no keyed block holds a token that was not
    accepted."""
    model, tok = _tiny(tmp_path, "qwen2")
    nv = model.config.n_vocab
    spec = _spec(Mixed(nv), draft_max=12)
    a = Engine(model, tok, n_ctx=192, n_parallel=1, spec=spec)
    ra = a.add_request(LOOP, SamplingParams(temperature=0, max_tokens=100))
    sa = a.sequence(ra)
    while a.has_unfinished() and (sa.n_generated < 50 or spec.stats.totals().rejections < 3):
        a.step()
    assert spec.stats.totals().rejections >= 3 and spec.stats.totals().accepted > 0
    b = Engine(model, tok, n_ctx=192, n_parallel=1)
    rb = b.add_request(LOOP, SamplingParams(temperature=0, max_tokens=100))
    sb = b.sequence(rb)
    while sb.n_computed < sa.n_computed:
        b.step()
    assert sb.n_computed == sa.n_computed and sb.tokens[:sa.n_computed] == sa.tokens[:sa.n_computed]
    bs = a.pool.block_size
    for layer in range(model.config.n_layer):
        for pos in range(sa.n_computed):
            for pool_a, pool_b, tab_a, tab_b in ((a.pool.k, b.pool.k, sa.block_table, sb.block_table),
                                                 (a.pool.v, b.pool.v, sa.block_table, sb.block_table)):
                if not pool_a:
                    continue
                ra_ = pool_a[layer][tab_a[pos // bs]].reshape(bs, -1)[pos % bs]
                rb_ = pool_b[layer][tab_b[pos // bs]].reshape(bs, -1)[pos % bs]
                assert ra_.tobytes() == rb_.tobytes(), (layer, pos)
    # every keyed block's tokens are the sequence's own (accepted) tokens at that place
    m = a.pool.manager
    for i in range(sa.n_hashed):
        key = m.key_of(sa.block_table[i])
        assert key is not None and list(key[1]) == sa.tokens[i * bs:(i + 1) * bs]
    # the blocks past the end went back to the pool
    assert len(sa.block_table) == (sa.n_computed + bs - 1) // bs or \
        len(sa.block_table) == (len(sa.tokens) + bs - 1) // bs


def test_rejected_tokens_never_keyed(tmp_path):
    """A proposer whose whole drafts are wrong fills blocks with rejected tokens: none of them
    is ever keyed, and a later prompt continuing with those tokens gets no cache hit on them."""
    model, tok = _tiny(tmp_path, "llama")
    nv = model.config.n_vocab
    class Flat(CostModel):  # rows cost nothing: the policy verifies whole proposals
        def observe(self, w, t):
            pass

        def cost(self, w):
            return 1.0
    spec = Speculator(SpecConfig(mode="ngram", draft_max=40, draft_min=40), [Wrong(nv)], Flat())
    eng = Engine(model, tok, n_ctx=256, n_parallel=1, n_batch=64, spec=spec)
    rid = eng.add_request(PLAIN, SamplingParams(temperature=0, max_tokens=60))
    seq = eng.sequence(rid)
    seen_drafts = []
    orig = eng._verify

    def spy(s, lg):
        seen_drafts.append((list(s.tokens), list(s.draft)))
        return orig(s, lg)
    eng._verify = spy
    out = []
    while eng.has_unfinished():
        for o in eng.step():
            if o.token is not None:
                out.append(o.token)
    assert spec.stats.totals().proposed >= 60 and spec.stats.totals().rejections > 0
    full = PLAIN + out
    keys = [k for k in eng.pool.manager._by_key]
    bs = eng.pool.block_size
    for k in keys:  # every cached block holds a slice of the real text at its own place
        toks = list(k[1])
        assert any(full[i:i + bs] == toks for i in range(0, len(full) - bs + 1, bs)), toks
    # a prompt made of a rejected draft after the real prefix: no hit past the real tokens
    before, draft = next((t, d) for t, d in seen_drafts if len(d) >= bs + 1)
    probe = before + draft
    hit = eng.pool.manager.match_prefix(probe, n_prompt=len(PLAIN))
    n_real = len(before) // bs
    assert len(hit) <= n_real
    del seq


def test_sampling_distribution_matches_target(tmp_path):
    """Chi-square: with speculation verifying the second generated token (a proposer right
    about half the time), that token's counts match the target's softmax given the first."""
    model, tok = _tiny(tmp_path, "llama", quant="F32")
    nv = model.config.n_vocab
    prompt = PLAIN[:9]
    temp = 1.5

    def dist(prefix):  # the target's sampling distribution of the token after prefix
        eng = Engine(model, tok, n_ctx=64, n_parallel=1)
        lg = []
        orig = eng._sample
        eng._sample = lambda s, x: (lg.append(x.copy()), orig(s, x))[1]
        eng.add_request(prefix, SamplingParams(temperature=0, max_tokens=1))
        while eng.has_unfinished():
            eng.step()
        x = lg[0].astype(np.float64) / temp
        p = np.exp(x - x.max())
        return p / p.sum()

    class Guess(Proposer):
        name = "guess"

        def propose(self, seqs, ks):  # the most likely next token: accepted ~half the time
            return [[int(np.argmax(cond(s.tokens[-1])))] for s in seqs]

    cache = {}

    def cond(t1):
        if t1 not in cache:
            cache[t1] = dist(prompt + [t1])
        return cache[t1]

    spec = Speculator(SpecConfig(mode="ngram", draft_max=1), [Guess()])
    eng = Engine(model, tok, n_ctx=64, n_parallel=8, spec=spec)
    n = 2400
    obs, exp = np.zeros(nv), np.zeros(nv)
    for seed0 in range(0, n, 8):
        rids = [eng.add_request(prompt, SamplingParams(temperature=temp, top_k=0, top_p=1.0,
                                                        min_p=0.0, seed=seed, max_tokens=3))
                for seed in range(seed0, seed0 + 8)]
        outs = {r: [] for r in rids}
        while eng.has_unfinished():
            for o in eng.step():
                if o.token is not None:
                    outs[o.request_id].append(o.token)
        for r in rids:
            t1, t2 = outs[r][:2]
            obs[t2] += 1
            exp += cond(t1)
    st = spec.stats.totals()
    assert st.proposed == n and 0 < st.accepted < n, st.to_dict()
    keep = exp >= 5  # cells with enough expectation; the rest pooled
    o = np.append(obs[keep], obs[~keep].sum())
    e = np.append(exp[keep], exp[~keep].sum())
    stat = float(((o - e) ** 2 / np.maximum(e, 1e-12)).sum())
    k = len(o) - 1
    # Wilson-Hilferty: the chi-square(k) tail through a normal one
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    pval = 0.5 * math.erfc(z / math.sqrt(2))
    assert pval > 1e-3, (stat, k, pval)


def test_ngram_proposer_lookup():
    class S:
        def __init__(self, toks):
            self.tokens, self.request_id = toks, "r"
    ng = NGramProposer(2, 4)
    # "1 2 3 4 | 9 | 1 2 3" -> after 1 2 3 came 4 9
    assert ng.propose([S([1, 2, 3, 4, 9, 1, 2, 3])], [2]) == [[4, 9]]
    ng.release("r")
    # a loop continues as a loop past the end
    assert ng.propose([S([7, 8, 7, 8, 7])], [5]) == [[8, 7, 8, 7, 8]]
    ng.release("r")
    assert ng.propose([S([1, 2, 3, 4])], [4]) == [[]]


def test_policy_prefers_deep_drafts_when_rows_are_cheap():
    from memfit.spec.policy import CostModel, expected_tokens
    cheap, dear = CostModel(), CostModel()
    for w in range(1, 25):
        cheap.observe(w, 1.0 + 0.02 * (w - 1))   # a streamed model: reads dominate
        dear.observe(w, 1.0 * w)                 # compute-bound: each row costs a token
    seq = type("S", (), {"tokens": [1, 2, 3], "request_id": "x"})()
    for cost, expect_spec in ((cheap, True), (dear, False)):
        sp = Speculator(SpecConfig(mode="auto", draft_max=16), [], cost)
        sp.stats.of("ngram").proposed, sp.stats.of("ngram").accepted = 100, 80
        chosen = sp._choose([(seq, "ngram", list(range(16)))], 1)
        assert bool(chosen) == expect_spec
        if expect_spec:
            assert len(chosen[0][2]) >= 8
    assert expected_tokens(0.0, 8) == 1.0 and expected_tokens(1.0, 8) == 9.0


@pytest.mark.realmodel
@pytest.mark.parametrize("which", ["smollm2", "gemma"])
def test_real_models_greedy_equal(which, request):
    import memfit
    path = request.getfixturevalue(f"{which}_path")
    text = ("Copy the list exactly.\nList: apples, pears, plums, cherries, grapes, lemons, limes.\n"
            "Copy: apples, pears, plums, cherries, grapes, lemons, limes.\nList: red, green, "
            "blue, yellow, purple, orange, black.\nCopy:")
    with memfit.load(path, n_ctx=256, spec="off") as m:
        base = m.generate(text, max_tokens=48, temperature=0)
    for mode in ("ngram", "auto"):
        with memfit.load(path, n_ctx=256, spec=mode, n_parallel=2) as m:
            c = m.generate(text, max_tokens=48, temperature=0)
            assert c.ids == base.ids, mode
            if mode == "ngram":
                st = m.spec_stats()
                assert st["proposed"] > 0 and st["accepted"] > 0, st


@pytest.mark.realmodel
def test_real_model_under_streaming_budget_equal(smollm2_path):
    """SmolLM2's weights streamed at the plan's floor (memory/store.py): n-gram speculation
    gives the memory-mapped model's greedy tokens."""
    from memfit.gguf import open_gguf
    from memfit.memory.bandwidth import Bandwidth
    from memfit.memory.ledger import Ledger
    from memfit.memory.planner import ModelDesc, plan
    from memfit.memory.store import WeightStore
    f = open_gguf(smollm2_path)
    tok = Tokenizer.from_metadata(f.metadata)
    text = "Repeat: one two three four five six. one two three four five six. one two three"
    ids = tok.encode(text)
    bw = Bandwidth(10e9, 1e9, "test")
    desc = ModelDesc.from_gguf(f)
    floor = plan(desc, 1 << 40, 192, 1, bw, baseline_bytes=0, n_batch=64).min_budget_bytes
    p = plan(desc, floor, 192, 1, bw, baseline_bytes=0, n_batch=64)
    store = WeightStore(f, p, Ledger(None, debug=""))
    try:
        mapped = load_model(f, ops=get_ops("native"))
        base, _ = _run(mapped, tok, [ids], n=32)
        streamed = load_model(f, weights=store, ops=get_ops("native"))
        got, eng = _run(streamed, tok, [ids], _spec("ngram"), n=32)
        assert got == base
        assert eng.stats()["spec"]["accepted"] > 0
        assert store.stats()["bytes_read"] > 0  # weights did stream
    finally:
        store.close()
        f.close()


@pytest.mark.parametrize("isa", ["scalar", "avx2"])
@pytest.mark.parametrize("arch", ["llama", "qwen3moe", "gemma3"])
def test_greedy_equal_on_other_isas(tmp_path, arch, isa):
    # the same equality on the other kernel paths this CPU runs (the default one is above)
    from memfit import _native
    if isa not in isa_paths():
        pytest.skip(f"no {isa} kernels on this CPU")
    before = _native.isa()
    _native.set_isa(isa)
    try:
        test_greedy_equal_every_arch(tmp_path, arch)
        test_greedy_equal_kv_types_batched_at_random_steps(tmp_path, arch, "q8_0")
    finally:
        _native.set_isa(before)
