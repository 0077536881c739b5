"""Teacher-forced agreement of memfit with llama.cpp on a synthetic MoE file (never in CI).

Three steps, two environments (llama-cpp-python is not a memfit dependency):
    python benchmarks/moe_agreement.py memfit MODEL DIR [-n 256] [--mem-budget SIZE]
    OMP_WAIT_POLICY=passive /root/peer-venv/bin/python benchmarks/moe_agreement.py llama MODEL DIR
    python benchmarks/moe_agreement.py compare MODEL DIR [--out benchmarks/moe_agreement.jsonl]

memfit: the text ($MEMFIT_GOLDEN/GPL-3.txt) tokenized by memfit (BOS as the file says), the
first N ids as one prompt, logits at every position (the store's expert cache when
--mem-budget is given, else the memory-mapped file). llama.cpp: the same ids, logits at every
position, once as one batch of 512 and once one token at a time (its own spread). compare: per
position softmax, KL(llama.cpp batch 512 || other) and top-1 agreement, mean/p99/max.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TEXT = Path(os.environ.get("MEMFIT_GOLDEN", "/work/shared/golden")) / "GPL-3.txt"


def memfit_step(a) -> None:
    import memfit
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    with memfit.load(a.model, threads=2, n_ctx=a.n + 8, mem_budget=a.mem_budget) as m:
        ids = m.tokenize(TEXT.read_text(encoding="utf-8"))[: a.n]
        np.save(d / "ids.npy", np.array(ids, np.int64))
        t0 = time.perf_counter()
        z = m.model.forward(ids, m.model.new_cache(a.n + 8), all_logits=True)
        tag = "memfit-budget" if a.mem_budget else "memfit"
        np.save(d / f"{tag}.npy", np.asarray(z, np.float32))
        st = m.store.stats() if m.store is not None else {}
        (d / f"{tag}.json").write_text(json.dumps({
            "seconds": time.perf_counter() - t0, "mem_budget": a.mem_budget,
            "expert_hit_rate": st.get("expert_hit_rate"), "bytes_read": st.get("bytes_read")}))


def llama_step(a) -> None:
    from llama_cpp import Llama
    d = Path(a.dir)
    ids = np.load(d / "ids.npy").tolist()
    for name, n_batch in (("llama-batch", 512), ("llama-seq", 1)):
        if (d / f"{name}.npy").exists():  # a rerun finishes what a stopped one left
            continue
        m = Llama(a.model, n_ctx=len(ids) + 8, n_batch=n_batch, n_ubatch=n_batch, logits_all=True,
                  n_threads=2, verbose=False, use_mmap=True, flash_attn=bool(a.flash_attn))
        m.eval(ids)
        np.save(d / f"{name}.npy", np.array(m.scores[: len(ids)], np.float32))
        del m


def _logsoftmax(z):
    z = z.astype(np.float64)
    z = z - z.max(1, keepdims=True)
    return z - np.log(np.exp(z).sum(1, keepdims=True))


def compare_step(a) -> None:
    d = Path(a.dir)
    ref = _logsoftmax(np.load(d / "llama-batch.npy"))
    rows = []
    for name in ("llama-seq", "memfit", "memfit-budget"):
        if not (d / f"{name}.npy").exists():
            continue
        got = _logsoftmax(np.load(d / f"{name}.npy"))
        kl = (np.exp(ref) * (ref - got)).sum(1)
        top = got.argmax(1) == ref.argmax(1)
        r = {"vs_llama_batch512": name, "flash_attn": a.flash_attn, "positions": len(kl),
             "top1_agreement": float(top.mean()),
             "mean_kld": float(kl.mean()), "kld_p99": float(np.percentile(kl, 99)),
             "kld_max": float(kl.max()), "model": os.path.basename(a.model)}
        meta = d / f"{name}.json"
        if meta.exists():
            r.update(json.loads(meta.read_text()))
        rows.append(r)
        print(json.dumps(r))
    if a.out:
        c = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"],
                           capture_output=True, text=True).stdout.strip()
        with open(a.out, "a") as f:
            for r in rows:
                f.write(json.dumps({**r, "commit": c, "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                             time.gmtime())}) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=("memfit", "llama", "compare"))
    ap.add_argument("model")
    ap.add_argument("dir")
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--mem-budget", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--flash-attn", type=int, default=1, choices=(0, 1),
                    help="llama.cpp's flash attention (1: on, as llama-server and llama-perplexity "
                         "run by default on the CPU; llama-cpp-python's own default is off)")
    a = ap.parse_args(argv)
    {"memfit": memfit_step, "llama": llama_step, "compare": compare_step}[a.step](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
