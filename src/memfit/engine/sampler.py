"""Token sampling as llama.cpp's default chain does it, plus stop strings and top logprobs.

Chain (llama.cpp common_sampler default order, without DRY/typical/XTC):
    penalties (repeat, frequency, presence over the last repeat_last_n tokens)
    -> top_k -> top_p -> min_p -> temperature -> draw
top_k/top_p/min_p see the untempered distribution, as in llama.cpp. temperature <= 0 is
greedy: argmax of the penalized logits.

    SamplingParams(...)                         validated in __post_init__ (RequestError)
    Sampler(params, n_vocab).sample(logits[n_vocab] f32, history: list[int]) -> int
    top_logprobs(logits, k) -> [[id, prob], ...]  full softmax of the raw logits
    StopMatcher(stops).push(text) -> (emit_text, stopped); .flush() -> held text
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import RequestError

# Before a full sort for top_p, try the best this many tokens: enough for nearly any nucleus.
_TOP_P_PREFIX = 512


@dataclass
class SamplingParams:
    """Defaults are llama.cpp's (llama-cli / llama-server, common_params_sampling):
    temp 0.8, top_k 40, top_p 0.95, min_p 0.05, repeat_penalty 1.0 (off) over the last 64
    tokens, presence/frequency 0 (off), a random seed, no token limit and no stop strings.

    top_k 0 = off; top_p 1 = off; min_p 0 = off; repeat_last_n 0 = off, -1 = whole history;
    seed None or -1 = random; max_tokens None or -1 = until end-of-generation/context full.
    logit_bias {token id: bias in [-100, 100]} is added to the logits before anything else
    (OpenAI's range; llama.cpp's order): -100 bans a token, +100 all but forces it. Keys may be
    ints or decimal strings (JSON object keys); the engine checks them against the vocabulary.
    presence/frequency are OpenAI's (logit -= count * frequency + (count > 0) * presence),
    counted over the same window as the repeat penalty (llama.cpp's penalty_last_n).
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    logit_bias: dict[int, float] | None = None
    draft_max: int | None = None  # speculative decoding: proposed tokens per step at most
                                  # (0: none; None: the engine's setting; spec/)

    def __post_init__(self) -> None:
        def number(name: str, lo: float, hi: float, lo_open: bool = False) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise RequestError(f"{name}={v!r} must be a finite number")
            if v < lo or v > hi or (lo_open and v == lo):
                rng = f"{'(' if lo_open else '['}{lo}, {hi}]"
                raise RequestError(f"{name}={v!r} is out of range; use a value in {rng}")
            return float(v)

        def integer(name: str, lo: int) -> int:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise RequestError(f"{name}={v!r} must be an integer")
            if v < lo:
                raise RequestError(f"{name}={v!r} must be >= {lo}")
            return int(v)

        self.temperature = number("temperature", -math.inf, math.inf)  # <= 0: greedy
        self.top_k = integer("top_k", 0)
        self.top_p = number("top_p", 0.0, 1.0, lo_open=True)
        self.min_p = number("min_p", 0.0, 1.0)
        self.repeat_penalty = number("repeat_penalty", 0.0, math.inf, lo_open=True)
        self.repeat_last_n = integer("repeat_last_n", -1)
        self.presence_penalty = number("presence_penalty", -2.0, 2.0)
        self.frequency_penalty = number("frequency_penalty", -2.0, 2.0)
        if self.seed is not None:
            self.seed = integer("seed", -1)
            if self.seed == -1:
                self.seed = None
        if self.max_tokens is not None:
            self.max_tokens = integer("max_tokens", -1)
            if self.max_tokens == -1:
                self.max_tokens = None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise RequestError(f"stop={self.stop!r}: every stop must be a non-empty string")
        if self.logit_bias is not None:
            self.logit_bias = _check_bias(self.logit_bias) or None
        if self.draft_max is not None:
            self.draft_max = integer("draft_max", 0)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def _check_bias(bias) -> dict[int, float]:
    if not isinstance(bias, dict):
        raise RequestError(f"logit_bias must be an object mapping token ids to numbers, got "
                           f"{type(bias).__name__}")
    out = {}
    for k, v in bias.items():
        if isinstance(k, str) and k.strip().lstrip("-").isdigit():
            k = int(k)
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
            raise RequestError(f"logit_bias key {k!r} must be a token id (an integer)")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or not -100 <= v <= 100:
            raise RequestError(f"logit_bias[{k}]={v!r} must be a number in [-100, 100]")
        out[int(k)] = float(v)
    return out


def prepare_logits(logits: np.ndarray, biases: list, masks: np.ndarray | None = None,
                   mask_rows: np.ndarray | None = None) -> None:
    """The batched step before per-row sampling, in place on logits f32 [rows, n_vocab]:
    each row's logit_bias (biases[r]: (ids int64, values f32) or None), then the grammar masks
    of the constrained rows in one vectorised call: masks int32 [len(mask_rows), words] of
    llguidance bits (bit t of word t // 32: token t allowed); a token not allowed gets -inf."""
    for r, b in enumerate(biases):
        if b is not None:
            logits[r, b[0]] += b[1]
    if masks is not None and len(mask_rows):
        nv = logits.shape[1]
        bits = np.unpackbits(masks.view(np.uint8), axis=1, count=nv, bitorder="little")
        sub = logits[mask_rows]
        np.putmask(sub, bits == 0, np.float32(-np.inf))
        logits[mask_rows] = sub


def _softmax64(x: np.ndarray) -> np.ndarray:
    """float64 probabilities; exp in float32 (fast over a whole vocab), sums in float64."""
    e = np.exp(x - np.max(x), dtype=np.float32)
    return e / e.sum(dtype=np.float64)


def _sort_desc(values: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """idx ordered by values[idx] descending; ties keep idx's order."""
    return idx[np.argsort(-values[idx], kind="stable")]


class Sampler:
    """One per sequence: holds the params and the random generator (seeded once)."""

    def __init__(self, params: SamplingParams, n_vocab: int):
        self.params = params
        self.n_vocab = n_vocab
        self.rng = np.random.default_rng(params.seed)

    def penalize(self, logits: np.ndarray, history) -> np.ndarray:
        """Logits after repeat/presence/frequency penalties (a copy when any applies)."""
        p = self.params
        n = len(history) if p.repeat_last_n == -1 else min(p.repeat_last_n, len(history))
        if n == 0 or (p.repeat_penalty == 1.0 and p.presence_penalty == 0.0
                      and p.frequency_penalty == 0.0):
            return logits
        window = np.asarray(history[len(history) - n:], dtype=np.int64)
        ids, counts = np.unique(window, return_counts=True)
        assert ids[0] >= 0 and ids[-1] < self.n_vocab, (ids[0], ids[-1], self.n_vocab)
        out = logits.copy()
        v = out[ids]
        # llama.cpp: shrink positive logits, grow negative ones (dividing would favour them)
        v = np.where(v <= 0, v * np.float32(p.repeat_penalty), v / np.float32(p.repeat_penalty))
        v -= (counts.astype(np.float32) * np.float32(p.frequency_penalty)
              + np.float32(p.presence_penalty))
        out[ids] = v
        return out

    def sample(self, logits: np.ndarray, history) -> int:
        """Next token id from logits[n_vocab] (float32) given all tokens so far."""
        p = self.params
        x = np.asarray(logits, dtype=np.float32)
        assert x.shape == (self.n_vocab,), (x.shape, self.n_vocab)
        x = self.penalize(x, history)
        if p.greedy:
            return int(np.argmax(x))
        ids, probs = self._distribution(x)
        cdf = np.cumsum(probs)
        i = int(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"))
        return int(ids[min(i, len(ids) - 1)])

    def _distribution(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The candidates and their probabilities after top_k, top_p, min_p and temperature
        (x: penalized logits)."""
        p = self.params
        if 0 < p.top_k < self.n_vocab:
            ids = np.sort(np.argpartition(-x, p.top_k - 1)[:p.top_k])
        else:
            ids = np.arange(self.n_vocab)
        if p.top_p < 1.0:
            ids = self._top_p(x, ids)
        if p.min_p > 0.0:
            # p_i >= min_p * p_max, done on logits as llama.cpp does
            lg = x[ids]
            ids = ids[lg >= lg.max() + np.float32(math.log(p.min_p))]
        return ids, _softmax64(x[ids] / np.float32(p.temperature))

    def _top_p(self, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The smallest most-probable prefix of ids whose probability reaches top_p, best first."""
        top_p = self.params.top_p
        lg = x[ids]
        probs = _softmax64(lg)
        # exact: if the best _TOP_P_PREFIX already reach top_p the rest is never needed
        pos = None
        if len(ids) > _TOP_P_PREFIX:
            pos = _sort_desc(lg, np.sort(np.argpartition(-lg, _TOP_P_PREFIX - 1)[:_TOP_P_PREFIX]))
            if probs[pos].sum() < top_p:
                pos = None
        if pos is None:
            pos = np.argsort(-lg, kind="stable")
        reached = np.cumsum(probs[pos]) >= top_p
        n_keep = int(np.argmax(reached)) + 1 if reached.any() else len(pos)
        return ids[pos[:n_keep]]


def top_logprobs(logits: np.ndarray, k: int) -> list[list]:
    """The k most probable [id, prob] of the full softmax of the raw logits (before any
    sampler: what llama-server returns for n_probs), most probable first, ties by lower id."""
    x = np.asarray(logits, dtype=np.float32).reshape(-1)
    k = min(int(k), x.size)
    if k <= 0:
        return []
    probs = _softmax64(x)
    part = np.sort(np.argpartition(-probs, k - 1)[:k]) if k < x.size else np.arange(x.size)
    order = part[np.argsort(-probs[part], kind="stable")]
    return [[int(i), float(probs[i])] for i in order]


class StopMatcher:
    """Cuts streamed text at the first stop string, as llama-server/OpenAI do: text that could
    still become a stop string is held back; the stop string itself is never emitted."""

    def __init__(self, stops):
        if isinstance(stops, str):
            stops = [stops]
        self.stops = list(stops or [])
        for s in self.stops:
            if not isinstance(s, str) or not s:
                raise RequestError(f"stop={self.stops!r}: every stop must be a non-empty string")
        self.held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, text: str) -> tuple[str, bool]:
        """Feed new text; returns (text safe to emit now, whether a stop string was hit)."""
        if self.stopped:
            return "", True
        buf = self.held + text
        hits = [(buf.find(s), s) for s in self.stops if s in buf]
        if hits:
            at, self.matched = min(hits)
            self.stopped, self.held = True, ""
            return buf[:at], True
        hold = max((self._partial(buf, s) for s in self.stops), default=0)
        self.held = buf[len(buf) - hold:]
        return buf[:len(buf) - hold], False

    def flush(self) -> str:
        """At the end of generation: the held-back text (it never became a stop string)."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out

    @staticmethod
    def _partial(buf: str, stop: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of stop."""
        for k in range(min(len(stop) - 1, len(buf)), 0, -1):
            if buf.endswith(stop[:k]):
                return k
        return 0
