"""KL divergence: memfit against llama.cpp, next to llama.cpp's own spread (batch 512 vs 1).

Run with the interpreter that has llama-cpp-python (built on this machine; never in CI):
    /root/peer-venv/bin/python benchmarks/kld_peer.py [--chunks 2] [--out DIR]

For each real model: the text (tests/data/golden/GPL-3.txt) tokenized by llama.cpp, two
512-token chunks, each chunk in a fresh context (BOS first where the model adds one):
  1. llama.cpp, the chunk as ONE batch of 512 with logits everywhere -> base file
     (llama-perplexity's --kl-divergence-base format, written by memfit.eval.kld.write_rows)
  2. llama.cpp, the chunk token by token (batch 1) -> statistics against the base
  3. memfit, `memfit perplexity MODEL --kl-divergence --kl-divergence-base FILE --json`
     (the memfit venv's interpreter, MEMFIT_PY) -> statistics against the same base
Prints one JSON line per (model, path) and appends them to benchmarks/kld_peer.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))  # memfit.eval.kld is numpy only
from golden_peer import MODEL_DIR, Peer  # noqa: E402
from peer_llamacpp import _quiet_logs  # noqa: E402

from memfit.eval.kld import compare_rows, read_base, write_rows  # noqa: E402

MODELS = {"smollm2-135m": "SmolLM2-135M-Instruct.Q4_1", "gemma3-270m": "gemma-3-270m-q4_k_m"}
TEXT = os.path.join(HERE, "..", "tests", "data", "golden", "GPL-3.txt")
N_CTX = 512


def rows_llamacpp(peer: Peer, chunk: list[int], batch: int):
    """(row, logits [k, n_vocab]) for rows N_CTX//2.. of one chunk in a fresh context."""
    first = N_CTX // 2
    L = peer.L
    ctx = peer.new_ctx()
    try:
        if batch >= len(chunk):
            peer._decode(ctx, chunk, all_logits=True)
            z = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(len(chunk), peer.n_vocab))
            for r in range(first, len(chunk), 16):  # slices: a 262k vocabulary is 1 MiB a row
                yield r, np.array(z[r:r + 16], dtype=np.float32)
            return
        for i, t in enumerate(chunk):
            peer._decode(ctx, [t])
            if i >= first:
                z = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(peer.n_vocab,))
                yield i, np.array(z, dtype=np.float32)[None]
    finally:
        L.llama_free(ctx)


def summary(model: str, path: str, r) -> dict:
    d = r.to_dict() if hasattr(r, "to_dict") else r
    return {"model": model, "path": path, "mean_kld": d["mean_kld"], "mean_kld_err": d["mean_kld_err"],
            "same_top": d["same_top"], "same_top_err": d["same_top_err"], "ppl": d["ppl"],
            "ppl_base": d["ppl_base"], "kld_99": d["percentiles"]["99.0"],
            "kld_max": d["percentiles"]["Maximum"], "count": d["count"], "chunks": d["chunks"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--out", default="/tmp/memfit-kld")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--base-only", action="store_true",
                    help="only write llama.cpp's batch-512 base files into --out (the tests use this)")
    a = ap.parse_args()
    import llama_cpp as L
    _keep = _quiet_logs(L)  # noqa: F841
    L.llama_backend_init()
    os.makedirs(a.out, exist_ok=True)
    text = open(TEXT, encoding="utf-8").read()
    if text.endswith("\n"):
        text = text[:-1]
    commit = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    memfit_py = os.environ.get("MEMFIT_PY", os.path.join(HERE, "..", ".venv", "bin", "python"))
    rows = []
    for name in a.models.split(","):
        stem = MODELS[name]
        peer = Peer(L, os.path.join(MODEL_DIR, stem + ".gguf"), repack=True)
        b = text.encode()
        buf = (L.llama_token * (len(b) + 16))()
        n = L.llama_tokenize(peer.vocab, b, len(b), buf, len(buf), True, False)  # as llama-perplexity
        toks = list(buf[:n])[:a.chunks * N_CTX]
        bos = L.llama_vocab_bos(peer.vocab) if L.llama_vocab_get_add_bos(peer.vocab) else None
        base_path = os.path.join(a.out, f"{stem}.b512.kld")
        t0 = time.perf_counter()
        write_rows(base_path, N_CTX, peer.n_vocab, toks, lambda c: rows_llamacpp(peer, c, 512), bos)
        if a.base_only:
            print(base_path, flush=True)
            peer.close()
            continue
        base = read_base(base_path)
        r1 = compare_rows(base, lambda c: rows_llamacpp(peer, c, 1), bos)
        rows.append(summary(name, "llama.cpp batch 1 vs llama.cpp batch 512", r1))
        print(json.dumps(rows[-1]), flush=True)
        peer.close()
        p = subprocess.run([memfit_py, "-m", "memfit", "perplexity", name, "--kl-divergence",
                            "--kl-divergence-base", base_path, "--json", "-t", "2"],
                           capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        rows.append(summary(name, "memfit vs llama.cpp batch 512", json.loads(p.stdout)))
        print(json.dumps(rows[-1]), flush=True)
        print(f"{name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if a.base_only:
        return 0
    with open(os.path.join(HERE, "kld_peer.jsonl"), "a") as f:
        for r in rows:
            f.write(json.dumps({**r, "memfit_commit": commit, "llama_cpp_python": L.__version__,
                                "n_ctx": N_CTX, "text": "tests/data/golden/GPL-3.txt",
                                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
