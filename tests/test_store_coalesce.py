"""Coalesced expert reads (memory/store.py _read_coalesced): the experts one get_experts
call (or one look-ahead hint) misses are read as sorted, merged runs, one preadv each, into
the experts' slots. Checked against MEMFIT_COALESCE=0 (each expert's three ranges read
apart): the same bytes in every slot (slices that share pages, so the shared-page copy runs),
the same logits from a real model decoding under a budget, and fewer reads."""

from __future__ import annotations

import os

import numpy as np
import pytest

import memfit
from memfit.gguf import open_gguf
from memfit.memory.ledger import Ledger
from memfit.memory.planner import ModelDesc
from memfit.memory.store import WeightStore
from memfit.runtime import Runtime
from memfit.synth import synth

from test_expert_cache import check, plan_slots, write_moe


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return write_moe(tmp_path_factory.mktemp("coalesce") / "moe.gguf")


def _store_reads(path, coalesce: bool, monkeypatch, calls, direct=True):
    monkeypatch.setenv("MEMFIT_COALESCE", "1" if coalesce else "0")
    f = open_gguf(path)
    p = plan_slots(ModelDesc.from_gguf(f), 8)
    store = WeightStore(f, p, Ledger(None, debug=""), direct=direct)
    try:
        assert store.coalesce is coalesce
        before = store.stats()["expert_reads"]
        for il, ex in calls:
            check(f, store.get_experts(il, ex), il, ex)   # the file's bytes, expert by expert
        st = store.stats()
        return st["expert_reads"] - before, st["expert_read_bytes"], store.direct
    finally:
        store.close()
        f.close()


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_coalesced_reads_are_the_same_bytes_in_fewer_reads(moe_path, monkeypatch, direct):
    # apart: 3 ranges per expert. Coalesced: runs of neighbouring experts, and the last
    # expert of one stacked tensor runs on into the first of the next (gate, up, down are
    # adjacent in this file): layer 0 {g0-3} {g5} {g7 u0-3} {u5} {u7 d0-3} {d5} {d7} = 7,
    # layer 1 {g1} {g6-7 u1} {u6-7 d1} {d6-7} = 4
    calls = [(0, [0, 1, 2, 3, 5, 7]), (1, [7, 6, 1])]
    n_on, b_on, used = _store_reads(moe_path, True, monkeypatch, calls, direct)
    n_off, b_off, _ = _store_reads(moe_path, False, monkeypatch, calls, direct)
    assert used == direct or not hasattr(os, "O_DIRECT")   # O_DIRECT where the fs takes it
    assert n_off == 6 * 3 + 3 * 3
    assert n_on == 7 + 4
    # the same experts; merged runs read a page two neighbours share once (slices of 7680
    # bytes: every neighbour shares one)
    assert b_off - 6 * 4096 * 3 <= b_on < b_off


def test_prefetch_hint_is_coalesced_too(moe_path, monkeypatch):
    monkeypatch.setenv("MEMFIT_COALESCE", "1")
    f = open_gguf(moe_path)
    store = WeightStore(f, plan_slots(ModelDesc.from_gguf(f), 8), Ledger(None, debug=""))
    try:
        store.prefetch_experts(1, [2, 3, 4])
        assert store.stats()["expert_reads"] == 3      # {g2-4} {u2-4} {d2-4}
        check(f, store.get_experts(1, [4, 2, 3]), 1, [4, 2, 3])
        assert store.stats()["expert_prefetch_hits"] == 3
    finally:
        store.close()
        f.close()


def _decode(path, coalesce: bool, monkeypatch) -> tuple[np.ndarray, dict]:
    monkeypatch.setenv("MEMFIT_COALESCE", "1" if coalesce else "0")
    # no look-ahead, no hot set from the first run's routing record: the same experts miss
    # in both runs (not depending on when prefetches finish)
    monkeypatch.setenv("MEMFIT_EXPERT_LOOKAHEAD", "0")
    monkeypatch.setenv("MEMFIT_EXPERT_HOTSET", "0")
    rt = Runtime(str(path), n_ctx=64, mem_budget=16 << 30)
    floor = rt.plan.min_budget_bytes
    rt.close()
    with memfit.load(path, n_ctx=64, mem_budget=floor + os.path.getsize(path) // 4) as m:
        assert m.store is not None and m.store.coalesce is coalesce
        ids = [int(i) for i in np.random.default_rng(5).integers(3, 2000, 24)]
        lp = m.logprobs(ids)
        return np.asarray(lp), m.store.stats()


def test_same_logits_from_a_model_under_a_budget(tmp_path, monkeypatch):
    path = synth(tmp_path / "q.gguf", "qwen3moe", "tiny", seed=2, progress=False).path
    lp_on, st_on = _decode(path, True, monkeypatch)
    lp_off, st_off = _decode(path, False, monkeypatch)
    np.testing.assert_array_equal(lp_on, lp_off)
    assert st_on["expert_misses"] == st_off["expert_misses"] > 0
    assert st_on["expert_reads"] < st_off["expert_reads"]
    assert st_on["expert_bytes_per_read"] > st_off["expert_bytes_per_read"]
    print(f"\nexpert reads: coalesced {st_on['expert_reads']} of "
          f"{st_on['expert_bytes_per_read'] / 1e3:.0f} kB, apart {st_off['expert_reads']} of "
          f"{st_off['expert_bytes_per_read'] / 1e3:.0f} kB")
