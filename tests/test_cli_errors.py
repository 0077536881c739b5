"""Bad arguments, for every subcommand, as a user types them: real `memfit` processes in an
empty folder. Each ends in ONE line `memfit: error: ...` naming the argument, a non-zero exit
that is not 70 (internal error), quickly (before any work), and nothing written."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

M = "smollm2-135m"  # never loaded: every case is refused before a model opens

CASES = [
    # run
    (["run", M, "-p", "hi", "-n", "-5"], "-n/--n-predict"),
    (["run", M, "-p", "hi", "-c", "0"], "-c/--ctx-size"),
    (["run", M, "-p", "hi", "--temp", "nan"], "--temp"),
    (["run", M, "-p", "hi", "--temp", "-1"], "--temp"),
    (["run", M, "-p", "hi", "-t", "0"], "-t/--threads"),
    (["run", M, "-p", "hi", "--top-p", "2"], "--top-p"),
    (["run", M, "-p", "hi", "--top-k", "-1"], "--top-k"),
    (["run", M, "-p", "hi", "--min-p", "1.5"], "--min-p"),
    (["run", M, "-p", "hi", "--repeat-penalty", "0"], "--repeat-penalty"),
    (["run", M, "-p", "hi", "--presence-penalty", "3"], "--presence-penalty"),
    (["run", M, "-p", "hi", "--mem-budget", "abc"], "--mem-budget"),
    (["run", M, "-p", "hi", "--mem-budget", "0"], "--mem-budget"),
    (["run", M, "-p", "hi", "--top-logprobs", "3"], "--top-logprobs"),
    (["run", M, "-p", "hi", "--top-logprobs", "-1", "--json"], "--top-logprobs"),
    (["run", M, "-p", "hi", "--chat-template", "chatml"], "--chat"),
    (["run", M, "-p", "hi", "--system", "be brief"], "--chat"),
    (["run", M, "-p", "hi", "--chat", "--chat-template", "nosuch"], "nosuch"),
    (["run", M, "-p", "hi", "--chat", "--chat-template", "empty.jinja"], "empty.jinja is empty"),
    (["run", M, "-p", "hi", "-ctk", "q5_1"], "--cache-type-k"),
    (["bench", M, "-p", "8", "-n", "4", "--parallel", "0"], "--parallel"),
    (["serve", M, "--port", "abc"], "--port"),
    (["serve", M, "--host", "0.0.0.0"], "API key"),
    (["run", M, "-p", "hi", "-f", "x.txt"], "-f"),
    (["run", M, "-f", "missing.txt"], "missing.txt"),
    (["run", M, "-p", "hi", "--seed", "x"], "--seed"),
    (["run", M, "-p", "hi", "--backend", "gpu"], "--backend"),
    # tokenize
    (["tokenize", M], "TEXT"),
    (["tokenize", M, "-f", "missing.txt"], "missing.txt"),
    (["tokenize", M, "a", "b"], "unrecognized"),
    # pull / list / rm
    (["pull", "no-such-model"], "no-such-model"),
    (["rm", "no-such-model"], "no-such-model"),
    (["rm"], "names"),
    (["list", "--bogus"], "--bogus"),
    # perplexity
    (["perplexity", M], "-f"),
    (["perplexity", M, "-f", "t.txt", "-c", "8"], "-c/--ctx-size"),
    (["perplexity", M, "-f", "t.txt", "--chunks", "0"], "--chunks"),
    (["perplexity", M, "--kl-divergence"], "--kl-divergence-base"),
    (["perplexity", M, "-f", "t.txt", "--kl-divergence-base", "nodir/b.kld"], "--kl-divergence-base"),
    (["perplexity", M, "--kl-divergence", "--kl-divergence-base", "missing.kld"], "missing.kld"),
    (["perplexity", M, "-f", "missing.txt"], "missing.txt"),
    # bench
    (["bench", "-r", "0"], "-r/--repetitions"),
    (["bench", "-p", "-1"], "-p/--n-prompt"),
    (["bench", "--kernels", "--types", "FOO"], "--types"),
    (["bench", "--kernels", "--rows", "0"], "--rows"),
    (["bench", "--kernels", "--cols", "100", "--types", "Q4_K"], "--cols"),
    (["bench", "--kernels", "--trials", "0"], "--trials"),
    (["bench", "--kernels", "--stream-bytes", "12XB"], "--stream-bytes"),
    (["bench", "--kernels", "--stream-bytes", "1024TiB"], "lower --stream-bytes"),
    (["bench", "--kernels", "--stream-bytes", "200MiB", "--mem-budget", "300MiB"], "the limit is --mem-budget"),
    # plan
    (["plan", M, "-c", "0"], "--ctx"),
    (["plan", M, "--mem-budget", "-1GiB"], "--mem-budget"),
    (["plan", M, "-t", "0"], "-t/--threads"),
    (["plan", M, "--response-store", "4MiB"], "add --serve"),
    # synth
    (["synth", "missing-dir/x.gguf", "--size", "tiny"], "missing-dir"),
    (["synth", ".", "--size", "tiny"], "directory"),
    (["synth", "/dev/null", "--size", "tiny"], "/dev/null"),
    (["synth", "x.gguf", "--seed", "-1"], "--seed"),
    (["synth", "x.gguf", "--size", "huge"], "huge"),
    (["synth", "x.gguf", "--quant", "Q9_Z"], "Q9_Z"),
    # info
    (["info", "missing.gguf"], "missing.gguf"),
    (["info"], "model"),
    # no such command
    (["frobnicate"], "frobnicate"),
]


def _run(args, cwd, env=None):
    e = dict(os.environ)
    e.pop("MEMFIT_MEM_BUDGET", None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "memfit", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=e, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("args, needle", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_argument_is_one_line_error(tmp_path, args, needle):
    (tmp_path / "t.txt").write_text("some text\n")
    (tmp_path / "empty.jinja").write_text("")
    before = sorted(os.listdir(tmp_path))
    t0 = time.perf_counter()
    p = _run(args, tmp_path)
    lines = p.stderr.strip().splitlines()
    assert p.returncode not in (0, 70), p.stderr
    assert len(lines) == 1 and lines[0].startswith("memfit: error:"), p.stderr
    assert needle in lines[0], lines[0]
    assert "Traceback" not in p.stderr and p.stdout == ""
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, no *.partial
    assert time.perf_counter() - t0 < 30


@pytest.mark.parametrize("env, needle", [
    ({"MEMFIT_THREADS": "abc"}, "MEMFIT_THREADS"), ({"MEMFIT_THREADS": "0"}, "MEMFIT_THREADS"),
    ({"MEMFIT_ISA": "sse9"}, "MEMFIT_ISA"), ({"MEMFIT_GATHER": "yes"}, "MEMFIT_GATHER"),
    ({"MEMFIT_TUNE": "pf_rows=many"}, "MEMFIT_TUNE"),
    ({"MEMFIT_ATTN": "f64"}, "MEMFIT_ATTN"),
])
def test_bad_environment_is_an_error(tmp_path, env, needle):
    p = _run(["tokenize", M, "hi"], tmp_path, env)
    lines = p.stderr.strip().splitlines()
    assert p.returncode not in (0, 70) and len(lines) == 1 and needle in lines[0], p.stderr


def test_isa_above_the_cpu_is_an_error(tmp_path):
    try:
        from memfit import _native
    except ImportError:
        pytest.skip("no native core")
    if _native.isa_hw() == "avx512vnni":
        pytest.skip("this CPU runs every ISA name")
    p = _run(["tokenize", M, "hi"], tmp_path, {"MEMFIT_ISA": "avx512vnni"})
    assert p.returncode == 1 and "not supported by this CPU" in p.stderr


def test_synth_refuses_to_overwrite_and_force_does(tmp_path):
    out = tmp_path / "m.gguf"
    out.write_bytes(b"keep me")
    p = _run(["synth", str(out), "--size", "tiny", "--arch", "llama"], tmp_path)
    assert p.returncode == 1 and "--force" in p.stderr
    assert out.read_bytes() == b"keep me"
    p = _run(["synth", str(out), "--size", "tiny", "--arch", "llama", "--force", "--json"], tmp_path)
    assert p.returncode == 0, p.stderr
    assert out.read_bytes()[:4] == b"GGUF"
    assert sorted(os.listdir(tmp_path)) == ["m.gguf"]


def test_synth_never_replaces_a_fifo(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    p = _run(["synth", str(fifo), "--size", "tiny", "--force"], tmp_path)
    assert p.returncode == 1 and "not a regular file" in p.stderr
    import stat
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


@pytest.mark.parametrize("cmd", [["info"], ["run", "-p", "hi"], ["plan"], ["bench", "-r", "1"],
                                 ["perplexity", "-f", "t.txt"], ["chat"]])
def test_fifo_or_directory_as_model_is_refused_not_waited_on(tmp_path, cmd):
    # opening a FIFO for reading waits for a writer: the file type is checked before any open
    (tmp_path / "t.txt").write_text("some text\n")
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    for model, kind in ((fifo, "FIFO"), (tmp_path, "directory")):
        t0 = time.perf_counter()
        p = _run([cmd[0], str(model), *cmd[1:]], tmp_path)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
        assert lines[-1].startswith("memfit: error:") and kind in lines[-1], p.stderr
        assert "not a regular file" in lines[-1]
        assert time.perf_counter() - t0 < 30
