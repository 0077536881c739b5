"""The sampler chain, each transform on hand-made logits; stop strings; top logprobs."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from memfit.engine.sampler import Sampler, SamplingParams, StopMatcher, top_logprobs
from memfit.errors import RequestError

OFF = dict(top_k=0, top_p=1.0, min_p=0.0)  # every filter disabled


def _logits(probs) -> np.ndarray:
    return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


def _draws(params: SamplingParams, logits, n=2000, history=()) -> Counter:
    s = Sampler(params, len(logits))
    return Counter(s.sample(logits, list(history)) for _ in range(n))


def test_defaults_are_llama_cpp():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.8, 40, 0.95, 0.05)
    assert (p.repeat_penalty, p.repeat_last_n, p.presence_penalty, p.frequency_penalty) == (1.0, 64, 0.0, 0.0)
    assert p.seed is None and p.max_tokens is None and p.stop == []


def test_greedy_is_argmax():
    rng = np.random.default_rng(0)
    for _ in range(20):
        x = rng.standard_normal(1000).astype(np.float32)
        assert Sampler(SamplingParams(temperature=0.0), 1000).sample(x, []) == int(np.argmax(x))
    assert Sampler(SamplingParams(temperature=-1.0), 3).sample(np.float32([0, 5, 1]), []) == 1


def test_top_k_only_returns_the_k_best():
    x = _logits([0.2, 0.1, 0.3, 0.15, 0.25])  # best two: ids 2, 4
    seen = _draws(SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, seed=1), x)
    assert set(seen) == {2, 4}
    # renormalized 0.3 : 0.25
    assert abs(seen[2] / 2000 - 0.3 / 0.55) < 0.05


def test_top_p_cutoff_includes_the_crossing_token():
    x = _logits([0.5, 0.3, 0.15, 0.05])
    # cumulative 0.5, 0.8, 0.95: top_p 0.8 keeps {0, 1}; 0.81 also needs token 2
    assert set(_draws(SamplingParams(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0, seed=2), x)) == {0, 1}
    assert set(_draws(SamplingParams(temperature=1.0, top_k=0, top_p=0.81, min_p=0.0, seed=2), x)) == {0, 1, 2}
    assert set(_draws(SamplingParams(temperature=1.0, top_k=0, top_p=0.3, min_p=0.0, seed=2), x)) == {0}


def test_top_p_on_a_large_vocab_matches_the_full_sort():
    # a flat distribution: the nucleus is larger than the partial-sort prefix
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(5000) * 0.1).astype(np.float32)
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=0.5, min_p=0.0, seed=3), 5000)
    kept = s._top_p(x, np.arange(5000))
    order = np.argsort(-x, kind="stable")
    p = np.exp(x.astype(np.float64) - x.max())
    p /= p.sum()
    n = int(np.argmax(np.cumsum(p[order]) >= 0.5)) + 1
    assert n > 512 and np.array_equal(kept, order[:n])


def test_min_p_relative_to_the_best():
    x = _logits([0.4, 0.1, 0.05, 0.45])
    # min_p 0.2: threshold 0.09 keeps 0, 1, 3; min_p 0.5 keeps 0, 3
    assert set(_draws(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2, seed=4), x)) == {0, 1, 3}
    assert set(_draws(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.5, seed=4), x)) == {0, 3}


def test_temperature_sharpens_and_flattens():
    x = _logits([0.6, 0.4])
    cold = _draws(SamplingParams(temperature=0.25, seed=5, **OFF), x)
    hot = _draws(SamplingParams(temperature=4.0, seed=5, **OFF), x)
    # p0 at T: 0.6^(1/T) / (0.6^(1/T) + 0.4^(1/T))
    for seen, t in ((cold, 0.25), (hot, 4.0)):
        want = 0.6 ** (1 / t) / (0.6 ** (1 / t) + 0.4 ** (1 / t))
        assert abs(seen[0] / 2000 - want) < 0.04, (t, seen, want)


def test_repeat_penalty_flips_the_argmax():
    x = np.float32([2.0, 1.5, -1.0])
    greedy = SamplingParams(temperature=0, repeat_penalty=1.5)
    assert Sampler(greedy, 3).sample(x, [0]) == 1  # 2.0 / 1.5 < 1.5
    assert Sampler(greedy, 3).sample(x, [2]) == 0
    out = Sampler(greedy, 3).penalize(x, [0, 2, 2])
    assert np.allclose(out, [2.0 / 1.5, 1.5, -1.5])  # negative logits are multiplied
    assert np.array_equal(x, [2.0, 1.5, -1.0])  # the caller's logits are untouched


def test_repeat_last_n_window():
    x = np.float32([2.0, 1.5, 0.0])
    hist = [0, 2, 2]  # token 0 is penalized only when the window reaches back 3 tokens
    for last_n, want in ((2, 0), (3, 1), (-1, 1), (0, 0)):
        p = SamplingParams(temperature=0, repeat_penalty=2.0, repeat_last_n=last_n)
        assert Sampler(p, 3).sample(x, hist) == want, last_n


def test_presence_and_frequency_math():
    x = np.float32([1.0, 1.0, 1.0, 1.0])
    p = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25, repeat_penalty=1.2)
    out = Sampler(p, 4).penalize(x, [1, 2, 2, 2])
    # id 1: 1/1.2 - 1*0.25 - 0.5; id 2: 1/1.2 - 3*0.25 - 0.5
    assert np.allclose(out, [1.0, 1 / 1.2 - 0.75, 1 / 1.2 - 1.25, 1.0], atol=1e-6)
    neg = Sampler(SamplingParams(presence_penalty=-1.0), 4).penalize(x, [3])
    assert np.allclose(neg, [1, 1, 1, 2])  # negative values encourage repeats


def test_seed_determinism():
    x = (np.random.default_rng(6).standard_normal(300)).astype(np.float32)
    p = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=1234)

    def run(params):
        s = Sampler(params, 300)
        return [s.sample(x, []) for _ in range(50)]

    a, b = run(p), run(SamplingParams(**{**vars(p), "stop": []}))
    assert a == b and len(set(a)) > 5
    assert run(SamplingParams(**{**vars(p), "seed": 99})) != a


def test_sampling_frequencies_follow_softmax():
    probs = [0.5, 0.25, 0.125, 0.125]
    seen = _draws(SamplingParams(temperature=1.0, seed=7, **OFF), _logits(probs), n=4000)
    for i, q in enumerate(probs):
        assert abs(seen[i] / 4000 - q) < 0.03


def test_top_logprobs_full_softmax():
    x = np.float32([1.0, 3.0, 2.0, 3.0])
    e = np.exp(np.float64(x) - 3)
    p = e / e.sum()
    top = top_logprobs(x, 3)
    assert [i for i, _ in top] == [1, 3, 2]  # tie 1/3 broken by lower id
    assert np.allclose([q for _, q in top], p[[1, 3, 2]])
    assert top_logprobs(x, 0) == [] and len(top_logprobs(x, 10)) == 4
    assert math.isclose(sum(q for _, q in top_logprobs(x, 4)), 1.0)


@pytest.mark.parametrize("bad", [
    dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=-0.1), dict(min_p=2.0),
    dict(repeat_penalty=0.0), dict(repeat_last_n=-2), dict(presence_penalty=3.0),
    dict(frequency_penalty=-2.5), dict(temperature=float("nan")), dict(top_k=1.5),
    dict(seed="x"), dict(max_tokens=-5), dict(stop=[""]), dict(stop=[3]),
])
def test_invalid_params(bad):
    name = next(iter(bad))
    with pytest.raises(RequestError, match=name):
        SamplingParams(**bad)


def test_param_normalization():
    p = SamplingParams(seed=-1, max_tokens=-1, stop="END")
    assert p.seed is None and p.max_tokens is None and p.stop == ["END"]
    assert SamplingParams(stop=None).stop == []


def _stream(stops, chunks):
    m = StopMatcher(stops)
    out = []
    for c in chunks:
        text, stopped = m.push(c)
        out.append(text)
        if stopped:
            return "".join(out), True, m
    out.append(m.flush())
    return "".join(out), False, m


def test_stop_across_chunk_boundaries():
    text, stopped, m = _stream(["</s>"], ["Hello <", "/", "s> world"])
    assert (text, stopped, m.matched) == ("Hello ", True, "</s>")
    # what could be a stop is held back, then released when it is not
    m = StopMatcher(["STOP"])
    assert m.push("abc ST") == ("abc ", False)
    assert m.push("O") == ("", False)
    assert m.push("x") == ("STOx", False)
    assert m.push("ST") == ("", False)
    assert m.flush() == "ST"


def test_stop_picks_the_earliest_and_ignores_later_text():
    text, stopped, m = _stream(["world", "lo"], ["hello world"])
    assert (text, stopped, m.matched) == ("hel", True, "lo")
    m = StopMatcher(["x"])
    assert m.push("ax") == ("a", True)
    assert m.push("more") == ("", True)
    assert m.flush() == ""


def test_stop_char_by_char_equals_whole():
    whole = "The answer is 42.\nUser: next"
    for stops in (["\nUser:"], ["42", "\n"], ["zzz"], []):
        a = _stream(stops, [whole])
        b = _stream(stops, list(whole))
        assert a[:2] == b[:2]
    assert _stream(["\nUser:"], list(whole))[0] == "The answer is 42."
    assert _stream([], list(whole))[0] == whole


def test_stop_matcher_rejects_empty_stop():
    with pytest.raises(RequestError, match="stop"):
        StopMatcher([""])
