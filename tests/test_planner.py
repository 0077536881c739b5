"""The planner as a pure function: floor refusal, tier priorities, disk bytes/token math."""

from __future__ import annotations

import numpy as np
import pytest

from memfit.errors import BudgetError
from memfit.memory.bandwidth import Bandwidth
from memfit.memory.planner import (IO_STAGING_BYTES, ModelDesc, describe_tensor, plan,
                                   plan_for_path, scratch_bytes)

MiB = 1 << 20
BW = Bandwidth(10e9, 1e9, "test")


def toy(n_layer=4, layer_mb=10, out_mb=8, tied=False, experts=0, used=0):
    """Hand-made dense (or MoE) model: per layer norms + attn 4 MiB + ffn (layer_mb - 4) MiB."""
    ts = [describe_tensor("token_embd.weight", out_mb * MiB, (1000, 64), tied)]
    for i in range(n_layer):
        p = f"blk.{i}."
        ts += [describe_tensor(p + "attn_norm.weight", 256, (64,)),
               describe_tensor(p + "attn_q.weight", 2 * MiB, (64, 64)),
               describe_tensor(p + "attn_output.weight", 2 * MiB, (64, 64)),
               describe_tensor(p + "ffn_norm.weight", 256, (64,))]
        if experts:
            ts += [describe_tensor(p + "ffn_gate_inp.weight", 64 * 1024, (experts, 64)),
                   describe_tensor(p + "ffn_up_exps.weight", experts * MiB, (experts, 64, 64),
                                   n_expert=experts, n_used=used)]
        else:
            ts += [describe_tensor(p + "ffn_up.weight", (layer_mb - 4) * MiB, (64, 64))]
    ts.append(describe_tensor("output_norm.weight", 256, (64,)))
    if not tied:
        ts.append(describe_tensor("output.weight", out_mb * MiB, (1000, 64)))
    return ModelDesc("llama", n_layer, 64, 4, 2, 16, 16, 1000, 128, tuple(ts),
                     n_expert=experts, n_expert_used=used, tied_output=tied, name="toy")


def fixed_bytes(m, n_ctx=128, threads=2, baseline=10 * MiB, n_batch=64):
    p = plan(m, 10**12, n_ctx, threads, BW, baseline_bytes=baseline, n_batch=n_batch)
    return p.baseline_bytes + p.scratch_bytes + p.kv_bytes + IO_STAGING_BYTES


def test_floor_refusal_names_minimum_and_floor_is_exact():
    m = toy()
    big = plan(m, 10**12, 128, 2, BW, baseline_bytes=10 * MiB, n_batch=64)
    floor = big.min_budget_bytes
    # two layer units (10 MiB + two 256 B norms) stream; fixed part + 2 units
    layer = sum(t.nbytes for t in m.tensors if t.layer == 0)
    assert layer == 10 * MiB + 512 and floor == fixed_bytes(m) + 2 * layer
    with pytest.raises(BudgetError) as e:
        plan(m, floor - 1, 128, 2, BW, baseline_bytes=10 * MiB, n_batch=64)
    msg = str(e.value)
    assert str(floor) in msg and "MiB" in msg and "smallest budget" in msg
    p = plan(m, floor, 128, 2, BW, baseline_bytes=10 * MiB, n_batch=64)
    assert p.planned_bytes <= floor and p.stream_slot_bytes == 2 * layer


def test_floor_pins_an_outlier_unit_instead_of_double_buffering_it():
    m = toy(out_mb=40, tied=True)  # tied 40 MiB embedding is also the output matrix
    p = plan(m, 10**12, 128, 2, BW, baseline_bytes=10 * MiB, n_batch=64)
    # pinning the 40 MiB unit once beats two 40 MiB slots
    assert p.min_budget_bytes == fixed_bytes(m) + 40 * MiB + 2 * (10 * MiB + 512)
    tight = plan(m, p.min_budget_bytes, 128, 2, BW, baseline_bytes=10 * MiB, n_batch=64)
    assert tight.tier_of("token_embd.weight") == "pinned"
    assert tight.embedding_by_rows is None


def test_everything_pinned_when_it_fits():
    m = toy()
    p = plan(m, 10**10, 128, 2, BW, baseline_bytes=10 * MiB)
    assert p.tiers["file"] == [] and p.disk_bytes_per_token == 0 and p.units == []
    assert p.stream_slot_bytes == 0
    assert p.predicted_tg_tokens_per_s == pytest.approx(BW.mem_read_bytes_per_s / p.mem_bytes_per_token)


def test_priorities_norms_then_attention_then_ffn_and_embedding_last():
    m = toy()
    base = fixed_bytes(m)
    # with attention pinned the largest streamed unit is output.weight (8 MiB > 6 MiB ffn):
    # room for 2 slots of it, all norms and attention (16 MiB) and a bit
    budget = base + 2 * 8 * MiB + 16 * MiB + 4096 + MiB
    p = plan(m, budget, 128, 2, BW, baseline_bytes=10 * MiB, n_batch=64)
    pinned = set(p.tiers["pinned"])
    assert all(f"blk.{i}.attn_norm.weight" in pinned for i in range(4))
    assert all(f"blk.{i}.attn_q.weight" in pinned and f"blk.{i}.attn_output.weight" in pinned
               for i in range(4))
    assert not any("ffn_up" in n for n in pinned)
    assert "token_embd.weight" not in pinned and p.embedding_by_rows == "token_embd.weight"
    assert p.stream_slot_bytes == 2 * 8 * MiB
    assert [u.name for u in p.units] == ["blk.0", "blk.1", "blk.2", "blk.3", "output.weight"]
    assert p.planned_bytes <= budget


def test_disk_bytes_per_token_and_prediction():
    m = toy()
    base = fixed_bytes(m)
    budget = base + 2 * (10 * MiB + 512) + 1024  # only norms fit beside the slots
    p = plan(m, budget, 128, 2, BW, baseline_bytes=10 * MiB, n_batch=64)
    big = [t.name for t in m.tensors if t.kind in ("attn", "ffn", "output")]
    assert set(big) <= set(p.tiers["file"])      # nothing larger than a norm fits
    streamed = sum(t.nbytes for t in m.tensors if t.name in p.tiers["file"] and t.kind != "embedding")
    assert 4 * 10 * MiB + 8 * MiB <= streamed < 4 * 10 * MiB + 8 * MiB + 4096
    emb_row = 8 * MiB // 1000                    # one embedding row per token
    assert p.disk_bytes_per_token == streamed + emb_row
    touched = sum(t.touched_per_token for t in m.tensors)
    assert p.mem_bytes_per_token == touched
    t = max(touched / 10e9, (streamed + emb_row) / 1e9)
    assert p.predicted_tg_tokens_per_s == pytest.approx(1 / t)
    serial = plan(m, budget, 128, 2, BW, baseline_bytes=10 * MiB, n_batch=64, overlap_io=False)
    assert serial.predicted_tg_tokens_per_s == pytest.approx(1 / (touched / 10e9 + (streamed + emb_row) / 1e9))
    assert any("~0%" in n for n in p.notes)  # LRU over a cyclic scan: said, not pretended
    j = p.to_json()
    for k in ("min_budget_bytes", "disk_bytes_per_token", "predicted_tg_tokens_per_s"):
        assert k in j
    assert "file tier" in p.format()


def test_batch_lowered_before_refusing():
    m = toy()
    hi = scratch_bytes(m, 512, 128, 2)
    lo = scratch_bytes(m, 64, 128, 2)
    assert hi > lo
    p = plan(m, fixed_bytes(m, n_batch=64) + 2 * (10 * MiB + 512), 128, 2, BW,
             baseline_bytes=10 * MiB, n_batch=512)
    assert p.n_batch == 64 and any("prefill batch" in n for n in p.notes)


def test_scratch_plans_what_a_process_does_at_once():
    """The logits a step returns (a verify step: a row per proposed token of every sequence),
    perplexity's slices where a process may score, the prompt being tokenized: beside the
    forward in `serve` (another request computes meanwhile), its maximum elsewhere."""
    from memfit.memory.planner import LOGITS_SLICE_ROWS, PROMPT_SCRATCH_BYTES
    import dataclasses
    m = dataclasses.replace(toy(), n_vocab=200_000)
    base = scratch_bytes(m, 512, 128, 2, scoring=False)
    # the sampled rows: f32 each, bounded by the batch
    assert scratch_bytes(m, 512, 128, 2, sample_rows=4 * 17, scoring=False) - base == 4 * 67 * 200_000
    assert scratch_bytes(m, 64, 128, 2, sample_rows=1000, scoring=False) == \
        scratch_bytes(m, 64, 128, 2, sample_rows=64, scoring=False)
    # scoring: perplexity's slices unless the step's rows are more
    assert scratch_bytes(m, 512, 128, 2) - base == 200_000 * (16 * LOGITS_SLICE_ROWS - 20)
    assert scratch_bytes(m, 512, 128, 2, sample_rows=68) == \
        scratch_bytes(m, 512, 128, 2, sample_rows=68, scoring=False)
    # the prompt: added while serving, the larger of the two otherwise
    serve = scratch_bytes(m, 512, 128, 2, scoring=False, tokenize=True, serving=True)
    assert serve - base == PROMPT_SCRATCH_BYTES
    run = scratch_bytes(m, 512, 128, 2, tokenize=True)
    assert scratch_bytes(m, 512, 128, 2) <= run < scratch_bytes(m, 512, 128, 2) + PROMPT_SCRATCH_BYTES
    # the whole plan: serving with 4 speculating sequences holds more than one plain run
    runp = plan(m, 10**12, 128, 2, BW, baseline_bytes=0)
    srv = plan(m, 10**12, 128, 2, BW, baseline_bytes=0, serving=True, n_parallel=4, draft_rows=16)
    assert srv.scratch_bytes - runp.scratch_bytes == \
        200_000 * (4 * 68 + 16 - 16 * LOGITS_SLICE_ROWS) + PROMPT_SCRATCH_BYTES


def test_kv_scales_with_context_and_enters_floor():
    m = toy()
    assert m.kv_bytes_per_token == 4 * 2 * (16 + 16) * 4
    a = plan(m, 10**12, 128, 2, BW, baseline_bytes=10 * MiB, n_batch=64)
    b = plan(m, 10**12, 4096, 2, BW, baseline_bytes=10 * MiB, n_batch=64)
    assert b.kv_bytes == 32 * a.kv_bytes
    assert b.min_budget_bytes - a.min_budget_bytes >= b.kv_bytes - a.kv_bytes


def test_moe_experts_pinned_whole_when_they_fit_else_cached_with_stated_hit_rate():
    m = toy(experts=8, used=2)
    p = plan(m, 10**12, 128, 2, BW, baseline_bytes=10 * MiB, n_batch=64)
    assert p.tiers["cache"] == [] and p.cache_hit_rate == 1.0 and p.disk_bytes_per_token == 0
    assert all(f"blk.{i}.ffn_up_exps.weight" in p.tiers["pinned"] for i in range(4))
    slot = MiB + 4096  # one expert's slice, page-aligned: at most one page more
    dense = sum(t.nbytes for t in m.tensors if t.kind != "expert")
    budget = fixed_bytes(m) + dense + 16 * slot  # 16 expert slots of 32
    q = plan(m, budget, 128, 2, BW, baseline_bytes=10 * MiB, n_batch=64)
    assert all("exps" in n for n in q.tiers["cache"]) and len(q.tiers["cache"]) == 4
    # the untied token embedding (read one row per token) is not held while experts miss:
    # its bytes are expert slots
    emb = next(t for t in m.tensors if t.kind == "embedding")
    n = 16 + emb.nbytes // slot
    assert q.cache_slot_bytes == slot and q.tiers["file"] == [emb.name]
    assert q.embedding_by_rows == emb.name
    assert q.cache_slots == n and q.cache_hit_rate == pytest.approx(n / 32)
    assert q.disk_bytes_per_token == pytest.approx(4 * 2 * MiB * (1 - n / 32) + emb.touched_per_token,
                                                   abs=1)
    assert any("uniform routing" in n for n in q.notes)
    j = q.to_json()
    assert (j["expert_cache_bytes"], j["expert_slots"], j["expected_hit_rate"]) == (
        n * slot, n, pytest.approx(n / 32))
    assert q.planned_bytes <= budget
    text = q.format()
    assert f"{n} slots" in text and f"hit rate >= {n / 32:.0%}" in text


def test_moe_floor_is_trunk_floor_plus_one_layers_k_slots():
    m = toy(experts=8, used=2)
    p = plan(m, 10**12, 128, 2, BW, baseline_bytes=10 * MiB, n_batch=64)
    slot = MiB + 4096
    # trunk: output.weight (8 MiB) is its largest unit and streams through 2 slots
    assert p.floor_parts["expert_slot_bytes"] == 2 * slot
    assert p.floor_parts["weights_bytes"] == 2 * 8 * MiB + 2 * slot
    assert p.min_budget_bytes == fixed_bytes(m) + 2 * 8 * MiB + 2 * slot
    with pytest.raises(BudgetError) as e:
        plan(m, p.min_budget_bytes - 1, 128, 2, BW, baseline_bytes=10 * MiB, n_batch=64)
    assert "expert slots for one layer" in str(e.value)
    q = plan(m, p.min_budget_bytes, 128, 2, BW, baseline_bytes=10 * MiB, n_batch=64)
    assert q.cache_slots == 2 and q.planned_bytes <= p.min_budget_bytes


def test_hot_set_from_counts_is_pinned_before_the_cache_is_sized():
    m = toy(experts=8, used=2)
    slot = MiB + 4096
    # the trunk without the untied token embedding (read by rows while experts miss)
    dense = sum(t.nbytes for t in m.tensors if t.kind not in ("expert", "embedding"))
    budget = fixed_bytes(m) + dense + 10 * slot
    counts = {il: [100, 50, 1, 1, 1, 1, 1, 1] for il in range(4)}
    p = plan(m, budget, 128, 2, BW, baseline_bytes=10 * MiB, n_batch=64, expert_counts=counts)
    # half of the room above one layer's 2 slots goes to the hot set: 4 experts
    assert p.hot_experts == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert p.hot_bytes == 4 * slot and p.cache_slots == 6
    assert p.hot_coverage == pytest.approx(4 * 100 / (4 * 156))
    assert p.planned_bytes <= budget
    assert p.breakdown()["resident_weights"] == p.tier_bytes["pinned"] + p.hot_bytes
    assert "hot experts" in p.format() and p.to_json()["hot_experts"][0] == [0, 0]
    cold = plan(m, budget, 128, 2, BW, baseline_bytes=10 * MiB, n_batch=64)
    assert cold.hot_experts == [] and cold.cache_slots == 10
    assert cold.cache_hit_rate == p.cache_hit_rate  # uniform: same share of experts held


def test_plan_for_real_gguf(tmp_path):
    from memfit.synth import synth
    path = synth(tmp_path / "t.gguf", "llama", "tiny", "Q4_K_M", progress=False).path
    full = plan_for_path(path, 4 << 30, n_ctx=256, threads=2, baseline_bytes=50 * MiB,
                         bandwidth=BW)
    assert full.tiers["file"] == [] and full.arch == "llama" and full.n_layer == 4
    assert full.weight_bytes < path.stat().st_size
    floor = full.min_budget_bytes
    tight = plan_for_path(path, floor, n_ctx=256, threads=2, baseline_bytes=50 * MiB,
                          bandwidth=BW)
    assert tight.disk_bytes_per_token > 0 and tight.planned_bytes <= floor
    with pytest.raises(BudgetError):
        plan_for_path(path, floor - 1, n_ctx=256, threads=2, baseline_bytes=50 * MiB,
                      bandwidth=BW)


def test_plan_bandwidth_prefers_store_observed_rate_over_probe(tmp_path, monkeypatch):
    # the store's own streaming rate (re-reads of the same bytes) beats the cold probe's
    import json

    from memfit.memory import bandwidth as bwmod
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    f = tmp_path / "w.bin"
    f.write_bytes(b"x" * 8192)
    key = bwmod.device_key(f)
    bwmod.cache_path().parent.mkdir(parents=True)
    bwmod.cache_path().write_text(json.dumps({"mem": {bwmod.machine_key(): 20e9},
                                              "disk": {key: 0.8e9}}))
    b = bwmod.get_bandwidth(f, measure=False)
    assert (b.disk_read_bytes_per_s, b.source) == (0.8e9, "cached")
    assert bwmod.record_observed_disk(f, bwmod.OBSERVE_MIN_BYTES - 1, 1.0) is None  # too little
    assert bwmod.get_bandwidth(f, measure=False).source == "cached"
    assert bwmod.record_observed_disk(f, 16 << 30, 8.0) == (16 << 30) / 8.0
    b = bwmod.get_bandwidth(f, measure=False)
    assert (b.disk_read_bytes_per_s, b.source) == ((16 << 30) / 8.0, "cached+observed")
    # a smaller, slower run shifts the volume-weighted rate, not to its own rate
    r = bwmod.record_observed_disk(f, 8 << 30, 8.0)
    assert r == pytest.approx((24 << 30) / 16.0)
    # a run of the whole window's volume replaces the record entirely
    r = bwmod.record_observed_disk(f, 32 << 30, 32.0)
    assert r == pytest.approx(float(1 << 30))
    assert b.mem_read_bytes_per_s == 20e9
    assert bwmod.get_bandwidth(f, measure=False, refresh=True).source == "default"


def test_server_bytes_are_a_fixed_cost():
    """What `memfit serve` keeps between requests (the Responses store) is planned like the
    draft: the floor and the planned bytes grow by it, it has its own ledger category, and
    the weights get that much less under the same budget."""
    m = toy(experts=8, used=2)
    budget = fixed_bytes(m) + 40 * MiB
    base = plan(m, budget, 128, 2, BW, baseline_bytes=10 * MiB, n_batch=64)
    srv = plan(m, budget, 128, 2, BW, baseline_bytes=10 * MiB, n_batch=64,
               server_bytes=3 * MiB)
    assert srv.min_budget_bytes == base.min_budget_bytes + 3 * MiB
    assert srv.breakdown()["server"] == 3 * MiB and base.breakdown()["server"] == 0
    assert srv.planned_bytes <= budget and srv.cache_bytes < base.cache_bytes
    assert "Responses store" in srv.format() and srv.to_json()["server_bytes"] == 3 * MiB
    with pytest.raises(BudgetError, match="Responses store 3.00 MiB"):
        plan(m, srv.min_budget_bytes - 1, 128, 2, BW, baseline_bytes=10 * MiB, n_batch=64,
             server_bytes=3 * MiB)


def test_random_read_probe_reads_the_region_it_is_given(tmp_path):
    """measure_disk_random (benchmarks/moe_bench.py's bound): random aligned requests inside
    [lo, hi) of a real file; a region smaller than one request is an OSError, not a hang."""
    from memfit.memory import bandwidth as bwmod
    f = tmp_path / "w.bin"
    f.write_bytes(np.random.default_rng(5).integers(0, 256, 6 << 20, dtype=np.uint8).tobytes())
    try:
        bps = bwmod.measure_disk_random(f, 256 << 10, lo=1 << 20, hi=5 << 20, max_s=0.2)
    except OSError as e:  # a file system without O_DIRECT (tmpfs)
        pytest.skip(f"no O_DIRECT here: {e}")
    assert bps > 0
    with pytest.raises(OSError, match="smaller than one request"):
        bwmod.measure_disk_random(f, 1 << 20, lo=1 << 20, hi=(1 << 20) + 8192)
