"""Speculative decoding: proposers guess a sequence's next tokens, the engine verifies them in
one forward (as decode rows of that sequence), keeps the longest prefix the target agrees with
and takes the rest back out of the KV cache.

    spec = Speculator(SpecConfig(mode="ngram", draft_max=16))
    eng = Engine(model, tok, n_ctx, spec=spec)

Pieces:
  SpecConfig   what the user asked for: mode off | ngram | draft | resident | auto, draft_max,
               draft_min (llama.cpp's --draft-max / --draft-min)
  Proposer     proposes up to k tokens for a sequence from its tokens so far (proposers.py:
               NGramProposer; a draft model lives in draft.py when loaded)
  CostModel    verify cost per width (rows of a decode step), measured on this run
  Speculator   per step, which sequences draft how many tokens (the adaptive policy) and the
               statistics (proposed, accepted, per proposer)

Exactness: at each verified row the target draws its own token exactly as it would without
speculation (greedy: the argmax; sampling: the sampler's chain with one random draw per emitted
token, in order), and a proposal is accepted when it is that token. A decode row's logits do not
depend on the other rows of its forward (the kernels' batch invariance), so the output with
speculation is the output without it, token for token, greedy or seeded. For sampling this is
the standard rejection rule for a deterministic draft (q one-hot on the proposal d): d is
accepted with probability p(d) = min(1, p(d)/q(d)), and a rejected row yields a token drawn from
p conditioned on not being d, the normalised residual max(0, p - q); drawing the target's token
with the row's own uniform number (the coupling) gives both at once and keeps seeded runs
reproducible whatever the policy decided.
"""

from __future__ import annotations

from .policy import CostModel, SpecConfig, Speculator, SpecStats
from .proposers import NGramProposer, OracleProposer, Proposer

__all__ = ["CostModel", "NGramProposer", "OracleProposer", "Proposer", "SpecConfig", "SpecStats", "Speculator"]
