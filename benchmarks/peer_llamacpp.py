"""llama.cpp pp/tg benchmark through llama-cpp-python, llama-bench style (never run in CI).

Run with the interpreter that has llama-cpp-python installed, e.g.
    /root/peer-venv/bin/python benchmarks/peer_llamacpp.py MODEL -p 512 -n 128 -r 5 -t 2 --json
Output lines match `memfit bench --json`: {"model", "test", "threads", "tokens_per_s", "samples", ...}.

Method (as llama-bench): random token ids, one warm-up, the KV cache cleared before every
repetition, n_batch = n_ubatch = 512; times come from llama_perf_context (t_p_eval_ms for
the prompt batch, t_eval_ms for single-token decodes), not from Python wall clock.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import resource
import statistics
import sys
import time


def _quiet_logs(llama_cpp):
    # llama.cpp logs every load to stderr; keep only errors.
    @llama_cpp.llama_log_callback
    def cb(level, text, user_data):
        if level == 4:  # GGML_LOG_LEVEL_ERROR
            sys.stderr.write(text.decode(errors="replace"))
    llama_cpp.llama_log_set(cb, ctypes.c_void_p(0))
    return cb  # keep a reference alive


def _decode(llama_cpp, ctx, tokens: list[int], n_batch: int) -> None:
    # Feed `tokens` in n_batch chunks; only the last position needs logits.
    for i in range(0, len(tokens), n_batch):
        chunk = tokens[i:i + n_batch]
        arr = (llama_cpp.llama_token * len(chunk))(*chunk)
        rc = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(chunk)))
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with {rc}")
    llama_cpp.llama_synchronize(ctx)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-r", "--repetitions", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-b", "--n-batch", type=int, default=512)
    ap.add_argument("--repack", type=int, choices=(0, 1), default=1,
                    help="llama.cpp weight repacking (use_extra_bufts); 1 is its default")
    ap.add_argument("--no-mmap", action="store_true", help="read weights instead of mmap")
    ap.add_argument("--no-warmup", action="store_true",
                    help="skip warm-up (budget runs: the warm-up would be as slow as the test)")
    ap.add_argument("--max-seconds", type=float, default=0.0,
                    help="tg: stop a repetition after this many seconds and report what it reached")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)

    import llama_cpp
    _keep = _quiet_logs(llama_cpp)
    llama_cpp.llama_backend_init()
    t0 = time.perf_counter()
    mp = llama_cpp.llama_model_default_params()
    mp.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE if a.no_mmap else llama_cpp.LLAMA_LOAD_MODE_MMAP
    mp.use_extra_bufts = bool(a.repack)
    model = llama_cpp.llama_model_load_from_file(a.model.encode(), mp)
    if not model:
        print(f"error: llama.cpp could not load {a.model}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - t0
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))

    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = max(a.n_prompt + a.n_gen, 16)
    cp.n_batch = a.n_batch
    cp.n_ubatch = a.n_batch
    cp.n_threads = a.threads
    cp.n_threads_batch = a.threads
    cp.no_perf = False
    ctx = llama_cpp.llama_init_from_model(model, cp)
    if not ctx:
        print("error: llama.cpp could not create a context", file=sys.stderr)
        return 2
    mem = llama_cpp.llama_get_memory(ctx)
    rng = random.Random(a.seed)

    def rand_tokens(n):
        return [rng.randrange(n_vocab) for _ in range(n)]

    name = os.path.basename(a.model)
    base = {"model": name, "threads": a.threads, "backend": "llama.cpp",
            "version": getattr(llama_cpp, "__version__", "?"), "repack": a.repack,
            "mmap": not a.no_mmap, "load_s": round(load_s, 3)}

    def emit(test, samples, extra=None):
        rec = dict(base, test=test,
                   tokens_per_s=round(statistics.median(samples), 3) if samples else 0.0,
                   samples=[round(s, 3) for s in samples],
                   peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        if extra:
            rec.update(extra)
        if a.json:
            print(json.dumps(rec), flush=True)
        else:
            sd = statistics.stdev(samples) if len(samples) > 1 else 0.0
            print(f"| {name} | llama.cpp | {a.threads} | {test} | {rec['tokens_per_s']:.2f} ± {sd:.2f} |",
                  flush=True)

    if a.n_prompt > 0:
        if not a.no_warmup:
            llama_cpp.llama_memory_clear(mem, False)
            _decode(llama_cpp, ctx, rand_tokens(a.n_prompt), a.n_batch)
        samples = []
        for _ in range(a.repetitions):
            llama_cpp.llama_memory_clear(mem, False)
            toks = rand_tokens(a.n_prompt)
            llama_cpp.llama_perf_context_reset(ctx)
            _decode(llama_cpp, ctx, toks, a.n_batch)
            d = llama_cpp.llama_perf_context(ctx)
            # a 512-token batch is a prompt eval; n_p_eval counts its tokens
            ms = d.t_p_eval_ms + d.t_eval_ms
            samples.append(1000.0 * a.n_prompt / ms)
        emit(f"pp{a.n_prompt}", samples)

    if a.n_gen > 0:
        if not a.no_warmup:
            llama_cpp.llama_memory_clear(mem, False)
            _decode(llama_cpp, ctx, rand_tokens(1), a.n_batch)
        samples, reached = [], []
        for _ in range(a.repetitions):
            llama_cpp.llama_memory_clear(mem, False)
            llama_cpp.llama_perf_context_reset(ctx)
            t_start = time.perf_counter()
            n_done = 0
            for _i in range(a.n_gen):
                _decode(llama_cpp, ctx, rand_tokens(1), a.n_batch)
                n_done += 1
                if a.max_seconds and time.perf_counter() - t_start > a.max_seconds:
                    break
                if a.max_seconds:  # budget runs: show progress, they are slow
                    print(f"tg progress: {n_done} tokens, {time.perf_counter() - t_start:.1f} s",
                          file=sys.stderr, flush=True)
            d = llama_cpp.llama_perf_context(ctx)
            samples.append(1000.0 * d.n_eval / d.t_eval_ms if d.t_eval_ms > 0 else 0.0)
            reached.append(n_done)
        extra = {"tokens_reached": reached} if a.max_seconds else None
        emit(f"tg{a.n_gen}", samples, extra)

    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
