"""The chat core: every generating endpoint runs through it.

OpenAI chat completions and completions (app.py), the Responses API (responses.py) and
Anthropic Messages (anthropic.py) each turn their request body into a ``ChatCall`` (or, for
completions, prompt ids) and read the same stream of events back, so limits, metrics, the
budget, structured output, tool calls, reasoning and disconnect handling are one code path:

    ctx = AppContext(state)                        # one per app: the shared request helpers
    run = await start_chat(ctx, request, call)     # templated, tokenized, queued, first token in
    async for ev in run.events(): ...              # ("content", choice, text), ("reasoning", ...),
                                                   # ("tool_call", ...), ("tool_args", ...),
                                                   # ("finish", choice, reason), ("usage", {...})
    choices, usage = await run.result()            # the same, collected (non-streamed answers)

A call with ``n`` > 1 is n engine requests with the same prompt (the prefix cache computes the
prompt once) and seeds seed, seed+1, ...; their outputs share one queue (worker.Job.index).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
import weakref
from dataclasses import dataclass, field

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from ..errors import MemfitError
from . import protocol as P
from .worker import Job, QueueTimeout

_UNSET = object()
_POLL_S = 0.25  # how often a waiting handler checks that its client is still there
MAX_N = 16      # choices per request


class Disconnected(Exception):
    """The client went away; nobody to answer (the handler returns 499)."""


@dataclass
class ChatCall:
    """A validated chat request, independent of the API it came in through."""

    model: str
    messages: list[dict]          # OpenAI chat messages (tool_calls on assistant turns,
    #                               tool_call_id on tool results)
    sampling: dict                # SamplingParams keywords
    max_tokens: int | None = None
    tools: list[dict] | None = None       # OpenAI chat tools
    tool_choice: object = "auto"          # "auto" | "none" | "required" | named function
    parallel_tool_calls: bool = True
    response_format: dict | None = None   # OpenAI chat response_format, or llama-server's
    #                                       {"type": "gbnf"|"lark"|"regex", ...}
    n: int = 1
    logprobs: bool = False
    n_top: int = 0
    reasoning_effort: str | None = None
    template_kwargs: dict = field(default_factory=dict)
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    prefill: str = ""             # a final assistant message to continue (llama-server's
    #                               assistant prefill, vLLM's continue_final_message)
    thinking_budget: int | None = None    # reasoning tokens before the server closes the
    #                                       reasoning (toolcalls.ThinkingBudget); None: no limit


# ----------------------------------------------------------------------------- app context

class AppContext:
    """The request helpers every endpoint module shares (``routes(ctx)``)."""

    def __init__(self, state):
        self.state = state
        self.metrics = state.metrics
        # one prompt templated and tokenized at a time, in bounded pieces that stop past the
        # context: the scratch is one piece (planner.PROMPT_SCRATCH_BYTES), not one per request
        self.prompt_gate = asyncio.Semaphore(1)
        self._src = _UNSET   # the chat template's jinja source, read once

    def endpoint(self, name: str):
        """Turns APIError/MemfitError into OpenAI error responses and counts statuses."""
        metrics = self.metrics

        def wrap(fn):
            async def handler(request: Request):
                request.state.t0 = time.perf_counter()  # arrival: TTFT and queue wait count from here
                try:
                    resp = await fn(request)
                except P.APIError as e:
                    resp = e.response()
                except MemfitError as e:
                    resp = P.APIError(400, str(e)).response()
                except Disconnected:  # nobody to answer; 499 is nginx's "client closed request"
                    resp = Response(status_code=499)
                metrics.requests.labels(name, str(resp.status_code)).inc()
                return resp
            return handler
        return wrap

    def need_ready(self) -> None:
        if not self.state.ready:
            raise P.APIError(503, "Loading model", headers={"Retry-After": "1"})

    async def read_json(self, request: Request) -> dict:
        try:
            raw = await request.body()  # read whole by the Guard before the app runs
        except ClientDisconnect:
            raise Disconnected() from None
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise P.APIError(400, f"malformed JSON in the request body: {e}") from None
        except RecursionError:
            raise P.APIError(400, "the JSON in the request body is nested too deeply") from None
        if not isinstance(body, dict):
            raise P.APIError(400, "the request body must be a JSON object")
        return body

    def check_model(self, body: dict, lenient: bool = False) -> str:
        """The served model's name; an unknown name is a 404 (OpenAI's and vLLM's behaviour)
        unless ``lenient`` (Anthropic clients send their own model names; the one loaded
        model answers, as llama-server does)."""
        ids = self.state.model_ids
        name = body.get("model")
        if name is None:
            return ids[0]
        if not isinstance(name, str):
            raise P.bad("model", f"model={name!r} must be a string")
        if name not in ids and lenient:
            return name
        if name not in ids:
            raise P.APIError(404, f"the model {name!r} does not exist; this server has "
                                  f"{ids[0]!r} (see GET /v1/models)",
                             param="model", code="model_not_found")
        return ids[0]

    async def prompt_ids(self, param: str, make, whole_context: bool = False) -> list[int]:
        """``make(limit)`` -> ids in a worker thread; more than the context (or
        --max-prompt-tokens) allows -> the context_length_exceeded 400 without the rest.
        A prompt leaves room for one generated token; /tokenize (whole_context) may fill it."""
        from ..memory.budget import trim_heap
        from ..tokenizer.vocab import TooManyTokens, UncuttableText
        state = self.state
        m = state.model
        cap = None if whole_context else state.max_prompt_tokens
        limit = m.n_ctx - (0 if whole_context else 1)
        limit = limit if cap is None else min(cap, limit)

        def work():
            try:
                return make(limit)
            finally:
                trim_heap()     # the pieces' memory back to the kernel before the next prompt

        async with self.prompt_gate:
            try:
                return await asyncio.to_thread(work)
            except UncuttableText as e:
                raise P.bad(param, str(e)) from None
            except TooManyTokens as e:
                if cap is not None and cap == limit:
                    raise P.APIError(400, f"the prompt has at least {e.n_at_least} tokens; "
                                          f"this server takes at most {cap} "
                                          f"(--max-prompt-tokens)", param,
                                     "context_length_exceeded") from None
                what = "content" if whole_context else "prompt"
                raise P.APIError(400, f"the {what} has at least {e.n_at_least} tokens but the "
                                      f"context is {m.n_ctx}; shorten the {what}", param,
                                 "context_length_exceeded") from None

    # --- chat prompts
    def render(self, call: ChatCall) -> "ChatPrompt":
        """The chat template applied to the call: prompt text, the tool-call format and the
        reasoning markers its output will be parsed with."""
        from ..tokenizer.templates import apply_template
        m = self.state.model
        tools = call.tools if call.tools and call.tool_choice != "none" else None
        kwargs = dict(call.template_kwargs)
        if call.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", call.reasoning_effort)
            # Qwen3-style templates: thinking off when the client asks for no reasoning
            if call.reasoning_effort in ("none", "minimal"):
                kwargs.setdefault("enable_thinking", False)
        if tools:
            kwargs["tools"] = tools
        try:
            text, _ = apply_template(m.tokenizer, m.file.arch, call.messages, True,
                                     self.state.chat_template, **kwargs)
        except MemfitError as e:
            raise P.bad("messages", str(e)) from None
        text += call.prefill
        from . import toolcalls
        from ..tokenizer.templates import template_source
        fmt = reasoning = None
        src = self._src if self._src is not _UNSET else \
            template_source(m.tokenizer, m.file.arch, self.state.chat_template)
        self._src = src
        if tools:
            fmt = toolcalls.detect_format(src, m.tokenizer)
        if self.state.reasoning_format != "none":
            reasoning = toolcalls.detect_reasoning(src, text)
        return ChatPrompt(text, fmt, reasoning, tools)

    async def chat_prompt(self, call: ChatCall) -> tuple["ChatPrompt", list[int]]:
        m = self.state.model
        holder = {}

        def make(limit):
            holder["p"] = cp = self.render(call)
            return m._prompt_ids(cp.text, limit)
        ids = await self.prompt_ids("messages", make)
        return holder["p"], ids

    async def count_chat_tokens(self, call: ChatCall) -> int:
        _, ids = await self.chat_prompt(call)
        return len(ids)

    async def constraint(self, call: ChatCall, cp: "ChatPrompt"):
        """The compiled grammar the call's output must follow, or None: a forced tool call
        (tool_choice required or a named function) or the response_format."""
        spec = None
        if cp.tools and call.tool_choice not in ("auto", "none"):
            from .toolcalls import tool_call_constraint
            try:
                spec = tool_call_constraint(cp.fmt, cp.tools, call.tool_choice,
                                            call.parallel_tool_calls, reasoning=cp.reasoning)
            except ValueError as e:
                raise P.bad("tool_choice", str(e)) from None
        elif call.response_format is not None:
            spec = P.response_format_spec(call.response_format)
        return await self.compile(spec)

    async def compile(self, spec: dict | None):
        if spec is None:
            return None
        from ..constrain import ConstraintError, compile_constraint
        tok = self.state.model.tokenizer
        try:
            return await asyncio.to_thread(compile_constraint, tok, spec)
        except ConstraintError as e:
            raise P.bad("response_format", str(e)) from None

    # --- generation
    def make_job(self, ids: list[int], sampling: dict, max_tokens: int | None, n_top: int,
                 t0: float, param: str, index: int = 0, ignore_eos: bool = False,
                 constraint=None, out: asyncio.Queue | None = None) -> Job:
        from ..engine.sampler import SamplingParams
        state, m = self.state, self.state.model
        n = len(ids)
        if n == 0:
            raise P.bad(param, "the prompt is empty (no tokens)")
        limit = state.max_prompt_tokens
        if limit is not None and n > limit:
            raise P.APIError(400, f"the prompt has {n} tokens; this server takes at most {limit} "
                                  f"(--max-prompt-tokens)", param, "context_length_exceeded")
        if n >= m.n_ctx:
            raise P.APIError(400, f"the prompt has {n} tokens but the context is {m.n_ctx}; "
                                  f"shorten the prompt", param, "context_length_exceeded")
        room = m.n_ctx - n  # max_tokens is capped by the context
        mt = room if max_tokens is None else min(max_tokens, room)
        try:
            params = SamplingParams(max_tokens=mt, **sampling)
        except MemfitError as e:
            raise P.APIError(400, str(e)) from None
        kw = {} if out is None else {"out": out}
        return Job(ids, params, n_top, asyncio.get_running_loop(), ignore_eos=ignore_eos,
                   t_submit=t0, constraint=constraint, index=index, **kw)

    async def launch(self, request: Request, jobs: list[Job]) -> "Generation":
        """Queue the jobs (all or none) and wait for each one's first output, so that a request
        that cannot start gets a proper status even when it asked for a stream."""
        state = self.state
        w = state.worker
        cap = state.n_parallel + state.max_queue
        if len(jobs) > cap:
            param = "n" if len({id(j.prompt_ids) for j in jobs}) == 1 else "prompt"
            raise P.bad(param, f"this request needs {len(jobs)} generations but the server runs "
                               f"at most {cap} at once (--parallel + --max-queue); ask for fewer")
        if w.pending + len(jobs) > cap:
            raise P.APIError(429, f"the server is busy: {w.pending} requests are running or "
                                  f"queued (limit {cap}); retry later", headers={"Retry-After": "1"})
        for j in jobs:
            w.submit(j)
        gen = Generation(self, request, jobs)
        try:
            await gen.prime()
        except BaseException:
            gen.abort()
            raise
        return gen


def _abort_jobs(worker, jobs) -> None:
    for j in jobs:
        if not j.done:
            worker.abort(j)  # a no-op for a job that finished meanwhile


def raise_item_error(item: Exception):
    if isinstance(item, QueueTimeout):
        raise P.APIError(429, f"the server is busy: the request {item}; retry later",
                         headers={"Retry-After": "1"})
    if isinstance(item, MemfitError):
        raise P.APIError(400, str(item))
    raise P.APIError(500, f"internal error: {type(item).__name__}: {item}")


@dataclass
class ChatPrompt:
    text: str
    fmt: object          # toolcalls.ToolFormat when tools are offered
    reasoning: object    # toolcalls.Reasoning when the template thinks
    tools: list | None


class Generation:
    """The engine requests of one HTTP request; ``items()`` yields (index, StepOutput) in
    arrival order until every one has finished. Accumulates usage and latency metrics."""

    def __init__(self, ctx: AppContext, request: Request, jobs: list[Job]):
        self.ctx, self.request, self.jobs = ctx, request, jobs
        self.out = jobs[0].out
        self.live = {j.index for j in jobs}
        self.first: list = []          # items read while priming, replayed by items()
        self.t_last: dict[int, float] = {}
        self.finished: dict[int, object] = {}   # index -> final StepOutput
        self.t_checked = time.perf_counter()
        # a run dropped without being read to its end (a stream that never started, a handler
        # that failed) still stops its engine requests
        self._fin = weakref.finalize(self, _abort_jobs, ctx.state.worker, list(jobs))

    async def _get(self):
        """The next (index, item); checks every _POLL_S that the client is still there (also
        while outputs keep coming, so a long non-streamed answer is stopped too)."""
        while True:
            now = time.perf_counter()
            if now - self.t_checked > _POLL_S:
                self.t_checked = now
                if await self.request.is_disconnected():
                    self.abort()
                    self.ctx.metrics.disconnects.inc()
                    raise Disconnected()
            try:
                return await asyncio.wait_for(self.out.get(), _POLL_S)
            except asyncio.TimeoutError:
                pass

    async def prime(self) -> None:
        waiting = set(self.live)
        while waiting:
            idx, item = await self._get()
            if isinstance(item, Exception):
                raise_item_error(item)
            self.first.append((idx, item))
            waiting.discard(idx)

    async def items(self, poll: bool = True):
        """(index, StepOutput) until all finished; an engine error mid-way is raised."""
        m = self.ctx.metrics
        pending = self.first
        self.first = []
        while self.live:
            if pending:
                idx, item = pending.pop(0)
            else:
                idx, item = await (self._get() if poll else self.out.get())
            if isinstance(item, Exception):
                raise item
            now = time.perf_counter()
            if item.token is not None:
                if idx not in self.t_last:
                    m.ttft.observe(now - self.jobs[0].t_submit)
                else:
                    m.itl.observe(now - self.t_last[idx])
                self.t_last[idx] = now
            if item.finished:
                self.live.discard(idx)
                self.finished[idx] = item
                m.prompt_tokens.inc(item.prompt_n)
                m.cached_tokens.inc(item.cache_n)
                m.generated_tokens.inc(item.n_generated)
            yield idx, item

    def abort(self) -> None:
        _abort_jobs(self.ctx.state.worker, self.jobs)

    def usage(self) -> dict:
        """OpenAI usage: the prompt counted once per prompt (n choices share it)."""
        fs = list(self.finished.values())
        prompts = {}
        for j in self.jobs:
            o = self.finished.get(j.index)
            key = id(j.prompt_ids)
            if o is not None:
                p, c = prompts.get(key, (0, 0))
                prompts[key] = (max(p, o.prompt_n), max(c, o.cache_n))
        pn = sum(p for p, _ in prompts.values())
        cn = sum(c for _, c in prompts.values())
        return P.usage(pn, sum(o.n_generated for o in fs), cn)

    def timings(self, index: int = 0) -> dict:
        """llama-server's `timings` of one choice (prompt_n counts the tokens not cached)."""
        o = self.finished.get(index)
        if o is None:
            return {}
        d = {"prompt_n": o.prompt_n - o.cache_n, "cache_n": o.cache_n, "predicted_n": o.n_generated}
        if o.timings is not None:
            d.update(o.timings.to_dict())
            d["cache_n"] = o.cache_n
        return d


# ----------------------------------------------------------------------------- chat runs

class _PlainParser:
    """Output parser of a call with neither tools nor reasoning markers: all text is content."""
    tool_calls: list = []

    def push(self, text: str) -> list[tuple]:
        return [("content", text)] if text else []

    def finish(self) -> list[tuple]:
        return []


class ChatRun:
    """A started chat call: events as the tokens arrive (see the module doc)."""

    def __init__(self, ctx: AppContext, call: ChatCall, cp: ChatPrompt, gen: Generation,
                 prompt_n: int):
        self.ctx, self.call, self.cp, self.gen = ctx, call, cp, gen
        self.id = uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.prompt_n = prompt_n
        self.logprob_entries: dict[int, list] = {}  # choice -> [(token, logprob, top)]
        self.forced_calls = bool(cp.tools) and call.tool_choice not in ("auto", "none")

    def abort(self) -> None:
        """Stop the run's engine requests now (their KV blocks are freed)."""
        self.gen.abort()

    def _parser(self):
        cp = self.cp
        if not cp.tools and cp.reasoning is None:
            return _PlainParser()
        from .toolcalls import OutputParser
        return OutputParser(cp.fmt if cp.tools else None, cp.reasoning, cp.tools)

    async def events(self, poll: bool = True):
        """Chat events in order; closing this generator early aborts the run."""
        n = self.call.n
        parsers = [self._parser() for _ in range(n)]
        eog = self.ctx.state.model.tokenizer.eog_ids
        done = False
        try:
            async for idx, o in self.gen.items(poll):
                if self.call.logprobs and o.token is not None and o.token not in eog:
                    self.logprob_entries.setdefault(idx, []).append(_lp_entry(o, self.call.n_top))
                for ev in parsers[idx].push(o.text):
                    yield (ev[0], idx, *ev[1:])
                if o.finished:
                    for ev in parsers[idx].finish():
                        yield (ev[0], idx, *ev[1:])
                    reason = "length" if o.finish_reason == "length" else "stop"
                    if parsers[idx].tool_calls and reason == "stop":
                        reason = "tool_calls"
                    yield ("finish", idx, reason)
            done = True
            yield ("usage", self.gen.usage())
        finally:
            if not done:  # the client went away or the stream was closed: stop at once
                self.gen.abort()

    async def result(self) -> tuple[list[dict], dict]:
        """Collected choices [{content, reasoning, tool_calls, finish_reason}] and usage."""
        choices = [{"content": "", "reasoning": "", "tool_calls": [], "finish_reason": None}
                   for _ in range(self.call.n)]
        usage = {}
        async for ev in self.events():
            kind = ev[0]
            if kind == "usage":
                usage = ev[1]
                continue
            c = choices[ev[1]]
            if kind == "content":
                c["content"] += ev[2]
            elif kind == "reasoning":
                c["reasoning"] += ev[2]
            elif kind == "tool_call":
                c["tool_calls"].append({"id": ev[3], "type": "function",
                                        "function": {"name": ev[4], "arguments": ""}})
            elif kind == "tool_args":
                c["tool_calls"][ev[2]]["function"]["arguments"] += ev[3]
            elif kind == "finish":
                c["finish_reason"] = ev[2]
        return choices, usage


def _lp_entry(o, n_top: int) -> tuple:
    top = o.top or []
    lp = o.logprob if o.logprob is not None else \
        next((x for i, x in top if i == o.token), float("-inf"))
    # JSON has no -inf: OpenAI reports impossible tokens as -9999
    return (o.token, max(float(lp), -9999.0), [[i, max(float(x), -9999.0)] for i, x in top[:n_top]])


def seeds(sampling: dict, n: int) -> list[dict]:
    """n choices: seed, seed+1, ... (a random seed each when none is given)."""
    s = sampling.get("seed")
    return [dict(sampling, seed=None if s is None else s + i) for i in range(n)]


async def start_chat(ctx: AppContext, request: Request, call: ChatCall) -> ChatRun:
    """Template, tokenize, compile the call's constraint, queue its n choices and wait for
    their first tokens; errors before that raise APIError."""
    ctx.need_ready()
    if call.tools:
        from .toolcalls import validate_tools
        try:
            validate_tools(call.tools, call.tool_choice, call.parallel_tool_calls)
        except ValueError as e:
            raise P.bad("tools", str(e)) from None
    cp, ids = await ctx.chat_prompt(call)
    grammar = await ctx.constraint(call, cp)
    if call.thinking_budget is not None and cp.reasoning is not None:
        from .toolcalls import ThinkingBudget
        grammar = ThinkingBudget(ctx.state.model.tokenizer, cp.reasoning, call.thinking_budget,
                                 grammar)
    t0 = getattr(request.state, "t0", time.perf_counter())
    out: asyncio.Queue = asyncio.Queue()
    jobs = [ctx.make_job(ids, s, call.max_tokens, max(call.n_top, 1) if call.logprobs else 0, t0,
                         "messages", index=i, ignore_eos=call.ignore_eos, constraint=grammar,
                         out=out)
            for i, s in enumerate(seeds(call.sampling, call.n))]
    gen = await ctx.launch(request, jobs)
    return ChatRun(ctx, call, cp, gen, len(ids))


def chat_call_from_openai(ctx: AppContext, body: dict) -> ChatCall:
    """An OpenAI /v1/chat/completions body (with llama-server's extensions) as a ChatCall."""
    m = ctx.state.model
    model = ctx.check_model(body)
    msgs = P.chat_messages(body)
    sampling, max_tokens = P.common_fields(body, m.n_ctx, ctx.state.n_predict, m.tokenizer.n_vocab)
    stream, include_usage = P.stream_fields(body)
    lp, top = P.chat_logprobs(body)
    tools, tool_choice, parallel = P.tool_fields(body)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise P.bad("chat_template_kwargs", "chat_template_kwargs must be an object")
    agp = P.get_bool(body, "add_generation_prompt", True)
    cont = P.get_bool(body, "continue_final_message", False)
    if agp and cont and "add_generation_prompt" in body:
        raise P.bad("continue_final_message", "continue_final_message and add_generation_prompt "
                                              "cannot both be true")
    prefill = ""
    last = msgs[-1]
    if last["role"] == "assistant" and not last.get("tool_calls") and (cont or agp):
        # the final assistant message is continued, not closed (llama-server's prefill)
        prefill, msgs = last["content"], msgs[:-1]
        if not msgs:
            raise P.bad("messages", "messages holds only an assistant message; give a user "
                                    "message before it")
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in ("none", "minimal", "low", "medium", "high"):
        raise P.bad("reasoning_effort", f"reasoning_effort={effort!r} must be one of none, "
                                        f"minimal, low, medium, high")
    # llama-server's thinking budget in tokens (-1: no limit; 0: close the reasoning at once)
    budget = None
    for name in ("thinking_budget_tokens", "reasoning_budget"):
        v = P.get_int(body, name, None, lo=-1)
        if v is not None:
            budget = None if v < 0 else v
    return ChatCall(model, msgs, sampling, max_tokens, tools, tool_choice, parallel,
                    P.response_format_of(body), P.get_n(body), lp, top, effort, kwargs,
                    P.get_bool(body, "ignore_eos", False), stream, include_usage, prefill,
                    thinking_budget=budget)
