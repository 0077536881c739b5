"""The expert cache in the weight store, on MoE-shaped GGUF files this test writes itself:
bytes identical to the file at every split, LRU vs frequency-with-admission, router-lookahead
prefetch (recall, waste, waited-for not re-read), demand before prefetch, and faults (EIO,
short read, shrinking file; demand and prefetch): one error each, then a clean retry."""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time

import numpy as np
import pytest

from memfit.errors import WeightReadError
from memfit.gguf import open_gguf
from memfit.memory.bandwidth import Bandwidth
from memfit.memory.io import DEMAND, PREFETCH, IOPool, os_pread
from memfit.memory.ledger import Ledger
from memfit.memory.planner import ModelDesc, expert_slot_bytes, expert_tensor_names, plan
from memfit.memory.policy import DecayPolicy, LRUPolicy
from memfit.memory.store import WeightStore

BW = Bandwidth(10e9, 1e9, "test")
N_LAYER, N_EXPERT, N_USED, E, F = 2, 8, 2, 40, 48


def write_moe(path, seed=0, n_layer=N_LAYER, n_expert=N_EXPERT, arch="qwen3moe"):
    """A qwen3moe-shaped file: F32 trunk, stacked experts (n_expert, F, E) / (n_expert, E, F);
    one expert's slice is 7680 bytes, so slices are not page-aligned."""
    import gguf
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    a = arch
    for k, v in (("block_count", n_layer), ("context_length", 128), ("embedding_length", E),
                 ("feed_forward_length", 0), ("attention.head_count", 2),
                 ("attention.head_count_kv", 2), ("expert_count", n_expert),
                 ("expert_used_count", N_USED), ("expert_feed_forward_length", F)):
        w.add_uint32(f"{a}.{k}", v)
    w.add_tensor("token_embd.weight", rng.standard_normal((100, E), dtype=np.float32))
    for il in range(n_layer):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", np.ones(E, np.float32))
        w.add_tensor(p + "attn_q.weight", rng.standard_normal((E, E), dtype=np.float32))
        w.add_tensor(p + "ffn_gate_inp.weight", rng.standard_normal((n_expert, E), dtype=np.float32))
        g, u, d = expert_tensor_names(il)
        w.add_tensor(g, rng.standard_normal((n_expert, F, E), dtype=np.float32))
        w.add_tensor(u, rng.standard_normal((n_expert, F, E), dtype=np.float32))
        w.add_tensor(d, rng.standard_normal((n_expert, E, F), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(E, np.float32))
    w.add_tensor("output.weight", rng.standard_normal((100, E), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return write_moe(tmp_path_factory.mktemp("moe") / "moe.gguf")


def plan_slots(desc, slots=None, **kw):
    """Plan with the trunk pinned and room for `slots` expert slots (None: everything)."""
    big = plan(desc, 1 << 40, 64, 2, BW, baseline_bytes=0, n_batch=64, **kw)
    if slots is None:
        return big
    fixed = big.baseline_bytes + big.scratch_bytes + big.kv_bytes + big.io_staging_bytes
    trunk = sum(t.nbytes for t in desc.tensors if t.kind != "expert")
    return plan(desc, fixed + trunk + slots * expert_slot_bytes(desc), 64, 2, BW,
                baseline_bytes=0, n_batch=64, **kw)


def expected(f, il, e):
    out = []
    for name in expert_tensor_names(il):
        t = f.tensors[name]
        out.append(np.asarray(f.tensor_data(name)).reshape(-1).view(np.uint8)
                   .reshape(t.shape[0], -1)[e])
    return out


def check(f, got, il, experts):
    assert len(got) == len(experts)
    for (g, u, d), e in zip(got, experts):
        for q, want, shape in zip((g, u, d), expected(f, il, e), ((F, E), (F, E), (E, F))):
            assert tuple(q.shape) == shape
            np.testing.assert_array_equal(np.asarray(q.data).reshape(-1), want)


def routing(n_calls, seed=1):
    rng = np.random.default_rng(seed)
    return [(c % N_LAYER, sorted(rng.choice(N_EXPERT, N_USED, replace=False).tolist()))
            for c in range(n_calls)]


@pytest.mark.parametrize("slots", [2, 5, None], ids=["floor", "some", "all"])
@pytest.mark.parametrize("policy", ["lru", "decay"])
def test_experts_are_the_files_bytes_at_any_split(moe_path, slots, policy):
    f = open_gguf(moe_path)
    desc = ModelDesc.from_gguf(f)
    p = plan_slots(desc, slots)
    if slots is None:
        assert p.cache_slots == 0 and p.tiers["cache"] == []
    else:
        assert p.cache_slots == slots and len(p.tiers["cache"]) == 3 * N_LAYER
    led = Ledger(None, debug="")
    store = WeightStore(f, p, led, expert_policy=policy)
    try:
        for il, ex in routing(40):
            check(f, store.get_experts(il, ex), il, ex)
            store.prefetch_experts((il + 1) % N_LAYER, ex)  # a poor predictor: still correct
        st = store.stats()
        assert st["expert_requests"] == 80
        assert (st["expert_hits"] + st["expert_hot_hits"] + st["expert_prefetch_hits"]
                + st["expert_misses"]) == 80
        if slots is None:
            assert st["expert_hit_rate"] == 1.0 and st["bytes_read"] >= desc.weight_bytes
        else:
            assert st["expert_misses"] > 0 and st["expert_hit_rate"] < 1
            assert st["expert_hit_rate"] > 0 or slots == 2  # 2 slots, layers alternate: 0%
            assert led.items("weight_cache")["expert_cache"] == slots * p.cache_slot_bytes
        assert "experts: hit rate" in store.format_stats()
        # the same expert twice in one call is read once and handed out twice
        il, e = 1, 3
        check(f, store.get_experts(il, [e, e]), il, [e, e])
    finally:
        store.close()
        f.close()
    assert led.total() == 0


def test_frequency_policy_keeps_hot_experts_that_lru_evicts(moe_path):
    # two hot experts every 4th call, between them a scan of three cold ones: LRU (3 slots)
    # evicts the hot ones before they come back; decay + admission keeps them
    seq = []
    for c in range(160):
        seq.append([0, 1] if c % 4 == 0 else [2 + (c - c // 4 - 1) % 6])
    rates = {}
    for policy in (LRUPolicy(), DecayPolicy(decay=0.95)):
        f = open_gguf(moe_path)
        store = WeightStore(f, plan_slots(ModelDesc.from_gguf(f), 3), expert_policy=policy)
        try:
            for ex in seq:
                check(f, store.get_experts(0, ex), 0, ex)
            rates[policy.name] = store.stats()["expert_hit_rate"]
        finally:
            store.close()
            f.close()
    assert rates["lru"] < 0.05 and rates["decay"] > 0.3, rates


class Counting:
    """The store's reader, counting bytes read per file offset (and slowed, optionally)."""

    def __init__(self, delay=0.0):
        self.bytes: dict[int, int] = {}
        self.delay = delay
        self.lock = threading.Lock()

    def __call__(self, fd, buf, offset):
        time.sleep(self.delay)
        n = os_pread(fd, buf, offset)
        with self.lock:
            self.bytes[offset] = self.bytes.get(offset, 0) + n
        return n


def test_prefetch_recall_waste_and_in_flight_waited_not_reread(moe_path):
    f = open_gguf(moe_path)
    reader = Counting(delay=0.05)  # reads are still in flight when get_experts arrives
    store = WeightStore(f, plan_slots(ModelDesc.from_gguf(f), 6), reader=reader)
    try:
        assert store.wants_expert_prediction
        check(f, store.get_experts(0, [0, 1]), 0, [0, 1])
        store.prefetch_experts(1, [3, 4])          # layer 1's router predicts 3 and 4
        before = store.stats()["bytes_read"]
        check(f, store.get_experts(1, [3, 5]), 1, [3, 5])   # 3 right, 4 wrong, 5 missed
        st = store.stats()
        assert st["expert_prefetch_hits"] == 1 and st["prefetch_recall"] == 0.5
        assert st["bytes_read"] - before == store._x_span((1, 5))  # 3 was not read again
        t = f.tensors[expert_tensor_names(1)[0]]
        off3 = t.offset + 3 * (t.nbytes // N_EXPERT)
        assert reader.bytes[off3 - off3 % 4096] == reader.bytes.get(off3 - off3 % 4096)
        assert sum(v for o, v in reader.bytes.items()
                   if o - o % 4096 == off3 - off3 % 4096) <= store._x_span((1, 3))
        # expert 4 was read ahead and never used: wasted once it is evicted
        for ex in ([6, 7], [0, 2], [1, 6], [3, 7]):
            store.get_experts(0, ex)
        st = store.stats()
        assert st["prefetch_wasted_bytes"] == store._x_span((1, 4))
        assert st["prefetched_experts"] == 2
    finally:
        store.close()
        f.close()


def test_stall_split_between_misses_and_prefetches(moe_path):
    f = open_gguf(moe_path)
    store = WeightStore(f, plan_slots(ModelDesc.from_gguf(f), 6), reader=Counting(delay=0.05))
    try:
        st0 = store.stats()
        store.get_experts(0, [0, 1])                 # two misses: read on demand
        st1 = store.stats()
        assert st1["expert_stall_demand_s"] - st0["expert_stall_demand_s"] >= 0.04
        assert st1["expert_stall_prefetch_s"] == st0["expert_stall_prefetch_s"]
        store.prefetch_experts(1, [3, 4])
        store.get_experts(1, [3, 4])                 # both predicted, still in flight
        st2 = store.stats()
        assert st2["expert_stall_demand_s"] == st1["expert_stall_demand_s"]
        assert st2["expert_stall_prefetch_s"] - st1["expert_stall_prefetch_s"] >= 0.02
        total = st2["expert_stall_demand_s"] + st2["expert_stall_prefetch_s"]
        assert abs(total - st2["io_stall_s"]) < 1e-9   # no streamed units: all of it experts'
        d = WeightStore.interval(st0, st2, 2)
        assert d["io_stall_demand_per_token_s"] + d["io_stall_prefetch_per_token_s"] == \
            pytest.approx(d["io_stall_per_token_s"])
        assert "on misses" in store.format_stats()
    finally:
        store.close()
        f.close()


def test_demand_reads_go_ahead_of_prefetches():
    pool = IOPool(workers=1)
    gate, order = threading.Event(), []
    try:
        pool.submit(DEMAND, gate.wait)  # occupies the only worker
        futs = [pool.submit(PREFETCH, order.append, "prefetch-1"),
                pool.submit(PREFETCH, order.append, "prefetch-2"),
                pool.submit(DEMAND, order.append, "demand")]
        gate.set()
        for fu in futs:
            fu.result(timeout=5)
    finally:
        pool.shutdown()
    assert order == ["demand", "prefetch-1", "prefetch-2"]


def test_too_many_experts_in_one_call_names_the_limit(moe_path):
    f = open_gguf(moe_path)
    store = WeightStore(f, plan_slots(ModelDesc.from_gguf(f), 3))
    try:
        assert store.expert_batch_limit == 3
        with pytest.raises(AssertionError, match="expert_batch_limit"):
            store.get_experts(0, [0, 1, 2, 3])
        check(f, store.get_experts(0, [4, 5, 6]), 0, [4, 5, 6])
    finally:
        store.close()
        f.close()


# ---- faults ------------------------------------------------------------------------------

class Faulty:
    """Reader failing once on the first request inside [lo, hi): 'eio' or 'short' (half the
    request, then end of file)."""

    def __init__(self):
        self.kind, self.lo, self.hi, self.eof_at = None, 0, 0, None

    def arm(self, kind, lo, hi):
        self.kind, self.lo, self.hi = kind, lo - lo % 4096, hi

    def __call__(self, fd, buf, offset):
        if self.eof_at == offset:
            self.eof_at = None
            return 0
        if self.kind and self.lo <= offset < self.hi:
            kind, self.kind = self.kind, None
            if kind == "eio":
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            n = os_pread(fd, buf[: len(buf) // 2], offset)
            self.eof_at = offset + n
            return n
        return os_pread(fd, buf, offset)


def expert_range(f, il, e):
    t = f.tensors[expert_tensor_names(il)[1]]  # the up slice
    per = t.nbytes // N_EXPERT
    return t.offset + e * per, t.offset + (e + 1) * per


@pytest.mark.parametrize("how", ["demand", "prefetch"])
@pytest.mark.parametrize("kind", ["eio", "short", "shrink"])
def test_expert_read_fault_surfaces_once_then_retry_is_clean(moe_path, tmp_path, kind, how):
    path = tmp_path / "m.gguf"
    shutil.copyfile(moe_path, path)
    original = path.read_bytes()
    f = open_gguf(path)
    reader = Faulty()
    led = Ledger(None, debug="")
    store = WeightStore(f, plan_slots(ModelDesc.from_gguf(f), 4), led, reader=reader)
    try:
        check(f, store.get_experts(0, [0, 1]), 0, [0, 1])
        lo, hi = expert_range(f, 1, 7)  # the last expert of the last layer: near the end
        if kind == "shrink":
            os.truncate(path, (lo + hi) // 2)
        else:
            reader.arm(kind, lo, hi)
        if how == "prefetch":
            store.prefetch_experts(1, [7, 2])
        with pytest.raises(WeightReadError) as e:
            store.get_experts(1, [2, 7])
        msg = str(e.value)
        assert "layer 1" in msg and "retry" in msg
        assert ("Input/output error" in msg) if kind == "eio" else ("short read" in msg)
        if kind == "shrink":
            path.write_bytes(original)
        for _ in range(3):  # surfaced once: the retries read again and are right
            check(f, store.get_experts(1, [2, 7]), 1, [2, 7])
        for il, ex in routing(12):  # and no slot leaked
            check(f, store.get_experts(il, ex), il, ex)
        # failed reads: one expert, or (cut short) both experts whose down slice is past the cut
        assert store.stats()["read_errors"] == (2 if kind == "shrink" else 1)
        assert len(store._x_free) + len(store._x_slot_of) == 4
    finally:
        store.close()
        f.close()
    assert led.total() == 0


def test_lookahead_prefetch_never_evicts_the_layer_about_to_run(moe_path):
    # the model predicts layer L+1 before it asks for layer L's experts: the prefetch must not
    # evict layer L's resident experts (it would turn their hits into demand reads)
    f = open_gguf(moe_path)
    store = WeightStore(f, plan_slots(ModelDesc.from_gguf(f), 4))
    try:
        store.get_experts(0, [0, 1])
        store.get_experts(1, [4, 5])    # cache full: layer 0's 0, 1 and layer 1's 4, 5
        store.get_experts(0, [0, 1])    # hits; now layer 1 is the evictable one
        store.prefetch_experts(1, [6, 7])  # issued while layer 0 runs: may evict 4, 5 only
        st = store.stats()
        assert st["prefetched_experts"] == 2 and st["expert_hits"] == 2
        check(f, store.get_experts(1, [6, 7]), 1, [6, 7])
        assert store.stats()["expert_prefetch_hits"] + store.stats()["expert_hits"] == 4
        store.prefetch_experts(1, [2, 3])  # layer 0 is the one about to run: not a victim
        assert store.stats()["prefetched_experts"] == 2
        check(f, store.get_experts(0, [0, 1]), 0, [0, 1])
        assert store.stats()["expert_misses"] == 4  # only the first two calls missed
    finally:
        store.close()
        f.close()


def test_policies_pick_victims_by_their_rule():
    lru = LRUPolicy()
    for k in ("a", "b", "c"):
        lru.insert(k)
    lru.access("a")
    assert lru.victim(lambda k: True) == "b"
    assert lru.victim(lambda k: k != "b") == "c"
    lru.access("zz")  # not resident: nothing to move
    assert lru.victim(lambda k: False) is None and lru.admit("x", "b")

    d = DecayPolicy(decay=0.5)
    for k, uses in (("a", 3), ("b", 1), ("c", 2)):
        for _ in range(uses):
            d.access(k)
        d.insert(k)
    assert d.victim(lambda k: True) == "b" and d.victim(lambda k: k != "b") == "c"
    d.access("x")
    assert not d.admit("x", "c") and d.admit("x", "b") is False  # 1 use vs 1 use: not more
    for _ in range(3):
        d.advance()
    d.access("x")  # fresh use beats b's old one (decayed to 1/8)
    assert d.admit("x", "b")
    d.remove("b")
    assert d.victim(lambda k: True) == "c"
    for _ in range(10000):  # the heap of stale entries stays bounded
        d.access("a")
    assert len(d._heap) <= 4 * 2 + 64
    prior = DecayPolicy(prior={"h": 10.0, "c": 5.0})
    prior.insert("h")
    prior.insert("c")
    assert prior.victim(lambda k: True) == "c" and prior.score("h") == pytest.approx(2.0)
