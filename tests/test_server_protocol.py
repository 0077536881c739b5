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
    ({"stop": [""]}, "stop"), ({"stop": ["a"] * 17}, "stop"), ({"n": 0}, "n"), ({"n": 3}, "n"),
])
def test_common_fields_errors_name_the_field(body, param):
    e = _err(P.common_fields, body, 512, None)
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
    assert P.completion_prompt({"prompt": ["hello"]}) == "hello"
    assert P.completion_prompt({"prompt": [[1, 2, 3]]}) == [1, 2, 3]
    for bad in ["", [], [1, "a"], None, 5, [[1], [2]]]:
        assert _err(P.completion_prompt, {"prompt": bad}).param == "prompt"


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
