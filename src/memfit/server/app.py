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
import uuid
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .. import __version__
from ..errors import MemfitError
from . import protocol as P
from .chat import (AppContext, Disconnected, _lp_entry, chat_call_from_openai, seeds,
                   start_chat)
from .metrics import Metrics

FINGERPRINT = f"memfit-{__version__}"


@dataclass
class ServerState:
    model_ids: list[str]                 # names the `model` field may select (first is listed)
    n_parallel: int
    max_queue: int
    max_prompt_tokens: int | None = None
    chat_template: str | None = None     # --chat-template: a built-in name or a jinja file
    reasoning_format: str = "auto"       # --reasoning-format: none leaves thinking in content
    n_predict: int | None = None         # --n-predict: max tokens of a request that gives none
    response_store_bytes: int = 16 << 20  # --response-store: the Responses store's bytes
    model: object = None                 # memfit.api.Model once loaded
    worker: object = None                # EngineWorker once loaded
    metrics: Metrics = field(default_factory=Metrics)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def ready(self) -> bool:
        return self.worker is not None


def _json(status: int, body: dict, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


def build_app(state: ServerState) -> Starlette:
    ctx = AppContext(state)
    metrics = state.metrics
    endpoint, need_ready, read_json = ctx.endpoint, ctx.need_ready, ctx.read_json

    def piece_bytes(tid: int) -> bytes:
        return state.model.tokenizer.token_to_bytes(tid)

    def chat_logprobs_obj(entries: list) -> dict:
        return {"content": [P.chat_token_logprob(piece_bytes(t), lp, top, piece_bytes)
                            for t, lp, top in entries]}

    def text_logprobs_obj(entries: list, offset0: int) -> dict:
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

    def head(kind: str, rid: str, created: int, model: str, obj: str) -> dict:
        return {"id": ("chatcmpl-" if kind == "chat" else "cmpl-") + rid, "object": obj,
                "created": created, "model": model, "system_fingerprint": FINGERPRINT}

    def sse(obj: dict) -> bytes:
        return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"

    def streaming(gen) -> StreamingResponse:
        return StreamingResponse(gen, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ------------------------------------------------------------------ chat completions
    @endpoint("chat")
    async def chat_completions(request: Request):
        need_ready()
        body = await read_json(request)
        call = chat_call_from_openai(ctx, body)
        run = await start_chat(ctx, request, call)
        if call.stream:
            return streaming(chat_stream(run))
        try:
            choices, usage = await run.result()
        except Disconnected:
            return Response(status_code=499)
        out = []
        for i, c in enumerate(choices):
            msg = {"role": "assistant",
                   "content": c["content"] if c["content"] or not c["tool_calls"] else None}
            if c["reasoning"]:
                msg["reasoning_content"] = c["reasoning"]
            if c["tool_calls"]:
                msg["tool_calls"] = c["tool_calls"]
            lp = chat_logprobs_obj(run.logprob_entries.get(i, [])) if call.logprobs else None
            out.append({"index": i, "message": msg, "logprobs": lp,
                        "finish_reason": c["finish_reason"]})
        body = head("chat", run.id, run.created, call.model, "chat.completion")
        body["choices"] = out
        body["usage"] = usage
        body["timings"] = run.gen.timings(0)
        return _json(200, body)

    async def chat_stream(run):
        call = run.call
        obj = "chat.completion.chunk"
        sent_lp = {}

        def chunk(i: int, delta: dict, finish=None, lp=None) -> bytes:
            c = head("chat", run.id, run.created, call.model, obj)
            c["choices"] = [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}]
            if call.include_usage:
                c["usage"] = None
            return sse(c)

        def new_lp(i: int):
            if not call.logprobs:
                return None
            e = run.logprob_entries.get(i, [])
            k = sent_lp.get(i, 0)
            sent_lp[i] = len(e)
            return chat_logprobs_obj(e[k:]) if len(e) > k else None

        events = run.events(poll=False)  # Starlette cancels the stream when the client leaves
        finished = False
        try:
            for i in range(call.n):
                # content null, not "": llama-server's first chunk, and clients that reject an
                # empty content delta (llama.cpp's test client) accept it
                yield chunk(i, {"role": "assistant", "content": None})
            async for ev in events:
                kind = ev[0]
                if kind == "content":
                    yield chunk(ev[1], {"content": ev[2]}, lp=new_lp(ev[1]))
                elif kind == "reasoning":
                    yield chunk(ev[1], {"reasoning_content": ev[2]})
                elif kind == "tool_call":
                    _, i, k, cid, name = ev
                    yield chunk(i, {"tool_calls": [{"index": k, "id": cid, "type": "function",
                                                    "function": {"name": name, "arguments": ""}}]})
                elif kind == "tool_args":
                    _, i, k, text = ev
                    yield chunk(i, {"tool_calls": [{"index": k, "function": {"arguments": text}}]})
                elif kind == "finish":
                    yield chunk(ev[1], {}, ev[2], lp=new_lp(ev[1]))
                elif kind == "usage" and call.include_usage:
                    u = head("chat", run.id, run.created, call.model, obj)
                    u["choices"] = []
                    u["usage"] = ev[1]
                    u["timings"] = run.gen.timings(0)
                    yield sse(u)
            finished = True
            yield b"data: [DONE]\n\n"
        except Exception as e:  # noqa: BLE001 - the engine failed mid-stream: an error event
            finished = True
            yield sse(P.APIError(500, f"{type(e).__name__}: {e}").body())
        finally:
            if not finished:
                metrics.disconnects.inc()
            await events.aclose()  # aborts the run unless it finished

    # ------------------------------------------------------------------ completions
    @endpoint("completions")
    async def completions(request: Request):
        need_ready()
        body = await read_json(request)
        model = ctx.check_model(body)
        m = state.model
        prompts = P.completion_prompts(body)
        n = P.get_n(body)
        sampling, max_tokens = P.common_fields(body, m.n_ctx, state.n_predict or 16,
                                               m.tokenizer.n_vocab)
        stream_, include_usage = P.stream_fields(body)
        lp, top = P.completion_logprobs(body)
        echo = P.get_bool(body, "echo", False)
        if echo and lp:
            raise P.bad("echo", "echo together with logprobs (prompt logprobs) is not supported; "
                                "drop one of them")
        rf = P.response_format_of(body)
        grammar = await ctx.compile(P.response_format_spec(rf) if rf else None)
        all_ids, echoes = [], []
        for prompt in prompts:
            try:
                ids = await ctx.prompt_ids("prompt", lambda k, p=prompt: m._prompt_ids(p, k))
            except P.APIError:
                raise
            except MemfitError as e:
                raise P.bad("prompt", str(e)) from None
            all_ids.append(ids)
            echoes.append((prompt if isinstance(prompt, str) else m.detokenize(ids)) if echo else "")
        t0 = request.state.t0
        out: asyncio.Queue = asyncio.Queue()
        ignore_eos = P.get_bool(body, "ignore_eos", False)
        jobs = []
        for pi, ids in enumerate(all_ids):
            for j, s in enumerate(seeds(sampling, n)):
                jobs.append(ctx.make_job(ids, s, max_tokens, max(top, 1) if lp else 0, t0,
                                         "prompt", index=pi * n + j, ignore_eos=ignore_eos,
                                         constraint=grammar, out=out))
        gen = await ctx.launch(request, jobs)
        rid, created = uuid.uuid4().hex[:24], int(time.time())
        echo_of = [echoes[i // n] for i in range(len(jobs))]
        if stream_:
            return streaming(completion_stream(gen, rid, created, model, echo_of, lp, top,
                                               include_usage))
        texts = list(echo_of)
        entries: dict[int, list] = {}
        eog = m.tokenizer.eog_ids
        try:
            async for i, o in gen.items():
                texts[i] += o.text
                if lp and o.token is not None and o.token not in eog:
                    entries.setdefault(i, []).append(_lp_entry(o, top))
        except Disconnected:
            return Response(status_code=499)
        except BaseException:
            gen.abort()
            raise
        choices = []
        for i in range(len(jobs)):
            f = gen.finished[i]
            choices.append({"index": i, "text": texts[i],
                            "logprobs": text_logprobs_obj(entries.get(i, []), len(echo_of[i]))
                            if lp else None,
                            "finish_reason": "length" if f.finish_reason == "length" else "stop"})
        resp = head("completion", rid, created, model, "text_completion")
        resp["choices"] = choices
        resp["usage"] = gen.usage()
        resp["timings"] = gen.timings(0)
        return _json(200, resp)

    async def completion_stream(gen, rid, created, model, echo_of, lp, top, include_usage):
        obj = "text_completion"
        offsets = [len(e) for e in echo_of]
        eog = state.model.tokenizer.eog_ids

        def chunk(i: int, text: str, lpo, finish) -> bytes:
            c = head("completion", rid, created, model, obj)
            c["choices"] = [{"index": i, "text": text, "logprobs": lpo, "finish_reason": finish}]
            if include_usage:
                c["usage"] = None
            return sse(c)

        finished = False
        try:
            for i, e in enumerate(echo_of):
                if e:
                    yield chunk(i, e, None, None)
            async for i, o in gen.items(poll=False):
                new = [_lp_entry(o, top)] if lp and o.token is not None and o.token not in eog \
                    else []
                if o.text or new:
                    lpo = text_logprobs_obj(new, offsets[i]) if lp else None
                    offsets[i] += len(o.text)
                    yield chunk(i, o.text, lpo, None)
                if o.finished:
                    yield chunk(i, "", None, "length" if o.finish_reason == "length" else "stop")
            finished = True
            if include_usage:
                u = head("completion", rid, created, model, obj)
                u["choices"] = []
                u["usage"] = gen.usage()
                u["timings"] = gen.timings(0)
                yield sse(u)
            yield b"data: [DONE]\n\n"
        except Exception as e:  # noqa: BLE001 - the engine failed mid-stream: an error event
            finished = True
            gen.abort()
            yield sse(P.APIError(500, f"{type(e).__name__}: {e}").body())
        finally:
            if not finished:  # the client went away (Starlette cancelled us): stop at once
                gen.abort()
                metrics.disconnects.inc()

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
        return Response(metrics.render(state.worker, state.model,
                                       getattr(state, "response_store", None)),
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
        ids = await ctx.prompt_ids("content", lambda n: tok.encode_limited(
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

    @endpoint("apply-template")
    async def apply_template_route(request: Request):
        """llama-server's /apply-template: the chat prompt a request would be given."""
        need_ready()
        body = await read_json(request)
        call = chat_call_from_openai(ctx, body)
        cp = await asyncio.to_thread(ctx.render, call)
        return _json(200, {"prompt": cp.text})

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
        Route("/apply-template", apply_template_route, methods=["POST"]),
    ]
    from . import anthropic, embeddings, page, responses
    routes += (responses.routes(ctx) + anthropic.routes(ctx) + embeddings.routes(ctx)
               + page.routes(ctx))
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error,
                                                        Exception: server_error})
