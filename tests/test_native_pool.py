"""The native thread pool and ISA selection: thread counts, env overrides, concurrent callers."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

_native = pytest.importorskip("memfit._native")
from memfit.ops import QTensor  # noqa: E402
from memfit.ops import native as nat  # noqa: E402
from memfit.quant.random import random_blocks  # noqa: E402
from memfit.quant.types import BY_NAME  # noqa: E402


def _case(seed=0, rows=301, cols=512):
    t = BY_NAME["Q4_K"]
    rng = np.random.default_rng(seed)
    w = QTensor("w", t, (rows, cols), random_blocks(t, rows * cols, rng))
    x = rng.standard_normal((5, cols)).astype(np.float32)
    return w, x


def test_set_threads_changes_count_not_results():
    w, x = _case()
    before = nat.get_threads()
    try:
        results = []
        for n in (1, 3, 2):
            assert nat.set_threads(n) == n and nat.get_threads() == n
            results.append(nat.matmul(x, w))
        # rows split differently per thread count; each dot is computed the same way
        np.testing.assert_array_equal(results[0], results[1])
        np.testing.assert_array_equal(results[0], results[2])
    finally:
        nat.set_threads(before)


def test_concurrent_python_callers():
    # the GIL is released in the kernels; callers serialize on the pool, results stay right
    w, x = _case(1)
    want = nat.matmul(x, w)
    errors = []

    def run():
        for _ in range(20):
            if not np.array_equal(nat.matmul(x, w), want):
                errors.append("mismatch")

    ts = [threading.Thread(target=run) for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors


def test_isa_names_and_set_isa():
    hw = _native.isa_hw()
    assert hw in ("scalar", "avx2", "avx512", "avx512vnni")
    before = _native.isa()
    try:
        assert _native.set_isa("scalar") == "scalar" and _native.isa() == "scalar"
        with pytest.raises(ValueError, match="unknown ISA"):
            _native.set_isa("sse9")
        if hw != "avx512vnni":
            with pytest.raises(ValueError, match="not supported by this CPU"):
                _native.set_isa("avx512vnni")
    finally:
        _native.set_isa(before)


def test_env_overrides_in_subprocess():
    env = dict(os.environ, MEMFIT_ISA="scalar", MEMFIT_THREADS="3")
    out = subprocess.run([sys.executable, "-c", "import memfit._native as n; print(n.isa(), n.get_threads())"],
                         env=env, capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert out == ["scalar", "3"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_computes_inline():
    # the child inherits no worker threads; kernels must still finish (inline) and be right
    w, x = _case(2)
    want = nat.matmul(x, w)
    pid = os.fork()
    if pid == 0:
        ok = nat.get_threads() == 1 and np.array_equal(nat.matmul(x, w), want)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
