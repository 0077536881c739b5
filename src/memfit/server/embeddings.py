"""POST /v1/embeddings (OpenAI's shape), pooled hidden states as llama-server's --embedding.

Each input's vector is ``Model.embed_ids``: the final-normed hidden state of every token
(after output_norm, before the output head), pooled mean / cls / last (``--pooling``; default
the GGUF's pooling type, else mean) and L2-normalized. Inputs are tokenized in a worker thread
(bounded pieces that stop past the context, as prompts are), then run one after another on the
engine's thread between decode steps (``EngineWorker.call``): the model and its KV pool are the
engine's, so an embedding holds at most one prompt's scratch and its own KV blocks, which it
frees before the next step. A client that leaves stops the batch at the next input.
"""

from __future__ import annotations

import asyncio
import base64

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ..errors import MemfitError
from . import protocol as P
from .chat import Disconnected

MAX_INPUTS = 2048      # OpenAI's limit on the inputs of one request
POOLINGS = ("mean", "cls", "last")


class _Busy(Exception):
    pass


def parse_input(body: dict) -> list:
    """``input`` -> a list of items, each a str or a list of token ids (OpenAI's four forms)."""
    x = body.get("input")
    if x is None:
        raise P.bad("input", "input is required: a string, a list of strings, a list of token "
                             "ids or a list of lists of token ids")
    if isinstance(x, str):
        return [x]
    if not isinstance(x, list) or not x:
        raise P.bad("input", "input must be a non-empty string or a non-empty list")
    if len(x) > MAX_INPUTS:
        raise P.bad("input", f"input has {len(x)} items; at most {MAX_INPUTS} per request")
    if all(P._is_int(i) for i in x):
        return [x]
    for k, item in enumerate(x):
        if isinstance(item, str):
            continue
        if not isinstance(item, list) or not all(P._is_int(i) for i in item):
            raise P.bad("input", f"input[{k}] must be a string or a list of token ids")
    return x


def encoding_format(body: dict) -> str:
    f = body.get("encoding_format", "float")
    if f is None:
        return "float"
    if f not in ("float", "base64"):
        raise P.bad("encoding_format", f"encoding_format={f!r}: use 'float' or 'base64'")
    return f


def routes(ctx) -> list[Route]:
    """``ctx``: the app's chat.AppContext (state, endpoint, read_json, check_model, prompt_gate)."""
    state = ctx.state

    def pooling() -> str:
        p = getattr(state, "pooling", None)  # --pooling; None: the model's default
        return p if p is not None else state.model.default_pooling()

    def to_ids(items: list) -> list[list[int]]:
        """Texts tokenized as prompts (special tokens added), ids checked; each within the
        context (a whole one: nothing is generated after it) and --max-prompt-tokens."""
        from ..memory.budget import trim_heap
        from ..tokenizer.vocab import TooManyTokens, UncuttableText
        m = state.model
        cap = state.max_prompt_tokens
        limit = m.n_ctx if cap is None else min(cap, m.n_ctx)
        why = f"the context is {m.n_ctx}" if limit == m.n_ctx else \
            f"this server takes at most {cap} (--max-prompt-tokens)"
        out = []
        try:
            for k, item in enumerate(items):
                try:
                    ids = m._prompt_ids(item, limit)
                except TooManyTokens as e:
                    raise P.APIError(400, f"input[{k}] has at least {e.n_at_least} tokens but "
                                          f"{why}; shorten it", "input",
                                     "context_length_exceeded") from None
                except (UncuttableText, MemfitError) as e:
                    raise P.bad("input", f"input[{k}]: {e}") from None
                if not ids:
                    raise P.bad("input", f"input[{k}] is empty (no tokens)")
                out.append(ids)
        finally:
            trim_heap()
        return out

    def embed_one(ids: list[int], pool_kind: str) -> np.ndarray:
        """On the engine thread: refuse (busy) when the KV pool cannot hold the input now."""
        m = state.model
        mgr = m.engine.pool.manager
        if mgr.blocks_for(len(ids)) > mgr.n_free:
            raise _Busy()
        return m.embed_ids(ids, pool_kind, normalize=True)

    @ctx.endpoint("embeddings")
    async def embeddings(request: Request):
        ctx.need_ready()
        body = await ctx.read_json(request)
        model = ctx.check_model(body)
        if body.get("dimensions") is not None:
            raise P.bad("dimensions", "dimensions is not supported: this model's embeddings "
                                      f"have {state.model.config.n_embd} dimensions; omit it")
        fmt = encoding_format(body)
        items = parse_input(body)
        async with ctx.prompt_gate:   # shared with prompts: one tokenizer scratch at a time
            all_ids = await asyncio.to_thread(to_ids, items)
        kind = pooling()
        data, n_tokens = [], 0
        for k, ids in enumerate(all_ids):
            if k and await request.is_disconnected():
                raise Disconnected()
            try:
                v = await state.worker.call(lambda ids=ids: embed_one(ids, kind))
            except _Busy:
                raise P.APIError(429, "the server is busy: the KV cache has no room for this "
                                      "input now; retry later", headers={"Retry-After": "1"})
            except MemfitError as e:
                raise P.bad("input", f"input[{k}]: {e}") from None
            if fmt == "base64":  # little-endian float32 bytes, as OpenAI sends them
                emb = base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
            else:
                emb = v.tolist()
            data.append({"object": "embedding", "index": k, "embedding": emb})
            n_tokens += len(ids)
        return JSONResponse({"object": "list", "data": data, "model": model,
                             "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})

    return [Route("/v1/embeddings", embeddings, methods=["POST"]),
            Route("/embeddings", embeddings, methods=["POST"])]
