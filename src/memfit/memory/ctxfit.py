"""Context size against a budget: the KV cache competes with the weights for the same bytes.

Under a budget a default context of 4096 can take the room the weights needed, turning a
model that would run from memory into one streamed from disk every token (SmolLM2 at
300 MiB: 58 MiB/token, ~4.5 instead of ~37 tok/s). ``fit_context`` is the one rule every
command uses (runtime.Runtime plans run, chat, bench, serve and plan): a context the user
set is kept; otherwise the largest one up to the default that keeps every weight resident,
else (weights stream at any context) the largest that streams at most 25% more per token
than context 512. ``explain_streaming`` says why weights stream and what would avoid it.
Both only call ``plan_at(n_ctx, **kv) -> Plan``, the pure planner on one model description.
"""

from __future__ import annotations

from ..errors import BudgetError, RequestError

STEP = 256          # contexts tried are multiples of this (the KV block size divides it)
MIN_FIT_CTX = 256   # below this a lowered context is not worth it: stream, or refuse
STREAM_REF_CTX = 512  # streaming anyway: contexts are compared with this one's disk bytes
STREAM_SLACK = 0.25   # ... and may stream this much more per token


def train_ctx(f) -> int:
    """The model's training context (GGUF <arch>.context_length), 4096 when absent."""
    return int(f.metadata.get(f"{f.arch}.context_length", 0) or 4096)


def default_ctx(f, limit: int = 0) -> int:
    """The context when the user sets none: min(training context, 4096, the architecture's
    limit when it has one)."""
    return min(train_ctx(f), 4096, limit or 4096)


def check_ctx(f, n_ctx: int | None, limit: int = 0, why: str = "") -> None:
    """Refuse a context above the training context (or the architecture's own ``limit``,
    because ``why``) before the planner sizes its KV cache."""
    t = train_ctx(f)
    if n_ctx is not None and int(n_ctx) > t:
        raise RequestError(f"context size {n_ctx} exceeds the model's training context {t}; "
                           f"use --ctx-size {t} or less")
    if n_ctx is not None and limit and int(n_ctx) > limit:
        raise RequestError(f"context size {n_ctx} is above {limit}: {why}; use --ctx-size "
                           f"{limit} or less")


def _plan_or_none(plan_at, n_ctx, **kv):
    try:
        return plan_at(n_ctx, **kv)
    except BudgetError:
        return None


def _is_resident(p) -> bool:
    return p is not None and not p.tiers["file"] and not p.tiers["cache"]


def _largest(ok, hi: int) -> int | None:
    """The largest c in {hi} + {k * STEP < hi} with ok(c), for ok monotone (true up to some
    context, false above): bisect."""
    if ok(hi):
        return hi
    lo_k, hi_k, best = 1, (hi - 1) // STEP, None
    while lo_k <= hi_k:
        mid = (lo_k + hi_k) // 2
        if ok(mid * STEP):
            best, lo_k = mid * STEP, mid + 1
        else:
            hi_k = mid - 1
    return best


def largest_resident_ctx(plan_at, hi: int, **kv) -> int | None:
    """The largest context <= hi (a multiple of STEP, or hi itself) whose plan keeps every
    weight resident, or None. Residency only gets easier as the context shrinks."""
    return _largest(lambda c: _is_resident(_plan_or_none(plan_at, c, **kv)), hi)


def fit_context(plan_at, default: int, n_ctx: int | None = None) -> tuple[int, str | None]:
    """(context, note or None) for a load: n_ctx when the user set it; else the default when
    its plan keeps every weight resident, else the largest resident context >= MIN_FIT_CTX.
    Else the weights stream at every context: the largest context up to the default that
    streams at most STREAM_SLACK more per token than STREAM_REF_CTX does (a context that only
    costs speed is not chosen for the user), or, where the budget does not hold
    STREAM_REF_CTX, the largest it holds >= MIN_FIT_CTX; below the floor even there, the
    BudgetError at MIN_FIT_CTX."""
    if n_ctx is not None:
        return int(n_ctx), None
    p = _plan_or_none(plan_at, default)
    if _is_resident(p) or default <= MIN_FIT_CTX:
        return default, None
    c = largest_resident_ctx(plan_at, default)
    if c is not None and c >= MIN_FIT_CTX:
        return c, (f"context {c} (not the default {default}): the largest that keeps every "
                   f"weight resident within the budget; a larger --ctx-size streams weights "
                   f"from disk")
    fits = lambda c: _plan_or_none(plan_at, c) is not None  # noqa: E731
    ref = _plan_or_none(plan_at, min(STREAM_REF_CTX, default))
    if ref is None:
        c = _largest(fits, min(STREAM_REF_CTX, default))
        if c is None or c < MIN_FIT_CTX:
            plan_at(MIN_FIT_CTX)  # raises: the floor at the smallest context tried
    else:
        bound = ref.disk_bytes_per_token * (1 + STREAM_SLACK)
        c = _largest(lambda c: fits(c) and plan_at(c).disk_bytes_per_token <= bound, default)
    if c == default:
        return c, None
    most = _largest(fits, default)
    if c == most:
        return c, (f"context {c} (not the default {default}): the largest this budget holds; "
                   f"weights stream at every context")
    return c, (f"context {c} (not the default {default}): weights stream at every context "
               f"this budget holds, and a larger one streams more per token (--ctx-size up "
               f"to {most} fits, slower)")


def explain_streaming(plan_at, plan, budget) -> str:
    """Why a plan streams weights, and what would keep them resident."""
    c = plan.n_ctx
    why = (f"streaming {plan.disk_bytes_per_token / 2**20:.0f} MiB of weights per token from the "
           f"file: the budget {budget / 2**20:.0f} MiB holds the runtime, scratch and the KV cache "
           f"for context {c} ({plan.kv_bytes / 2**20:.0f} MiB) but not all the weights")
    fixes = []
    smaller = largest_resident_ctx(plan_at, c) if c > STEP else None
    if smaller:
        fixes.append(f"--ctx-size {smaller}")
    if plan.cache_type_k == "f16" and _is_resident(
            _plan_or_none(plan_at, c, cache_type_k="q8_0", cache_type_v="q8_0")):
        fixes.append("a q8_0 KV cache (--cache-type-k q8_0 --cache-type-v q8_0)")
    if not fixes:
        return why + "; the weights alone do not fit: raise --mem-budget to keep them resident"
    return why + "; to keep them resident use " + " or ".join(fixes) + ", or raise --mem-budget"


__all__ = ["check_ctx", "default_ctx", "explain_streaming", "fit_context",
           "largest_resident_ctx", "train_ctx", "MIN_FIT_CTX", "STEP"]
