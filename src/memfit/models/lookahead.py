"""Which experts layer l+1 will route to, predicted while layer l runs (the expert cache's
prefetch hint under a budget).

The plain look-ahead applies layer l+1's router to layer l's FFN input, an approximation of
layer l+1's real router input; its error is systematic, and on routers with persistent
preferences it loses to "the experts the previous token used" (issue 17 item 17). Both are
combined here: the previous token's real router logits at layer l+1, plus how much the
look-ahead's logits moved since that token,

    predicted_t = real_{t-1} + (look_t - look_{t-1}),

so the look-ahead's error, which persists from token to token, cancels, and what is left is
the change the hidden state brings. A row whose sequence has no state for the position just
before (its first token, a prompt row, a slot taken over by another request) falls back to
the look-ahead alone. Measured recall on `memfit synth --arch qwen3moe --size tiny` files
(64 sampled tokens, synthetic weights and routing): uniform routing 0.81 (look-ahead 0.72,
previous token 0.56), skew 1 0.93 (0.61, 0.90), skew 2 0.997 (0.82, 0.996).

State per (layer, sequence slot): the position and the logits of its last row, two vectors of
n_expert floats each; top-k by logits is top-k by probability for softmax and sigmoid gating
alike."""

from __future__ import annotations

import numpy as np


class RouterLookahead:
    def __init__(self):
        self._real: dict[tuple[int, int], tuple[int, np.ndarray]] = {}
        self._look: dict[tuple[int, int], tuple[int, np.ndarray]] = {}

    @staticmethod
    def _last_rows(seq: np.ndarray) -> np.ndarray:
        """Index of the last row of each sequence slot among the rows."""
        _, first_rev = np.unique(seq[::-1], return_index=True)
        return len(seq) - 1 - first_rev

    def predict(self, layer: int, look: np.ndarray, seq: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Scores [n, n_expert] for layer ``layer`` from its look-ahead logits ``look`` [n,
        n_expert] of rows in sequence slots ``seq`` at positions ``pos``; records ``look``."""
        out = look
        if len(np.unique(seq)) == len(seq):  # one row per sequence (decode): the delta form
            out = look.copy()
            for i, (s, p) in enumerate(zip(seq.tolist(), pos.tolist())):
                real, prev = self._real.get((layer, s)), self._look.get((layer, s))
                if real is not None and prev is not None and real[0] == prev[0] == p - 1:
                    out[i] = real[1] + (look[i] - prev[1])
        for i in self._last_rows(seq).tolist():
            self._look[(layer, int(seq[i]))] = (int(pos[i]), look[i].copy())
        return out

    def observe(self, layer: int, logits: np.ndarray, seq: np.ndarray, pos: np.ndarray) -> None:
        """Layer ``layer``'s real router logits [n, n_expert] of the rows."""
        for i in self._last_rows(seq).tolist():
            self._real[(layer, int(seq[i]))] = (int(pos[i]), logits[i].copy())
