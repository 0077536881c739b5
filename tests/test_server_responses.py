"""`memfit serve`'s OpenAI Responses API through the official openai client: text answers equal
to chat completions' (greedy, same prompt), input items, the streamed event sequence, the
max_output_tokens cut, previous_response_id over the in-memory store, retrieve/delete, bad
requests (400 naming the field), metrics; tool calls on a tiny model with a Qwen template."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from _server import ServerProcess

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.realmodel, pytest.mark.slow, pytest.mark.timeout(300)]

Q = "What is the capital of France? Answer in one sentence."
SYSTEM = "You are terse."


@pytest.fixture(scope="module")
def server(smollm2_path):
    s = ServerProcess([str(smollm2_path), "--alias", "smollm2", "-c", "1024", "-np", "2"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def chat(client, messages, max_tokens):
    return client.chat.completions.create(model="smollm2", messages=messages, temperature=0,
                                          max_tokens=max_tokens)


def test_text_equals_chat_completion(client):
    r = client.responses.create(model="smollm2", input=Q, instructions=SYSTEM, temperature=0,
                                max_output_tokens=24)
    ref = chat(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": Q}], 24)
    c = ref.choices[0]
    assert r.object == "response" and r.model == "smollm2" and r.id.startswith("resp_")
    assert r.output_text == c.message.content and r.output_text
    [item] = r.output
    assert item.type == "message" and item.role == "assistant"
    assert [p.type for p in item.content] == ["output_text"]
    if c.finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None
    assert r.usage.input_tokens == ref.usage.prompt_tokens
    assert r.usage.output_tokens == ref.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == SYSTEM and r.temperature == 0


def test_input_items_equal_instructions(client):
    """A developer message and input_text parts are the same prompt as instructions + text."""
    a = client.responses.create(model="smollm2", input=Q, instructions=SYSTEM, temperature=0,
                                max_output_tokens=12)
    b = client.responses.create(model="smollm2", temperature=0, max_output_tokens=12, input=[
        {"role": "developer", "content": SYSTEM},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": Q[:10]},
                     {"type": "input_text", "text": Q[10:]}]}])
    assert b.output_text == a.output_text
    assert b.usage.input_tokens == a.usage.input_tokens


def test_stream_events(client):
    kw = dict(model="smollm2", input="Name three colours.", temperature=0, max_output_tokens=20)
    plain = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    final = "response.incomplete" if plain.status == "incomplete" else "response.completed"
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", final]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    rid = events[0].response.id
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    text = "".join(e.delta for e in deltas)
    assert text == plain.output_text
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 for e in deltas)
    assert events[-4].text == text
    assert events[-2].item.content[0].text == text
    done = events[-1].response
    assert done.id == rid and done.status == plain.status and done.output_text == text
    assert done.usage.output_tokens == plain.usage.output_tokens
    assert done.usage.input_tokens == plain.usage.input_tokens


def test_stream_helper_final_response(client):
    """client.responses.stream accumulates the events into the final response."""
    with client.responses.stream(model="smollm2", input="Say hello.", temperature=0,
                                 max_output_tokens=200) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert final.status == "completed"
    assert final.output_text == "".join(deltas) and final.output_text


def test_logprobs_equal_chat_completion(client):
    kw = dict(model="smollm2", input=Q, temperature=0, max_output_tokens=8, top_logprobs=2,
              include=["message.output_text.logprobs"])
    r = client.responses.create(**kw)
    ref = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": Q}],
                                         temperature=0, max_tokens=8, logprobs=True,
                                         top_logprobs=2)
    part = r.output[0].content[0]
    want = ref.choices[0].logprobs.content
    assert [(x.token, x.logprob) for x in part.logprobs] == [(x.token, x.logprob) for x in want]
    assert "".join(x.token for x in part.logprobs) == part.text
    assert all(len(x.top_logprobs) == 2 and x.top_logprobs[0].token == x.token
               for x in part.logprobs)               # greedy: the chosen token is the top one
    assert r.top_logprobs == 2
    events = list(client.responses.create(stream=True, **kw))
    streamed = [x.token for e in events if e.type == "response.output_text.delta"
                for x in e.logprobs]
    assert streamed == [x.token for x in part.logprobs]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert [x.token for x in done.logprobs] == streamed
    plain = client.responses.create(model="smollm2", input=Q, temperature=0, max_output_tokens=8)
    assert plain.output[0].content[0].logprobs == []


def test_max_output_tokens_incomplete(client):
    r = client.responses.create(model="smollm2", input=Q, temperature=0, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    events = list(client.responses.create(model="smollm2", input=Q, temperature=0,
                                          max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == r.output_text


def test_previous_response_id(client):
    """The stored conversation continues; instructions are not carried over (as OpenAI)."""
    first = "My name is Ada. Please remember it."
    r1 = client.responses.create(model="smollm2", input=first, instructions=SYSTEM,
                                 temperature=0, max_output_tokens=16)
    r2 = client.responses.create(model="smollm2", input="What is my name?",
                                 previous_response_id=r1.id, temperature=0, max_output_tokens=16)
    ref = chat(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": first}],
               16)
    assert r1.output_text == ref.choices[0].message.content
    ref2 = chat(client, [{"role": "user", "content": first},
                         {"role": "assistant", "content": r1.output_text},
                         {"role": "user", "content": "What is my name?"}], 16)
    assert r2.output_text == ref2.choices[0].message.content
    assert r2.usage.input_tokens == ref2.usage.prompt_tokens
    assert r2.previous_response_id == r1.id
    got = client.responses.retrieve(r1.id)
    assert got.id == r1.id and got.output_text == r1.output_text
    assert got.usage.input_tokens == r1.usage.input_tokens


def test_store_false_unknown_and_delete(client):
    r = client.responses.create(model="smollm2", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="smollm2", input="Hi", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    kept = client.responses.create(model="smollm2", input="Hi", max_output_tokens=2)
    assert client.responses.retrieve(kept.id).id == kept.id
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


BAD = [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", "web_search"),
    ({"input": "x", "text": {"format": {"type": "sound"}}}, "text.format.type", "sound"),
    ({}, "input", "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type", "input_image"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "robot"),
    ({"input": [{"type": "function_call", "call_id": 1, "name": "f", "arguments": "{}"}]},
     "input[0].call_id", "call_id"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"input": "x", "reasoning": {"effort": "huge"}}, "reasoning.effort", "huge"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", "no tools"),
    ({"input": "x", "temperature": 3}, "temperature", "temperature"),
    ({"input": "x", "previous_response_id": 5}, "previous_response_id", "string"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs", "top_logprobs"),
    ({"input": "x", "include": "all"}, "include", "include"),
    ({"input": [{"type": "reasoning", "content": "thought"}]}, "input[0].content", "reasoning"),
]


@pytest.mark.parametrize("extra,param,word", BAD, ids=[b[1] for b in BAD])
def test_bad_requests(server, extra, param, word):
    r = httpx.post(server.url + "/v1/responses", json={"model": "smollm2", **extra}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert word in err["message"] and "\n" not in err["message"]


def test_metrics_count_responses(server, client):
    client.responses.create(model="smollm2", input="Hi", max_output_tokens=2)
    httpx.post(server.url + "/v1/responses", json={"model": "smollm2"}, timeout=30)
    m = server.metrics()
    assert m['memfit_requests_total{endpoint="responses",status="200"}'] >= 1
    assert m['memfit_requests_total{endpoint="responses",status="400"}'] >= 1


# ----------------------------------------------------------------------------- tool calls

CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string",
                                                         "enum": ["Paris", "London"]}},
               "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": CITY_SCHEMA, "strict": True}]


@pytest.fixture(scope="module")
def tools_client(request):
    """A server on a tiny random-weight model whose template supports tools (the chat core's
    fixture); the tool-call constraint makes even random weights produce a valid call."""
    path = request.getfixturevalue("qwen_tools_model")
    s = ServerProcess([str(path), "--alias", "qwen-tools", "-np", "2"])
    request.addfinalizer(s.stop)
    return openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120)


def _validate(arguments: str) -> dict:
    import jsonschema
    args = json.loads(arguments)
    jsonschema.validate(args, CITY_SCHEMA)
    return args


def test_tool_call_conversation(tools_client):
    c = tools_client
    r = c.responses.create(model="qwen-tools", input="What is the weather in Paris?",
                           tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                           temperature=0, max_output_tokens=200)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and r.status == "completed"
    call = calls[0]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    _validate(call.arguments)
    # the tool's result, through the stored conversation, and the same turn spelt out
    r2 = c.responses.create(model="qwen-tools", previous_response_id=r.id, tools=TOOLS,
                            tool_choice="none", temperature=0, max_output_tokens=8,
                            input=[{"type": "function_call_output", "call_id": call.call_id,
                                    "output": "sunny, 21 C"}])
    assert [o.type for o in r2.output] == ["message"]
    explicit = c.responses.create(model="qwen-tools", tools=TOOLS, tool_choice="none",
                                  temperature=0, max_output_tokens=8, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert explicit.usage.input_tokens == r2.usage.input_tokens
    assert explicit.output_text == r2.output_text


def test_tool_call_streamed(tools_client):
    events = list(tools_client.responses.create(
        model="qwen-tools", input="Weather in London?", tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False,
        temperature=0, max_output_tokens=200, stream=True))
    added = [e for e in events if e.type == "response.output_item.added"
             and e.item.type == "function_call"]
    assert added and added[0].item.name == "get_weather"
    idx = added[0].output_index
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta"
                     and e.output_index == idx)
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"
              and e.output_index == idx]
    assert done.arguments == deltas
    _validate(done.arguments)
    assert events[-1].type == "response.completed"
    final = [o for o in events[-1].response.output if o.type == "function_call"]
    assert final[0].arguments == deltas and final[0].call_id == added[0].item.call_id


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_text_format_json_schema(client):
    import jsonschema
    r = client.responses.create(model="smollm2", input="Describe a person as JSON.",
                                max_output_tokens=200, temperature=0,
                                text={"format": {"type": "json_schema", "name": "person",
                                                 "schema": PERSON, "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema"


def _wait_metric(server, name, pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        v = server.metrics()[name]
        if pred(v) or time.monotonic() > deadline:
            return v
        time.sleep(0.05)


def test_stream_disconnect_stops_generation(server):
    before = server.metrics()
    body = {"model": "smollm2", "input": "Count: 1, 2, 3,", "max_output_tokens": 400,
            "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if "response.output_text.delta" in line:
                assert server.metrics()["memfit_requests_running"] == 1
                break
    assert _wait_metric(server, "memfit_requests_running", lambda v: v == 0) == 0
    assert _wait_metric(server, "memfit_kv_blocks_used", lambda v: v == 0) == 0
    after = server.metrics()
    assert after["memfit_client_disconnects_total"] == before["memfit_client_disconnects_total"] + 1
    assert after["memfit_generated_tokens_total"] - before["memfit_generated_tokens_total"] < 400


def test_unsupported_schema_is_400(server):
    r = httpx.post(server.url + "/v1/responses", timeout=30, json={
        "model": "smollm2", "input": "x", "text": {"format": {
            "type": "json_schema", "name": "x",
            "schema": {"type": "string", "format": "no-such-format"}}}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "text.format.schema" and "no-such-format" in err["message"]


def test_response_store_bounds():
    from memfit.server.responses import ENTRY_OVERHEAD, ResponseStore
    cap = 3 * (ENTRY_OVERHEAD + 100)
    st = ResponseStore(capacity=3, max_bytes=cap)
    for i in range(4):
        st.put(f"r{i}", {"i": i}, [])
    assert len(st) == 3 and st.get("r0") is None          # the oldest went first
    assert st.get("r1") == ({"i": 1}, [])                  # ... and a read makes one recent
    st.put("r4", {"i": 4}, [])
    assert st.get("r2") is None and st.get("r1") is not None
    fill = cap - ENTRY_OVERHEAD - len(json.dumps([{"t": ""}, []], separators=(",", ":")))
    st.put("big", {"t": "x" * fill}, [])                   # the byte bound evicts the rest
    assert len(st) == 1 and st.get("big") is not None and st.bytes == cap
    assert not st.put("huge", {"t": "x" * cap}, [])        # over the bound alone: not kept
    assert st.get("huge") is None and st.get("big") is not None
    assert st.delete("big") and st.bytes == 0 and len(st) == 0
    assert st.stats()["evicted"] == 5 and st.stats()["refused"] == 1


def test_response_store_books_its_bytes_in_the_ledger():
    """With a ledger, the store's bytes are its entry server/responses; when the ledger has
    no room for a new response, the least recently used ones are evicted until it fits."""
    from memfit.memory.ledger import Ledger
    from memfit.server.responses import ENTRY_OVERHEAD, LEDGER_NAME, ResponseStore
    led = Ledger(100_000, debug="")
    led.alloc("kv", "pool", 90_000)
    st = ResponseStore(capacity=100, max_bytes=50_000, ledger=lambda: led)
    one = {"t": "x" * (3000 - ENTRY_OVERHEAD - 12)}
    for i in range(5):
        assert st.put(f"r{i}", one, [])
    assert led.items("server") == {LEDGER_NAME: st.bytes} and len(st) == 3  # 10k of room
    assert st.get("r0") is None and st.get("r1") is None and st.get("r4") is not None
    assert st.stats()["evicted"] == 2 and led.total() <= 100_000
    led.free("kv", "pool")                               # room again: nothing more evicted
    for i in range(5, 10):
        st.put(f"r{i}", one, [])
    assert len(st) == 8 and led.items("server")[LEDGER_NAME] == st.bytes
    st.delete("r9")
    assert led.items("server")[LEDGER_NAME] == st.bytes


# ----------------------------------------------------------------------------- reasoning

@pytest.fixture(scope="module")
def reasoning_server(request, r1_model):
    """A tiny random model with DeepSeek-R1's template, which opens <think> in the generation
    prompt when thinking is on: random weights never close it, so all output is reasoning."""
    s = ServerProcess([str(r1_model), "--alias", "r1", "-np", "1"])
    request.addfinalizer(s.stop)
    return s


def test_reasoning_item(reasoning_server):
    c = openai.OpenAI(base_url=reasoning_server.base_url, api_key="x", max_retries=0)
    kw = dict(model="r1", input="Think about it.", reasoning={"effort": "high"},
              max_output_tokens=12, temperature=0)
    r = c.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning"]
    thought = r.output[0].content[0].text
    assert r.output[0].content[0].type == "reasoning_text" and thought
    assert r.status == "incomplete" and r.output_text == ""
    events = list(c.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[2:5] == ["response.output_item.added", "response.content_part.added",
                          "response.reasoning_text.delta"]
    assert types[-4:] == ["response.reasoning_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert events[-4].text == thought
    assert events[-1].response.output[0].content[0].text == thought


def test_reasoning_items_go_back_as_reasoning_content():
    """A reasoning item is the reasoning_content of the assistant turn after it (its content as
    memfit writes it, or OpenAI's summary); one before a user message answers nothing."""
    from memfit.server.responses import input_messages
    msgs = input_messages([
        {"role": "user", "content": "weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "call the tool"}]},
        {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "answer now"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "never used"}]},
        {"role": "user", "content": "thanks"}])
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant", "user"]
    assert msgs[1]["reasoning_content"] == "call the tool" and len(msgs[1]["tool_calls"]) == 2
    assert msgs[3]["reasoning_content"] == "answer now" and msgs[3]["content"] == "Sunny."
    assert all("never used" not in str(m) for m in msgs)


def test_reasoning_item_reaches_the_template(qwen3_server):
    """Over HTTP: Qwen3's template renders the reasoning of the current tool-call loop and drops
    an earlier turn's, so the prompt grows by the reasoning only in the first case."""
    c = openai.OpenAI(base_url=qwen3_server.base_url, api_key="x", max_retries=0, timeout=120)
    thought = {"type": "reasoning", "id": "rs_1", "summary": [],
               "content": [{"type": "reasoning_text", "text": "The user wants Paris; I will "
                                                              "call get_weather for it now."}]}
    loop = [{"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny, 21 C"}]

    def tokens(inp):
        return c.responses.create(model="qwen3", input=inp, tools=TOOLS, tool_choice="none",
                                  temperature=0, max_output_tokens=1).usage.input_tokens
    plain = tokens(loop)
    assert tokens(loop[:1] + [thought] + loop[1:]) > plain + 10
    later = [{"role": "user", "content": "And tomorrow?"}]
    assert tokens(loop[:1] + [thought] + loop[1:] + later) == tokens(loop + later)
