"""How many proposed tokens to verify, decided from measurements of this run.

A verify pass of w rows costs ``cost(w)`` seconds: measured per width (an exponential moving
average of the decode steps' forward time by their row count), and before a width is measured,
a line through what is known: ``cost(1) * (1 + slope * (w - 1))``, where the slope (the cost of
one more row relative to a whole decode token) starts from the prefill's measured time per row
over the decode's time per token. That single number is what separates the cases: a model
whose weights stream from disk pays its reads once per forward (slope ~0.02-0.05: deep drafts
are nearly free), a small resident model pays each row's compute (slope ~0.1-0.5), and a
mixture-of-experts model pays for the union of the experts its rows route to (measured, as the
widths are used).

With a per-token acceptance rate a (accepted / (accepted + rejections), per proposer, with a
prior until measured), k proposed tokens yield E(k) = (1 - a^(k+1)) / (1 - a) tokens per pass.
For each sequence the policy picks the k (up to the proposal's length and ``draft_max``) that
maximises the step's tokens per second, and speculates only when that beats k = 0 by a margin
(``auto``) or whenever a proposal exists (an explicit mode, as llama.cpp). Widths never tried
are tried once in a while (1 step in ``explore``) so that a curve that is better than its prior
gets found.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

MODES = ("off", "ngram", "draft", "resident", "auto")


@dataclass
class SpecConfig:
    mode: str = "auto"
    draft_max: int = 16       # llama.cpp --draft-max (its default 16)
    draft_min: int = 0        # llama.cpp --draft-min: fewer proposed tokens are not verified
    ngram_min: int = 2
    ngram_max: int = 4
    margin: float = 0.05      # auto: predicted gain needed before speculating

    def __post_init__(self) -> None:
        from ..errors import RequestError
        if self.mode not in MODES:
            raise RequestError(f"--spec {self.mode!r}: choose one of {', '.join(MODES)}")
        for name in ("draft_max", "draft_min"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v > 256:
                raise RequestError(f"--{name.replace('_', '-')} {v!r}: use an integer in 0..256")
        if self.draft_min > self.draft_max:
            raise RequestError(f"--draft-min {self.draft_min} is above --draft-max {self.draft_max}")


@dataclass
class ProposerStats:
    drafts: int = 0       # verify passes that carried a proposal
    proposed: int = 0     # proposed tokens verified
    accepted: int = 0     # of them accepted
    rejections: int = 0   # passes that ended on a rejected token

    def to_dict(self) -> dict:
        return {"drafts": self.drafts, "proposed": self.proposed, "accepted": self.accepted,
                "acceptance_rate": round(self.accepted / self.proposed, 4) if self.proposed else None,
                "mean_accepted": round(self.accepted / self.drafts, 3) if self.drafts else None}


@dataclass
class SpecStats:
    by: dict = field(default_factory=dict)   # proposer name -> ProposerStats

    def of(self, name: str) -> ProposerStats:
        st = self.by.get(name)
        if st is None:
            st = self.by[name] = ProposerStats()
        return st

    def to_dict(self) -> dict:
        return {k: v.to_dict() for k, v in self.by.items()}

    def totals(self) -> ProposerStats:
        t = ProposerStats()
        for v in self.by.values():
            t.drafts += v.drafts
            t.proposed += v.proposed
            t.accepted += v.accepted
            t.rejections += v.rejections
        return t


class CostModel:
    """Seconds per decode forward of w rows: measured widths, else a line from cost(1)."""

    ALPHA = 0.25

    def __init__(self, slope: float | None = None):
        self.t: dict[int, float] = {}     # width -> EMA seconds
        self.slope_hint = slope           # given (plan) or measured from prefill
        self._pf_row = None               # EMA prefill seconds per row

    def observe(self, width: int, seconds: float) -> None:
        if width <= 0 or not seconds > 0:
            return
        old = self.t.get(width)
        self.t[width] = seconds if old is None else old + self.ALPHA * (seconds - old)

    def observe_prefill(self, rows: int, seconds: float) -> None:
        if rows >= 8 and seconds > 0:  # short chunks are dominated by the weights' read
            per = seconds / rows
            old = self._pf_row
            self._pf_row = per if old is None else old + self.ALPHA * (per - old)

    def slope(self) -> float:
        t1 = self.t.get(1)
        if t1 and self._pf_row:  # measured: the prefill's time per row over a decode token's
            return min(1.0, self._pf_row / t1)
        if self.slope_hint is not None:
            return self.slope_hint
        return 1.0  # nothing known: no row is assumed free

    def cost(self, w: int) -> float:
        if w in self.t:
            return self.t[w]
        t1 = self.t.get(1)
        if t1 is None:
            return float(w)
        below = [x for x in self.t if x < w]
        above = [x for x in self.t if x > w]
        if below and above:  # interpolate between measured widths
            a, b = max(below), min(above)
            return self.t[a] + (self.t[b] - self.t[a]) * (w - a) / (b - a)
        a = max(below) if below else 1
        return self.t[a] + t1 * self.slope() * (w - a)


# one more decode row's compute, in units of the time one token's weights take to read from
# memory: measured with `memfit bench --spec` on SmolLM2 and Gemma resident (AMD EPYC Zen 4,
# 2 threads; BENCHMARKS.md "Speculative decoding"); the run replaces it with its own measurement
ROW_COMPUTE = 0.6


def _union(n: int, k: int, w: int) -> float:
    """Expected distinct experts w rows route to, k of n each (uniform routing)."""
    return n * (1.0 - (1.0 - k / n) ** w) if n and k else 0.0


def predicted_cost(plan, w: int) -> float:
    """A verify pass of w rows in tokens' time, before anything is measured: the token's
    memory time, plus ROW_COMPUTE x that per extra row, plus its disk time -- for a
    mixture-of-experts model whose experts stream, the disk time grows with the union of the
    experts the w rows route to (uniform routing: n (1 - (1 - k/n)^w) of n experts), which is
    why speculation rarely pays there."""
    bw = plan.bandwidth
    t_mem = plan.mem_bytes_per_token / bw.mem_read_bytes_per_s
    t_disk = plan.disk_bytes_per_token / bw.disk_read_bytes_per_s
    t1 = 1.0 / plan.predicted_tg_tokens_per_s if plan.predicted_tg_tokens_per_s > 0 \
        else t_mem + t_disk
    grow = 1.0
    if plan.n_expert and plan.n_expert_used and t_disk > 0:
        grow = _union(plan.n_expert, plan.n_expert_used, w) / plan.n_expert_used
    return (t1 + ROW_COMPUTE * t_mem * (w - 1) + t_disk * (grow - 1.0)) / t1


def predicted_slope(plan) -> float:
    """The verify-cost slope a plan predicts before anything is measured (per extra row, in
    tokens): from predicted_cost over 8 rows."""
    return min(1.0, (predicted_cost(plan, 8) - 1.0) / 7.0)


def format_cost_model(plan, widths=(1, 4, 8, 16, 24)) -> str:
    """`memfit plan`'s line: the predicted verify cost per width relative to one token."""
    pts = ", ".join(f"{w} rows {predicted_cost(plan, w):.2f}x" for w in widths[1:])
    return (f"speculation: a verify pass of w rows is predicted to cost {pts} one token; the "
            f"run measures its own curve and speculates where accepted tokens pay for it")


def expected_tokens(a: float, k: int) -> float:
    """Tokens one verify pass yields with k proposed tokens and per-token acceptance a."""
    if k <= 0:
        return 1.0
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class Speculator:
    """The engine's side of speculation: proposals per step, the policy, the statistics."""

    PRIOR = {"ngram": 0.5, "draft": 0.6, "resident": 0.3, "oracle": 0.9}
    EXPLORE = 16

    def __init__(self, config: SpecConfig, proposers: list | None = None,
                 cost: CostModel | None = None):
        from .proposers import NGramProposer
        self.config = config
        if proposers is None:
            proposers = []
            if config.mode in ("ngram", "auto"):
                proposers.append(NGramProposer(config.ngram_min, config.ngram_max))
        self.proposers = proposers
        self.cost = cost or CostModel()
        self.stats = SpecStats()
        self._steps = 0
        self._ptime: dict[str, float] = {}  # proposer -> seconds per proposed token (EMA)

    @property
    def enabled(self) -> bool:
        return self.config.mode != "off" and bool(self.proposers) and self.config.draft_max > 0

    def acceptance(self, name: str) -> float:
        st = self.stats.by.get(name)
        prior = self.PRIOR.get(name, 0.5)
        if st is None or st.proposed == 0:
            return prior
        # a few pseudo-observations of the prior keep the first passes from deciding alone
        acc, rej = st.accepted + 2 * prior, st.rejections + 2 * (1 - prior)
        return acc / (acc + rej)

    def plan_step(self, seqs, caps) -> list:
        """Proposals for this decode step: [(sequence, proposer name, tokens)]; ``caps[i]`` is
        the most tokens seqs[i] may have proposed (max_tokens, context, n_batch). Proposers
        are asked in order (n-gram first: free) for the sequences still without a proposal,
        each for at most the length the policy would verify if it were all there (a draft
        model's forwards are not spent on tokens that would be cut)."""
        if not self.enabled or not seqs:
            return []
        self._steps += 1
        cfg = self.config
        lo = max(cfg.draft_min, 1)
        cands = [(s, min(cfg.draft_max, c)) for s, c in zip(seqs, caps)]
        cands = [(s, w) for s, w in cands if w >= lo]
        if not cands:
            return []
        explore = self._steps % self.EXPLORE == 0
        out = {}  # id(sequence) -> (sequence, proposer, tokens)
        for p in self.proposers:
            todo = []
            for s, w in cands:
                if id(s) in out:
                    continue
                k = w if cfg.mode != "auto" or explore else \
                    self._best_k(p.name, len(seqs), float(len(seqs)), w)
                if k >= lo:
                    todo.append((s, k))
            if not todo:
                continue
            t0 = time.perf_counter()
            drafts = p.propose([s for s, _ in todo], [k for _, k in todo])
            n = sum(len(d) for d in drafts)
            if n:
                per = (time.perf_counter() - t0) / n
                old = self._ptime.get(p.name)
                self._ptime[p.name] = per if old is None else old + 0.25 * (per - old)
            for (s, k), d in zip(todo, drafts):
                if len(d) >= lo:
                    out[id(s)] = (s, p.name, list(d[:k]))
        if not out:
            return []
        return self._choose(list(out.values()), len(seqs), explore)

    def _best_k(self, name: str, rows: int, tokens: float, n_max: int) -> int:
        """The proposal length (0..n_max) that maximises the step's tokens per second: a pass
        yields E(k) tokens for this sequence and costs cost(rows + k) plus the proposer's
        time for k tokens; auto wants a margin over k = 0."""
        cfg = self.config
        a = self.acceptance(name)
        tp = self._ptime.get(name, 0.0)
        best_k, best = 0, tokens / self.cost.cost(rows)
        need = 1.0 + (cfg.margin if cfg.mode == "auto" else 0.0)
        for k in range(max(cfg.draft_min, 1), n_max + 1):
            r = (tokens - 1 + expected_tokens(a, k)) / (self.cost.cost(rows + k) + tp * k)
            if r > best * need:
                best_k, best = k, r
        return best_k

    def _choose(self, props: list, n_rows: int, explore: bool = False) -> list:
        """The policy: each proposal cut to the length that maximises the step's tokens/s."""
        cfg = self.config
        rows, tokens, chosen = n_rows, float(n_rows), []
        for s, name, d in props:
            best_k = self._best_k(name, rows, tokens, len(d))
            if best_k == 0 and cfg.mode != "auto":
                best_k = len(d)   # an explicit mode verifies what was proposed
            if best_k == 0 and explore:
                unseen = [k for k in range(1, len(d) + 1) if rows + k not in self.cost.t]
                best_k = unseen[0] if unseen else 0
            if best_k >= max(cfg.draft_min, 1):
                chosen.append((s, name, d[:best_k]))
                rows += best_k
                tokens += expected_tokens(self.acceptance(name), best_k) - 1
        return chosen

    def record(self, name: str, proposed: int, accepted: int) -> None:
        st = self.stats.of(name)
        st.drafts += 1
        st.proposed += proposed
        st.accepted += accepted
        st.rejections += accepted < proposed

    def release(self, request_id: str) -> None:
        for p in self.proposers:
            p.release(request_id)

    def summary(self) -> dict:
        t = self.stats.totals()
        d = {"mode": self.config.mode, "draft_max": self.config.draft_max,
             "draft_min": self.config.draft_min, **t.to_dict(),
             "proposers": self.stats.to_dict()}
        return d


def format_stats(summary: dict) -> str:
    """One line for run/bench summaries."""
    if not summary or not summary.get("proposed"):
        return f"spec {summary.get('mode', 'off') if summary else 'off'}: nothing proposed"
    parts = []
    for name, st in summary["proposers"].items():
        parts.append(f"{name} {st['accepted']}/{st['proposed']} accepted "
                     f"({100 * (st['acceptance_rate'] or 0):.0f}%, {st['mean_accepted']} per pass, "
                     f"{st['drafts']} passes)")
    return "spec " + summary["mode"] + ": " + "; ".join(parts)
