"""The memory budget: parsing sizes, detecting what the machine grants, measuring RSS.

Size syntax (case-insensitive, optional space, fractions allowed: "1.5G"):
    plain number / "B"       bytes
    K, M, G, T (docker-style) and KiB, MiB, GiB, TiB   binary: 1024, 1024**2, ...
    KB, MB, GB, TB                                      decimal: 1000, 1000**2, ...
The budget caps the process's peak RSS (VmHWM), interpreter included.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import RequestError

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

_UNITS = {
    "": 1, "b": 1,
    "k": KiB, "m": MiB, "g": GiB, "t": TiB,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")

ENV_BUDGET = "MEMFIT_MEM_BUDGET"
# cgroup v1 reports "unlimited" as a huge page-rounded number
_UNLIMITED = 1 << 60


def parse_size(text: str | int) -> int:
    """'6GiB' | '512MiB' | '100KiB' | '1.5G' | '4GB' | '123456' -> bytes (int, > 0)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise RequestError(f"memory size {text!r} must be positive")
        return text
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise RequestError(
            f"invalid memory size {text!r}: use a number with an optional unit, e.g. 6GiB, "
            "512MiB, 1.5G (K/M/G/T and KiB/MiB/GiB/TiB are binary, KB/MB/GB/TB decimal)")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise RequestError(f"memory size {text!r} must be positive")
    return n


def format_size(n: int) -> str:
    """Bytes -> short binary text, e.g. '2.50 GiB (2684354560 bytes)' style without the bytes."""
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


# ---- reading /proc and cgroups -------------------------------------------------------------

def _status_kb(pid: int | str, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/{pid}/status")


def rss_of(pid: int) -> int:
    """Current resident set (VmRSS) of a process, bytes."""
    return _status_kb(pid, "VmRSS")


def peak_rss_of(pid: int) -> int:
    """Peak resident set (VmHWM) of a process, bytes."""
    return _status_kb(pid, "VmHWM")


def measure_baseline() -> int:
    """This process's current RSS (bytes): the runtime baseline before budgeted allocations.
    Garbage that only the cycle collector would free (a closed model in a long-lived process)
    and freed heap pages are given back first, so they do not count against the budget."""
    import gc
    gc.collect()
    trim_heap()
    return _status_kb("self", "VmRSS")


def current_rss() -> int:
    return _status_kb("self", "VmRSS")


def peak_rss() -> int:
    """This process's peak RSS (VmHWM), bytes: the number the budget caps."""
    return _status_kb("self", "VmHWM")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0, writing 5 to clear_refs). False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def trim_heap() -> None:
    """Give freed heap pages back to the kernel (glibc malloc_trim), so RSS falls after a
    burst of large transient allocations (a long prompt's text and pieces); no-op elsewhere."""
    global _libc
    if _libc is None:
        import ctypes
        try:
            _libc = ctypes.CDLL(None)           # this process's symbols: libc is linked in
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


_libc = None


def mem_available(meminfo: str = "/proc/meminfo") -> int:
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not in /proc/meminfo")


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        v = int(text)
    except ValueError:
        return None
    return None if v >= _UNLIMITED else v


def cgroup_limit(proc_cgroup: str | None = None, root: str | Path = "/sys/fs/cgroup"
                 ) -> tuple[int | None, str]:
    """Smallest memory limit on this process's cgroup path and its ancestors.

    Reads v2 (memory.max, memory.high under root/<path>) and v1 (memory.limit_in_bytes under
    root/memory/<path>). Inside a container the path may not exist under root; then root's own
    files count. Returns (bytes or None, where it was found)."""
    root = Path(root)
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None, "no /proc/self/cgroup"
    best: tuple[int | None, str] = (None, "no cgroup memory limit")

    def consider(d: Path, names: tuple[str, ...]):
        nonlocal best
        for name in names:
            v = _read_limit(d / name)
            if v is not None and (best[0] is None or v < best[0]):
                best = (v, str(d / name))

    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":
            base, names = root, ("memory.max", "memory.high")
            if (root / "unified").is_dir() and not (root / "cgroup.controllers").exists():
                base = root / "unified"  # hybrid hierarchy
        elif "memory" in controllers.split(","):
            base, names = root / "memory", ("memory.limit_in_bytes",)
        else:
            continue
        rel_parts = [p for p in rel.split("/") if p]
        # walk from the process's cgroup up to the mount root; limits are hierarchical
        for i in range(len(rel_parts), -1, -1):
            d = base.joinpath(*rel_parts[:i])
            if d.is_dir():
                consider(d, names)
    return best


def detect_margin(limit: int) -> int:
    """Margin kept free under a detected limit: 10% of it, at least 64 MiB, at most 1 GiB."""
    return min(GiB, max(64 * MiB, limit // 10))


def detect_budget(meminfo: str = "/proc/meminfo", proc_cgroup: str | None = None,
                  cgroup_root: str | Path = "/sys/fs/cgroup") -> tuple[int, str]:
    """(budget bytes, explanation): min(MemAvailable, cgroup limit) minus detect_margin()."""
    avail = mem_available(meminfo)
    limit, where = cgroup_limit(proc_cgroup, cgroup_root)
    if limit is not None and limit < avail:
        base, src = limit, f"cgroup limit {format_size(limit)} ({where})"
    else:
        base, src = avail, f"MemAvailable {format_size(avail)}"
        if limit is not None:
            src += f" (below cgroup limit {format_size(limit)})"
    margin = detect_margin(base)
    budget = base - margin
    return budget, f"detected: {src} minus margin {format_size(margin)} = {format_size(budget)}"


def resolve_budget(value: str | int | None = None) -> tuple[int, str]:
    """The budget to use: explicit value (CLI/API) > $MEMFIT_MEM_BUDGET > detection.
    Returns (bytes, explanation); raises RequestError naming a malformed value."""
    if value is not None and value != "":
        n = parse_size(value)
        return n, f"--mem-budget {value} = {format_size(n)}"
    env = os.environ.get(ENV_BUDGET)
    if env:
        try:
            n = parse_size(env)
        except RequestError as e:
            raise RequestError(f"${ENV_BUDGET}: {e}") from None
        return n, f"${ENV_BUDGET}={env} = {format_size(n)}"
    return detect_budget()
