"""Teacher-forced logits of a token sequence, a few rows at a time (never [n, n_vocab] whole).

Row i is the model's output after ids[:i+1]. The sequence goes through the model in the
plan's n_batch pieces (scratch is sized for them); the final hidden states of the wanted rows
become logits LOGITS_SLICE_ROWS rows at a time, so a 262k vocabulary costs ~8 MiB, not 512 MiB.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np


def iter_logits(m, ids, first: int = 0) -> Iterator[tuple[int, np.ndarray]]:
    """Yield (row, logits f32 [rows, n_vocab]) for rows first..len(ids)-1 of ``ids`` run as one
    sequence from position 0 on ``m`` (a memfit.api.Model), in blocks of its engine's KV pool."""
    from ..kv.seq import SeqKV
    from ..memory.planner import LOGITS_SLICE_ROWS as rows
    n = len(ids)
    assert 0 <= first < n
    ids = np.asarray(ids, dtype=np.int32)
    hs = []
    with SeqKV(m.engine.pool, n) as cache:
        for b in range(0, n, m.n_batch):
            piece = ids[b:b + m.n_batch]
            if b + len(piece) <= first:
                m.model.forward(piece, cache)
            else:
                hs.append(m.model.forward(piece, cache, hidden_from=max(0, first - b)))
    h = np.concatenate(hs) if len(hs) > 1 else hs[0]
    for j in range(0, len(h), rows):
        yield first + j, m.model.logits(h[j:j + rows])


def log_softmax(lg: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 sums (as llama.cpp's double sum_exp), f32 out."""
    mx = lg.max(axis=1, keepdims=True)
    lse = np.log(np.exp(lg - mx, dtype=np.float64).sum(axis=1, keepdims=True))
    return (lg - mx - lse).astype(np.float32)
