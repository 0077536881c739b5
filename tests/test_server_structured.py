"""Structured output, tool calls and reasoning through `memfit serve`'s chat completions and
completions, with the official openai client: every schema of tests/schemas.py on both real
models (response_format json_schema strict), JSON mode, GBNF/json_schema fields as llama-server
takes them, 400s for what cannot be compiled; a tool-calling conversation (call -> tool result
-> answer) streamed and not on a tiny random model with Qwen2.5's template, tool_choice
required / named always giving arguments that validate; reasoning_content split on a template
that thinks (DeepSeek-R1's)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from _server import ServerProcess
from schemas import SCHEMAS, UNSUPPORTED

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODELS = {"smollm2": "smollm2_path", "gemma": "gemma_path"}
# Greedy decoding of these 135M / 270M models can loop inside what a schema allows (one more
# key, forever) until max_tokens; which schema does so depends on the kernel path's rounding
# (AVX2 against AVX-512). Such an answer must still be JSON cut short, never text the
# constraint would have refused; at most this many schemas of the sweep may end that way.
MAX_CUT = 2


def _close(t: str) -> str | None:
    """t with its open string and containers closed (None: t ends inside an escape)."""
    stack, ins, esc = [], False, False
    for ch in t:
        if ins:
            esc, ins = (False, ins) if esc else (ch == "\\", ch != '"')
        elif ch == '"':
            ins = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]":
            if not stack or stack.pop() != ch:
                return None
    return None if esc else t + ('"' if ins else "") + "".join(reversed(stack))


def _json_cut_short(text: str):
    """The JSON value text begins (a prefix of it, closed), or None when no prefix of text
    closes into JSON: text cut by max_tokens is a valid beginning, dropping at most the last
    unfinished member."""
    for cut in range(len(text), max(0, len(text) - 200), -1):
        closed = _close(text[:cut])
        if closed is not None:
            try:
                return json.loads(closed)
            except ValueError:
                pass
    return None


@pytest.fixture(scope="module", params=list(MODELS))
def real(request):
    path = request.getfixturevalue(MODELS[request.param])
    s = ServerProcess([str(path), "--alias", request.param, "-c", "2048", "-np", "4"])
    request.addfinalizer(s.stop)
    return request.param, s, openai.OpenAI(base_url=s.base_url, api_key="unused",
                                           max_retries=0, timeout=300)


@pytest.mark.realmodel
def test_every_schema_strict_parses_and_validates(real):
    name, _, client = real
    assert len(SCHEMAS) >= 20

    def one(item):
        sname, schema = item
        r = client.chat.completions.create(
            model=name, temperature=0, max_tokens=400,
            messages=[{"role": "user", "content": f"Give an example {sname} as JSON."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": sname, "schema": schema, "strict": True}})
        c = r.choices[0]
        if c.finish_reason == "length":
            assert _json_cut_short(c.message.content) is not None, (sname, c.message.content)
            return sname, False
        assert c.finish_reason == "stop", (sname, c.message.content)
        jsonschema.validate(json.loads(c.message.content), schema)
        return sname, True
    with ThreadPoolExecutor(4) as ex:       # the server batches them (-np 4)
        done = list(ex.map(one, SCHEMAS))
    assert sorted(n for n, _ in done) == sorted(n for n, _ in SCHEMAS)
    cut = [n for n, whole in done if not whole]
    assert len(cut) <= MAX_CUT, cut


@pytest.mark.realmodel
def test_json_mode_streamed_and_completions(real):
    name, s, client = real
    parts, finish = [], None
    for ch in client.chat.completions.create(
            model=name, temperature=0, max_tokens=300, stream=True,
            messages=[{"role": "user", "content": "Give a JSON object with a cat's name and age."}],
            response_format={"type": "json_object"}):
        if ch.choices and ch.choices[0].delta.content:
            parts.append(ch.choices[0].delta.content)
        if ch.choices and ch.choices[0].finish_reason:
            finish = ch.choices[0].finish_reason
    text = "".join(parts)
    assert finish in ("stop", "length"), finish
    # a greedy loop of keys is cut by max_tokens (see MAX_CUT); the object is still JSON
    assert isinstance(json.loads(text) if finish == "stop" else _json_cut_short(text), dict), text
    # /v1/completions takes response_format too, and llama-server's json_schema and grammar
    r = client.completions.create(model=name, prompt="A number:", max_tokens=20, temperature=0,
                                  extra_body={"json_schema": {"type": "integer", "minimum": 3,
                                                              "maximum": 9}})
    assert 3 <= json.loads(r.choices[0].text) <= 9
    r = client.completions.create(model=name, prompt="Say a:", max_tokens=10, temperature=0,
                                  extra_body={"grammar": 'root ::= "a"{5,5}'})
    assert r.choices[0].text == "aaaaa" and r.choices[0].finish_reason == "stop"


@pytest.mark.realmodel
def test_bad_formats_are_400(real):
    name, s, client = real
    msgs = [{"role": "user", "content": "hi"}]
    for rf, param in [({"type": "sound"}, "response_format.type"),
                      ({"type": "json_schema"}, "response_format.json_schema")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=name, messages=msgs, response_format=rf)
        assert e.value.body["param"] == param
    for sname, schema, needle in UNSUPPORTED:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=name, messages=msgs, response_format={
                    "type": "json_schema", "json_schema": {"name": sname, "schema": schema}})
        assert needle in e.value.body["message"] and "\n" not in e.value.body["message"]
    r = httpx.post(s.base_url + "/chat/completions", timeout=30,
                   json={"messages": msgs, "grammar": "root ::= this is (not valid GBNF"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


# ----------------------------------------------------------------------------- tools

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time.",
                                           "parameters": {"type": "object", "properties": {
                                               "tz": {"type": "string", "maxLength": 10}},
                                               "required": ["tz"],
                                               "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def tools_client(qwen_tools_model):
    s = ServerProcess([str(qwen_tools_model), "--alias", "qwen-tools", "-np", "2"])
    yield s, openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120)
    s.stop()


def _check_call(call, names=("get_weather", "get_time")):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    args = json.loads(call.function.arguments)
    schema = TOOLS[0 if call.function.name == "get_weather" else 1]["function"]["parameters"]
    jsonschema.validate(args, schema)


def test_tool_call_conversation(tools_client):
    s, c = tools_client
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.chat.completions.create(model="qwen-tools", messages=msgs, tools=TOOLS,
                                  tool_choice="required", parallel_tool_calls=False,
                                  temperature=0, max_tokens=300)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    _check_call(call)
    # the call and its result go back through Qwen's template (tool_calls + tool message)
    msgs2 = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    p = httpx.post(s.url + "/apply-template", json={"messages": msgs2, "tools": TOOLS}).json()["prompt"]
    assert "<tool_call>" in p and call.function.name in p and "sunny, 21 C" in p
    assert "<tool_response>" in p
    r2 = c.chat.completions.create(model="qwen-tools", messages=msgs2, tools=TOOLS,
                                   tool_choice="none", temperature=0, max_tokens=8)
    assert r2.choices[0].message.tool_calls is None and r2.choices[0].message.content
    # the call and its result are in the prompt (tool_choice none leaves the tool list out)
    r0 = c.chat.completions.create(model="qwen-tools", messages=msgs, tools=TOOLS,
                                   tool_choice="none", temperature=0, max_tokens=1)
    assert r2.usage.prompt_tokens > r0.usage.prompt_tokens + 20


def test_tool_calls_streamed_equal_plain(tools_client):
    _, c = tools_client
    kw = dict(model="qwen-tools", messages=[{"role": "user", "content": "Time in Tokyo?"}],
              tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
              parallel_tool_calls=False, temperature=0, max_tokens=300)
    plain = c.chat.completions.create(**kw).choices[0]
    calls, finish = {}, None
    for ch in c.chat.completions.create(stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        for tc in d.tool_calls or []:
            e = calls.setdefault(tc.index, {"id": None, "name": None, "args": ""})
            e["id"] = tc.id or e["id"]
            if tc.function and tc.function.name:
                e["name"] = tc.function.name
            e["args"] += (tc.function.arguments or "") if tc.function else ""
        finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1
    pc = plain.message.tool_calls[0]
    assert calls[0]["name"] == pc.function.name == "get_time"
    assert calls[0]["args"] == pc.function.arguments
    _check_call(pc, ("get_time",))


NOTE = {"type": "function", "function": {"name": "write_note", "parameters": {
    "type": "object", "properties": {
        "title": {"type": "string", "minLength": 30, "maxLength": 40},
        "tags": {"type": "array", "items": {"enum": ["home", "work", "misc"]}, "minItems": 3,
                 "maxItems": 4}},
    "required": ["title", "tags"], "additionalProperties": False}}}


def _stream_calls(c, **kw):
    """Streamed tool-call deltas folded: ({index: [id, name, [argument pieces]]}, finish)."""
    calls, finish = {}, None
    for ch in c.chat.completions.create(stream=True, **kw):
        if not ch.choices:
            continue
        for tc in ch.choices[0].delta.tool_calls or []:
            if tc.index not in calls:
                # the first delta of a call: id, type, name and empty arguments
                assert tc.id and tc.type == "function" and tc.function.name
                assert tc.function.arguments == ""
                calls[tc.index] = [tc.id, tc.function.name, []]
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index][2].append(tc.function.arguments)
        finish = ch.choices[0].finish_reason or finish
    return calls, finish


def test_tool_arguments_stream_in_pieces(tools_client):
    _, c = tools_client
    kw = dict(model="qwen-tools", messages=[{"role": "user", "content": "Write a note."}],
              tools=TOOLS + [NOTE], tool_choice={"type": "function",
                                                 "function": {"name": "write_note"}},
              parallel_tool_calls=False, temperature=0, max_tokens=300)
    plain = c.chat.completions.create(**kw).choices[0]
    assert plain.finish_reason == "tool_calls"
    args = plain.message.tool_calls[0].function.arguments
    jsonschema.validate(json.loads(args), NOTE["function"]["parameters"])
    calls, finish = _stream_calls(c, **kw)
    assert finish == "tool_calls" and list(calls) == [0] and calls[0][1] == "write_note"
    pieces = calls[0][2]
    assert "".join(pieces) == args
    assert len(pieces) > 3, pieces     # not one delta at the end


def test_tool_call_cut_by_max_tokens(tools_client):
    """A call cut off by max_tokens once its name is out stays a call, its arguments closed
    where they were cut (so they parse), finish_reason "length" (llama-server does the same)."""
    _, c = tools_client
    kw = dict(model="qwen-tools", messages=[{"role": "user", "content": "Write a note."}],
              tools=[NOTE], tool_choice="required", temperature=0, max_tokens=60)
    ch = c.chat.completions.create(**kw).choices[0]
    assert ch.finish_reason == "length" and not ch.message.content
    (call,) = ch.message.tool_calls
    assert call.function.name == "write_note"
    args = json.loads(call.function.arguments)
    assert isinstance(args, dict) and len(call.function.arguments) > 2, args
    calls, finish = _stream_calls(c, **kw)
    assert finish == "length" and "".join(calls[0][2]) == call.function.arguments


@pytest.mark.parametrize("template,marker", [
    ("Qwen3-Coder.jinja", "<function=write_note>\n<parameter=title>"),
    ("llama-cpp-deepseek-r1.jinja", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>write_note"),
    ("openai-gpt-oss-120b.jinja", "to=functions.write_note<|channel|>commentary json"),
])
def test_native_call_formats(tmp_path_factory, template, marker):
    """Qwen3-Coder's XML parameters, DeepSeek-R1's tool tokens and gpt-oss's harmony
    channels: a forced call comes out in the template's own format, is parsed the same
    streamed and not, and goes back into the next prompt in that format. (Reasoning is off:
    random weights in an open thinking block would think to max_tokens.)"""
    from conftest import template_model
    path = template_model(tmp_path_factory, template)
    s = ServerProcess([str(path), "--alias", "m", "-np", "1", "--reasoning-format", "none"])
    try:
        c = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120)
        msgs = [{"role": "user", "content": "Write a note."}]
        kw = dict(model="m", messages=msgs, tools=[NOTE], tool_choice="required",
                  parallel_tool_calls=False, temperature=0, max_tokens=400)
        ch = c.chat.completions.create(**kw).choices[0]
        assert ch.finish_reason == "tool_calls", ch.message
        (call,) = ch.message.tool_calls
        assert call.function.name == "write_note" and not ch.message.content
        jsonschema.validate(json.loads(call.function.arguments), NOTE["function"]["parameters"])
        calls, finish = _stream_calls(c, **kw)
        assert finish == "tool_calls" and "".join(calls[0][2]) == call.function.arguments
        history = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                          {"role": "tool", "tool_call_id": call.id, "content": "saved"}]
        p = httpx.post(s.url + "/apply-template",
                       json={"messages": history, "tools": [NOTE]}).json()["prompt"]
        assert marker in p and "saved" in p
    finally:
        s.stop()


def _builtin(name, key):
    return {"type": "function", "function": {"name": name, "description": f"{name} built-in",
                                             "parameters": {"type": "object", "properties": {
                                                 key: {"type": "string", "maxLength": 40}},
                                                 "required": [key]}}}


def test_llama31_builtin_tools(tmp_path_factory):
    """Llama 3.1's built-in tools over HTTP with the openai client: the template lists them
    in builtin_tools, a forced call comes out as <|python_tag|>name.call(query="...") and is
    parsed into tool_calls (JSON arguments), the same streamed; the call goes back into the
    next prompt in that syntax, and the conversation goes on after its result."""
    from conftest import template_model
    path = template_model(tmp_path_factory, "meta-llama-Llama-3.1-8B-Instruct.jinja")
    tools = [_builtin("brave_search", "query"), _builtin("code_interpreter", "code"),
             TOOLS[0]]
    s = ServerProcess([str(path), "--alias", "m", "-np", "1"])
    try:
        c = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120)
        msgs = [{"role": "user", "content": "Search the web for memfit."}]
        p = httpx.post(s.url + "/apply-template", json={"messages": msgs, "tools": tools},
                       timeout=30).json()["prompt"]
        assert "Environment: ipython\nTools: brave_search\n" in p
        assert '"name": "get_weather"' in p and '"name": "brave_search"' not in p
        for name, key in (("brave_search", "query"), ("code_interpreter", "code")):
            kw = dict(model="m", messages=msgs, tools=tools, temperature=0, max_tokens=200,
                      tool_choice={"type": "function", "function": {"name": name}})
            ch = c.chat.completions.create(**kw).choices[0]
            assert ch.finish_reason == "tool_calls" and not ch.message.content, ch.message
            (call,) = ch.message.tool_calls
            args = json.loads(call.function.arguments)
            assert call.function.name == name and list(args) == [key], call
            assert isinstance(args[key], str) and len(args[key]) <= 40
            calls, finish = _stream_calls(c, **kw)
            assert finish == "tool_calls" and [v[1] for v in calls.values()] == [name]
            assert json.loads("".join(calls[0][2])) == args
        # the conversation goes on: the call renders as the model wrote it, then its result
        history = msgs + [{"role": "assistant", "content": None,
                           "tool_calls": [call.model_dump()]},
                          {"role": "tool", "tool_call_id": call.id, "content": "2 results"}]
        p = httpx.post(s.url + "/apply-template", json={"messages": history, "tools": tools},
                       timeout=30).json()["prompt"]
        code = json.loads(call.function.arguments)["code"]
        assert f'<|python_tag|>code_interpreter.call(code="{code}")<|eom_id|>' in p
        assert '<|start_header_id|>ipython<|end_header_id|>\n\n"2 results"' in p
        r = c.chat.completions.create(model="m", messages=history, tools=tools,
                                      tool_choice="none", temperature=0, max_tokens=8)
        assert r.choices[0].finish_reason in ("stop", "length")
        assert not r.choices[0].message.tool_calls
    finally:
        s.stop()


def test_tool_choice_required_always_validates(tools_client):
    _, c = tools_client
    for seed in range(6):   # sampled: whatever the random weights prefer, the call parses
        r = c.chat.completions.create(
            model="qwen-tools", messages=[{"role": "user", "content": f"Question {seed}"}],
            tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed, max_tokens=300,
            parallel_tool_calls=False)   # random weights would repeat calls to max_tokens
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch.message
        for call in ch.message.tool_calls:
            _check_call(call)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="qwen-tools", messages=[{"role": "user", "content": "x"}],
                                  tools=TOOLS, tool_choice={"type": "function",
                                                            "function": {"name": "nope"}})
    assert e.value.body["param"] in ("tools", "tool_choice")


# ----------------------------------------------------------------------------- reasoning

def test_reasoning_content_split(r1_model):
    s = ServerProcess([str(r1_model), "--alias", "r1", "-np", "1"])
    try:
        c = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120)
        msgs = [{"role": "user", "content": "Think about it."}]
        r = c.chat.completions.create(model="r1", messages=msgs, temperature=0, max_tokens=12)
        m = r.choices[0].message
        # R1's generation prompt opens <think>: random weights never close it, so it is all
        # reasoning, none of it content
        assert getattr(m, "reasoning_content", None) and not m.content
        streamed = ""
        for ch in c.chat.completions.create(model="r1", messages=msgs, temperature=0,
                                            max_tokens=12, stream=True):
            if ch.choices:
                d = ch.choices[0].delta
                assert not d.content
                streamed += getattr(d, "reasoning_content", None) or ""
        assert streamed == m.reasoning_content
    finally:
        s.stop()
    # --reasoning-format none leaves the thinking in content
    s = ServerProcess([str(r1_model), "--alias", "r1", "-np", "1", "--reasoning-format", "none"])
    try:
        c = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120)
        r2 = c.chat.completions.create(model="r1", messages=msgs, temperature=0, max_tokens=12)
        assert r2.choices[0].message.content == m.reasoning_content
    finally:
        s.stop()


def test_reasoning_budget(r1_model):
    """llama-server's thinking_budget_tokens / reasoning_budget: the server closes the
    reasoning after that many tokens (</think> forced) and the answer follows as content; 0
    closes it at once; -1 is no limit. Random weights never close it themselves."""
    s = ServerProcess([str(r1_model), "--alias", "r1", "-np", "1"])
    try:
        c = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120)
        kw = dict(model="r1", messages=[{"role": "user", "content": "Think about it."}],
                  temperature=0, max_tokens=30)

        def run(**extra):
            m = c.chat.completions.create(extra_body=extra, **kw).choices[0].message
            return getattr(m, "reasoning_content", None) or "", m.content or ""
        free, none = run(reasoning_budget=-1)
        assert free and not none                     # all reasoning, to max_tokens
        think5, answer5 = run(thinking_budget_tokens=5)
        think10, answer10 = run(reasoning_budget=10)
        assert think5 and answer5 and think10 and answer10
        assert len(think5) < len(think10) < len(free) and free.startswith(think5)
        think0, answer0 = run(reasoning_budget=0)
        assert not think0 and answer0
        streamed_think = streamed = ""
        for ch in c.chat.completions.create(stream=True, extra_body={"reasoning_budget": 5},
                                            **kw):
            if ch.choices:
                d = ch.choices[0].delta
                streamed_think += getattr(d, "reasoning_content", None) or ""
                streamed += d.content or ""
        assert (streamed_think, streamed) == (think5, answer5)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(extra_body={"reasoning_budget": "many"}, **kw)
        assert e.value.body["param"] == "reasoning_budget"
    finally:
        s.stop()


@pytest.mark.realmodel
def test_metrics_count_the_sliding_window_group(real):
    """/metrics shows the sliding-window layers' block group (Gemma-3; none for SmolLM2): its
    size, blocks held while a request runs, all given back after it."""
    name, s, client = real
    m = s.metrics()
    assert m["memfit_kv_swa_blocks_used"] == 0
    if name == "smollm2":
        assert m["memfit_kv_swa_blocks_total"] == 0
        return
    total = m["memfit_kv_swa_blocks_total"]
    assert 0 < total < m["memfit_kv_blocks_total"]
    stream = client.completions.create(model=name, prompt="Count: one two three", stream=True,
                                       max_tokens=40, temperature=0,
                                       extra_body={"ignore_eos": True})
    held = None
    for i, _ in enumerate(stream):
        if i == 2:
            held = s.metrics()["memfit_kv_swa_blocks_used"]
    assert held is not None and 0 < held <= total
    deadline = time.monotonic() + 30
    while s.metrics()["memfit_kv_swa_blocks_used"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert s.metrics()["memfit_kv_swa_blocks_used"] == 0
