"""Measured memory and disk read bandwidth, for the Plan's tokens/s bound.

Results are cached in bandwidth.json under memfit's directory (memfit/paths.py: $MEMFIT_CACHE,
default ~/.cache/memfit; memory keyed by CPU model + MemTotal, disk keyed by the device number
of the file), several probes each with the time and the load average seen while it ran (see choose_probe / probe_is_stale), so a budgeted run never
allocates the probe buffer: ``get_bandwidth(path, measure=False)`` only reads the cache or
the defaults, while a plan that may measure re-probes values that are old or were loaded.

The disk rate a plan uses is, in order: the rate the weight store itself observed while
streaming on that device (``record_observed_disk``, written when a store closes after
streaming >= OBSERVE_MIN_BYTES = 8 GiB), else the probe's, else the default. The store's rate
wins because it averages tens of seconds of the real pattern (the same bytes re-read every
token), while the probe samples a few seconds. On this VM disk re-reads are usually faster
(likely the host caching recent blocks, which guest drop_caches cannot clear) and the rate
swings 0.6-2.3 GB/s: a cold read 0.6-1.1 GB/s, the store decoding 1.5-1.7. So the probe
reads its region twice and keeps the second pass, the pattern decode has.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_MEM_BW = 10e9    # bytes/s, used when nothing was measured
DEFAULT_DISK_BW = 1e9
ALIGN = 4096


@dataclass(frozen=True)
class Bandwidth:
    mem_read_bytes_per_s: float = DEFAULT_MEM_BW
    disk_read_bytes_per_s: float = DEFAULT_DISK_BW
    source: str = "default"  # 'measured', 'cached', 'observed' or 'default' (joined by '+')
    mem_note: str = ""       # where each number came from and when (for `memfit plan`)
    disk_note: str = ""


# Probes are kept with the load average seen while they ran (issue 9: a first run that
# overlapped a compile cached 240 MB/s disk and 8.8 GB/s memory, against 1.1 GB/s and 16 GB/s
# measured quiet). The plan uses the best recent quiet probe; a probe taken under load, or
# old, is re-taken when a plan may measure (a budgeted run never probes: it reads the cache).
MAX_PROBES = 8
MAX_AGE_S = 7 * 86400     # a probe older than this is re-taken
BUSY_LOAD = 0.75          # 1-minute load average per CPU at or above which a probe is "loaded"
LOADED_RETRY_S = 3600     # a loaded probe is re-taken once the machine is quiet, or after this


def load_per_cpu() -> float:
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 0.0


def _probes(cache: dict, kind: str, key: str) -> list[dict]:
    """Probe records {bps, time, load} for kind 'mem'|'disk'; a legacy single value (time and
    load unknown) counts as one old, loaded probe."""
    out = [p for p in cache.get(f"{kind}_probes", {}).get(key, []) if isinstance(p, dict)]
    legacy = cache.get(kind, {}).get(key)
    if not out and isinstance(legacy, (int, float)):
        out = [{"bps": float(legacy), "time": 0.0, "load": None}]
    return out


def choose_probe(probes: list[dict], now: float | None = None) -> dict | None:
    """The fastest quiet probe younger than MAX_AGE_S, else the fastest quiet one, else the
    fastest recent one, else the newest (a loaded machine only ever reads slower)."""
    if not probes:
        return None
    now = time.time() if now is None else now
    quiet = [p for p in probes if p.get("load") is not None and p["load"] < BUSY_LOAD]
    recent = [p for p in probes if now - p.get("time", 0) < MAX_AGE_S]
    for pool in ([p for p in quiet if p in recent], quiet, recent):
        if pool:
            return max(pool, key=lambda p: p["bps"])
    return max(probes, key=lambda p: p.get("time", 0))


def probe_is_stale(p: dict | None, now: float | None = None, load: float | None = None) -> bool:
    """True when a plan that may measure should probe again."""
    if p is None or p.get("load") is None:
        return True
    now = time.time() if now is None else now
    load = load_per_cpu() if load is None else load
    age = now - p.get("time", 0)
    if age > MAX_AGE_S:
        return True
    return p["load"] >= BUSY_LOAD and (load < BUSY_LOAD or age > LOADED_RETRY_S)


def probe_note(p: dict | None, fresh: bool = False) -> str:
    if p is None:
        return "default (never measured)"
    if p.get("load") is None:
        return "cached probe of unknown time and load (an older memfit)"
    when = "now" if fresh else time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(p["time"]))
    busy = " (under load: re-probed when the machine is quiet)" if p["load"] >= BUSY_LOAD else ""
    return f"probed {when}, load {p['load']:.2f}/CPU{busy}"


def _add_probe(cache: dict, kind: str, key: str, bps: float, load: float) -> dict:
    rec = {"bps": float(bps), "time": time.time(), "load": round(float(load), 3)}
    lst = (_probes(cache, kind, key) + [rec])[-MAX_PROBES:]  # a legacy value is kept as a probe
    cache.setdefault(f"{kind}_probes", {})[key] = lst
    return rec


def cache_path() -> Path:
    from ..paths import data_dir
    return data_dir() / "bandwidth.json"


def _load_cache() -> dict:
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _save_cache(d: dict) -> None:
    p = cache_path()
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".{os.getpid()}.tmp")  # processes saving at once do not mix
        tmp.write_text(json.dumps(d, indent=1, sort_keys=True))
        os.replace(tmp, p)
    except OSError:
        pass


def machine_key() -> str:
    cpu = "cpu"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                cpu += f"|{line.split()[1]}kB"
                break
    except OSError:
        pass
    # "rb2:": the probe is read_bound (older entries were a numpy sum, which reads less)
    return "rb2:" + cpu


def device_key(path: str | os.PathLike) -> str:
    st = os.stat(path)
    # "v2": the probe walks a contiguous region with the store's request size and depth
    return f"v2:{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def probe_buffer(nbytes: int, fill: int = 7) -> np.ndarray:
    """nbytes of `fill` starting on a 64-byte boundary (numpy's own allocations are 16-byte
    aligned, and csrc/membw.c reads a misaligned buffer with scalar loads); written, so its
    pages are real and not the shared zero page."""
    raw = np.empty(nbytes + 64, dtype=np.uint8)
    off = -raw.ctypes.data % 64
    buf = raw[off:off + nbytes]
    buf.fill(fill)
    return buf


def read_pass(buf: np.ndarray, strategy: dict | None = None, reps: int = 3,
              clock=time.perf_counter, warm: bool = True) -> float:
    """Bytes/s of one parallel read pass over buf with one strategy (csrc/membw.c: streams,
    width, prefetch, threads; {} is 1 stream, the widest loads, no prefetch, every thread),
    best of reps (after a warm-up pass if warm)."""
    from .. import _native
    st = strategy or {}
    args = (st.get("streams", 1), st.get("width", 512), st.get("prefetch", 0), st.get("threads", 0))
    if warm:
        _native.read_buffer(buf, *args)
    best = 0.0
    for _ in range(reps):
        t0 = clock()
        _native.read_buffer(buf, *args)
        best = max(best, buf.nbytes / (clock() - t0))
    return best


def read_strategies(threads: int | None = None) -> list[dict]:
    """The read strategies the bound is the best of: 1-8 interleaved streams per thread, 512-
    and 256-bit loads, with and without a software prefetch 1 KiB ahead, on every thread of the
    pool; and 1 and 2 streams on one thread (a core alone can read more than its share)."""
    from .. import _native
    widths = (512, 256) if _native.isa().startswith("avx512") else (256,)
    out = [{"streams": s, "width": w, "prefetch": pf}
           for s in (1, 2, 4, 8) for w in widths for pf in (0, 1024)]
    if (threads or 1) > 1:
        out += [{"streams": s, "width": widths[0], "prefetch": 0, "threads": 1} for s in (1, 2)]
    return out


def read_bound(nbytes: int = 512 << 20, reps: int = 2, clock=time.perf_counter,
               buf: np.ndarray | None = None) -> tuple[float, dict]:
    """The machine's read bound: (bytes/s, strategy) of the best strategy of read_strategies
    over an nbytes buffer (larger than the caches; written, so its pages are real). Which
    strategy wins differs between CPUs (several streams per core on the Xeons, one on Zen), so
    no single pass is the bound a kernel can be held to (issue 22: a kernel read up to 134%
    of the old one-stream probe). ~40 passes: about a second at 20-60 GB/s over 512 MiB."""
    from ..ops import native
    if buf is None:
        buf = probe_buffer(nbytes)
    best, pick = 0.0, {}
    read_pass(buf, {}, 1, clock)
    for st in read_strategies(native.get_threads()):
        bps = read_pass(buf, st, reps, clock, warm=False)
        if bps > best:
            best, pick = bps, st
    return best, pick


def measure_memory_bandwidth(nbytes: int = 256 << 20) -> float:
    """Read bandwidth (bytes/s) for plans: read_bound over an nbytes buffer."""
    return read_bound(nbytes)[0]


def measure_disk_bandwidth(path: str | os.PathLike, sample_bytes: int = 512 << 20,
                           chunk: int | None = None, workers: int | None = None,
                           max_s: float = 1.5, passes: int = 2) -> float:
    """Read bandwidth (bytes/s) of the file's device with the weight store's own access
    pattern: O_DIRECT requests of IO_CHUNK bytes, IO_WORKERS in flight, walking one contiguous
    region (a streamed unit is contiguous in the file), `passes` times over the same bytes;
    the rate of the last pass is returned, because decode re-reads the same bytes every token
    (a virtual disk's host cache serves re-reads faster: here 0.8 GB/s cold, 1.4 re-read).
    O_DIRECT bypasses the page cache, so the result is the disk's, not RAM's. Raises OSError
    where O_DIRECT is not possible."""
    from .io import IO_CHUNK, IO_WORKERS
    chunk = chunk or IO_CHUNK
    workers = workers or IO_WORKERS
    size = os.path.getsize(path)
    n_chunks = max(1, min(sample_bytes, size) // chunk)
    start = ((size - n_chunks * chunk) // 2) // ALIGN * ALIGN if size > n_chunks * chunk else 0
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:
        for _ in range(max(1, passes)):
            nbytes, dt = _read_pass(fd, [start + i * chunk for i in range(n_chunks)], chunk,
                                    workers, max_s)
            if nbytes == 0:
                raise OSError(f"no bytes read from {path}")
            n_chunks = max(1, nbytes // chunk)  # the next pass re-reads what this one read
    finally:
        os.close(fd)
    return nbytes / dt


def measure_disk_random(path: str | os.PathLike, chunk: int, lo: int = 0, hi: int | None = None,
                        workers: int | None = None, max_s: float = 2.0, seed: int = 0) -> float:
    """Read bandwidth (bytes/s) of requests the way a streamed MoE decode reads its missed experts:
    O_DIRECT requests of `chunk` bytes (rounded up to the alignment) at random aligned offsets in
    [lo, hi) of the file (the experts' bytes), IO_WORKERS in flight, for max_s seconds. Unlike
    measure_disk_bandwidth's contiguous re-read, nothing here is a neighbour of the last request
    nor (with a region much larger than the disk's cache) read twice: the rate a decode's ~1 MB
    expert reads can have. Raises OSError where O_DIRECT is not possible."""
    import random
    from .io import IO_WORKERS
    workers = workers or IO_WORKERS
    chunk = -(-max(chunk, ALIGN) // ALIGN) * ALIGN
    size = os.path.getsize(path)
    hi = size if hi is None else min(hi, size)
    lo = lo // ALIGN * ALIGN
    if hi - lo < chunk:
        raise OSError(f"{path}: the region is smaller than one request")
    rng = random.Random(seed)
    n = max(workers, int(max_s * 4e9) // chunk)  # more than max_s can read at 4 GB/s
    offsets = [lo + rng.randrange((hi - lo - chunk) // ALIGN + 1) * ALIGN for _ in range(n)]
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:
        nbytes, dt = _read_pass(fd, offsets, chunk, workers, max_s)
    finally:
        os.close(fd)
    if nbytes == 0:
        raise OSError(f"no bytes read from {path}")
    return nbytes / dt


def _read_pass(fd: int, offsets: list[int], chunk: int, workers: int,
               max_s: float) -> tuple[int, float]:
    """One walk over offsets (at most max_s seconds) by `workers` threads: (bytes, seconds)."""
    done = [0]
    nxt = [0]
    lock = threading.Lock()
    t0 = time.perf_counter()

    def work():
        mm = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT requires
        try:
            while time.perf_counter() - t0 < max_s:
                with lock:
                    if nxt[0] >= len(offsets):
                        break
                    off = offsets[nxt[0]]
                    nxt[0] += 1
                n = os.preadv(fd, [mm], off)
                with lock:
                    done[0] += n
        finally:
            mm.close()

    ts = [threading.Thread(target=work) for _ in range(workers)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return done[0], time.perf_counter() - t0


# a store must stream this much before its rate is recorded: >= ~5 s of reading, to average
# out this disk's moment-to-moment swings (0.6-2.3 GB/s), and so short runs (tests, small
# models' few GB of small requests) do not overwrite a 7B decode's record
OBSERVE_MIN_BYTES = 8 << 30
OBSERVE_WINDOW_BYTES = 32 << 30  # the recorded rate is over about the last this-many bytes


def record_observed_disk(path: str | os.PathLike, nbytes: int, seconds: float) -> float | None:
    """Add a weight store's streaming (nbytes read in seconds of reading) to path's device
    record and return the device's rate now: total bytes / total seconds over a window of
    the last ~OBSERVE_WINDOW_BYTES, so one 7B decode (tens of GB) outweighs a small run's
    few GB of small requests. None if too little was read to count. Never raises."""
    if nbytes < OBSERVE_MIN_BYTES or seconds <= 0:
        return None
    try:
        dkey = device_key(path)
    except OSError:
        return None
    cache = _load_cache()
    rec = cache.setdefault("disk_observed", {}).get(dkey)
    b, s = (float(rec["bytes"]), float(rec["seconds"])) if isinstance(rec, dict) else (0.0, 0.0)
    if b + nbytes > OBSERVE_WINDOW_BYTES and b > 0:  # age the old record out by volume
        keep = max(0.0, OBSERVE_WINDOW_BYTES - nbytes) / b
        b, s = b * keep, s * keep
    b, s = b + nbytes, s + seconds
    cache["disk_observed"][dkey] = {"bytes": b, "seconds": s}
    _save_cache(cache)
    return b / s


def _observed_rate(cache: dict, dkey: str) -> float | None:
    rec = cache.get("disk_observed", {}).get(dkey)
    try:
        return float(rec["bytes"]) / float(rec["seconds"])
    except (TypeError, KeyError, ValueError, ZeroDivisionError):
        return None


def get_bandwidth(path: str | os.PathLike | None = None, *, measure: bool = True,
                  refresh: bool = False) -> Bandwidth:
    """Bandwidth for plans: for the disk, the store's observed rate, else the chosen cached
    probe, else measured (if measure) and cached, else the default. With measure, a probe
    that is missing, old or was taken under load is taken again (choose_probe/probe_is_stale);
    refresh ignores the caches and, with measure, probes now. Never raises."""
    from .planner import COUNTS
    COUNTS["bandwidth"] += 1
    cache = _load_cache()
    src = []
    mkey = machine_key()
    now = time.time()
    saved = False

    def probe(kind: str, key: str, fn):
        nonlocal saved
        chosen = None if refresh else choose_probe(_probes(cache, kind, key), now)
        if chosen is not None and not (measure and probe_is_stale(chosen, now)):
            return chosen["bps"], "cached", probe_note(chosen)
        if measure:
            before = load_per_cpu()
            try:
                bps = fn()
            except (MemoryError, OSError):
                bps = None
            if bps is not None:
                rec = _add_probe(cache, kind, key, bps, max(before, load_per_cpu()))
                saved = True
                pick = rec if refresh else choose_probe(_probes(cache, kind, key), now + 1)
                cache.setdefault(kind, {})[key] = pick["bps"]  # the single value older readers use
                if pick is rec:
                    return bps, "measured", probe_note(rec, fresh=True)
                return pick["bps"], "cached", (probe_note(pick) + f"; a probe now (load "
                                                f"{rec['load']:.2f}/CPU) read {bps / 1e9:.2f} GB/s")
        if chosen is not None:
            return chosen["bps"], "cached", probe_note(chosen)
        return None, "default", probe_note(None)

    mem, s1, mem_note = probe("mem", mkey, measure_memory_bandwidth)
    src.append(s1)
    if mem is None:
        mem = DEFAULT_MEM_BW
    disk, disk_note = None, probe_note(None)
    if path is not None:
        try:
            dkey = device_key(path)
        except OSError:
            dkey = None
        obs = None if refresh or dkey is None else _observed_rate(cache, dkey)
        if obs is not None:
            disk = obs
            src.append("observed")
            rec = cache.get("disk_observed", {}).get(dkey, {})
            disk_note = (f"observed: the weight store's own streaming rate over the last "
                         f"{float(rec.get('bytes', 0)) / 2**30:.0f} GiB it read")
        elif dkey is not None:
            disk, s2, disk_note = probe("disk", dkey, lambda: measure_disk_bandwidth(path))
            src.append(s2)
    if disk is None:
        disk = DEFAULT_DISK_BW
        if "default" not in src:
            src.append("default")
    if saved:
        _save_cache(cache)
    return Bandwidth(float(mem), float(disk), "+".join(dict.fromkeys(src)), mem_note, disk_note)
