"""One load, one plan (issue 17, items 6-7): `memfit plan` shows the configuration that `run`
and `serve` then use (context, KV, resident and streamed bytes), the context is fitted by one
rule for every command (serve's -np included), and a load describes the GGUF, reads the
bandwidth record and the routing counts once."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import httpx
import pytest

from _server import ServerProcess

MiB = 1 << 20


def memfit(*args, check=True) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "memfit", *map(str, args)], capture_output=True,
                       text=True, timeout=300)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def plan_json(model, *args) -> dict:
    return json.loads(memfit("plan", model, "--no-measure", "--json", *args).stdout)


def same_config(plan: dict, load: dict) -> None:
    assert load["weight_store"] is True
    assert load["n_ctx"] == plan["n_ctx"]
    assert load["n_parallel"] == plan["n_parallel"]
    assert load["n_batch"] == plan["n_batch"]
    assert load["kv_bytes"] == plan["kv_bytes"]
    assert load["pinned_bytes"] == plan["tiers"]["pinned"]["bytes"]
    assert load["streamed_tensors"] == plan["tiers"]["file"]["n_tensors"]
    assert load["disk_bytes_per_token"] == plan["disk_bytes_per_token"]
    assert load["planned_bytes"] == plan["planned_bytes"]


@pytest.mark.realmodel
@pytest.mark.parametrize("budget,ctx", [("280MiB", None), ("200MiB", None), ("200MiB", 512),
                                        ("170MiB", None)])
def test_plan_shows_what_run_uses(smollm2_path, budget, ctx):
    extra = ["-c", ctx] if ctx else []
    p = plan_json(smollm2_path, "--mem-budget", budget, *extra)
    r = memfit("run", smollm2_path, "-p", "Hello", "-n", 2, "--temp", 0, "--json", "-t", 2,
               "--mem-budget", budget, *extra)
    d = json.loads(r.stdout)
    same_config(p, d["load"])
    if ctx:
        assert p["n_ctx"] == ctx
    else:  # the rule: the default when it fits resident, else lowered (never refused here)
        assert 256 <= p["n_ctx"] <= 4096
        if p["n_ctx"] < 4096:
            assert any("not the default 4096" in n for n in p["load_notes"])
    if budget == "280MiB" and not ctx:  # the whole model fits at a lowered context
        assert p["disk_bytes_per_token"] == 0 and p["n_ctx"] < 4096
    assert d["peak_rss_bytes"] <= p["budget_bytes"]


@pytest.mark.realmodel
def test_text_plan_and_run_start_up_line_agree(smollm2_path):
    p = plan_json(smollm2_path, "--mem-budget", "200MiB")
    text = memfit("plan", smollm2_path, "--no-measure", "--mem-budget", "200MiB").stdout
    assert f"KV cache (ctx {p['n_ctx']})" in text
    r = memfit("run", smollm2_path, "-p", "Hello", "-n", 2, "--temp", 0, "-t", 2,
               "--mem-budget", "200MiB")
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("memfit: loaded"))
    assert f"{p['n_ctx']} ctx" in line
    assert f"streamed {p['disk_bytes_per_token'] / MiB:.0f} MiB/token" in line


@pytest.mark.realmodel
def test_serve_fits_the_context_for_its_slots_as_plan_shows(smollm2_path):
    """`serve --mem-budget 300MiB -np 4` used to be refused (the default context for 4 slots
    is below the floor); now it lowers the context by the same rule as `plan --serve -np 4`
    (--serve: serve's web stack and structured-output tables are in its baseline; without
    it the plan is run's, which holds more weights)."""
    p = plan_json(smollm2_path, "--mem-budget", "300MiB", "-np", 4, "--serve")
    run_plan = plan_json(smollm2_path, "--mem-budget", "300MiB", "-np", 4)
    assert run_plan["baseline_bytes"] < p["baseline_bytes"]
    assert p["n_parallel"] == 4 and p["n_ctx"] < 4096
    srv = ServerProcess([str(smollm2_path), "--mem-budget", "300MiB", "-np", "4", "-t", "2"])
    try:
        out = "".join(srv.lines)
        m = re.search(r"plan: budget .* ctx (\d+) x (\d+), KV (\d+) MiB", out)
        assert m, out
        assert (int(m.group(1)), int(m.group(2))) == (p["n_ctx"], 4)
        assert int(m.group(3)) == round(p["kv_bytes"] / MiB)
        srv.wait_for(f"ctx {p['n_ctx']})")  # the ready line: the load used that plan
        r = httpx.post(srv.url + "/v1/completions", json={
            "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        srv.stop()


COUNT_LOAD = ("import json, sys\n"
              "from memfit.api import Model\n"
              "from memfit.memory.planner import COUNTS\n"
              "kw = json.loads(sys.argv[2])\n"
              "with Model(sys.argv[1], threads=2, **kw) as m:\n"
              "    m.generate('Hello', max_tokens=2, temperature=0)\n"
              "    print(json.dumps([dict(COUNTS), m.n_ctx]))\n")


def _counts_of_load(path, **kw) -> tuple[dict, int]:
    """The planner's work counters after one load (and a generation) in a fresh process: its
    own RSS is the baseline the plan measures, as for any user's load."""
    env = {k: v for k, v in os.environ.items() if k != "MEMFIT_MEM_BUDGET"}
    p = subprocess.run([sys.executable, "-c", COUNT_LOAD, str(path), json.dumps(kw)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    counts, n_ctx = json.loads(p.stdout)
    return counts, n_ctx


@pytest.mark.realmodel
@pytest.mark.parametrize("budget", ["280MiB", "200MiB", None])
def test_one_load_describes_the_file_once(smollm2_path, budget):
    counts, n_ctx = _counts_of_load(smollm2_path, mem_budget=budget)
    assert counts["describe"] == 1 and counts["bandwidth"] == 1
    assert counts.get("routing", 0) == 0
    # fitting the context bisects with the pure planner only (memoized): the default, up to
    # log2(4096 / 256) for residency, as many for streaming and for the budget, q8_0 KV
    assert 1 <= counts["plan"] <= 16
    if budget == "280MiB":
        assert n_ctx < 4096


def test_one_load_of_a_moe_model_reads_its_routing_counts_once(tmp_path, monkeypatch):
    from memfit.models.synthetic import write_tiny_model
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the child inherits it
    path = write_tiny_model(tmp_path / "moe.gguf", "qwen3moe", "Q4_0", seed=3, n_embd=256,
                            n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_expert=16,
                            n_expert_used=2, n_ff_exp=256, n_ctx=512)
    # the routing counts are read for the plan's hot set and kept for the store: once
    counts, _ = _counts_of_load(path, mem_budget="64GiB", n_ctx=128)
    assert counts["describe"] == 1 and counts["bandwidth"] == 1 and counts["routing"] == 1
    assert counts["plan"] == 1  # a context the user set: one plan


def _peak_of(*args) -> tuple[int, dict]:
    """(VmHWM of a `python -m memfit` process at exit, its --json output)."""
    from test_budget_e2e import memfit as measured
    r = measured(*args)
    return r.peak_rss, r.json()


@pytest.mark.realmodel
@pytest.mark.timeout(300)
@pytest.mark.parametrize("budget_mib", [170, 200])
def test_a_streaming_run_uses_the_budget(smollm2_path, tmp_path, budget_mib):
    """SmolLM2 at 200 MiB with -c 512 used to peak at 132 MiB (66%) while streaming 52 MiB of
    weights per token. A prompt of nearly one full prefill batch (the scratch the plan holds)
    now peaks within 10% below the budget (issue 17's target): the runtime's memory predicted
    from the file, the tokenizer's build peak before any weight, and a plan for what a process
    does at once (a `run` tokenizes its prompt before its forward, not beside it; a step's
    logits rows, not perplexity's slices beside the prompt reserve). Measured on the Xeon:
    0.91 at 170 MiB, 0.92 at 200 (0.85-0.88 before the last) with a 440-token prompt; on a
    Zen 4 the 440-token prompt peaked at 0.897-0.905 of 170 MiB (the scratch of the 72 rows it
    leaves unused is ~2% of the budget), so the prompt is 500 tokens: 0.918 at 170, 0.931 at 200."""
    words = ("time people year way day man thing woman life child world school state family "
             "student group country problem hand part place case week company system").split()
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(" ".join(words[(i * 7 + i // 5) % len(words)] for i in range(500)))
    budget = budget_mib * MiB
    peak, d = _peak_of("run", smollm2_path, "-f", prompt, "-n", 4, "--temp", 0, "--json",
                       "-c", 512, "-t", 2, "--mem-budget", budget)
    assert 480 < len(d["prompt_ids"]) < 512 and d["load"]["streamed_tensors"] > 0
    assert peak <= budget
    assert peak >= 0.9 * budget, (peak / MiB, budget_mib)  # was 66% at 200 MiB


@pytest.mark.realmodel
@pytest.mark.parametrize("budget", ["190MiB", "170MiB"])
def test_streaming_anyway_the_context_costs_little_speed(smollm2_path, budget):
    """Where no context keeps the weights resident the chosen one streams at most 25% more per
    token than context 512 (200 MiB used to be refused: the default 4096 is below the floor),
    or is the largest the budget holds; a larger context that fits is named in the note."""
    p = plan_json(smollm2_path, "--mem-budget", budget)
    ref = plan_json(smollm2_path, "--mem-budget", budget, "-c", 512)
    assert p["disk_bytes_per_token"] > 0 and ref["disk_bytes_per_token"] > 0
    assert p["n_ctx"] >= 512
    note = next(n for n in p["load_notes"] if n.startswith(f"context {p['n_ctx']} "))
    if "the largest this budget holds" not in note:
        assert p["disk_bytes_per_token"] <= 1.25 * ref["disk_bytes_per_token"]
        bigger = int(note.split("--ctx-size up to ")[1].split()[0])
        assert bigger > p["n_ctx"]
        assert plan_json(smollm2_path, "--mem-budget", budget, "-c", bigger)[
            "disk_bytes_per_token"] > 1.25 * ref["disk_bytes_per_token"]
        r = memfit("plan", smollm2_path, "--no-measure", "--mem-budget", budget, "-c",
                   bigger + 256, check=False)
        assert r.returncode != 0 and "below the floor" in r.stderr
