"""memfit and llama.cpp decoding in one process, block by block (never run in CI).

compare.py alternates whole processes (seconds to minutes apart); on a host whose memory
bandwidth moves with other tenants' load from one minute to the next, that spread is as large
as the effects measured. Here both runtimes are loaded into one process and decode blocks of
N tokens from an empty context in A B B A order, a sleep between blocks (both thread pools
spin ~1-2 ms after work), so each pair of blocks sees the same machine. Reported: each
side's median tok/s and the median of the per-round ratios with its range.

With --split, both sides also report the output matrix's share of a token: memfit from its
profile counters (csrc/pool.c), llama.cpp from a graph-eval callback timed at the final norm
and at the output node (the callback splits llama.cpp's graph there: one extra pool wake per
token, so --split rounds are not used for the ratio).

Run with the peer venv's interpreter and memfit's sources on the path:
    PYTHONPATH=src:$VIRTUAL_ENV/lib/python3.11/site-packages /root/peer-venv/bin/python \
        benchmarks/interleaved.py MODEL -n 32 --rounds 12
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import statistics
import sys
import time

import numpy as np


def _llama(path: str, threads: int, repack: bool, n_ctx: int, split: bool):
    import llama_cpp
    from peer_llamacpp import _quiet_logs  # this script's folder is on sys.path

    log_cb = _quiet_logs(llama_cpp)
    llama_cpp.llama_backend_init()
    mp = llama_cpp.llama_model_default_params()
    mp.use_extra_bufts = repack
    model = llama_cpp.llama_model_load_from_file(path.encode(), mp)
    if not model:
        sys.exit(f"error: llama.cpp could not load {path}")
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, 512, 512
    cp.n_threads = cp.n_threads_batch = threads
    cp.no_perf = False
    marks: dict[str, float] = {}
    keep = [log_cb]
    if split:
        base = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
        base.ggml_get_name.restype = ctypes.c_char_p
        base.ggml_get_name.argtypes = [ctypes.c_void_p]
        wanted = {b"result_norm", b"result_output"}

        @llama_cpp.ggml_backend_sched_eval_callback
        def eval_cb(t, ask, user_data):
            name = base.ggml_get_name(t)
            if ask:
                return name in wanted
            marks[name.decode()] = time.perf_counter()
            return True
        cp.cb_eval = eval_cb
        keep.append(eval_cb)
    ctx = llama_cpp.llama_init_from_model(model, cp)
    mem = llama_cpp.llama_get_memory(ctx)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))

    def block(ids: list[int]) -> dict:
        llama_cpp.llama_memory_clear(mem, False)
        llama_cpp.llama_perf_context_reset(ctx)
        out_s = 0.0
        for tok in ids:
            arr = (llama_cpp.llama_token * 1)(tok)
            if llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, 1)) != 0:
                sys.exit("error: llama_decode failed")
            llama_cpp.llama_synchronize(ctx)
            if split:
                out_s += marks["result_output"] - marks["result_norm"]
        d = llama_cpp.llama_perf_context(ctx)
        return {"s": d.t_eval_ms / 1e3, "output_s": out_s}
    return block, n_vocab, keep


def _memfit(path: str, threads: int, n_ctx: int):
    from memfit import _native
    from memfit.api import Model
    from memfit.errors import MemfitError
    try:
        m = Model(path, threads=threads, n_ctx=n_ctx, quiet=True)
    except MemfitError as e:
        sys.exit(f"error: {e}")
    model = m.model
    vocab = model.config.n_vocab

    def block(ids: list[int], split: bool = False) -> dict:
        a = np.asarray(ids, dtype=np.int32)
        cache = model.new_cache(len(ids) + 1)
        if split:
            _native.profile(True)
        t0 = time.perf_counter()
        for i in range(len(a)):
            model.forward(a[i:i + 1], cache)
        s = time.perf_counter() - t0
        out_s = 0.0
        if split:
            _native.profile(False)
            st = _native.profile_stats()
            out_s = sum(x["ns"] for x in st["matmul"] if x["n"] == 1 and x["rows"] == (vocab,)) * 1e-9
        return {"s": s, "output_s": out_s}
    return block, m


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-n", "--n-gen", type=int, default=16, help="tokens per block")
    ap.add_argument("--rounds", type=int, default=20, help="A B B A rounds")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--repack", type=int, choices=(0, 1), default=1)
    ap.add_argument("--split", action="store_true", help="also time the output matrix on both sides")
    ap.add_argument("--sleep", type=float, default=0.05, help="seconds between blocks")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)

    n_ctx = a.n_gen + 8
    mf_block, mf_model = _memfit(a.model, a.threads, n_ctx)
    ll_block, n_vocab, _keep = _llama(a.model, a.threads, bool(a.repack), n_ctx, a.split)
    rng = random.Random(1)
    mf_block([rng.randrange(n_vocab) for _ in range(a.n_gen)])  # warm-ups
    ll_block([rng.randrange(n_vocab) for _ in range(a.n_gen)])
    mf_s, ll_s, ratios, mf_out, ll_out = [], [], [], [], []
    for r in range(a.rounds):
        ids = [rng.randrange(n_vocab) for _ in range(a.n_gen)]  # the same ids on both sides
        res = {}
        for side in (("mf", "ll") if r % 2 == 0 else ("ll", "mf")):
            time.sleep(a.sleep)
            res[side] = mf_block(ids, a.split) if side == "mf" else ll_block(ids)
        mf_s.append(res["mf"]["s"]); ll_s.append(res["ll"]["s"])
        ratios.append(res["ll"]["s"] / res["mf"]["s"])
        mf_out.append(res["mf"]["output_s"]); ll_out.append(res["ll"]["output_s"])
        print(f"# round {r + 1}/{a.rounds}: memfit {a.n_gen / mf_s[-1]:.2f} tok/s, llama.cpp "
              f"{a.n_gen / ll_s[-1]:.2f} tok/s, ratio {ratios[-1]:.3f}", file=sys.stderr, flush=True)
    n = a.n_gen
    rec = {"model": os.path.basename(a.model), "test": f"tg{n}-interleaved", "threads": a.threads,
           "rounds": a.rounds, "repack": a.repack, "split": a.split,
           "memfit_tok_s": round(n / statistics.median(mf_s), 3),
           "llama_tok_s": round(n / statistics.median(ll_s), 3),
           "ratio_median": round(statistics.median(ratios), 4),
           "ratio_min": round(min(ratios), 4), "ratio_max": round(max(ratios), 4),
           "memfit_samples": [round(n / s, 3) for s in mf_s],
           "llama_samples": [round(n / s, 3) for s in ll_s]}
    if a.split:
        rec["memfit_output_ms"] = round(1e3 * statistics.median(mf_out) / n, 3)
        rec["llama_output_ms"] = round(1e3 * statistics.median(ll_out) / n, 3)
        rec["memfit_rest_ms"] = round(1e3 * statistics.median(
            [s - o for s, o in zip(mf_s, mf_out)]) / n, 3)
        rec["llama_rest_ms"] = round(1e3 * statistics.median(
            [s - o for s, o in zip(ll_s, ll_out)]) / n, 3)
    if a.json:
        print(json.dumps(rec), flush=True)
    print(f"| {rec['model']} | tg{n} x {a.rounds} rounds | memfit {rec['memfit_tok_s']:.2f} | "
          f"llama.cpp {rec['llama_tok_s']:.2f} | ratio {rec['ratio_median']:.3f} "
          f"[{rec['ratio_min']:.3f}, {rec['ratio_max']:.3f}] |", file=sys.stderr)
    if a.split:
        print(f"output matrix ms/token: memfit {rec['memfit_output_ms']}, llama.cpp {rec['llama_output_ms']}; "
              f"rest: memfit {rec['memfit_rest_ms']}, llama.cpp {rec['llama_rest_ms']}", file=sys.stderr)
    mf_model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
