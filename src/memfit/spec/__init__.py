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

Exactness: greedy acceptance compares each proposed token with the target's argmax at the row
before it; a decode row's logits do not depend on the other rows of its forward (the kernels'
batch invariance), so greedy output with speculation equals greedy output without it, token for
token. With sampling, a proposal (a point mass: proposers are deterministic) is accepted with
probability p(token) under the sampler's final distribution, else the token is drawn from that
distribution with the proposal removed (the residual of Leviathan et al.'s rule for a one-hot
draft), so the output distribution is the target's (engine/sampler.py accept_or_resample).
"""

from __future__ import annotations

from .policy import CostModel, SpecConfig, Speculator, SpecStats
from .proposers import NGramProposer, Proposer

__all__ = ["CostModel", "NGramProposer", "Proposer", "SpecConfig", "SpecStats", "Speculator"]
