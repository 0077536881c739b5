"""The Python API, memfit's first interface; the CLI and the server are thin layers over it.

    with memfit.load("smollm2-135m") as m:
        r = m.generate("The capital of France is", max_tokens=16, temperature=0)
        print(r.text, r.timings)
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
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
                 mem_budget: int | str | None = None, n_parallel: int = 1,
                 cache_type_k: str = "f16", cache_type_v: str = "f16", *, runtime=None,
                 constrained: bool = False, spec: str | None = "auto",
                 draft_max: int | None = None, draft_min: int | None = None,
                 model_draft: str | os.PathLike | None = None):
        """Plan and load (memfit.runtime.Runtime), or load the planned ``runtime`` given
        (serve plans before its port opens). ``spec``: speculative decoding, off | ngram |
        draft | resident | auto (memfit.spec; the output is the same tokens either way),
        with at most ``draft_max`` proposed tokens per step (default 16) and at least
        ``draft_min``; ``model_draft``: a GGUF with the same vocabulary as the draft model."""
        from .runtime import Runtime
        from .spec.build import as_config
        rt = runtime if runtime is not None else Runtime(
            model, threads=threads, n_ctx=n_ctx, backend=backend, quiet=quiet,
            mem_budget=mem_budget, n_parallel=n_parallel, cache_type_k=cache_type_k,
            cache_type_v=cache_type_v, constrained=constrained,
            spec=as_config(spec, draft_max, draft_min), model_draft=model_draft)
        self.runtime = rt.load()
        self.path, self.file, self.store, self.ledger = rt.path, rt.file, rt.store, rt.ledger
        self.plan = rt.plan if rt.use_store else None  # the plan a weight store executes
        self.notes = rt.notes  # start-up facts the CLI prints (context fitted, streaming)
        self.threads, self.n_parallel, self.n_ctx, self.n_batch = \
            rt.threads, rt.n_parallel, rt.n_ctx, rt.n_batch
        self.cache_type_k, self.cache_type_v = rt.cache_type_k, rt.cache_type_v
        self.tokenizer, self.ops, self.model, self.config, self.engine = \
            rt.tokenizer, rt.ops, rt.model, rt.config, rt.engine

    # --- lifecycle
    def close(self) -> None:
        self.closed = True
        self.runtime.close()

    def _check_open(self) -> None:
        if getattr(self, "closed", False):
            raise RequestError(f"the model {self.path.name} is closed; load it again")

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- tokens
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            template: str | None = None, *, tools: list[dict] | None = None,
                            **kwargs) -> str:
        """Render messages with ``template`` (a built-in name or a jinja file), else the
        GGUF's own, else the built-in template of the model's family (as llama.cpp);
        ``chat_template_used`` says which. ``tools`` (OpenAI tool objects) and other keyword
        arguments (enable_thinking, ...) go to the template (tokenizer.templates)."""
        from .tokenizer.templates import apply_template
        text, self.chat_template_used = apply_template(
            self.tokenizer, self.file.arch, messages, add_generation_prompt, template,
            tools=tools, **kwargs)
        return text

    def _prompt_ids(self, prompt: str | Sequence[int], limit: int | None = None) -> list[int]:
        """Prompt text or ids -> ids; with ``limit``, text is tokenized in bounded pieces and
        tokenizer.vocab.TooManyTokens raised as soon as it has more than limit tokens."""
        if isinstance(prompt, str):
            if limit is not None:
                return self.tokenizer.encode_limited(prompt, limit)
            return self.tokenize(prompt, add_special=True, parse_special=True)
        if limit is not None and len(prompt) > limit:
            from .tokenizer.vocab import TooManyTokens
            raise TooManyTokens(len(prompt), limit)
        ids = [int(i) for i in prompt]
        bad = [i for i in ids if not 0 <= i < self.tokenizer.n_vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{self.tokenizer.n_vocab - 1})")
        return ids

    def _prompt_ids_ctx(self, prompt: str | Sequence[int]) -> list[int]:
        """A prompt to generate from -> ids, text tokenized in bounded pieces that stop as soon
        as it cannot fit the context (a prompt needs at least one free position)."""
        from .tokenizer.vocab import TooManyTokens
        try:
            return self._prompt_ids(prompt, self.n_ctx - 1)
        except TooManyTokens as e:
            raise RequestError(f"the prompt has {'at least ' if isinstance(prompt, str) else ''}"
                               f"{e.n_at_least} tokens but the context is {self.n_ctx}; raise "
                               f"--ctx-size or shorten the prompt") from None

    def spec_stats(self) -> dict | None:
        """Speculative decoding so far: mode, proposed, accepted, acceptance_rate,
        mean_accepted (per verify pass), per proposer; None when it is off."""
        return self.engine.stats()["spec"]

    # --- generation (clients of self.engine)
    def constraint(self, json_schema: dict | str | None = None, grammar: str | None = None,
                   regex: str | None = None):
        """The compiled constraint (constrain.Grammar) of generate's keywords, or None:
        ``json_schema`` a JSON schema (dict or JSON text), ``grammar`` a Lark or GBNF grammar
        (told apart by its syntax), ``regex`` a regular expression; at most one.
        constrain.ConstraintError (a RequestError) when it cannot be compiled."""
        from .constrain import compile_constraint, spec_from_kwargs
        spec = spec_from_kwargs(json_schema, grammar, regex)
        return None if spec is None else compile_constraint(self.tokenizer, spec)

    def _steps(self, prompt, n_top: int, state: GenerationState | None, json_schema=None,
               grammar=None, regex=None, draft_max=None, **sampling):
        self._check_open()
        params = SamplingParams(**sampling)
        constraint = self.constraint(json_schema, grammar, regex)
        ids = self._prompt_ids_ctx(prompt)
        st = state if state is not None else GenerationState(ids)
        st.prompt_ids = ids
        return st, generate_steps(self.model, self.tokenizer, ids, params, self.n_ctx,
                                  n_top=n_top, state=st, n_batch=self.n_batch,
                                  engine=self.engine, constraint=constraint,
                                  draft_max=draft_max)

    @staticmethod
    def _is_batch(prompt) -> bool:
        return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
                and all(isinstance(p, str) or (isinstance(p, Sequence) and not isinstance(p, str))
                        for p in prompt))

    def generate(self, prompt: str | Sequence[int] | list, max_tokens: int = 128,
                 top_logprobs: int = 0, *, json_schema: dict | str | None = None,
                 grammar: str | None = None, regex: str | None = None,
                 draft_max: int | None = None, **sampling) -> Completion | list[Completion]:
        """Complete ``prompt`` (text or ids). Sampling keywords: temperature, top_k, top_p,
        min_p, repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty, seed, stop,
        logit_bias ({token id: bias in [-100, 100]}). At most one constraint: ``json_schema``
        (a dict or JSON text: the text is JSON that validates), ``grammar`` (Lark or GBNF),
        ``regex``; the text then ends with "stop" where the grammar is complete.
        ``draft_max``: proposed tokens per step for this call (0: no speculation; None: the
        model's setting).
        A list of prompts (texts or id lists) runs them together (up to n_parallel at once)
        and returns a list of Completions in the same order."""
        if not self._is_batch(prompt):
            st, steps = self._steps(prompt, top_logprobs, None, json_schema, grammar, regex,
                                    draft_max, max_tokens=max_tokens, **sampling)
            for _ in steps:
                pass
            return Completion(st.prompt_ids, st.ids, st.text, st.finish_reason, st.timings,
                              st.top if top_logprobs > 0 else None)
        self._check_open()
        params = SamplingParams(max_tokens=max_tokens, **sampling)
        constraint = self.constraint(json_schema, grammar, regex)
        eng = self.engine
        all_ids = [self._prompt_ids_ctx(p) for p in prompt]
        rids, seqs = [], {}
        try:
            for ids in all_ids:
                rid = eng.add_request(ids, params, n_top=top_logprobs, constraint=constraint,
                                      draft_max=draft_max)
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

    def stream(self, prompt: str | Sequence[int], max_tokens: int = 128, *,
               json_schema: dict | str | None = None, grammar: str | None = None,
               regex: str | None = None, draft_max: int | None = None,
               **sampling) -> Iterator[str]:
        """Yield text pieces as they are decoded (never a broken UTF-8 sequence); keywords
        as generate's."""
        _, steps = self._steps(prompt, 0, None, json_schema, grammar, regex, draft_max,
                               max_tokens=max_tokens, **sampling)
        for step in steps:
            if step.text:
                yield step.text

    # --- saved sessions
    def _kv_geometry(self) -> dict:
        from .kv.quant import cache_type, row_bytes
        from .kv.storage import aux_dtype, kv_layout
        L = kv_layout(self.config)
        return {"n_layer": L.n_layer, "n_kv_head": L.n_head_kv,
                "row_bytes_k": row_bytes(cache_type(self.cache_type_k), L.head_dim_k),
                # V inside K (MLA): no V rows of their own; glm-dsa's indexer key rows stand
                # in their place (kv/storage.py read_blocks)
                "row_bytes_v": (L.aux_dim * np.dtype(aux_dtype(self.cache_type_k)).itemsize
                                if L.aux_layers else 0) if L.v_in_k else
                row_bytes(cache_type(self.cache_type_v), L.head_dim_v)}

    def save_state(self, path: str | os.PathLike, ids: Sequence[int],
                   extra: dict | None = None) -> int:
        """Save a sequence: its token ids (e.g. ``r.prompt_ids + r.ids`` of a Completion, or a
        running request's tokens) with the K/V rows of their whole blocks as a prompt of ids
        computes them (in the cache types), this model's identity and ``extra`` (JSON-able).
        Crash-safe (memfit/session.py). Blocks the prefix cache does not hold are computed
        first. Returns the file size."""
        from . import session as ss
        ids = self._prompt_ids(list(ids))
        if not ids:
            raise RequestError("nothing to save: the sequence has no tokens")
        if len(ids) >= self.n_ctx:
            raise RequestError(f"the sequence has {len(ids)} tokens but the context is "
                               f"{self.n_ctx}; save a shorter one or raise --ctx-size")
        pool = self.engine.pool
        k, v = ss.export_prefix(pool, ids)
        # the cache holds ids' blocks as prompt rows only up to where generated tokens began
        # (engine/scheduler.py): compute the whole sequence as a prompt, so that the file holds
        # every full block and a restored session continues as a cold run of ids would
        if k[0].shape[0] < len(ids) // pool.block_size * pool.block_size:
            self.generate(ids, max_tokens=0)
            k, v = ss.export_prefix(pool, ids)
        st = ss.SessionState(list(ids), k, v, self.cache_type_k, self.cache_type_v, extra or {})
        return ss.save(path, ss.model_identity(self.file), st)

    def load_state(self, path: str | os.PathLike) -> tuple[list[int], dict]:
        """Restore a session saved by save_state: its K/V blocks go into the engine's prefix
        cache, so the next request that starts with its ids reuses them. Returns (ids, extra).
        SessionError when the file belongs to another model or cache types, or is truncated
        or corrupt."""
        from . import session as ss
        st = ss.load(path, ss.model_identity(self.file), self.cache_type_k, self.cache_type_v,
                     self._kv_geometry())
        bad = [i for i in st.ids if not 0 <= i < self.tokenizer.n_vocab]
        if bad:  # same model file, so only a hand-edited file (checksum recomputed) gets here
            raise ss.SessionError(f"{path} is corrupt: token id {bad[0]} is outside the "
                                  f"vocabulary (0..{self.tokenizer.n_vocab - 1}); save the "
                                  f"session again")
        if len(st.ids) >= self.n_ctx:
            raise RequestError(f"the session holds {len(st.ids)} tokens but the context is "
                               f"{self.n_ctx}; load it with --ctx-size {len(st.ids) + 1} or more")
        ss.import_prefix(self.engine.pool, st.ids, st.k, st.v)
        return list(st.ids), st.extra

    # --- embeddings
    def default_pooling(self) -> str:
        """The GGUF's ``{arch}.pooling_type`` when it is mean, cls or last, else "mean".
        (llama-server falls back to "none", per-token vectors, which its /v1/embeddings
        refuses; mean pooling makes a causal model's file usable as it is.)"""
        t = self.file.metadata.get(f"{self.file.arch}.pooling_type")
        return {1: "mean", 2: "cls", 3: "last"}.get(t, "mean")

    def embed(self, inputs: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
              pooling: str | None = None, normalize: bool = True) -> np.ndarray:
        """Pooled final hidden states f32 [n_inputs, n_embd], as llama-server's --embedding:
        the hidden state after output_norm (before the output head) of each token, pooled
        "mean" (default: default_pooling()), "cls" (first token) or "last", then L2-normalized
        when ``normalize``. ``inputs``: a text, a list of texts, a list of token ids or a list
        of id lists; texts get the model's special tokens (BOS/EOS) as a prompt does. The
        inputs run one after another in the plan's n_batch pieces on the engine's KV pool."""
        self._check_open()
        if isinstance(inputs, np.ndarray):
            inputs = inputs.tolist()
        if isinstance(inputs, str) or (isinstance(inputs, Sequence) and len(inputs) > 0 and
                                       all(isinstance(i, (int, np.integer)) for i in inputs)):
            inputs = [inputs]
        if not isinstance(inputs, Sequence) or len(inputs) == 0:
            raise RequestError("embed needs a text, a list of texts, a list of token ids or a "
                               "list of id lists (got an empty or unknown input)")
        ids = []
        for k, p in enumerate(inputs):
            try:
                ids.append(self._prompt_ids(p, self.n_ctx))
            except RequestError as e:
                from .tokenizer.vocab import TooManyTokens
                if isinstance(e, TooManyTokens):
                    raise RequestError(f"input {k} has at least {e.n_at_least} tokens but the "
                                       f"context is {self.n_ctx}; shorten it or raise "
                                       f"n_ctx / --ctx-size") from None
                raise
            if not ids[-1]:
                raise RequestError(f"input {k} is empty (no tokens); give some text or ids")
        out = np.empty((len(ids), self.config.n_embd), np.float32)
        for k, x in enumerate(ids):
            out[k] = self.embed_ids(x, pooling, normalize)
        return out

    def embed_ids(self, ids: Sequence[int], pooling: str | None = None,
                  normalize: bool = True) -> np.ndarray:
        """One sequence of token ids (1..n_ctx of them) -> its pooled embedding f32 [n_embd].
        Not thread-safe, as forward is not: the server runs it on the engine's thread."""
        from .kv.seq import SeqKV
        pooling = self.default_pooling() if pooling is None else pooling
        if pooling not in ("mean", "cls", "last"):
            raise RequestError(f"pooling {pooling!r} is not supported; use mean, cls or last")
        n = len(ids)
        if n == 0:
            raise RequestError("cannot embed an empty input (no tokens)")
        if n > self.n_ctx:
            raise RequestError(f"the input has {n} tokens but the context is {self.n_ctx}")
        ids = np.asarray(ids, dtype=np.int32)
        if pooling == "cls":
            ids = ids[:1]  # causal: the first token's state does not depend on the rest
        acc = np.zeros(self.config.n_embd, np.float64)
        with SeqKV(self.engine.pool, len(ids)) as cache:
            for b in range(0, len(ids), self.n_batch):
                piece = ids[b:b + self.n_batch]
                if pooling == "mean":   # every row's final-normed state, summed in float64
                    acc += self.model.forward(piece, cache, hidden_from=0).sum(axis=0,
                                                                               dtype=np.float64)
                else:                   # only the piece's last row leaves the last layer
                    acc[:] = self.model.forward(piece, cache, hidden_from=len(piece) - 1)[0]
        if pooling == "mean":
            acc /= n
        if normalize:  # llama.cpp's common_embd_normalize(..., 2): a zero vector stays zero
            norm = math.sqrt(float(acc @ acc))
            acc *= 1.0 / norm if norm > 0 else 0.0
        return acc.astype(np.float32)

    # --- evaluation
    def logprobs(self, ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced log-probabilities, f32 [len(ids), n_vocab]: row i is log p(next token)
        after ids[:i+1], computed in the plan's batches (only the result is n x n_vocab)."""
        from .eval.logits import iter_logits, log_softmax
        self._check_open()
        ids = self._prompt_ids(ids)
        if not ids:
            raise RequestError("logprobs of an empty sequence: give at least one token id")
        if len(ids) > self.n_ctx:
            raise RequestError(f"{len(ids)} tokens exceed the context {self.n_ctx}; load with "
                               f"n_ctx={len(ids)} or more")
        out = np.empty((len(ids), self.tokenizer.n_vocab), dtype=np.float32)
        for row, lg in iter_logits(self, ids):
            out[row:row + len(lg)] = log_softmax(lg)
        return out

    def perplexity(self, text: str, ctx: int = 512, progress=None,
                   max_chunks: int | None = None) -> Perplexity:
        """llama-perplexity's method: ctx-token chunks, BOS first when the model adds one,
        the second half of each chunk scored. ``progress(i, n, running_ppl)`` per chunk."""
        self._check_open()
        if ctx < 16:
            raise RequestError(f"perplexity context {ctx} is too small (minimum 16)")
        from .memory.planner import LOGITS_SLICE_ROWS as rows
        t0 = time.perf_counter()
        toks = self.tokenize(text, add_special=True, parse_special=False)
        n_chunks = len(toks) // ctx
        if max_chunks:
            n_chunks = min(n_chunks, max_chunks)
        if n_chunks == 0:
            raise RequestError(f"the text has {len(toks)} tokens; perplexity needs at least "
                               f"{ctx} (one chunk of --ctx-size)")
        first = ctx // 2
        nll = nll2 = 0.0
        count = 0
        running = []
        bos = self.tokenizer.bos_id if self.tokenizer.add_bos else None
        from .kv.seq import SeqKV
        cache = SeqKV(self.engine.pool, ctx)  # blocks of the engine's pool (in the ledger)
        for c in range(n_chunks):
            chunk = list(toks[c * ctx:(c + 1) * ctx])
            if bos is not None:
                chunk[0] = bos
            cache.reset()
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
        cache.close()
        mean = nll / count
        ppl = math.exp(mean)
        var = nll2 / count - mean * mean
        err = ppl * math.sqrt(var / (count - 1)) if var > 0 and count > 1 else 0.0
        return Perplexity(ppl, err, n_chunks, len(toks), running, time.perf_counter() - t0)
