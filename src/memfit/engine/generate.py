"""Timings (llama-server's field names) and the one-sequence generation loop, now a client of
the Engine (engine.py): it adds one request and steps until it is done.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from ..errors import RequestError
from .sampler import SamplingParams


@dataclass
class Timings:
    prompt_n: int = 0          # prompt tokens evaluated (llama-server: without the cached ones)
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    cache_n: int = 0           # prompt tokens reused from the prefix cache

    @property
    def prompt_per_second(self) -> float:
        return self.prompt_n / (self.prompt_ms / 1e3) if self.prompt_ms > 0 else 0.0

    @property
    def predicted_per_second(self) -> float:
        return self.predicted_n / (self.predicted_ms / 1e3) if self.predicted_ms > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "cache_n": self.cache_n, "prompt_n": self.prompt_n, "prompt_ms": round(self.prompt_ms, 3),
            "prompt_per_second": round(self.prompt_per_second, 3),
            "predicted_n": self.predicted_n, "predicted_ms": round(self.predicted_ms, 3),
            "predicted_per_second": round(self.predicted_per_second, 3),
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
                   n_batch: int = 512, engine=None, constraint=None,
                   draft_max: int | None = None) -> Iterator[Step]:
    """Yield a Step per generated token (and a last Step(-1, text) for text held back to the
    end); fills ``state`` (ids, text, finish_reason, timings). Runs on ``engine`` when given
    (others' requests may share its steps), else on a one-sequence Engine of its own.
    ``constraint``: a constrain.Grammar the tokens obey (engine.py)."""
    from .engine import Engine

    if not prompt_ids:
        raise RequestError("the prompt is empty (no tokens); give some text")
    st = state if state is not None else GenerationState(list(prompt_ids))
    eng = engine if engine is not None else Engine(model, tokenizer, n_ctx, 1, n_batch)
    rid = eng.add_request(prompt_ids, params, n_top=n_top, constraint=constraint,
                          draft_max=draft_max)
    seq = eng.sequence(rid)
    done = False
    try:
        while not done:
            for o in eng.step():
                if o.request_id != rid:
                    continue
                if o.token is not None:
                    st.ids.append(o.token)
                    # seq.top[i] belongs to generated token i (a step may emit several: forced
                    # tokens of a grammar)
                    top = seq.top[len(st.ids) - 1] if n_top > 0 else None
                    if n_top > 0:
                        st.top.append(top)
                    st.text += o.text
                    yield Step(o.token, o.text, top)
                elif o.text:
                    st.text += o.text
                    yield Step(-1, o.text, None)
                if o.finished:
                    st.finish_reason = o.finish_reason
                    st.timings = o.timings
                    done = True
    finally:
        if not done:
            eng.abort(rid)
