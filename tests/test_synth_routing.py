"""Calibrated synthetic routing (memfit synth --routing-overlap, synth.calibrate_routing): a
tiny qwen3moe is written with the knob, then decoded through the public API (memfit.load,
the weight store) with sampled tokens, the router's choices recorded where the store is asked
for them (WeightStore.get_experts, as tests/_lookahead_recall.py does); the consecutive-token
overlap must be what was asked within a tolerance, and the file calibrated to k/n_expert
(uniform, independent routing) must measure near k/n_expert."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import memfit
from memfit.errors import RequestError
from memfit.gguf import open_gguf
from memfit.runtime import Runtime
from memfit.synth import synth

N_DECODE = 48
K, N_EXPERT = 4, 16     # qwen3moe tiny


SEEDS = (3, 4, 5)   # one sampled sequence's mean moved 0.28-0.51 with the seed (asked 0.4)


def _sequence_overlaps(path, floor, seed) -> list[float]:
    """|S_t & S_t-1| / k for each decode step and layer of one sampled sequence."""
    # under a budget the experts come from the store (unconstrained: from the mapped file)
    with memfit.load(path, n_ctx=128, mem_budget=floor + os.path.getsize(path) // 2) as m:
        calls = []

        def spy(real):
            def call(il, experts, *a, **kw):   # records, then the store does its real work
                if calls and calls[-1][0] == il:   # one layer's experts asked in groups
                    calls[-1][1].extend(int(e) for e in experts)
                else:
                    calls.append((il, [int(e) for e in experts]))
                return real(il, experts, *a, **kw)
            return call

        # every layer's experts go through one of these (get_experts calls begin_experts;
        # note_experts: a fused layer whose experts were all at hand)
        m.store.begin_experts = spy(m.store.begin_experts)
        m.store.note_experts = spy(m.store.note_experts)
        ids = [int(i) for i in np.random.default_rng(7).integers(3, 2000, 4)]
        # one token a step (no speculation: a verified draft asks for several tokens' experts
        # in one call; `auto` speculates where this CPU's verify cost says it pays)
        m.generate(ids, max_tokens=N_DECODE, temperature=1.0, seed=seed, draft_max=0)
        n_layer = m.config.n_layer
    steps = [calls[i:i + n_layer] for i in range(n_layer, len(calls), n_layer)]  # decode only
    ov = []
    for prev, cur in zip(steps[:-1], steps[1:]):
        for (la, a), (lb, b) in zip(prev, cur):
            assert la == lb and len(a) == len(b) == K
            ov.append(len(set(a) & set(b)) / K)
    return ov


def _decoded_overlap(path) -> tuple[float, int]:
    """Mean |S_t & S_t-1| / k over the decode steps and layers of len(SEEDS) sampled
    sequences (one sequence is too few: its tokens decide its mean), and the pairs counted."""
    rt = Runtime(str(path), n_ctx=128, mem_budget=16 << 30)   # the floor as this load plans it
    floor = rt.plan.min_budget_bytes
    rt.close()
    ov = [o for seed in SEEDS for o in _sequence_overlaps(path, floor, seed)]
    return float(np.mean(ov)), len(ov)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Routing counts (and probes) in a directory of the test's own: pytest's numbered tmp
    paths repeat across runs, and a record left in the user's cache for the same path was
    found and refused with a warning as belonging to another file."""
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path / "memfit-cache"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("routing")
    out = {}
    for name, f in (("realistic", 0.4), ("uniform", K / N_EXPERT)):
        out[name] = synth(d / f"{name}.gguf", "qwen3moe", "tiny", seed=4, progress=False,
                          routing_overlap=f).path
    return out


def test_calibrated_overlap_is_what_was_asked(files):
    ov, n = _decoded_overlap(files["realistic"])
    print(f"\nasked 0.40: decoded overlap {ov:.3f} over {n} pairs")
    assert n >= len(SEEDS) * 4 * (N_DECODE - 3)
    assert abs(ov - 0.40) < 0.1, ov
    with open_gguf(files["realistic"]) as f:
        md = f.metadata
        assert md["memfit.synth.routing_overlap"] == pytest.approx(0.4)
        # the synth's own held-out measurement, stored in the file
        assert abs(md["memfit.synth.routing_overlap_measured"] - 0.4) < 0.1
        assert 0.25 <= md["memfit.synth.routing_top_share_measured"] <= 1.0


def test_calibrated_gpt_oss_zeroes_its_router_bias(tmp_path):
    """A router with a bias (gpt-oss): the calibrated rows were fitted without one and carry
    the popularity offsets, so the bias is written as zeros; the file's own decode check then
    measures the overlap asked for. (Its plain file's biases are random, not zero.)"""
    plain = synth(tmp_path / "p.gguf", "gpt-oss", "tiny", seed=2, progress=False).path
    cal = synth(tmp_path / "c.gguf", "gpt-oss", "tiny", seed=2, progress=False,
                routing_overlap=0.4).path
    for path, zero in ((plain, False), (cal, True)):
        with open_gguf(path) as f:
            b = [t for t in f.tensors.values() if t.name.endswith("ffn_gate_inp.bias")]
            assert b and all(t.type.name == "F32" for t in b)
            vals = np.concatenate([np.asarray(f.tensor_data(t.name)).view(np.float32).ravel() for t in b])
            assert (not vals.any()) == zero
            if zero:
                assert abs(f.metadata["memfit.synth.routing_overlap_measured"] - 0.4) < 0.1


def test_uniform_calibration_is_near_k_over_n(files):
    ov, n = _decoded_overlap(files["uniform"])
    print(f"\nasked k/n = {K / N_EXPERT}: decoded overlap {ov:.3f} over {n} pairs")
    assert abs(ov - K / N_EXPERT) < 0.1, ov
    ov_real, _ = _decoded_overlap(files["realistic"])
    assert ov_real > ov + 0.05


def test_info_shows_the_routing_statistics(files):
    p = subprocess.run([sys.executable, "-m", "memfit", "info", str(files["realistic"])],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "routing_overlap               0.400" in p.stdout
    assert "routing_overlap_measured" in p.stdout and "routing_top_share_measured" in p.stdout


def test_bad_routing_overlap_is_refused(tmp_path):
    with pytest.raises(RequestError, match="dense"):
        synth(tmp_path / "d.gguf", "llama", "tiny", routing_overlap=0.3, progress=False)
    with pytest.raises(RequestError, match="between 0 and 1"):
        synth(tmp_path / "d.gguf", "qwen3moe", "tiny", routing_overlap=1.5, progress=False)
    p = subprocess.run([sys.executable, "-m", "memfit", "synth", str(tmp_path / "e.gguf"),
                        "--arch", "qwen3moe", "--size", "tiny", "--routing-overlap", "2"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "Traceback" not in p.stderr and "routing-overlap" in p.stderr


def test_calibrated_files_sharpen_the_attention_query_path_only(files, tmp_path):
    """Calibrated qwen3moe files multiply the query path's last unnormalized tensor by the
    stored attention gain (synth.ATTN_GAIN_CALIBRATED); everything else keeps the plain file's
    scale. Each arch's query path: the per-head q norm, else MLA's q_b, else Wq."""
    from memfit.synth import ATTN_GAIN_CALIBRATED, _query_path
    gain = ATTN_GAIN_CALIBRATED["qwen3moe"]
    assert gain > 1.0
    plain = synth(tmp_path / "plain.gguf", "qwen3moe", "tiny", seed=4, progress=False).path
    with open_gguf(files["realistic"]) as cal, open_gguf(plain) as pl:
        assert cal.metadata["memfit.synth.attention_gain"] == pytest.approx(gain)
        assert "memfit.synth.attention_gain" not in pl.metadata
        for name in ("blk.0.attn_q_norm.weight", "blk.1.attn_k_norm.weight", "blk.0.attn_norm.weight"):
            a = cal.tensor_data(name).view(np.float32)
            b = pl.tensor_data(name).view(np.float32)
            want = gain if "attn_q_norm" in name else 1.0
            np.testing.assert_allclose(a, want * b, rtol=1e-6)
    assert _query_path(["blk.0.attn_q.weight", "blk.0.attn_q_norm.weight", "blk.0.attn_k.weight"]) \
        == {"blk.0.attn_q_norm.weight"}
    assert _query_path(["blk.3.attn_q_a.weight", "blk.3.attn_q_a_norm.weight", "blk.3.attn_q_b.weight",
                        "blk.3.attn_kv_b.weight"]) == {"blk.3.attn_q_b.weight"}
    assert _query_path(["blk.12.attn_q.weight", "blk.12.attn_k.weight", "output.weight"]) \
        == {"blk.12.attn_q.weight"}
