"""llama.cpp's perplexity with a quantized KV cache, through llama-cpp-python (never run in CI).

    /root/peer-venv/bin/python benchmarks/kv_quant_peer.py MODEL [-f GPL-3.txt] [--types f16,q8_0,q4_0]

llama-perplexity's method (512-token chunks, BOS first when the model adds one, the last 255
tokens scored), flash attention on (llama.cpp needs it for a quantized V cache), 2 threads.
It is the reference for memfit's -ctk/-ctv numbers in BENCHMARKS.md section 5.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import numpy as np

GGML = {"f16": 1, "q8_0": 8, "q4_0": 2}


def run(path: str, text: str, ctype: str, ctx: int = 512, threads: int = 2) -> dict:
    import llama_cpp
    llm = llama_cpp.Llama(model_path=path, n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True,
                          type_k=GGML[ctype], type_v=GGML[ctype], flash_attn=True,
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    add_bos = llm.metadata.get("tokenizer.ggml.add_bos_token", "true") != "false"
    toks = llm.tokenize(text.encode(), add_bos=add_bos, special=False)
    n_chunks = len(toks) // ctx
    first = ctx // 2
    nll = []
    for c in range(n_chunks):
        chunk = list(toks[c * ctx:(c + 1) * ctx])
        if add_bos:
            chunk[0] = llm.token_bos()
        llm.reset()
        llm.eval(chunk)
        lg = np.asarray(llm.scores[first:ctx - 1], dtype=np.float64)
        lg -= lg.max(axis=1, keepdims=True)
        lp = lg - np.log(np.exp(lg).sum(axis=1, keepdims=True))
        tgt = np.asarray(chunk[first + 1:ctx])
        nll.append(-lp[np.arange(len(tgt)), tgt])
    v = np.concatenate(nll)
    ppl = math.exp(v.mean())
    return {"model": os.path.basename(path), "cache_type": ctype, "chunks": n_chunks,
            "n_tokens": len(toks), "ppl": ppl,
            "ppl_err": ppl * float(v.std()) / math.sqrt(len(v) - 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-f", "--file", default=os.path.join(os.environ.get("MEMFIT_GOLDEN", "/work/shared/golden"),
                                                         "GPL-3.txt"))
    ap.add_argument("--types", default="f16,q8_0,q4_0")
    a = ap.parse_args()
    text = open(a.file, encoding="utf-8").read()
    if text.endswith("\n"):
        text = text[:-1]
    for t in a.types.split(","):
        print(json.dumps(run(a.model, text, t)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
