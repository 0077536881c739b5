"""Request validation and the guard's helpers, without a server (fast)."""

from __future__ import annotations

import pytest

from memfit.server import protocol as P
from memfit.server.security import host_name, is_loopback


def _err(fn, *a):
    with pytest.raises(P.APIError) as e:
        fn(*a)
    return e.value


def test_common_fields_defaults_and_caps():
    sampling, mt = P.common_fields({}, 512, None)
    assert mt is None and sampling["temperature"] == 0.8 and sampling["top_k"] == 40
    assert sampling["seed"] is None and sampling["stop"] == []
    _, mt = P.common_fields({"max_tokens": 5, "max_completion_tokens": 7}, 512, None)
    assert mt == 7  # the newer name wins
    _, mt = P.common_fields({"max_tokens": -1}, 512, 16)
    assert mt == 16
    s, _ = P.common_fields({"seed": -1, "stop": "x", "temperature": 0}, 512, None)
    assert s["seed"] is None and s["stop"] == ["x"] and s["temperature"] == 0.0


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 513}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"temperature": float("nan")}, "temperature"), ({"top_p": 1.01}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": "x"}, "frequency_penalty"), ({"seed": "1"}, "seed"),
    ({"stop": [""]}, "stop"), ({"stop": ["a"] * 17}, "stop"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"600": -1}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"),
])
def test_common_fields_errors_name_the_field(body, param):
    e = _err(P.common_fields, body, 512, None, 600)
    assert e.status == 400 and e.param == param and param.split(".")[0] in e.message
    assert e.body()["error"]["type"] == "invalid_request_error"


def test_messages_and_prompts():
    msgs = P.chat_messages({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}]})
    assert msgs == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
                    {"role": "assistant", "content": ""}]
    e = _err(P.chat_messages, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert e.param == "messages[0].content[0]"
    assert P.completion_prompts({"prompt": ["hello"]}) == ["hello"]
    assert P.completion_prompts({"prompt": "hello"}) == ["hello"]
    assert P.completion_prompts({"prompt": [[1, 2, 3]]}) == [[1, 2, 3]]
    assert P.completion_prompts({"prompt": [1, 2, 3]}) == [[1, 2, 3]]
    assert P.completion_prompts({"prompt": ["a", [1], "b"]}) == ["a", [1], "b"]
    for bad in ["", [], [1, "a"], None, 5, ["a", ""], [[1], []], ["x"] * 65]:
        assert _err(P.completion_prompts, {"prompt": bad}).param == "prompt"
    for body in [{"n": 0}, {"n": 17}, {"n": "2"}]:
        assert _err(P.get_n, body).param == "n"
    assert P.get_n({"n": 3}) == 3
    assert P.logit_bias({"logit_bias": {"5": -100, "7": 2.5}}, 600) == {5: -100.0, 7: 2.5}


def test_response_format_and_tools_fields():
    assert P.response_format_of({}) is None
    assert P.response_format_of({"response_format": {"type": "text"}}) is None
    assert P.response_format_of({"response_format": {"type": "json_object"}}) == {"type": "json_object"}
    s = {"type": "object"}
    assert P.response_format_of({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": s, "strict": True}}}) == {"type": "json_schema", "schema": s, "strict": True}
    assert P.response_format_of({"json_schema": s})["schema"] == s      # llama-server's field
    assert P.response_format_of({"grammar": "root ::= \"a\""})["type"] == "gbnf"
    for body, param in [({"response_format": {"type": "sound"}}, "response_format.type"),
                        ({"response_format": "json"}, "response_format"),
                        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
                        ({"response_format": {"type": "json_schema", "json_schema": {"schema": 1}}},
                         "response_format.json_schema.schema"),
                        ({"response_format": {"type": "json_object"}, "grammar": "x"}, "grammar")]:
        assert _err(P.response_format_of, body).param == param
    assert P.tool_fields({}) == (None, "none", True)
    t = [{"type": "function", "function": {"name": "f"}}]
    assert P.tool_fields({"tools": t}) == (t, "auto", True)
    for body in [{"tools": {}}, {"tools": t, "tool_choice": "sometimes"},
                 {"tool_choice": "required"}, {"tools": t, "tool_choice": 3}]:
        assert _err(P.tool_fields, body).param in ("tools", "tool_choice")
    msgs = P.chat_messages({"messages": [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}]})
    assert msgs[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert msgs[1] == {"role": "tool", "content": "42", "tool_call_id": "c1"}


def test_stream_and_logprob_fields():
    assert P.stream_fields({"stream": True, "stream_options": {"include_usage": True}}) == (True, True)
    assert _err(P.stream_fields, {"stream_options": {"include_usage": True}}).param == "stream_options"
    assert P.chat_logprobs({"logprobs": True, "top_logprobs": 3}) == (True, 3)
    assert _err(P.chat_logprobs, {"logprobs": True, "top_logprobs": 21}).param == "top_logprobs"
    assert P.completion_logprobs({"logprobs": 0}) == (True, 0)
    assert P.completion_logprobs({}) == (False, 0)


def test_host_helpers():
    assert host_name("LocalHost:8080") == "localhost"
    assert host_name("[::1]:80") == "::1" and host_name("127.0.0.1") == "127.0.0.1"
    assert is_loopback("127.0.0.5") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1")
    assert not is_loopback("example.com")
