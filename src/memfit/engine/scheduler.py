"""The scheduler: who runs this step and with how many tokens, decided with integers only.

Policy: sequences are admitted in arrival order while a slot is free (at most ``max_seqs``
running) and the pool has blocks for the part of the prompt the prefix cache does not hold.
A step is either a prefill step (prompt chunks of the sequences still prefilling, in admission
order, at most ``n_batch`` tokens in all: a burst of prompts is prefilled in one forward) or
a decode step: the pending generated tokens of every sequence past its prefill (one sampled
token each, plus any tokens a grammar forced after it or a recomputed run, at most
``n_batch`` rows in all: a run that does not fit continues next step); the two alternate
while both kinds wait, so a long prompt does not stall the others. A decode row that needs a
new block when none is free preempts the most recently admitted other sequence: its blocks go
back to the pool (its full ones stay in the prefix cache) and it waits at the front of the
queue to be recomputed. With speculation (the ``propose`` hook), a decode step first lets
the sequences with one pending token take proposed tokens (``draft``), verified as extra decode
rows of that sequence in the same step; a draft is cut to the rows and blocks there are and
never preempts another sequence.

Sliding-window layers (gpt-oss, gemma3: kv/manager.py WindowBlocks): a step's rows take their
window blocks when the step is scheduled (the group is sized so that they always fit:
kv/storage.py kv_swa_pool_blocks), and a sequence gives back the blocks its window left when
its step is committed; a drafted sequence does so only after its verify has taken the
rejected rows back (engine.py _verify), so that rollback never needs a given-back block.

Batch invariance: every position of a sequence has one kind for its whole life. Prompt
positions are prompt rows (the prefill kernels), generated ones decode rows (the decode
kernels), whatever the step: a recomputed sequence feeds its generated tokens as decode rows
(a run of them in a decode step, beside other sequences' rows), a step never mixes the
kinds, and a block holding decode rows is keyed with where they start (kv/manager.py
block_key), so a new prompt never reuses K/V that a cold run would compute otherwise. The
kernels make a row independent of the others in its forward, so chunks of any size are
packed, and a sequence's tokens do not depend on what else runs, how its prompt was chunked
or what the prefix cache held.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..kv.pool import KVPool
from .sequence import Sequence, Status


@dataclass
class Scheduled:
    seqs: list[Sequence]
    n_tokens: list[int]    # tokens fed for each sequence this step
    decode: bool           # decode rows: generated tokens (one or a run per sequence)


def pack_prompt_chunks(seqs, n_batch: int) -> tuple[list, list[int]]:
    """The next prompt chunk of each of seqs in order, at most n_batch rows in all (a chunk
    ends at its prompt's end): (sequences, rows of each)."""
    out, ks, room = [], [], n_batch
    for s in seqs:
        k = min(room, s.n_prompt - s.n_computed)
        out.append(s)
        ks.append(k)
        room -= k
        if room == 0:
            break
    return out, ks


class Scheduler:
    def __init__(self, pool: KVPool, max_seqs: int, n_batch: int, n_ctx: int, pack: bool = True):
        self.pool, self.max_seqs, self.n_batch, self.n_ctx = pool, max_seqs, n_batch, n_ctx
        self.pack = pack  # prefill chunks of several sequences share a forward
        self.bs = pool.block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        self._last_prefill = False
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0     # of them found
        self.n_preempted = 0
        self.n_prefill_steps = 0   # prefill steps run
        self.n_prefill_chunks = 0  # prompt chunks they carried (> steps: chunks were packed)
        # speculative decoding: called in a decode step with (sequences that may draft, room
        # in rows); it sets their ``draft`` (engine.py), which this step then verifies
        self.propose = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- blocks
    def _admit(self, seq: Sequence) -> bool:
        """Give seq its cached prefix blocks and blocks for the rest of its tokens; False (and
        no change) when the pool cannot hold them now."""
        toks = seq.tokens
        # reuse whole cached blocks, but leave at least one token to compute (its logits)
        if not self.pool.manager.admit(seq, toks, n_prompt=seq.n_prompt):
            return False
        if not seq.admitted:
            seq.admitted = True
            seq.cache_n = seq.n_computed
            self.prefix_queries += len(toks)
            self.prefix_hits += seq.n_computed
        seq.slot = self._free_slots.pop()
        seq.status = Status.RUNNING
        return True

    def free(self, seq: Sequence) -> None:
        """Return seq's blocks and slot (finished, aborted or preempted)."""
        self.pool.manager.free(seq)
        if seq.slot >= 0:
            self._free_slots.append(seq.slot)
            seq.slot = -1
        if seq in self.running:
            self.running.remove(seq)

    def _preempt(self, keep: Sequence) -> bool:
        victims = [s for s in self.running if s is not keep]
        if not victims:
            return False
        v = victims[-1]
        self.free(v)
        v.n_computed = v.n_hashed = 0
        v.last_key = None
        v.draft = []
        v.status = Status.WAITING
        self.waiting.appendleft(v)
        self.n_preempted += 1
        return True

    # --- one step
    def schedule(self) -> Scheduled | None:
        while self.waiting and self._free_slots and self._admit(self.waiting[0]):
            self.running.append(self.waiting.popleft())
        if not self.running:
            return None
        # prompt rows still to compute (a one-token prompt too); else generated tokens: the
        # one sampled last step, the tokens a grammar forced after it, or a recomputed run
        prefill = [s for s in self.running if s.n_computed < s.n_prompt]
        decode = [s for s in self.running if s.n_computed >= s.n_prompt]
        if prefill and (not decode or not self._last_prefill):
            self._last_prefill = True
            # a chunk of prompt rows ends at the prompt's end (then decode rows follow)
            seqs, ks = pack_prompt_chunks(prefill if self.pack else prefill[:1], self.n_batch)
            for s, k in zip(seqs, ks):
                self._reserve_window(s, k)
            self.n_prefill_steps += 1
            self.n_prefill_chunks += len(seqs)
            return Scheduled(seqs, ks, False)
        self._last_prefill = False
        extra = max(self.n_batch, len(decode)) - len(decode)
        if self.propose is not None:
            room = extra - sum(s.n_pending - 1 for s in decode)
            ready = [s for s in decode if s.n_pending == 1]
            if ready and room > 0:
                self.propose(ready, room)
        # every sequence gets its next row; runs longer than one share the rest of n_batch
        # in admission order (the rows of a run that do not fit wait for the next step; a
        # draft is cut to what fits)
        ks = []
        for s in decode:
            k = 1 + min(s.n_pending - 1, extra)
            extra -= k - 1
            ks.append(k)
            if s.draft and s.n_computed + k < len(s.tokens) + len(s.draft):
                del s.draft[max(0, s.n_computed + k - len(s.tokens)):]
        # decode rows write positions n_computed.. n_computed + k - 1: their blocks must exist
        for i, (s, k) in enumerate(zip(decode, ks)):
            while s.status is Status.RUNNING and \
                    (s.n_computed + k - 1) // self.bs >= len(s.block_table):
                if self.pool.n_free > 0:
                    s.block_table.append(self.pool.allocate())
                elif s.draft:  # a guess never preempts anyone: cut it to the blocks there are
                    k = max(1, len(s.block_table) * self.bs - s.n_computed)
                    del s.draft[max(0, s.n_computed + k - len(s.tokens)):]
                    k = ks[i] = min(k, s.n_pending)
                elif not self._preempt(s):
                    raise AssertionError("one sequence outgrew the whole pool")
        run = [(s, k) for s, k in zip(decode, ks) if s.status is Status.RUNNING]
        for s, k in run:
            self._reserve_window(s, k)
        return Scheduled([s for s, _ in run], [k for _, k in run], True)

    def _reserve_window(self, s: Sequence, k: int) -> None:
        # the window layers' blocks of s's k rows (kv_swa_pool_blocks sizes the group for them)
        if not self.pool.reserve_window(s, k):
            raise AssertionError(f"the sliding-window KV group ({self.pool.n_swa_blocks} "
                                 f"blocks, {self.pool.n_swa_used} used) cannot hold a step of "
                                 f"{k} rows: it is smaller than kv_swa_pool_blocks")

    def after_step(self, sched: Scheduled) -> None:
        """Advance n_computed and key the blocks that became full (prefix cache)."""
        for s, k in zip(sched.seqs, sched.n_tokens):
            # a verified draft's blocks are keyed once the engine has taken back its rejected
            # rows (engine.py _verify): a block holding a rejected token is never keyed, and
            # its window blocks are given back only then
            self.pool.manager.commit(s, k, None if s.draft else s.tokens, n_prompt=s.n_prompt,
                                     slide=not s.draft)
