"""The decode matvec tuning (csrc/pool.c mf_tune: a row per CPU family, MEMFIT_TUNE) picks
among kernels with the same per-row arithmetic and the order rows are read in: no tuning may
change a result bit. Every tuning below forces another kernel form (1-row with and without
prefetch, 4-row and 8-row groups adjacent or a task part apart) on rows short and long, on
every ISA this CPU runs; each must give the default row's bits for the decode (rowwise) matmul.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

_native = pytest.importorskip("memfit._native")
from memfit.ops import QTensor  # noqa: E402
from memfit.ops import native as nat  # noqa: E402
from memfit.quant.types import BY_NAME  # noqa: E402
from memfit.quant.random import random_blocks  # noqa: E402

ISAS = ["scalar", "avx2", "avx512", "avx512vnni"]
BIG = 1 << 20
TUNINGS = [
    "streams=5,task_kib=8",
    f"streams=1,pf_rows=0,pf_rows_multi=0,pf_strided=0,k_vd4_min_rb={BIG},k_vd8_min_rb={BIG},q8_vd4_min_rb={BIG}",
    "pf_rows=3,pf_rows_multi=16,pf_strided=5,k_vd4_min_rb=0,k_vd8_min_rb=0,q8_vd4_min_rb=0",
    "k_vd4_min_rb=0,k_vd8_min_rb=0,stride_max_rb=0,task_kib=4,task_kib_multi=4,streams=3",
    f"k_vd4_min_rb=0,k_vd8_min_rb={BIG},stride_max_rb={BIG},task_kib=1024,task_kib_multi=999",
]


def _isas():
    return ISAS[:ISAS.index(_native.isa_hw()) + 1]


@pytest.fixture(params=_isas())
def isa(request):
    before, threads = _native.isa(), _native.get_threads()
    _native.set_isa(request.param)
    yield request.param
    _native.set_isa(before)
    _native.set_threads(threads)
    _native.set_tune(os.environ.get("MEMFIT_TUNE", ""))


# K-quants and Q4_0 keep the 1-row kernel's bits in every group form; Q8_0's 4-row kernel sums
# in another order (tests/test_native_quant.py), so it is held to the same bits only among
# tunings that keep its 4-row threshold
@pytest.mark.parametrize("name, cols", [("Q4_K", 256 * 3), ("Q4_K", 256 * 45), ("Q5_K", 256 * 43),
                                        ("Q6_K", 256 * 31), ("Q6_K", 256 * 5), ("Q4_0", 32 * 97),
                                        ("Q5_0", 32 * 33), ("Q3_K", 256 * 9)])
def test_tunings_same_bits(isa, name, cols):
    t = BY_NAME[name]
    rng = np.random.default_rng(4100 + t.id + cols)
    rows = 203  # 8- and 4-row groups, tasks of several sizes, a 3-row remainder
    w = QTensor("w", t, (rows, cols), random_blocks(t, rows * cols, rng))
    X = rng.standard_normal((3, cols)).astype(np.float32)
    _native.set_tune("")
    ref = nat.matmul(X, w, rowwise=True).view(np.uint32).copy()
    for spec in TUNINGS:
        got = _native.set_tune(spec)
        assert got["source"].endswith("+" + spec)
        for nt in (1, 2):
            _native.set_threads(nt)
            y = nat.matmul(X, w, rowwise=True)
            np.testing.assert_array_equal(y.view(np.uint32), ref, err_msg=f"{name} {isa} [{spec}] threads={nt}")
            np.testing.assert_array_equal(nat.matmul(X[1:2], w, rowwise=True)[0].view(np.uint32), ref[1],
                                          err_msg=f"{name} {isa} [{spec}] one X row")


def test_set_tune_refuses_unknown_names_and_keeps_the_row():
    before = _native.tune()
    for bad in ("bogus=1", "pf_rows=-1", "pf_rows=x", "pf_rows", "pf_rows=1,task_kib=99999999"):
        with pytest.raises(ValueError, match="name=value"):
            _native.set_tune(bad)
        assert _native.tune() == {**before, "source": _native.tune()["source"]}
    _native.set_tune(os.environ.get("MEMFIT_TUNE", ""))


def test_memfit_tune_env_and_cpu_row():
    # MEMFIT_TUNE applies on top of this CPU's row at import; "default" is the row alone
    code = "from memfit import _native as n; import json; print(json.dumps(n.tune()))"
    env = dict(os.environ, MEMFIT_TUNE="pf_rows=5,task_kib=128")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    t = json.loads(out.stdout)
    assert t["pf_rows"] == 5 and t["task_kib"] == 128 and t["source"].endswith("+pf_rows=5,task_kib=128")
    row = _native.set_tune("default")
    assert "+" not in row["source"] and row["task_kib"] in (64, 128)
    _native.set_tune(os.environ.get("MEMFIT_TUNE", ""))
