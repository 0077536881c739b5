"""Everything memfit keeps lives under the one directory (memfit/paths.py): with
$MEMFIT_CACHE set, budgeted `run`, `plan` and `bench` processes write their bandwidth probes
and routing counts there and nothing under $HOME (issue 17, item 12)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from test_budget_e2e import memfit

MOE = dict(n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_expert=16,
           n_expert_used=4, n_ff_exp=256, n_ctx=256)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    from memfit.models.synthetic import write_tiny_model
    return write_tiny_model(tmp_path_factory.mktemp("moe_cache") / "qwen3moe-tiny.gguf",
                            "qwen3moe", "Q4_0", seed=3, **MOE)


def _files(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())


@pytest.mark.timeout(300)
def test_memfit_cache_holds_everything_home_untouched(moe_model, tmp_path):
    home, cache = tmp_path / "home", tmp_path / "cache"
    home.mkdir()
    env = {"HOME": str(home), "MEMFIT_CACHE": str(cache), "XDG_CACHE_HOME": ""}
    floor = memfit("plan", moe_model, "--mem-budget", "64GiB", "-c", 64, "--json",
                   "--no-measure", env=env).json()["min_budget_bytes"]
    budget = floor + moe_model.stat().st_size // 2  # experts stream: routing counts, disk reads
    r = memfit("run", moe_model, "-p", "The quick brown fox", "-n", 4, "--temp", 0, "-c", 64,
               "--mem-budget", budget, env=env)
    assert r.rc == 0, r.err
    routing = list((cache / "routing").glob("*.json"))
    assert len(routing) == 1, _files(cache)
    p = memfit("plan", moe_model, "--mem-budget", budget, "-c", 64, env=env)  # measures
    assert p.rc == 0, p.err
    assert (cache / "bandwidth.json").is_file(), _files(cache)
    b = memfit("bench", moe_model, "-p", 8, "-n", 2, "-r", 1, "--mem-budget", budget, env=env)
    assert b.rc == 0, b.err
    assert _files(home) == [], _files(home)
    # and the probes and counts of one cache are not seen by another
    other = tmp_path / "other"
    q = memfit("plan", moe_model, "--mem-budget", budget, "-c", 64, "--no-measure", "--json",
               env={**env, "MEMFIT_CACHE": str(other)})
    assert q.rc == 0, q.err
    assert not (other / "routing").exists() and not (other / "bandwidth.json").exists()
    assert os.listdir(home) == []
