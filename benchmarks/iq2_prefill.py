"""Prefill A/B for the IQ2 types: the batched kernels (rowwise=False: kblk on avx2, kgemm on
avx512vnni, over W unpacked to mf_kblk) against the vec-dots (rowwise=True) at n = 64..512,
4096x4096, 2 threads, alternating, medians of wall time. Writes one JSON line per sample."""
import json
import subprocess
import sys
import time

import numpy as np

import memfit._native as N
from memfit.ops import QTensor
from memfit.ops import native as nat
from memfit.quant.random import random_blocks
from memfit.quant.types import BY_NAME

commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
rows = cols = 4096
rng = np.random.default_rng(0)
out = open(sys.argv[1], "a")
for name in ("IQ2_XXS", "IQ2_XS", "IQ2_S"):
    t = BY_NAME[name]
    w = QTensor("w", t, (rows, cols), random_blocks(t, rows * cols, rng))
    for isa in ("avx2", "avx512vnni"):
        N.set_isa(isa)
        for n in (64, 128, 512):
            X = rng.standard_normal((n, cols)).astype(np.float32)
            y = np.empty((n, rows), np.float32)
            samples = {"prefill": [], "vecdot": []}
            for rep in range(3):
                for mode, rw in (("prefill", False), ("vecdot", True)):
                    t0 = time.perf_counter()
                    nat.matmul(X, w, out=y, rowwise=rw)
                    samples[mode].append(time.perf_counter() - t0)
            for mode, s in samples.items():
                rec = {"bench": "iq2_prefill", "commit": commit, "type": name, "isa": isa, "n": n,
                       "rows": rows, "cols": cols, "mode": mode, "seconds": s,
                       "median_tok_s": n / float(np.median(s))}
                out.write(json.dumps(rec) + "\n")
                print(name, isa, n, mode, f"{n / np.median(s):.0f} tok/s", flush=True)
