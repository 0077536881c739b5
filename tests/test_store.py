"""The weight store executes a Plan: same logits as plain file weights, at any tier split."""

from __future__ import annotations

import numpy as np
import pytest

from memfit.gguf import open_gguf
from memfit.memory.bandwidth import Bandwidth
from memfit.memory.ledger import Ledger
from memfit.memory.planner import ModelDesc, plan
from memfit.memory.store import WeightStore
from memfit.models import load_model
from memfit.synth import synth

MiB = 1 << 20
BW = Bandwidth(10e9, 1e9, "test")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("st") / "m.gguf", "qwen2", "tiny", "Q4_K_M",
                 seed=3, progress=False).path


def plan_at(desc, budget=None):
    """The test plan of `desc` (ctx 64, 2 threads, n_batch 64) at `budget`, or at its floor."""
    def at(b):
        return plan(desc, b, 64, 2, BW, baseline_bytes=0, n_batch=64)
    return at(at(1 << 40).min_budget_bytes if budget is None else budget)


def greedy(model, n_new=4):
    cache = model.new_cache(64)
    logits = model.forward(np.array([1, 2, 3, 4], np.int32), cache)
    out, all_logits = [], [logits]
    for _ in range(n_new):
        tok = int(np.argmax(logits))
        out.append(tok)
        logits = model.forward(np.array([tok], np.int32), cache)
        all_logits.append(logits)
    return out, np.stack(all_logits)


@pytest.fixture(scope="module")
def reference(model_path):
    m = load_model(model_path)
    try:
        return greedy(m)
    finally:
        m.file.close()


@pytest.mark.parametrize("where", ["floor", "middle", "all"])
@pytest.mark.parametrize("prefetch", [True, False])
def test_store_matches_file_weights(model_path, reference, where, prefetch):
    f = open_gguf(model_path)
    desc = ModelDesc.from_gguf(f)
    floor = plan_at(desc).min_budget_bytes
    p = plan_at(desc, {"floor": floor, "middle": floor + desc.weight_bytes // 3, "all": 1 << 40}[where])
    led = Ledger(None, debug="")
    store = WeightStore(f, p, led, prefetch=prefetch)
    try:
        model = load_model(f, weights=store)
        toks, logits = greedy(model)
        assert toks == reference[0]
        np.testing.assert_array_equal(logits, reference[1])  # bytes are the same bytes
        st = store.stats()
        if where == "all":
            assert st["bytes_read"] >= desc.weight_bytes and p.units == []
        else:
            assert p.units and st["bytes_read"] > desc.weight_bytes  # streamed every token
            assert led.total("weight_cache") == st["slot_bytes"] > 0
        assert led.total("resident_weights") >= p.tier_bytes["pinned"]
        if where == "all":  # everything pinned: every get is a hit, nothing waits for I/O
            assert st["hit_rate"] == 1.0 and st["io_stall_s"] == 0.0
        else:  # the streamed units are read every token: some gets wait for their read
            assert 0.0 < st["hit_rate"] < 1.0 and st["io_stall_s"] > 0.0
        assert "hit rate" in store.format_stats()
    finally:
        store.close()
        f.close()
    assert led.total() == 0  # everything the store registered was given back


def test_streamed_bytes_per_token_match_plan(model_path):
    f = open_gguf(model_path)
    desc = ModelDesc.from_gguf(f)
    p = plan_at(desc)
    store = WeightStore(f, p)
    try:
        model = load_model(f, weights=store)
        cache = model.new_cache(64)
        model.forward(np.array([5], np.int32), cache)
        before = store.stats()["bytes_read"]
        model.forward(np.array([6], np.int32), cache)
        per_token = store.stats()["bytes_read"] - before
        # aligned reads of the planned file-tier bytes (the embedding rows are mmapped)
        streamed = p.disk_bytes_per_token - (desc.tensors[0].row_bytes if p.embedding_by_rows else 0)
        assert streamed <= per_token <= streamed + len(p.tiers["file"]) * 8192 + 2 * streamed // len(p.units)
    finally:
        store.close()
        f.close()


def test_store_records_its_streaming_rate_for_later_plans(model_path, tmp_path, monkeypatch):
    from memfit.memory import bandwidth as bwmod
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    f = open_gguf(model_path)
    desc = ModelDesc.from_gguf(f)
    p = plan_at(desc)
    store = WeightStore(f, p)
    try:
        if not store.direct:
            pytest.skip("O_DIRECT refused here (tmpfs): page-cache reads are never recorded")
        # a tiny model streams far below OBSERVE_MIN_BYTES; lower it to this run's volume
        monkeypatch.setattr(bwmod, "OBSERVE_MIN_BYTES", 1)
        model = load_model(f, weights=store)
        cache = model.new_cache(64)
        for tok in (5, 6, 7):
            model.forward(np.array([tok], np.int32), cache)
    finally:
        store.close()  # waits for the last prefetch, then records
        f.close()
    rate = store.stats()["stream_read_bytes_per_s"]
    assert rate > 0
    b = bwmod.get_bandwidth(model_path, measure=False)
    assert "observed" in b.source and b.disk_read_bytes_per_s == pytest.approx(rate)
