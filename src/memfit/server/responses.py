"""The OpenAI Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A request is turned into a chat core ``ChatCall`` (chat.py) and answered from its events, so
limits, metrics, tools, reasoning and structured output are the chat path's:

- ``input`` (a string or items: messages with input_text/output_text parts, ``function_call``
  and ``function_call_output`` items) and ``instructions`` -> OpenAI chat messages (assistant
  ``tool_calls`` and ``tool`` results); a ``reasoning`` item becomes the ``reasoning_content``
  of the assistant turn after it (vLLM's mapping; the chat template decides whether to render
  it: Qwen3's does within a tool-call loop, most drop earlier turns' reasoning);
- flat function ``tools`` -> chat tools; ``text.format`` -> ``response_format``;
  ``reasoning.effort`` -> ``reasoning_effort``; ``max_output_tokens`` -> ``max_tokens``;
- the answer -> ``output`` items: a ``reasoning`` item (reasoning_text content), a ``message``
  with one ``output_text`` part, ``function_call`` items; ``status`` is ``incomplete`` with
  ``incomplete_details.reason = "max_output_tokens"`` when the token limit cut it.

Streaming sends the official event sequence (``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``,
... ``response.completed`` or ``response.incomplete``), each with its ``sequence_number``.

Responses with ``store`` (the default) are kept in memory in a bounded LRU store (STORE_SIZE
entries, ``--response-store`` bytes) for ``previous_response_id`` and ``GET``: the conversation
so far as chat messages (without its instructions, which OpenAI does not carry over) plus the
response object. Its bytes are part of the memory budget: the plan reserves them and the store
books what it holds in the ledger (category "server"), evicting the least recently used
responses when the ledger refuses more. The store is in this process only; a restart forgets
it (an unknown or evicted id is a 404, as OpenAI's).
The shapes follow the ``openai`` package's types (openai/types/responses/).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections import OrderedDict

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..errors import BudgetError
from . import protocol as P
from .chat import ChatCall, start_chat

STORE_SIZE = 256          # stored responses kept (least recently used dropped first) ...
STORE_BYTES = 16 << 20    # ... and their bytes at most (--response-store), reserved in the plan
# per stored response besides its JSON: the bytes object, the id string, the map's slot
ENTRY_OVERHEAD = 512
LEDGER_NAME = "responses"   # the store's entry in the ledger's "server" category
EFFORTS = ("none", "minimal", "low", "medium", "high")
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "repeat_penalty",
                    "repeat_last_n", "presence_penalty", "frequency_penalty")


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


class ResponseStore:
    """A bounded LRU map: response id -> (response object, chat history after it), each kept
    as compact JSON bytes, so the bytes counted are the bytes held (plus ENTRY_OVERHEAD). At
    most ``capacity`` entries and ``max_bytes`` (the plan's reservation). With a ledger (a
    budget), the store's bytes are its ledger entry server/responses: an entry the ledger
    refuses evicts the least recently used ones until it fits, or is not kept. ``ledger`` is
    a callable (the model, and its ledger, loads after the routes exist)."""

    def __init__(self, capacity: int = STORE_SIZE, max_bytes: int = STORE_BYTES,
                 ledger=None):
        self.capacity, self.max_bytes = capacity, max_bytes
        self._ledger = ledger or (lambda: None)
        self._d: OrderedDict[str, bytes] = OrderedDict()
        self.bytes = 0
        self.evicted = 0            # entries dropped to make room
        self.refused = 0            # responses not kept (larger than the store, or no room)

    @staticmethod
    def _size(blob: bytes) -> int:
        return len(blob) + ENTRY_OVERHEAD

    def _book(self, total: int) -> bool:
        """Set the ledger entry to ``total`` bytes; False when the ledger refuses it."""
        led = self._ledger()
        if led is None:
            return True
        try:
            if LEDGER_NAME in led.items("server"):
                led.resize("server", LEDGER_NAME, total)
            else:
                led.alloc("server", LEDGER_NAME, total)
        except BudgetError:
            return False
        return True

    def _evict(self) -> None:
        self.bytes -= self._size(self._d.popitem(last=False)[1])
        self.evicted += 1

    def put(self, rid: str, response: dict, history: list[dict]) -> bool:
        """Keep a response; False when it is not kept."""
        self.delete(rid)
        blob = json.dumps([response, history], ensure_ascii=False,
                          separators=(",", ":")).encode()
        size = self._size(blob)
        if size > self.max_bytes:
            self.refused += 1
            return False
        while self._d and (len(self._d) >= self.capacity or self.bytes + size > self.max_bytes):
            self._evict()
        while not self._book(self.bytes + size):
            if not self._d:
                self.refused += 1
                self._book(0)
                return False
            self._evict()
        self._d[rid] = blob
        self.bytes += size
        return True

    def get(self, rid: str) -> tuple[dict, list[dict]] | None:
        blob = self._d.get(rid)
        if blob is None:
            return None
        self._d.move_to_end(rid)
        response, history = json.loads(blob)
        return response, history

    def delete(self, rid: str) -> bool:
        blob = self._d.pop(rid, None)
        if blob is None:
            return False
        self.bytes -= self._size(blob)
        self._book(self.bytes)
        return True

    def stats(self) -> dict:
        return {"bytes": self.bytes, "entries": len(self._d), "max_bytes": self.max_bytes,
                "capacity": self.capacity, "evicted": self.evicted, "refused": self.refused}

    def __len__(self) -> int:
        return len(self._d)


# ----------------------------------------------------------------------------- request

def _text_of(content, p: str, allowed: tuple[str, ...]) -> str:
    """Content at ``p`` (a string or a list of text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise P.bad(p, f"{p} must be a string or a list of text parts")
    out = []
    for j, part in enumerate(content):
        q = f"{p}[{j}]"
        if not isinstance(part, dict):
            raise P.bad(q, f"{q} must be an object like "
                           f"{{\"type\": \"input_text\", \"text\": ...}}")
        t = part.get("type")
        if t == "refusal" and isinstance(part.get("refusal"), str):
            out.append(part["refusal"])
            continue
        if t not in allowed:
            raise P.bad(f"{q}.type", f"{q}.type={t!r} is not supported; memfit takes text "
                                     f"parts ({', '.join(allowed)})")
        if not isinstance(part.get("text"), str):
            raise P.bad(f"{q}.text", f"{q}.text must be a string")
        out.append(part["text"])
    return "".join(out)


_TEXT_PARTS = ("input_text", "output_text", "text")


def input_messages(inp, param: str = "input", before: list[dict] = ()) -> list[dict]:
    """Responses ``input`` -> OpenAI chat messages. Consecutive ``function_call`` items (and
    the assistant message just before them) form one assistant turn with ``tool_calls``;
    ``before`` (a stored conversation) names the functions its calls' results answer."""
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    if not isinstance(inp, list) or not inp:
        raise P.bad(param, f"{param} must be a string or a non-empty list of input items")
    out: list[dict] = []
    names = {tc["id"]: tc["function"]["name"]    # call_id -> function name, for tool results
             for m in before for tc in m.get("tool_calls") or ()}
    assistant_open = False            # the last message is an assistant turn calls may join
    thought = None                    # a reasoning item's text, for the next assistant turn

    def assistant(msg: dict) -> dict:
        nonlocal thought
        if thought is not None:
            msg["reasoning_content"] = thought
            thought = None
        return msg

    for i, it in enumerate(inp):
        p = f"{param}[{i}]"
        if not isinstance(it, dict):
            raise P.bad(p, f"{p} must be an object (a message or a function_call / "
                           f"function_call_output item)")
        t = it.get("type", "message" if "role" in it else None)
        if t == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise P.bad(f"{p}.role", f"{p}.role={role!r} must be one of user, system, "
                                         f"developer, assistant")
            text = _text_of(it.get("content"), f"{p}.content", _TEXT_PARTS)
            msg = {"role": "system" if role == "developer" else role, "content": text}
            if role == "assistant":
                assistant(msg)
            else:
                thought = None    # reasoning answers the turn after it, not a user's message
            out.append(msg)
            assistant_open = role == "assistant"
        elif t == "function_call":
            call_id, name, args = it.get("call_id"), it.get("name"), it.get("arguments")
            for k, v in (("call_id", call_id), ("name", name), ("arguments", args)):
                if not isinstance(v, str):
                    raise P.bad(f"{p}.{k}", f"{p}.{k} must be a string")
            names[call_id] = name
            tc = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if assistant_open:
                last = out[-1]
                last.setdefault("tool_calls", []).append(tc)
                if last["content"] == "":
                    last["content"] = None
            else:
                out.append(assistant({"role": "assistant", "content": None, "tool_calls": [tc]}))
                assistant_open = True
        elif t == "function_call_output":
            call_id, output = it.get("call_id"), it.get("output")
            if not isinstance(call_id, str):
                raise P.bad(f"{p}.call_id", f"{p}.call_id must be a string")
            output = _text_of(output, f"{p}.output", _TEXT_PARTS)
            msg = {"role": "tool", "tool_call_id": call_id, "content": output}
            if call_id in names:
                msg["name"] = names[call_id]
            out.append(msg)
            assistant_open = False
            thought = None
        elif t == "reasoning":
            # content [{"type": "reasoning_text", "text"}] as memfit writes it, else the summary
            # [{"type": "summary_text", "text"}] as OpenAI's models return it; encrypted_content
            # (OpenAI's opaque form) has nothing memfit can read
            parts = it.get("content") or it.get("summary") or []
            if not isinstance(parts, list) or not all(
                    isinstance(q, dict) and isinstance(q.get("text"), str) for q in parts):
                raise P.bad(f"{p}.content", f"{p}: a reasoning item's content (or summary) must "
                                            f"be a list of {{\"type\": \"reasoning_text\", "
                                            f"\"text\": ...}} parts")
            text = "\n".join(q["text"] for q in parts)
            thought = text if thought is None else thought + "\n" + text
            assistant_open = False   # what follows is a new assistant turn, with this reasoning
        else:
            raise P.bad(f"{p}.type", f"{p}.type={t!r} is not supported; use message, "
                                     f"function_call, function_call_output or reasoning items")
    return out


def chat_tools(body: dict) -> list[dict] | None:
    """Responses' flat function tools -> OpenAI chat tools; other tool types are refused."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise P.bad("tools", "tools must be a list of function tools")
    out = []
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise P.bad(p, f"{p} must be an object {{\"type\": \"function\", \"name\", "
                           f"\"parameters\"}}")
        if t.get("type") != "function":
            raise P.bad(f"{p}.type", f"{p}.type={t.get('type')!r} is not supported; memfit "
                                     f"serves function tools only")
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise P.bad(f"{p}.name", f"{p}.name must be a non-empty string")
        fn = {"name": name}
        if t.get("description") is not None:
            if not isinstance(t["description"], str):
                raise P.bad(f"{p}.description", f"{p}.description must be a string")
            fn["description"] = t["description"]
        params = t.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise P.bad(f"{p}.parameters", f"{p}.parameters must be a JSON schema object")
            fn["parameters"] = params
        if t.get("strict") is not None:
            fn["strict"] = P.get_bool(t, "strict", False)
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(body: dict, tools: list | None):
    tc = body.get("tool_choice")
    if tc is None:
        return "auto" if tools else "none"
    if tc in ("auto", "none"):
        return tc
    if not tools:
        raise P.bad("tool_choice", "tool_choice asks for a tool call but no tools were given")
    if tc == "required":
        return tc
    if isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("name"), str):
        return {"type": "function", "function": {"name": tc["name"]}}
    raise P.bad("tool_choice", f"tool_choice={tc!r} is not supported; use \"auto\", \"none\", "
                               f"\"required\" or {{\"type\": \"function\", \"name\": ...}}")


def response_format(body: dict) -> dict | None:
    """``text.format`` -> the chat core's normalised response format (protocol.py's
    response_format_of: {"type": "json_object"} | {"type": "json_schema", "schema", "strict"});
    None for plain text."""
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise P.bad("text", "text must be an object like {\"format\": {\"type\": \"text\"}}")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise P.bad("text.format", "text.format must be an object with a type")
    t = fmt.get("type")
    if t == "text":
        return None
    if t == "json_object":
        return {"type": "json_object"}
    if t == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise P.bad("text.format.schema", "text.format.schema must be a JSON schema object")
        strict = fmt.get("strict", False)
        if not isinstance(strict, bool):
            raise P.bad("text.format.strict", "text.format.strict must be true or false")
        return {"type": "json_schema", "schema": schema, "strict": strict}
    raise P.bad("text.format.type", f"text.format.type={t!r} is not supported; use text, "
                                    f"json_object or json_schema")


def reasoning_effort(body: dict) -> str | None:
    r = body.get("reasoning")
    if r is None:
        return None
    if not isinstance(r, dict):
        raise P.bad("reasoning", "reasoning must be an object like {\"effort\": \"low\"}")
    e = r.get("effort")
    if e is not None and e not in EFFORTS:
        raise P.bad("reasoning.effort", f"reasoning.effort={e!r} must be one of "
                                        f"{', '.join(EFFORTS)}")
    return e


LOGPROBS_INCLUDE = "message.output_text.logprobs"


def logprob_fields(body: dict) -> tuple[bool, int]:
    """(logprobs wanted, top alternatives per token): ``include`` with
    "message.output_text.logprobs" or ``top_logprobs`` > 0 (other include values name outputs
    of hosted tools memfit does not have, and change nothing)."""
    inc = body.get("include")
    if inc is not None and (not isinstance(inc, list) or not all(isinstance(x, str) for x in inc)):
        raise P.bad("include", "include must be a list of strings")
    top = P.get_int(body, "top_logprobs", 0, lo=0, hi=P.MAX_TOP_LOGPROBS)
    return bool(top) or LOGPROBS_INCLUDE in (inc or []), top


def thinking_kwargs(effort: str | None) -> dict:
    """Chat-template variables for a reasoning request: templates that can think either way
    (Qwen3, DeepSeek-R1 as llama.cpp ships them) read ``enable_thinking``; asked for reasoning,
    it is on (off for "none" / "minimal" is the chat core's)."""
    return {"enable_thinking": True} if effort in ("low", "medium", "high") else {}


def max_output_tokens(body: dict, n_ctx: int) -> int | None:
    v = body.get("max_output_tokens")
    if v is None:
        return None
    if not P._is_int(v) or v < 1:
        raise P.bad("max_output_tokens", f"max_output_tokens={v!r} must be an integer >= 1")
    if v > n_ctx:
        raise P.bad("max_output_tokens", f"max_output_tokens={v} exceeds the context size "
                                         f"{n_ctx}; ask for at most {n_ctx} tokens")
    return v


def sampling_of(body: dict, n_ctx: int) -> dict:
    """The sampling keywords (memfit's defaults, as on chat completions) from the fields the
    Responses API shares with chat (temperature, top_p) and llama-server's extensions."""
    sub = {k: body[k] for k in _SAMPLING_FIELDS if k in body}
    sampling, _ = P.common_fields(sub, n_ctx, None)
    return sampling


# ----------------------------------------------------------------------------- response objects

def usage_of(u: dict) -> dict:
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [text_part(text)]}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(item_id: str, call_id: str, name: str, args: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": args, "status": status}


def history_of(output: list[dict]) -> list[dict]:
    """A response's output items as the chat messages of its assistant turn."""
    text = "".join(part["text"] for it in output if it["type"] == "message"
                   for part in it["content"])
    calls = [{"id": it["call_id"], "type": "function",
              "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in output if it["type"] == "function_call"]
    msg = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        msg["tool_calls"] = calls
    return [msg]


class Request_:
    """One validated Responses request: the chat call and what the response object echoes."""

    def __init__(self, call: ChatCall, body: dict, history: list[dict], instructions,
                 stream: bool, store: bool, previous: str | None):
        self.call, self.body, self.history = call, body, history
        self.instructions, self.stream, self.store, self.previous = \
            instructions, stream, store, previous
        self.id = _id("resp_")
        self.created = int(time.time())

    def response(self, status: str, output: list[dict], usage: dict | None,
                 incomplete: bool = False) -> dict:
        b, c = self.body, self.call
        fmt = (b.get("text") or {}).get("format") if isinstance(b.get("text"), dict) else None
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": self.instructions, "max_output_tokens": c.max_tokens,
            "model": c.model, "output": output, "parallel_tool_calls": c.parallel_tool_calls,
            "previous_response_id": self.previous,
            "reasoning": {"effort": c.reasoning_effort, "summary": None},
            "store": self.store, "temperature": c.sampling.get("temperature"),
            "text": {"format": fmt or {"type": "text"}},
            "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [],
            "top_p": c.sampling.get("top_p"), "top_logprobs": c.n_top, "truncation": "disabled",
            "usage": usage, "user": b.get("user"), "metadata": b.get("metadata") or {},
            **({"completed_at": int(time.time())} if status != "in_progress" else {}),
        }


def parse(ctx, body: dict, store: ResponseStore) -> Request_:
    m = ctx.state.model
    model = ctx.check_model(body)
    if "input" not in body:
        raise P.bad("input", "input is required: a string or a list of input items")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise P.bad("instructions", "instructions must be a string")
    previous = body.get("previous_response_id")
    before: list[dict] = []
    if previous is not None:
        if not isinstance(previous, str):
            raise P.bad("previous_response_id", "previous_response_id must be a string")
        got = store.get(previous)
        if got is None:
            raise P.APIError(404, f"Previous response with id {previous!r} not found.",
                             param="previous_response_id", code="previous_response_not_found")
        before = got[1]
    history = before + input_messages(body["input"], before=before)
    msgs = ([{"role": "system", "content": instructions}] if instructions else []) + history
    tools = chat_tools(body)
    tool_choice = chat_tool_choice(body, tools)
    parallel = P.get_bool(body, "parallel_tool_calls", True)
    effort = reasoning_effort(body)
    lp, top = logprob_fields(body)
    call = ChatCall(model, msgs, sampling_of(body, m.n_ctx), max_output_tokens(body, m.n_ctx),
                    tools, tool_choice, parallel, response_format(body), logprobs=lp, n_top=top,
                    reasoning_effort=effort, template_kwargs=thinking_kwargs(effort),
                    ignore_eos=P.get_bool(body, "ignore_eos", False))
    return Request_(call, body, history, instructions, P.get_bool(body, "stream", False),
                    P.get_bool(body, "store", True), previous)


# ----------------------------------------------------------------------------- answers

class Builder:
    """Chat events -> Responses output items and, when streaming, the SSE events that build
    them (an item is opened on its first event and closed when another kind starts)."""

    def __init__(self, req: Request_, new_logprobs=None):
        self.req = req
        self.output: list[dict] = []
        self.open: dict | None = None     # the item being built
        self.seq = 0
        # () -> the logprob entries of tokens not reported yet (None: not asked for); they go
        # with the next text delta, as chat completions' stream sends them
        self.new_logprobs = new_logprobs or (lambda: [])

    def ev(self, type_: str, **fields) -> bytes:
        d = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return (f"event: {type_}\ndata: ".encode() + json.dumps(d, ensure_ascii=False).encode()
                + b"\n\n")

    def _start(self, item: dict) -> list[bytes]:
        out = self.close()
        self.output.append(item)
        self.open = item
        idx = len(self.output) - 1
        added = dict(item, content=[]) if "content" in item else dict(item)
        out.append(self.ev("response.output_item.added", output_index=idx, item=added))
        if item["type"] == "message":
            out.append(self.ev("response.content_part.added", item_id=item["id"],
                               output_index=idx, content_index=0, part=text_part("")))
        elif item["type"] == "reasoning":
            out.append(self.ev("response.content_part.added", item_id=item["id"],
                               output_index=idx, content_index=0,
                               part={"type": "reasoning_text", "text": ""}))
        return out

    def close(self, status: str = "completed") -> list[bytes]:
        it, self.open = self.open, None
        if it is None:
            return []
        idx = len(self.output) - 1
        it["status"] = status
        out = []
        if it["type"] == "message":
            part = it["content"][0]
            out.append(self.ev("response.output_text.done", item_id=it["id"], output_index=idx,
                               content_index=0, text=part["text"], logprobs=part["logprobs"]))
            out.append(self.ev("response.content_part.done", item_id=it["id"], output_index=idx,
                               content_index=0, part=part))
        elif it["type"] == "reasoning":
            part = it["content"][0]
            out.append(self.ev("response.reasoning_text.done", item_id=it["id"],
                               output_index=idx, content_index=0, text=part["text"]))
            out.append(self.ev("response.content_part.done", item_id=it["id"], output_index=idx,
                               content_index=0, part=part))
        else:
            out.append(self.ev("response.function_call_arguments.done", item_id=it["id"],
                               output_index=idx, arguments=it["arguments"]))
        out.append(self.ev("response.output_item.done", output_index=idx, item=it))
        return out

    def push(self, e: tuple) -> list[bytes]:
        """One chat event of choice 0 -> SSE events (the items are updated either way)."""
        kind, it = e[0], self.open
        if kind == "content":
            out = [] if it is not None and it["type"] == "message" else \
                self._start(message_item(_id("msg_"), "", "in_progress"))
            part = self.open["content"][0]
            part["text"] += e[2]
            lp = self.new_logprobs()
            part["logprobs"] += lp
            out.append(self.ev("response.output_text.delta", item_id=self.open["id"],
                               output_index=len(self.output) - 1, content_index=0,
                               delta=e[2], logprobs=lp))
            return out
        if kind == "reasoning":
            out = [] if it is not None and it["type"] == "reasoning" else \
                self._start(reasoning_item(_id("rs_"), "", "in_progress"))
            self.open["content"][0]["text"] += e[2]
            out.append(self.ev("response.reasoning_text.delta", item_id=self.open["id"],
                               output_index=len(self.output) - 1, content_index=0, delta=e[2]))
            return out
        if kind == "tool_call":
            return self._start(call_item(_id("fc_"), e[3], e[4], "", "in_progress"))
        if kind == "tool_args":
            if it is None or it["type"] != "function_call":
                return []
            it["arguments"] += e[3]
            return [self.ev("response.function_call_arguments.delta", item_id=it["id"],
                            output_index=len(self.output) - 1, delta=e[3])]
        return []


async def start(ctx, request, call: ChatCall, format_field: str):
    """start_chat, with a response format the constraint compiler refuses reported under the
    API's own field name (the core names the chat field, response_format)."""
    try:
        return await start_chat(ctx, request, call)
    except P.APIError as e:
        if e.param == "response_format":
            e.param = format_field
            e.message = e.message.replace("json_schema.schema", format_field, 1)
        raise


def abort_run(run) -> None:
    """Stop a started chat run at once (frees its KV); a no-op once it has finished."""
    abort = getattr(run, "abort", None)
    (abort or run.gen.abort)()


def routes(ctx) -> list[Route]:
    state = ctx.state
    store = ResponseStore(max_bytes=getattr(state, "response_store_bytes", STORE_BYTES),
                          ledger=lambda: getattr(state.model, "ledger", None))
    state.response_store = store     # /metrics and /props report it

    def logprob_source(run):
        """Builder's new_logprobs for a run: OpenAI's logprob objects of choice 0's tokens
        since the last call (None when the request did not ask for logprobs)."""
        if not run.call.logprobs:
            return None
        tok = ctx.state.model.tokenizer
        sent = [0]

        def new() -> list[dict]:
            e = run.logprob_entries.get(0, [])
            k, sent[0] = sent[0], len(e)
            return [P.chat_token_logprob(tok.token_to_bytes(t), lp, top, tok.token_to_bytes)
                    for t, lp, top in e[k:]]
        return new

    def remember(req: Request_, resp: dict, output: list[dict]) -> None:
        if req.store:
            store.put(req.id, resp, req.history + history_of(output))

    @ctx.endpoint("responses")
    async def create(request: Request):
        ctx.need_ready()
        body = await ctx.read_json(request)
        req = parse(ctx, body, store)
        run = await start(ctx, request, req.call, "text.format.schema")
        if req.stream:
            return StreamingResponse(stream(req, run), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        b = Builder(req, logprob_source(run))
        usage, reason = {}, "stop"
        async with contextlib.aclosing(run.events()) as events:
            async for e in events:
                if e[0] == "usage":
                    usage = e[1]
                elif e[0] == "finish":
                    reason = e[2]
                elif e[1] == 0:
                    b.push(e)
        incomplete = reason == "length"
        b.close("incomplete" if incomplete else "completed")
        if not b.output:     # nothing generated: still one (empty) message
            b.output.append(message_item(_id("msg_"), "", "completed"))
        resp = req.response("incomplete" if incomplete else "completed", b.output,
                            usage_of(usage), incomplete)
        remember(req, resp, b.output)
        return JSONResponse(resp)

    async def stream(req: Request_, run):
        b = Builder(req, logprob_source(run))
        reason, finished = "stop", False
        try:
            yield b.ev("response.created", response=req.response("in_progress", [], None))
            yield b.ev("response.in_progress", response=req.response("in_progress", [], None))
            # poll=False: Starlette cancels this generator when the client leaves, and closing
            # the events generator aborts the run
            async with contextlib.aclosing(run.events(False)) as events:
                async for e in events:
                    if e[0] == "usage":
                        incomplete = reason == "length"
                        for x in b.close("incomplete" if incomplete else "completed"):
                            yield x
                        if not b.output:
                            for x in b._start(message_item(_id("msg_"), "", "in_progress")):
                                yield x
                            for x in b.close():
                                yield x
                        status = "incomplete" if incomplete else "completed"
                        resp = req.response(status, b.output, usage_of(e[1]), incomplete)
                        remember(req, resp, b.output)
                        yield b.ev(f"response.{status}", response=resp)
                    elif e[0] == "finish":
                        reason = e[2]
                    elif e[1] == 0:
                        for x in b.push(e):
                            yield x
            finished = True
        except Exception as err:  # noqa: BLE001 - an engine failure mid-stream: report it
            finished = True
            yield b.ev("error", code=getattr(err, "code", None) or "server_error",
                       message=getattr(err, "message", None) or f"{type(err).__name__}: {err}",
                       param=getattr(err, "param", None))
        finally:
            if not finished:
                ctx.metrics.disconnects.inc()
            # the client may have left before the events generator started (closing that
            # would not run its cleanup): stop the run here; a no-op once it has finished
            abort_run(run)

    def stored(request: Request) -> tuple[str, tuple]:
        rid = request.path_params["rid"]
        got = store.get(rid)
        if got is None:
            raise P.APIError(404, f"Response with id {rid!r} not found.", param="response_id")
        return rid, got

    @ctx.endpoint("responses")
    async def retrieve(request: Request):
        _, (resp, _) = stored(request)
        return JSONResponse(resp)

    @ctx.endpoint("responses")
    async def delete(request: Request):
        rid, _ = stored(request)
        store.delete(rid)
        return JSONResponse({"id": rid, "object": "response", "deleted": True})

    return [
        Route("/v1/responses", create, methods=["POST"]),
        Route("/responses", create, methods=["POST"]),
        Route("/v1/responses/{rid}", retrieve, methods=["GET"]),
        Route("/v1/responses/{rid}", delete, methods=["DELETE"]),
        Route("/responses/{rid}", retrieve, methods=["GET"]),
        Route("/responses/{rid}", delete, methods=["DELETE"]),
    ]
