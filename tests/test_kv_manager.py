"""One KV implementation (issue 17 item 5): the integer block manager (allocate, commit,
rollback, free, prefix keys), the storage under it, the single-sequence path that perplexity,
logprobs, KLD and the benches run on the engine's pool, and the one KV byte formula."""

from __future__ import annotations

import random

import numpy as np
import pytest

from memfit.errors import RequestError
from memfit.kv import KVPool, SeqKV, kv_bytes_per_token
from memfit.kv.manager import BlockManager, SeqBlocks, block_key

BS = 32


def _keys(tokens, n_blocks):
    out, key = [], None
    for i in range(n_blocks):
        key = block_key(key, tokens[i * BS:(i + 1) * BS])
        out.append(key)
    return out


# --- the manager, in integers --------------------------------------------------------------

def test_rollback_frees_blocks_and_unkeys_them():
    m = BlockManager(8, BS)
    s, toks = SeqBlocks(), list(range(1000, 1100))
    assert m.allocate_for(s, 100) and len(s.block_table) == 4 and m.n_free == 4
    m.commit(s, 100, toks)
    assert s.n_computed == 100 and s.n_hashed == 3
    table = list(s.block_table)
    assert len(m.match_prefix(toks + [0])) == 3
    # roll back 40 tokens: end 60 is inside block 1; blocks 2 and 3 go back to the pool
    n, copies = m.rollback(s, 40)
    assert (n, copies) == (40, [])
    assert s.n_computed == 60 and s.block_table == table[:2] and m.n_free == 6
    assert s.n_hashed == 1 and s.last_key == _keys(toks, 1)[0]
    # no block holding a rolled-back token keeps a key: only block 0 matches
    assert [m.key_of(b) for b in table] == [_keys(toks, 1)[0], None, None, None]
    assert m.match_prefix(toks + [0]) == _keys(toks, 1)
    # the freed blocks are handed out again (plain free blocks, before any cached one)
    other = SeqBlocks()
    assert m.allocate_for(other, 64)
    assert set(other.block_table) == set(table[2:])
    m.free(other)
    # re-forward other tokens: they, not the rolled-back ones, are what the prefix cache keys
    new = toks[:60] + list(range(5000, 5040))
    assert m.allocate_for(s, 40)
    m.commit(s, 40, new)
    assert m.match_prefix(new + [0]) == _keys(new, 3)
    assert m.match_prefix(toks + [0]) == _keys(toks, 1)
    m.free(s)
    assert m.n_used == 0 and m.n_cached == 3  # keyed full blocks stay reusable
    with pytest.raises(AssertionError):
        m.release([table[0]])  # a block nobody holds


def test_rollback_of_a_shared_block_copies_it():
    p = KVPool(2, 6, 2, 32)
    m = p.manager
    a, toks = SeqBlocks(), list(range(64))
    assert m.allocate_for(a, 64)
    for layer in p.k + p.v:  # recognisable rows: block b row r holds b * 100 + r
        layer[...] = (np.arange(layer.shape[0]) // BS * 100 + np.arange(layer.shape[0]) % BS
                      )[:, None, None]
    m.commit(a, 64, toks)
    b = SeqBlocks()
    assert m.admit(b, toks + [7])  # shares a's two blocks, one new block for the last token
    assert b.block_table[:2] == a.block_table and b.n_computed == 64
    assert m.ref[a.block_table[1]] == 2
    # b takes back 10 tokens: its end (54) falls in the shared block; a's copy stays as it is
    assert p.rollback(b, 10) == 10
    shared, mine = a.block_table[1], b.block_table[1]
    assert mine != shared and m.ref[shared] == 1 and m.ref[mine] == 1
    for layer in p.k_blocks + p.v_blocks:
        np.testing.assert_array_equal(layer[mine, :22], layer[shared, :22])
    assert m.key_of(shared) is not None and m.key_of(mine) is None
    assert m.match_prefix(toks + [7]) == _keys(toks, 2)  # a's blocks, untouched
    assert m.lookup(_keys(toks, 2)[1]) == shared
    m.release([shared])
    # rolling back past a shared block only drops the reference: the owner keeps its key
    c = SeqBlocks()
    assert m.admit(c, toks + [9]) and c.block_table[:2] == a.block_table
    assert p.rollback(c, 32) == 32 and c.n_computed == 32 and c.block_table == a.block_table[:1]
    assert m.ref[a.block_table[1]] == 1 and m.key_of(a.block_table[1]) is not None


def test_random_operations_keep_the_prefix_cache_true():
    """Sequences allocate, commit, roll back and free at random over a small pool while a
    shadow copy records which token each row really holds: every keyed block holds exactly
    the tokens of its key, and reference counts are the block tables' counts."""
    rng = random.Random(3)
    m = BlockManager(12, BS)
    rows: dict[int, list] = {}  # block -> the token of each row written to it
    n_copies = n_shared = 0
    seqs: list[tuple[SeqBlocks, list]] = []
    seen: list[list] = [[]]  # token lists of earlier sequences: new ones often start with one
    vocab = [1, 2]

    def write(s, toks, lo, hi):
        for p in range(lo, hi):
            b = s.block_table[p // BS]
            rows.setdefault(b, [None] * BS)[p % BS] = toks[p]

    for _ in range(6000):
        op = rng.random()
        if op < 0.25 and len(seqs) < 4:
            base = rng.choice(seen)
            toks = base[:rng.randint(0, len(base))] + [rng.choice(vocab)
                                                      for _ in range(rng.randint(1, 60))]
            seen.append(list(toks))
            s = SeqBlocks()
            if m.admit(s, toks):
                write(s, toks, s.n_computed, len(toks))
                m.commit(s, len(toks) - s.n_computed, toks)
                seqs.append((s, toks))
        elif op < 0.55 and seqs:
            s, toks = rng.choice(seqs)
            k = rng.randint(1, 40)
            if len(toks) + k <= 200 and m.allocate_for(s, k):
                toks += [rng.choice(vocab) for _ in range(k)]
                write(s, toks, s.n_computed, len(toks))
                m.commit(s, k, toks)
        elif op < 0.85 and seqs:
            s, toks = rng.choice(seqs)
            n_shared += any(m.ref[b] > 1 for b in s.block_table)
            n, copies = m.rollback(s, rng.randint(0, len(toks)))
            n_copies += len(copies)
            for src, dst, nr in copies:
                rows[dst] = rows[src][:nr] + [None] * (BS - nr)
            del toks[len(toks) - n:]
            assert s.n_computed == len(toks)
        elif seqs:
            s, toks = seqs.pop(rng.randrange(len(seqs)))
            m.free(s)
        # invariants
        count = np.zeros(m.n_blocks, np.int32)
        for s, toks in seqs:
            assert len(s.block_table) == m.blocks_for(len(toks))
            for b in s.block_table:
                count[b] += 1
            for p in range(len(toks)):  # every sequence still sees its own tokens
                assert rows[s.block_table[p // BS]][p % BS] == toks[p]
        np.testing.assert_array_equal(count, m.ref)
        assert m.n_used == int((count > 0).sum())
        for key, b in m._by_key.items():
            assert key[1] == tuple(rows[b]), "a keyed block holds other tokens than its key"
    assert m.n_cached > 0 and n_copies > 5 and n_shared > 10  # keyed, shared, copied blocks


# --- the single-sequence path: rollback + re-forward == cold --------------------------------

def _tiny(tmp_path_factory, arch):
    from memfit.models import load_model
    from memfit.models.synthetic import write_tiny_model
    from memfit.ops import get_ops
    path = write_tiny_model(tmp_path_factory.mktemp("kvm") / f"{arch}.gguf", arch, "Q4_0", seed=2)
    return load_model(path, ops=get_ops("native"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _tiny(tmp_path_factory, "llama")


@pytest.fixture(scope="module", params=["llama", "gemma3"])  # gemma3: sliding window of 4
def tiny_arch(request, tmp_path_factory):
    return _tiny(tmp_path_factory, request.param)


def _run(model, pool, pieces, trims=()):
    """Forward pieces in order on a fresh sequence of pool; after piece i, trim trims[i]."""
    out = []
    with SeqKV(pool) as c:
        for i, ids in enumerate(pieces):
            out.append(model.forward(np.asarray(ids, np.int32), c, all_logits=True))
            if i < len(trims) and trims[i]:
                assert c.trim(trims[i]) == trims[i]
        return out[-1]


@pytest.mark.parametrize("cache_type", ["f16", "q8_0", "q4_0"])
def test_rollback_then_reforward_equals_cold(tiny_arch, cache_type):
    tiny = tiny_arch
    c = tiny.config
    pool = KVPool(c.n_layer, 6, c.n_head_kv, c.head_dim_k, c.head_dim_v, cache_type)
    rng = np.random.default_rng(0)
    P, D, E = (rng.integers(0, c.n_vocab, n) for n in (40, 30, 9))
    cold = _run(tiny, pool, [P, E])
    assert pool.n_used == 0  # the sequence gave its blocks back
    # a draft crossing into a new block is taken back, then other tokens are fed
    warm = _run(tiny, pool, [P, D, E], trims=[0, len(D)])
    np.testing.assert_array_equal(warm.view(np.uint32), cold.view(np.uint32))
    # decode rows (the fused one-token path): a rejected token, then the accepted one
    cold1 = _run(tiny, pool, [P, E[:1]])
    warm1 = _run(tiny, pool, [P, D[:1], D[1:2], E[:1]], trims=[0, 0, 2])
    np.testing.assert_array_equal(warm1.view(np.uint32), cold1.view(np.uint32))
    # a trim into the prompt, then a longer re-forward
    cold2 = _run(tiny, pool, [P[:25], D])
    np.testing.assert_array_equal(_run(tiny, pool, [P, D], trims=[15]).view(np.uint32),
                                  cold2.view(np.uint32))


def test_sequence_refuses_what_the_pool_cannot_hold(tiny):
    c = tiny.config
    pool = KVPool(c.n_layer, 2, c.n_head_kv, c.head_dim_k, c.head_dim_v)
    with pytest.raises(RequestError, match="does not fit in the KV pool of 64 tokens"):
        SeqKV(pool, 65)
    held = SeqBlocks()
    assert pool.manager.allocate_for(held, 40)  # another sequence holds both blocks
    with SeqKV(pool, 64) as s:
        with pytest.raises(RequestError, match="free blocks"):
            tiny.forward(np.arange(10, dtype=np.int32), s)
        assert s.offset == 0
    pool.manager.free(held)
    with SeqKV(pool, 64) as s:
        tiny.forward(np.arange(10, dtype=np.int32), s)
        with pytest.raises(RequestError, match="context overflow"):
            tiny.forward(np.arange(60, dtype=np.int32), s)
        assert s.offset == 10 and pool.n_used == 1
    assert pool.n_used == 0


# --- one KV byte formula -------------------------------------------------------------------

CONFIGS = [  # n_layer, n_head_kv, head_dim_k, head_dim_v
    (30, 3, 64, 64),      # SmolLM2-135M
    (18, 1, 256, 256),    # Gemma-3-270M
    (28, 4, 128, 128),    # a 7B-class GQA model
    (2, 2, 192, 128),     # K and V head dims apart (DeepSeek-style)
]


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("tk,tv", [("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"),
                                   ("q8_0", "f16"), ("f16", "q4_0")])
def test_kv_bytes_have_one_definition(cfg, tk, tv):
    from memfit.engine.engine import kv_pool_blocks
    from memfit.kv.quant import row_bytes, cache_type
    from memfit.memory.planner import ModelDesc, kv_bytes
    nl, hkv, dk, dv = cfg
    per_tok = kv_bytes_per_token(nl, hkv, dk, dv, tk, tv)
    # the formula itself, from the cache types' row sizes (2 B / value, 34 and 18 B per 32)
    per_val = {"f16": 2, "q8_0": 34 / 32, "q4_0": 18 / 32}
    assert per_tok == round(nl * hkv * (dk * per_val[tk] + dv * per_val[tv]))
    assert per_tok == nl * hkv * (row_bytes(cache_type(tk), dk) + row_bytes(cache_type(tv), dv))
    desc = ModelDesc(name="m", arch="llama", n_layer=nl, n_embd=256, n_head=8, n_head_kv=hkv,
                     head_dim=dk, head_dim_v=dv, n_ff=512, n_vocab=1000, tensors=[])
    n_ctx, n_par = 100, 3
    blocks = kv_pool_blocks(n_ctx, n_par)
    planned = kv_bytes(desc, n_ctx, None, n_par, tk, tv)
    pool = KVPool(nl, blocks, hkv, dk, dv, tk, cache_type_v=tv)
    assert planned == pool.nbytes == blocks * BS * per_tok
    assert desc.kv_cache_bytes(7, tk, tv) == 7 * per_tok


def test_planner_and_pool_count_with_the_one_formula(monkeypatch):
    """Change the one definition and the counters follow it: the planner's KV line is
    computed with it, and a pool whose arrays disagree with it refuses to exist."""
    import memfit.kv.storage as storage
    from memfit.memory.planner import ModelDesc, kv_bytes
    real = storage.kv_bytes_per_token
    desc = ModelDesc(name="m", arch="llama", n_layer=30, n_embd=576, n_head=9, n_head_kv=3,
                     head_dim=64, head_dim_v=64, n_ff=1536, n_vocab=1000, tensors=[])
    before = kv_bytes(desc, 512, None, 1, "q8_0", "q8_0")
    monkeypatch.setattr(storage, "kv_bytes_per_token", lambda *a, **k: real(*a, **k) + 1)
    assert kv_bytes(desc, 512, None, 1, "q8_0", "q8_0") == before + 512
    with pytest.raises(AssertionError):
        KVPool(30, 16, 3, 64, 64, "q8_0")


# --- perplexity, logprobs and KLD run in the engine's pool, counted by the ledger ----------

def _golden_text(golden_dir) -> str:
    text = (golden_dir / "GPL-3.txt").read_text(encoding="utf-8")
    return text[:-1] if text.endswith("\n") else text


@pytest.mark.realmodel
def test_evaluation_runs_in_the_engine_pool(smollm2_path, golden_dir):
    import memfit
    text = _golden_text(golden_dir)
    with memfit.load(smollm2_path, n_ctx=512, threads=2, mem_budget="2GiB") as m:
        pool = m.engine.pool
        assert m.ledger.items("kv") == {"kv_pool": pool.nbytes}  # the pool books its own bytes
        written = lambda: sum(int(np.count_nonzero(a)) for a in pool.k)  # noqa: E731
        assert written() == 0
        r = m.perplexity(text, ctx=512, max_chunks=1)
        assert r.chunks == 1 and 5 < r.ppl < 50
        n1 = written()  # the chunk's K rows went into the pool's blocks ...
        assert n1 > 0 and pool.n_used == 0  # ... and the blocks went back
        pool.k[0][...] = 0
        ids = m.tokenize(text)[:300]
        lp = m.logprobs(ids)
        assert lp.shape == (300, m.tokenizer.n_vocab) and pool.n_used == 0
        assert np.count_nonzero(pool.k[0]) > 0
        # the engine shares the pool: a generation after them is the cold one it always was
        g = m.generate(ids[:40], max_tokens=1, temperature=0, top_logprobs=1)
        assert g.ids[0] == int(np.argmax(lp[39]))
        # an evaluation that does not fit in the loaded context is refused, naming the fix
        with pytest.raises(RequestError, match="context of 1024 or more"):
            m.perplexity(text, ctx=1024, max_chunks=1)


@pytest.mark.realmodel
@pytest.mark.timeout(300)
def test_perplexity_under_budget_books_its_kv(smollm2_path, golden_dir, tmp_path):
    """A real `memfit perplexity --mem-budget` process: peak RSS (VmHWM) within the budget,
    with the debug ledger checking RSS against its entries, and --json showing the KV pool
    the evaluation ran in as the ledger's kv entry, the plan's KV line."""
    from test_budget_e2e import memfit
    f = tmp_path / "gpl.txt"
    f.write_text(_golden_text(golden_dir), encoding="utf-8")
    plan = memfit("plan", smollm2_path, "--mem-budget", "64GiB", "-c", 1024, "--json",
                  "--no-measure").json()
    budget = plan["min_budget_bytes"]
    r = memfit("perplexity", smollm2_path, "-f", f, "-c", 1024, "--chunks", 1, "--json",
               "-t", 2, "--mem-budget", budget, env={"MEMFIT_DEBUG_LEDGER": "1"})
    d = r.json()
    assert d["chunks"] == 1 and 5 < d["ppl"] < 50
    kv = 1024 * kv_bytes_per_token(30, 3, 64, 64, "f16", "f16")  # SmolLM2-135M, one sequence
    assert d["ledger"]["kv"] == {"kv_pool": kv} and d["kv_pool_bytes"] == kv == plan["kv_bytes"]
    assert r.peak_rss <= budget, f"peak RSS {r.peak_rss / 2**20:.1f} MiB > {budget / 2**20:.1f}"
    assert d["peak_rss_bytes"] <= budget


def test_engine_sequence_rolls_back_through_the_manager(tmp_path):
    """The engine's own Sequence (keyed by the scheduler) rolled back mid-request: its
    rolled-back block leaves the prefix cache, the engine recomputes the taken-back tokens,
    the block is keyed again with the same tokens, and a later request reuses it."""
    from memfit.engine.engine import Engine
    from memfit.engine.sampler import SamplingParams
    from memfit.gguf import open_gguf
    from memfit.models import load_model
    from memfit.models.synthetic import write_tiny_model
    from memfit.ops import get_ops
    from memfit.tokenizer import Tokenizer
    f = open_gguf(write_tiny_model(tmp_path / "q.gguf", "qwen3", "Q8_0", seed=21))
    tok = Tokenizer.from_metadata(f.metadata)
    tok.eog_ids = set()
    eng = Engine(load_model(f, ops=get_ops("native")), tok, n_ctx=256)
    pool, m = eng.pool, eng.pool.manager
    prompt = [(7 * i) % 200 + 3 for i in range(70)]
    rid = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=4))
    eng.step()  # the whole prompt, and its first token
    seq = eng.sequence(rid)
    assert seq.n_computed == 70 and seq.n_hashed == 2
    assert m.match_prefix(prompt) == _keys(prompt, 2)
    assert pool.rollback(seq, 40) == 40 and seq.n_computed == 30 and seq.n_hashed == 0
    assert m.match_prefix(prompt) == [] and len(seq.block_table) == 1
    # blocks for the tokens to recompute (the scheduler allocates at admission and per decode row)
    assert m.allocate_for(seq, len(seq.tokens) - seq.n_computed) and len(seq.block_table) == 3
    out = []
    while eng.has_unfinished():
        out += [o.token for o in eng.step() if o.request_id == rid]
    assert len(out) == 3  # the taken-back tokens were recomputed, then decoding went on
    assert m.match_prefix(prompt) == _keys(prompt, 2) and pool.n_used == 0
    rid2 = eng.add_request(prompt + [9], SamplingParams(temperature=0, max_tokens=1))
    while eng.has_unfinished():
        done = [o for o in eng.step() if o.request_id == rid2 and o.finished]
    assert done[0].cache_n == 64
