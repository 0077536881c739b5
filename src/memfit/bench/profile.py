"""Where one decode token's time goes (`memfit bench MODEL --profile`).

Method: decode `n_gen` tokens one at a time (after `n_prompt` prompt tokens and one warm-up
token) with the native profile counters on (csrc/pool.c, csrc/quant_mm.c), and time every
fused decoder-layer call from Python. Per token:

- each matmul call by weight set (type, shape; Q/K/V and gate/up are one call each, as decode
  issues them), its time, and its GB/s of weight bytes against the read probe;
- the rest of the layer (attention, norms, RoPE, activation, KV write: layer time minus its
  matvecs), the output matrix, the waits for a streaming store's reads (I/O stall), and what
  is left: Python, embedding lookup, final norm;
- the thread pool: jobs per token and the threads' idle time inside jobs (dispatch, waiting
  for the last task, imbalance), which is already part of the matvec times above.

The bound is weight bytes per token / read probe: the time a token needs if every byte
streamed at the probe's rate and nothing else cost anything.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from ..quant.types import TYPES

_TYPE_NAMES = {i: t.name for i, t in TYPES.items()}


def profile_decode(model, n_gen: int = 32, n_prompt: int = 0, seed: int = 0,
                   probe_gb_per_s: float | None = None, pool=None,
                   n_batch: int | None = None) -> dict:
    """The profile as a dict (see the module docstring); times in ms per token. The sequence
    runs in blocks of ``pool`` (the engine's KV pool, of n_batch rows per step) when given."""
    from .. import _native
    if model.ops.name != "native":
        from ..errors import RequestError
        raise RequestError("--profile needs the native backend (--backend native)")
    c = model.config
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, c.n_vocab, size=n_prompt + n_gen + 1, dtype=np.int32)
    from .llama_bench import _cache, prompt_pieces
    cache = _cache(model, pool, n_prompt + n_gen + 2)
    step = prompt_pieces(pool, n_prompt, n_batch)
    for b in range(0, n_prompt, step):
        model.forward(ids[b:min(b + step, n_prompt)], cache)
    model.forward(ids[n_prompt:n_prompt + 1], cache)  # warm-up: scratch, fused layers built

    layer_ns = [0]
    ops = model.ops
    # the fused layers the model calls for decode rows (a layer whose experts the store streams:
    # one call when its experts are at hand, else the calls around the store's reads)
    names = [nm for nm in ("decode_batch", "decode_batch_moe", "decode_batch_route",
                           "decode_batch_route_ahead", "decode_batch_experts",
                           "decode_batch_experts_at", "decode_batch_experts_part")
             if hasattr(ops, nm)]
    real = {nm: getattr(ops, nm) for nm in names}

    def timer(f):
        def timed(*a):
            t0 = time.perf_counter_ns()
            r = f(*a)
            layer_ns[0] += time.perf_counter_ns() - t0
            return r
        return timed

    for nm in names:
        setattr(ops, nm, timer(real[nm]))
    store = model.weights
    stall0 = getattr(store, "io_stall_s", None)
    _native.profile(True)
    try:
        t0 = time.perf_counter_ns()
        for i in range(n_prompt + 1, n_prompt + 1 + n_gen):
            model.forward(ids[i:i + 1], cache)
        total_ns = time.perf_counter_ns() - t0
    finally:
        _native.profile(False)
        for nm in names:
            setattr(ops, nm, real[nm])
    st = _native.profile_stats()
    per = 1e-6 / n_gen  # ns summed over the run -> ms per token
    mats, out_ms, layer_mat_ms, out_bytes, layer_bytes = [], 0.0, 0.0, 0, 0
    for m in st["matmul"]:
        if m["n"] != 1:
            continue
        ms = m["ns"] * per
        calls = m["calls"] / n_gen
        is_out = m["rows"] == (c.n_vocab,)
        name = "+".join(_TYPE_NAMES.get(t, str(t)) for t in m["types"])
        shape = "+".join(f"{r}x{m['cols']}" for r in m["rows"])
        gbs = m["bytes"] * m["calls"] / (m["ns"] * 1e-9) / 1e9 if m["ns"] else 0.0
        mats.append({"what": "output" if is_out else "layer", "types": name, "shape": shape,
                     "calls_per_token": calls, "ms": ms, "gb_per_s": gbs,
                     "bytes_per_token": m["bytes"] * calls})
        if is_out:
            out_ms += ms
            out_bytes += m["bytes"] * calls
        else:
            layer_mat_ms += ms
            layer_bytes += m["bytes"] * calls
    mats.sort(key=lambda r: -r["ms"])
    total_ms, layers_ms = total_ns * per, layer_ns[0] * per
    # the caller's waits for the store's reads (a streamed model; outside the fused calls)
    stall_ms = (store.io_stall_s - stall0) * 1e9 * per if stall0 is not None else 0.0
    thr = st["threads"]
    idle_ms = (st["wall_ns"] * thr - st["busy_ns"]) / thr * per
    res = {
        "model": getattr(model, "path", None) and str(model.path), "threads": thr,
        "isa": _native.isa(), "tune": _native.tune(), "n_gen": n_gen, "n_prompt": n_prompt, "fused_layers": layer_ns[0] > 0,
        "ms_per_token": total_ms, "tokens_per_s": 1e3 / total_ms,
        "layers_ms": layers_ms, "layer_matvec_ms": layer_mat_ms,
        "layer_rest_ms": layers_ms - layer_mat_ms if layer_ns[0] else None,
        "output_ms": out_ms,
        "io_stall_ms": stall_ms,
        "other_ms": total_ms - (layers_ms if layer_ns[0] else layer_mat_ms) - out_ms - stall_ms,
        "pool_jobs_per_token": st["jobs"] / n_gen, "pool_idle_ms": idle_ms,
        "pool_tail_wait_ms": st["tail_wait_ns"] * per,
        "weight_bytes_per_token": layer_bytes + out_bytes, "matmuls": mats,
    }
    if probe_gb_per_s:
        res["read_probe_gb_per_s"] = probe_gb_per_s
        res["bound_ms"] = (layer_bytes + out_bytes) / (probe_gb_per_s * 1e9) * 1e3
        res["fraction_of_bound"] = res["bound_ms"] / total_ms
    return res


def format_profile(p: dict) -> str:
    """Markdown: one line per matmul weight set, then the buckets that make up a token."""
    probe = p.get("read_probe_gb_per_s")
    lines = [f"decode profile: {p['n_gen']} tokens after {p['n_prompt']} prompt tokens, "
             f"{p['threads']} threads, isa {p['isa']}"
             + (f" (tuning {p['tune']['source']})" if p.get("tune") else "")
             + f": {p['ms_per_token']:.2f} ms/token "
             f"({p['tokens_per_s']:.2f} tok/s)"
             + (f"; read probe {probe:.1f} GB/s, bound {p['bound_ms']:.2f} ms "
                f"({100 * p['fraction_of_bound']:.0f}% of it)" if probe else ""),
             "", "| part | types | shape | calls/token | ms/token | % of token | GB/s |"
             + (" % of probe |" if probe else ""),
             "|---|---|---|---:|---:|---:|---:|" + ("---:|" if probe else "")]
    tot = p["ms_per_token"]
    for m in p["matmuls"]:
        lines.append(f"| {m['what']} matvec | {m['types']} | {m['shape']} | {m['calls_per_token']:.0f} | "
                     f"{m['ms']:.2f} | {100 * m['ms'] / tot:.1f}% | {m['gb_per_s']:.1f} |"
                     + (f" {100 * m['gb_per_s'] / probe:.0f}% |" if probe else ""))
    blank = " | |" if probe else ""

    def row(name, ms, note=""):
        return f"| {name} | | {note} | | {ms:.2f} | {100 * ms / tot:.1f}% |{blank}"
    if p["layer_rest_ms"] is not None:
        lines.append(row("attention, norms, RoPE, routing, activation, KV write (in the fused layers)",
                         p["layer_rest_ms"]))
    if p.get("io_stall_ms"):
        lines.append(row("waiting for the store's weight reads (I/O stall)", p["io_stall_ms"]))
    lines.append(row("Python, embedding, final norm, other", p["other_ms"]))
    lines.append(row("thread pool idle inside jobs (part of the matvecs above)", p["pool_idle_ms"],
                     f"{p['pool_jobs_per_token']:.0f} jobs/token; caller's wait for the last task "
                     f"{p['pool_tail_wait_ms']:.2f} ms"))
    return "\n".join(lines)


def run_profile(model, n_gen: int, n_prompt: int, as_json: bool, probe: bool = True,
                pool=None, n_batch: int | None = None) -> int:
    from ..memory.bandwidth import read_bound
    bw = read_bound(1 << 30)[0] / 1e9 if probe else None
    p = profile_decode(model, n_gen=n_gen, n_prompt=n_prompt, probe_gb_per_s=bw, pool=pool,
                       n_batch=n_batch)
    print(json.dumps(p) if as_json else format_profile(p), flush=True)
    if not as_json and not p["fused_layers"]:
        print("note: this model's layers ran op by op (no fused decode layer)", file=sys.stderr)
    return 0
