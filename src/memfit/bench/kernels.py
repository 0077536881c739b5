"""Kernel micro-benchmark: GB/s of weight bytes streamed by a large matvec (n = 1, the decode
case) per quant type, next to the machine's read bandwidth measured in the same run."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np


def memory_read_bandwidth(nbytes: int = 1 << 30, reps: int = 5, clock=time.perf_counter,
                          streams: int = 1) -> float:
    """Bytes/s of one parallel read pass (one stream per thread, or `streams` interleaved)
    over a buffer larger than any cache (best of reps). clock=time.thread_time (1 thread only:
    the pass then runs in this thread) counts only the CPU time this thread got: a
    preemption-proof figure on a shared machine."""
    from ..memory.bandwidth import probe_buffer, read_pass
    buf = probe_buffer(nbytes)
    return read_pass(buf, {"streams": streams}, reps, clock)


# The matrices a 7B-class decode streams (qwen2/llama 7-8B: attention 4096x4096 (Q, O), FFN
# gate/up 14336x4096 and down 4096x14336, the qwen2 output matrix 152064x3584).
SHAPES_7B = [(4096, 4096), (14336, 4096), (4096, 14336), (152064, 3584)]


def _strategy(st: dict) -> str:
    """One read strategy (memory/bandwidth.py read_strategies) in words."""
    return (f"{st.get('streams', 1)} stream(s), {st.get('width', 512)}-bit loads"
            + (f", prefetch {st['prefetch']} B" if st.get("prefetch") else "")
            + (f", {st['threads']} thread(s)" if st.get("threads") else ""))


def parse_shapes(spec: str | None, rows: int, cols: int) -> list[tuple[int, int]]:
    """--shapes: None -> [(rows, cols)]; "7b" -> (rows, cols) then SHAPES_7B (no repeats);
    else a comma list of ROWSxCOLS."""
    from ..errors import RequestError
    if not spec:
        return [(rows, cols)]
    out: list[tuple[int, int]] = []
    for part in spec.split(","):
        part = part.strip().lower()
        if part == "7b":
            cand = [(rows, cols)] + SHAPES_7B
        else:
            r, x, c = part.partition("x")
            if not (x and r.isdigit() and c.isdigit() and int(r) > 0 and int(c) > 0):
                raise RequestError(f"--shapes: {part!r} is not ROWSxCOLS (e.g. 4096x4096) or 7b")
            cand = [(int(r), int(c))]
        for s in cand:
            if s not in out:
                out.append(s)
    return out


def _matrices(type_name: str, rows: int, cols: int, seed: int, min_total: int):
    """Distinct copies of one random matrix, >= min_total bytes in all (>= 2 copies), so that
    cycling over them streams every call's weights from DRAM rather than the L3."""
    from ..ops import QTensor
    from ..quant.random import random_weight
    from ..quant.types import BY_NAME
    t = BY_NAME[type_name]
    w0 = random_weight(t, (rows, cols), np.random.default_rng(seed)).reshape(-1)
    copies = max(2, -(-min_total // w0.nbytes))
    return [QTensor("bench", t, (rows, cols), w0 if i == 0 else w0.copy()) for i in range(copies)]


def _time_matvec(ws: list, reps: int, seed: int = 0, clock=time.perf_counter) -> float:
    """Median seconds of one n=1 matmul, calls cycling over the copies (clock: see
    memory_read_bandwidth)."""
    from ..ops import native
    rows, cols = ws[0].shape
    x = np.random.default_rng(seed).standard_normal((1, cols)).astype(np.float32)
    out = np.empty((1, rows), np.float32)
    for q in ws:
        native.matmul(x, q, out=out)
    times = []
    for r in range(max(reps, len(ws))):
        q = ws[r % len(ws)]
        t0 = clock()
        native.matmul(x, q, out=out)
        times.append(clock() - t0)
    return statistics.median(times)


def matvec_bandwidth(type_name: str, rows: int, cols: int, reps: int = 10, seed: int = 0,
                     min_total: int = 512 << 20) -> dict:
    """Median GB/s of one n=1 matvec streamed from DRAM (see _matrices)."""
    ws = _matrices(type_name, rows, cols, seed, min_total)
    med = _time_matvec(ws, reps, seed)
    nbytes = int(ws[0].data.nbytes)
    return {"type": type_name, "rows": rows, "cols": cols, "weight_bytes": nbytes,
            "copies": len(ws), "seconds": med, "gb_per_s": nbytes / med / 1e9}


def _check_memory(names: list[str], shapes: list, stream_bytes: int,
                  mem_limit: tuple[int, str]) -> None:
    """Refuse a run whose buffers do not fit mem_limit (bytes, where it comes from): the read
    probe holds 2 x stream_bytes, each (type, shape) its matrix copies (_matrices)."""
    from ..errors import RequestError
    from ..memory.budget import current_rss, format_size
    from ..quant.types import BY_NAME
    limit, why = mem_limit
    probe = max(64 << 20, 2 * stream_bytes)
    mats = max(max(2 * w, -(-stream_bytes // w) * w) for w in
               (BY_NAME[n].row_bytes(c) * r for n in names for (r, c) in shapes))
    need = current_rss() + max(probe, mats)
    if need > limit:
        raise RequestError(f"--stream-bytes {format_size(stream_bytes)} needs about "
                           f"{format_size(need)} of memory (the read probe holds 2 x "
                           f"--stream-bytes, the matrices --stream-bytes); the limit is "
                           f"{why}: lower --stream-bytes"
                           + ("" if why.startswith("detected") else " or raise the budget"))


def run_kernel_bench(types: str = "Q4_0,Q8_0,Q4_K,Q6_K", rows: int = 14336, cols: int = 4096,
                     threads: int | None = None, as_json: bool = False, trials: int = 3,
                     stream_bytes: int = 1 << 30, shapes: str | None = None,
                     isas: str | None = None, cpu_time: bool = False,
                     mem_limit: tuple[int, str] | None = None, tunes: str | None = None) -> int:
    """Each trial measures the read bandwidth, then every (type, shape) matvec streamed from
    DRAM, once per ISA in `isas` (alternating on the same matrices: an A/B within the trial).
    Every matvec is reported as a fraction of the probe *of its own trial* (median over the
    trials: this host's probe moves +-15% between trials); --json prints one object per
    (type, shape, isa) with all samples. tunes: ';'-separated decode tunings (csrc/pool.c,
    MEMFIT_TUNE's "name=value,..."; "default" is this CPU's row) alternated the same way, each
    row of the result labelled with its tuning. cpu_time (1 thread only): probe and matvecs timed
    by this thread's CPU time, so other processes on the cores do not count."""
    from .. import _native
    from ..errors import RequestError
    from ..memory.bandwidth import probe_buffer, read_bound, read_pass, read_strategies
    from ..ops import native
    if threads:
        native.set_threads(threads)
    threads = native.get_threads()
    if cpu_time and threads != 1:
        raise RequestError("--cpu-time measures one thread: add -t 1")
    clock = time.thread_time if cpu_time else time.perf_counter
    names = [t.strip() for t in types.split(",") if t.strip()]
    shape_list = parse_shapes(shapes, rows, cols)
    isa_before = _native.isa()
    isa_list = [i.strip() for i in (isas or isa_before).split(",") if i.strip()]
    for i in isa_list:
        try:
            _native.set_isa(i)
        except ValueError as e:
            raise RequestError(f"--isa: {e}") from None
    _native.set_isa(isa_before)
    tune_before = os.environ.get("MEMFIT_TUNE", "")
    tune_list = [t.strip() for t in tunes.split(";")] if tunes else [None]
    for t in tune_list:
        if t is not None:
            try:
                _native.set_tune(t)
            except ValueError as e:
                raise RequestError(f"--tune: {e}") from None
    _native.set_tune(tune_before)
    if mem_limit is not None:
        _check_memory(names, shape_list, stream_bytes, mem_limit)
    variants = [(i, t) for i in isa_list for t in tune_list]
    keys = [(n, s, v) for n in names for s in shape_list for v in variants]
    multi = len(variants) > 1

    def label(v):
        return v[0] + ("" if v[1] is None else f" [{v[1] or 'default'}]")
    bws: list[float] = []  # the read bound (memory/bandwidth.py read_bound), each trial
    bwm: list[float] = []  # the one-stream-per-thread pass, same trials (the old probe)
    strat: list[dict] = []
    gbs: dict = {k: [] for k in keys}
    fracs: dict = {k: [] for k in keys}
    info: dict = {}
    try:
        for k in range(max(1, trials)):
            buf = probe_buffer(max(64 << 20, 2 * stream_bytes))
            b, st = read_bound(clock=clock, buf=buf)
            bw = b / 1e9
            bws.append(bw)
            strat.append(st)
            bwm.append(read_pass(buf, {}, 3, clock) / 1e9)
            del buf
            for name in names:
                for (r, c) in shape_list:
                    ws = _matrices(name, r, c, k, stream_bytes)
                    nbytes = int(ws[0].data.nbytes)
                    for v in variants:
                        _native.set_isa(v[0])
                        tune = _native.tune() if v[1] is None else {**_native.set_tune(v[1]), "spec": v[1]}
                        g = nbytes / _time_matvec(ws, 10, k, clock) / 1e9
                        gbs[(name, (r, c), v)].append(g)
                        fracs[(name, (r, c), v)].append(g / bw)
                        info[(name, (r, c), v)] = {"weight_bytes": nbytes, "copies": len(ws), "tune": tune}
                    del ws
            if not as_json:
                print(f"  trial {k + 1}/{max(1, trials)}: read bound {bw:.1f} GB/s ({_strategy(st)}; "
                      f"one stream per thread {bwm[-1]:.1f}), "
                      + ", ".join(f"{n} {r}x{c}{'/' + label(v) if multi else ''} "
                                  f"{gbs[(n, (r, c), v)][-1]:.1f}" for n, (r, c), v in keys),
                      file=sys.stderr, flush=True)
    finally:
        _native.set_isa(isa_before)
        _native.set_tune(tune_before)
    bw = statistics.median(bws)
    if not as_json:
        print(f"read bound: {bw:.1f} GB/s ({threads} threads, best of {len(read_strategies(threads))} "
              f"read strategies, median of {len(bws)} trials"
              + (", per CPU-second" if cpu_time else "") + f"; one stream per thread "
              f"{statistics.median(bwm):.1f} GB/s)", file=sys.stderr)
        print("| type | matrix | isa | weight MB | GB/s | % of read bound (same trial) "
              "| % of one-stream read |")
        print("|---|---|---|---:|---:|---:|---:|")
    for key in keys:
        name, (r, c), (isa, tune) = key
        res = {"type": name, "rows": r, "cols": c, "isa": isa, **info[key],
               "gb_per_s": statistics.median(gbs[key]), "samples_gb_per_s": gbs[key],
               "fraction_of_bandwidth": statistics.median(fracs[key]),
               "samples_fraction": fracs[key],
               "mem_read_gb_per_s": bw, "mem_read_samples_gb_per_s": bws,
               "read_bound_strategies": strat,
               "one_stream_samples_gb_per_s": bwm,
               "fraction_of_one_stream": statistics.median(g / b for g, b in zip(gbs[key], bwm)),
               "threads": threads,
               "clock": "thread_time" if cpu_time else "wall"}
        if as_json:
            print(json.dumps(res), flush=True)
        else:
            print(f"| {name} | {r}x{c} | {label((isa, tune))} | {res['weight_bytes'] / 1e6:.1f} | "
                  f"{res['gb_per_s']:.1f} | {100 * res['fraction_of_bandwidth']:.0f}% | "
                  f"{100 * res['fraction_of_one_stream']:.0f}% |", flush=True)
    return 0
