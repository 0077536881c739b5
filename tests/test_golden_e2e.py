"""End to end against llama.cpp's goldens: perplexity through the public API on the two real
small models. Next-token distributions are compared by KL divergence and top-1 agreement in
test_golden_kld.py (which replaced the per-step greedy rule)."""

from __future__ import annotations

import json

import pytest

import memfit

MODELS = {
    "smollm2": ("smollm2_path", "SmolLM2-135M-Instruct.Q4_1"),
    "gemma": ("gemma_path", "gemma-3-270m-q4_k_m"),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model_and_golden(request, golden_dir):
    fixture, stem = MODELS[request.param]
    path = request.getfixturevalue(fixture)
    with memfit.load(path) as m:
        yield m, stem, golden_dir


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
