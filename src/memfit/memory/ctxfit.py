"""Context size against a budget: the KV cache competes with the weights for the same bytes.

Under a budget a default context of 4096 can take the room the weights needed, turning a
model that would run from memory into one streamed from disk every token (SmolLM2 at
300 MiB: 58 MiB/token, ~4.5 instead of ~37 tok/s). When the user did not choose the context,
``fit_context`` picks the largest one up to the default that keeps every weight resident; when
they did, ``explain_streaming`` says why the weights stream and what would avoid it. Both
only call the planner (pure, ~40 ms a plan).
"""

from __future__ import annotations

from ..errors import BudgetError, RequestError

STEP = 256          # contexts tried are multiples of this (the KV block size divides it)
MIN_FIT_CTX = 256   # below this a lowered context is not worth it: stream instead


def train_ctx(f) -> int:
    """The model's training context (GGUF <arch>.context_length), 4096 when absent."""
    return int(f.metadata.get(f"{f.arch}.context_length", 0) or 4096)


def check_ctx(f, n_ctx: int | None) -> None:
    """Refuse a context above the training context before the planner sizes its KV cache."""
    t = train_ctx(f)
    if n_ctx is not None and int(n_ctx) > t:
        raise RequestError(f"context size {n_ctx} exceeds the model's training context {t}; "
                           f"use --ctx-size {t} or less")


def _resident(f, budget, n_ctx, threads, baseline, **kv):
    """The plan at n_ctx when it keeps every weight resident, else None; kv: the planner's
    KV keywords (n_parallel, cache_type_k, cache_type_v)."""
    from .planner import plan_for_path
    try:
        p = plan_for_path(f, budget, n_ctx=n_ctx, threads=threads, baseline_bytes=baseline, **kv)
    except BudgetError:
        return None
    return p if not p.tiers["file"] and not p.tiers["cache"] else None


def largest_resident_ctx(f, budget, hi, threads, baseline, **kv) -> int | None:
    """The largest context <= hi (a multiple of STEP, or hi itself) whose plan keeps every
    weight resident, or None. Residency only gets easier as the context shrinks: bisect."""
    if _resident(f, budget, hi, threads, baseline, **kv):
        return hi
    lo_k, hi_k = 0, (hi - 1) // STEP          # candidates k * STEP, k in [1, hi_k]
    best = None
    lo_k = 1
    while lo_k <= hi_k:
        mid = (lo_k + hi_k) // 2
        if _resident(f, budget, mid * STEP, threads, baseline, **kv):
            best, lo_k = mid * STEP, mid + 1
        else:
            hi_k = mid - 1
    return best


def fit_context(f, budget, threads, baseline, **kv) -> tuple[int | None, str | None]:
    """For a user who did not set the context: (context, note) when lowering it keeps the
    weights resident, else (None, None) (plan the default and stream)."""
    default = min(train_ctx(f), 4096)
    if _resident(f, budget, default, threads, baseline, **kv):
        return None, None
    c = largest_resident_ctx(f, budget, default, threads, baseline, **kv)
    if c is None or c < MIN_FIT_CTX:
        return None, None
    return c, (f"context {c} (not the default {default}): the largest that keeps every weight "
               f"resident within the budget; a larger --ctx-size streams weights from disk")


def explain_streaming(f, plan, budget, threads, baseline, **kv) -> str:
    """Why a plan streams weights, and what would keep them resident."""
    c = plan.n_ctx
    why = (f"streaming {plan.disk_bytes_per_token / 2**20:.0f} MiB of weights per token from the "
           f"file: the budget {budget / 2**20:.0f} MiB holds the runtime, scratch and the KV cache "
           f"for context {c} ({plan.kv_bytes / 2**20:.0f} MiB) but not all the weights")
    fixes = []
    smaller = largest_resident_ctx(f, budget, c, threads, baseline, **kv) if c > STEP else None
    if smaller:
        fixes.append(f"--ctx-size {smaller}")
    q8 = {**kv, "cache_type_k": "q8_0", "cache_type_v": "q8_0"}
    if plan.cache_type_k == "f16" and _resident(f, budget, c, threads, baseline, **q8):
        fixes.append("a q8_0 KV cache (--cache-type-k q8_0 --cache-type-v q8_0)")
    if not fixes:
        return why + "; the weights alone do not fit: raise --mem-budget to keep them resident"
    return why + "; to keep them resident use " + " or ".join(fixes) + ", or raise --mem-budget"


__all__ = ["check_ctx", "explain_streaming", "fit_context", "largest_resident_ctx", "train_ctx"]
