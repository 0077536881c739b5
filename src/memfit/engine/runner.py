"""The runner: turns a scheduled step into the Batch arrays ``Model.forward`` takes (and
nothing else: no decisions). Index arrays are preallocated for the largest step."""

from __future__ import annotations

import numpy as np

from ..kv.pool import KVPool
from ..kv.view import BatchKV
from ..models.batch import Batch
from .scheduler import Scheduled


class Runner:
    def __init__(self, model, pool: KVPool, max_seqs: int, n_batch: int, n_ctx: int):
        self.model, self.pool = model, pool
        cap = max(n_batch, max_seqs)
        self._ids = np.zeros(cap, np.int64)
        self._pos = np.zeros(cap, np.int32)
        self._seq = np.zeros(cap, np.int32)
        self._slots = np.zeros(cap, np.int32)
        self._qtab = np.zeros(cap, np.int32)
        per_seq = (n_ctx + pool.block_size - 1) // pool.block_size + 1
        self._tables = np.zeros(max_seqs * per_seq, np.int32)
        self._all = np.arange(cap)
        # the sliding-window layers' group (kv/pool.py): its tables at the same offsets
        self._swa = pool.swa is not None
        if self._swa:
            self._stables = np.zeros_like(self._tables)
            self._sslots = np.zeros(cap, np.int32)

    def run(self, sched: Scheduled) -> np.ndarray:
        """Logits f32 [rows, n_vocab] for the sequences of sched that sample this step (decode
        rows; a prefill chunk that reaches the end of its tokens), in sched's order; a
        sequence with a draft gets 1 + len(draft) rows (its last token and each proposed one)."""
        bs = self.pool.block_size
        n = t = 0
        out = []
        for s, k in zip(sched.seqs, sched.n_tokens):
            p0, tab = s.n_computed, s.block_table
            ids = s.tokens[p0:p0 + k]
            if len(ids) < k:  # the proposed tokens follow the last one
                ids = ids + s.draft[:k - len(ids)]
            self._tables[t:t + len(tab)] = tab
            p = np.arange(p0, p0 + k, dtype=np.int32)
            self._ids[n:n + k] = ids
            self._pos[n:n + k] = p
            self._seq[n:n + k] = s.slot
            self._slots[n:n + k] = self._tables[t + p // bs] * bs + p % bs
            self._qtab[n:n + k] = t
            if self._swa:  # a given-back block (-1) reads as block 0: before every window
                st = self._stables[t:t + len(tab)]
                st[:] = 0
                st[:len(s.swa_table)] = s.swa_table
                np.maximum(st, 0, out=st)
                self._sslots[n:n + k] = st[p // bs] * bs + p % bs
            if s.draft:  # the last token and each proposed one: a logits row each
                out.extend(range(n + k - 1 - len(s.draft), n + k))
            elif p0 + k == len(s.tokens):
                out.append(n + k - 1)
            n += k
            t += len(tab)
        swa = (self.pool.swa_layers, self._sslots[:n], self._stables[:t]) if self._swa else None
        kv = BatchKV(self.pool.k, self.pool.v, self.pool.kv_type, self._pos[:n], self._slots[:n],
                     self._qtab[:n], self._tables[:t], bs, kv_type_v=self.pool.kv_type_v,
                     v_in_k=self.pool.v_in_k, aux=self.pool.aux, swa=swa)
        rows = self._all[:n] if len(out) == n else np.asarray(out, np.int64)
        batch = Batch(self._ids[:n], self._pos[:n], self._seq[:n], rows, kv,
                      decode=sched.decode)
        return self.model.forward(batch)
