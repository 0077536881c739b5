"""The draft-model proposer: a second, smaller GGUF with the target's vocabulary guesses the
next tokens greedily (llama.cpp's ``--model-draft``).

    draft = load_draft(path, target_model, target_tokenizer, target_file.metadata,
                       n_ctx=4096, n_parallel=4, n_batch=512, ledger=ledger)
    spec = make_speculator(cfg, model=target, tokenizer=tok, draft=draft)   # spec/build.py

The proposer owns its model (weights read once into buffers it owns and books in the ledger
when there is a budget: ``resident_weights/draft_weights``), its own paged KV pool (kv/pool.py,
booked as ``kv/draft_kv_pool``) and per request a shadow sequence: a block table, how many
tokens it has computed and which ones. ``propose()`` rolls each shadow back to the longest
common prefix of what it computed and the target sequence's tokens now (kv/pool.py rollback:
rejected guesses leave its cache there), catches up (prompt positions with the prefill
kernels, generated ones as decode rows, as the target computes them), then takes k greedy
steps; every forward carries all the step's sequences (engine/runner.py Runner with the
shadows as its sequences). ``release()`` gives a shadow's blocks back.

DraftProposer also serves the resident-layers draft (spec/resident.py): the same loop over a
``model`` whose ``forward(batch)`` runs a subset of the target's layers on a KV pool of its own.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from ..engine.runner import Runner
from ..engine.scheduler import Scheduled, pack_prompt_chunks
from ..errors import RequestError
from ..kv.pool import KVPool
from ..kv.storage import kv_layout, kv_pool_blocks
from .proposers import Proposer


class _Shadow:
    """The draft's copy of one request: the fields Runner and the block manager read."""

    __slots__ = ("request_id", "tokens", "n_prompt", "block_table", "n_computed", "n_hashed",
                 "last_key", "slot", "draft")

    def __init__(self, request_id: str, n_prompt: int, slot: int):
        self.request_id, self.n_prompt, self.slot = request_id, n_prompt, slot
        self.tokens: list[int] = []      # tokens[:n_computed] have K/V in the draft's pool
        self.block_table: list[int] = []
        self.n_computed = self.n_hashed = 0
        self.last_key = None
        self.draft: list[int] = []       # always empty (Runner reads it)


class DraftProposer(Proposer):
    """Greedy proposals of ``model`` (its logits' argmax) on a KV pool of its own. A sequence's
    proposal stops at the first token whose draft probability is below ``p_min`` (llama.cpp's
    --draft-p-min, default 0.75 there too): a guess the draft itself doubts is rarely accepted,
    and every guess costs a draft forward and a verify row."""

    name = "draft"
    P_MIN = 0.75

    def __init__(self, model, *, n_ctx: int, n_parallel: int = 1, n_batch: int = 512,
                 ledger=None, cache_type: str | None = None, layout=None, eog_ids=(),
                 name: str | None = None, owned=()):
        self.model = model
        if name is not None:
            self.name = name
        self.n_parallel, self.n_batch = max(1, int(n_parallel)), max(1, int(n_batch))
        layout = layout or kv_layout(model.config)
        cache_type = cache_type or ("f16" if getattr(model, "kv_f16", True) else "f32")
        self.pool = KVPool.of(layout, kv_pool_blocks(n_ctx, self.n_parallel), cache_type)
        self.ledger = ledger
        self._booked: list[tuple[str, str]] = []
        self._book("kv", f"{self.name}_kv_pool", self.pool.nbytes)
        for cat, nm, n in owned:   # what the loader allocated for this proposer
            self._book(cat, nm, n)
        self.runner = Runner(model, self.pool, self.n_parallel, self.n_batch, n_ctx)
        self.eog = frozenset(int(i) for i in eog_ids)
        self._shadows: OrderedDict[str, _Shadow] = OrderedDict()   # least recently used first
        self._free_slots = list(range(self.n_parallel - 1, -1, -1))
        self.p_min = self.P_MIN
        self.n_forwards = 0     # draft forwards run
        self.seconds = 0.0      # time spent proposing (the policy's verify cost leaves it out)

    def _book(self, cat: str, nm: str, n: int) -> None:
        if self.ledger is not None:
            self.ledger.alloc(cat, nm, int(n))
            self._booked.append((cat, nm))

    # --- shadows
    def _shadow(self, s, busy: set) -> _Shadow | None:
        sh = self._shadows.get(s.request_id)
        if sh is not None:
            self._shadows.move_to_end(s.request_id)
            return sh
        while not self._free_slots:   # more requests than slots: the least recent one goes
            old = next((r for r in self._shadows if r not in busy), None)
            if old is None:
                return None
            self.release(old)
        sh = self._shadows[s.request_id] = _Shadow(s.request_id, s.n_prompt,
                                                   self._free_slots.pop())
        return sh

    def release(self, request_id: str) -> None:
        sh = self._shadows.pop(request_id, None)
        if sh is None:
            return
        self.pool.manager.free(sh)
        sh.n_computed = 0
        self._free_slots.append(sh.slot)

    def _reserve(self, sh: _Shadow, end: int, busy: set) -> bool:
        """Blocks for positions < end (evicting idle shadows when the pool is short)."""
        m = self.pool.manager
        while not m.allocate_for(sh, end - sh.n_computed):
            old = next((r for r in self._shadows if r not in busy), None)
            if old is None:
                return False
            self.release(old)
        return True

    # --- proposals
    def propose(self, seqs, ks) -> list[list[int]]:
        t0 = time.perf_counter()
        try:
            return self._propose(seqs, ks)
        finally:
            self.seconds += time.perf_counter() - t0

    def _propose(self, seqs, ks) -> list[list[int]]:
        outs: list[list[int]] = [[] for _ in seqs]
        busy = {s.request_id for s in seqs}
        act = []  # [index, shadow, k]
        for i, (s, k) in enumerate(zip(seqs, ks)):
            if k <= 0:
                continue
            sh = self._shadow(s, busy)
            if sh is None:
                continue
            toks = s.tokens
            # the longest common prefix of what the draft computed and the tokens now, less
            # at least the last token (its logits give the first guess)
            n = min(sh.n_computed, len(toks) - 1)
            lcp = 0
            a = sh.tokens
            while lcp < n and a[lcp] == toks[lcp]:
                lcp += 1
            if sh.n_computed > lcp:
                self.pool.rollback(sh, sh.n_computed - lcp)
            sh.tokens = list(toks)
            if sh.n_prompt != s.n_prompt:  # the id came back with another prompt
                self.pool.rollback(sh, sh.n_computed)
                sh.n_prompt = s.n_prompt
            # K/V for the pending tokens and every guess but the last
            if not self._reserve(sh, len(toks) + k - 1, busy) and \
                    not self._reserve(sh, len(toks), busy):
                continue
            k = min(k, len(sh.block_table) * self.pool.block_size - len(toks) + 1)
            act.append([i, sh, k])
        if not act:
            return outs
        self._prefill([sh for _, sh, _ in act])
        while act:
            # decode rows: every active shadow's pending tokens (its catch-up run, then one
            # guess per step), at most n_batch rows per forward
            seqs_, ns, room, wants = [], [], self.n_batch, []
            for a in act:
                sh = a[1]
                n = min(len(sh.tokens) - sh.n_computed, max(room, 1))
                if room <= 0:
                    break
                seqs_.append(sh)
                ns.append(n)
                room -= n
                wants.append(a if sh.n_computed + n == len(sh.tokens) else None)
            logits = self._run(Scheduled(seqs_, ns, True))
            r = 0
            done = []
            for a in wants:
                if a is None:
                    continue
                i, sh, k = a
                row = logits[r]
                r += 1
                tok = int(np.argmax(row))
                if self.p_min > 0.0:
                    # the draft's probability of its own token: 1 / sum(exp(l - max))
                    p = 1.0 / float(np.exp(row - row[tok], dtype=np.float64).sum())
                    if p < self.p_min:
                        done.append(a)
                        continue
                outs[i].append(tok)
                sh.tokens.append(tok)
                if len(outs[i]) >= k or tok in self.eog:
                    done.append(a)
            act = [a for a in act if not any(a is d for d in done)]
        return outs

    def _prefill(self, shadows) -> None:
        """Prompt positions the shadows miss, with the prefill kernels (no logits wanted:
        every shadow has generated tokens after its prompt)."""
        todo = [sh for sh in shadows if sh.n_computed < sh.n_prompt]
        while todo:
            self._run(Scheduled(*pack_prompt_chunks(todo, self.n_batch), False))
            todo = [sh for sh in todo if sh.n_computed < sh.n_prompt]

    def _run(self, sched: Scheduled) -> np.ndarray:
        logits = self.runner.run(sched)
        self.n_forwards += 1
        for sh, n in zip(sched.seqs, sched.n_tokens):
            self.pool.manager.commit(sh, n)
        return logits

    # --- bookkeeping
    @property
    def n_shadows(self) -> int:
        return len(self._shadows)

    def close(self) -> None:
        """Free every shadow, close the draft's file (when it opened it), free its bookings."""
        for rid in list(self._shadows):
            self.release(rid)
        f, self.model.file = getattr(self.model, "file", None), None
        if f is not None:
            f.close()
        if self.ledger is not None:
            for cat, nm in self._booked:
                self.ledger.free(cat, nm)
        self._booked = []


class _OwnedWeights:
    """Every tensor of a GGUF read once into a buffer of its own (the draft is pinned whole:
    its reads never compete with the target's streaming)."""

    wants_expert_prediction = False

    def decode_step(self, seconds: float, rows: int) -> None:
        """Nothing to decide: no look-ahead here."""
    expert_batch_limit = 0

    def __init__(self, gguf_file):
        from ..ops import QTensor
        self.file = gguf_file
        self._t: dict[str, object] = {}
        self.nbytes = 0
        # read with pread, not through the file's mapping: no mapped pages stay resident
        fhs = [open(p, "rb", buffering=0) for p in gguf_file.paths]
        try:
            for name, t in gguf_file.tensors.items():
                buf = np.empty(t.nbytes, np.uint8)
                fh = fhs[t.file_index]
                fh.seek(t.offset)
                got = fh.readinto(memoryview(buf))
                if got != t.nbytes:
                    raise RequestError(f"{gguf_file.paths[t.file_index]}: tensor {name} is cut "
                                       f"short ({got} of {t.nbytes} bytes)")
                self._t[name] = QTensor(name, t.type, t.shape, buf)
                self.nbytes += buf.nbytes
        finally:
            for fh in fhs:
                fh.close()

    def has(self, name: str) -> bool:
        return name in self._t

    def info(self, name: str):
        t = self.file.tensors[name]
        return t.shape, t.type

    def get(self, name: str):
        return self._t[name]

    def get_experts(self, il, experts):
        from ..models.weights import expert_views
        return expert_views(self, il, experts)

    def prefetch_experts(self, il, experts) -> None:
        pass

    def experts_in_place(self, il):
        return tuple(self.get(f"blk.{il}.ffn_{m}_exps.weight") for m in ("gate", "up", "down"))


def _token_list(md: dict) -> list:
    return list(md.get("tokenizer.ggml.tokens") or [])


def check_vocab(target_md: dict, target_nv: int, draft_md: dict, draft_nv: int,
                draft_name: str) -> None:
    """Refuse a draft whose vocabulary is not the target's (size, then a sample of texts)."""
    if draft_nv != target_nv:
        raise RequestError(f"--model-draft {draft_name}: its vocabulary has {draft_nv} tokens, "
                           f"the model's {target_nv}; a draft needs the same vocabulary")
    a, b = _token_list(target_md), _token_list(draft_md)
    if len(a) != len(b):
        raise RequestError(f"--model-draft {draft_name}: its tokenizer lists {len(b)} tokens, "
                           f"the model's {len(a)}; a draft needs the same vocabulary")
    if a:
        ids = sorted(set(np.linspace(0, len(a) - 1, min(len(a), 256)).astype(int).tolist()))
        bad = next((i for i in ids if a[i] != b[i]), None)
        if bad is not None:
            raise RequestError(f"--model-draft {draft_name}: token {bad} is {b[bad]!r} there but "
                               f"{a[bad]!r} in the model; a draft needs the same vocabulary")


def load_draft(source, target, tokenizer, target_metadata: dict, *, n_ctx: int,
               n_parallel: int = 1, n_batch: int = 512, ledger=None,
               cache_type: str | None = None, ops=None, scratch: int | None = None
               ) -> DraftProposer:
    """A DraftProposer for a GGUF (a path, or an open GGUFFile its caller closes), checked
    against the target model (a loaded models.Model, its tokenizer and its file's metadata);
    with a ledger its weights are read into memory and booked (resident_weights/draft_weights),
    its scratch (scratch/draft_model: ``scratch`` bytes, the plan's figure) and KV pool too."""
    from ..gguf import open_gguf
    from ..models import config_from_gguf, load_model
    opened = open_gguf(source) if isinstance(source, (str, os.PathLike)) else None
    f = opened or source
    try:
        cfg = config_from_gguf(f, check=True)
        check_vocab(target_metadata, target.config.n_vocab, f.metadata, cfg.n_vocab,
                    Path(f.paths[0]).name)
        owned = []
        weights = None
        if ledger is not None:
            weights = _OwnedWeights(f)
            owned.append(("resident_weights", "draft_weights", weights.nbytes))
            owned.append(("scratch", "draft_model", scratch if scratch is not None
                          else draft_scratch_bytes(f, n_batch, n_ctx, n_parallel)))
        model = load_model(f, weights=weights, ops=ops if ops is not None else target.ops)
        model.kv_f16 = getattr(target, "kv_f16", True)
        model.file = opened
        return DraftProposer(model, n_ctx=n_ctx, n_parallel=n_parallel, n_batch=n_batch,
                             ledger=ledger, cache_type=cache_type,
                             eog_ids=getattr(tokenizer, "eog_ids", ()), owned=owned)
    except BaseException:
        if opened is not None:
            opened.close()
        raise


def draft_scratch_bytes(f, n_batch: int, n_ctx: int, n_parallel: int = 1) -> int:
    """The draft forward's activations and logits (the planner's estimate for its shape): it
    samples one row per sequence and never scores or tokenizes."""
    from ..memory.planner import ModelDesc, scratch_bytes
    return scratch_bytes(ModelDesc.from_gguf(f), n_batch, n_ctx, os.cpu_count() or 1,
                         sample_rows=n_parallel, scoring=False)
