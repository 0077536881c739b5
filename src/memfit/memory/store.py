"""The weight store: executes a Plan behind the WeightSource protocol (has / info / get, and
get_experts / prefetch_experts for mixture-of-experts models).

- pinned tier: read once with pread into buffers the store owns (the hot experts too);
- file tier: streamed per use into two page-aligned slots (double buffering): while the model
  computes with unit u (one layer's streamed tensors) the next unit, as the prefetch policy
  names it (policy.NextUnitPrefetch: u+1, cyclically), is read into the other slot;
- expert cache: fixed slots, each one expert's gate/up/down slices (three ranges of the
  file), filled on demand or by router-lookahead prefetch, evicted by a replacement policy
  object (policy.LRUPolicy / DecayPolicy);
- an untied embedding is read by rows through a private mmap, released with MADV_DONTNEED
  (and FADV_DONTNEED) each time it is fetched again, so its touched rows do not accumulate.

Reads use O_DIRECT in large aligned chunks on an I/O pool where demand reads go ahead of
prefetches (IO_WORKERS requests in flight: the queue depth). The experts one call needs (or
one look-ahead hint names) are read as one batch: their page-aligned ranges sorted and merged
where they touch (neighbouring experts of one stacked tensor are adjacent in the file), each
merged run one preadv into the experts' slots (a page two experts share is read once and
copied), so a layer's misses cost a few large reads instead of three per expert;
MEMFIT_COALESCE=0 reads each expert's three ranges apart (the old path, for comparison).
stats() counts read requests and bytes per request. Neither RSS nor the page cache grows;
where O_DIRECT is refused (tmpfs), buffered pread + POSIX_FADV_DONTNEED. A slot holds a unit
only after every byte arrived: a failed read drains the unit's other reads, frees the slot
and raises WeightReadError once; the next call reads again.

Model code never knows which tier served a tensor. A QTensor from a streamed unit is valid
until the model has moved two units further (the slot is then reused); experts are valid
until the next get_experts call.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from typing import Sequence

import numpy as np

from ..errors import WeightReadError
from ..ops import QTensor
from .io import (DEMAND, IO_CHUNK, IO_WORKERS, PAGE, PREFETCH, Done, IOPool, Reader, os_pread,
                 when_all)
from .ledger import Ledger, LedgerDriftError
from .planner import Plan, expert_switch, expert_tensor_names
from .policy import LookaheadDecision, NextUnitPrefetch, make_policy

__all__ = ["WeightStore", "IO_CHUNK", "IO_WORKERS", "PAGE"]


def _floor(n: int) -> int:
    return n - n % PAGE


def _ceil(n: int) -> int:
    return -(-n // PAGE) * PAGE


class WeightStore:
    def __init__(self, gguf_file, plan: Plan, ledger: Ledger | None = None, *,
                 direct: bool = True, prefetch: bool = True, reader: Reader | None = None,
                 expert_policy=None, routing=None):
        """reader(fd, buf, offset) -> n replaces os.preadv (fault-injection tests);
        expert_policy: a policy object or name (default: the plan's); routing: a
        hotset.RoutingCounts that get_experts updates (saved by its owner)."""
        self._closed = False
        self.file = gguf_file
        self.plan = plan
        self.ledger = ledger
        self.prefetch_enabled = prefetch
        self.prefetch_policy = NextUnitPrefetch()
        self.tensors = gguf_file.tensors
        self._reader = reader or os_pread
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
        self.read_errors = 0        # failed reads surfaced (or dropped prefetches)
        self.reads = 0              # read requests issued (one pread/preadv call's worth each)
        self.read_bytes = 0         # bytes those requests asked for
        # MEMFIT_COALESCE=0: one request per expert range (the old path, for comparison)
        self.coalesce = expert_switch("MEMFIT_COALESCE")
        self._stream_bytes = 0      # file-tier bytes read, and seconds spent reading them
        self._stream_s = 0.0
        self._lock = threading.Lock()
        self._io = IOPool()
        self._ledger_items: list[tuple[str, str]] = []
        try:
            self._setup(plan, ledger, expert_policy, routing)
        except BaseException:
            self.close()
            raise

    def _setup(self, plan: Plan, ledger: Ledger | None, expert_policy, routing) -> None:
        # the store books only its own buffers (pinned tensors, slots, expert cache); the
        # runtime books the baseline and scratch, the KV pool its blocks (runtime.Runtime)
        # pinned tier
        self._pinned: dict[str, np.ndarray] = {}
        for name in plan.tiers["pinned"]:
            ti = self.tensors[name]
            buf, view = self._alloc_aligned(ti.offset, ti.nbytes)
            self._register("resident_weights", name, buf.nbytes)
            self._wait(self._read_ranges([(ti.file_index, _floor(ti.offset), buf,
                                           ti.offset + ti.nbytes - _floor(ti.offset))],
                                         DEMAND), name)
            self._pinned[name] = view

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
        n_slots = 2 if self.units else 0
        for i in range(n_slots):
            self._register("weight_cache", f"stream_slot_{i}", max(slot_bytes, PAGE))
        self._slot_mm = [mmap.mmap(-1, max(slot_bytes, PAGE)) for _ in range(n_slots)]
        self._slots = [np.frombuffer(m, np.uint8) for m in self._slot_mm]
        self._slot_unit = [-1] * n_slots       # unit whose every byte is in the slot
        self._slot_loading = [-1] * n_slots    # unit being read into it
        self._slot_future: list[Done | None] = [None] * n_slots
        self._current = -1

        self._setup_experts(plan, expert_policy, routing)

        # embedding read by rows through a private mapping
        self._emb = plan.embedding_by_rows
        self._emb_mm = None
        if self._emb is not None:
            ti = self.tensors[self._emb]
            with open(self.file.paths[ti.file_index], "rb") as fh:
                self._emb_mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            self._emb_range = (_floor(ti.offset), _ceil(ti.offset + ti.nbytes))
            self._emb_fd = os.open(self.file.paths[ti.file_index], os.O_RDONLY)
            # a token's row faults in its own pages only: the kernel's read-around of a fault
            # (the device's read-ahead, 8 MiB on this host's virtio disk) read 8 MiB from the
            # disk for every token's 1 KiB row once the rows were dropped (6-10 ms a token)
            a, b = self._emb_range
            self._emb_mm.madvise(mmap.MADV_RANDOM, a, min(b, len(self._emb_mm)) - a)
        if ledger is not None and ledger.debug:
            ledger.start_watchdog()

    def _register(self, cat: str, name: str, n: int) -> None:
        if self.ledger is not None:
            self.ledger.alloc(cat, name, n)
            self._ledger_items.append((cat, name))

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

    # ---- streaming (dense units) ----
    def _ensure(self, ui: int) -> int:
        """Slot holding unit ui, loaded; waits for (or issues) its read, then prefetches the
        next unit the prefetch policy names."""
        slot = next((s for s in range(len(self._slots))
                     if ui in (self._slot_unit[s], self._slot_loading[s])), None)
        if slot is not None and self._slot_unit[slot] == ui:
            self.hits += 1
        elif slot is not None:  # its prefetch is in flight (or done, not yet looked at)
            fut = self._slot_future[slot]
            if fut.done():
                self.hits += 1
            t0 = time.perf_counter()
            self._finish_slot(slot, surface=True)
            self.io_stall_s += time.perf_counter() - t0
        else:
            # not there: the slot not holding the current unit takes it
            cur = self._current
            slot = 1 if cur != -1 and cur in (self._slot_unit[0], self._slot_loading[0]) else 0
            t0 = time.perf_counter()
            self._finish_slot(slot, surface=False)  # an unneeded prefetch: drain, drop
            self._start_unit(ui, slot, DEMAND)
            self._finish_slot(slot, surface=True)
            self.io_stall_s += time.perf_counter() - t0
        if ui != self._current:
            self._current = ui
            nxt = self.prefetch_policy.next_unit(ui, len(self.units))
            other = 1 - slot
            if (self.prefetch_enabled and nxt is not None
                    and nxt not in (self._slot_unit[other], self._slot_loading[other])):
                self._finish_slot(other, surface=False)
                self._start_unit(nxt, other, PREFETCH)
        return slot

    def _start_unit(self, ui: int, slot: int, prio: int) -> None:
        assert self._slot_future[slot] is None
        self._slot_unit[slot] = -1
        self._slot_loading[slot] = ui
        self._count(self._unit_read_bytes[ui])
        buf, ranges = self._slots[slot], []
        for name, (off, _delta) in self._layout[ui].items():
            ti = self.tensors[name]
            start, end = _floor(ti.offset), _ceil(ti.offset + ti.nbytes)
            ranges.append((ti.file_index, start, buf[off: off + end - start],
                           ti.offset + ti.nbytes - start))
        t0 = time.perf_counter()
        fut = self._read_ranges(ranges, prio)
        n = self._unit_read_bytes[ui]

        def timed(f):
            # one unit read in flight at a time per slot pair: bytes / summed time is the
            # rate the store streams at under real decode conditions (CPU load included)
            if f.exception() is None:
                with self._lock:
                    self._stream_bytes += n
                    self._stream_s += time.perf_counter() - t0
        fut.add_done_callback(timed)
        self._slot_future[slot] = fut

    def _finish_slot(self, slot: int, surface: bool) -> None:
        """Wait for the slot's read (all of its chunks). Success: the slot holds the unit.
        Failure: the slot is freed, and the error raised once when surface, else dropped."""
        fut = self._slot_future[slot]
        if fut is None:
            return
        err = fut.exception()  # waits; never raises
        self._slot_future[slot] = None
        ui, self._slot_loading[slot] = self._slot_loading[slot], -1
        if err is None:
            self._slot_unit[slot] = ui
            return
        self._slot_unit[slot] = -1
        self.read_errors += 1
        if surface:
            raise self._wrap(err, self.units[ui].name)

    def _count(self, n: int) -> None:
        # bytes are counted when a read is issued, so statistics do not race the prefetcher
        with self._lock:
            self.bytes_read += n

    def _wrap(self, err: BaseException, what: str) -> BaseException:
        if isinstance(err, WeightReadError):
            return WeightReadError(f"{err} (reading {what}); retry, or check the disk and the file")
        if isinstance(err, OSError):
            return WeightReadError(f"reading {what} from {self.file.paths[0]} failed: {err}; "
                                   "retry, or check the disk and the file")
        return err

    def _wait(self, fut: Done, what: str) -> None:
        err = fut.exception()
        if err is not None:
            self.read_errors += 1
            raise self._wrap(err, what)

    def _read_ranges(self, ranges, prio: int) -> Done:
        """Read (file_index, offset, dst, need) ranges in IO_CHUNK requests; the Done is done
        when every request is (first error carried). need: bytes of dst that must come from
        the file; past them (the aligned tail at the end of the file) zeros may stand in."""
        batch, nbytes = [], 0
        for fi, off, dst, need in ranges:
            for c in range(0, len(dst), IO_CHUNK):
                batch.append((prio, Done(), self._pread, (fi, off + c, dst[c: c + IO_CHUNK],
                                                          need - c)))
                nbytes += len(dst[c: c + IO_CHUNK])
        self._io.submit_batch(batch)
        futs = [b[1] for b in batch]
        with self._lock:
            self.reads += len(futs)
            self.read_bytes += nbytes
        return when_all(futs)

    def _read_coalesced(self, pieces, prio: int) -> tuple[list[Done], int, int]:
        """Read pieces (file_index, offset, dst, need, tag), page-aligned, sorted and merged:
        pieces whose file ranges touch or share a page (neighbouring experts of one stacked
        tensor) become one run read by preadv into the pieces' buffers (a page shared by two
        pieces is read once, into the first, and copied into the second); runs are cut into
        requests of at most IO_CHUNK bytes that the I/O pool issues IO_WORKERS at a time.
        Returns (one Done per piece, in the order given: done when every byte of the piece
        is there), number of requests, bytes they read."""
        order = sorted(range(len(pieces)), key=lambda i: (pieces[i][0], pieces[i][1]))
        runs: list[list] = []    # [file_index, start, end, need_end, [(i, skip)]]
        for i in order:
            fi, off, dst, need, _ = pieces[i]
            end = off + len(dst)
            r = runs[-1] if runs else None
            if r is not None and r[0] == fi and off <= r[2] < end and r[2] - off < len(dst):
                r[4].append((i, r[2] - off))   # skip the bytes already read into the run
                r[2] = end
                r[3] = max(r[3], off + need)
            else:
                runs.append([fi, off, end, off + need, [(i, 0)]])
        done = [[] for _ in pieces]     # request futures each piece waits for
        batch = []                      # the requests, queued at once (IOPool.submit_batch)
        n_req = nbytes = 0
        for fi, start, end, need_end, members in runs:
            # requests: iovec lists of <= IO_CHUNK bytes; copies run after the request that
            # read their source
            req, req_off, req_len, req_pieces, copies = [], start, 0, set(), []
            prev = None    # (piece index, its dst) of the previous member

            def flush():
                nonlocal req, req_off, req_len, req_pieces, copies, n_req, nbytes
                if not req:
                    return
                fut = Done()
                batch.append((prio, fut, self._preadv,
                              (fi, req_off, req, need_end - req_off, copies)))
                for j in req_pieces:
                    done[j].append(fut)
                n_req += 1
                nbytes += req_len
                req_off += req_len
                req, req_len, req_pieces, copies = [], 0, set(), []

            for i, skip in members:
                dst = pieces[i][2]
                if skip:
                    # the shared bytes come from the previous piece's tail, after its read
                    pj, pdst = prev
                    copies_for = (pdst[len(pdst) - skip:], dst[:skip])
                    # the copy runs in the request that read its source when that is the
                    # current one (the previous piece's tail is its last bytes)
                    if req_len >= skip:
                        copies.append(copies_for)
                        req_pieces.add(i)
                    else:
                        # source split across requests: copy after both, in a request of its own
                        flush()
                        src_fut = when_all(done[pj])
                        cp = copies_for
                        fut = Done()

                        def after(f, cp=cp, fut=fut):
                            if f.exception() is None:
                                cp[1][:] = cp[0]
                                fut.set_result(None)
                            else:
                                fut.set_exception(f.exception())
                        src_fut.add_done_callback(after)
                        done[i].append(fut)
                body = dst[skip:]
                pos = 0
                while pos < len(body):
                    take = min(len(body) - pos, IO_CHUNK - req_len)
                    req.append(body[pos: pos + take])
                    req_len += take
                    req_pieces.add(i)
                    pos += take
                    if req_len >= IO_CHUNK:
                        flush()
                prev = (i, dst)
            flush()
        self._io.submit_batch(batch)
        with self._lock:
            self.reads += n_req
            self.read_bytes += nbytes
        return [when_all(d) for d in done], n_req, nbytes

    def _preadv(self, file_index: int, offset: int, bufs: list, need: int, copies) -> None:
        """One read request into several page-aligned buffers (preadv: one system call for
        the lot with the default reader; an injected reader is called per buffer), then the
        copies (src, dst) of bytes shared with a buffer before."""
        if len(bufs) == 1 or self._reader is not os_pread:
            pos = 0
            for b in bufs:
                self._pread(file_index, offset + pos, b, need - pos)
                pos += len(b)
        else:
            fd = self._fds[file_index]
            views = [memoryview(b) for b in bufs]
            total = sum(len(v) for v in views)
            done = 0
            while done < total:
                # skip the buffers already filled; cut the first partly filled one
                rest, acc = [], 0
                for v in views:
                    if acc + len(v) <= done:
                        acc += len(v)
                        continue
                    rest.append(v[max(0, done - acc):])
                    acc += len(v)
                n = os.preadv(fd, rest, offset + done)
                if n == 0:
                    if done < need:
                        raise WeightReadError(
                            f"short read from {self.file.paths[file_index]}: end of file at "
                            f"offset {offset + done}, {min(need, total) - done} bytes of weights "
                            "missing (was the file truncated or replaced?)")
                    for v in rest:   # aligned tail past the end of the file
                        v[:] = b"\0" * len(v)
                    break
                done += n
            if not self.direct:
                os.posix_fadvise(fd, offset, total, os.POSIX_FADV_DONTNEED)
        for src, dst in copies:
            dst[:] = src

    def _pread(self, file_index: int, offset: int, dst: np.ndarray, need: int) -> None:
        fd = self._fds[file_index]
        mv = memoryview(dst)
        done = 0
        while done < len(mv):
            n = self._reader(fd, mv[done:], offset + done)
            if n == 0:
                if done < need:  # the file ends before the tensor does: it changed or shrank
                    raise WeightReadError(
                        f"short read from {self.file.paths[file_index]}: end of file at offset "
                        f"{offset + done}, {min(need, len(mv)) - done} bytes of weights missing "
                        "(was the file truncated or replaced?)")
                mv[done:] = b"\0" * (len(mv) - done)  # aligned tail past the end of the file
                break
            done += n
        if not self.direct:
            os.posix_fadvise(fd, offset, len(mv), os.POSIX_FADV_DONTNEED)

    def _alloc_aligned(self, offset: int, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
        start, end = _floor(offset), _ceil(offset + nbytes)
        mm = mmap.mmap(-1, end - start)
        buf = np.frombuffer(mm, np.uint8)
        self._count(buf.nbytes)
        return buf, buf[offset - start: offset - start + nbytes]

    def _get_rows_tensor(self, t) -> QTensor:
        # drop the rows touched since the last fetch, then hand out a fresh view
        a, b = self._emb_range
        self._emb_mm.madvise(mmap.MADV_DONTNEED, a, min(b, len(self._emb_mm)) - a)
        os.posix_fadvise(self._emb_fd, a, b - a, os.POSIX_FADV_DONTNEED)
        self.hits += 1
        data = np.frombuffer(self._emb_mm, np.uint8, count=t.nbytes, offset=t.offset)
        return QTensor(t.name, t.type, t.shape, data)

    # ---- experts ----
    def _setup_experts(self, plan: Plan, expert_policy, routing) -> None:
        self.n_expert = int(getattr(plan, "n_expert", 0) or 0)
        self.routing = routing
        self._x_tensors: dict[int, tuple] = {}   # layer -> (gate, up, down) TensorInfo
        layers = sorted({int(n.split(".")[1]) for n in plan.tensor_bytes
                         if n.startswith("blk.") and n.endswith("_exps.weight")})
        for il in layers:
            names = expert_tensor_names(il)
            if all(n in self.tensors for n in names):
                self._x_tensors[il] = tuple(self.tensors[n] for n in names)
        self.wants_expert_prediction = False
        self._lookahead = None
        self._x_pending: list = []                 # (layer, experts) used through the table
        self.expert_table = None
        self.xstats = {"requests": 0, "hits": 0, "hot_hits": 0, "misses": 0,
                       "prefetch_hits": 0, "prefetched": 0, "prefetch_wasted_bytes": 0,
                       "predicted_routed": 0, "routed_predicted": 0, "demand_bytes": 0,
                       "prefetch_bytes": 0, "reads": 0, "read_bytes": 0,
                       "stall_demand_s": 0.0, "stall_prefetch_s": 0.0}
        if not self._x_tensors or not self.n_expert:
            self._x_nslots = 0
            return
        # One mapping holds the hot experts, then the cache's slots (each booked in its own
        # category), so that the fused MoE layer finds every expert at hand through one buffer
        # and the table expert_table: xoff[il] [n_expert, 3] int64, the byte offsets in it of
        # the expert's gate, up and down, -1 while the expert is not all there.
        self._hot: dict[tuple[int, int], tuple[np.ndarray, list]] = {}
        hot = [tuple(k) for k in getattr(plan, "hot_experts", ()) or ()]
        hot_bytes = sum(self._x_span(k) for k in hot)
        self._x_nslots = int(getattr(plan, "cache_slots", 0) or 0)
        self._x_slot_bytes = int(getattr(plan, "cache_slot_bytes", 0) or 0)
        self._x_base = hot_bytes                   # slot i at _x_base + i * _x_slot_bytes
        total = hot_bytes + self._x_nslots * self._x_slot_bytes
        if total:
            self._x_mm = mmap.mmap(-1, total)
            xb = np.frombuffer(self._x_mm, np.uint8)
            self.xoff = {il: np.full((self.n_expert, 3), -1, np.int64) for il in self._x_tensors
                         if self._x_tensors[il][0].name not in self._pinned}
            self.expert_table = (xb, self.xoff)
        if hot:
            self._register("resident_weights", "hot_experts", hot_bytes)
            pos, items = 0, []
            for k in hot:
                n = self._x_span(k)
                items.append((k, xb[pos: pos + n], pos))
                pos += n
            started = self._x_read([it[:2] for it in items], DEMAND)
            for (k, buf, at), (lay, _f) in zip(items, started):
                self._hot[k] = (buf, lay)
                self._x_table_set(k, at, lay)
            self._wait(when_all([f for _l, f in started]), "the hot experts")
        # the cache: n slots of one expert each
        if self._x_nslots:
            assert self._x_slot_bytes >= max(self._x_span((il, 0)) for il in self._x_tensors)
            self._register("weight_cache", "expert_cache", self._x_nslots * self._x_slot_bytes)
            self._x_buf = [xb[hot_bytes + i * self._x_slot_bytes:hot_bytes + (i + 1) * self._x_slot_bytes]
                           for i in range(self._x_nslots)]
        self._x_key: list = [None] * self._x_nslots        # key whose bytes are all there
        self._x_lay: list = [None] * self._x_nslots
        self._x_slot_of: dict = {}                          # resident key -> slot
        self._x_loading: dict = {}                          # key -> (slot, future, prefetch?)
        self._x_free = list(range(self._x_nslots))[::-1]
        self._x_transient: set = set()                      # keys not admitted: evict first
        self._x_in_use: set = set()                         # the last get_experts' keys
        self._x_unused_prefetch: set = set()
        self._x_predicted: dict[int, set] = {}
        if expert_policy is None:
            expert_policy = getattr(plan, "expert_policy", "lru") or "lru"
        if isinstance(expert_policy, str):
            prior = routing.as_prior() if routing is not None and expert_policy == "decay" else None
            expert_policy = make_policy(expert_policy, prior)
        self.expert_policy = expert_policy
        # router look-ahead: decided by measurement while decoding (LookaheadDecision),
        # always with MEMFIT_EXPERT_LOOKAHEAD=1, never with 0
        mode = os.environ.get("MEMFIT_EXPERT_LOOKAHEAD", "").strip()
        on = (self.prefetch_enabled and self._x_nslots > 0
              and expert_switch("MEMFIT_EXPERT_LOOKAHEAD"))
        # one decision per number of rows in the step (8 and more together): a step of 4
        # sequences prefetches the union of 4 routes, which can evict its own experts where
        # one sequence's prefetch pays, and its seconds per row are not one row's
        self._lookahead = {} if on else None
        self._lookahead_forced = mode == "1"
        self._lookahead_rows = 1                            # the last step's class
        self.wants_expert_prediction = on

    def decode_step(self, seconds: float, rows: int) -> None:
        """A decode forward's time: the measurement of the look-ahead decision for steps of
        this many rows; the next step (most likely of as many rows) follows that decision."""
        if self._lookahead is not None and rows > 0:
            k = self._lookahead_rows = min(rows, 8)
            d = self._lookahead.get(k)
            if d is None:
                d = self._lookahead[k] = LookaheadDecision(forced=self._lookahead_forced)
            self.wants_expert_prediction = d.observe(seconds / rows, self.wants_expert_prediction)

    def _lookahead_state(self) -> str:
        """on | off | exploring for steps of the last step's row count ('on' before any step
        when look-ahead is enabled)."""
        if self._lookahead is None:
            return "off"
        if self._lookahead_forced:
            return "on"
        d = self._lookahead.get(self._lookahead_rows)
        return d.state if d is not None else "exploring"

    def _x_span(self, key) -> int:
        """Bytes of the three page-aligned ranges of expert key."""
        il, e = key
        n = 0
        for ti in self._x_tensors[il]:
            per = ti.nbytes // self.n_expert
            off = ti.offset + e * per
            n += _ceil(off + per) - _floor(off)
        return n

    def _x_ranges(self, key, buf: np.ndarray):
        """(layout [(pos + delta, per)] of gate/up/down inside buf, read ranges into buf)."""
        il, e = key
        lay, ranges, pos = [], [], 0
        for ti in self._x_tensors[il]:
            per = ti.nbytes // self.n_expert
            off = ti.offset + e * per
            start, end = _floor(off), _ceil(off + per)
            ranges.append((ti.file_index, start, buf[pos: pos + end - start], off + per - start))
            lay.append((pos + off - start, per))
            pos += end - start
        return lay, ranges

    def _x_view(self, key, buf, lay) -> tuple[QTensor, QTensor, QTensor]:
        il, e = key
        return tuple(QTensor(f"{ti.name}[{e}]", ti.type, ti.shape[1:], buf[p: p + n])
                     for ti, (p, n) in zip(self._x_tensors[il], lay))

    def _x_table_set(self, key, at: int, lay) -> None:
        """Expert key's gate/up/down at offsets at + lay's positions of the expert mapping
        (at None: not there)."""
        xo = self.xoff.get(key[0]) if self.expert_table is not None else None
        if xo is not None:
            xo[key[1]] = -1 if at is None else [at + p for p, _n in lay]

    def _x_pinned_view(self, key):
        il, e = key
        out = []
        for ti in self._x_tensors[il]:
            per = ti.nbytes // self.n_expert
            out.append(QTensor(f"{ti.name}[{e}]", ti.type, ti.shape[1:],
                               self._pinned[ti.name][e * per:(e + 1) * per]))
        return tuple(out)

    def _x_take_slot(self, key, prefetch: bool) -> int | None:
        """A slot for key: a free one, else a transient one, else the policy's victim (if the
        policy admits key over it; a demand read that is not admitted still takes the
        victim's slot, marked transient). None: nothing evictable (or a prefetch not
        admitted)."""
        if self._x_free:
            return self._x_free.pop()
        in_use, prev = self._x_in_use, key[0] - 1

        def evictable(k) -> bool:
            # a prefetch for layer L is issued while layer L-1 runs (before or after its
            # get_experts): it never evicts layer L-1's experts, nor the last call's
            return k not in in_use and not (prefetch and k[0] == prev)

        victim = next((k for k in self._x_transient if k in self._x_slot_of and evictable(k)),
                      None)
        if victim is None:
            victim = self.expert_policy.victim(evictable)
            if victim is None:
                return None
            if not self.expert_policy.admit(key, victim):
                if prefetch:
                    return None
                self._x_transient.add(key)
        return self._x_evict(victim)

    def _x_evict(self, key) -> int:
        slot = self._x_slot_of.pop(key)
        self._x_key[slot] = None
        self._x_table_set(key, None, None)
        self._x_transient.discard(key)
        self.expert_policy.remove(key)
        if key in self._x_unused_prefetch:  # read ahead, evicted before any use
            self._x_unused_prefetch.discard(key)
            self.xstats["prefetch_wasted_bytes"] += self._x_span(key)
        return slot

    def _x_read(self, items, prio: int) -> list[tuple[list, Done]]:
        """Read experts [(key, buf)] into their buffers: (layout, Done) per item. Coalesced
        (the default): every range of every item in one sorted, merged batch
        (_read_coalesced); MEMFIT_COALESCE=0: each expert's three ranges read apart."""
        xs = self.xstats
        if not self.coalesce:
            out = []
            for key, buf in items:
                lay, ranges = self._x_ranges(key, buf)
                r0 = self.reads
                out.append((lay, self._read_ranges(ranges, prio)))
                xs["reads"] += self.reads - r0
                xs["read_bytes"] += sum(len(r[2]) for r in ranges)
            return out
        lays, pieces, owner = [], [], []
        for j, (key, buf) in enumerate(items):
            lay, ranges = self._x_ranges(key, buf)
            lays.append(lay)
            for fi, off, dst, need in ranges:
                pieces.append((fi, off, dst, need, j))
                owner.append(j)
        futs, n_req, nbytes = self._read_coalesced(pieces, prio)
        xs["reads"] += n_req
        xs["read_bytes"] += nbytes     # a page two experts share counts once
        per = [[] for _ in items]
        for j, f in zip(owner, futs):
            per[j].append(f)
        return [(lay, when_all(fs)) for lay, fs in zip(lays, per)]

    def _x_start(self, batch: list, prio: int) -> None:
        """Start the reads of [(key, slot)] (one coalesced batch); each key is loading."""
        if not batch:
            return
        started = self._x_read([(k, self._x_buf[slot]) for k, slot in batch], prio)
        for (key, slot), (lay, fut) in zip(batch, started):
            self._x_lay[slot] = lay
            n = self._x_span(key)
            self._count(n)
            self.xstats["prefetch_bytes" if prio == PREFETCH else "demand_bytes"] += n
            self._x_loading[key] = (slot, fut, prio == PREFETCH)

    def _x_finish(self, key) -> BaseException | None:
        """Wait for key's read; on success the slot holds it, else the slot is freed."""
        slot, fut, _ = self._x_loading.pop(key)
        err = fut.exception()
        if err is None:
            self._x_key[slot] = key
            self._x_slot_of[key] = slot
            self._x_table_set(key, self._x_base + slot * self._x_slot_bytes, self._x_lay[slot])
            self.expert_policy.insert(key)
        else:
            self._x_free.append(slot)
            self._x_transient.discard(key)
            self._x_unused_prefetch.discard(key)
            self.read_errors += 1
        return err

    def _x_harvest(self) -> None:
        """Prefetches that finished well become resident (evictable); a failed one stays
        until its expert is asked for (the error surfaces then) or its slot is reclaimed."""
        for k, (_slot, fut, _pre) in list(self._x_loading.items()):
            if fut.done() and fut.exception() is None:
                self._x_finish(k)

    def note_experts(self, il: int, experts: Sequence[int]) -> None:
        """Layer il's experts (distinct, in index order) were used where expert_table held
        them all, as a get_experts call that hit on each: its counts and the policy's
        accesses are kept for the next call that needs them (_x_flush), in this order."""
        self._x_pending.append((il, experts))

    def _x_flush(self) -> None:
        pend, self._x_pending = self._x_pending, []
        for il, experts in pend:
            self._x_use(il, [(il, int(e)) for e in experts], hit=True)

    def _x_use(self, il: int, uniq: list, hit: bool = False) -> None:
        """The counts and policy calls of a get_experts call on the distinct keys uniq (hit:
        every one of them is at hand: its accesses too)."""
        xs = self.xstats
        xs["requests"] += len(uniq)
        if self.routing is not None:
            self.routing.add(il, [e for _, e in uniq])
        pred = self._x_predicted.pop(il, None)
        if pred is not None:
            xs["predicted_routed"] += len(uniq)
            xs["routed_predicted"] += sum(1 for k in uniq if k in pred)
        if self._x_tensors[il][0].name in self._pinned:
            xs["hot_hits"] += len(uniq)
            return
        policy = self.expert_policy
        if hasattr(policy, "advance"):
            policy.advance()
        self._x_in_use = set(uniq)
        if hit:
            hot = self._hot
            for k in uniq:
                if k in hot:
                    xs["hot_hits"] += 1
                else:
                    policy.access(k)
                    xs["hits"] += 1
            self._x_unused_prefetch.difference_update(uniq)

    def get_experts(self, il: int, experts: Sequence[int], views: bool = True
                    ) -> list[tuple[QTensor, QTensor, QTensor]] | None:
        """(gate, up, down) 2-D QTensors of each expert of layer il, in the order asked; valid
        until the next get_experts call. Misses are read at once (ahead of any prefetch); a
        prefetch still in flight is waited for, not read again. views=False: the experts
        are made present (expert_table) and None is returned."""
        return self.end_experts(self.begin_experts(il, experts), views)

    def begin_experts(self, il: int, experts: Sequence[int]):
        """get_experts' first half: the counts, the policy's calls and the misses' reads
        started (ahead of any prefetch). Until end_experts(token), expert_table holds the
        experts that were at hand and the caller may compute with those while the rest load;
        no other store call may come in between."""
        self._x_flush()
        keys = [(il, int(e)) for e in experts]
        uniq = list(dict.fromkeys(keys))
        if self._x_tensors[il][0].name in self._pinned:
            self._x_use(il, uniq)
            return il, keys, uniq, None, 0.0, False
        n_cached = sum(1 for k in uniq if k not in self._hot)
        assert n_cached <= self._x_nslots, (
            f"get_experts asked for {n_cached} experts of layer {il} at once; the expert "
            f"cache has {self._x_nslots} slots (ask in groups of expert_batch_limit)")
        self._x_harvest()
        self._x_use(il, uniq)
        policy, xs = self.expert_policy, self.xstats
        t0 = time.perf_counter()
        waits, start = [], []
        for k in uniq:
            if k in self._hot:
                xs["hot_hits"] += 1
                continue
            policy.access(k)
            if k in self._x_slot_of:
                xs["hits"] += 1
            elif k in self._x_loading:
                xs["prefetch_hits"] += 1
                waits.append(k)
            else:
                xs["misses"] += 1
                slot = self._x_take_slot(k, prefetch=False)
                if slot is None:  # every slot holds an expert of this call or a prefetch
                    slot = self._x_reclaim_prefetch()
                assert slot is not None, "the slot count was checked above"
                start.append((k, slot))
                waits.append(k)
        self._x_start(start, DEMAND)   # the misses' ranges, sorted and merged
        return il, keys, uniq, waits, time.perf_counter() - t0, bool(start)

    @staticmethod
    def experts_pending(token) -> bool:
        """Whether begin_experts left reads to wait for."""
        return bool(token[3])

    def end_experts(self, token, views: bool = False
                    ) -> list[tuple[QTensor, QTensor, QTensor]] | None:
        """get_experts' second half: waits for begin_experts' reads (the time counted as
        stall with begin's own); the views when asked (see get_experts)."""
        il, keys, uniq, waits, spent, demand = token
        if waits is None:   # pinned
            return [self._x_pinned_view(k) for k in keys] if views else None
        t0, errors = time.perf_counter(), []
        for k in waits:
            err = self._x_finish(k)
            if err is not None and not errors:
                errors.append(err)
        self._x_unused_prefetch.difference_update(uniq)
        if waits:
            stall = spent + time.perf_counter() - t0
            self.io_stall_s += stall
            # a call that read misses on demand, or one that only waited for prefetches
            self.xstats["stall_demand_s" if demand else "stall_prefetch_s"] += stall
        if errors:
            self._x_in_use = set()
            raise self._wrap(errors[0], f"experts of layer {il}")
        if not views:
            return None
        out = []
        for k in keys:
            if k in self._hot:
                buf, lay = self._hot[k]
                out.append(self._x_view(k, buf, lay))
            else:
                slot = self._x_slot_of[k]
                out.append(self._x_view(k, self._x_buf[slot], self._x_lay[slot]))
        return out

    def _x_reclaim_prefetch(self) -> int | None:
        """Wait for a read of an expert this call did not ask for and take its slot."""
        for k in list(self._x_loading):
            if k not in self._x_in_use:
                if self._x_finish(k) is None:
                    return self._x_evict(k)
                return self._x_free.pop()
        return None

    @property
    def expert_batch_limit(self) -> int:
        """Most distinct experts one get_experts call may ask for (the cache's slots plus the
        hot set; everything when the experts are pinned)."""
        if not self._x_tensors or any(t[0].name in self._pinned for t in self._x_tensors.values()):
            return max(self.n_expert, 1)
        return max(self._x_nslots, 1)

    def experts_in_place(self, il: int) -> tuple[QTensor, QTensor, QTensor] | None:
        """Layer il's stacked expert tensors when they are pinned and no routing counts are
        being kept (the fused MoE decode layer reads them in place and asks get_experts
        nothing); else None: the layer runs op by op through get_experts."""
        x = self._x_tensors.get(il)
        if x is None or self.routing is not None or any(t.name not in self._pinned for t in x):
            return None
        return tuple(QTensor(t.name, t.type, t.shape, self._pinned[t.name]) for t in x)

    def prefetch_experts(self, il: int, experts: Sequence[int]) -> None:
        """Router-lookahead hint: start background reads of layer il's predicted experts that
        are not resident (in free slots or over the policy's victims; never over the experts
        of the current call)."""
        if il not in self._x_tensors or self._x_tensors[il][0].name in self._pinned:
            return
        self._x_flush()
        keys = list(dict.fromkeys((il, int(e)) for e in experts))
        self._x_predicted[il] = set(keys)
        if not self._x_nslots:
            return
        self._x_harvest()
        start = []
        for k in keys:
            if k in self._hot or k in self._x_slot_of or k in self._x_loading:
                continue
            slot = self._x_take_slot(k, prefetch=True)
            if slot is None:
                break
            self.xstats["prefetched"] += 1
            self._x_unused_prefetch.add(k)
            start.append((k, slot))
        self._x_start(start, PREFETCH)

    # ---- statistics / lifetime ----
    def stats(self) -> dict:
        self._x_flush()
        d = {"bytes_read": self.bytes_read, "gets": self.gets,
             "hit_rate": self.hits / self.gets if self.gets else 1.0,
             "io_stall_s": self.io_stall_s, "o_direct": self.direct,
             "stream_read_bytes_per_s": (self._stream_bytes / self._stream_s
                                         if self._stream_s > 0 else 0.0),
             "pinned_bytes": self.plan.tier_bytes["pinned"],
             "slot_bytes": sum(s.nbytes for s in self._slots),
             "read_errors": self.read_errors,
             # read requests (a preadv of merged ranges counts once) and their mean size
             "reads": self.reads, "read_bytes": self.read_bytes,
             "bytes_per_read": self.read_bytes / self.reads if self.reads else 0.0,
             "coalesce": self.coalesce}
        if self._x_tensors:
            xs = self.xstats
            served = xs["hits"] + xs["hot_hits"] + xs["prefetch_hits"]
            d.update({
                "expert_requests": xs["requests"], "expert_hits": xs["hits"],
                "expert_hot_hits": xs["hot_hits"], "expert_misses": xs["misses"],
                "expert_prefetch_hits": xs["prefetch_hits"],
                "expert_hit_rate": served / xs["requests"] if xs["requests"] else 1.0,
                "prefetch_recall": (xs["routed_predicted"] / xs["predicted_routed"]
                                    if xs["predicted_routed"] else 0.0),
                "expert_served": served, "prefetch_routed": xs["predicted_routed"],
                "prefetch_routed_predicted": xs["routed_predicted"],
                "prefetched_experts": xs["prefetched"],
                "prefetch_wasted_bytes": xs["prefetch_wasted_bytes"],
                "expert_demand_bytes": xs["demand_bytes"],
                "expert_prefetch_bytes": xs["prefetch_bytes"],
                "expert_slots": self._x_nslots, "hot_experts": len(getattr(self, "_hot", ())),
                "expert_reads": xs["reads"], "expert_read_bytes": xs["read_bytes"],
                "expert_bytes_per_read": xs["read_bytes"] / xs["reads"] if xs["reads"] else 0.0,
                # the experts' share of io_stall_s: calls that read misses on demand, and calls
                # whose experts were all at hand or prefetched but some prefetch still in flight
                "expert_stall_demand_s": xs["stall_demand_s"],
                "expert_stall_prefetch_s": xs["stall_prefetch_s"],
                "lookahead": self._lookahead_state(),
                # per rows in a step: the decisions taken, in order
                "lookahead_decisions": {k: list(d.decisions) for k, d in
                                        sorted((self._lookahead or {}).items())},
            })
        return d

    @staticmethod
    def interval(before: dict, after: dict, n_tokens: int) -> dict:
        """Statistics of the work between two stats() snapshots over n_tokens tokens (bench:
        one test): bytes read (and per token), I/O stall per token, expert hit rate, prefetch
        recall, waste."""
        d = {"bytes_read": after["bytes_read"] - before["bytes_read"]}
        d["bytes_read_per_token"] = d["bytes_read"] / n_tokens if n_tokens else 0.0
        # io_stall_s itself is the running total since load (as bytes_read in bench's rows)
        stall = after.get("io_stall_s", 0.0) - before.get("io_stall_s", 0.0)
        d["io_stall_per_token_s"] = stall / n_tokens if n_tokens else 0.0
        reads = after.get("reads", 0) - before.get("reads", 0)
        rbytes = after.get("read_bytes", 0) - before.get("read_bytes", 0)
        d["reads"] = reads
        d["reads_per_token"] = reads / n_tokens if n_tokens else 0.0
        d["bytes_per_read"] = rbytes / reads if reads else 0.0
        if "expert_requests" in after:
            req = after["expert_requests"] - before["expert_requests"]
            served = after["expert_served"] - before["expert_served"]
            routed = after["prefetch_routed"] - before["prefetch_routed"]
            hit = after["prefetch_routed_predicted"] - before["prefetch_routed_predicted"]
            xr = after["expert_reads"] - before["expert_reads"]
            xb = after["expert_read_bytes"] - before["expert_read_bytes"]
            db = after["expert_demand_bytes"] - before["expert_demand_bytes"]
            sd = after["expert_stall_demand_s"] - before["expert_stall_demand_s"]
            sp = after["expert_stall_prefetch_s"] - before["expert_stall_prefetch_s"]
            d.update({"expert_reads": xr,
                      "io_stall_demand_per_token_s": sd / n_tokens if n_tokens else 0.0,
                      "io_stall_prefetch_per_token_s": sp / n_tokens if n_tokens else 0.0,
                      "expert_demand_bytes_per_token": db / n_tokens if n_tokens else 0.0,
                      "expert_reads_per_token": xr / n_tokens if n_tokens else 0.0,
                      "expert_bytes_per_read": xb / xr if xr else 0.0})
            d.update({"expert_hit_rate": served / req if req else 1.0,
                      "expert_misses": after["expert_misses"] - before["expert_misses"],
                      "prefetch_recall": hit / routed if routed else 0.0,
                      "prefetch_wasted_bytes": (after["prefetch_wasted_bytes"]
                                                - before["prefetch_wasted_bytes"])})
        return d

    def format_stats(self) -> str:
        s = self.stats()
        out = (f"store: read {s['bytes_read'] / 1e6:.1f} MB, hit rate {s['hit_rate']:.0%}, "
               f"I/O stall {s['io_stall_s']:.2f} s" + ("" if s["o_direct"] else " (buffered)")
               + (f" (experts: {s['expert_stall_demand_s']:.2f} s on misses, "
                  f"{s['expert_stall_prefetch_s']:.2f} s on prefetches)" if "expert_stall_demand_s" in s else "")
               + f", {s['reads']} reads of {s['bytes_per_read'] / 1e3:.0f} kB"
               + ("" if s["coalesce"] else " (not coalesced)"))
        if "expert_hit_rate" in s:
            out += (f" | experts: hit rate {s['expert_hit_rate']:.0%} ({s['expert_hits']} cached, "
                    f"{s['expert_hot_hits']} hot, {s['expert_prefetch_hits']} prefetched, "
                    f"{s['expert_misses']} missed), prefetch recall {s['prefetch_recall']:.0%}, "
                    f"wasted {s['prefetch_wasted_bytes'] / 1e6:.1f} MB, "
                    f"{s['expert_reads']} expert reads of {s['expert_bytes_per_read'] / 1e3:.0f} kB")
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for f in getattr(self, "_slot_future", ()):
            if f is not None:
                f.exception()  # drain; the error no longer matters
        for _slot, f, _ in getattr(self, "_x_loading", {}).values():
            f.exception()
        self._io.shutdown()
        if getattr(self, "_x_pending", None):
            self._x_flush()
        if getattr(self, "routing", None) is not None:
            self.routing.save()  # learned counts for the next load's hot set
        if self.direct and self.file.paths:
            # calibrate later plans with this device's streaming rate (page-cache reads excluded)
            from .bandwidth import record_observed_disk
            record_observed_disk(self.file.paths[0], self._stream_bytes, self._stream_s)
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        if getattr(self, "_emb_mm", None) is not None:
            os.close(self._emb_fd)
            self._emb_mm = None  # views may still reference it; the GC closes it
        if self.ledger is not None:
            self.ledger.stop_watchdog()
            for cat, name in self._ledger_items:
                self.ledger.free(cat, name)
            self._ledger_items = []
        self._pinned = {}
        if self.ledger is not None and self.ledger.debug == "raise" and self.ledger.violation:
            raise LedgerDriftError(f"memfit ledger drift during the run: {self.ledger.violation}")

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()
