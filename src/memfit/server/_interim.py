"""Stand-in for the batch engine until memfit.engine.engine lands (INTERFACES.md section 1).

Same interface (add_request/abort/step/has_unfinished/stats), built on the one-sequence
generator: each step advances every running request by one token, one after another. No
batching, no prefix reuse, one full-context KV cache per request. Used only when the loaded
model has no ``engine`` attribute.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from ..engine.generate import GenerationState, generate_steps


@dataclass
class StepOutput:
    request_id: str
    token: int | None
    text: str
    top: list | None
    logprob: float | None
    finished: bool
    finish_reason: str | None
    prompt_n: int
    cache_n: int
    n_generated: int


class InterimEngine:
    def __init__(self, m):
        self.m = m
        self._seqs: dict[str, tuple] = {}

    def add_request(self, prompt_ids, params, *, n_top: int = 0, request_id=None) -> str:
        from ..errors import RequestError
        if not prompt_ids:
            raise RequestError("the prompt is empty (no tokens); give some text")
        if len(prompt_ids) >= self.m.n_ctx:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens but the context is "
                               f"{self.m.n_ctx}; raise --ctx-size or shorten the prompt")
        rid = request_id or uuid.uuid4().hex
        st = GenerationState(list(prompt_ids))
        gen = generate_steps(self.m.model, self.m.tokenizer, list(prompt_ids), params,
                             self.m.n_ctx, n_top=n_top, state=st, n_batch=self.m.n_batch)
        self._seqs[rid] = (gen, st, n_top)
        return rid

    def abort(self, rid: str) -> None:
        self._seqs.pop(rid, None)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def step(self) -> list:
        outs = []
        for rid, (gen, st, n_top) in list(self._seqs.items()):
            s = next(gen, None)
            if s is None:  # the generator ended without a final token
                outs.append(StepOutput(rid, None, "", None, None, True, st.finish_reason,
                                       len(st.prompt_ids), 0, len(st.ids)))
                del self._seqs[rid]
                continue
            top = lp = None
            if s.top is not None:  # probabilities -> logprobs
                top = [[i, math.log(p) if p > 0 else -math.inf] for i, p in s.top]
                lp = next((x for i, x in top if i == s.id), None)
            tok = s.id if s.id >= 0 else None
            outs.append(StepOutput(rid, tok, s.text, top, lp, False, None,
                                   len(st.prompt_ids), 0, len(st.ids)))
        return outs

    def stats(self) -> dict:
        return {"running": len(self._seqs), "waiting": 0, "kv_blocks_total": 0,
                "kv_blocks_used": 0, "kv_blocks_cached": 0, "prefix_cache_queries": 0,
                "prefix_cache_hits": 0}
