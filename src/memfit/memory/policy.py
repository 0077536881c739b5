"""Policies the weight store calls; the store only executes them (mechanism apart).

Replacement policies for the expert cache take keys (layer, expert). The store calls
``access`` on every use (hit or miss), ``insert``/``remove`` when a key's bytes enter/leave a
slot, ``victim(evictable)`` for the resident key to evict (``evictable(key)`` says whether the
store may evict it now; None when none may be), and ``admit(key, victim)`` for whether a new
key is worth evicting that victim (when not, the store reads the expert into a transient slot
that is evicted first, and the victim stays). Both policies pick a victim in O(log n)
amortized: a 30B-A3B has ~6k (layer, expert) units and ~400 misses per token.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from typing import Callable, Hashable, Mapping


class LRUPolicy:
    """Least recently used; admits everything (the baseline)."""

    name = "lru"

    def __init__(self):
        self._order: OrderedDict = OrderedDict()   # resident keys, oldest first

    def access(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def insert(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victim(self, evictable: Callable[[Hashable], bool]) -> Hashable | None:
        # the keys skipped (in use now) are the most recently used few
        return next((k for k in self._order if evictable(k)), None)

    def admit(self, key: Hashable, victim: Hashable) -> bool:
        return True


class DecayPolicy:
    """Frequency with exponential decay: a key's score is its uses, each older use counted
    decay**age (age in ticks, one tick per get_experts call). The victim is the resident key
    with the lowest score; a new key is admitted only when its score beats the victim's
    (units are the same size, so the one used more often saves more reads). ``prior`` seeds
    scores (learned routing counts, scaled so the largest is ``prior_weight``).

    log score at tick T = (log s - L t) + L T with L = log(decay), t the tick of the last
    update: the order of keys does not change between their own updates, so a heap of
    rank = log s - L t finds the minimum (stale entries are skipped)."""

    name = "decay"

    def __init__(self, decay: float = 0.98, prior: Mapping[Hashable, float] | None = None,
                 prior_weight: float = 2.0):
        assert 0.0 < decay < 1.0
        self._ld = math.log(decay)
        self.tick = 0
        self._rank: dict[Hashable, float] = {}   # every key seen (history outlives residency)
        self._resident: set = set()
        self._heap: list[tuple[float, Hashable]] = []
        if prior:
            top = max(prior.values()) or 1.0
            for k, v in prior.items():
                if v > 0:
                    self._rank[k] = math.log(prior_weight * v / top)

    def advance(self) -> None:
        self.tick += 1

    def score(self, key: Hashable) -> float:
        r = self._rank.get(key)
        return 0.0 if r is None else math.exp(r + self._ld * self.tick)

    def access(self, key: Hashable) -> None:
        self._rank[key] = math.log(self.score(key) + 1.0) - self._ld * self.tick
        if key in self._resident:
            self._push(key)

    def insert(self, key: Hashable) -> None:
        self._resident.add(key)
        self._push(key)

    def _push(self, key: Hashable) -> None:
        heapq.heappush(self._heap, (self._rank.get(key, -math.inf), key))
        if len(self._heap) > 4 * len(self._resident) + 64:  # drop the stale entries
            self._heap = [(self._rank.get(k, -math.inf), k) for k in self._resident]
            heapq.heapify(self._heap)

    def remove(self, key: Hashable) -> None:
        self._resident.discard(key)

    def victim(self, evictable: Callable[[Hashable], bool]) -> Hashable | None:
        held, found = [], None
        while self._heap:
            r, k = heapq.heappop(self._heap)
            if k not in self._resident or r != self._rank.get(k, -math.inf):
                continue  # stale entry
            held.append((r, k))
            if evictable(k):
                found = k
                break
        for e in held:
            heapq.heappush(self._heap, e)
        return found

    def admit(self, key: Hashable, victim: Hashable) -> bool:
        return self.score(key) > self.score(victim)


class NextUnitPrefetch:
    """Dense streaming: after unit u comes u+1, cyclically (after the last layer, the next
    token's first)."""

    def next_unit(self, ui: int, n_units: int) -> int | None:
        nxt = (ui + 1) % n_units
        return None if nxt == ui else nxt


class LookaheadDecision:
    """Whether router look-ahead prefetch pays, decided by measurement while decoding (issue
    22: it removed stalls on a loaded machine and cost 22% on uniform routing, so no constant
    can decide it). It explores in windows of WINDOW decode steps, on and off in turn (PAIRS
    windows of each; a window's first step, which still carries the other side's reads, is
    not counted), keeps the side with the lower median seconds per decoded row, off unless
    on is MARGIN faster (off reads less), holds that for HOLD steps, then explores again
    (the cache's contents and the routing drift). forced: always on (MEMFIT_EXPERT_LOOKAHEAD=1).
    ``observe`` takes a finished step's time and whether look-ahead was on, and returns
    whether the next step should use it."""

    WINDOW, PAIRS, HOLD, MARGIN = 4, 2, 64, 0.03

    def __init__(self, forced: bool = False):
        self.forced = forced
        self.on = True
        self.samples: dict[bool, list[float]] = {True: [], False: []}
        self.explore_left = 2 * self.PAIRS * self.WINDOW   # steps left in this exploration
        self.hold_left = 0
        self.in_window = 0            # steps taken in the current window
        self.decisions: list[bool] = []

    @property
    def state(self) -> str:
        if self.forced:
            return "on"
        return "exploring" if self.explore_left else ("on" if self.on else "off")

    def observe(self, seconds_per_row: float, was_on: bool) -> bool:
        if self.forced:
            return True
        if self.explore_left:
            if self.in_window:                    # not a window's first step
                self.samples[was_on].append(seconds_per_row)
            self.in_window += 1
            self.explore_left -= 1
            if self.in_window == self.WINDOW:
                self.in_window = 0
                self.on = not was_on
            if self.explore_left == 0:
                self.on = self._decide()
                self.hold_left = self.HOLD
            return self.on
        self.hold_left -= 1
        if self.hold_left <= 0:                   # explore again, starting from on
            self.samples = {True: [], False: []}
            self.explore_left = 2 * self.PAIRS * self.WINDOW
            self.on = True
        return self.on

    def _decide(self) -> bool:
        on, off = sorted(self.samples[True]), sorted(self.samples[False])
        if not on or not off:
            choice = bool(on)
        else:
            choice = on[len(on) // 2] < off[len(off) // 2] * (1.0 - self.MARGIN)
        self.decisions.append(choice)
        return choice


def make_policy(name: str, prior=None):
    if name == "lru":
        return LRUPolicy()
    if name == "decay":
        return DecayPolicy(prior=prior)
    raise ValueError(f"unknown expert cache policy {name!r} (lru | decay)")
