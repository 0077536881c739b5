"""Exact by construction: a sequence's tokens and logits are the same bits cold, after a
prefix-cache hit, chunked at any size, batched with other sequences added at any step, and
recomputed after preemption, for every architecture and KV cache type; and on the real models
the first token's distribution after a cache hit is the teacher-forced one.

The kernels keep each row independent of its call (tests/test_batch_invariance_kernels.py);
the engine keeps each position's kind (prompt row / decode row) fixed (engine/scheduler.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import isa_paths

from memfit.engine.engine import Engine
from memfit.engine.sampler import SamplingParams
from memfit.models import load_model
from memfit.models.synthetic import write_tiny_model
from memfit.ops import get_ops
from memfit.tokenizer import Tokenizer

ARCHS = ["llama", "qwen2", "qwen3", "gemma3", "qwen3moe", "qwen2moe", "mixtral", "olmoe", "glm4moe",
         "deepseek2", "gpt-oss"]
KV = ["f16", "q8_0", "q4_0"]
N_GEN = 8
PREFIX = [3 + (i * 11) % 240 for i in range(40)]  # one full 32-token block and 8 more
# 1-4 tokens past the cached block (the cases that differed), longer tails, another prefix
PROMPTS = [PREFIX[:33], PREFIX[:34], PREFIX[:35], PREFIX[:36], PREFIX + [7, 9, 11],
           PREFIX + list(range(60, 90)), [5, 17, 200], [101]]


def _tiny(tmp_path, arch):
    from memfit.gguf import open_gguf
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, "Q4_K", seed=31)
    f = open_gguf(path)
    tok = Tokenizer.from_metadata(f.metadata)
    tok.eog_ids = set()
    return load_model(f, ops=get_ops("native")), tok


class Recorder:
    """Runs requests on one engine; per request the sampled tokens and the bits of every
    sampled row's logits (the engine's own, captured where it samples)."""

    def __init__(self, eng: Engine):
        self.eng, self.logits, self.toks = eng, {}, {}
        sample = eng._sample

        def keep(s, lg):
            self.logits.setdefault(s.request_id, []).append(lg.copy())
            return sample(s, lg)
        eng._sample = keep

    def add(self, ids, n=N_GEN) -> str:
        rid = self.eng.add_request(ids, SamplingParams(temperature=0, max_tokens=n))
        self.toks[rid] = []
        return rid

    def step(self):
        for o in self.eng.step():
            if o.token is not None:
                self.toks[o.request_id].append(o.token)

    def drain(self):
        while self.eng.has_unfinished():
            self.step()
        assert self.eng.pool.n_used == 0

    def result(self, rid):
        return self.toks[rid], np.stack(self.logits[rid]).view(np.uint32)


def _engine(model, tok, kv, n_parallel=1, n_batch=512, n_blocks=None):
    return Engine(model, tok, n_ctx=160, n_parallel=n_parallel, n_batch=n_batch,
                  cache_type=kv, cache_type_v=kv, n_blocks=n_blocks)


def _alone(model, tok, kv, ids, n=N_GEN, **kw):
    r = Recorder(_engine(model, tok, kv, **kw))
    rid = r.add(ids, n=n)
    r.drain()
    return r.result(rid)


def _same(a, b, what):
    assert a[0] == b[0], f"{what}: tokens {a[0]} != {b[0]}"
    assert np.array_equal(a[1], b[1]), f"{what}: logits differ in row(s) {np.nonzero((a[1] != b[1]).any(1))[0]}"


@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("arch", ARCHS)
def test_cold_cached_chunked_batched_preempted(tmp_path, arch, kv):
    model, tok = _tiny(tmp_path, arch)
    _battery(model, tok, kv, [_alone(model, tok, kv, p) for p in PROMPTS], f"{arch} {kv}")


def _battery(model, tok, kv, cold, what):
    """cached, chunked, batched and preempted runs of PROMPTS on ``model``, each the same bits
    as ``cold`` (the prompts run alone, one engine each)"""
    # cached: the prefix's first block is warm, each prompt then computes only its tail
    r = Recorder(_engine(model, tok, kv, n_parallel=2))
    r.add(PREFIX, n=2)
    r.drain()
    for p, c in zip(PROMPTS, cold):
        rid = r.add(p)
        r.drain()
        _same(r.result(rid), c, f"{what} cached, prompt of {len(p)}")
    assert r.eng.scheduler.prefix_hits >= 5 * 32
    # chunked prefill at several sizes
    for nb in (3, 16, 33):
        for p, c in zip(PROMPTS[4:6], cold[4:6]):
            _same(_alone(model, tok, kv, p, n_batch=nb), c, f"{what} chunks of {nb}")
    # batched: the prompts join at random steps next to each other (seeded, several orders)
    for seed in range(3):
        rng = np.random.default_rng(seed)
        r = Recorder(_engine(model, tok, kv, n_parallel=8, n_batch=int(rng.choice([8, 64, 512]))))
        order = rng.permutation(len(PROMPTS))
        rids = {}
        for i in order:
            rids[i] = r.add(PROMPTS[i])
            for _ in range(int(rng.integers(0, 4))):
                r.step()
        r.drain()
        for i, rid in rids.items():
            _same(r.result(rid), cold[i], f"{what} batched seed {seed}, prompt {i}")
    # preempted: a pool too small for all, so sequences are evicted and recomputed
    r = Recorder(_engine(model, tok, kv, n_parallel=4, n_blocks=5))
    steps, schedule = [], r.eng.scheduler.schedule
    r.eng.scheduler.schedule = lambda: (lambda s: (steps.append(s), s)[1])(schedule())
    rids = [r.add(p, n=40) for p in PROMPTS[4:8]]
    r.drain()
    assert r.eng.scheduler.n_preempted > 0
    # the evicted sequences' generated tokens were recomputed as decode rows, several a step
    assert any(s is not None and s.decode and sum(s.n_tokens) > len(s.seqs) for s in steps)
    long_cold = [_alone(model, tok, kv, p, n=40) for p in PROMPTS[4:8]]
    for rid, c, p in zip(rids, long_cold, PROMPTS[4:8]):
        _same(r.result(rid), c, f"{what} preempted, prompt of {len(p)}")


@pytest.mark.parametrize("arch, kv", [("llama", "f16"), ("qwen3moe", "q8_0"), ("qwen2moe", "q4_0")])
def test_exact_under_a_budget(tmp_path, arch, kv):
    # the weights streamed from the file at the budget's floor (the experts through the
    # cache's few slots, prefill in expert groups): the same bits as the memory-mapped model
    from memfit.gguf import open_gguf
    from memfit.memory.bandwidth import Bandwidth
    from memfit.memory.ledger import Ledger
    from memfit.memory.planner import ModelDesc, plan
    from memfit.memory.store import WeightStore
    mapped, tok = _tiny(tmp_path, arch)
    cold = [_alone(mapped, tok, kv, p) for p in PROMPTS]
    f = open_gguf(tmp_path / f"{arch}.gguf")
    desc = ModelDesc.from_gguf(f)
    floor = plan(desc, 1 << 40, 160, 8, Bandwidth(10e9, 1e9, "test"), baseline_bytes=0, n_batch=64).min_budget_bytes
    p = plan(desc, floor, 160, 8, Bandwidth(10e9, 1e9, "test"), baseline_bytes=0, n_batch=64)
    store = WeightStore(f, p, Ledger(None, debug=""))
    try:
        streamed = load_model(f, weights=store)
        _battery(streamed, tok, kv, cold, f"{arch} {kv} under a budget")
        st = store.stats()
        assert st["bytes_read"] > 0, st  # weights did stream
    finally:
        store.close()
        f.close()


@pytest.mark.parametrize("isa", ["scalar", "avx2"])
@pytest.mark.parametrize("arch, kv", [("llama", "q8_0"), ("qwen3moe", "f16"), ("gemma3", "q4_0")])
def test_exact_on_other_isas(tmp_path, arch, kv, isa):
    # the same cases on the other kernel paths this CPU runs (the default one is above)
    from memfit import _native
    if isa not in isa_paths():
        pytest.skip(f"no {isa} kernels on this CPU")
    before = _native.isa()
    _native.set_isa(isa)
    try:
        test_cold_cached_chunked_batched_preempted(tmp_path, arch, kv)
    finally:
        _native.set_isa(before)


@pytest.mark.realmodel
@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("which", ["smollm2", "gemma"])
def test_real_models_cached_equals_cold_and_teacher_forced(which, kv, request):
    """Issue 17's case: warm the first 32-token block, then 1..16 uncached tokens: the first
    token's logits equal the cold run's and the teacher-forced ones (eval/logits.py, what
    api.logprobs and perplexity use) bit for bit; batched with neighbours the greedy tokens
    equal alone."""
    import memfit
    from memfit.eval.logits import iter_logits
    path = request.getfixturevalue(f"{which}_path")
    text = ("The quick brown fox jumps over the lazy dog. Memory budgets matter when a model "
            "is larger than the machine, so every byte counts and every token is computed once. "
            "A second sentence follows the first, and a third one after it, to make the prompt "
            "long enough for two blocks of the cache.")
    with memfit.load(path, n_ctx=256, n_parallel=4, cache_type_k=kv, cache_type_v=kv) as m:
        ids = m.tokenize(text)[:48]
        assert len(ids) == 48
        teacher = np.empty((len(ids), tok_n := m.tokenizer.n_vocab), np.float32)
        for row, lg in iter_logits(m, ids):
            teacher[row:row + len(lg)] = lg
        assert tok_n == teacher.shape[1]
        model, tok = m.model, m.tokenizer
        warm = Recorder(Engine(model, tok, 256, 2, cache_type=kv, cache_type_v=kv))
        warm.add(ids[:33], n=1)
        warm.drain()
        for n in (33, 34, 35, 36, 37, 41, 48):
            rid = warm.add(ids[:n], n=1)
            warm.drain()
            cached = warm.result(rid)
            _same(cached, _alone(model, tok, kv, ids[:n], n=1), f"{which} {kv} cached vs cold, n={n}")
            assert np.array_equal(cached[1][0], teacher[n - 1].view(np.uint32)), \
                f"{which} {kv} n={n}: engine logits differ from the teacher-forced ones"
        prompts = [ids[:33], ids[:40], ids[5:45], ids[:48]]
        both = m.generate(prompts, max_tokens=12, temperature=0)
        alone = [m.generate(p, max_tokens=12, temperature=0) for p in prompts]
        assert [b.ids for b in both] == [a.ids for a in alone]
