"""A Sequence: one request's tokens, sampling state, KV blocks and progress.

``tokens`` is prompt + generated ids; ``n_computed`` of them have their K/V in the pool (the
rest are fed by the next steps: a prefill chunk, or the token sampled last step with the
tokens a grammar forced after it). ``draft`` holds tokens a proposer guessed after the last
one (speculative decoding): fed and verified in the same decode step, never part of ``tokens``
until accepted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from .sampler import Sampler, SamplingParams, StopMatcher


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int                   # tokens to generate at most (already capped by context)
    sampler: Sampler
    decoder: object                   # tokenizer.StreamDecoder
    stops: StopMatcher
    n_top: int = 0
    ignore_eos: bool = False          # benches: end-of-generation tokens do not stop it
    slot: int = -1                    # sequence slot while running (Batch.seq)
    tokens: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    n_computed: int = 0
    n_hashed: int = 0                 # full blocks registered in the prefix cache
    last_key: tuple | None = None     # prefix key of block n_hashed - 1
    swa_table: list[int] = field(default_factory=list)  # sliding-window layers' blocks (kv/manager.py)
    cache_n: int = 0                  # prompt tokens reused from the prefix cache (first admission)
    admitted: bool = False
    status: Status = Status.WAITING
    finish_reason: str | None = None
    text: str = ""
    top: list = field(default_factory=list)  # per step [[id, prob], ...] (n_top > 0)
    t_add: float = field(default_factory=time.perf_counter)
    t_first: float = 0.0              # first token sampled (end of prefill)
    t_prefill_start: float = 0.0
    t_done: float = 0.0
    matcher: object = None            # constrain.Matcher: the grammar's state (None: free text)
    forced: list[int] = field(default_factory=list)  # forced tokens not yet fed (engine.py)
    n_forced: int = 0                 # generated tokens the grammar forced (not sampled)
    bias: tuple | None = None         # logit_bias as (ids int64, values f32)
    draft: list[int] = field(default_factory=list)  # proposed tokens verified this step (spec/)
    draft_by: str | None = None       # the proposer that made them
    draft_max: int | None = None      # per request: proposed tokens at most (0: no speculation)

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt_ids)

    @property
    def n_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def n_pending(self) -> int:
        """Tokens whose K/V the next steps must compute (proposed ones included)."""
        return len(self.tokens) + len(self.draft) - self.n_computed
