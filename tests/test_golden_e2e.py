"""End to end against llama.cpp's goldens: greedy continuations and perplexity, through the
public API (tokenizer + model + sampler), on the two real small models."""

from __future__ import annotations

import json

import pytest

import memfit
from conftest import load_jsonl

MODELS = {
    "smollm2": ("smollm2_path", "SmolLM2-135M-Instruct.Q4_1"),
    "gemma": ("gemma_path", "gemma-3-270m-q4_k_m"),
}
STEPS = 32


@pytest.fixture(scope="module", params=list(MODELS))
def model_and_golden(request, golden_dir):
    fixture, stem = MODELS[request.param]
    path = request.getfixturevalue(fixture)
    with memfit.load(path) as m:
        yield m, stem, golden_dir


def compare_greedy(m, case) -> tuple[int, float]:
    """Returns (steps compared, max prob diff); asserts the golden rule of issue 2."""
    r = m.generate(case["prompt"], max_tokens=STEPS, temperature=0, top_logprobs=5)
    assert r.prompt_ids == case["prompt_ids"]
    worst = 0.0
    for k, (tok, top, gold) in enumerate(zip(r.ids, r.top, case["steps"][:STEPS])):
        gtop = gold["top5"]
        if tok == gold["id"]:
            diff = abs(top[0][1] - gtop[0][1])
            worst = max(worst, diff)
            assert diff <= 0.05, f"{case['case']} step {k}: p={top[0][1]:.4f} vs golden {gtop[0][1]:.4f}"
            continue
        near_tie = gtop[0][1] - gtop[1][1] < 0.05
        assert near_tie and tok in [i for i, _ in gtop], (
            f"{case['case']} step {k}: memfit chose {tok} (p={top[0][1]:.4f}), golden {gold['id']} "
            f"top5 {gtop}")
        return k, worst
    return min(len(r.ids), STEPS), worst


@pytest.mark.realmodel
def test_greedy_matches_llamacpp(model_and_golden):
    m, stem, golden_dir = model_and_golden
    cases = load_jsonl(golden_dir / f"greedy_{stem}.jsonl")
    assert len(cases) >= 12
    compared = [compare_greedy(m, c) for c in cases]
    # most cases must run the full 32 steps in agreement; parting is only allowed at near-ties
    assert sum(k for k, _ in compared) >= 0.5 * STEPS * len(cases), compared


@pytest.mark.realmodel
def test_perplexity_matches_llamacpp(model_and_golden):
    m, stem, golden_dir = model_and_golden
    gold = next(r for r in json.loads((golden_dir / "perplexity.json").read_text())["results"]
                if r["model"] == stem + ".gguf")
    text = (golden_dir / "GPL-3.txt").read_text(encoding="utf-8")
    if text.endswith("\n"):
        text = text[:-1]
    r = m.perplexity(text, ctx=512)
    assert r.n_tokens == gold["n_tokens"]
    assert r.chunks == gold["n_chunks"]
    assert abs(r.ppl - gold["ppl"]) / gold["ppl"] < 0.01, (r.ppl, gold["ppl"])
    assert abs(r.ppl_err - gold["ppl_err"]) / gold["ppl_err"] < 0.05
