"""Quantized KV cache quality: perplexity and KL divergence against the f16 cache.

    python benchmarks/kv_quant.py MODEL [MODEL ...] [-f GPL-3.txt] [--json out.jsonl]

llama-perplexity's method (512-token chunks, the last 255 tokens of each scored), run once per
cache type on the same loaded model (the cache type is switched between passes; the weights
are shared). Per scored token: the log-softmax of each type; KL(f16 || type) summed over the
vocabulary, averaged over tokens (llama-perplexity --kl-divergence's "Mean KLD"), and the
share of tokens whose argmax equals f16's ("same top p").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

TYPES = ("f16", "q8_0", "q4_0")


def _logprobs(m, chunk: list[int], first: int) -> np.ndarray:
    """log-softmax float64 [ctx - first - 1, n_vocab] of the scored rows of one chunk."""
    from memfit.memory.planner import LOGITS_SLICE_ROWS as rows
    ctx = len(chunk)
    cache = m.model.new_cache(ctx)
    hs = []
    for b in range(0, ctx, m.n_batch):
        piece = np.asarray(chunk[b:b + m.n_batch], dtype=np.int32)
        if b + len(piece) <= first:
            m.model.forward(piece, cache)
        else:
            hs.append(m.model.forward(piece, cache, hidden_from=max(0, first - b)))
    h = np.concatenate(hs) if len(hs) > 1 else hs[0]
    n = ctx - first - 1
    out = []
    for j in range(0, n, rows):
        lg = m.model.logits(h[j:min(j + rows, n)]).astype(np.float64)
        lg -= lg.max(axis=1, keepdims=True)
        out.append(lg - np.log(np.exp(lg).sum(axis=1, keepdims=True)))
    return np.concatenate(out)


def run(path: str, text: str, ctx: int = 512, max_chunks: int = 0) -> dict:
    import memfit
    with memfit.load(path, n_ctx=ctx) as m:
        toks = m.tokenize(text, add_special=True, parse_special=False)
        n_chunks = len(toks) // ctx
        if max_chunks:
            n_chunks = min(n_chunks, max_chunks)
        first = ctx // 2
        bos = m.tokenizer.bos_id if m.tokenizer.add_bos else None
        nll = {t: [] for t in TYPES}
        kl = {t: [] for t in TYPES[1:]}
        same = {t: 0 for t in TYPES[1:]}
        secs = {t: 0.0 for t in TYPES}
        for c in range(n_chunks):
            chunk = list(toks[c * ctx:(c + 1) * ctx])
            if bos is not None:
                chunk[0] = bos
            tgt = np.asarray(chunk[first + 1:ctx])
            ref = None
            for t in TYPES:
                m.model.cache_type_k = m.model.cache_type_v = t
                t0 = time.perf_counter()
                lp = _logprobs(m, chunk, first)
                secs[t] += time.perf_counter() - t0
                nll[t].append(-lp[np.arange(len(tgt)), tgt])
                if ref is None:
                    ref = lp
                else:
                    kl[t].append((np.exp(ref) * (ref - lp)).sum(axis=1))
                    same[t] += int((ref.argmax(1) == lp.argmax(1)).sum())
            print(f"{os.path.basename(path)}: chunk {c + 1}/{n_chunks}", file=sys.stderr, flush=True)
        res = {"model": os.path.basename(path), "chunks": n_chunks, "n_tokens": len(toks),
               "types": {}}
        n = sum(len(v) for v in nll["f16"])
        for t in TYPES:
            v = np.concatenate(nll[t])
            ppl = math.exp(v.mean())
            r = {"ppl": ppl, "ppl_err": ppl * float(np.std(v)) / math.sqrt(len(v) - 1),
                 "seconds": round(secs[t], 1)}
            if t != "f16":
                k = np.concatenate(kl[t])
                r.update(kld_mean=float(k.mean()), kld_err=float(k.std() / math.sqrt(len(k) - 1)),
                         kld_p99=float(np.percentile(k, 99)), kld_max=float(k.max()),
                         same_top_p=same[t] / n,
                         ppl_ratio=ppl / math.exp(np.concatenate(nll["f16"]).mean()))
            res["types"][t] = r
        return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("-f", "--file", default=os.path.join(os.environ.get("MEMFIT_GOLDEN", "/work/shared/golden"),
                                                         "GPL-3.txt"))
    ap.add_argument("--json", default=None, help="append one JSON line per model")
    ap.add_argument("--chunks", type=int, default=0, help="score only the first N chunks (0: all)")
    a = ap.parse_args()
    text = open(a.file, encoding="utf-8").read()
    if text.endswith("\n"):  # as llama-perplexity
        text = text[:-1]
    print("| model | KV K/V | PPL | PPL / f16 | mean KLD vs f16 | KLD p99 | same top token |")
    print("|---|---|---|---|---|---|---|")
    for p in a.models:
        r = run(p, text, max_chunks=a.chunks)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(r) + "\n")
        for t, v in r["types"].items():
            if t == "f16":
                print(f"| {r['model']} | f16/f16 | {v['ppl']:.4f} ± {v['ppl_err']:.4f} | 1 | - | - | - |")
            else:
                print(f"| {r['model']} | {t}/{t} | {v['ppl']:.4f} ± {v['ppl_err']:.4f} | "
                      f"{v['ppl_ratio']:.4f} | {v['kld_mean']:.5f} ± {v['kld_err']:.5f} | "
                      f"{v['kld_p99']:.4f} | {v['same_top_p']:.2%} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
