"""One ledger for every budgeted byte, and a debug watchdog that checks it against VmRSS.

Every owner of a large buffer registers it: ``ledger.alloc(category, name, nbytes)`` and
``ledger.free(category, name)``. With MEMFIT_DEBUG_LEDGER=1 (tests) each alloc/free and
``check()`` compares the real VmRSS with ledger total + slack and raises LedgerDriftError
(an AssertionError) when the process holds more than the ledger explains;
MEMFIT_DEBUG_LEDGER=warn prints to stderr instead.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass

from ..errors import BudgetError
from .budget import MiB, current_rss, format_size, parse_size

# "server": what `memfit serve` keeps between requests (the Responses API store)
CATEGORIES = ("baseline", "scratch", "kv", "resident_weights", "weight_cache", "io_staging",
              "server")
ENV_DEBUG = "MEMFIT_DEBUG_LEDGER"
ENV_SLACK = "MEMFIT_LEDGER_SLACK"


class LedgerDriftError(AssertionError):
    """Real RSS exceeded what the ledger accounts for (a buffer was not registered)."""


@dataclass
class DriftReport:
    rss: int
    ledger_total: int
    slack: int

    @property
    def excess(self) -> int:
        return self.rss - self.ledger_total - self.slack

    def __str__(self) -> str:
        return (f"VmRSS {format_size(self.rss)} > ledger {format_size(self.ledger_total)} + "
                f"slack {format_size(self.slack)} (unaccounted {format_size(self.excess)})")


def debug_mode() -> str:
    """'' (off), 'raise' or 'warn' from $MEMFIT_DEBUG_LEDGER."""
    v = os.environ.get(ENV_DEBUG, "").strip().lower()
    if v in ("", "0", "false", "no", "off"):
        return ""
    return "warn" if v == "warn" else "raise"


class Ledger:
    """Bytes by category and name; thread-safe. ``budget_bytes`` None means unbounded."""

    def __init__(self, budget_bytes: int | None, *, slack: int | None = None,
                 debug: str | None = None):
        self.budget = budget_bytes
        self._items: dict[str, dict[str, int]] = {c: {} for c in CATEGORIES}
        self._lock = threading.Lock()
        self.peak_total = 0
        self.debug = debug_mode() if debug is None else debug
        env_slack = os.environ.get(ENV_SLACK)
        # default slack: allocator arenas, thread stacks, small Python objects
        self.slack = slack if slack is not None else (parse_size(env_slack) if env_slack else 64 * MiB)
        self.violation: DriftReport | None = None
        self._watchdog: threading.Thread | None = None
        self._stop = threading.Event()

    # ---- accounting ----
    def alloc(self, category: str, name: str, nbytes: int) -> None:
        assert category in self._items, f"unknown ledger category {category!r}"
        assert nbytes >= 0
        with self._lock:
            assert name not in self._items[category], f"{category}/{name} registered twice"
            total = self._total() + nbytes
            if self.budget is not None and total > self.budget:
                raise BudgetError(
                    f"allocating {format_size(nbytes)} for {category}/{name} would exceed the "
                    f"memory budget {format_size(self.budget)} (ledger {format_size(total - nbytes)}: "
                    f"{self._fmt_breakdown()}); raise --mem-budget or lower --ctx")
            self._items[category][name] = nbytes
            self.peak_total = max(self.peak_total, total)
        if self.debug:
            self.check()

    def free(self, category: str, name: str) -> int:
        with self._lock:
            n = self._items[category].pop(name)
        return n

    def resize(self, category: str, name: str, nbytes: int) -> None:
        with self._lock:
            assert name in self._items[category]
            old = self._items[category].pop(name)
        try:
            self.alloc(category, name, nbytes)
        except BudgetError:
            with self._lock:
                self._items[category][name] = old
            raise

    def _total(self) -> int:
        return sum(sum(d.values()) for d in self._items.values())

    def total(self, category: str | None = None) -> int:
        with self._lock:
            if category is None:
                return self._total()
            return sum(self._items[category].values())

    def breakdown(self) -> dict[str, int]:
        """Bytes per category (every category present, zeros included)."""
        with self._lock:
            return {c: sum(d.values()) for c, d in self._items.items()}

    def items(self, category: str) -> dict[str, int]:
        with self._lock:
            return dict(self._items[category])

    def _fmt_breakdown(self) -> str:
        return ", ".join(f"{c} {format_size(sum(d.values()))}" for c, d in self._items.items()
                         if d)

    def format(self) -> str:
        bd = self.breakdown()
        lines = [f"{c:<17} {format_size(n):>12}" for c, n in bd.items()]
        lines.append(f"{'total':<17} {format_size(sum(bd.values())):>12}"
                     + (f" of budget {format_size(self.budget)}" if self.budget else ""))
        return "\n".join(lines)

    # ---- watchdog ----
    def drift(self, rss: int | None = None) -> DriftReport:
        return DriftReport(current_rss() if rss is None else rss, self.total(), self.slack)

    def check(self, rss: int | None = None, mode: str | None = None) -> DriftReport:
        """Compare real VmRSS with ledger + slack. mode 'raise' -> LedgerDriftError,
        'warn' -> stderr, '' -> only return the report. Also raises a violation that the
        background watchdog recorded."""
        mode = self.debug if mode is None else mode
        rep = self.drift(rss)
        bad = rep if rep.excess > 0 else self.violation
        if bad is not None and mode:
            msg = f"memfit ledger drift: {bad}\n  ledger: {self._fmt_breakdown()}"
            if mode == "raise":
                raise LedgerDriftError(msg)
            print(msg, file=sys.stderr, flush=True)
        return rep

    def start_watchdog(self, interval_s: float = 0.05) -> None:
        """Sample VmRSS in a thread; the first excess is kept in ``violation`` (and printed)
        and raised by the next check() on the main thread."""
        if self._watchdog is not None:
            return
        self._stop.clear()

        def loop():
            from .io import block_async_signals
            block_async_signals()
            while not self._stop.wait(interval_s):
                rep = self.drift()
                if rep.excess > 0 and self.violation is None:
                    self.violation = rep
                    print(f"memfit ledger watchdog: {rep}", file=sys.stderr, flush=True)

        self._watchdog = threading.Thread(target=loop, name="memfit-ledger-watchdog", daemon=True)
        self._watchdog.start()

    def stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._stop.set()
            self._watchdog.join()
            self._watchdog = None
