"""Regression (issue 8, first paragraph): a budgeted mixture-of-experts file used to reach the
weight store's "internal error" assertion (exit 70) after reading every pinned tensor. Now a
real `memfit` process runs it with the experts in the cache tier, and a broken MoE file is
refused from its header (exit 1, one clear line) before any weight is read."""

from __future__ import annotations

import subprocess
import sys

import pytest

from memfit.gguf import open_gguf
from memfit.memory.planner import ModelDesc
from memfit.synth import synth


def _memfit(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "memfit", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("moe") / "q3moe.gguf", "qwen3moe", "tiny", "Q4_K_M",
                 seed=3, progress=False).path


def test_budgeted_moe_file_runs_with_experts_in_the_cache_tier(moe_file):
    plan = _memfit("plan", moe_file, "--mem-budget", "120MiB", "--no-measure", "--json")
    assert plan.returncode == 0, plan.stderr
    assert "ffn_up_exps" in plan.stdout and '"cache"' in plan.stdout
    p = _memfit("run", moe_file, "--mem-budget", "120MiB", "-p", "hello world", "-n", "6")
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    assert "internal error" not in p.stderr
    assert p.stdout.startswith("hello world")
    assert "experts: hit rate" in p.stderr   # the expert cache really served them


def test_broken_moe_file_is_refused_from_the_header(tmp_path):
    from memfit.models.synthetic import write_tiny_model
    bad = write_tiny_model(tmp_path / "bad.gguf", "qwen3moe", "Q4_K", seed=1,
                           shapes={"blk.1.ffn_down_exps.weight": (8, 256, 512)})
    p = _memfit("run", bad, "--mem-budget", "200MiB", "-p", "hi", "-n", "2")
    assert p.returncode == 1, (p.returncode, p.stderr)
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("memfit: ") and "blk.1.ffn_down_exps.weight" in last
    assert "(8, 256, 512)" in last and "internal error" not in p.stderr


def test_planner_reads_hyperparameters_through_the_spec(moe_file):
    with open_gguf(moe_file) as f:
        d = ModelDesc.from_gguf(f)
    assert (d.arch, d.n_layer, d.n_expert, d.n_expert_used, d.head_dim) == ("qwen3moe", 4, 16, 4, 128)
    assert {t.kind for t in d.tensors if "_exps" in t.name} == {"expert"}
