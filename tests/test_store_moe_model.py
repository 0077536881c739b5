"""MoE models (models/ from the moe branch) through the weight store: logits identical to the
memory-mapped file at the floor, half the experts and everything pinned, for both cache
policies; a prefill whose expert union exceeds the cache is asked in groups; an injected
expert read error during forward surfaces once and the retried forward is identical."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from memfit.errors import WeightReadError
from memfit.gguf import open_gguf
from memfit.memory.bandwidth import Bandwidth
from memfit.memory.io import os_pread
from memfit.memory.ledger import Ledger
from memfit.memory.planner import ModelDesc, expert_tensor_names, plan
from memfit.memory.store import WeightStore
from memfit.models import load_model
from memfit.models.synthetic import write_tiny_model

BW = Bandwidth(10e9, 1e9, "test")
CFG = {"qwen3moe": dict(n_embd=256, n_layer=3, n_head=4, n_head_kv=2, head_dim=64,
                        n_expert=8, n_expert_used=2, n_ff_exp=256),
       "qwen2moe": dict(n_embd=256, n_layer=3, n_head=4, n_head_kv=2, head_dim=64,
                        n_expert=8, n_expert_used=2, n_ff_exp=256, n_ff_shexp=512)}
PROMPT = np.array([5, 17, 200, 33, 290, 0, 64, 128], np.int32)


def greedy(model, n_new=4):
    cache = model.new_cache(32)
    logits = [model.forward(PROMPT, cache)]
    for _ in range(n_new):
        logits.append(model.forward(np.array([int(np.argmax(logits[-1]))], np.int32), cache))
    return np.stack(logits)


@pytest.fixture(scope="module", params=["qwen3moe", "qwen2moe"])
def moe(request, tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("moe") / "m.gguf", request.param, "Q4_0",
                            seed=3, **CFG[request.param])
    m = load_model(path)
    try:
        return path, greedy(m)
    finally:
        m.file.close()


def plan_at(desc, where):
    def at(b):
        return plan(desc, b, 32, 2, BW, baseline_bytes=0, n_batch=32)
    floor = at(1 << 40).min_budget_bytes
    experts = sum(t.nbytes for t in desc.tensors if t.kind == "expert")
    return at({"floor": floor, "half": floor + experts // 2, "all": 1 << 40}[where])


@pytest.mark.parametrize("where", ["floor", "half", "all"])
@pytest.mark.parametrize("policy", ["lru", "decay"])
def test_moe_model_through_the_store_is_identical(moe, where, policy):
    path, reference = moe
    f = open_gguf(path)
    p = plan_at(ModelDesc.from_gguf(f), where)
    led = Ledger(None, debug="")
    store = WeightStore(f, p, led, expert_policy=policy)
    try:
        model = load_model(f, weights=store)
        np.testing.assert_array_equal(greedy(model), reference)
        st = store.stats()
        assert st["expert_requests"] > 0
        if where == "all":
            assert p.tiers["cache"] == [] and st["expert_hit_rate"] == 1.0
        else:
            assert p.tiers["cache"] and st["expert_misses"] > 0
            assert st["lookahead"] in ("on", "off", "exploring") and 0.0 <= st["prefetch_recall"] <= 1.0
            assert st["prefetch_routed"] > 0  # the model's look-ahead reached the store
        if where == "floor":
            assert p.cache_slots == 2 and store.expert_batch_limit == 2  # prefill in groups
    finally:
        store.close()
        f.close()
    assert led.total() == 0


class FailOnce:
    def __init__(self, lo, hi):
        self.lo, self.hi, self.armed = lo - lo % 4096, hi, False

    def __call__(self, fd, buf, offset):
        if self.armed and self.lo <= offset < self.hi:
            self.armed = False
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return os_pread(fd, buf, offset)


@pytest.mark.parametrize("prefetch", [False, True], ids=["demand", "prefetch"])
def test_expert_read_error_in_forward_then_identical_retry(moe, prefetch):
    path, reference = moe
    f = open_gguf(path)
    p = plan_at(ModelDesc.from_gguf(f), "half")
    # every expert range of the last layer fails once (demand read or look-ahead prefetch)
    names = expert_tensor_names(2)
    lo = min(f.tensors[n].offset for n in names)
    hi = max(f.tensors[n].offset + f.tensors[n].nbytes for n in names)
    reader = FailOnce(lo, hi)
    store = WeightStore(f, p, prefetch=prefetch, reader=reader)
    try:
        model = load_model(f, weights=store)
        assert store.wants_expert_prediction == prefetch
        cache = model.new_cache(32)
        reader.armed = True
        with pytest.raises(WeightReadError, match="experts of layer 2"):
            model.forward(PROMPT, cache)
        first = model.forward(PROMPT, cache)
        np.testing.assert_array_equal(first, reference[0])
        assert store.stats()["read_errors"] == 1
    finally:
        store.close()
        f.close()
