"""Where this process's memory is: private (anonymous) pages against file-backed ones.

A weight streamer that reads through the page cache, or maps the file, can look small in the
numbers it books while the kernel holds the file's pages for it: mapped pages count in RSS as
RssFile (reclaimable, shared with the page cache), unmapped cached pages not at all in RSS,
only in the cgroup's "file" count. process_memory() reads them apart from /proc/self/status
(RssAnon / RssFile / RssShmem, which sum to VmRSS) and, where the process's cgroup v2 is
readable, its anon and file counts (v1: rss and cache; the page cache charged to the cgroup,
this process's and any other's in it). Linux only; elsewhere the fields are 0.
"""

from __future__ import annotations

import os

_CG_ROOT = "/sys/fs/cgroup"


def _status() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def _cgroup_stat() -> dict[str, int]:
    """anon / file bytes of this process's memory cgroup ({} where not readable): v1's
    memory controller (memory.stat rss / cache) where the process has one, else v2's
    (memory.stat anon / file)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [ln.rstrip("\n").split(":", 2) for ln in f]
    except OSError:
        return {}
    v1 = next((p for _, ctl, p in lines if "memory" in ctl.split(",")), None)
    v2 = next((p for h, ctl, p in lines if h == "0" and ctl == ""), None)
    for path, keys in ((v1 and os.path.join(_CG_ROOT, "memory", v1.lstrip("/")), ("rss", "cache")),
                       (v2 is not None and os.path.join(_CG_ROOT, v2.lstrip("/")), ("anon", "file"))):
        if not path:
            continue
        try:
            with open(os.path.join(path, "memory.stat")) as f:
                st = dict(ln.split() for ln in f if ln.count(" ") == 1)
            return {"anon": int(st[keys[0]]), "file": int(st[keys[1]])}
        except (OSError, KeyError, ValueError):
            continue
    return {}


def process_memory() -> dict[str, int]:
    """{rss_bytes, rss_anon_bytes (private), rss_file_bytes (mapped file pages, page cache),
    rss_shmem_bytes (anonymous shared mappings: the store's buffers), rss_own_bytes (anon +
    shmem), peak_rss_bytes} of this process, plus cgroup_anon_bytes and
    cgroup_file_bytes (the page cache charged to its cgroup) where readable."""
    s = _status()
    d = {"rss_bytes": s.get("VmRSS", 0), "rss_anon_bytes": s.get("RssAnon", 0),
         "rss_file_bytes": s.get("RssFile", 0), "rss_shmem_bytes": s.get("RssShmem", 0),
         "peak_rss_bytes": s.get("VmHWM", 0)}
    d["rss_own_bytes"] = d["rss_anon_bytes"] + d["rss_shmem_bytes"]
    cg = _cgroup_stat()
    if cg:
        d["cgroup_anon_bytes"], d["cgroup_file_bytes"] = cg["anon"], cg["file"]
    return d


def format_memory(d: dict[str, int]) -> str:
    """"RSS own 150 MiB (anon 57, shmem 93) + file-backed 27 MiB, cgroup page cache 300 MiB"
    for a summary line."""
    out = (f"RSS own {d['rss_own_bytes'] / 2**20:.0f} MiB (anon {d['rss_anon_bytes'] / 2**20:.0f}, "
           f"shmem {d['rss_shmem_bytes'] / 2**20:.0f}) + file-backed "
           f"{d['rss_file_bytes'] / 2**20:.0f} MiB")
    if "cgroup_file_bytes" in d:
        out += f", cgroup page cache {d['cgroup_file_bytes'] / 2**20:.0f} MiB"
    return out
