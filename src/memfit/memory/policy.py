"""Policies the weight store calls; the store only executes them (mechanism apart).

Replacement policies for the expert cache take keys (layer, expert) and see only keys the
store may evict. ``access`` is called on every use (hit or miss), ``insert``/``remove`` when a
key enters/leaves the cache, ``victim`` picks one of ``candidates`` to evict, and ``admit``
says whether a new key is worth evicting that victim (when not, the store reads the expert
into a transient slot that is evicted first, and the victim stays).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Hashable, Iterable, Mapping


class LRUPolicy:
    """Least recently used; admits everything (the baseline)."""

    name = "lru"

    def __init__(self):
        self._order: OrderedDict = OrderedDict()

    def access(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def insert(self, key: Hashable) -> None:
        self.access(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victim(self, candidates: Iterable[Hashable]) -> Hashable:
        cand = set(candidates)
        assert cand, "no evictable key"
        for k in self._order:  # oldest first
            if k in cand:
                return k
        return next(iter(cand))

    def admit(self, key: Hashable, victim: Hashable) -> bool:
        return True


class DecayPolicy:
    """Frequency with exponential decay: each key's score is its uses, each older use counted
    decay**age (age in store ticks, one tick per get_experts call). The victim is the lowest
    score; a new key is admitted only when its score beats the victim's (same-size units, so
    the one used more often saves more reads). ``prior`` seeds scores (learned routing
    counts, scaled so the largest is ``prior_weight``)."""

    name = "decay"

    def __init__(self, decay: float = 0.98, prior: Mapping[Hashable, float] | None = None,
                 prior_weight: float = 2.0):
        assert 0.0 < decay <= 1.0
        self.decay = decay
        self._log_decay = math.log(decay)
        self.tick = 0
        self._score: dict[Hashable, tuple[float, int]] = {}  # key -> (score, tick of score)
        if prior:
            top = max(prior.values()) or 1.0
            for k, v in prior.items():
                if v > 0:
                    self._score[k] = (prior_weight * v / top, 0)

    def advance(self) -> None:
        self.tick += 1

    def score(self, key: Hashable) -> float:
        s, t = self._score.get(key, (0.0, self.tick))
        return s * math.exp(self._log_decay * (self.tick - t))

    def access(self, key: Hashable) -> None:
        self._score[key] = (self.score(key) + 1.0, self.tick)

    def insert(self, key: Hashable) -> None:
        pass

    def remove(self, key: Hashable) -> None:
        pass  # the score outlives residency: a key evicted and seen again keeps its history

    def victim(self, candidates: Iterable[Hashable]) -> Hashable:
        return min(candidates, key=self.score)

    def admit(self, key: Hashable, victim: Hashable) -> bool:
        return self.score(key) > self.score(victim)


class NextUnitPrefetch:
    """Dense streaming: after unit u comes u+1, cyclically (after the last layer, the next
    token's first)."""

    def next_unit(self, ui: int, n_units: int) -> int | None:
        nxt = (ui + 1) % n_units
        return None if nxt == ui else nxt


def make_policy(name: str, prior=None):
    if name == "lru":
        return LRUPolicy()
    if name == "decay":
        return DecayPolicy(prior=prior)
    raise ValueError(f"unknown expert cache policy {name!r} (lru | decay)")
