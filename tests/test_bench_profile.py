"""`memfit bench --profile`: one decode token's time split by matvec weight set, the rest of
the fused layers, the output matrix and Python; the parts must add up to the token."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_native = pytest.importorskip("memfit._native")
from memfit.bench.profile import format_profile, profile_decode  # noqa: E402
from memfit.models import load_model  # noqa: E402
from memfit.models.synthetic import write_tiny_model  # noqa: E402
from memfit.ops import get_ops  # noqa: E402


def test_profile_parts_add_up(tmp_path):
    path = write_tiny_model(tmp_path / "q.gguf", "qwen2", "Q4_K", seed=1)
    m = load_model(path, ops=get_ops("native"))
    c = m.config
    p = profile_decode(m, n_gen=6, n_prompt=3, probe_gb_per_s=10.0)
    assert p["fused_layers"] and p["n_gen"] == 6
    layer = [x for x in p["matmuls"] if x["what"] == "layer"]
    out = [x for x in p["matmuls"] if x["what"] == "output"]
    # Q/K/V, O, gate/up, down: 4 calls per layer; the output matrix once per token
    assert sum(x["calls_per_token"] for x in layer) == 4 * c.n_layer
    assert len(out) == 1 and out[0]["calls_per_token"] == 1
    assert out[0]["shape"] == f"{c.n_vocab}x{c.n_embd}"
    parts = p["layer_matvec_ms"] + p["layer_rest_ms"] + p["output_ms"] + p["other_ms"]
    assert parts == pytest.approx(p["ms_per_token"], rel=1e-9)
    assert p["layer_rest_ms"] > 0 and p["layers_ms"] <= p["ms_per_token"]
    assert p["bound_ms"] == pytest.approx(p["weight_bytes_per_token"] / 1e10 * 1e3)
    assert "| output matvec | Q" in format_profile(p)
    # the decode tuning in use is part of the record (a profile on another CPU row differs)
    assert p["tune"] == _native.tune() and f"(tuning {p['tune']['source']})" in format_profile(p)
    # the counters are off again: a plain forward adds nothing
    before = _native.profile_stats()["matmul"]
    m.forward([1], m.new_cache(4))
    assert _native.profile_stats()["matmul"] == before


def test_cli_profile_json(tmp_path):
    path = write_tiny_model(tmp_path / "l.gguf", "llama", "Q4_0", seed=2)
    p = subprocess.run([sys.executable, "-m", "memfit", "bench", str(path), "--profile", "-p", "2",
                        "-n", "3", "--json", "-t", "2"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["threads"] == 2 and r["n_gen"] == 3 and r["read_probe_gb_per_s"] > 0
    assert {x["what"] for x in r["matmuls"]} == {"layer", "output"}


def test_kernel_bench_cpu_time_needs_one_thread(capsys):
    from memfit.bench.kernels import run_kernel_bench
    from memfit.errors import RequestError
    n = _native.get_threads()
    try:
        with pytest.raises(RequestError, match="-t 1"):
            run_kernel_bench(types="Q4_0", rows=64, cols=512, threads=2, cpu_time=True)
        run_kernel_bench(types="Q4_0", rows=64, cols=512, threads=1, as_json=True, trials=1,
                         stream_bytes=1 << 20, cpu_time=True)
    finally:
        _native.set_threads(n)
    r = json.loads(capsys.readouterr().out)
    assert r["clock"] == "thread_time" and r["threads"] == 1 and r["gb_per_s"] > 0


def test_read_probe_streams_argument():
    import numpy as np
    buf = np.full(1 << 20, 3, np.uint8)
    for k in (1, 2, 4, 64):
        _native.read_buffer(buf, k)
    with pytest.raises(ValueError, match="streams 0"):
        _native.read_buffer(buf, 0)


def test_kernel_shapes_7b_no_repeats():
    # --shapes 7b adds a 7B's matrices to --rows x --cols; a shape named twice runs once
    from memfit.bench.kernels import SHAPES_7B, parse_shapes
    assert parse_shapes("7b", 14336, 4096) == [(14336, 4096), (4096, 4096), (4096, 14336), (152064, 3584)]
    assert parse_shapes("7b", 100, 512) == [(100, 512)] + SHAPES_7B
    assert parse_shapes("64x512,7b,64x512", 1, 32) == [(64, 512), (1, 32)] + SHAPES_7B
