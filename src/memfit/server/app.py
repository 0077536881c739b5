"""The HTTP app (Starlette): OpenAI endpoints plus llama-server's /health, /tokenize, /detokenize.

Handlers validate, tokenize and hand a Job to the engine worker; they wait for the first
token before answering, so a request that cannot start (queue full or timed out, prompt too
long) gets a proper status even when it asked for a stream. A client that goes away is noticed
(stream cancelled by Starlette, or polled while a non-streamed answer is built) and its
generation is aborted at once, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .. import __version__
from ..errors import MemfitError
from . import protocol as P
from .metrics import Metrics
from .worker import Job, QueueTimeout

FINGERPRINT = f"memfit-{__version__}"
_POLL_S = 0.25  # how often a waiting handler checks that its client is still there


@dataclass
class ServerState:
    model_ids: list[str]                 # names the `model` field may select (first is listed)
    n_parallel: int
    max_queue: int
    max_prompt_tokens: int | None = None
    model: object = None                 # memfit.api.Model once loaded
    worker: object = None                # EngineWorker once loaded
    metrics: Metrics = field(default_factory=Metrics)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def ready(self) -> bool:
        return self.worker is not None


class _Disconnected(Exception):
    pass


def _json(status: int, body: dict, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


def _error_response(e: P.APIError) -> JSONResponse:
    return e.response()


def build_app(state: ServerState) -> Starlette:
    metrics = state.metrics

    def endpoint(name: str):
        """Turns APIError/MemfitError into OpenAI error responses and counts statuses."""
        def wrap(fn):
            async def handler(request: Request):
                request.state.t0 = time.perf_counter()  # arrival: TTFT and queue wait count from here
                try:
                    resp = await fn(request)
                except P.APIError as e:
                    resp = _error_response(e)
                except MemfitError as e:
                    resp = _error_response(P.APIError(400, str(e)))
                except _Disconnected:  # nobody to answer; 499 is nginx's "client closed request"
                    resp = Response(status_code=499)
                metrics.requests.labels(name, str(resp.status_code)).inc()
                return resp
            return handler
        return wrap

    def need_ready():
        if not state.ready:
            raise P.APIError(503, "Loading model", headers={"Retry-After": "1"})

    async def read_json(request: Request) -> dict:
        try:
            raw = await request.body()  # read whole by the Guard before the app runs
        except ClientDisconnect:
            raise _Disconnected() from None
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise P.APIError(400, f"malformed JSON in the request body: {e}") from None
        except RecursionError:
            raise P.APIError(400, "the JSON in the request body is nested too deeply") from None
        if not isinstance(body, dict):
            raise P.APIError(400, "the request body must be a JSON object")
        return body

    def check_model(body: dict) -> str:
        name = body.get("model")
        if name is None:
            return state.model_ids[0]
        if not isinstance(name, str):
            raise P.bad("model", f"model={name!r} must be a string")
        if name not in state.model_ids:
            raise P.APIError(404, f"the model {name!r} does not exist; this server has "
                                  f"{state.model_ids[0]!r} (see GET /v1/models)",
                             param="model", code="model_not_found")
        return state.model_ids[0]

    # ------------------------------------------------------------------ prompts
    # one prompt templated and tokenized at a time, in bounded pieces that stop past the
    # context: the scratch is one piece (planner.PROMPT_SCRATCH_BYTES), not one per request
    prompt_gate = asyncio.Semaphore(1)

    async def prompt_ids(param: str, make, whole_context: bool = False) -> list[int]:
        """``make(limit)`` -> ids in a worker thread; more than the context (or
        --max-prompt-tokens) allows -> the context_length_exceeded 400 without the rest.
        A prompt leaves room for one generated token; /tokenize (whole_context) may fill it."""
        from ..memory.budget import trim_heap
        from ..tokenizer.vocab import TooManyTokens, UncuttableText
        m = state.model
        cap = None if whole_context else state.max_prompt_tokens
        limit = m.n_ctx - (0 if whole_context else 1)
        limit = limit if cap is None else min(cap, limit)

        def work():
            try:
                return make(limit)
            finally:
                trim_heap()     # the pieces' memory back to the kernel before the next prompt

        async with prompt_gate:
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

    # ------------------------------------------------------------------ generation
    def make_job(req: P.GenRequest, t0: float) -> Job:
        from ..engine.sampler import SamplingParams
        m = state.model
        n = len(req.prompt_ids)
        if n == 0:
            raise P.bad("prompt", "the prompt is empty (no tokens)")
        limit = state.max_prompt_tokens
        param = "messages" if req.kind == "chat" else "prompt"
        if limit is not None and n > limit:
            raise P.APIError(400, f"the prompt has {n} tokens; this server takes at most {limit} "
                                  f"(--max-prompt-tokens)", param, "context_length_exceeded")
        if n >= m.n_ctx:
            raise P.APIError(400, f"the prompt has {n} tokens but the context is {m.n_ctx}; "
                                  f"shorten the prompt", param, "context_length_exceeded")
        room = m.n_ctx - n  # max_tokens is capped by the context
        mt = room if req.max_tokens is None else min(req.max_tokens, room)
        try:
            params = SamplingParams(max_tokens=mt, **req.sampling)
        except MemfitError as e:
            raise P.APIError(400, str(e)) from None
        w = state.worker
        if w.pending >= state.n_parallel + state.max_queue:
            raise P.APIError(429, f"the server is busy: {w.pending} requests are running or "
                                  f"queued (limit {state.n_parallel + state.max_queue}); "
                                  f"retry later", headers={"Retry-After": "1"})
        # the engine reports the sampled token's logprob alongside its top list
        n_top = max(req.n_top, 1) if req.logprobs else 0
        return Job(req.prompt_ids, params, n_top, asyncio.get_running_loop(),
                   ignore_eos=req.ignore_eos, t_submit=t0)

    async def next_item(job: Job, request: Request):
        """The job's next output; checks every _POLL_S that the client is still there (also
        while outputs keep coming, so a long non-streamed answer is stopped too)."""
        while True:
            now = time.perf_counter()
            if now - job.t_checked > _POLL_S:
                job.t_checked = now
                if await request.is_disconnected():
                    state.worker.abort(job)
                    metrics.disconnects.inc()
                    raise _Disconnected()
            try:
                return await asyncio.wait_for(job.out.get(), _POLL_S)
            except asyncio.TimeoutError:
                pass

    def raise_item_error(item: Exception):
        if isinstance(item, QueueTimeout):
            raise P.APIError(429, f"the server is busy: the request {item}; retry later",
                             headers={"Retry-After": "1"})
        if isinstance(item, MemfitError):
            raise P.APIError(400, str(item))
        raise P.APIError(500, f"internal error: {type(item).__name__}: {item}")

    class Collector:
        """Accumulates StepOutputs of one request: text, logprobs, usage, latencies."""

        def __init__(self, req: P.GenRequest, job: Job):
            self.req, self.job = req, job
            self.text = ""
            self.lp: list[tuple[int, float, list]] = []   # (token, logprob, top)
            self.finish_reason = None
            self.prompt_n, self.cache_n, self.n_gen = len(req.prompt_ids), 0, 0
            self.t_last = None
            self.engine_timings = None
            self.eog = state.model.tokenizer.eog_ids

        def push(self, o) -> tuple[str, list]:
            now = time.perf_counter()
            new_lp = []
            if o.token is not None:
                if self.t_last is None:
                    metrics.ttft.observe(now - self.job.t_submit)
                else:
                    metrics.itl.observe(now - self.t_last)
                self.t_last = now
                if self.req.logprobs and o.token not in self.eog:
                    top = o.top or []
                    lp = o.logprob if o.logprob is not None else \
                        next((x for i, x in top if i == o.token), float("-inf"))
                    # JSON has no -inf: OpenAI reports impossible tokens as -9999
                    new_lp.append((o.token, max(float(lp), -9999.0),
                                   [[i, max(float(x), -9999.0)] for i, x in top[:self.req.n_top]]))
            self.text += o.text
            self.lp += new_lp
            if o.finished:
                self.finish_reason = "length" if o.finish_reason == "length" else "stop"
                self.prompt_n, self.cache_n, self.n_gen = o.prompt_n, o.cache_n, o.n_generated
                self.engine_timings = getattr(o, "timings", None)
                metrics.prompt_tokens.inc(o.prompt_n)
                metrics.cached_tokens.inc(o.cache_n)
                metrics.generated_tokens.inc(o.n_generated)
            return o.text, new_lp

        def usage(self) -> dict:
            return P.usage(self.prompt_n, self.n_gen, self.cache_n)

        def timings(self) -> dict:
            """llama-server's `timings` (prompt_n counts the tokens not taken from the cache)."""
            d = {"prompt_n": self.prompt_n - self.cache_n, "cache_n": self.cache_n,
                 "predicted_n": self.n_gen}
            if self.engine_timings is not None:
                d.update(self.engine_timings.to_dict())
                d["cache_n"] = self.cache_n
            return d

    def piece_bytes(tid: int) -> bytes:
        return state.model.tokenizer.token_to_bytes(tid)

    def logprobs_obj(kind: str, entries: list, offset0: int) -> dict | None:
        if kind == "chat":
            return {"content": [P.chat_token_logprob(piece_bytes(t), lp, top, piece_bytes)
                                for t, lp, top in entries]}
        toks, offs, off = [], [], offset0
        for t, _, _ in entries:
            s = piece_bytes(t).decode("utf-8", errors="replace")
            toks.append(s)
            offs.append(off)
            off += len(s)
        return {"tokens": toks, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [{piece_bytes(i).decode("utf-8", errors="replace"): x
                                  for i, x in top} for _, _, top in entries],
                "text_offset": offs}

    def head(req: P.GenRequest, obj: str) -> dict:
        return {"id": ("chatcmpl-" if req.kind == "chat" else "cmpl-") + req.id, "object": obj,
                "created": req.created, "model": req.model, "system_fingerprint": FINGERPRINT}

    async def run_generation(request: Request, req: P.GenRequest) -> Response:
        job = make_job(req, request.state.t0)
        state.worker.submit(job)
        try:
            first = await next_item(job, request)
            if isinstance(first, Exception):
                raise_item_error(first)
            col = Collector(req, job)
            if req.stream:  # the stream owns the job from here on
                return StreamingResponse(stream(request, req, job, col, first),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache",
                                                  "X-Accel-Buffering": "no"})
            item = first
            while True:
                if isinstance(item, Exception):
                    raise_item_error(item)
                col.push(item)
                if item.finished:
                    break
                item = await next_item(job, request)
        except _Disconnected:
            return Response(status_code=499)
        except BaseException:  # cancelled (shutdown) or failed: the job must not keep decoding
            state.worker.abort(job)  # a no-op for a job that already finished
            raise
        text = req.echo_text + col.text
        lp = logprobs_obj(req.kind, col.lp, len(req.echo_text)) if req.logprobs else None
        if req.kind == "chat":
            body = head(req, "chat.completion")
            body["choices"] = [{"index": 0, "message": {"role": "assistant", "content": text},
                                "logprobs": lp, "finish_reason": col.finish_reason}]
        else:
            body = head(req, "text_completion")
            body["choices"] = [{"index": 0, "text": text, "logprobs": lp,
                                "finish_reason": col.finish_reason}]
        body["usage"] = col.usage()
        body["timings"] = col.timings()
        return _json(200, body)

    async def stream(request, req: P.GenRequest, job: Job, col: Collector, first):
        chat = req.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        offset = len(req.echo_text)

        def chunk(text: str | None, lp, finish, delta_role=False) -> bytes:
            c = head(req, obj)
            if chat:
                delta = {"role": "assistant", "content": ""} if delta_role else \
                    ({} if text is None else {"content": text})
                c["choices"] = [{"index": 0, "delta": delta, "logprobs": lp,
                                 "finish_reason": finish}]
            else:
                c["choices"] = [{"index": 0, "text": text or "", "logprobs": lp,
                                 "finish_reason": finish}]
            if req.include_usage:
                c["usage"] = None
            return b"data: " + json.dumps(c, ensure_ascii=False).encode() + b"\n\n"

        finished = False
        try:
            if chat:
                yield chunk(None, None, None, delta_role=True)
            elif req.echo_text:
                yield chunk(req.echo_text, None, None)
            item = first
            while True:
                if isinstance(item, Exception):
                    err = P.APIError(500, f"{type(item).__name__}: {item}")
                    yield b"data: " + json.dumps(err.body()).encode() + b"\n\n"
                    finished = True
                    return
                text, new_lp = col.push(item)
                if text or new_lp:
                    lp = logprobs_obj(req.kind, new_lp, offset) if req.logprobs else None
                    offset += len(text)
                    yield chunk(text, lp, None)
                if item.finished:
                    finished = True
                    yield chunk(None, None, col.finish_reason)
                    if req.include_usage:
                        u = head(req, obj)
                        u["choices"] = []
                        u["usage"] = col.usage()
                        u["timings"] = col.timings()
                        yield b"data: " + json.dumps(u).encode() + b"\n\n"
                    yield b"data: [DONE]\n\n"
                    return
                item = await job.out.get()
        finally:
            if not finished:  # the client went away (Starlette cancelled us): stop at once
                state.worker.abort(job)
                metrics.disconnects.inc()

    # ------------------------------------------------------------------ routes
    @endpoint("chat")
    async def chat_completions(request: Request):
        need_ready()
        body = await read_json(request)
        model = check_model(body)
        msgs = P.chat_messages(body)
        sampling, max_tokens = P.common_fields(body, state.model.n_ctx, None)
        stream_, include_usage = P.stream_fields(body)
        lp, top = P.chat_logprobs(body)
        m = state.model
        # templating and tokenizing a long prompt must not stall the streams on this loop
        ids = await prompt_ids("messages", lambda n: m._prompt_ids(m.apply_chat_template(msgs), n))
        req = P.GenRequest("chat", model, ids, sampling, max_tokens, stream_, include_usage,
                           lp, top, ignore_eos=P.get_bool(body, "ignore_eos", False))
        return await run_generation(request, req)

    @endpoint("completions")
    async def completions(request: Request):
        need_ready()
        body = await read_json(request)
        model = check_model(body)
        prompt = P.completion_prompt(body)
        sampling, max_tokens = P.common_fields(body, state.model.n_ctx, 16)
        stream_, include_usage = P.stream_fields(body)
        lp, top = P.completion_logprobs(body)
        echo = P.get_bool(body, "echo", False)
        if echo and lp:
            raise P.bad("echo", "echo together with logprobs (prompt logprobs) is not supported; "
                                "drop one of them")
        m = state.model
        try:
            ids = await prompt_ids("prompt", lambda n: m._prompt_ids(prompt, n))
        except P.APIError:
            raise
        except MemfitError as e:
            raise P.bad("prompt", str(e)) from None
        echo_text = (prompt if isinstance(prompt, str) else m.detokenize(ids)) if echo else ""
        req = P.GenRequest("completion", model, ids, sampling, max_tokens, stream_,
                           include_usage, lp, top, echo_text,
                           ignore_eos=P.get_bool(body, "ignore_eos", False))
        return await run_generation(request, req)

    @endpoint("models")
    async def models(request: Request):
        data = [{"id": state.model_ids[0], "object": "model", "created": state.created,
                 "owned_by": "memfit"}]
        if state.model is not None:
            m = state.model
            data[0]["meta"] = {"n_ctx": m.n_ctx, "n_vocab": m.tokenizer.n_vocab,
                               "arch": m.config.arch, "n_parallel": state.n_parallel}
        return _json(200, {"object": "list", "data": data})

    @endpoint("health")
    async def health(request: Request):
        need_ready()
        return _json(200, {"status": "ok"})

    @endpoint("metrics")
    async def metrics_route(request: Request):
        return Response(metrics.render(state.worker, state.model),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @endpoint("tokenize")
    async def tokenize(request: Request):
        need_ready()
        body = await read_json(request)
        content = body.get("content")
        if not isinstance(content, str):
            raise P.bad("content", "content must be a string")
        add_special = P.get_bool(body, "add_special", False)
        parse_special = P.get_bool(body, "parse_special", True)
        with_pieces = P.get_bool(body, "with_pieces", False)
        tok = state.model.tokenizer
        # counted up to the context, in bounded pieces, as a prompt is
        ids = await prompt_ids("content", lambda n: tok.encode_limited(
            content, n, add_special=add_special, parse_special=parse_special), whole_context=True)
        if not with_pieces:
            return _json(200, {"tokens": ids})
        out = []
        for i in ids:
            b = tok.token_to_bytes(i)
            try:
                piece = b.decode("utf-8")
            except UnicodeDecodeError:  # llama-server: a partial character as its bytes
                piece = list(b)
            out.append({"id": i, "piece": piece})
        return _json(200, {"tokens": out})

    @endpoint("detokenize")
    async def detokenize(request: Request):
        need_ready()
        body = await read_json(request)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(P._is_int(i) for i in ids):
            raise P.bad("tokens", "tokens must be a list of token ids")
        n = state.model.tokenizer.n_vocab
        bad_ids = [i for i in ids if not 0 <= i < n]
        if bad_ids:
            raise P.bad("tokens", f"token id {bad_ids[0]} is outside the vocabulary (0..{n - 1})")
        return _json(200, {"content": state.model.detokenize(ids)})

    async def http_error(request: Request, exc: HTTPException):
        metrics.requests.labels("other", str(exc.status_code)).inc()
        msg = {404: f"no route {request.method} {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}
        return P.APIError(exc.status_code, msg.get(exc.status_code, str(exc.detail))).response()

    async def server_error(request: Request, exc: Exception):
        # a bug: Starlette logs the traceback after this; the client still gets an error object
        return P.APIError(500, f"internal error: {type(exc).__name__}").response()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/health", health, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
    ]
    from . import embeddings, page
    routes += embeddings.routes(state, endpoint) + page.routes(state, endpoint)
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error,
                                                        Exception: server_error})
