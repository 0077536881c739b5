"""Speculative decoding with a draft model (spec/draft.py) and with the budget's resident layers
(spec/resident.py): greedy output equals the output without speculation under a budget that
streams the target, the draft's KV goes back when requests finish or abort, a draft with
another vocabulary is refused in one line, and the plan counts the draft."""

from __future__ import annotations

import re

import pytest

import memfit
from memfit.engine.sampler import SamplingParams
from memfit.errors import BudgetError, RequestError
from memfit.models.synthetic import write_tiny_model
from memfit.spec.draft import check_vocab

CTX = 256
PROMPTS = [[5, 17, 200, 33, 290, 64, 64, 128, 7, 255, 1, 5, 17, 200, 33, 64],
           [40, 41, 42, 43, 44, 40, 41, 42, 43, 44, 40, 41]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec_draft")
    # a target big enough that a budget streams part of it, and a 1-layer draft written with
    # the same tokenizer metadata and another seed
    target = write_tiny_model(d / "target.gguf", "llama", "Q8_0", seed=1, n_layer=6, n_embd=512,
                              n_ff=1024, n_head=8, n_head_kv=4)
    draft = write_tiny_model(d / "draft.gguf", "llama", "Q8_0", seed=2, n_layer=1)
    return target, draft


def _floor(path, **kw) -> int:
    with pytest.raises(BudgetError) as e:
        memfit.load(path, n_ctx=CTX, mem_budget="1MiB", n_parallel=2, **kw)
    return int(re.search(r"works is [\d.]+ \w+ \((\d+) bytes\)", str(e.value)).group(1))


def _streaming(path, extra_mib: float, **kw):
    """The model loaded at a budget extra_mib above its floor (measured now: the baseline is
    this process's RSS), which must stream part of the weights."""
    m = memfit.load(path, n_ctx=CTX, mem_budget=_floor(path, **kw) + int(extra_mib * 2**20),
                    n_parallel=2, **kw)
    assert m.plan is not None and m.plan.tiers["file"], "the budget should stream the target"
    return m


def _greedy(m, **kw):
    if m.runtime.draft is not None:
        m.runtime.draft.p_min = 0.0   # random weights are never confident: propose anyway
    ban = {i: -100.0 for i in m.tokenizer.eog_ids}   # random weights: keep generating
    return [c.ids for c in m.generate(PROMPTS, max_tokens=40, temperature=0, logit_bias=ban,
                                      **kw)]


@pytest.fixture(scope="module")
def reference(tiny):
    with _streaming(tiny[0], 3, spec="off") as m:
        return _greedy(m)


def test_draft_model_greedy_equals_off_and_frees_kv(tiny, reference):
    target, draft = tiny
    with _streaming(target, 3, spec="draft", model_draft=draft) as m:
        assert m.plan.draft["weights_bytes"] > 0 and "draft model draft" in m.plan.format()
        # every part books its own bytes: the draft's weights, KV pool and scratch
        assert m.ledger.items("resident_weights")["draft_weights"] == m.plan.draft["weights_bytes"]
        assert m.ledger.items("kv")["draft_kv_pool"] == m.runtime.draft.pool.nbytes
        assert m.ledger.items("scratch")["draft_model"] == m.plan.draft["scratch_bytes"]
        assert _greedy(m) == reference
        st = m.spec_stats()["proposers"]["draft"]
        assert st["proposed"] > 0
        d = m.runtime.draft
        assert d.pool.n_used == 0 and d.n_shadows == 0   # released when the requests finished


def test_target_as_its_own_draft_accepts_everything(tiny, reference):
    target, _ = tiny
    with _streaming(target, 3, spec="draft", model_draft=target, draft_max=6) as m:
        assert _greedy(m) == reference
        st = m.spec_stats()["proposers"]["draft"]
        assert st["proposed"] > 20 and st["acceptance_rate"] == 1.0


def test_abort_frees_the_draft_kv(tiny):
    target, draft = tiny
    with _streaming(target, 3, spec="draft", model_draft=draft) as m:
        eng, d = m.engine, m.runtime.draft
        ban = {i: -100.0 for i in m.tokenizer.eog_ids}
        rid = eng.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=100,
                                                         logit_bias=ban))
        d.p_min = 0.0
        while d.n_shadows == 0:
            eng.step()
        eng.step()
        assert d.pool.n_used > 0
        eng.abort(rid)
        outs = eng.step()
        assert outs[-1].finish_reason == "abort"
        assert d.pool.n_used == 0 and d.n_shadows == 0 and eng.pool.n_used == 0


def test_mismatched_vocabulary_is_refused_in_one_line(tiny, smollm2_path):
    target, _ = tiny
    with pytest.raises(RequestError) as e:
        memfit.load(target, n_ctx=CTX, spec="draft", model_draft=smollm2_path)
    msg = str(e.value)
    assert "vocabulary" in msg and "\n" not in msg
    # same size, another token text
    md = {"tokenizer.ggml.tokens": ["a", "b", "c"]}
    with pytest.raises(RequestError, match="token 2 is 'x' there but 'c'"):
        check_vocab(md, 3, {"tokenizer.ggml.tokens": ["a", "b", "x"]}, 3, "d.gguf")


def test_budget_too_small_for_both_names_the_draft(tiny):
    target, draft = tiny
    with pytest.raises(BudgetError) as e:
        memfit.load(target, n_ctx=CTX, mem_budget="1MiB", spec="draft", model_draft=draft)
    assert "the draft model pinned whole" in str(e.value)
    assert _floor(target, spec="draft", model_draft=draft) > _floor(target, spec="off")


def test_draft_mode_without_a_draft_model_is_refused(tiny):
    with pytest.raises(RequestError, match="--model-draft FILE"):
        memfit.load(tiny[0], n_ctx=CTX, spec="draft")


def _resident(target):
    """A budget that streams part of the target but pins its output head (the tied
    embedding): the resident draft's precondition."""
    last = None
    for extra in (8, 9, 10, 7, 11, 12):
        try:
            m = _streaming(target, extra, spec="resident")
        except (RequestError, AssertionError) as e:   # head streams, or nothing streams
            last = e
            continue
        return m
    raise AssertionError(f"no budget for the resident draft: {last}")


def test_resident_greedy_equals_off(tiny, reference):
    with _resident(tiny[0]) as m:
        d = m.runtime.draft
        assert d.attn_layers and len(d.ffn_layers) < m.config.n_layer
        assert _greedy(m) == reference
        assert m.spec_stats()["proposers"]["resident"]["proposed"] > 0
        assert d.pool.n_used == 0 and d.n_shadows == 0


def test_resident_needs_a_streaming_budget(tiny):
    with pytest.raises(RequestError, match="needs a budget that streams") as e:
        memfit.load(tiny[0], n_ctx=CTX, spec="resident")
    assert "\n" not in str(e.value)
