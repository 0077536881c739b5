"""Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A request becomes a chat core ``ChatCall`` (chat.py), so limits, metrics, tools and reasoning
are the chat path's:

- ``system`` (a string or text blocks) -> a system message; ``messages`` with string or block
  content: ``text``; ``tool_use`` blocks on assistant turns -> ``tool_calls`` (input as JSON
  arguments); ``tool_result`` blocks on user turns -> ``tool`` messages (``is_error`` results
  are prefixed "Error: "); ``thinking`` blocks on assistant turns -> ``reasoning_content``
  (the chat template decides whether earlier reasoning shows: Qwen3's keeps it after the last
  user query), ``redacted_thinking`` blocks are dropped;
- ``tools`` ({name, description, input_schema}) -> chat tools; ``tool_choice`` auto / any /
  tool / none (+ ``disable_parallel_tool_use``) -> auto / required / a named function / none;
- ``thinking`` {"type": "enabled", "budget_tokens"} -> reasoning on (``reasoning_effort`` from
  the budget: up to 2048 low, up to 8192 medium, else high) and the budget enforced as a token
  count (the server closes the thinking there: toolcalls.ThinkingBudget), {"type":
  "disabled"} -> "none";
- ``output_config`` {"format": {"type": "json_schema", "schema"}} -> a strict JSON schema
  response format (structured output), its ``effort`` -> ``reasoning_effort``;
- the answer -> ``thinking``, ``text`` and ``tool_use`` blocks; ``stop_reason`` end_turn /
  max_tokens / stop_sequence / tool_use.

The engine reports "stop" for both an end-of-generation token and a stop string; a stop
string is recognised by the last token not being end-of-generation, and which one of the
``stop_sequences`` it was from the text that token produced (the engine withholds it).

Usage follows Anthropic's split: ``input_tokens`` are the prompt tokens not read from the
prefix cache, ``cache_read_input_tokens`` those that were; their sum is what count_tokens says.
Streaming sends message_start, ping, content_block_start / _delta (text_delta,
thinking_delta, signature_delta, input_json_delta) / _stop, message_delta (stop_reason,
usage), message_stop.
Errors have Anthropic's shape ``{"type": "error", "error": {"type", "message"}}`` (also from
the Guard in front of the app, see security.py). Shapes follow the ``anthropic`` package's types.
"""

from __future__ import annotations

import contextlib
import json
import traceback
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..errors import MemfitError
from . import protocol as P

# Anthropic's error types by HTTP status (else api_error)
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
          429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
          529: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _TYPES.get(status, "api_error"),
                                       "message": message}}


def error_response(e: P.APIError) -> JSONResponse:
    """An APIError in Anthropic's shape (the same status and headers)."""
    return JSONResponse(error_body(e.status, e.message), status_code=e.status,
                        headers={k: str(v) for k, v in e.headers.items()})


# ----------------------------------------------------------------------------- request

def _text_blocks(v, p: str) -> str:
    """A string or a list of text blocks at ``p`` as one string."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise P.bad(p, f"{p} must be a string or a list of text blocks")
    out = []
    for j, b in enumerate(v):
        q = f"{p}[{j}]"
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            t = b.get("type") if isinstance(b, dict) else None
            raise P.bad(q, f"{q} must be a text block {{\"type\": \"text\", \"text\": ...}}"
                           + (f"; {t!r} blocks are not supported" if t else ""))
        out.append(b["text"])
    return "".join(out)


def chat_messages(body: dict) -> list[dict]:
    """``system`` + ``messages`` -> OpenAI chat messages."""
    out: list[dict] = []
    system = body.get("system")
    if system is not None:
        s = _text_blocks(system, "system")
        if s:
            out.append({"role": "system", "content": s})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise P.bad("messages", "messages must be a non-empty list of {\"role\", \"content\"} "
                                "objects")
    names: dict[str, str] = {}   # tool_use id -> tool name, for the results
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise P.bad(p, f"{p} must be an object with role and content")
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise P.bad(f"{p}.role", f"{p}.role={role!r} must be user or assistant (the system "
                                     f"prompt goes in the top-level system field)")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise P.bad(f"{p}.content", f"{p}.content must be a string or a list of blocks")
        text, calls, thinking = [], [], []
        for j, b in enumerate(content):
            q = f"{p}.content[{j}]"
            t = b.get("type") if isinstance(b, dict) else None
            if t == "text":
                if not isinstance(b.get("text"), str):
                    raise P.bad(f"{q}.text", f"{q}.text must be a string")
                text.append(b["text"])
            elif t == "tool_use" and role == "assistant":
                tid, name, inp = b.get("id"), b.get("name"), b.get("input", {})
                if not isinstance(tid, str) or not isinstance(name, str):
                    raise P.bad(q, f"{q} must have a string id and name")
                if not isinstance(inp, dict):
                    raise P.bad(f"{q}.input", f"{q}.input must be an object")
                names[tid] = name
                calls.append({"id": tid, "type": "function",
                              "function": {"name": name,
                                           "arguments": json.dumps(inp, ensure_ascii=False)}})
            elif t == "tool_result" and role == "user":
                tid = b.get("tool_use_id")
                if not isinstance(tid, str):
                    raise P.bad(f"{q}.tool_use_id", f"{q}.tool_use_id must be a string")
                c = _text_blocks(b.get("content") or "", f"{q}.content")
                is_error = b.get("is_error")
                if is_error is not None and not isinstance(is_error, bool):
                    raise P.bad(f"{q}.is_error", f"{q}.is_error must be true or false")
                if text:   # text before a result stays before it
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                msg = {"role": "tool", "tool_call_id": tid,
                       "content": ("Error: " + c) if is_error else c}
                if tid in names:
                    msg["name"] = names[tid]
                out.append(msg)
            elif t == "thinking" and role == "assistant":
                if not isinstance(b.get("thinking"), str):
                    raise P.bad(f"{q}.thinking", f"{q}.thinking must be a string")
                thinking.append(b["thinking"])
            elif t == "redacted_thinking" and role == "assistant":
                continue   # encrypted by Anthropic: nothing a local model can read
            else:
                raise P.bad(f"{q}.type", f"{q}.type={t!r} is not supported in a {role} "
                                         f"message; memfit takes text"
                                         + (", tool_use and thinking" if role == "assistant"
                                            else " and tool_result") + " blocks")
        if role == "assistant":
            msg = {"role": "assistant", "content": "".join(text) if text or not calls else None}
            if thinking:
                msg["reasoning_content"] = "\n".join(thinking)
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif text or not any(o.get("role") == "tool" for o in out[-1:]):
            out.append({"role": "user", "content": "".join(text)})
    return out


def chat_tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise P.bad("tools", "tools must be a list of {name, description, input_schema}")
    out = []
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise P.bad(p, f"{p} must be an object {{name, description, input_schema}}")
        if t.get("type") not in (None, "custom"):
            raise P.bad(f"{p}.type", f"{p}.type={t.get('type')!r} is not supported; memfit "
                                     f"serves client tools ({{name, description, "
                                     f"input_schema}}) only")
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise P.bad(f"{p}.name", f"{p}.name must be a non-empty string")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise P.bad(f"{p}.input_schema", f"{p}.input_schema must be a JSON schema object")
        fn = {"name": name, "parameters": schema}
        if t.get("description") is not None:
            if not isinstance(t["description"], str):
                raise P.bad(f"{p}.description", f"{p}.description must be a string")
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(body: dict) -> tuple[object, bool]:
    """Anthropic tool_choice -> (chat tool_choice, parallel_tool_calls)."""
    tc = body.get("tool_choice")
    if tc is None:
        return ("auto" if body.get("tools") else "none"), True
    if tc == "none":
        return "none", True
    if not isinstance(tc, dict):
        raise P.bad("tool_choice", "tool_choice must be an object like {\"type\": \"auto\"}")
    parallel = not P.get_bool(tc, "disable_parallel_tool_use", False)
    t = tc.get("type")
    if t in ("auto", "none"):
        return t, parallel
    if t not in ("any", "tool"):
        raise P.bad("tool_choice.type", f"tool_choice.type={t!r} must be one of auto, any, "
                                        f"tool, none")
    if not body.get("tools"):
        raise P.bad("tool_choice", f"tool_choice.type={t!r} asks for a tool call but no tools "
                                   f"were given")
    if t == "any":
        return "required", parallel
    name = tc.get("name")
    if not isinstance(name, str) or not name:
        raise P.bad("tool_choice.name", "tool_choice.name must name a tool when type is "
                                        "\"tool\"")
    return {"type": "function", "function": {"name": name}}, parallel


def thinking_effort(body: dict) -> str | None:
    th = body.get("thinking")
    if th is None:
        return None
    if not isinstance(th, dict):
        raise P.bad("thinking", "thinking must be an object like {\"type\": \"enabled\", "
                                "\"budget_tokens\": 2048}")
    t = th.get("type")
    if t == "disabled":
        return "none"
    if t == "adaptive":
        return "medium"
    if t != "enabled":
        raise P.bad("thinking.type", f"thinking.type={t!r} must be enabled or disabled")
    budget = P.get_int(th, "budget_tokens", None, lo=1)
    if budget is None:
        raise P.bad("thinking.budget_tokens", "thinking.budget_tokens is required when "
                                              "thinking is enabled")
    return "low" if budget <= 2048 else "medium" if budget <= 8192 else "high"


def output_config(body: dict) -> tuple[dict | None, str | None]:
    """``output_config`` -> (the chat core's response format, reasoning effort):
    {"format": {"type": "json_schema", "schema"}} constrains the answer to the schema;
    ``effort`` low / medium / high (xhigh and max: high)."""
    oc = body.get("output_config")
    if oc is None:
        return None, None
    if not isinstance(oc, dict):
        raise P.bad("output_config", "output_config must be an object like {\"format\": "
                                     "{\"type\": \"json_schema\", \"schema\": {...}}}")
    rf = None
    fmt = oc.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            raise P.bad("output_config.format", "output_config.format must be {\"type\": "
                                                "\"json_schema\", \"schema\": {...}}")
        if not isinstance(fmt.get("schema"), dict):
            raise P.bad("output_config.format.schema", "output_config.format.schema must be a "
                                                       "JSON schema object")
        rf = {"type": "json_schema", "schema": fmt["schema"], "strict": True}
    effort = oc.get("effort")
    if effort is not None:
        if effort not in ("low", "medium", "high", "xhigh", "max"):
            raise P.bad("output_config.effort", f"output_config.effort={effort!r} must be one "
                                                f"of low, medium, high, xhigh, max")
        effort = "high" if effort in ("xhigh", "max") else effort
    return rf, effort


def stop_sequences(body: dict) -> list[str]:
    v = body.get("stop_sequences")
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise P.bad("stop_sequences", "stop_sequences must be a list of non-empty strings")
    if len(v) > P.MAX_STOP:
        raise P.bad("stop_sequences", f"stop_sequences has {len(v)} strings; at most "
                                      f"{P.MAX_STOP} are allowed")
    return v


def parse(ctx, body: dict, count_only: bool = False):
    """The request body -> ChatCall (count_tokens: max_tokens not required)."""
    from .chat import ChatCall
    from .responses import thinking_kwargs
    m = ctx.state.model
    model = ctx.check_model(body, lenient=True)
    msgs = chat_messages(body)
    max_tokens = None
    if not count_only:
        if body.get("max_tokens") is None:
            raise P.bad("max_tokens", "max_tokens: Field required")
        max_tokens = P.get_int(body, "max_tokens", None, lo=1, hi=m.n_ctx)
    # Anthropic's ranges: temperature and top_p in [0, 1]; top_k an integer >= 0
    sub = {}
    if body.get("temperature") is not None:
        sub["temperature"] = P.get_num(body, "temperature", None, 0.0, 1.0)
    if body.get("top_p") is not None:
        sub["top_p"] = P.get_num(body, "top_p", None, 0.0, 1.0, lo_open=True)
    if body.get("top_k") is not None:
        sub["top_k"] = P.get_int(body, "top_k", None, lo=0)
    sampling, _ = P.common_fields(sub, m.n_ctx, None)
    sampling["stop"] = stop_sequences(body)
    tool_choice, parallel = chat_tool_choice(body)
    rf, effort = output_config(body)
    effort = thinking_effort(body) or effort
    th = body.get("thinking")
    budget = th.get("budget_tokens") if effort and th and th.get("type") == "enabled" else None
    return ChatCall(model, msgs, sampling, max_tokens, chat_tools(body), tool_choice, parallel,
                    rf, reasoning_effort=effort, template_kwargs=thinking_kwargs(effort),
                    ignore_eos=P.get_bool(body, "ignore_eos", False), thinking_budget=budget)


# ----------------------------------------------------------------------------- answers

def tool_input(arguments: str) -> dict:
    """A call's JSON arguments as tool_use input (an object; anything else is kept whole
    under "arguments" rather than dropped)."""
    try:
        v = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {"arguments": arguments}
    return v if isinstance(v, dict) else {"arguments": v}


def matched_stop(run, text: str, stops: list[str]) -> str | None:
    """The stop sequence that ended choice 0, or None when it ended on end-of-generation.
    The engine withholds the stop string: it is in the text of the last token, after ``text``."""
    if not stops:
        return None
    gen = getattr(run, "gen", None)
    o = getattr(gen, "finished", {}).get(0) if gen is not None else None
    if o is None or o.token is None:
        return None
    tok = run.ctx.state.model.tokenizer
    if o.token in tok.eog_ids:
        return None
    piece = tok.token_to_bytes(o.token).decode("utf-8", errors="ignore")
    longest = max(len(s) for s in stops)
    tail = text[-longest:] + piece
    hits = [(tail.find(s), s) for s in stops if s in tail]
    return min(hits)[1] if hits else (stops[0] if len(stops) == 1 else None)


def stop_reason(finish: str, stop_seq: str | None) -> str:
    if finish == "tool_calls":
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    return "stop_sequence" if stop_seq is not None else "end_turn"


def usage_of(u: dict) -> dict:
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": u["prompt_tokens"] - cached, "output_tokens": u["completion_tokens"],
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _sse(name: str, data: dict) -> bytes:
    return (f"event: {name}\ndata: ".encode() + json.dumps(data, ensure_ascii=False).encode()
            + b"\n\n")


def routes(ctx) -> list[Route]:
    from .chat import Disconnected
    from .responses import abort_run, start

    def anthropic_errors(fn):
        """APIError / MemfitError -> Anthropic's error body (inside ctx.endpoint, which
        counts the status); a bug is a 500 in that shape too, its traceback on stderr."""
        async def handler(request: Request):
            try:
                return await fn(request)
            except P.APIError as e:
                return error_response(e)
            except MemfitError as e:
                return error_response(P.APIError(400, str(e)))
            except Disconnected:
                raise
            except Exception as e:  # noqa: BLE001 - a bug: still Anthropic's error shape
                traceback.print_exc()
                return error_response(P.APIError(500, f"internal error: {type(e).__name__}"))
        return handler

    @ctx.endpoint("messages")
    @anthropic_errors
    async def messages(request: Request):
        ctx.need_ready()
        body = await ctx.read_json(request)
        call = parse(ctx, body)
        stream = P.get_bool(body, "stream", False)
        run = await start(ctx, request, call, "output_config.format.schema")
        mid = "msg_" + uuid.uuid4().hex
        if stream:
            return StreamingResponse(stream_events(run, call, mid), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        choices, usage = await run.result()
        c = choices[0]
        blocks = []
        if c["reasoning"]:
            blocks.append({"type": "thinking", "thinking": c["reasoning"], "signature": ""})
        if c["content"] or not (c["tool_calls"] or c["reasoning"]):  # never no block at all
            blocks.append({"type": "text", "text": c["content"]})
        for tc in c["tool_calls"]:
            blocks.append({"type": "tool_use", "id": tc["id"], "name": tc["function"]["name"],
                           "input": tool_input(tc["function"]["arguments"])})
        seq = matched_stop(run, c["content"], call.sampling["stop"]) \
            if c["finish_reason"] == "stop" else None
        return JSONResponse({"id": mid, "type": "message", "role": "assistant",
                             "model": call.model, "content": blocks,
                             "stop_reason": stop_reason(c["finish_reason"], seq),
                             "stop_sequence": seq, "usage": usage_of(usage)})

    async def stream_events(run, call, mid: str):
        finished = False
        try:
            yield _sse("message_start", {"type": "message_start", "message": {
                "id": mid, "type": "message", "role": "assistant", "model": call.model,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": run.prompt_n, "output_tokens": 0}}})
            yield _sse("ping", {"type": "ping"})
            index, open_kind, text, finish = -1, None, "", "stop"

            def start(kind: str, block: dict):
                nonlocal index, open_kind
                out = stop_block()
                index += 1
                open_kind = kind
                out.append(_sse("content_block_start", {"type": "content_block_start",
                                                        "index": index,
                                                        "content_block": block}))
                return out

            def stop_block():
                nonlocal open_kind
                if open_kind is None:
                    return []
                # Anthropic closes a thinking block with its signature; a local model has
                # none to give (empty, as llama-server sends it)
                out = [delta({"type": "signature_delta", "signature": ""})] \
                    if open_kind == "thinking" else []
                open_kind = None
                return out + [_sse("content_block_stop", {"type": "content_block_stop",
                                                          "index": index})]

            def delta(d: dict) -> bytes:
                return _sse("content_block_delta", {"type": "content_block_delta",
                                                    "index": index, "delta": d})

            # poll=False: Starlette cancels this generator when the client leaves
            async with contextlib.aclosing(run.events(False)) as events:
                async for e in events:
                    kind = e[0]
                    if kind == "usage":
                        out = stop_block()
                        if index < 0:   # nothing generated: still one (empty) text block
                            out += start("text", {"type": "text", "text": ""}) + stop_block()
                        for x in out:
                            yield x
                        seq = matched_stop(run, text, call.sampling["stop"]) \
                            if finish == "stop" else None
                        yield _sse("message_delta", {
                            "type": "message_delta",
                            "delta": {"stop_reason": stop_reason(finish, seq),
                                      "stop_sequence": seq},
                            "usage": usage_of(e[1])})
                        yield _sse("message_stop", {"type": "message_stop"})
                        continue
                    if e[1] != 0:
                        continue
                    if kind == "finish":
                        finish = e[2]
                    elif kind == "content":
                        text += e[2]
                        if open_kind != "text":
                            for x in start("text", {"type": "text", "text": ""}):
                                yield x
                        yield delta({"type": "text_delta", "text": e[2]})
                    elif kind == "reasoning":
                        if open_kind != "thinking":
                            for x in start("thinking", {"type": "thinking", "thinking": "",
                                                        "signature": ""}):
                                yield x
                        yield delta({"type": "thinking_delta", "thinking": e[2]})
                    elif kind == "tool_call":
                        for x in start("tool_use", {"type": "tool_use", "id": e[3],
                                                    "name": e[4], "input": {}}):
                            yield x
                    elif kind == "tool_args" and open_kind == "tool_use":
                        yield delta({"type": "input_json_delta", "partial_json": e[3]})
            finished = True
        except P.APIError as err:
            finished = True
            yield _sse("error", error_body(err.status, err.message))
        except Exception as err:  # noqa: BLE001 - an engine failure mid-stream: report it
            finished = True
            yield _sse("error", error_body(500, f"{type(err).__name__}: {err}"))
        finally:
            if not finished:
                ctx.metrics.disconnects.inc()
            # the client may have left before the events generator started (closing that
            # would not run its cleanup): stop the run here; a no-op once it has finished
            abort_run(run)

    @ctx.endpoint("messages")
    @anthropic_errors
    async def count_tokens(request: Request):
        ctx.need_ready()
        body = await ctx.read_json(request)
        call = parse(ctx, body, count_only=True)
        return JSONResponse({"input_tokens": await ctx.count_chat_tokens(call)})

    return [
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/messages/count_tokens", count_tokens, methods=["POST"]),
    ]
