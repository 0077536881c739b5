"""Kernel micro-benchmark: GB/s of weight bytes streamed by a large matvec (n = 1, the decode
case) per quant type, next to the machine's read bandwidth measured in the same run."""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np


def memory_read_bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Bytes/s of one parallel read pass over a buffer larger than any cache (best of reps)."""
    from .. import _native
    buf = np.full(nbytes, 7, dtype=np.uint8)  # written: real pages, not the shared zero page
    _native.read_buffer(buf)
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        _native.read_buffer(buf)
        best = max(best, nbytes / (time.perf_counter() - t0))
    return best


def matvec_bandwidth(type_name: str, rows: int, cols: int, reps: int = 10, seed: int = 0,
                     min_total: int = 512 << 20) -> dict:
    """Median GB/s of one n=1 matvec. Calls cycle over enough distinct copies of the matrix
    (>= min_total bytes in all) that each call streams its weights from DRAM, not from L3."""
    from ..ops import QTensor
    from ..ops import native
    from ..quant.random import random_weight
    from ..quant.types import BY_NAME
    t = BY_NAME[type_name]
    rng = np.random.default_rng(seed)
    w0 = random_weight(t, (rows, cols), rng).reshape(-1)
    copies = max(2, -(-min_total // w0.nbytes))
    ws = [QTensor("bench", t, (rows, cols), w0 if i == 0 else w0.copy()) for i in range(copies)]
    x = rng.standard_normal((1, cols)).astype(np.float32)
    out = np.empty((1, rows), np.float32)
    for q in ws:
        native.matmul(x, q, out=out)
    times = []
    for r in range(max(reps, copies)):
        q = ws[r % copies]
        t0 = time.perf_counter()
        native.matmul(x, q, out=out)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {"type": type_name, "rows": rows, "cols": cols, "weight_bytes": int(w0.nbytes),
            "copies": copies, "seconds": med, "gb_per_s": w0.nbytes / med / 1e9}


def run_kernel_bench(types: str = "Q4_0,Q8_0,Q4_K,Q6_K", rows: int = 14336, cols: int = 4096,
                     threads: int | None = None, as_json: bool = False, trials: int = 3,
                     stream_bytes: int = 512 << 20) -> int:
    """Each trial measures the read bandwidth, then every type's DRAM-streamed matvec; the
    table reports medians over the trials (this kind of host moves +-15% between runs, so a
    single probe next to a single matvec can mislead), --json one object per type with all
    samples."""
    from ..ops import native
    if threads:
        native.set_threads(threads)
    threads = native.get_threads() if hasattr(native, "get_threads") else threads
    names = [t.strip() for t in types.split(",") if t.strip()]
    bws: list[float] = []
    gbs: dict[str, list[float]] = {n: [] for n in names}
    info: dict[str, dict] = {}
    for k in range(max(1, trials)):
        bws.append(memory_read_bandwidth(max(64 << 20, 2 * stream_bytes)) / 1e9)
        for name in names:
            r = matvec_bandwidth(name, rows, cols, min_total=stream_bytes)
            gbs[name].append(r["gb_per_s"])
            info[name] = r
        if not as_json:
            print(f"  trial {k + 1}/{max(1, trials)}: read {bws[-1]:.1f} GB/s, "
                  + ", ".join(f"{n} {gbs[n][-1]:.1f}" for n in names), file=sys.stderr, flush=True)
    bw = statistics.median(bws)
    if not as_json:
        print(f"memory read bandwidth: {bw:.1f} GB/s ({threads} threads, median of {len(bws)})",
              file=sys.stderr)
        print("| type | matrix | weight MB | GB/s | % of memory bandwidth |")
        print("|---|---|---:|---:|---:|")
    for name in names:
        r = {**info[name], "gb_per_s": statistics.median(gbs[name]), "samples_gb_per_s": gbs[name],
             "mem_read_gb_per_s": bw, "mem_read_samples_gb_per_s": bws, "threads": threads}
        r["fraction_of_bandwidth"] = r["gb_per_s"] / bw
        del r["seconds"]
        if as_json:
            print(json.dumps(r), flush=True)
        else:
            print(f"| {name} | {rows}x{cols} | {r['weight_bytes'] / 1e6:.1f} | {r['gb_per_s']:.1f} | "
                  f"{100 * r['fraction_of_bandwidth']:.0f}% |", flush=True)
    return 0
