"""The hard memory budget on a mixture-of-experts model, end to end (issue 8): real
`python -m memfit` processes on a synthetic qwen3moe (220 MiB, 32 experts of which 4 are
routed per token, 8 layers) whose peak RSS (VmHWM) is read from /proc, at 100% and 50% of the
file and at the floor `memfit plan` states: within the budget, greedy ids and top-5
log-probabilities identical to the unconstrained run; below the floor refused before loading
with the minimum named; and the late-refusal regression (a MoE file under a budget used to
die with exit 70 "internal error" in store.py after reading the weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_budget_e2e import MiB, memfit

PROMPT = "The quick brown fox jumps"
N_GEN = 6
CTX = 128
MOE = dict(n_embd=512, n_layer=8, n_head=4, n_head_kv=2, head_dim=128, n_expert=32,
           n_expert_used=4, n_ff_exp=1024, n_ctx=512)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    from memfit.models.synthetic import write_tiny_model
    return write_tiny_model(tmp_path_factory.mktemp("moe_e2e") / "qwen3moe-220m.gguf",
                            "qwen3moe", "Q4_0", seed=7, **MOE)


def run(model, budget=None, cache=None):
    args = ["run", model, "-p", PROMPT, "-n", N_GEN, "--temp", 0, "--json", "-c", CTX,
            "--top-logprobs", 5]
    if budget is not None:
        args += ["--mem-budget", budget]
    env = {"MEMFIT_DEBUG_LEDGER": "1"} if budget is not None else {}
    if cache is not None:
        env["XDG_CACHE_HOME"] = str(cache)
    return memfit(*args, env=env)


@pytest.fixture(scope="module")
def reference(moe_model, tmp_path_factory):
    r = run(moe_model, cache=tmp_path_factory.mktemp("ref_cache"))
    d = r.json()
    assert len(d["ids"]) == N_GEN and "store" not in d
    return d, r


def floor_of(model) -> int:
    return memfit("plan", model, "--mem-budget", "64GiB", "-c", CTX, "--json",
                  "--no-measure").json()["min_budget_bytes"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["100%", "50%", "floor"])
def test_moe_within_budget_identical_greedy(moe_model, reference, tmp_path, where):
    ref, unconstrained = reference
    size = moe_model.stat().st_size
    floor = floor_of(moe_model)
    budget = {"100%": size, "50%": size // 2, "floor": floor}[where]
    assert floor < size // 2 < size  # the test model keeps all three points meaningful
    r = run(moe_model, budget, cache=tmp_path)
    assert r.rc == 0 and "internal error" not in r.err, r.err[-3000:]
    d = r.json()
    print(f"{where}: budget {budget / MiB:.1f} MiB, peak RSS {r.peak_rss / MiB:.1f} MiB, "
          f"store {d['store']}")
    assert r.peak_rss <= budget, (r.peak_rss / MiB, budget / MiB)
    assert d["peak_rss_bytes"] <= budget and d["mem_budget_bytes"] == budget
    assert d["ids"] == ref["ids"], "greedy tokens differ from the unconstrained run"
    assert d["top"] == ref["top"], "top-5 log-probabilities differ"
    st = d["store"]
    if where != "100%":
        assert unconstrained.peak_rss > size * 0.9  # memory-mapped whole without a budget
        assert st["expert_misses"] > 0 and 0.0 <= st["expert_hit_rate"] < 1.0
        # experts missed were read from the file (how much depends on the cache the budget
        # leaves: more room, fewer reads)
        assert st["bytes_read"] >= st["expert_demand_bytes"] > 0
        assert {"prefetch_recall", "prefetch_wasted_bytes", "expert_hits"} <= set(st)
    if where == "floor":
        assert st["expert_slots"] == MOE["n_expert_used"]
    if where != "100%":
        # the budget is used, within 10% below it (at 100% the expert cache has 3x more slots
        # than this 6-token run routes distinct experts: slots are resident once filled)
        # (less the reserve every plan keeps for templating and tokenizing a prompt, which a
        # 6-token prompt does not touch: planner.PROMPT_SCRATCH_BYTES)
        from memfit.memory.planner import PROMPT_SCRATCH_BYTES
        assert r.peak_rss >= 0.9 * (budget - PROMPT_SCRATCH_BYTES), (r.peak_rss / MiB, budget / MiB)


@pytest.mark.timeout(120)
def test_moe_plan_prints_the_expert_tier(moe_model):
    size = moe_model.stat().st_size
    j = memfit("plan", moe_model, "--mem-budget", size // 2, "-c", CTX, "--json",
               "--no-measure").json()
    assert j["expert_slots"] > MOE["n_expert_used"] and j["expert_cache_bytes"] > 0
    assert 0 < j["expected_hit_rate"] < 1 and j["disk_bytes_per_token"] > 0
    t = memfit("plan", moe_model, "--mem-budget", size // 2, "-c", CTX, "--no-measure")
    assert t.rc == 0 and f"cache {j['expert_slots']} slots" in t.out
    assert "hot experts" in t.out and "uniform routing" in t.out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["run", "plan"])
def test_moe_below_floor_refused_before_loading(moe_model, tmp_path, command):
    floor = floor_of(moe_model)
    extra = ["-p", PROMPT, "-n", 2] if command == "run" else []
    r = memfit(command, moe_model, *extra, "-c", CTX, "--mem-budget", floor - 1,
               env={"XDG_CACHE_HOME": str(tmp_path)})
    assert r.rc == 1 and "Traceback" not in r.err and "internal error" not in r.err
    assert "below the floor" in r.err and "expert slots for one layer" in r.err
    assert f"raise --mem-budget to at least {-(-floor // MiB)}MiB" in r.err
    assert r.seconds < 5.0 and r.peak_rss < 120 * MiB  # nothing was read
    assert not any(tmp_path.rglob("*.json"))


@pytest.mark.timeout(120)
def test_unsupported_moe_architecture_refused_before_the_store_reads(tmp_path):
    # the late-refusal bug's other half: an architecture memfit cannot run is refused before
    # the weight store pins anything (it used to read the weights first)
    from test_expert_cache import write_moe
    path = write_moe(tmp_path / "grok.gguf", arch="grok")
    r = memfit("run", path, "-p", "hi", "-n", 2, "--mem-budget", "1GiB")
    assert r.rc == 1 and "not supported" in r.err and "internal error" not in r.err, r.err


@pytest.mark.timeout(300)
def test_run_and_bench_report_expert_statistics(moe_model, tmp_path):
    budget = moe_model.stat().st_size // 2
    r = memfit("run", moe_model, "-p", PROMPT, "-n", 3, "--temp", 0, "-c", CTX,
               "--mem-budget", budget, env={"XDG_CACHE_HOME": str(tmp_path)})
    assert r.rc == 0, r.err
    line = next(x for x in r.err.splitlines() if x.startswith("memfit: prompt"))
    assert "experts: hit rate" in line and "prefetch recall" in line and "wasted" in line
    b = memfit("bench", moe_model, "-p", 8, "-n", 4, "-r", 1, "--json", "--mem-budget", budget,
               env={"XDG_CACHE_HOME": str(tmp_path)})
    assert b.rc == 0, b.err
    rows = [json.loads(x) for x in b.out.splitlines() if x.strip()]
    assert [row["test"] for row in rows] == ["pp8", "tg4"]
    for row in rows:
        assert 0.0 <= row["expert_hit_rate"] <= 1.0 and 0.0 <= row["prefetch_recall"] <= 1.0
        assert row["bytes_read_per_token"] > 0 and row["peak_rss_bytes"] <= budget
        # the stall of this test alone, per token (io_stall_s is the running total)
        assert 0.0 <= row["io_stall_per_token_s"] * int(row["test"][2:]) * 2 <= row["io_stall_s"]
        # its experts' part: on misses read on demand, and on prefetches still in flight
        split = row["io_stall_demand_per_token_s"] + row["io_stall_prefetch_per_token_s"]
        assert 0.0 <= split <= row["io_stall_per_token_s"] + 1e-9
        assert row["expert_demand_bytes_per_token"] >= 0
    t = memfit("bench", moe_model, "-p", 8, "-n", 4, "-r", 1, "--mem-budget", budget,
               env={"XDG_CACHE_HOME": str(tmp_path)})
    assert t.rc == 0, t.err
    head = next(x for x in t.out.splitlines() if x.startswith("| model"))
    assert "expert hits" in head and "prefetch recall" in head and "read/token" in head
    assert "stall/token (on misses)" in head
