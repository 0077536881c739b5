"""The engine: requests in, tokens out, many sequences at once.

    eng = Engine(model, tokenizer, n_ctx=4096, n_parallel=4)
    rid = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=32))
    while eng.has_unfinished():
        for out in eng.step():      # one scheduler step: prompt chunks, or a decode row each
            print(out.request_id, out.text, out.finished)

One step = schedule (scheduler.py, integers), run (runner.py -> Model.forward), postprocess
(sample, detokenize, stop strings, EOG, max_tokens). Prefix reuse is automatic: full KV blocks
are keyed by their tokens (kv/pool.py). Not thread-safe: one thread owns an Engine.

Constrained requests (``add_request(..., constraint=compile_constraint(tok, spec))``,
memfit/constrain): while the forward runs, a worker thread has llguidance compute the token
masks of the step's constrained rows (GIL released) into one int32 bitmask; after it, every
row's logit_bias and the masks are applied in one batched call (sampler.prepare_logits), then
each row samples as usual. End-of-generation is allowed only where the grammar may end; a
complete grammar ends the sequence with "stop". Tokens the grammar forces after a sampled one
are appended at once and emitted as StepOutputs of their own in the same step (logprob 0.0,
top [[token, 0.0]] when n_top > 0: they were not sampled); the next decode step computes them
together as rows of their sequence, so they cost no forward each. They count toward
max_tokens. ``fast_forward = False`` (env MEMFIT_FF=0) feeds them one per step instead: the
same tokens and the same outputs, one forward each (the comparison for tests and benches).
``top`` / ``logprob`` of a row with logit_bias or a grammar come from its logits after the
bias and the mask (the distribution the token is drawn from, before penalties and
temperature); tokens they exclude are left out of ``top``.

Speculative decoding (``Engine(..., spec=Speculator)``, memfit/spec): in a decode step the
scheduler asks ``_propose`` for proposals for the sequences with one pending token and no
grammar; a sequence's ``draft`` is fed after its pending token as decode rows of that step,
each with a logits row. ``_verify`` draws the target's own token at each row as ``_sample``
would and accepts a proposal while it is that token, so the output is the same tokens with or
without speculation (greedy or seeded); the rejected rows are rolled back out of the KV cache
before any block holding them is keyed in the prefix cache.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from dataclasses import dataclass

import numpy as np

from ..errors import RequestError
from ..kv.pool import KVPool
from ..kv.storage import kv_layout
from ..kv.storage import kv_pool_blocks  # the planner's pool size (the API imports it here)
from .generate import Timings
from .runner import Runner
from .sampler import Sampler, SamplingParams, StopMatcher, prepare_logits, top_logprobs
from .scheduler import Scheduler
from .sequence import Sequence, Status


@dataclass
class StepOutput:
    request_id: str
    token: int | None          # a token generated this step (None: an abort notice); a step
                               # emits several for one request when a grammar forces tokens
    text: str                  # new text ('' mid UTF-8 / while a stop string is pending)
    top: list | None           # [[id, logprob], ...] when n_top > 0 ([[id, 0.0]]: forced)
    logprob: float | None      # logprob of `token` (when n_top > 0; 0.0 for a forced token)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    prompt_n: int              # prompt tokens
    cache_n: int               # prompt tokens reused from the prefix cache
    n_generated: int
    timings: Timings | None = None  # on the finished output


class Engine:
    def __init__(self, model, tokenizer, n_ctx: int, n_parallel: int = 1, n_batch: int = 512,
                 cache_type: str | None = None, n_blocks: int | None = None, ledger=None,
                 cache_type_v: str | None = None, spec=None, window_kv: bool = True):
        if n_parallel < 1:
            raise RequestError(f"n_parallel must be >= 1, got {n_parallel}")
        c = model.config
        cache_type = cache_type or ("f16" if getattr(model, "kv_f16", True) else "f32")
        self.model, self.tokenizer = model, tokenizer
        if ledger is not None and ledger.budget is not None:
            tokenizer.llg_lean = True  # constrain/tokenizer.py: llguidance's smaller tables
        self.n_ctx, self.n_parallel, self.n_batch = n_ctx, n_parallel, n_batch
        # the sliding-window layers keep only their windows (kv/pool.py): a group of their own
        # (window_kv False: they keep the whole context, masked; tests and benches compare)
        layout = kv_layout(c)
        self.pool = KVPool.of(layout, n_blocks or kv_pool_blocks(n_ctx, n_parallel),
                              cache_type, ledger=ledger, cache_type_v=cache_type_v,
                              n_blocks_swa=layout.swa_blocks(n_ctx, n_parallel, n_batch)
                              if window_kv else None)
        # prompt chunks of several sequences share a forward: on the native backend no row's
        # result depends on the others (ops/native.py); numpy's matmul gives no such promise
        pack = model.ops.has("batch_invariant")
        self.scheduler = Scheduler(self.pool, n_parallel, n_batch, n_ctx, pack=pack)
        self.runner = Runner(model, self.pool, n_parallel, n_batch, n_ctx)
        self.seqs: dict[str, Sequence] = {}
        self._pending: list[StepOutput] = []  # abort notices for the next step()
        self._ids = itertools.count()
        self.n_steps = 0
        # forced tokens join the next forward together (False: one per step, see module doc)
        self.fast_forward = os.environ.get("MEMFIT_FF", "1") != "0"
        self.n_forced = 0          # generated tokens a grammar forced (not sampled)
        self.n_constrained = 0     # generated tokens of constrained sequences, forced included
        self._masker = None        # constrain.MaskWorker, made for the first constraint
        # speculative decoding (spec/): proposals verified as decode rows of their sequence
        self.spec = None
        self.set_spec(spec)

    def set_spec(self, spec) -> None:
        """Speculate with ``spec`` (a spec.Speculator; None or a disabled one: no
        speculation) from the next step on; benches switch it between repetitions."""
        self.spec = spec if spec is not None and spec.enabled else None
        self.scheduler.propose = self._propose if self.spec is not None else None

    # --- requests
    def add_request(self, prompt_ids, params: SamplingParams, *, n_top: int = 0,
                    request_id: str | None = None, ignore_eos: bool = False,
                    constraint=None, draft_max: int | None = None) -> str:
        """Queue a request; ``constraint``: a constrain.Grammar compiled for this engine's
        tokenizer (every generated token then obeys it); ``draft_max``: proposed tokens per
        step at most for this request (0: no speculation; None: the engine's). Returns the
        request id."""
        from ..tokenizer import StreamDecoder

        ids = [int(i) for i in prompt_ids]
        if not ids:
            raise RequestError("the prompt is empty (no tokens); give some text")
        nv = self.model.config.n_vocab
        bad = [i for i in ids if not 0 <= i < nv]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{nv - 1})")
        if len(ids) >= self.n_ctx:
            raise RequestError(f"the prompt has {len(ids)} tokens but the context is {self.n_ctx}; "
                               f"raise --ctx-size or shorten the prompt")
        bias = None
        if params.logit_bias:
            bad = [i for i in params.logit_bias if not 0 <= i < nv]
            if bad:
                raise RequestError(f"logit_bias token id {bad[0]} is outside the vocabulary "
                                   f"(0..{nv - 1})")
            bias = (np.fromiter(params.logit_bias.keys(), np.int64, len(params.logit_bias)),
                    np.fromiter(params.logit_bias.values(), np.float32, len(params.logit_bias)))
        if constraint is not None and getattr(constraint, "tokenizer", None) is not self.tokenizer:
            raise RequestError("the constraint was compiled for another tokenizer; compile it "
                               "with this model's (constrain.compile_constraint)")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.seqs:
            raise RequestError(f"request id {rid!r} is already running")
        mt = params.max_tokens
        mt = self.n_ctx if mt is None or mt < 0 else mt
        mt = min(mt, self.n_ctx - len(ids))
        bs = self.pool.block_size
        if (len(ids) + mt + bs - 1) // bs > self.pool.n_blocks:
            raise RequestError(f"the prompt ({len(ids)} tokens) and max_tokens ({mt}) need more "
                               f"than the KV pool's {self.pool.n_blocks * bs} tokens; lower "
                               f"max_tokens or shorten the prompt")
        seq = Sequence(rid, ids, params, mt,
                       Sampler(params, self.tokenizer.n_vocab), StreamDecoder(self.tokenizer),
                       StopMatcher(params.stop or []), n_top=int(n_top), ignore_eos=ignore_eos)
        seq.bias = bias
        draft_max = params.draft_max if draft_max is None else draft_max
        if draft_max is not None:
            if isinstance(draft_max, bool) or not isinstance(draft_max, int) or draft_max < 0:
                raise RequestError(f"draft_max={draft_max!r} must be an integer >= 0")
            seq.draft_max = draft_max
        if constraint is not None:
            seq.matcher = constraint.matcher()
            seq.forced = seq.matcher.forced()  # the grammar's start may be forced already
            if self._masker is None:
                from ..constrain.masks import MaskWorker
                self._masker = MaskWorker(self.tokenizer.n_vocab)
        self.seqs[rid] = seq
        self.scheduler.add(seq)
        return rid

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks (its last output says "abort")."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return
        if seq in self.scheduler.waiting:
            self.scheduler.waiting.remove(seq)
        self.scheduler.free(seq)
        seq.draft = []
        if self.spec is not None:
            self.spec.release(request_id)
        seq.status, seq.finish_reason = Status.FINISHED, "abort"
        self._pending.append(StepOutput(request_id, None, "", None, None, True, "abort",
                                        seq.n_prompt, seq.cache_n, seq.n_generated,
                                        self._timings(seq)))

    def has_unfinished(self) -> bool:
        return bool(self._pending) or self.scheduler.has_unfinished()

    def stats(self) -> dict:
        s, p = self.scheduler, self.pool
        return {"running": len(s.running), "waiting": len(s.waiting),
                "kv_blocks_total": p.n_blocks, "kv_blocks_used": p.n_used,
                "kv_blocks_cached": p.n_cached, "kv_block_size": p.block_size,
                "kv_cache_type": p.cache_type, "kv_cache_type_v": p.cache_type_v,
                "kv_v_in_k": p.v_in_k, "kv_bytes": p.nbytes,
                "kv_swa_blocks_total": p.n_swa_blocks, "kv_swa_blocks_used": p.n_swa_used,
                "prefix_cache_queries": s.prefix_queries, "prefix_cache_hits": s.prefix_hits,
                "preempted": s.n_preempted, "prefill_steps": s.n_prefill_steps,
                "prefill_chunks": s.n_prefill_chunks, "steps": self.n_steps, "n_parallel": self.n_parallel,
                "constrained_tokens": self.n_constrained, "forced_tokens": self.n_forced,
                "spec": self.spec.summary() if self.spec is not None else None}

    # --- one step
    def step(self) -> list[StepOutput]:
        outs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if sched is None:
            return outs
        self.n_steps += 1
        now = time.perf_counter()
        for s in sched.seqs:
            if not s.t_prefill_start:
                s.t_prefill_start = now
        # the sequences that sample this step, in the runner's order: one logits row each, a
        # drafted one 1 + len(draft) rows (row i scores the token after its i-th proposal)
        rows, row_of = [], []
        for s, k in zip(sched.seqs, sched.n_tokens):
            if s.n_computed + k == len(s.tokens) + len(s.draft):
                rows.append(s)
                row_of.extend([s] * (1 + len(s.draft)))
        masked = [r for r, s in enumerate(row_of) if s.matcher is not None and not s.forced
                  and s.matcher.ll is not None]  # (a thinking budget alone masks nothing)
        if masked:  # llguidance fills them in a worker thread while the forward runs
            self._masker.start([row_of[r].matcher for r in masked])
        t0 = time.perf_counter()
        try:
            logits = self.runner.run(sched)
        finally:
            masks = self._masker.join() if masked else None
        if self.spec is not None:
            dt, width = time.perf_counter() - t0, sum(sched.n_tokens)
            if sched.decode:
                self.spec.cost.observe(width, dt)
            else:
                self.spec.cost.observe_prefill(width, dt)
        self.scheduler.after_step(sched)
        assert len(row_of) == logits.shape[0]
        biases = [s.bias for s in row_of]
        if masked or any(b is not None for b in biases):
            prepare_logits(logits, biases, masks, np.asarray(masked, np.int64))
        r = 0
        for s in rows:
            if s.draft:
                nr = 1 + len(s.draft)
                outs.extend(self._verify(s, logits[r:r + nr]))
                r += nr
            else:
                outs.extend(self._sample(s, logits[r]))
                r += 1
        return outs

    # --- speculative decoding
    def _propose(self, seqs: list[Sequence], room: int) -> None:
        """Scheduler hook in a decode step: proposals for the sequences that may draft (one
        pending token, no grammar: forced tokens are a grammar's own certain proposals)."""
        cand, caps = [], []
        for s in seqs:
            if s.matcher is not None or s.forced or s.draft_max == 0:
                continue
            cap = min(room, s.max_tokens - s.n_generated - 1,
                      s.draft_max if s.draft_max is not None else room)
            if cap > 0:
                cand.append(s)
                caps.append(cap)
        if not cand:
            return
        for s, name, d in self.spec.plan_step(cand, caps):
            s.draft, s.draft_by = list(d), name

    def _verify(self, s: Sequence, logits: np.ndarray) -> list[StepOutput]:
        """Accept the longest prefix of s.draft the target agrees with, plus the target's own
        token after it; take the rejected rows back out of the KV cache and key the blocks
        that the accepted tokens filled."""
        d, s.draft = s.draft, []
        toks, tops, acc = [], [], 0
        hist = list(s.tokens)
        for i in range(len(d) + 1):
            lg = logits[i]
            top = self._top(s, lg)
            prop = d[i] if i < len(d) else -1
            # the target's own token here, drawn as without speculation (one random draw per
            # emitted token, in order): a proposal is accepted when it is that token
            tok = int(s.sampler.sample(lg, hist))
            toks.append(tok)
            tops.append(top)
            hist.append(tok)
            if tok != prop:
                break
            acc += 1
            if tok in self.tokenizer.eog_ids and not s.ignore_eos:
                break
        self.spec.record(s.draft_by or "?", len(d), acc)
        # exactly the rejected rows: their block was never shared nor keyed, and the window
        # layers give blocks back only after this (scheduler.py after_step)
        n_back = self.pool.rollback(s, len(d) - acc)
        assert n_back == len(d) - acc, (n_back, len(d) - acc)
        # hist: s.tokens + toks; a final commit: the window layers' old blocks go back now
        self.pool.manager.commit(s, 0, hist, n_prompt=s.n_prompt)
        outs = []
        for i, tok in enumerate(toks):
            o, done = self._emit(s, tok, logits[i], tops[i])
            outs.extend(o)
            if done:
                break
        return outs

    def _sample(self, s: Sequence, logits: np.ndarray) -> list[StepOutput]:
        if not s.t_first:
            s.t_first = time.perf_counter()
        if s.n_generated >= s.max_tokens:  # max_tokens 0 (or a full context): nothing to sample
            return [self._finish(s, None, "", None, None, "length")]
        if s.forced:  # the grammar's forced start, or (fast_forward off) the next forced token
            toks = s.forced[:] if self.fast_forward else s.forced[:1]
            del s.forced[:len(toks)]
            return self._push_forced(s, toks)
        m = s.matcher
        if m is not None and not np.isfinite(logits.max()):
            # no token allowed: llguidance's matcher is in error (cannot happen for a grammar
            # that compiled); end the text here rather than emit a token it rejects
            return [self._finish(s, None, "", None, None, "stop")]
        top = self._top(s, logits)
        tok = int(s.sampler.sample(logits, s.tokens))
        return self._emit(s, tok, logits, top)[0]

    @staticmethod
    def _top(s: Sequence, logits: np.ndarray):
        top = top_logprobs(logits, s.n_top) if s.n_top > 0 else None
        if top is not None and (s.matcher is not None or s.bias is not None):
            top = [t for t in top if t[1] > 0]  # not the tokens the mask or a -100 bias removed
        return top

    def _emit(self, s: Sequence, tok: int, logits: np.ndarray, top) -> tuple[list, bool]:
        """Append a chosen token and emit it: end-of-generation, the grammar, stop strings and
        max_tokens apply; returns (outputs, whether s finished)."""
        m = s.matcher
        s.tokens.append(tok)
        lp = None
        if top is not None:
            s.top.append(top)
            mx = float(np.max(logits))
            logz = mx + math.log(float(np.exp(logits - mx, dtype=np.float64).sum()))
            lp = float(logits[tok]) - logz
            top = [[i, math.log(p) if p > 0 else -math.inf] for i, p in top]
        if m is not None:
            self.n_constrained += 1
        if tok in self.tokenizer.eog_ids and (not s.ignore_eos or m is not None):
            # (a grammar allows end-of-generation only where it may end: it ends the text)
            return [self._finish(s, tok, "", top, lp, "stop")], True
        if m is not None and not m.consume([tok]):
            return [self._finish(s, tok, "", top, lp, "stop")], True
        emit, stopped = s.stops.push(s.decoder.push(tok))
        if stopped or (m is not None and m.stopped):
            return [self._finish(s, tok, emit, top, lp, "stop")], True
        if s.n_generated >= s.max_tokens:
            return [self._finish(s, tok, emit, top, lp, "length")], True
        s.text += emit
        out = [StepOutput(s.request_id, tok, emit, top, lp, False, None, s.n_prompt, s.cache_n,
                          s.n_generated)]
        if m is not None:
            ff = m.forced()
            if ff and self.fast_forward:
                out.extend(self._push_forced(s, ff))
                return out, out[-1].finished
            s.forced = ff
        return out, False

    def _push_forced(self, s: Sequence, toks: list[int]) -> list[StepOutput]:
        """Append tokens the grammar forces (consumed by its matcher at once) and emit one
        StepOutput each; stop strings, the grammar's end and max_tokens apply per token."""
        assert s.matcher.consume(toks), s.matcher.error
        outs = []
        for i, tok in enumerate(toks):
            s.tokens.append(tok)
            s.n_forced += 1
            self.n_forced += 1
            self.n_constrained += 1
            top = lp = None
            if s.n_top > 0:  # not sampled: certain given the grammar
                s.top.append([[tok, 1.0]])
                top, lp = [[tok, 0.0]], 0.0
            emit, stopped = s.stops.push(s.decoder.push(tok))
            if stopped or (i == len(toks) - 1 and s.matcher.stopped):
                outs.append(self._finish(s, tok, emit, top, lp, "stop"))
                return outs
            if s.n_generated >= s.max_tokens:
                outs.append(self._finish(s, tok, emit, top, lp, "length"))
                return outs
            s.text += emit
            outs.append(StepOutput(s.request_id, tok, emit, top, lp, False, None, s.n_prompt,
                                   s.cache_n, s.n_generated))
        return outs

    def _finish(self, s: Sequence, tok, emit: str, top, lp, reason: str) -> StepOutput:
        if not s.stops.stopped:
            # text held back by the stop matcher or the UTF-8 decoder was not a stop: emit it
            e2, _ = s.stops.push(s.decoder.flush())
            emit += e2 + s.stops.flush()
        s.text += emit
        s.status, s.finish_reason = Status.FINISHED, reason
        s.t_done = time.perf_counter()
        s.draft = []
        if self.spec is not None:
            self.spec.release(s.request_id)
        self.scheduler.free(s)
        self.seqs.pop(s.request_id, None)
        return StepOutput(s.request_id, tok, emit, top, lp, True, reason, s.n_prompt, s.cache_n,
                          s.n_generated, self._timings(s))

    @staticmethod
    def _timings(s: Sequence) -> Timings:
        t = Timings(prompt_n=s.n_prompt - s.cache_n, cache_n=s.cache_n, predicted_n=s.n_generated)
        if s.t_first:
            t.prompt_ms = (s.t_first - s.t_prefill_start) * 1e3
            t.predicted_ms = ((s.t_done or time.perf_counter()) - s.t_first) * 1e3
        return t

    def sequence(self, request_id: str) -> Sequence | None:
        return self.seqs.get(request_id)
