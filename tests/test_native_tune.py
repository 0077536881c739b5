"""The decode matvec tuning (csrc/pool.c mf_tune: a row per CPU family, MEMFIT_TUNE) picks
among kernels with the same per-row arithmetic and the order rows are read in: no tuning may
change a result bit. Every tuning below forces another kernel form (1-row with and without
prefetch, 4-row and 8-row groups adjacent or a task part apart) on rows short and long, on
every ISA this CPU runs, with and without the in-kernel prefetch (pf_dist, pf_dist_multi); each
must give the default row's bits for the decode (rowwise) matmul.
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
    f"k_vd4_min_rb=0,k_vd8_min_rb={BIG},stride_max_rb={BIG},task_kib=1024,task_kib_multi=999,task_kib_strided=4",
    f"stride_max_rb={BIG},task_kib_strided=2000",
    "pf_dist=3072,k_vd4_min_rb=0,k_vd8_min_rb=0,q8_vd4_min_rb=0",
    f"pf_dist=64,pf_dist_multi=4096,stride_max_rb={BIG},streams=3",
    "pf_dist=1024,pf_dist_multi=0,k_vd4_min_rb=0,k_vd8_min_rb=0",
    "pf_dist=0,pf_rows=2",
    "pdep=0",
    "pdep=1",
    f"k_vd4_short_rb={BIG}",
    f"k_vd4_short_rb={BIG},pf_dist=0,task_kib_multi=4",
    "k_vd4_short_rb=0,pf_dist=2048,pf_dist_multi=1024",
    # the 4/8-row kernels prefetch in their loop on their own (the Zen 4 row), 1-row ones not
    f"pf_dist=0,pf_dist_multi=1024,pf_rows_multi=8,k_vd4_min_rb=0,k_vd8_min_rb=0,q8_vd4_min_rb=0,stride_max_rb={BIG}",
    "pf_dist=0,pf_dist_multi=512,stride_max_rb=0,k_vd4_short_rb=0",
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
                                        ("Q5_0", 32 * 33), ("Q3_K", 256 * 9), ("MXFP4", 32 * 91),
                                        ("MXFP4", 32 * 8), ("NVFP4", 64 * 45), ("NVFP4", 64 * 3),
                                        ("IQ1_S", 256 * 7), ("IQ1_M", 256 * 5), ("IQ3_S", 256 * 11)])
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


def test_pdep_only_with_bmi2():
    # the IQ1 and IQ3_S AVX2 kernels build their row indexes by pdep only where the CPU has
    # BMI2: asking for it elsewhere leaves it 0 (tests above then compare the same form twice)
    row = _native.set_tune("default")
    assert row["pdep"] in (0, 1)
    on = _native.set_tune("pdep=1")["pdep"]
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    if flags:
        assert on == ("bmi2" in flags)
    assert _native.set_tune("pdep=0")["pdep"] == 0
    _native.set_tune(os.environ.get("MEMFIT_TUNE", ""))


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


# f16-cache attention: the heads of a KV group in one task (sharing the K/V rows' conversion,
# the accumulator in registers) against one head per task (fa_heads=0, ops.c fa16_paged_task):
# the same bits for every head split, GQA and MLA-like shapes (V inside K), dots with a tail
# (D % 8), Dv not a multiple of 16 (the 8-wide accumulator), windows, softcap, sinks
@pytest.mark.parametrize("Hq, Hkv, D, Dv, window, softcap, v_in_k, sinks", [
    (8, 2, 64, 64, 0, 0.0, False, False), (4, 1, 256, 256, 0, 0.0, False, False),
    (6, 3, 76, 40, 37, 0.0, False, True), (12, 1, 48, 32, 0, 0.0, True, False),
    (5, 5, 24, 24, 0, 30.0, False, False), (16, 2, 128, 144, 100, 0.0, False, True)])
def test_attention_head_groups_same_bits(isa, Hq, Hkv, D, Dv, window, softcap, v_in_k, sinks):
    rng = np.random.default_rng(Hq * 1000 + D + Dv)
    bs, n_blocks = 16, 20
    K = (rng.standard_normal((n_blocks * bs, Hkv, D)) * 2).astype(np.float16)
    V = None if v_in_k else rng.standard_normal((n_blocks * bs, Hkv, Dv)).astype(np.float16)
    tabs = [rng.permutation(n_blocks)[:12], rng.permutation(n_blocks)[:3]]
    tables = np.concatenate(tabs).astype(np.int32)
    q_pos = np.array([0, 1, 63, 64, 65, 150, 191, 17, 40], np.int32)   # block edges, 4-key tails
    q_tab = np.array([0] * 7 + [12] * 2, np.int32)
    q = rng.standard_normal((len(q_pos), Hq, D)).astype(np.float32)
    sk = rng.standard_normal(Hq).astype(np.float32) if sinks else None
    kw = {} if sk is None else {"sinks": sk}

    def run(spec, nt, rows=slice(None)):
        _native.set_tune(spec)
        _native.set_threads(nt)
        out = np.empty((len(q_pos[rows]), Hq, Dv), np.float32)
        _native.attention_paged(q[rows].copy(), K, V, 1, q_pos[rows], q_tab[rows], tables, bs, 0.2,
                                window, softcap, out, **kw)
        return out.view(np.uint32)

    ref = run("fa_heads=0", 1)
    for spec in ("", "fa_heads=1", "fa_heads=3", "fa_heads=128"):
        for nt in (1, 2):
            np.testing.assert_array_equal(run(spec, nt), ref, err_msg=f"{isa} [{spec}] threads={nt}")
        # a row alone (decode) is the same row in the batch
        np.testing.assert_array_equal(run(spec, 2, slice(5, 6)), ref[5:6], err_msg=f"{isa} [{spec}] one row")


# prefill rows: consecutive positions of two sequences, with and without a window (where the
# rows' first keys differ); the f16-cache kernel runs up to 4 rows a task converting their
# K/V rows once (ops.c fa16g_task): every row has the bits it has alone and with one head a task
@pytest.mark.parametrize("window", [0, 16])
def test_attention_query_tiles_same_bits(isa, window):
    rng = np.random.default_rng(5 + window)
    Hq, Hkv, D, bs, n_blocks = 4, 1, 64, 16, 12
    K = rng.standard_normal((n_blocks * bs, Hkv, D)).astype(np.float16)
    V = rng.standard_normal((n_blocks * bs, Hkv, D)).astype(np.float16)
    tables = np.concatenate([rng.permutation(n_blocks)[:4], rng.permutation(n_blocks)[:2]]).astype(np.int32)
    q_pos = np.concatenate([np.arange(3, 58), np.arange(0, 21)]).astype(np.int32)
    q_tab = np.array([0] * 55 + [4] * 21, np.int32)
    q = rng.standard_normal((len(q_pos), Hq, D)).astype(np.float32)

    def run(spec, nt, rows):
        _native.set_tune(spec)
        _native.set_threads(nt)
        out = np.empty((len(q_pos[rows]), Hq, D), np.float32)
        _native.attention_paged(q[rows].copy(), K, V, 1, q_pos[rows], q_tab[rows], tables, bs, 0.2,
                                window, 0.0, out)
        return out.view(np.uint32)

    try:
        whole = run("", 2, slice(None))
        np.testing.assert_array_equal(run("fa_heads=0", 1, slice(None)), whole)
        for i in range(len(q_pos)):
            np.testing.assert_array_equal(run("", 2, slice(i, i + 1)), whole[i:i + 1], err_msg=f"row {i}")
        np.testing.assert_array_equal(run("", 1, slice(50, 63)), whole[50:63])
    finally:
        _native.set_tune(os.environ.get("MEMFIT_TUNE", ""))
