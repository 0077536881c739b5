"""Bandwidth probes that do not lie: several kept with the load seen during each, quiet and
recent ones preferred, loaded or old ones re-taken when a plan may measure, and `memfit plan`
says where each number came from (issue 9, item 10)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from memfit.memory import bandwidth as bw


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


def _write(cache: dict) -> None:
    bw.cache_path().parent.mkdir(parents=True, exist_ok=True)
    bw.cache_path().write_text(json.dumps(cache))


def test_choose_prefers_quiet_then_recent():
    now = 1e9
    loaded_fast = {"bps": 16e9, "time": now - 60, "load": 3.0}
    quiet = {"bps": 12e9, "time": now - 3600, "load": 0.1}
    quiet_old = {"bps": 20e9, "time": now - 30 * 86400, "load": 0.1}
    assert bw.choose_probe([loaded_fast, quiet, quiet_old], now) is quiet
    assert bw.choose_probe([loaded_fast, quiet_old], now) is quiet_old   # quiet beats recent
    assert bw.choose_probe([loaded_fast], now) is loaded_fast
    assert bw.choose_probe([], now) is None


def test_staleness():
    now = 1e9
    assert bw.probe_is_stale(None, now, 0.1)
    assert bw.probe_is_stale({"bps": 1, "time": 0, "load": None}, now, 0.1)       # legacy
    assert not bw.probe_is_stale({"bps": 1, "time": now - 60, "load": 0.1}, now, 3.0)
    assert bw.probe_is_stale({"bps": 1, "time": now - 8 * 86400, "load": 0.1}, now, 0.1)
    loaded = {"bps": 1, "time": now - 60, "load": 2.0}
    assert bw.probe_is_stale(loaded, now, 0.2)          # quiet now: take it again
    assert not bw.probe_is_stale(loaded, now, 2.0)      # still busy, and recent: keep
    assert bw.probe_is_stale({**loaded, "time": now - 7200}, now, 2.0)


def test_cached_quiet_probe_wins_and_is_explained(cache_home):
    now = time.time()
    mk = bw.machine_key()
    _write({"mem_probes": {mk: [{"bps": 8.8e9, "time": now - 100, "load": 4.0},
                                {"bps": 16e9, "time": now - 200, "load": 0.2}]}})
    b = bw.get_bandwidth(None, measure=False)
    assert b.mem_read_bytes_per_s == 16e9 and b.source.startswith("cached")
    assert "load 0.20/CPU" in b.mem_note and "under load" not in b.mem_note
    assert b.disk_note == "default (never measured)"


def test_loaded_old_probe_is_taken_again_when_measuring(cache_home):
    mk = bw.machine_key()
    _write({"mem": {mk: 8.8e9}})                         # an older memfit's single value
    b = bw.get_bandwidth(None, measure=False)
    assert b.mem_read_bytes_per_s == 8.8e9 and "unknown time and load" in b.mem_note
    b = bw.get_bandwidth(None, measure=True)             # re-probed: unknown load is stale
    probes = json.loads(bw.cache_path().read_text())["mem_probes"][mk]
    assert len(probes) == 2 and probes[-1]["load"] is not None and probes[-1]["bps"] > 0
    assert "probed" in b.mem_note


def test_plan_reprobe_says_where_and_when(cache_home, smollm2_path):
    env = dict(os.environ, XDG_CACHE_HOME=str(cache_home))
    env.pop("MEMFIT_MEM_BUDGET", None)

    def plan(*extra):
        p = subprocess.run([sys.executable, "-m", "memfit", "plan", str(smollm2_path),
                            "--mem-budget", "1GiB", *extra], capture_output=True, text=True,
                           env=env, timeout=120)
        assert p.returncode == 0, p.stderr
        return p.stdout

    d = json.loads(plan("--reprobe", "--json"))
    assert d["bandwidth_notes"]["memory"].startswith("probed now")
    text = plan("--no-measure")
    assert "memory bandwidth" in text and "probed 20" in text   # a date, from the cache


def test_read_strategies_read_every_byte_once(isa):
    """Every read strategy of the read bound (widths, streams, prefetch, one thread or all)
    reads each byte of the buffer exactly once: its checksum (an xor of 8-byte words, in
    which a word read twice cancels and a word skipped is missing) equals numpy's."""
    import numpy as np

    from memfit import _native
    from memfit.ops import native
    rng = np.random.default_rng(3)
    buf = bw.probe_buffer(3 << 20)
    assert buf.ctypes.data % 64 == 0
    buf[:] = rng.integers(0, 256, size=buf.size, dtype=np.uint8)
    want = int(np.bitwise_xor.reduce(buf.view(np.uint64)))
    native.set_threads(2)           # the isa fixture restores the thread count
    strategies = bw.read_strategies(2)
    assert len(strategies) >= 10 and strategies[-1]["threads"] == 1
    for st in strategies:
        got = _native.read_buffer(buf, st["streams"], st["width"], st["prefetch"],
                                  st.get("threads", 0))
        assert got == want, st
    bps, pick = bw.read_bound(buf=buf, reps=1)
    assert bps > 0 and pick in strategies
    for bad in ((0,), (1, 128), (1, 512, 100), (1, 512, 0, -1)):
        with pytest.raises(ValueError):
            _native.read_buffer(buf, *bad)
