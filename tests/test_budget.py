"""Budget parsing/detection, RSS probes, and the ledger with its RSS watchdog."""

from __future__ import annotations

import numpy as np
import pytest

from memfit.errors import BudgetError, RequestError
from memfit.memory import budget as B
from memfit.memory.ledger import CATEGORIES, Ledger, LedgerDriftError

MiB, GiB = B.MiB, B.GiB


@pytest.mark.parametrize("text,expected", [
    ("6GiB", 6 * GiB), ("512MiB", 512 * MiB), ("100KiB", 102400), ("1.5G", int(1.5 * GiB)),
    ("123456", 123456), ("4GB", 4 * 10**9), ("2 gib", 2 * GiB), ("700m", 700 * MiB),
    ("10b", 10), (".5T", B.TiB // 2), (3 * GiB, 3 * GiB),
])
def test_parse_size(text, expected):
    assert B.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "6XB", "-1G", "0", "1.2.3G", "G"])
def test_parse_size_rejects_with_value_named(text):
    with pytest.raises(RequestError) as e:
        B.parse_size(text)
    assert repr(text) in str(e.value)


def _meminfo(tmp_path, avail_kb):
    p = tmp_path / "meminfo"
    p.write_text(f"MemTotal: 32000000 kB\nMemFree: 1000 kB\nMemAvailable: {avail_kb} kB\n")
    return str(p)


def test_cgroup_v2_limit_walks_ancestors(tmp_path):
    root = tmp_path / "cg"
    (root / "a" / "b").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("memory\n")
    (root / "a" / "memory.max").write_text(f"{3 * GiB}\n")
    (root / "a" / "b" / "memory.max").write_text("max\n")
    (root / "a" / "b" / "memory.high").write_text(f"{2 * GiB}\n")
    limit, where = B.cgroup_limit("0::/a/b\n", root)
    assert limit == 2 * GiB and where.endswith("memory.high")


def test_cgroup_v1_limit_and_unlimited(tmp_path):
    root = tmp_path / "cg"
    (root / "memory" / "job").mkdir(parents=True)
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (root / "memory" / "job" / "memory.limit_in_bytes").write_text(f"{5 * GiB}\n")
    assert B.cgroup_limit("4:memory:/job\n1:cpu:/\n", root)[0] == 5 * GiB
    assert B.cgroup_limit("4:memory:/\n", root) == (None, "no cgroup memory limit")


def test_detect_budget_takes_smaller_minus_margin(tmp_path):
    root = tmp_path / "cg"
    (root / "memory" / "job").mkdir(parents=True)
    (root / "memory" / "job" / "memory.limit_in_bytes").write_text(f"{2 * GiB}\n")
    mi = _meminfo(tmp_path, 20 * 1024 * 1024)  # 20 GiB available
    n, why = B.detect_budget(mi, "4:memory:/job\n", root)
    assert n == 2 * GiB - B.detect_margin(2 * GiB) and n < 2 * GiB
    assert "cgroup limit" in why and "margin" in why
    n2, why2 = B.detect_budget(mi, "4:memory:/other\n", root)  # no limit found: MemAvailable
    assert n2 == 20 * GiB - GiB and "MemAvailable" in why2


def test_resolve_budget_order(monkeypatch):
    monkeypatch.setenv(B.ENV_BUDGET, "3GiB")
    assert B.resolve_budget("1GiB")[0] == GiB
    assert B.resolve_budget(None)[0] == 3 * GiB
    monkeypatch.setenv(B.ENV_BUDGET, "lots")
    with pytest.raises(RequestError, match="MEMFIT_MEM_BUDGET"):
        B.resolve_budget(None)
    monkeypatch.delenv(B.ENV_BUDGET)
    n, why = B.resolve_budget(None)
    assert n > 0 and why.startswith("detected")


def test_rss_probes_see_a_touched_buffer():
    import os
    before = B.current_rss()
    a = np.ones(64 * MiB // 8)  # 64 MiB, written so the pages are resident
    after = B.current_rss()
    assert after - before > 48 * MiB
    assert B.peak_rss() >= after and B.peak_rss_of(os.getpid()) >= after
    assert B.rss_of(os.getpid()) > 0
    del a


def test_ledger_accounting_and_budget_refusal():
    led = Ledger(100 * MiB, debug="")
    led.alloc("kv", "layer0", 30 * MiB)
    led.alloc("resident_weights", "blk.0.attn_q", 50 * MiB)
    bd = led.breakdown()
    assert set(bd) == set(CATEGORIES) and bd["kv"] == 30 * MiB and led.total() == 80 * MiB
    with pytest.raises(BudgetError, match="exceed the memory budget"):
        led.alloc("scratch", "big", 30 * MiB)
    assert led.total() == 80 * MiB  # refused allocation left no trace
    assert led.free("kv", "layer0") == 30 * MiB
    led.alloc("scratch", "big", 30 * MiB)
    assert led.peak_total == 80 * MiB and "total" in led.format()
    with pytest.raises(AssertionError):
        led.alloc("scratch", "big", 1)


def test_ledger_watchdog_catches_unregistered_memory():
    base = B.current_rss()
    led = Ledger(None, slack=32 * MiB, debug="raise")
    led.alloc("baseline", "runtime", base)
    led.check()  # consistent now
    hidden = np.ones(128 * MiB // 8)  # not registered
    with pytest.raises(LedgerDriftError, match="unaccounted"):
        led.check()
    led.alloc("scratch", "hidden", hidden.nbytes)  # registering it explains the RSS
    led.check()
    del hidden


def test_ledger_background_watchdog_records_violation():
    import time
    led = Ledger(None, slack=16 * MiB, debug="raise")
    led.alloc("baseline", "runtime", B.current_rss())
    led.start_watchdog(0.01)
    try:
        hidden = np.ones(96 * MiB // 8)
        for _ in range(200):
            if led.violation is not None:
                break
            time.sleep(0.01)
        assert led.violation is not None and led.violation.excess > 0
    finally:
        led.stop_watchdog()
    del hidden
    with pytest.raises(LedgerDriftError):
        led.check()  # the recorded violation is raised on the main thread
