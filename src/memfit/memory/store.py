"""The weight store: executes a Plan behind the WeightSource protocol (has / info / get).

- pinned tier: read once with pread into buffers the store owns;
- file tier: streamed per use into two page-aligned slots (double buffering): while the model
  computes with unit u (one layer's streamed tensors) a prefetch thread reads unit u+1
  (cyclically: after the last unit comes the first, i.e. the next token) into the other slot.
  Reads use O_DIRECT in large aligned chunks on an I/O pool, so neither RSS nor the page cache
  grows; where O_DIRECT is refused (tmpfs), buffered pread + POSIX_FADV_DONTNEED;
- an untied embedding is read by rows through a private mmap, released with MADV_DONTNEED
  (and FADV_DONTNEED) each time it is fetched again, so its touched rows do not accumulate.

Model code never knows which tier served a tensor. A QTensor from a streamed unit is valid
until the model has moved two units further (the slot is then reused).
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ..ops import QTensor
from .ledger import Ledger, LedgerDriftError
from .planner import Plan

PAGE = 4096
IO_CHUNK = 4 << 20      # bytes per read request
IO_WORKERS = 4          # requests in flight (disk queue depth)


def _floor(n: int) -> int:
    return n - n % PAGE


def _ceil(n: int) -> int:
    return -(-n // PAGE) * PAGE


class WeightStore:
    def __init__(self, gguf_file, plan: Plan, ledger: Ledger | None = None, *,
                 direct: bool = True, prefetch: bool = True):
        self._closed = False
        self.file = gguf_file
        self.plan = plan
        self.ledger = ledger
        self.prefetch_enabled = prefetch
        self.tensors = gguf_file.tensors
        assert len(gguf_file.paths) >= 1
        self._fds: dict[int, int] = {}
        self.direct = False
        for i, p in enumerate(gguf_file.paths):
            fd = None
            if direct and hasattr(os, "O_DIRECT"):
                try:
                    fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
                    self.direct = True
                except OSError:
                    fd = None
            self._fds[i] = fd if fd is not None else os.open(p, os.O_RDONLY)
        self.direct = self.direct and len(self._fds) > 0
        self.bytes_read = 0
        self.gets = 0
        self.hits = 0               # served without waiting for I/O
        self.io_stall_s = 0.0
        self._stream_bytes = 0      # file-tier bytes read, and seconds spent reading them
        self._stream_s = 0.0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(IO_WORKERS, thread_name_prefix="memfit-io")
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="memfit-prefetch")

        # the plan's reservations nobody else registers (activations, KV, staging), so the
        # ledger total is the planned total and the debug watchdog compares RSS with it
        self._reserved: list[tuple[str, str]] = []
        if ledger is not None:
            for cat, n in (("scratch", plan.scratch_bytes), ("kv", plan.kv_bytes),
                           ("io_staging", plan.io_staging_bytes)):
                if not ledger.items(cat):
                    ledger.alloc(cat, "plan", n)
                    self._reserved.append((cat, "plan"))

        # pinned tier
        self._pinned: dict[str, np.ndarray] = {}
        for name in plan.tiers["pinned"]:
            ti = self.tensors[name]
            buf, view = self._alloc_aligned(ti.offset, ti.nbytes)
            self._read_into(ti.file_index, ti.offset, buf, view)
            self._pinned[name] = view
            if ledger is not None:
                ledger.alloc("resident_weights", name, buf.nbytes)
        assert not plan.tiers["cache"], "expert cache tier: MoE models are not supported yet"

        # streamed units: layout of each unit inside a slot (page-aligned per tensor)
        self.units = plan.units
        self._unit_of: dict[str, int] = {}
        self._layout: list[dict[str, tuple[int, int]]] = []   # name -> (slot offset, delta)
        self._unit_read_bytes: list[int] = []
        slot_bytes = 0
        for ui, u in enumerate(self.units):
            lay, pos = {}, 0
            for name in u.tensors:
                ti = self.tensors[name]
                self._unit_of[name] = ui
                lay[name] = (pos, ti.offset - _floor(ti.offset))
                pos += _ceil(ti.offset + ti.nbytes) - _floor(ti.offset)
            self._layout.append(lay)
            self._unit_read_bytes.append(pos)
            slot_bytes = max(slot_bytes, pos)
        self._slot_mm = [mmap.mmap(-1, max(slot_bytes, PAGE)) for _ in range(2 if self.units else 0)]
        self._slots = [np.frombuffer(m, np.uint8) for m in self._slot_mm]
        if ledger is not None:
            for i, s in enumerate(self._slots):
                ledger.alloc("weight_cache", f"stream_slot_{i}", s.nbytes)
        self._slot_unit = [-1, -1]
        self._slot_future: list[Future | None] = [None, None]
        self._current = -1

        # embedding read by rows through a private mapping
        self._emb = plan.embedding_by_rows
        self._emb_mm = None
        if self._emb is not None:
            ti = self.tensors[self._emb]
            with open(gguf_file.paths[ti.file_index], "rb") as fh:
                self._emb_mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            self._emb_range = (_floor(ti.offset), _ceil(ti.offset + ti.nbytes))
            self._emb_fd = os.open(gguf_file.paths[ti.file_index], os.O_RDONLY)
        if ledger is not None and ledger.debug:
            ledger.start_watchdog()

    # ---- WeightSource ----
    def has(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str):
        t = self.tensors[name]
        return t.shape, t.type

    def get(self, name: str) -> QTensor:
        t = self.tensors[name]
        self.gets += 1
        if name in self._pinned:
            self.hits += 1
            return QTensor(name, t.type, t.shape, self._pinned[name])
        if name == self._emb:
            return self._get_rows_tensor(t)
        ui = self._unit_of.get(name)
        assert ui is not None, f"tensor {name} has no tier in the plan"
        slot = self._ensure(ui)
        off, delta = self._layout[ui][name]
        data = self._slots[slot][off + delta: off + delta + t.nbytes]
        return QTensor(name, t.type, t.shape, data)

    # ---- streaming ----
    def _ensure(self, ui: int) -> int:
        """Slot holding unit ui, loaded; waits for (or issues) its read, then prefetches the next."""
        if ui in self._slot_unit:
            slot = self._slot_unit.index(ui)
            fut = self._slot_future[slot]
            if fut is not None and not fut.done():
                t0 = time.perf_counter()
                fut.result()
                self.io_stall_s += time.perf_counter() - t0
            else:
                if fut is not None:
                    fut.result()  # surface a failed read
                self.hits += 1
        else:
            # not there: the slot not holding the current unit takes it (wait for its prefetch)
            slot = 1 if self._slot_unit[0] == self._current and self._current != -1 else 0
            t0 = time.perf_counter()
            fut = self._slot_future[slot]
            if fut is not None:
                fut.result()
            self._slot_unit[slot] = ui
            self._slot_future[slot] = None
            self._count(self._unit_read_bytes[ui])
            self._read_unit(ui, slot)
            self.io_stall_s += time.perf_counter() - t0
        if ui != self._current:
            self._current = ui
            nxt = (ui + 1) % len(self.units)
            other = 1 - slot
            if self.prefetch_enabled and nxt != ui and self._slot_unit[other] != nxt:
                prev = self._slot_future[other]
                if prev is not None:
                    prev.result()
                self._slot_unit[other] = nxt
                self._count(self._unit_read_bytes[nxt])
                self._slot_future[other] = self._prefetcher.submit(self._read_unit, nxt, other)
        return slot

    def _count(self, n: int) -> None:
        # bytes are counted when a read is issued, so statistics do not race the prefetcher
        with self._lock:
            self.bytes_read += n

    def _read_unit(self, ui: int, slot: int) -> None:
        t0 = time.perf_counter()
        buf = self._slots[slot]
        futs = []
        for name, (off, delta) in self._layout[ui].items():
            ti = self.tensors[name]
            start, end = _floor(ti.offset), _ceil(ti.offset + ti.nbytes)
            for c in range(start, end, IO_CHUNK):
                n = min(IO_CHUNK, end - c)
                dst = buf[off + (c - start): off + (c - start) + n]
                futs.append(self._pool.submit(self._pread, ti.file_index, c, dst))
        for f in futs:
            f.result()
        # unit reads are serial (one prefetch at a time), so bytes / summed time is the rate
        # the store streams at under real decode conditions (CPU load included)
        dt = time.perf_counter() - t0
        with self._lock:
            self._stream_bytes += self._unit_read_bytes[ui]
            self._stream_s += dt

    def _pread(self, file_index: int, offset: int, dst: np.ndarray) -> None:
        fd = self._fds[file_index]
        mv = memoryview(dst)
        done = 0
        while done < len(mv):
            n = os.preadv(fd, [mv[done:]], offset + done)
            if n == 0:  # end of file inside the aligned tail: the rest is padding
                mv[done:] = b"\0" * (len(mv) - done)
                break
            done += n
        if not self.direct:
            os.posix_fadvise(fd, offset, len(mv), os.POSIX_FADV_DONTNEED)

    def _alloc_aligned(self, offset: int, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
        start, end = _floor(offset), _ceil(offset + nbytes)
        mm = mmap.mmap(-1, end - start)
        buf = np.frombuffer(mm, np.uint8)
        return buf, buf[offset - start: offset - start + nbytes]

    def _read_into(self, file_index: int, offset: int, buf: np.ndarray, view: np.ndarray) -> None:
        start = _floor(offset)
        self._count(buf.nbytes)
        futs = [self._pool.submit(self._pread, file_index, start + c, buf[c: c + IO_CHUNK])
                for c in range(0, buf.nbytes, IO_CHUNK)]
        for f in futs:
            f.result()

    def _get_rows_tensor(self, t) -> QTensor:
        # drop the rows touched since the last fetch, then hand out a fresh view
        a, b = self._emb_range
        self._emb_mm.madvise(mmap.MADV_DONTNEED, a, min(b, len(self._emb_mm)) - a)
        os.posix_fadvise(self._emb_fd, a, b - a, os.POSIX_FADV_DONTNEED)
        self.hits += 1
        data = np.frombuffer(self._emb_mm, np.uint8, count=t.nbytes, offset=t.offset)
        return QTensor(t.name, t.type, t.shape, data)

    # ---- statistics / lifetime ----
    def stats(self) -> dict:
        return {"bytes_read": self.bytes_read, "gets": self.gets,
                "hit_rate": self.hits / self.gets if self.gets else 1.0,
                "io_stall_s": self.io_stall_s, "o_direct": self.direct,
                "stream_read_bytes_per_s": (self._stream_bytes / self._stream_s
                                            if self._stream_s > 0 else 0.0),
                "pinned_bytes": self.plan.tier_bytes["pinned"],
                "slot_bytes": sum(s.nbytes for s in self._slots)}

    def format_stats(self) -> str:
        s = self.stats()
        return (f"store: read {s['bytes_read'] / 1e6:.1f} MB, hit rate {s['hit_rate']:.0%}, "
                f"I/O stall {s['io_stall_s']:.2f} s" + ("" if s["o_direct"] else " (buffered)"))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for f in self._slot_future:
            if f is not None:
                try:
                    f.result()
                except Exception:
                    pass
        self._prefetcher.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        if self.direct and self.file.paths:
            # calibrate later plans with this device's streaming rate (page-cache reads excluded)
            from .bandwidth import record_observed_disk
            record_observed_disk(self.file.paths[0], self._stream_bytes, self._stream_s)
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        if self._emb_mm is not None:
            os.close(self._emb_fd)
            self._emb_mm = None  # views may still reference it; the GC closes it
        if self.ledger is not None:
            self.ledger.stop_watchdog()
            for cat, name in self._reserved:
                self.ledger.free(cat, name)
            self._reserved = []
            for name in list(self._pinned):
                self.ledger.free("resident_weights", name)
            for i in range(len(self._slots)):
                self.ledger.free("weight_cache", f"stream_slot_{i}")
        self._pinned = {}
        if self.ledger is not None and self.ledger.debug == "raise" and self.ledger.violation:
            raise LedgerDriftError(f"memfit ledger drift during the run: {self.ledger.violation}")

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()
