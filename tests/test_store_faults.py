"""Fault injection in the weight store (dense units): an I/O error, a short read and a file
that shrinks, on demand reads and on prefetches. Each surfaces as one WeightReadError, and a
retried forward returns logits identical to the reference (a slot holds a unit only after
every byte arrived). The reader is the store's own injection point; nothing else is mocked."""

from __future__ import annotations

import errno
import os
import shutil
import threading

import numpy as np
import pytest

from memfit.errors import MemfitError, WeightReadError
from memfit.gguf import open_gguf
from memfit.memory.bandwidth import Bandwidth
from memfit.memory.io import os_pread
from memfit.memory.ledger import Ledger
from memfit.memory.planner import ModelDesc, plan
from memfit.memory.store import WeightStore
from memfit.models import load_model
from memfit.synth import synth

BW = Bandwidth(10e9, 1e9, "test")
PROMPT = np.array([1, 2, 3, 4], np.int32)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("faults") / "m.gguf", "qwen2", "tiny", "Q4_K_M",
                 seed=5, progress=False).path


def floor_plan(desc):
    def at(b):
        return plan(desc, b, 64, 2, BW, baseline_bytes=0, n_batch=64)
    return at(at(1 << 40).min_budget_bytes)


@pytest.fixture(scope="module")
def reference(model_path):
    m = load_model(model_path)
    try:
        cache = m.new_cache(64)
        first = m.forward(PROMPT, cache)
        second = m.forward(np.array([int(np.argmax(first))], np.int32), cache)
        return first, second
    finally:
        m.file.close()


class Faulty:
    """The store's reader with one armed fault at file offsets [lo, hi): 'eio' raises EIO,
    'short' returns part of the request and then end-of-file."""

    def __init__(self):
        self.kind, self.lo, self.hi = None, 0, 0
        self.fired = 0
        self.short_at = None
        self.lock = threading.Lock()

    def arm(self, kind, lo, hi):
        self.kind, self.lo, self.hi, self.fired, self.short_at = kind, lo, hi, 0, None

    def __call__(self, fd, buf, offset):
        with self.lock:
            hit = self.kind and self.lo <= offset < self.hi and not self.fired
            if hit:
                self.fired += 1
                kind, self.kind = self.kind, None
            elif self.short_at == offset:
                self.short_at = None
                return 0  # the rest of the short read: end of file
        if hit and kind == "eio":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        if hit and kind == "short":
            n = os_pread(fd, buf[: len(buf) // 2], offset)
            self.short_at = offset + n
            return n
        return os_pread(fd, buf, offset)


def unit_range(f, p, name):
    """File byte range [lo, hi) of streamed unit `name`."""
    u = next(u for u in p.units if u.name == name)
    ts = [f.tensors[n] for n in u.tensors]
    return min(t.offset for t in ts), max(t.offset + t.nbytes for t in ts)


def run_with_fault(path, reference, *, prefetch, inject):
    f = open_gguf(path)
    p = floor_plan(ModelDesc.from_gguf(f))
    reader = Faulty()
    led = Ledger(None, debug="")
    store = WeightStore(f, p, led, prefetch=prefetch, reader=reader)
    try:
        assert len(p.units) >= 3
        model = load_model(f, weights=store)
        cache = model.new_cache(64)
        # blk.2: its read is a prefetch (issued while blk.1 computes) when prefetch is on
        inject(f, p, reader, unit_range(f, p, "blk.2"))
        with pytest.raises(WeightReadError) as e:
            model.forward(PROMPT, cache)
        msg = str(e.value)
        assert "blk.2" in msg and "retry" in msg and isinstance(e.value, MemfitError)
        assert cache.offset == 0
        # the failure surfaced once: the retry reads again and gets the reference bytes
        first = model.forward(PROMPT, cache)
        np.testing.assert_array_equal(first, reference[0])
        second = model.forward(np.array([int(np.argmax(first))], np.int32), cache)
        np.testing.assert_array_equal(second, reference[1])
        assert store.stats()["read_errors"] == 1
        return msg
    finally:
        store.close()
        f.close()
        assert led.total() == 0


@pytest.mark.parametrize("prefetch", [False, True], ids=["demand", "prefetch"])
@pytest.mark.parametrize("kind", ["eio", "short"])
def test_read_fault_surfaces_once_and_retry_matches(model_path, reference, prefetch, kind):
    def inject(f, p, reader, rng):
        reader.arm(kind, rng[0] - rng[0] % 4096, rng[1])
    msg = run_with_fault(model_path, reference, prefetch=prefetch, inject=inject)
    assert ("Input/output error" in msg) if kind == "eio" else ("short read" in msg)


@pytest.mark.parametrize("prefetch", [False, True], ids=["demand", "prefetch"])
def test_file_that_shrinks_is_an_error_not_zero_weights(model_path, reference, tmp_path,
                                                        prefetch):
    path = tmp_path / "copy.gguf"
    shutil.copyfile(model_path, path)
    original = path.read_bytes()
    f = open_gguf(path)
    p = floor_plan(ModelDesc.from_gguf(f))
    store = WeightStore(f, p, Ledger(None, debug=""), prefetch=prefetch)
    try:
        model = load_model(f, weights=store)
        cache = model.new_cache(64)
        lo, hi = unit_range(f, p, "blk.2")
        emb = f.tensors["token_embd.weight"]
        assert emb.offset + emb.nbytes <= lo  # the mmapped embedding rows stay in the file
        os.truncate(path, (lo + hi) // 2)     # the store keeps its descriptors open
        with pytest.raises(WeightReadError) as e:
            model.forward(PROMPT, cache)
        msg = str(e.value)
        assert "short read" in msg and "truncated" in msg and "blk.2" in msg
        path.write_bytes(original)  # restored: the retry reads the whole unit again
        first = model.forward(PROMPT, cache)
        np.testing.assert_array_equal(first, reference[0])
        second = model.forward(np.array([int(np.argmax(first))], np.int32), cache)
        np.testing.assert_array_equal(second, reference[1])
    finally:
        store.close()
        f.close()


def test_failed_unneeded_prefetch_is_dropped_not_raised_forever(model_path, reference):
    # a prefetch that fails is drained; the demand for its unit reads it again
    f = open_gguf(model_path)
    p = floor_plan(ModelDesc.from_gguf(f))
    reader = Faulty()
    store = WeightStore(f, p, prefetch=True, reader=reader)
    try:
        model = load_model(f, weights=store)
        cache = model.new_cache(64)
        lo, hi = unit_range(f, p, "blk.2")
        reader.arm("eio", lo - lo % 4096, hi)
        with pytest.raises(WeightReadError):
            model.forward(PROMPT, cache)
        for _ in range(2):  # no stale error comes back on later calls
            c2 = model.new_cache(64)
            np.testing.assert_array_equal(model.forward(PROMPT, c2), reference[0])
    finally:
        store.close()
        f.close()
