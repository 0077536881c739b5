"""MEMFIT_BATCH_INVARIANT=0: the documented opt-out of batch invariance where it costs speed
(a MoE prompt's expert groups of fewer than 8 rows on the one-row kernels, csrc/moe.c). By
default a prompt row's logits do not depend on the rows beside it; with the opt-out they may
(last bits), and they stay close to the invariant ones."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from memfit import _native
from memfit.gguf import open_gguf
from memfit.models import load_model
from memfit.models.synthetic import write_tiny_model
from memfit.ops import get_ops


def _prefill(model, ids, chunks):
    """Last-row logits of each chunk of ids fed in turn (one cache)."""
    cache = model.new_cache(len(ids) + 4)
    out, a = [], 0
    for n in chunks:
        out.append(np.array(model.forward(np.asarray(ids[a:a + n]), cache)).reshape(-1))
        a += n
    return out


def test_opt_out_moves_small_expert_groups_to_the_one_row_kernels(tmp_path, isa):
    # 32 experts, 2 per token: a 40-row prompt gives groups of 1-7 rows
    path = write_tiny_model(tmp_path / "m.gguf", "qwen3moe", "Q4_K", seed=3, n_expert=32)
    model = load_model(open_gguf(path), ops=get_ops("native"))
    prompts = [list(np.random.default_rng(s).integers(3, 250, 40)) for s in (1, 2, 3)]
    before = _native.set_moe_vecdot_below(0)
    try:
        assert before == 0                       # the default: invariant
        wholes = [_prefill(model, ids, [40])[-1] for ids in prompts]
        chunked = _prefill(model, prompts[0], [13, 20, 7])[-1]
        assert np.array_equal(wholes[0].view(np.uint32), chunked.view(np.uint32))
        assert _native.set_moe_vecdot_below(8) == 0
        fasts = [_prefill(model, ids, [40])[-1] for ids in prompts]
        # other kernels for the small groups: other last bits (the scalar path has one
        # kernel for both; elsewhere a last row's logits can still round to the same bits,
        # so the three prompts together must show it), the same distribution
        same = [np.array_equal(f.view(np.uint32), w.view(np.uint32)) for f, w in zip(fasts, wholes)]
        assert (isa == "scalar") == all(same)
        for fast, whole in zip(fasts, wholes):
            np.testing.assert_allclose(fast, whole, rtol=0, atol=2e-2 * np.abs(whole).max())
    finally:
        _native.set_moe_vecdot_below(before)
    for bad in (-1, 65):
        try:
            _native.set_moe_vecdot_below(bad)
        except ValueError:
            continue
        raise AssertionError(f"set_moe_vecdot_below({bad}) accepted")


def test_environment_switch():
    code = ("from memfit.ops import native; from memfit import _native; "
            "print(native.BATCH_INVARIANT, _native.set_moe_vecdot_below(0))")
    for env, want in (("0", "False 8"), ("1", "True 0"), (None, "True 0")):
        e = {k: v for k, v in os.environ.items() if k != "MEMFIT_BATCH_INVARIANT"}
        if env is not None:
            e["MEMFIT_BATCH_INVARIANT"] = env
        r = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0 and r.stdout.split() == want.split(), r.stderr
