"""llama.cpp aggregate decode tok/s with N sequences decoding together, through
llama-cpp-python's low-level API (llama-batched-bench's S_TG; never run in CI).

    /root/peer-venv/bin/python benchmarks/peer_llamacpp_parallel.py MODEL -p 32 -n 32 -r 2 \
        --parallel 1,2,4,8 -t 2

Method, as `memfit bench --parallel`: per N, one warm-up then -r repetitions; each clears the
KV cache, prefills N prompts of -p random tokens in one batch (seq ids 0..N-1), then runs -n
steps, each one llama_decode of a batch holding one random token per sequence (logits for
all). Aggregate tok/s = N * n_gen / wall time of the -n steps. kv_unified so the sequences
share one cache of n_ctx = N * (p + n) cells (rounded up).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-p", "--n-prompt", type=int, default=32)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("-r", "--repetitions", type=int, default=2)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--parallel", default="1,2,4,8")
    ap.add_argument("--label", default="")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--repack", type=int, choices=(0, 1), default=1,
                    help="llama.cpp weight repacking; 0 under a memory limit (as section 3)")
    a = ap.parse_args(argv)
    par = [int(x) for x in a.parallel.split(",")]

    import llama_cpp as L
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from peer_llamacpp import _quiet_logs
    _keep = _quiet_logs(L)
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = bool(a.repack)
    model = L.llama_model_load_from_file(a.model.encode(), mp)
    assert model, a.model
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    rng = random.Random(a.seed)
    nmax = max(par)
    n_ctx = ((nmax * (a.n_prompt + a.n_gen) + 255) // 256) * 256
    cp = L.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_batch = cp.n_ubatch = max(512, nmax * a.n_prompt)
    cp.n_seq_max = nmax
    cp.kv_unified = True
    cp.n_threads = cp.n_threads_batch = a.threads
    ctx = L.llama_init_from_model(model, cp)
    assert ctx
    mem = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(max(cp.n_batch, nmax), 0, nmax)

    def run_batch(items):  # items: (token, pos, seq, want_logits)
        batch.n_tokens = len(items)
        for i, (tok, pos, seq, lg) in enumerate(items):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = lg
        rc = L.llama_decode(ctx, batch)
        assert rc == 0, rc
        L.llama_synchronize(ctx)

    def once(n):
        L.llama_memory_clear(mem, True)
        run_batch([(rng.randrange(n_vocab), p, s, p == a.n_prompt - 1)
                   for s in range(n) for p in range(a.n_prompt)])
        t0 = time.perf_counter()
        for step in range(a.n_gen):
            run_batch([(rng.randrange(n_vocab), a.n_prompt + step, s, True) for s in range(n)])
        return n * a.n_gen / (time.perf_counter() - t0)

    for n in par:
        l0 = os.getloadavg()[0]
        once(n)  # warm-up
        samples = [once(n) for _ in range(a.repetitions)]
        print(json.dumps({"model": os.path.basename(a.model), "backend": "llama.cpp",
                          "version": L.__version__, "test": f"tg{a.n_gen}", "parallel": n,
                          "n_prompt": a.n_prompt, "threads": a.threads,
                          "tokens_per_s": round(statistics.median(samples), 3),
                          "samples": [round(s, 3) for s in samples],
                          "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                          "label": a.label, "load1_before": l0,
                          "load1_after": os.getloadavg()[0]}), flush=True)
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
