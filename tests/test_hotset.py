"""The learned hot set: routing counts recorded per model file in the user cache, reread at
the next load, where the hottest experts are pinned (and the hit rate changes); a corrupt or
foreign record is ignored with a warning, never a crash."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest

from memfit.gguf import open_gguf
from memfit.memory.bandwidth import Bandwidth
from memfit.memory.hotset import HotSetWarning, RoutingCounts, record_path
from memfit.memory.planner import ModelDesc, expert_slot_bytes, plan_for_path
from memfit.memory.store import WeightStore
from test_expert_cache import N_EXPERT, N_LAYER, check, write_moe

BW = Bandwidth(10e9, 1e9, "test")


@pytest.fixture
def model(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return write_moe(tmp_path / "moe.gguf", seed=4)


def budget_for(path, slots):
    with open_gguf(path) as f:
        desc = ModelDesc.from_gguf(f)
    big = plan_for_path(path, 1 << 40, n_ctx=64, threads=2, baseline_bytes=0, bandwidth=BW)
    fixed = big.baseline_bytes + big.scratch_bytes + big.kv_bytes + big.io_staging_bytes
    trunk = sum(t.nbytes for t in desc.tensors if t.kind != "expert")
    return fixed + trunk + slots * expert_slot_bytes(desc)


# layer 0's experts 0 and 1 every 5th call, between them a scan over all of layer 1: an LRU
# cache of 6 slots never keeps them; pinned, they always hit
SEQ = [(0, [0, 1]) if c % 5 == 0 else (1, [2 * ((c - c // 5 - 1) % 4), 2 * ((c - c // 5 - 1) % 4) + 1])
       for c in range(100)]


def run(path, budget):
    p = plan_for_path(path, budget, n_ctx=64, threads=2, baseline_bytes=0, bandwidth=BW)
    f = open_gguf(path)
    routing = RoutingCounts.load(path, p.n_layer, p.n_expert)
    store = WeightStore(f, p, routing=routing)
    try:
        for il, ex in SEQ:
            check(f, store.get_experts(il, ex), il, ex)
        return p, store.stats()
    finally:
        store.close()  # writes the record
        f.close()


def test_counts_roundtrip(model):
    rc = RoutingCounts.load(model, N_LAYER, N_EXPERT)
    assert not rc.counts.any() and not record_path(model).exists()
    rc.add(1, [3, 5])
    rc.add(1, [3])
    rc.save()
    again = RoutingCounts.load(model, N_LAYER, N_EXPERT)
    assert again.counts[1, 3] == 2 and again.counts[1, 5] == 1 and again.counts.sum() == 3
    assert again.by_layer() == {1: [0, 0, 0, 2, 0, 1, 0, 0]}


def test_hot_set_learned_in_one_run_is_pinned_at_the_next_and_raises_the_hit_rate(model):
    budget = budget_for(model, 6)
    p1, s1 = run(model, budget)
    assert p1.hot_experts == [] and p1.cache_slots == 6
    assert s1["expert_hit_rate"] < 0.05  # the scan evicts the hot pair every time
    rec = json.loads(record_path(model).read_text())
    assert rec["counts"][0][:2] == [20, 20] and sum(rec["counts"][1]) == 160
    p2, s2 = run(model, budget)
    # layer 0's pair is routed above its layer's mean; layer 1 is uniform: not hot
    assert p2.hot_experts == [(0, 0), (0, 1)] and p2.cache_slots == 4
    assert p2.hot_coverage == pytest.approx(40 / 200)
    assert s2["expert_hot_hits"] == 40 and s2["expert_hit_rate"] >= 0.2
    assert p2.planned_bytes <= budget and "hot experts" in p2.format()
    # the counts keep accumulating across runs
    assert json.loads(record_path(model).read_text())["counts"][0][:2] == [40, 40]


@pytest.mark.parametrize("what", ["corrupt", "foreign", "shape"])
def test_bad_record_is_ignored_with_a_warning(model, what):
    budget = budget_for(model, 6)
    run(model, budget)
    rp = record_path(model)
    rec = json.loads(rp.read_text())
    if what == "corrupt":
        rp.write_text(rp.read_text()[:40])
    elif what == "foreign":  # another file's counts under this path (the model was replaced)
        rec["model"]["header_sha256"] = "0" * 64
        rp.write_text(json.dumps(rec))
    else:
        rec["counts"] = rec["counts"][:1]
        rp.write_text(json.dumps(rec))
    with pytest.warns(HotSetWarning, match="another file" if what == "foreign" else "corrupt"):
        p = plan_for_path(model, budget, n_ctx=64, threads=2, baseline_bytes=0, bandwidth=BW)
    assert p.hot_experts == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HotSetWarning)
        p, st = run(model, budget)  # loads and runs; the record is rewritten from this run
    assert p.hot_experts == [] and st["expert_requests"] == 200
    assert json.loads(rp.read_text())["counts"][0][:2] == [20, 20]


def test_changed_model_file_is_not_credited_with_old_counts(model, tmp_path):
    run(model, budget_for(model, 6))
    shutil.copyfile(model, tmp_path / "tmp.gguf")
    os.replace(tmp_path / "tmp.gguf", model)  # same path, new mtime
    os.utime(model, ns=(1, 1))
    with pytest.warns(HotSetWarning, match="another file"):
        rc = RoutingCounts.load(model, N_LAYER, N_EXPERT)
    assert not rc.counts.any()


def test_expert_policy_from_the_environment(model, monkeypatch):
    from memfit.errors import RequestError
    budget = budget_for(model, 6)
    monkeypatch.setenv("MEMFIT_EXPERT_POLICY", "decay")
    p = plan_for_path(model, budget, n_ctx=64, threads=2, baseline_bytes=0, bandwidth=BW)
    assert p.expert_policy == "decay" and p.to_json()["expert_policy"] == "decay"
    with open_gguf(model) as f, WeightStore(f, p) as store:
        assert store.expert_policy.name == "decay"
    monkeypatch.setenv("MEMFIT_EXPERT_POLICY", "fifo")
    with pytest.raises(RequestError, match="'fifo'"):
        plan_for_path(model, budget, n_ctx=64, threads=2, baseline_bytes=0, bandwidth=BW)


def test_hot_set_and_lookahead_switches_from_the_environment(model, monkeypatch):
    """Ablation switches: MEMFIT_EXPERT_HOTSET=0 plans no hot set although counts are recorded;
    MEMFIT_EXPERT_LOOKAHEAD=0 makes the store ask for no router look-ahead."""
    from memfit.errors import RequestError
    budget = budget_for(model, 6)
    run(model, budget)  # records counts: layer 0's pair is hot at the next load
    kw = dict(n_ctx=64, threads=2, baseline_bytes=0, bandwidth=BW)
    assert plan_for_path(model, budget, **kw).hot_experts == [(0, 0), (0, 1)]
    monkeypatch.setenv("MEMFIT_EXPERT_HOTSET", "0")
    p = plan_for_path(model, budget, **kw)
    assert p.hot_experts == [] and p.cache_slots == 6
    with open_gguf(model) as f, WeightStore(f, p) as store:
        assert store.wants_expert_prediction
    monkeypatch.setenv("MEMFIT_EXPERT_LOOKAHEAD", "0")
    with open_gguf(model) as f, WeightStore(f, p) as store:
        assert not store.wants_expert_prediction
        check(f, store.get_experts(1, [2, 3]), 1, [2, 3])
    monkeypatch.setenv("MEMFIT_EXPERT_HOTSET", "no")
    with pytest.raises(RequestError, match="MEMFIT_EXPERT_HOTSET='no'"):
        plan_for_path(model, budget, **kw)
