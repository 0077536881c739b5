"""OpenAI request validation and response shapes (explicit checks; no framework).

Every bad request becomes an APIError whose body is OpenAI's error object
``{"error": {"message", "type", "param", "code"}}``; the message names the field and what to
do. Unknown fields are ignored, as OpenAI's API does. Sampling defaults are llama-server's.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

# llama-server / OpenAI error types by status
_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          408: "timeout_error", 429: "rate_limit_error", 500: "server_error",
          503: "unavailable_error"}  # else invalid_request_error

MAX_STOP = 16          # stop strings per request
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat top_logprobs
MAX_N = 16             # choices per request
MAX_PROMPTS = 64       # prompts in one /v1/completions request


class APIError(Exception):
    """An HTTP error with an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self):
        """The one writer of error responses (the app, the guard and the h11 protocol's 400)."""
        from starlette.responses import JSONResponse
        return JSONResponse(self.body(), status_code=self.status,
                            headers={k: str(v) for k, v in self.headers.items()})


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object; its code is a string or null, never the HTTP status."""
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


# ----------------------------------------------------------------------------- field checks

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def get_int(body: dict, name: str, default, lo: int | None = None, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise bad(name, f"{name}={v!r} must be an integer")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise bad(name, f"{name}={v} is out of range; use an integer in {rng}")
    return v


def get_num(body: dict, name: str, default, lo: float, hi: float, lo_open: bool = False):
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v):
        raise bad(name, f"{name}={v!r} must be a finite number")
    if v < lo or v > hi or (lo_open and v == lo):
        raise bad(name, f"{name}={v} is out of range; use a number in "
                        f"{'(' if lo_open else '['}{lo}, {hi}]")
    return float(v)


def get_bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"{name}={v!r} must be true or false")
    return v


def get_stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise bad("stop", "stop must be a non-empty string or a list of non-empty strings")
    if len(v) > MAX_STOP:
        raise bad("stop", f"stop has {len(v)} strings; at most {MAX_STOP} are allowed")
    return v


# ----------------------------------------------------------------------------- requests

@dataclass
class GenRequest:
    """A validated generation request, endpoint-independent."""

    kind: str                          # "chat" | "completion"
    model: str
    prompt_ids: list[int]
    sampling: dict                     # SamplingParams keywords
    max_tokens: int | None             # None: until end-of-generation or the context is full
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    n_top: int = 0                     # top alternatives per token
    echo_text: str = ""                # completions with echo: the prompt text
    ignore_eos: bool = False           # llama-server's extension: end-of-generation does not stop
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


def get_n(body: dict) -> int:
    """OpenAI's n: that many choices, each its own engine request (seed, seed+1, ...)."""
    return get_int(body, "n", 1, lo=1, hi=MAX_N)


def logit_bias(body: dict, n_vocab: int) -> dict[int, float] | None:
    """OpenAI's logit_bias {"token id": bias in [-100, 100]}; -100 bans a token, 100 forces it."""
    v = body.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad("logit_bias", 'logit_bias must be an object like {"1234": -100}')
    out = {}
    for k, b in v.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            raise bad("logit_bias", f"logit_bias key {k!r} is not a token id") from None
        if not 0 <= tid < n_vocab:
            raise bad("logit_bias", f"logit_bias token id {tid} is outside the vocabulary "
                                    f"(0..{n_vocab - 1})")
        if not _is_num(b) or not -100 <= b <= 100:
            raise bad("logit_bias", f"logit_bias[{k!r}]={b!r} must be a number in [-100, 100]")
        out[tid] = float(b)
    return out or None


def common_fields(body: dict, n_ctx: int, max_tokens_default: int | None,
                  n_vocab: int | None = None) -> tuple[dict, int | None]:
    """Sampling keywords and max_tokens shared by both endpoints (llama-server defaults)."""
    mt = body.get("max_completion_tokens")
    name = "max_completion_tokens"
    if mt is None:
        mt, name = body.get("max_tokens"), "max_tokens"
    if mt is None or mt == -1:  # -1: llama-server's "until the context is full"
        max_tokens = max_tokens_default
    else:
        if not _is_int(mt):
            raise bad(name, f"{name}={mt!r} must be an integer")
        if mt < 1:
            raise bad(name, f"{name}={mt} must be >= 1")
        if mt > n_ctx:
            raise bad(name, f"{name}={mt} exceeds the context size {n_ctx}; "
                            f"ask for at most {n_ctx} tokens")
        max_tokens = mt
    seed = get_int(body, "seed", None)
    sampling = dict(
        temperature=get_num(body, "temperature", 0.8, 0.0, 2.0),
        top_p=get_num(body, "top_p", 0.95, 0.0, 1.0, lo_open=True),
        top_k=get_int(body, "top_k", 40, lo=0),
        min_p=get_num(body, "min_p", 0.05, 0.0, 1.0),
        repeat_penalty=get_num(body, "repeat_penalty", 1.0, 0.0, 10.0, lo_open=True),
        repeat_last_n=get_int(body, "repeat_last_n", 64, lo=-1),
        presence_penalty=get_num(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=get_num(body, "frequency_penalty", 0.0, -2.0, 2.0),
        seed=None if seed is None or seed == -1 else seed,
        stop=get_stop(body),
    )
    dm = body.get("speculative.n_max")  # llama-server's per-request draft length
    if dm is not None:
        if not _is_int(dm) or dm < 0:
            raise bad("speculative.n_max", f"speculative.n_max={dm!r} must be an integer >= 0 "
                                           f"(0: no speculation)")
        sampling["draft_max"] = dm
    if n_vocab is not None:
        lb = logit_bias(body, n_vocab)
        if lb:
            sampling["logit_bias"] = lb
    return sampling, max_tokens


_RF_TYPES = ("text", "json_object", "json_schema")


def response_format_of(body: dict) -> dict | None:
    """The output constraint of a request: OpenAI's response_format, or llama-server's
    top-level json_schema / grammar (GBNF); None for free text. Returned normalised as
    {"type": "json_object"} | {"type": "json_schema", "schema", "strict"} |
    {"type": "gbnf", "grammar"}."""
    given = [k for k in ("response_format", "json_schema", "grammar") if body.get(k) is not None]
    if len(given) > 1:
        raise bad(given[1], f"{' and '.join(given)} were both given; use one of them")
    if body.get("json_schema") is not None:
        js = body["json_schema"]
        if not isinstance(js, dict):
            raise bad("json_schema", "json_schema must be a JSON schema object")
        return {"type": "json_schema", "schema": js, "strict": True}
    if body.get("grammar") is not None:
        g = body["grammar"]
        if not isinstance(g, str) or not g.strip():
            raise bad("grammar", "grammar must be a non-empty GBNF grammar string")
        return {"type": "gbnf", "grammar": g}
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise bad("response_format", 'response_format must be an object like {"type": "json_object"}')
    t = rf.get("type")
    if t not in _RF_TYPES:
        raise bad("response_format.type", f"response_format.type={t!r} is not supported; use "
                                          f"one of {', '.join(_RF_TYPES)}")
    if t == "text":
        return None
    if t == "json_object":
        schema = rf.get("schema")  # llama-server's extension: json_object with a schema
        if schema is None:
            return {"type": "json_object"}
        if not isinstance(schema, dict):
            raise bad("response_format.schema", "response_format.schema must be a JSON schema object")
        return {"type": "json_schema", "schema": schema, "strict": True}
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise bad("response_format.json_schema",
                  'response_format.json_schema must be an object like {"name": ..., "schema": {...}}')
    name = js.get("name")
    if name is not None and (not isinstance(name, str) or len(name) > 64):
        raise bad("response_format.json_schema.name",
                  "response_format.json_schema.name must be a string of at most 64 characters")
    schema = js.get("schema", {})
    if not isinstance(schema, dict):
        raise bad("response_format.json_schema.schema",
                  "response_format.json_schema.schema must be a JSON schema object")
    strict = js.get("strict", False)
    if not isinstance(strict, bool):
        raise bad("response_format.json_schema.strict", "strict must be true or false")
    return {"type": "json_schema", "schema": schema, "strict": strict}


def response_format_spec(rf: dict) -> dict:
    """A normalised response format as a memfit.constrain spec."""
    return dict(rf)


def tool_fields(body: dict) -> tuple[list | None, object, bool]:
    """tools, tool_choice, parallel_tool_calls (deep checks: toolcalls.validate_tools)."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad("tools", 'tools must be a list of {"type": "function", "function": {...}}')
    tools = tools or None
    tc = body.get("tool_choice")
    if tc is None:
        tc = "auto" if tools else "none"
    if not isinstance(tc, (str, dict)):
        raise bad("tool_choice", 'tool_choice must be "auto", "none", "required" or '
                                 '{"type": "function", "function": {"name": ...}}')
    if tc not in ("none", "auto") and isinstance(tc, str) and tc != "required":
        raise bad("tool_choice", f'tool_choice={tc!r} must be "auto", "none", "required" or a '
                                 f'named function')
    if tc != "none" and tc != "auto" and not tools:
        raise bad("tool_choice", "tool_choice asks for a tool call but no tools were given")
    return tools, tc, get_bool(body, "parallel_tool_calls", True)


def stream_fields(body: dict) -> tuple[bool, bool]:
    stream = get_bool(body, "stream", False)
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not isinstance(so, dict):
            raise bad("stream_options", "stream_options must be an object like {\"include_usage\": true}")
        if not stream:
            raise bad("stream_options", "stream_options is only allowed when stream is true")
        include_usage = get_bool(so, "include_usage", False)
    return stream, include_usage


def _text_content(c, p: str) -> str:
    if isinstance(c, list):
        parts = []
        for j, part in enumerate(c):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise bad(f"{p}.content[{j}]", f"{p}.content[{j}] must be a text part "
                                                f"{{\"type\": \"text\", \"text\": ...}}; "
                                                f"other content types are not supported")
            parts.append(part["text"])
        c = "".join(parts)
    if not isinstance(c, str):
        raise bad(f"{p}.content", f"{p}.content must be a string or a list of text parts")
    return c


def _tool_calls(v, p: str) -> list[dict]:
    if not isinstance(v, list):
        raise bad(f"{p}.tool_calls", f"{p}.tool_calls must be a list of tool calls")
    out = []
    for k, tc in enumerate(v):
        q = f"{p}.tool_calls[{k}]"
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(q, f'{q} must be {{"id", "type": "function", "function": {{"name", '
                         f'"arguments"}}}}')
        args = fn.get("arguments", "{}")
        if isinstance(args, dict):  # some clients send the object itself
            args = json.dumps(args, ensure_ascii=False)
        if not isinstance(args, str):
            raise bad(f"{q}.function.arguments", f"{q}.function.arguments must be a JSON string")
        cid = tc.get("id")
        out.append({"id": cid if isinstance(cid, str) else f"call_{k}", "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def chat_messages(body: dict) -> list[dict]:
    """messages as OpenAI chat messages for the chat template: {"role", "content": str} (text
    parts joined), plus tool_calls and reasoning_content on assistant turns and tool_call_id
    on tool results."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "messages must be a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(p, f"{p} must be an object with role and content")
        role = m.get("role")
        if not isinstance(role, str) or role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(f"{p}.role", f"{p}.role={role!r} must be one of system, developer, user, "
                                   f"assistant, tool")
        c = m.get("content")
        if c is None and role == "assistant":
            c = ""
        msg = {"role": "system" if role == "developer" else role, "content": _text_content(c, p)}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], p)
        if role == "assistant" and m.get("reasoning_content") is not None:
            # earlier reasoning (llama-server's field): the template decides whether it shows
            if not isinstance(m["reasoning_content"], str):
                raise bad(f"{p}.reasoning_content", f"{p}.reasoning_content must be a string")
            msg["reasoning_content"] = m["reasoning_content"]
        if role == "tool":
            tid = m.get("tool_call_id")
            if tid is not None and not isinstance(tid, str):
                raise bad(f"{p}.tool_call_id", f"{p}.tool_call_id must be a string")
            if tid is not None:
                msg["tool_call_id"] = tid
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def chat_logprobs(body: dict) -> tuple[bool, int]:
    lp = get_bool(body, "logprobs", False)
    top = get_int(body, "top_logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS)
    if top and not lp:
        raise bad("top_logprobs", "top_logprobs needs logprobs set to true")
    return lp, top


def completion_prompts(body: dict) -> list:
    """The prompts of /v1/completions: each a text or a list of token ids (OpenAI takes a
    string, a list of strings, a list of ids or a list of id lists)."""
    p = body.get("prompt")
    if isinstance(p, str) or (isinstance(p, list) and p and all(_is_int(t) for t in p)):
        p = [p]
    if not isinstance(p, list) or not p:
        raise bad("prompt", "prompt must be a non-empty string, a list of token ids, or a list "
                            "of those")
    if len(p) > MAX_PROMPTS:
        raise bad("prompt", f"prompt has {len(p)} prompts; at most {MAX_PROMPTS} are allowed")
    for i, q in enumerate(p):
        if isinstance(q, str):
            if not q:
                raise bad("prompt", f"prompt[{i}] is empty; give some text or token ids")
        elif not (isinstance(q, list) and q and all(_is_int(t) for t in q)):
            raise bad("prompt", f"prompt[{i}] must be a non-empty string or a non-empty list "
                                f"of token ids")
    return p


def completion_logprobs(body: dict) -> tuple[bool, int]:
    v = body.get("logprobs")
    if v is None or v is False:
        return False, 0
    if v is True:
        return True, 1
    n = get_int(body, "logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS)
    return True, n


# ----------------------------------------------------------------------------- responses

def usage(prompt_n: int, completion_n: int, cache_n: int) -> dict:
    return {"prompt_tokens": prompt_n, "completion_tokens": completion_n,
            "total_tokens": prompt_n + completion_n,
            "prompt_tokens_details": {"cached_tokens": cache_n}}


def chat_token_logprob(piece_bytes: bytes, lp: float, top: list, pieces) -> dict:
    """OpenAI chat logprobs entry; ``pieces(id) -> bytes``."""
    def one(b: bytes, x: float) -> dict:
        return {"token": b.decode("utf-8", errors="replace"), "logprob": x, "bytes": list(b)}
    d = one(piece_bytes, lp)
    d["top_logprobs"] = [one(pieces(i), x) for i, x in top]
    return d
