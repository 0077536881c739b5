"""`memfit serve`'s Anthropic Messages API through the official anthropic client: text answers
equal to chat completions' (greedy, same prompt), count_tokens equal to the answer's prompt
tokens, the streamed event sequence, stop_sequences, errors in Anthropic's shape, x-api-key and
Bearer auth; a tool_use -> tool_result conversation on a tiny model with a Qwen template."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from _server import ServerProcess

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.realmodel, pytest.mark.slow, pytest.mark.timeout(300)]

Q = "What is the capital of France? Answer in one sentence."
SYSTEM = "You are terse."
KEY = "sk-test-h3-0123456789"
T0 = {"temperature": 0}   # greedy (the anthropic client takes sampling fields as extra_body)


@pytest.fixture(scope="module")
def server(smollm2_path):
    s = ServerProcess([str(smollm2_path), "--alias", "smollm2", "-c", "1024", "-np", "2"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def chat(oai, messages, max_tokens, **kw):
    return oai.chat.completions.create(model="smollm2", messages=messages, temperature=0,
                                       max_tokens=max_tokens, **kw)


def prompt_tokens(usage) -> int:
    """Anthropic splits the prompt into tokens read from the cache and the rest."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_text_equals_chat_completion(client, oai):
    m = client.messages.create(model="smollm2", max_tokens=24, system=SYSTEM, extra_body=T0,
                               messages=[{"role": "user", "content": Q}])
    ref = chat(oai, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": Q}], 24)
    c = ref.choices[0]
    assert m.type == "message" and m.role == "assistant" and m.model == "smollm2"
    assert m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == c.message.content and m.content[0].text
    assert m.stop_reason == ("max_tokens" if c.finish_reason == "length" else "end_turn")
    assert m.stop_sequence is None
    assert prompt_tokens(m.usage) == ref.usage.prompt_tokens
    assert m.usage.output_tokens == ref.usage.completion_tokens


def test_blocks_equal_strings(client):
    """system and content as text blocks are the same prompt as plain strings."""
    a = client.messages.create(model="smollm2", max_tokens=12, system=SYSTEM, extra_body=T0,
                               messages=[{"role": "user", "content": Q}])
    b = client.messages.create(
        model="smollm2", max_tokens=12, extra_body=T0,
        system=[{"type": "text", "text": SYSTEM[:4]}, {"type": "text", "text": SYSTEM[4:]}],
        messages=[{"role": "user", "content": [{"type": "text", "text": Q}]}])
    assert b.content[0].text == a.content[0].text
    assert prompt_tokens(b.usage) == prompt_tokens(a.usage)


def test_count_tokens_equals_answer(client, oai):
    msgs = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": Q}]
    n = client.messages.count_tokens(model="smollm2", system=SYSTEM, messages=msgs).input_tokens
    m = client.messages.create(model="smollm2", max_tokens=4, system=SYSTEM, messages=msgs)
    assert n == prompt_tokens(m.usage)
    ref = chat(oai, [{"role": "system", "content": SYSTEM}, *msgs], 1)
    assert n == ref.usage.prompt_tokens


def test_stream(client):
    kw = dict(model="smollm2", max_tokens=20, extra_body=T0,
              messages=[{"role": "user", "content": "Name three colours."}])
    plain = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == plain.content[0].text == final.content[0].text
    assert final.stop_reason == plain.stop_reason
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert prompt_tokens(final.usage) == prompt_tokens(plain.usage)
    events = list(client.messages.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert types[-2] == "message_delta" and types[-3] == "content_block_stop"
    assert types[1] == "content_block_start" and "content_block_delta" in types
    assert events[0].message.content == [] and events[0].message.stop_reason is None
    assert events[-2].delta.stop_reason == plain.stop_reason
    assert events[-2].usage.output_tokens == plain.usage.output_tokens
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert "".join(deltas) == text


def test_ping_event(server):
    """Anthropic's stream carries a ping after message_start (the SDK skips it)."""
    with httpx.stream("POST", server.url + "/v1/messages", timeout=60, json={
            "model": "smollm2", "max_tokens": 2, "stream": True,
            "messages": [{"role": "user", "content": "Hi"}]}) as r:
        names = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"


def test_stop_sequence(client):
    kw = dict(model="smollm2", max_tokens=40, extra_body=T0,
              messages=[{"role": "user", "content": Q}])
    full = client.messages.create(**kw).content[0].text
    words = full.split()
    assert len(words) > 3, full
    stop = words[2]
    cut = full[:full.index(stop)]
    m = client.messages.create(stop_sequences=["QQQ-never", stop], **kw)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == cut
    with client.messages.stream(stop_sequences=["QQQ-never", stop], **kw) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert final.content[0].text == cut


BAD = [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"max_tokens": 4, "messages": []}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": 4, "temperature": 1.5, "messages": [{"role": "user", "content": "x"}]},
     "temperature"),
    ({"max_tokens": 4, "tool_choice": {"type": "any"},
      "messages": [{"role": "user", "content": "x"}]}, "tool_choice"),
    ({"max_tokens": 4, "tools": [{"name": "f"}], "messages": [{"role": "user", "content": "x"}]},
     "tools[0].input_schema"),
    ({"max_tokens": 4, "stop_sequences": "x", "messages": [{"role": "user", "content": "x"}]},
     "stop_sequences"),
    ({"max_tokens": 4, "thinking": {"type": "enabled"},
      "messages": [{"role": "user", "content": "x"}]}, "thinking.budget_tokens"),
]


@pytest.mark.parametrize("body,field", BAD, ids=[b[1] for b in BAD])
def test_bad_requests(server, body, field):
    r = httpx.post(server.url + "/v1/messages", json={"model": "smollm2", **body}, timeout=30)
    assert r.status_code == 400, r.text
    j = r.json()
    assert j["type"] == "error" and j["error"]["type"] == "invalid_request_error"
    assert field in j["error"]["message"] and "\n" not in j["error"]["message"]


def test_errors_through_the_client(client, server):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="smollm2", max_tokens=4,
                               messages=[{"role": "bot", "content": "x"}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    # Anthropic clients send their own model names: the loaded model answers (llama-server's way)
    r = client.messages.create(model="claude-sonnet-4-5", max_tokens=2,
                               messages=[{"role": "user", "content": "x"}])
    assert r.model == "claude-sonnet-4-5" and r.usage.output_tokens >= 1
    r = httpx.post(server.url + "/v1/messages", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_metrics_count_messages(server, client):
    client.messages.create(model="smollm2", max_tokens=2,
                           messages=[{"role": "user", "content": "x"}])
    m = server.metrics()
    assert m['memfit_requests_total{endpoint="messages",status="200"}'] >= 1
    assert m['memfit_requests_total{endpoint="messages",status="400"}'] >= 1


# ----------------------------------------------------------------------------- auth

@pytest.fixture(scope="module")
def keyed(smollm2_path):
    s = ServerProcess([str(smollm2_path), "--alias", "smollm2", "-c", "512", "-np", "1",
                       "--api-key", KEY])
    s.headers = {"Authorization": f"Bearer {KEY}"}
    yield s
    s.stop()


def test_api_key_x_api_key_and_bearer(keyed):
    msgs = [{"role": "user", "content": "Hi"}]
    by_x = anthropic.Anthropic(base_url=keyed.url, api_key=KEY, max_retries=0)
    assert by_x.messages.create(model="smollm2", max_tokens=2, messages=msgs).usage.output_tokens
    by_bearer = anthropic.Anthropic(base_url=keyed.url, auth_token=KEY, max_retries=0)
    assert by_bearer.messages.count_tokens(model="smollm2", messages=msgs).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0).messages.create(
            model="smollm2", max_tokens=2, messages=msgs)
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": "invalid API key"}}
    r = httpx.post(keyed.url + "/v1/messages/count_tokens", json={"messages": msgs}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    # the OpenAI endpoints take either header too, and refuse in OpenAI's shape
    ok = openai.OpenAI(base_url=keyed.base_url, api_key=KEY, max_retries=0)
    assert ok.responses.create(model="smollm2", input="Hi", max_output_tokens=2).output_text
    r = httpx.post(keyed.base_url + "/responses", headers={"x-api-key": KEY}, timeout=30,
                   json={"model": "smollm2", "input": "Hi", "max_output_tokens": 2})
    assert r.status_code == 200 and r.json()["object"] == "response"
    with pytest.raises(openai.AuthenticationError) as e2:
        openai.OpenAI(base_url=keyed.base_url, api_key="wrong", max_retries=0).responses.create(
            model="smollm2", input="Hi", max_output_tokens=2)
    assert e2.value.body["type"] == "authentication_error"


# ----------------------------------------------------------------------------- tool use

CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string",
                                                         "enum": ["Paris", "London"]}},
               "required": ["city"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The weather in a city.",
          "input_schema": CITY_SCHEMA}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tools_client(request):
    """A server on a tiny random-weight model whose template supports tools (the chat core's
    fixture); the tool-call constraint makes even random weights produce a valid call."""
    path = request.getfixturevalue("qwen_tools_model")
    s = ServerProcess([str(path), "--alias", "qwen-tools", "-np", "2"])
    request.addfinalizer(s.stop)
    return anthropic.Anthropic(base_url=s.url, api_key="unused", max_retries=0, timeout=120)


def test_tool_use_conversation(tools_client):
    import jsonschema
    c = tools_client
    m = c.messages.create(model="qwen-tools", max_tokens=200, tools=TOOLS, messages=ASK,
                          tool_choice={"type": "any", "disable_parallel_tool_use": True},
                          extra_body=T0)
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and uses[0].id
    jsonschema.validate(uses[0].input, CITY_SCHEMA)
    # the result goes back; tool_choice none: a text answer
    history = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                       for b in m.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                             "content": [{"type": "text", "text": "sunny"}]}]}]
    n = c.messages.count_tokens(model="qwen-tools", tools=TOOLS, messages=history,
                                tool_choice={"type": "none"}).input_tokens
    a = c.messages.create(model="qwen-tools", max_tokens=8, tools=TOOLS, messages=history,
                          tool_choice={"type": "none"}, extra_body=T0)
    assert [b.type for b in a.content] == ["text"] and a.stop_reason in ("end_turn", "max_tokens")
    assert prompt_tokens(a.usage) == n


def test_tool_use_streamed(tools_client):
    import jsonschema
    with tools_client.messages.stream(model="qwen-tools", max_tokens=200, tools=TOOLS,
                                      messages=ASK, extra_body=T0,
                                      tool_choice={"type": "tool", "name": "get_weather",
                                                   "disable_parallel_tool_use": True}) as s:
        events = list(s)
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    [use] = [b for b in final.content if b.type == "tool_use"][:1]
    jsonschema.validate(use.input, CITY_SCHEMA)
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                      and e.delta.type == "input_json_delta")
    assert json.loads(partial) == use.input


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_output_config_json_schema(client):
    import jsonschema
    m = client.messages.create(model="smollm2", max_tokens=200, extra_body=T0,
                               messages=[{"role": "user", "content": "Describe a person as JSON."}],
                               output_config={"format": {"type": "json_schema", "schema": PERSON}})
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), PERSON)


def test_stream_disconnect_stops_generation(server):
    before = server.metrics()
    body = {"model": "smollm2", "max_tokens": 400, "ignore_eos": True, "temperature": 0,
            "stream": True, "messages": [{"role": "user", "content": "Count: 1, 2, 3,"}]}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if "text_delta" in line:
                assert server.metrics()["memfit_requests_running"] == 1
                break
    deadline = time.monotonic() + 10
    while server.metrics()["memfit_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    after = server.metrics()
    assert after["memfit_requests_running"] == 0 and after["memfit_kv_blocks_used"] == 0
    assert after["memfit_client_disconnects_total"] == before["memfit_client_disconnects_total"] + 1
    assert after["memfit_generated_tokens_total"] - before["memfit_generated_tokens_total"] < 400


def test_unsupported_schema_is_400(server):
    r = httpx.post(server.url + "/v1/messages", timeout=30, json={
        "model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
        "output_config": {"format": {"type": "json_schema",
                                     "schema": {"type": "string", "format": "no-such-format"}}}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert "output_config.format.schema" in err["message"] and "no-such-format" in err["message"]


# ----------------------------------------------------------------------------- reasoning

@pytest.fixture(scope="module")
def reasoning_server(request, r1_model):
    """A tiny random model with DeepSeek-R1's template, which opens <think> in the generation
    prompt when thinking is on: random weights never close it, so all output is reasoning."""
    s = ServerProcess([str(r1_model), "--alias", "r1", "-np", "1"])
    request.addfinalizer(s.stop)
    return s


def test_thinking_blocks(reasoning_server):
    c = anthropic.Anthropic(base_url=reasoning_server.url, api_key="x", max_retries=0)
    kw = dict(model="r1", max_tokens=12, thinking={"type": "enabled", "budget_tokens": 1024},
              messages=[{"role": "user", "content": "Think about it."}], extra_body=T0)
    m = c.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking"] and m.content[0].thinking
    assert m.stop_reason == "max_tokens"
    with c.messages.stream(**kw) as s:
        events = list(s)
        final = s.get_final_message()
    deltas = [e.delta.thinking for e in events if e.type == "content_block_delta"
              and e.delta.type == "thinking_delta"]
    assert "".join(deltas) == m.content[0].thinking == final.content[0].thinking
    assert final.content[0].type == "thinking" and final.stop_reason == "max_tokens"
    # thinking off: the template closes the block at once; no thinking block comes back
    off = c.messages.create(**{**kw, "thinking": {"type": "disabled"}})
    assert "thinking" not in [b.type for b in off.content]


def test_thinking_budget_closes_the_reasoning(reasoning_server):
    """budget_tokens is a token count: when the thinking reaches it the server closes the
    block (appends </think> as forced tokens) and the answer goes on in a text block. Random
    weights never close it themselves (above: all thinking to max_tokens)."""
    c = anthropic.Anthropic(base_url=reasoning_server.url, api_key="x", max_retries=0)
    kw = dict(model="r1", max_tokens=30, thinking={"type": "enabled", "budget_tokens": 4},
              messages=[{"role": "user", "content": "Think about it."}], extra_body=T0)
    m = c.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text"], m.content
    assert m.content[0].thinking and m.content[1].text and m.stop_reason == "max_tokens"
    with c.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in final.content] == [(b.type, getattr(b, "thinking", None) or
                                         getattr(b, "text", None)) for b in m.content]
    # a larger budget thinks longer before the answer
    m2 = c.messages.create(**{**kw, "thinking": {"type": "enabled", "budget_tokens": 12}})
    assert [b.type for b in m2.content] == ["thinking", "text"]
    assert len(m2.content[0].thinking) > len(m.content[0].thinking)


def test_thinking_stream_events_as_anthropic_sends_them(reasoning_server):
    """The raw stream: the thinking block at index 0 (thinking_delta events, then a
    signature_delta just before its content_block_stop, as Anthropic closes one), then the
    text block at index 1 after the budget closed the thinking."""
    r = httpx.post(reasoning_server.url + "/v1/messages", timeout=120, json={
        "model": "r1", "max_tokens": 30, "stream": True, "temperature": 0,
        "thinking": {"type": "enabled", "budget_tokens": 4},
        "messages": [{"role": "user", "content": "What is 2+2?"}]})
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    kinds = [(e["type"], e.get("index"), (e.get("delta") or e.get("content_block") or {})
              .get("type")) for e in events]
    start = kinds.index(("content_block_start", 0, "thinking"))
    stop = kinds.index(("content_block_stop", 0, None))
    inner = kinds[start + 1:stop]
    assert inner[-1] == ("content_block_delta", 0, "signature_delta")
    assert set(inner[:-1]) == {("content_block_delta", 0, "thinking_delta")}
    sig = events[start + len(inner)]
    assert sig["delta"] == {"type": "signature_delta", "signature": ""}
    assert ("content_block_start", 1, "text") in kinds[stop:]


def test_thinking_history_goes_to_the_template(qwen3_server):
    """Thinking blocks of earlier assistant turns become reasoning_content, which Qwen3's
    template renders in <think> after the last user query: count_tokens grows by them;
    redacted_thinking (Anthropic's encrypted form) is dropped."""
    tool = {"name": "list_files", "description": "List files", "input_schema": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
    thought = "I should look at the project layout first."

    def turn(blocks):
        return [{"role": "user", "content": "Fix the bug"},
                {"role": "assistant", "content": blocks + [
                    {"type": "tool_use", "id": "call_1", "name": "list_files",
                     "input": {"path": "."}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "call_1", "content": "main.py"}]}]

    def count(blocks):
        r = httpx.post(qwen3_server.url + "/v1/messages/count_tokens", timeout=60, json={
            "model": "qwen3", "messages": turn(blocks), "tools": [tool]})
        assert r.status_code == 200, r.text
        return r.json()["input_tokens"]
    base = count([])
    assert count([{"type": "thinking", "thinking": thought, "signature": ""}]) > base + 5
    assert count([{"type": "redacted_thinking", "data": "abc"}]) == base
    # the OpenAI route takes the same as reasoning_content on an assistant message
    p = httpx.post(qwen3_server.url + "/apply-template", timeout=60, json={"messages": [
        {"role": "user", "content": "Fix the bug"},
        {"role": "assistant", "content": "", "reasoning_content": thought, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "list_files", "arguments": '{"path": "."}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "main.py"}]}).json()["prompt"]
    assert f"<think>\n{thought}\n</think>" in p
    r = httpx.post(qwen3_server.url + "/v1/messages", timeout=60, json={
        "model": "qwen3", "max_tokens": 4, "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": 3}]},
            {"role": "user", "content": "y"}]})
    assert r.status_code == 400 and "thinking must be a string" in r.text
