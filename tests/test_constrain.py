"""Constrained decoding (memfit/constrain, engine.py) on the two real models: every schema of
tests/schemas.py gives JSON that parses and validates (jsonschema), greedy and sampled, with
each request of a batch under its own constraint; regex, Lark and GBNF grammars; schemas
llguidance cannot compile are a ConstraintError naming the problem; forced tokens are used
and give the same tokens as feeding them one forward each; a constrained greedy sequence is
the same alone and batched; logit_bias bans (-100) and forces (+100) tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

import memfit
from memfit.constrain import ConstraintError, compile_constraint
from memfit.engine.sampler import SamplingParams
from memfit.errors import RequestError

from schemas import SCHEMAS, UNSUPPORTED

MODELS = ["smollm2_path", "gemma_path"]
MAX_TOKENS = 300


@pytest.fixture(scope="module", params=MODELS, ids=["smollm2", "gemma3"])
def model(request):
    m = memfit.load(str(request.getfixturevalue(request.param)), n_parallel=8, n_ctx=2048)
    yield m
    m.close()


def _prompt(m, name: str, schema: dict) -> list[int]:
    text = m.apply_chat_template([{"role": "user", "content":
                                   f"Reply with a JSON example of a {name.replace('_', ' ')} "
                                   f"following this schema: {json.dumps(schema)}"}])
    return m.tokenize(text)


def _spec(schema: dict) -> dict:
    return {"type": "json_schema", "schema": schema, "strict": True}


def _run(m, reqs, params: SamplingParams, fast_forward: bool = True, n_top: int = 0):
    """reqs [(prompt ids, Grammar | None)] together on the model's engine (each with its own
    constraint) -> per request {ids, text, finish, forced, outs}; and the steps taken."""
    eng = m.engine
    eng.fast_forward, steps0 = fast_forward, eng.n_steps
    try:
        rids = [eng.add_request(ids, params, constraint=g, n_top=n_top) for ids, g in reqs]
        res = {r: {"ids": [], "text": "", "finish": None, "outs": []} for r in rids}
        while eng.has_unfinished():
            for o in eng.step():
                d = res[o.request_id]
                d["outs"].append(o)
                if o.token is not None:
                    d["ids"].append(o.token)
                d["text"] += o.text
                if o.finished:
                    d["finish"] = o.finish_reason
    finally:
        eng.fast_forward = True
    assert eng.pool.n_used == 0
    return [res[r] for r in rids], eng.n_steps - steps0


def _check_valid(results, schemas):
    for (name, schema), r in zip(schemas, results):
        assert r["finish"] == "stop", (name, r["text"])
        doc = json.loads(r["text"])
        jsonschema.validate(doc, schema)


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_every_schema_validates_batched(model, temperature):
    m = model
    reqs = [(_prompt(m, n, s), compile_constraint(m.tokenizer, _spec(s))) for n, s in SCHEMAS]
    forced0, con0 = m.engine.n_forced, m.engine.n_constrained
    results, _ = _run(m, reqs, SamplingParams(temperature=temperature, seed=11,
                                              max_tokens=MAX_TOKENS))
    _check_valid(results, SCHEMAS)
    n_forced, n_con = m.engine.n_forced - forced0, m.engine.n_constrained - con0
    assert n_con == sum(len(r["ids"]) for r in results)
    assert 0.2 * n_con < n_forced < n_con  # separators and keys are forced, values are not


def test_constrained_greedy_alone_equals_batched(model):
    m = model
    chosen = SCHEMAS[:3] + SCHEMAS[-3:]
    reqs = [(_prompt(m, n, s), compile_constraint(m.tokenizer, _spec(s))) for n, s in chosen]
    batched, _ = _run(m, reqs + [(m.tokenize("Once upon a time"), None)],
                      SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    for (name, schema), (ids, _), b in zip(chosen, reqs, batched):
        alone = m.generate(ids, max_tokens=MAX_TOKENS, temperature=0, json_schema=schema)
        assert alone.ids == b["ids"], name
        assert alone.text == b["text"] and alone.finish_reason == "stop"


def test_forced_tokens_equal_one_per_forward(model):
    """Forced tokens appended at once and computed together in the next decode step give the
    same tokens (hence the same logits) as feeding them one forward each (fast_forward off),
    in fewer steps; the forced runs share decode steps with other sequences' rows."""
    m = model
    chosen = [SCHEMAS[i] for i in (1, 9, 18)]
    reqs = [(_prompt(m, n, s), compile_constraint(m.tokenizer, _spec(s))) for n, s in chosen]
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=MAX_TOKENS)
    seen = []
    run = m.engine.runner.run

    def spy(sched):
        seen.append((sched.decode, list(sched.n_tokens)))
        return run(sched)

    eng = m.engine
    eng.runner.run = spy
    per_seq: dict[str, int] = {}
    push = eng._push_forced

    def count(s, toks):   # forced tokens per sequence, then the engine's own work
        per_seq[s.request_id] = per_seq.get(s.request_id, 0) + len(toks)
        return push(s, toks)

    eng._push_forced = count
    f0 = eng.n_forced
    try:
        fast, steps_fast = _run(m, reqs, params)
    finally:
        del eng.runner.run
        del eng._push_forced
    f1 = eng.n_forced
    slow, steps_slow = _run(m, reqs, params, fast_forward=False)
    assert [r["ids"] for r in fast] == [r["ids"] for r in slow]
    assert [r["text"] for r in fast] == [r["text"] for r in slow]
    _check_valid(fast, chosen)
    n_forced = f1 - f0
    assert n_forced > 10 and eng.n_forced - f1 == n_forced and sum(per_seq.values()) == n_forced
    # one forward per token without fast-forward; with it, a forced run costs none of its own.
    # The sequences decode side by side, so the steps are the longest one's: the saving is at
    # least the forced tokens of the sequence that is longest with fast-forward, hence at least
    # the fewest any sequence had (each of the three is forced some)
    assert len(per_seq) == len(reqs)
    assert steps_slow - steps_fast >= min(per_seq.values()) > 0
    # a decode step carried a forced run (k > 1) beside another sequence's row
    assert any(d and len(k) > 1 and max(k) > 1 for d, k in seen)


def test_forced_tokens_outputs_logprobs_and_max_tokens(model):
    m = model
    name, schema = SCHEMAS[1]
    g = compile_constraint(m.tokenizer, _spec(schema))
    f0 = m.engine.n_forced
    (r,), _ = _run(m, [(_prompt(m, name, schema), g)],
                   SamplingParams(temperature=0, max_tokens=MAX_TOKENS), n_top=3)
    n_forced = m.engine.n_forced - f0
    outs = [o for o in r["outs"] if o.token is not None]
    certain = [o for o in outs if o.logprob == 0.0 and o.top == [[o.token, 0.0]]]
    assert len(certain) >= n_forced >= 5  # '{"name": "' and the other keys
    # sampled rows: logprobs of the masked distribution, only tokens the grammar allows
    for o in outs:
        assert 1 <= len(o.top) <= 3 and all(-1e9 < lp <= 0.0 for _, lp in o.top)
        assert o.top[0][0] == o.token and o.logprob == pytest.approx(o.top[0][1], abs=1e-6)
    # max_tokens counts forced tokens: a cut JSON text ends with "length"
    (cut,), _ = _run(m, [(_prompt(m, name, schema), g)], SamplingParams(temperature=0, max_tokens=7))
    assert cut["finish"] == "length" and len(cut["ids"]) == 7
    assert cut["ids"] == r["ids"][:7]


def test_python_api_stream_and_batch(model):
    m = model
    name, schema = SCHEMAS[0]
    text = m.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}])
    pieces = list(m.stream(text, max_tokens=MAX_TOKENS, temperature=0, json_schema=schema))
    assert len(pieces) > 3
    jsonschema.validate(json.loads("".join(pieces)), schema)
    got = m.generate([text, text + " Someone old."], max_tokens=MAX_TOKENS, temperature=0,
                     json_schema=json.dumps(schema))  # JSON text is accepted too
    assert got[0].text == "".join(pieces)
    for c in got:
        jsonschema.validate(json.loads(c.text), schema)


def test_regex_lark_gbnf(model):
    m = model
    ask = m.apply_chat_template([{"role": "user", "content": "What is the phone number of the "
                                                            "office? Is it open today?"}])
    for temperature in (0.0, 1.0):
        kw = dict(max_tokens=60, temperature=temperature, seed=3)
        r = m.generate(ask, regex=r"\(?[0-9]{3}\)? [0-9]{3}-[0-9]{4}", **kw)
        assert re.fullmatch(r"\(?[0-9]{3}\)? [0-9]{3}-[0-9]{4}", r.text) and r.finish_reason == "stop"
        lark = ('start: "Answer: " ANSWER " because " REASON "."\n'
                'ANSWER: "yes" | "no"\nREASON: /[a-z ]{1,30}/\n')
        r = m.generate(ask, grammar=lark, **kw)
        assert re.fullmatch(r"Answer: (yes|no) because [a-z ]{1,30}\.", r.text), r.text
        lark_json = ('start: "Result: " obj\n'
                     'obj: %json{"type": "object", "properties": {"open": {"type": "boolean"}},'
                     ' "required": ["open"], "additionalProperties": false}\n')
        r = m.generate(ask, grammar=lark_json, **kw)
        assert r.text.startswith("Result: ") and isinstance(json.loads(r.text[8:])["open"], bool)
        gbnf = 'root ::= ("yes" | "no") ", " digit digit "%"\ndigit ::= [0-9]\n'
        r = m.generate(ask, grammar=gbnf, **kw)
        assert re.fullmatch(r"(yes|no), [0-9]{2}%", r.text), r.text
        assert r.finish_reason == "stop"


def test_uncompilable_constraints_are_clear_errors(model):
    tok = model.tokenizer
    for name, schema, needle in UNSUPPORTED:
        with pytest.raises(ConstraintError, match=re.escape(needle)) as e:
            compile_constraint(tok, _spec(schema))
        assert "\n" not in str(e.value) and isinstance(e.value, RequestError)
    bad = [({"type": "regex", "regex": "a("}, "unclosed group"),
           ({"type": "lark", "grammar": "start: foo"}, "unknown name"),
           ({"type": "gbnf", "grammar": 'root ::= "a" missing'}, "missing"),
           ({"type": "xml"}, "unknown constraint type 'xml'"),
           ({"type": "json_schema", "schema": "{not json"}, "not valid JSON"),
           ({"type": "json_schema", "schema": [1]}, "must be a JSON object")]
    for spec, needle in bad:
        with pytest.raises(ConstraintError, match=re.escape(needle)) as e:
            compile_constraint(tok, spec)
        assert "\n" not in str(e.value)
    with pytest.raises(ConstraintError, match="at most one"):
        model.generate("hi", json_schema={"type": "object"}, regex="a+")


def test_compile_cache_and_json_object(model):
    tok = model.tokenizer
    spec = _spec(SCHEMAS[3][1])
    g1 = compile_constraint(tok, spec)
    assert compile_constraint(tok, json.loads(json.dumps(spec))) is g1  # cached by content
    assert g1.compile_s > 0
    g = compile_constraint(tok, {"type": "json_object"})
    (r,), _ = _run(model, [(_prompt(model, *SCHEMAS[0]), g)],
                   SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    assert r["finish"] == "stop" and isinstance(json.loads(r["text"]), dict)
    other = memfit.load(str(model.path), n_ctx=256)  # another tokenizer object
    try:
        with pytest.raises(RequestError, match="another tokenizer"):
            other.engine.add_request([1, 2], SamplingParams(), constraint=g)
    finally:
        other.close()


def test_logit_bias_bans_and_forces(model):
    m = model
    prompt = "The capital of France is"
    base = m.generate(prompt, max_tokens=8, temperature=0)
    banned = sorted(set(base.ids))
    r = m.generate(prompt, max_tokens=8, temperature=0, logit_bias={t: -100 for t in banned})
    assert not set(r.ids) & set(banned)
    # string keys (JSON objects' keys) are token ids too; sampled at temperature 1.5
    r = m.generate(prompt, max_tokens=8, temperature=1.5, seed=1,
                   logit_bias={str(t): -100.0 for t in banned})
    assert not set(r.ids) & set(banned)
    force = m.tokenize(" banana", add_special=False)[-1]
    for temperature in (0.0, 1.5):
        r = m.generate(prompt, max_tokens=6, temperature=temperature, seed=2,
                       logit_bias={force: 100})
        assert r.ids == [force] * 6
    # with a constraint, the bias works inside the grammar's choices
    no = m.tokenize("no", add_special=False)
    assert len(no) == 1
    r = m.generate(prompt, max_tokens=20, temperature=0, regex="(yes|no)", logit_bias={no[0]: 100})
    assert r.text == "no"


def test_logit_bias_validation(model):
    m = model
    nv = m.tokenizer.n_vocab
    for bias, needle in [({1: 101}, "[-100, 100]"), ({1: float("nan")}, "[-100, 100]"),
                         ({"x": 1}, "token id"), ([1, 2], "object"), ({1: True}, "[-100, 100]")]:
        with pytest.raises(RequestError, match=re.escape(needle)):
            SamplingParams(logit_bias=bias)
    with pytest.raises(RequestError, match=f"outside the vocabulary \\(0..{nv - 1}\\)"):
        m.generate("hi", max_tokens=1, logit_bias={nv: 5})
    with pytest.raises(RequestError, match="outside the vocabulary"):
        m.generate("hi", max_tokens=1, logit_bias={-1: 5})
    assert SamplingParams(logit_bias={}).logit_bias is None


def test_special_tokens_are_never_grammar_text(model):
    """Control tokens (<|im_start|>, <start_of_turn>, ...) are not text a grammar can produce:
    with a grammar that takes any text, only end-of-generation ids among them are allowed
    (where the grammar may end), and the text grammar excludes nothing else."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    from memfit.constrain.tokenizer import _Vocab

    tok = model.tokenizer
    special = set(_Vocab(tok).special_token_ids)
    assert len(special) >= 3
    g = compile_constraint(tok, {"type": "regex", "regex": "(.|\n){0,40}"})
    mask = allocate_token_bitmask(1, tok.n_vocab)
    fill_next_token_bitmask(g.matcher().ll, mask)
    bits = np.unpackbits(mask.view(np.uint8), count=tok.n_vocab, bitorder="little").astype(bool)
    allowed = set(np.flatnonzero(bits).tolist())
    assert allowed & special == set(tok.eog_ids) & special
    assert len(allowed) > 0.9 * tok.n_vocab - len(special)


TOOL_CALL = {
    "type": "object",
    "properties": {
        "name": {"enum": ["get_weather", "get_time"]},
        "arguments": {"type": "object",
                      "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                      "required": ["city", "days"], "additionalProperties": False}},
    "required": ["name", "arguments"], "additionalProperties": False}


def test_random_weights_follow_the_schema_alone_batched_preempted(tmp_path):
    """A tiny model with random weights still writes valid JSON under the constraint; each
    sequence (greedy or sampled with its seed) gets the same tokens alone, batched with the
    others, and evicted and recomputed from a pool too small for all (forced tokens too)."""
    from memfit.engine.engine import Engine
    from memfit.gguf import open_gguf
    from memfit.models import load_model
    from memfit.models.synthetic import write_tiny_model
    from memfit.ops import get_ops
    from memfit.tokenizer import Tokenizer

    f = open_gguf(write_tiny_model(tmp_path / "q.gguf", "qwen2", "Q4_K", seed=3))
    model, tok = load_model(f, ops=get_ops("native")), Tokenizer.from_metadata(f.metadata)
    g = compile_constraint(tok, _spec(TOOL_CALL))
    prompts = [[5, 17, 200], [33, 290, 0, 64], list(range(40, 69)), [255], [9, 9, 9]]
    params = [SamplingParams(temperature=t, seed=s, max_tokens=120)
              for t, s in [(0, None), (1.0, 1), (0.7, 2), (1.5, 3), (0, None)]]

    def run(eng, idx):
        rids = {eng.add_request(prompts[i], params[i], constraint=g): i for i in idx}
        got = {i: [] for i in idx}
        while eng.has_unfinished():
            for o in eng.step():
                if o.token is not None:
                    got[rids[o.request_id]].append(o.token)
        assert eng.pool.n_used == 0
        return got

    alone = {i: run(Engine(model, tok, n_ctx=256), [i])[i] for i in range(len(prompts))}
    for i, ids in alone.items():
        jsonschema.validate(json.loads(tok.decode(ids)), TOOL_CALL)
    eng = Engine(model, tok, n_ctx=256, n_parallel=4)
    assert run(eng, range(len(prompts))) == alone
    assert eng.stats()["forced_tokens"] > 0.3 * eng.stats()["constrained_tokens"]
    small = Engine(model, tok, n_ctx=256, n_parallel=4, n_blocks=6)
    assert run(small, range(len(prompts))) == alone
    assert small.scheduler.n_preempted > 0


def test_under_a_budget_the_tables_are_lean(smollm2_path):
    """With a memory budget the engine asks for llguidance's tables without slices (half the
    bytes, constrain/tokenizer.py); constrained output is the same text either way."""
    from memfit.memory.budget import current_rss

    name, schema = SCHEMAS[0]
    # the floor counts this process's baseline (other tests' models may be loaded)
    with memfit.load(str(smollm2_path), n_ctx=512, mem_budget=current_rss() + 300 * 2**20) as m:
        assert m.ledger is not None and m.tokenizer.llg_lean is True
        lean = m.generate(_prompt(m, name, schema), max_tokens=MAX_TOKENS, temperature=0,
                          json_schema=schema)
    jsonschema.validate(json.loads(lean.text), schema)
    with memfit.load(str(smollm2_path), n_ctx=512) as m:
        assert not getattr(m.tokenizer, "llg_lean", False)
        full = m.generate(_prompt(m, name, schema), max_tokens=MAX_TOKENS, temperature=0,
                          json_schema=schema)
    assert full.ids == lean.ids


def test_unbounded_numbers_end(model):
    """An integer without bounds is held to 16 digits (llama.cpp's limit): a small model that
    repeats a digit still ends its JSON; bounds and enum data of the schema are kept."""
    from memfit.constrain import NUMBER_LIMIT, _bound_numbers

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    text = model.apply_chat_template([{"role": "user", "content": "The largest city in France"}])
    r = model.generate(text, max_tokens=60, temperature=0, json_schema=schema)
    assert r.finish_reason == "stop"
    doc = json.loads(r.text)
    jsonschema.validate(doc, schema)
    assert abs(doc["population"]) <= NUMBER_LIMIT
    s = {"type": "object", "properties": {"a": {"type": ["integer", "null"], "minimum": 3},
                                          "b": {"enum": [{"type": "integer"}]}}}
    b = _bound_numbers(s)
    assert b["properties"]["a"] == {"type": ["integer", "null"], "minimum": 3, "maximum": NUMBER_LIMIT}
    assert b["properties"]["b"] == s["properties"]["b"] and "maximum" not in s["properties"]["a"]
