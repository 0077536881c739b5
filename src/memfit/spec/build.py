"""The Speculator a loaded runtime uses, from the user's SpecConfig (runtime.py calls it)."""

from __future__ import annotations

from ..errors import RequestError
from .policy import SpecConfig, Speculator
from .proposers import NGramProposer


def as_config(spec, draft_max: int | None = None, draft_min: int | None = None) -> SpecConfig:
    """SpecConfig from a mode string, a SpecConfig or None (off)."""
    if spec is None:
        spec = "off"
    if isinstance(spec, SpecConfig):
        cfg = spec
    elif isinstance(spec, str):
        kw = {}
        if draft_max is not None:
            kw["draft_max"] = draft_max
        if draft_min is not None:
            kw["draft_min"] = draft_min
        cfg = SpecConfig(mode=spec, **kw)
    else:
        raise RequestError(f"spec={spec!r}: give a mode (off, ngram, draft, resident, auto)")
    return cfg


def make_speculator(cfg: SpecConfig, *, model, tokenizer, draft=None,
                    resident=None, plan=None) -> Speculator | None:
    """The proposers for cfg.mode: ngram (prompt lookup), draft (``draft``: a loaded draft
    proposer, spec/draft.py), resident (``resident``: the budget's pinned layers as the draft,
    spec/resident.py), auto (ngram, then the draft model when one is loaded; never resident,
    whose measured acceptance does not pay: spec/resident.py)."""
    if cfg.mode == "off" or cfg.draft_max == 0:
        return None
    proposers = []
    if cfg.mode == "draft" and draft is None:
        raise RequestError("--spec draft needs a draft model: give --model-draft FILE (a GGUF "
                           "with the same vocabulary)")
    if cfg.mode in ("ngram", "auto"):  # first: free, and right where the text repeats
        proposers.append(NGramProposer(cfg.ngram_min, cfg.ngram_max))
    if cfg.mode in ("draft", "auto") and draft is not None:
        proposers.append(draft)
    if cfg.mode == "resident":
        if resident is None:
            raise RequestError("--spec resident needs a budget that streams part of a dense "
                               "model (--mem-budget); use ngram, draft or auto")
        proposers.append(resident)
    from .policy import CostModel, predicted_slope
    return Speculator(cfg, proposers,
                      CostModel(predicted_slope(plan) if plan is not None else None))
