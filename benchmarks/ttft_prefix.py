"""Issue 10: time to first token of a second chat turn that shares a ~1,500-token prefix with
the first, with prefix reuse (first turn already ran on this engine) and without (a fresh
model whose prefix cache is empty). Both arms load a fresh model, so load time and page-cache
state match; arms alternate per repetition. Never run in CI.

    python benchmarks/ttft_prefix.py smollm2-135m --reps 3 -t 2 >> benchmarks/ttft_prefix.jsonl

TTFT = wall time of generate(turn-2 ids, max_tokens=1) (prefill of the uncached tokens plus
one sampled token); timings.cache_n says how many prompt tokens came from the cache.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

import memfit

# Filler for the shared prefix: the project's own README (plain prose and tables), cut to N tokens.
_HERE = os.path.dirname(os.path.abspath(__file__))


def _prefix_ids(m, n_prefix: int) -> list[int]:
    text = open(os.path.join(_HERE, "..", "README.md"), encoding="utf-8").read()
    body = m.tokenize(text, add_special=False, parse_special=False)
    while len(body) < n_prefix:
        body = body + body
    head = m.tokenize(m.apply_chat_template([{"role": "system", "content": "You are helpful."}]))
    return (head + body)[:n_prefix]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--prefix", type=int, default=1500)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args(argv)
    commit = subprocess.run(["git", "-C", _HERE, "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    for rep in range(args.reps):
        for arm in (("reuse", "fresh") if rep % 2 == 0 else ("fresh", "reuse")):
            with memfit.load(args.model, threads=args.threads, n_ctx=2048) as m:
                p1 = _prefix_ids(m, args.prefix)
                turn2 = p1 + m.tokenize("\nUser: Summarise the above in one line.\nAssistant:",
                                        add_special=False)
                if arm == "reuse":
                    m.generate(p1, max_tokens=1, temperature=0)   # first turn fills the cache
                load1 = os.getloadavg()[0]
                t0 = time.perf_counter()
                r = m.generate(turn2, max_tokens=1, temperature=0)
                ttft = time.perf_counter() - t0
            print(json.dumps({"model": args.model, "arm": arm, "rep": rep, "ttft_s": round(ttft, 4),
                              "prompt_tokens": len(turn2), "cache_n": r.timings.cache_n,
                              "prompt_n": r.timings.prompt_n,
                              "prompt_ms": round(r.timings.prompt_ms, 2), "threads": args.threads,
                              "load1": round(load1, 2), "commit": commit}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
