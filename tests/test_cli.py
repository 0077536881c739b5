"""The CLI as a user runs it: real `memfit` processes, exit codes, JSON, no tracebacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SUBCOMMANDS = ["run", "tokenize", "pull", "list", "rm", "perplexity", "info", "plan", "bench", "synth"]


def memfit(*args, check=True, timeout=300, env=None):
    e = dict(os.environ)
    e.update(env or {})
    p = subprocess.run([sys.executable, "-m", "memfit", *map(str, args)], capture_output=True,
                       text=True, timeout=timeout, env=e)
    assert "Traceback" not in p.stderr, p.stderr
    if check:
        assert p.returncode == 0, p.stderr
    return p


def test_help_lists_every_command():
    out = memfit("--help").stdout
    for c in SUBCOMMANDS:
        assert c in out
    for c in SUBCOMMANDS:
        assert "usage: memfit " + c in memfit(c, "--help").stdout


def test_missing_model_is_one_line_error(tmp_path):
    p = memfit("info", tmp_path / "nope.gguf", check=False)
    assert p.returncode != 0
    assert "nope.gguf" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_corrupt_model_is_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 8)
    for cmd in (["info", bad], ["run", bad, "-p", "hi", "-n", "1"], ["tokenize", bad, "hi"]):
        p = memfit(*cmd, check=False)
        assert p.returncode != 0
        assert "bad.gguf" in p.stderr


@pytest.mark.realmodel
def test_run_json_greedy(smollm2_path):
    p = memfit("run", smollm2_path, "-p", "The capital of France is", "-n", "6", "--temp", "0",
               "--json", "--top-logprobs", "3")
    d = json.loads(p.stdout)
    assert d["prompt_ids"] == [504, 3575, 282, 4649, 314]
    assert d["ids"][:2] == [7042, 30]  # " Paris." as llama.cpp
    assert d["text"].startswith(" Paris.")
    assert len(d["top"]) == len(d["ids"]) and all(len(t) == 3 for t in d["top"])
    assert d["top"][0][0][0] == 7042 and 0.7 < d["top"][0][0][1] < 0.86
    assert d["timings"]["prompt_n"] == 5 and d["timings"]["predicted_n"] == 6
    assert d["peak_rss_bytes"] > 0


@pytest.mark.realmodel
def test_run_streams_text_and_summary(smollm2_path):
    p = memfit("run", smollm2_path, "-p", "The capital of France is", "-n", "4", "--temp", "0")
    assert p.stdout.startswith("The capital of France is Paris.")
    summary = p.stderr.strip().splitlines()[-1]
    assert "prompt 5 tok" in summary and "generated 4 tok" in summary and "peak RSS" in summary


@pytest.mark.realmodel
def test_run_seed_is_reproducible(smollm2_path):
    args = ("run", smollm2_path, "-p", "Once upon a time", "-n", "12", "--temp", "1.0",
            "--seed", "7", "--json")
    a = json.loads(memfit(*args).stdout)["ids"]
    b = json.loads(memfit(*args).stdout)["ids"]
    assert a == b


@pytest.mark.realmodel
def test_chat_without_template_uses_the_family_builtin(gemma_path):
    # the GGUF has no tokenizer.chat_template: llama.cpp's gemma format, named on start
    p = memfit("run", gemma_path, "-p", "hi", "--chat", "-n", "1", "--temp", "0")
    assert "chat template: gemma (built-in for gemma3" in p.stderr


@pytest.mark.realmodel
def test_tokenize_json(gemma_path):
    d = json.loads(memfit("tokenize", gemma_path, "The capital of France is", "--json").stdout)
    assert d["ids"] == [2, 818, 5279, 529, 7001, 563]
    assert len(d["pieces"]) == len(d["ids"])
    d = json.loads(memfit("tokenize", gemma_path, "<bos>x", "--json", "--no-add-special",
                          "--no-parse-special").stdout)
    assert 2 not in d["ids"]


@pytest.mark.realmodel
def test_info_json(smollm2_path):
    d = json.loads(memfit("info", smollm2_path, "--json").stdout)
    text = json.dumps(d)
    assert "llama" in text and "Q4_1" in text


def test_pull_list():
    d = json.loads(memfit("pull", "--list", "--json").stdout)
    assert {r["name"] for r in d} == {"smollm2-135m", "gemma3-270m"}
    assert sum(r["default"] for r in d) == 1


def test_bad_flag_values_are_errors(tmp_path):
    p = memfit("pull", "no-such-model", check=False)
    assert p.returncode != 0 and "no-such-model" in p.stderr


@pytest.mark.realmodel
@pytest.mark.parametrize("args, needle", [
    (["-n", "-5"], "-5"), (["-c", "0"], "--ctx-size"), (["-c", "100000000"], "training context 8192"),
    (["--temp", "nan"], "nan"), (["-t", "0"], "threads"), (["--top-p", "2"], "--top-p"),
    (["--top-k", "-1"], "--top-k"), (["--mem-budget", "abc"], "abc"),
])
def test_bad_run_arguments_are_clear_errors(smollm2_path, args, needle):
    p = memfit("run", smollm2_path, "-p", "hi", "--no-echo", *args, check=False, timeout=60)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode != 0 and needle in last and last.startswith("memfit: error:")


def test_bench_kernels_json_reports_medians_against_bandwidth():
    # tiny shapes and stream volume: the schema and arithmetic, not the speed
    p = memfit("bench", "--kernels", "--types", "Q4_0,Q6_K", "--rows", 64, "--cols", 512,
               "--shapes", "64x512,32x256", "--isa", "scalar,avx2",
               "--trials", 2, "--stream-bytes", "4MiB", "--json", "-t", 2)
    rows = [json.loads(x) for x in p.stdout.splitlines()]
    assert [(r["type"], r["rows"], r["cols"], r["isa"]) for r in rows] == [
        (t, r, c, i) for t in ("Q4_0", "Q6_K") for r, c in ((64, 512), (32, 256)) for i in ("scalar", "avx2")]
    for r in rows:
        assert len(r["samples_gb_per_s"]) == 2 and len(r["mem_read_samples_gb_per_s"]) == 2
        assert r["gb_per_s"] == pytest.approx(sorted(r["samples_gb_per_s"])[0] / 2
                                              + sorted(r["samples_gb_per_s"])[1] / 2)
        # each sample against the probe of its own trial, then the median
        assert r["samples_fraction"] == pytest.approx(
            [g / b for g, b in zip(r["samples_gb_per_s"], r["mem_read_samples_gb_per_s"])])
        assert r["fraction_of_bandwidth"] == pytest.approx(sum(r["samples_fraction"]) / 2)
        assert r["gb_per_s"] > 0 and r["threads"] == 2 and r["copies"] >= 2
        assert len(r["one_stream_samples_gb_per_s"]) == 2 and r["fraction_of_one_stream"] > 0
        assert len(r["read_bound_strategies"]) == 2 and r["mem_read_gb_per_s"] > 0
    for bad_arg, needle in (("--shapes", "12y4"), ("--isa", "avx9"), ("--tune", "pf_rows=x")):
        bad = memfit("bench", "--kernels", bad_arg, needle, check=False)
        assert bad.returncode != 0 and needle in bad.stderr.strip().splitlines()[-1]
    bad = memfit("bench", "--kernels", "--stream-bytes", "12XB", check=False)
    assert bad.returncode != 0 and "12XB" in bad.stderr
