"""The hard memory budget on the large-MoE families (issue 19), end to end: real
`python -m memfit` processes on small synthetic glm4moe, deepseek2 and gpt-oss files (dense
leading layer, shared expert, NextN layer / MLA / MXFP4 experts with biases, sinks, windows) whose peak RSS (VmHWM) is read from /proc, at 100%
and 50% of the file and at the floor `memfit plan` states: within the budget and greedy ids
identical to the unconstrained run; below the floor refused before loading with the minimum
named. Weights and routing are synthetic."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_budget_e2e import MiB, memfit

PROMPT = "The quick brown fox"
N_GEN = 4
CTX = 64
SHAPES = {
    # ~170 MiB each at Q4_0: 8 layers of 32 experts (4 routed), one dense, one shared
    "glm4moe": dict(n_embd=512, n_layer=8, n_head=4, n_head_kv=2, head_dim=128, n_rot=64,
                    n_expert=32, n_expert_used=4, n_ff_exp=768, n_ff_shexp=768, n_ff=1024,
                    n_ctx=512),
    "deepseek2": dict(n_embd=512, n_layer=8, n_head=4, q_lora_rank=256, kv_lora_rank=256,
                      n_expert=32, n_expert_used=4, n_ff_exp=768, n_ff_shexp=768, n_ff=1024,
                      expert_group_count=4, expert_group_used_count=2, n_ctx=512),
    # MXFP4 experts as published
    "gpt-oss": dict(n_embd=512, n_layer=8, n_head=8, n_head_kv=2, head_dim=64, n_expert=32,
                    n_expert_used=4, n_ff_exp=768, n_ctx=512, sliding_window=16,
                    types={f"blk.{i}.ffn_{m}_exps.weight": "MXFP4" for i in range(8)
                           for m in ("gate", "up", "down")}),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def arch_model(request, tmp_path_factory) -> tuple[str, Path, dict]:
    from memfit.models.synthetic import write_tiny_model
    arch = request.param
    path = write_tiny_model(tmp_path_factory.mktemp(arch) / f"{arch}.gguf", arch, "Q4_0", seed=3,
                            **SHAPES[arch])
    ref = _run(path, cache=tmp_path_factory.mktemp("ref")).json()
    assert len(ref["ids"]) == N_GEN
    return arch, path, ref


def _run(model, budget=None, cache=None):
    args = ["run", model, "-p", PROMPT, "-n", N_GEN, "--temp", 0, "--json", "-c", CTX]
    if budget is not None:
        args += ["--mem-budget", budget]
    env = {"XDG_CACHE_HOME": str(cache)} if cache is not None else {}
    return memfit(*args, env=env)


def _floor(model) -> int:
    return memfit("plan", model, "--mem-budget", "64GiB", "-c", CTX, "--json",
                  "--no-measure").json()["min_budget_bytes"]


@pytest.mark.timeout(300)
def test_large_moe_families_hold_the_budget(arch_model, tmp_path):
    arch, path, ref = arch_model
    size, floor = path.stat().st_size, _floor(path)
    assert floor < size // 2
    for where, budget in (("100%", size), ("50%", size // 2), ("floor", floor)):
        r = _run(path, budget, cache=tmp_path / where)
        assert r.rc == 0, r.err[-2000:]
        d = r.json()
        print(f"{arch} {where}: budget {budget / MiB:.1f} MiB, peak RSS {r.peak_rss / MiB:.1f} MiB")
        assert r.peak_rss <= budget, (arch, where, r.peak_rss / MiB, budget / MiB)
        assert d["ids"] == ref["ids"], f"{arch} at {where}: greedy tokens differ"
        if where != "100%":
            assert d["store"]["expert_misses"] > 0
    r = memfit("run", path, "-p", PROMPT, "-n", 2, "-c", CTX, "--mem-budget", floor - 1,
               env={"XDG_CACHE_HOME": str(tmp_path / "below")})
    assert r.rc == 1 and "Traceback" not in r.err and "below the floor" in r.err
    assert f"raise --mem-budget to at least {-(-floor // MiB)}MiB" in r.err
