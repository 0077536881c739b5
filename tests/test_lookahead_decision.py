"""Router look-ahead stays only where it pays, decided by measurement while decoding
(memory/policy.py LookaheadDecision; issue 22 item 4): the rule on given timings, then a
budgeted MoE run in a real process that makes the decision and whose tokens do not depend
on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from memfit.memory.policy import LookaheadDecision

D = LookaheadDecision


def _explore(dec: LookaheadDecision, on_cost: float, off_cost: float) -> list[bool]:
    """One exploration with fixed costs per side; returns the on/off state of every step."""
    on, states = True, []
    for _ in range(2 * D.PAIRS * D.WINDOW):
        states.append(on)
        on = dec.observe(on_cost if on else off_cost, on)
    states.append(on)
    return states


@pytest.mark.parametrize("on_cost, off_cost, want", [
    (1.0, 2.0, True),      # look-ahead removes stalls: kept
    (2.0, 1.0, False),     # its wasted reads cost more: off
    (1.0, 1.01, False),    # within the margin: off (it reads less)
])
def test_the_faster_side_is_kept(on_cost, off_cost, want):
    dec = LookaheadDecision()
    assert dec.state == "exploring"
    states = _explore(dec, on_cost, off_cost)
    # windows of WINDOW steps, on first, alternating
    assert states[:2 * D.WINDOW] == [True] * D.WINDOW + [False] * D.WINDOW
    assert states[-1] is want and dec.decisions == [want]
    assert dec.state == ("on" if want else "off")
    for _ in range(D.HOLD - 1):            # held, whatever the timings say now
        assert dec.observe(5.0, want) is want
    assert dec.observe(5.0, want) is True and dec.state == "exploring"   # explores again


def test_a_windows_first_step_is_not_counted():
    """The first step after a switch still carries the other side's reads: a slow first
    step of the on windows must not make look-ahead look slow."""
    dec, on = LookaheadDecision(), True
    for i in range(2 * D.PAIRS * D.WINDOW):
        first = i % D.WINDOW == 0
        on = dec.observe((9.0 if first else 1.0) if on else 2.0, on)
    assert dec.decisions == [True]


def test_forced_is_always_on():
    dec = LookaheadDecision(forced=True)
    assert all(dec.observe(10.0, True) for _ in range(100)) and dec.state == "on"


SCRIPT = r"""
import json, os, sys
import numpy as np
import memfit
from memfit.runtime import Runtime
path = sys.argv[1]
rt = Runtime(path, n_ctx=256, mem_budget=16 << 30, n_parallel=2)
floor = rt.plan.min_budget_bytes
rt.close()
with memfit.load(path, n_ctx=256, mem_budget=floor + os.path.getsize(path) // 4, spec="off",
                 n_parallel=2) as m:
    ids = [int(i) for i in np.random.default_rng(0).integers(3, 2000, 8)]
    r = m.generate(ids, max_tokens=40, temperature=0)
    # two sequences decoded together: steps of two rows, decided apart from one row's
    b = m.generate([ids, ids[::-1]], max_tokens=40, temperature=0)
    st = m.store.stats()
print(json.dumps({"ids": r.ids, "batch": [x.ids for x in b], "lookahead": st["lookahead"],
                  "decisions": st["lookahead_decisions"], "prefetched": st["prefetched_experts"]}))
"""


def test_a_budgeted_run_decides_and_its_tokens_do_not_depend_on_it(tmp_path):
    path = tmp_path / "moe.gguf"
    r = subprocess.run([sys.executable, "-m", "memfit", "synth", str(path), "--arch", "qwen3moe",
                        "--size", "tiny", "--seed", "0"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = {}
    for mode in ("", "0", "1"):
        env = {**os.environ, "MEMFIT_CACHE": str(tmp_path / "cache"), "MEMFIT_EXPERT_LOOKAHEAD": mode}
        env.pop("MEMFIT_MEM_BUDGET", None)
        p = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], capture_output=True,
                           text=True, timeout=300, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
        out[mode] = json.loads(p.stdout.strip().splitlines()[-1])
    auto, off, on = out[""], out["0"], out["1"]
    assert auto["ids"] == off["ids"] == on["ids"]        # a hint never changes a result
    assert auto["batch"] == off["batch"] == on["batch"] and auto["batch"][0] == auto["ids"]
    # 39 decode steps of one row, then 39 of two: each an exploration (16 steps) ended in a
    # decision of its own, held since
    assert sorted(auto["decisions"]) == ["1", "2"]
    assert [len(v) for v in auto["decisions"].values()] == [1, 1]
    assert auto["lookahead"] in ("on", "off")
    assert off["lookahead"] == "off" and off["prefetched"] == 0 and off["decisions"] == {}
    assert on["lookahead"] == "on" and on["decisions"] == {"1": [], "2": []} and on["prefetched"] > 0
