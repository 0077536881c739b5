"""The Python API, memfit's first interface; the CLI and the server are thin layers over it.

    with memfit.load("smollm2-135m") as m:
        r = m.generate("The capital of France is", max_tokens=16, temperature=0)
        print(r.text, r.timings)
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .errors import RequestError
from .engine.generate import GenerationState, Timings, generate_steps
from .engine.sampler import SamplingParams


@dataclass
class Completion:
    prompt_ids: list[int]
    ids: list[int]
    text: str
    finish_reason: str | None
    timings: Timings
    top: list | None = None  # per step: [[id, prob], ...] of the full pre-sampling softmax

    def to_dict(self) -> dict:
        d = {"prompt_ids": self.prompt_ids, "ids": self.ids, "text": self.text,
             "finish_reason": self.finish_reason, "timings": self.timings.to_dict()}
        if self.top is not None:
            d["top"] = self.top
        return d


@dataclass
class Perplexity:
    ppl: float
    ppl_err: float
    chunks: int
    n_tokens: int
    per_chunk: list[float] = field(default_factory=list)  # running PPL after each chunk
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"ppl": self.ppl, "ppl_err": self.ppl_err, "chunks": self.chunks,
                "n_tokens": self.n_tokens, "per_chunk_running_ppl": self.per_chunk,
                "seconds": round(self.seconds, 3)}


def peak_rss_bytes() -> int:
    """Peak resident set (VmHWM) of this process: the number the budget caps."""
    from .memory.budget import peak_rss
    return peak_rss()


class Model:
    """A loaded GGUF model: tokenizer, architecture, compute backend."""

    def __init__(self, model: str | os.PathLike | None = None, threads: int | None = None,
                 n_ctx: int | None = None, backend: str | None = None, quiet: bool = True,
                 mem_budget: int | str | None = None, n_parallel: int = 1):
        from .gguf import open_gguf
        from .models import load_model
        from .ops import get_ops
        from .pull import resolve_model
        from .tokenizer import Tokenizer

        self.store = None
        self.path = Path(resolve_model(str(model) if model is not None else None, quiet=quiet))
        self.file = open_gguf(self.path)
        try:
            if threads is not None and threads < 1:
                raise RequestError(f"threads must be >= 1, got {threads}")
            if n_ctx is not None and int(n_ctx) < 8:  # before the planner sizes the KV cache
                raise RequestError(f"context size {n_ctx} is too small (minimum 8)")
            if int(n_parallel) < 1:
                raise RequestError(f"n_parallel must be >= 1, got {n_parallel}")
            self.n_parallel = int(n_parallel)
            self.threads = threads
            self.plan = self.ledger = None
            if mem_budget is not None or os.environ.get("MEMFIT_MEM_BUDGET"):
                self._plan_budget(mem_budget, n_ctx, quiet)  # refuses before anything loads
            else:
                self._auto_budget(n_ctx, quiet)
            self.tokenizer = Tokenizer.from_metadata(self.file.metadata)
            self.ops = get_ops(backend)
            if threads is not None and hasattr(self.ops, "set_threads"):
                self.ops.set_threads(threads)
            self.model = load_model(self.file, weights=self.store, ops=self.ops)
            self.config = self.model.config
            train_ctx = int(getattr(self.config, "n_ctx_train", 0) or 4096)
            self.n_ctx = int(n_ctx) if n_ctx is not None else min(train_ctx, 4096)
            self.n_batch = int(getattr(self.plan, "n_batch", 0) or 512)
            if self.n_ctx < 8:
                raise RequestError(f"context size {self.n_ctx} is too small (minimum 8)")
            if self.n_ctx > train_ctx:
                raise RequestError(f"context size {self.n_ctx} exceeds the model's training "
                                   f"context {train_ctx}; use --ctx-size {train_ctx} or less")
            self._check_kv_fits()
            from .engine.engine import Engine
            # the paged KV pool for n_parallel sequences of n_ctx tokens, counted by the ledger
            self.engine = Engine(self.model, self.tokenizer, self.n_ctx, self.n_parallel,
                                 self.n_batch, ledger=self.ledger)
        except BaseException:
            self.close()
            raise

    def _check_kv_fits(self) -> None:
        """Refuse a context whose KV cache cannot fit in available memory (before allocating)."""
        import psutil
        c = self.config
        from .engine.engine import kv_pool_blocks
        from .kv import BLOCK_SIZE
        tokens = kv_pool_blocks(self.n_ctx, self.n_parallel) * BLOCK_SIZE
        kv = 2 * tokens * c.n_layer * c.n_head_kv * (c.head_dim_k + c.head_dim_v)  # f16
        avail = psutil.virtual_memory().available
        if kv > avail:
            raise RequestError(f"context size {self.n_ctx} x {self.n_parallel} sequences needs "
                               f"{kv / 2**30:.1f} GiB of KV cache but {avail / 2**30:.1f} GiB is "
                               f"available; lower --ctx-size or --parallel")

    def _auto_budget(self, n_ctx, quiet: bool) -> None:
        """No budget given: plan against the detected one (MemAvailable or the cgroup limit,
        minus a margin). A model that fits whole is memory-mapped as before; one that does
        not is run within the detected budget by the weight store, and one below its floor
        is refused (naming the minimum) instead of thrashing or being OOM-killed."""
        from .memory.budget import detect_budget, measure_baseline
        from .memory.planner import plan_for_path

        try:
            budget, why = detect_budget()
        except (OSError, ValueError):  # no /proc/meminfo or cgroup files: nothing to plan for
            return
        baseline = measure_baseline()
        plan = plan_for_path(self.file, budget, n_ctx=n_ctx, threads=self.threads,
                             baseline_bytes=baseline, n_parallel=self.n_parallel)
        if plan.tiers["file"] or plan.tiers["cache"]:
            if not quiet:
                print(f"memfit: the model does not fit in memory ({why}); streaming "
                      f"{plan.disk_bytes_per_token / 2**30:.2f} GiB per token from the file "
                      f"(set --mem-budget to choose the budget)", file=sys.stderr, flush=True)
            self._plan_budget(budget, n_ctx, quiet, plan=plan, baseline=baseline)

    def _plan_budget(self, mem_budget, n_ctx, quiet: bool, plan=None, baseline=None) -> None:
        """Plan tiers for the budget (refusing below the floor before anything loads), then
        open a WeightStore that executes the plan inside a ledger of the budget."""
        from .memory.budget import measure_baseline, resolve_budget
        from .memory.ledger import Ledger
        from .memory.planner import plan_for_path
        from .memory.store import WeightStore

        budget, _why = resolve_budget(mem_budget)
        if plan is None:
            baseline = measure_baseline()
            plan = plan_for_path(self.file, budget, n_ctx=n_ctx, threads=self.threads,
                                 baseline_bytes=baseline, n_parallel=self.n_parallel)
        self.plan = plan
        self.ledger = Ledger(budget)
        self.ledger.alloc("baseline", "runtime", baseline)
        self.store = WeightStore(self.file, self.plan, self.ledger)

    # --- lifecycle
    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        self.file.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- tokens
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        from .tokenizer import render_chat
        tmpl = self.tokenizer.chat_template
        if not tmpl:
            raise RequestError(f"{self.path.name} has no chat template "
                               f"(tokenizer.chat_template); use plain completion without --chat")
        bos = self.tokenizer.token_text(self.tokenizer.bos_id) if self.tokenizer.bos_id is not None else ""
        eos = self.tokenizer.token_text(self.tokenizer.eos_id) if self.tokenizer.eos_id is not None else ""
        return render_chat(tmpl, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=bos, eos_token=eos)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenize(prompt, add_special=True, parse_special=True)
        ids = [int(i) for i in prompt]
        bad = [i for i in ids if not 0 <= i < self.tokenizer.n_vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{self.tokenizer.n_vocab - 1})")
        return ids

    # --- generation (clients of self.engine)
    def _steps(self, prompt, n_top: int, state: GenerationState | None, **sampling):
        params = SamplingParams(**sampling)
        ids = self._prompt_ids(prompt)
        st = state if state is not None else GenerationState(ids)
        st.prompt_ids = ids
        return st, generate_steps(self.model, self.tokenizer, ids, params, self.n_ctx,
                                  n_top=n_top, state=st, n_batch=self.n_batch,
                                  engine=self.engine)

    @staticmethod
    def _is_batch(prompt) -> bool:
        return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
                and all(isinstance(p, str) or (isinstance(p, Sequence) and not isinstance(p, str))
                        for p in prompt))

    def generate(self, prompt: str | Sequence[int] | list, max_tokens: int = 128,
                 top_logprobs: int = 0, **sampling) -> Completion | list[Completion]:
        """Complete ``prompt`` (text or ids). Sampling keywords: temperature, top_k, top_p,
        min_p, repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty, seed, stop.
        A list of prompts (texts or id lists) runs them together (up to n_parallel at once)
        and returns a list of Completions in the same order."""
        if not self._is_batch(prompt):
            st, steps = self._steps(prompt, top_logprobs, None, max_tokens=max_tokens, **sampling)
            for _ in steps:
                pass
            return Completion(st.prompt_ids, st.ids, st.text, st.finish_reason, st.timings,
                              st.top if top_logprobs > 0 else None)
        params = SamplingParams(max_tokens=max_tokens, **sampling)
        eng = self.engine
        all_ids = [self._prompt_ids(p) for p in prompt]
        rids, seqs = [], {}
        try:
            for ids in all_ids:
                rid = eng.add_request(ids, params, n_top=top_logprobs)
                rids.append(rid)
                seqs[rid] = eng.sequence(rid)
            done: dict[str, Completion] = {}
            while len(done) < len(rids):
                for o in eng.step():
                    if o.finished and o.request_id in seqs:
                        s = seqs[o.request_id]
                        done[o.request_id] = Completion(
                            list(s.prompt_ids), list(s.output_ids), s.text, s.finish_reason,
                            o.timings, s.top if top_logprobs > 0 else None)
        finally:
            for rid in rids:
                if eng.sequence(rid) is not None:
                    eng.abort(rid)
        return [done[r] for r in rids]

    def stream(self, prompt: str | Sequence[int], max_tokens: int = 128, **sampling) -> Iterator[str]:
        """Yield text pieces as they are decoded (never a broken UTF-8 sequence)."""
        _, steps = self._steps(prompt, 0, None, max_tokens=max_tokens, **sampling)
        for step in steps:
            if step.text:
                yield step.text

    # --- evaluation
    def perplexity(self, text: str, ctx: int = 512, progress=None) -> Perplexity:
        """llama-perplexity's method: ctx-token chunks, BOS first when the model adds one,
        the second half of each chunk scored. ``progress(i, n, running_ppl)`` per chunk."""
        if ctx < 16:
            raise RequestError(f"perplexity context {ctx} is too small (minimum 16)")
        from .memory.planner import LOGITS_SLICE_ROWS as rows
        t0 = time.perf_counter()
        toks = self.tokenize(text, add_special=True, parse_special=False)
        n_chunks = len(toks) // ctx
        if n_chunks == 0:
            raise RequestError(f"the text has {len(toks)} tokens; perplexity needs at least "
                               f"{ctx} (one chunk of --ctx-size)")
        first = ctx // 2
        nll = nll2 = 0.0
        count = 0
        running = []
        bos = self.tokenizer.bos_id if self.tokenizer.add_bos else None
        for c in range(n_chunks):
            chunk = list(toks[c * ctx:(c + 1) * ctx])
            if bos is not None:
                chunk[0] = bos
            cache = self.model.new_cache(ctx)
            # forward in the plan's n_batch pieces (scratch is sized for it); keep rows first..
            hs = []
            for b in range(0, ctx, self.n_batch):
                piece = np.asarray(chunk[b:b + self.n_batch], dtype=np.int32)
                if b + len(piece) <= first:
                    self.model.forward(piece, cache)
                else:
                    hs.append(self.model.forward(piece, cache, hidden_from=max(0, first - b)))
            h = np.concatenate(hs) if len(hs) > 1 else hs[0]
            tgt_all = np.asarray(chunk[first + 1:ctx])
            v = np.empty(len(tgt_all))
            for j in range(0, len(tgt_all), rows):  # f32 logits [rows, n_vocab] at a time
                lg = self.model.logits(h[j:j + rows][:len(tgt_all) - j])
                mx = lg.max(axis=1, keepdims=True)
                logz = np.log(np.exp(lg - mx, dtype=np.float64).sum(axis=1)) + mx[:, 0]
                tgt = tgt_all[j:j + rows]
                v[j:j + len(tgt)] = logz - lg[np.arange(len(tgt)), tgt]
            nll += float(v.sum())
            nll2 += float((v * v).sum())
            count += len(v)
            running.append(math.exp(nll / count))
            if progress:
                progress(c + 1, n_chunks, running[-1])
        mean = nll / count
        ppl = math.exp(mean)
        var = nll2 / count - mean * mean
        err = ppl * math.sqrt(var / (count - 1)) if var > 0 and count > 1 else 0.0
        return Perplexity(ppl, err, n_chunks, len(toks), running, time.perf_counter() - t0)
