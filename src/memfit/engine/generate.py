"""The generation loop: prefill, then decode one token at a time until a stop condition.

Mechanism only: the model turns ids into logits, the sampler picks a token, the stream
decoder and stop matcher turn ids into text. Timings use llama-server's field names.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from ..errors import RequestError
from .sampler import Sampler, SamplingParams, StopMatcher, top_logprobs


@dataclass
class Timings:
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    cache_n: int = 0  # prompt tokens whose KV was reused (a session's common prefix)

    @property
    def prompt_per_second(self) -> float:
        return self.prompt_n / (self.prompt_ms / 1e3) if self.prompt_ms > 0 else 0.0

    @property
    def predicted_per_second(self) -> float:
        return self.predicted_n / (self.predicted_ms / 1e3) if self.predicted_ms > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "prompt_n": self.prompt_n, "prompt_ms": round(self.prompt_ms, 3),
            "prompt_per_second": round(self.prompt_per_second, 3),
            "predicted_n": self.predicted_n, "predicted_ms": round(self.predicted_ms, 3),
            "predicted_per_second": round(self.predicted_per_second, 3),
            "cache_n": self.cache_n,
        }


@dataclass
class Step:
    """One generated token, with the text it completed (may be '' mid UTF-8 sequence)."""

    id: int
    text: str
    top: list | None = None


@dataclass
class GenerationState:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    text: str = ""
    top: list = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (EOG or stop string) | "length"
    timings: Timings = field(default_factory=Timings)


def generate_steps(model, tokenizer, prompt_ids: list[int], params: SamplingParams,
                   n_ctx: int, n_top: int = 0, state: GenerationState | None = None,
                   n_batch: int = 512, cache=None, n_cached: int = 0) -> Iterator[Step]:
    """Yield a Step per generated token; fills ``state`` (ids, text, finish_reason, timings).
    With ``cache`` (a session's), its first n_cached rows already hold prompt_ids[:n_cached]."""
    from ..tokenizer import StreamDecoder

    if not prompt_ids:
        raise RequestError("the prompt is empty (no tokens); give some text")
    if len(prompt_ids) >= n_ctx:
        raise RequestError(f"the prompt has {len(prompt_ids)} tokens but the context is {n_ctx}; "
                           f"raise --ctx-size or shorten the prompt")
    st = state if state is not None else GenerationState(list(prompt_ids))
    max_tokens = params.max_tokens if params.max_tokens is not None and params.max_tokens >= 0 \
        else n_ctx
    max_tokens = min(max_tokens, n_ctx - len(prompt_ids))
    sampler = Sampler(params, tokenizer.n_vocab)
    decoder = StreamDecoder(tokenizer)
    stops = StopMatcher(params.stop or [])
    eog = tokenizer.eog_ids
    history = list(prompt_ids)

    if cache is None:
        cache, n_cached = model.new_cache(n_ctx), 0
    assert cache.offset == n_cached < len(prompt_ids)
    t0 = time.perf_counter()
    ids = np.asarray(prompt_ids[n_cached:], dtype=np.int32)
    for b in range(0, len(ids), n_batch):  # prefill in batches of n_batch (scratch is sized for it)
        logits = model.forward(ids[b:b + n_batch], cache)
    t1 = time.perf_counter()
    st.timings.prompt_n = len(prompt_ids) - n_cached
    st.timings.cache_n = n_cached
    st.timings.prompt_ms = (t1 - t0) * 1e3
    st.finish_reason = "length"
    for i in range(max_tokens):
        top = top_logprobs(logits, n_top) if n_top > 0 else None
        tok = int(sampler.sample(logits, history))
        history.append(tok)
        st.ids.append(tok)
        if top is not None:
            st.top.append(top)
        if tok in eog:
            st.finish_reason = "stop"
            yield Step(tok, "", top)
            break
        emit, stopped = stops.push(decoder.push(tok))
        st.text += emit
        yield Step(tok, emit, top)
        if stopped:
            st.finish_reason = "stop"
            break
        if i + 1 < max_tokens:
            logits = model.forward(np.asarray([tok], dtype=np.int32), cache)
    if not stops.stopped:
        # text held back by the stop matcher or the UTF-8 decoder was not a stop: emit it
        emit, _ = stops.push(decoder.flush())
        tail = emit + stops.flush()
        if tail:
            st.text += tail
            yield Step(-1, tail, None)
    st.timings.predicted_n = len(st.ids)
    st.timings.predicted_ms = (time.perf_counter() - t1) * 1e3
