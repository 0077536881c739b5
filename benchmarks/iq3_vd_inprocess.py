"""Per-type vec-dot cost, single thread, weights cache-resident (compute, not DRAM).

    python benchmarks/iq3_vd_inprocess.py [TYPES] [--isa=avx2,avx512vnni] [--rounds=N] [--out=F.jsonl]

A 64 x 4096 weight (<= 230 KB, L2) dotted with one X row (decode kernels, n=1) many times;
timed by this thread's CPU time (time.thread_time), so other processes on the shared host do
not count. Reports ns per 256-value block and the GB/s it would sustain (the compute ceiling);
ISAs alternate per round. One JSON line per sample.
"""
import json
import subprocess
import sys
import time

import numpy as np

from memfit import _native
from memfit.ops import QTensor
from memfit.ops import native as nat
from memfit.quant.random import random_blocks
from memfit.quant.types import BY_NAME

args = [a for a in sys.argv[1:] if not a.startswith("--")]
opt = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
types = (args[0] if args else "IQ3_XXS,IQ3_S,IQ1_S,IQ1_M,Q4_K").split(",")
isas = opt.get("isa", "avx2,avx512vnni").split(",")
rounds = int(opt.get("rounds", 5))
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
nat.set_threads(1)
rng = np.random.default_rng(0)
rows, cols, reps = 64, 4096, 400
f = open(opt["out"], "a") if "out" in opt else None
res = {}
for name in types:
    t = BY_NAME[name]
    w = QTensor("w", t, (rows, cols), random_blocks(t, rows * cols, rng))
    x = rng.standard_normal((1, cols)).astype(np.float32)
    for r in range(rounds):
        for isa in (isas if r % 2 == 0 else isas[::-1]):
            _native.set_isa(isa)
            nat.matmul(x, w, rowwise=True)
            t0 = time.thread_time()
            for _ in range(reps):
                nat.matmul(x, w, rowwise=True)
            dt = (time.thread_time() - t0) / reps
            nsb = dt * 1e9 / (rows * cols / 256)
            gbs = rows * t.row_bytes(cols) / dt / 1e9
            res.setdefault((name, isa), []).append((nsb, gbs))
            if f:
                f.write(json.dumps({"bench": "vd_l2_1thread", "type": name, "isa": isa, "round": r,
                                    "rows": rows, "cols": cols, "ns_per_256": round(nsb, 2),
                                    "gb_per_s": round(gbs, 3), "commit": commit,
                                    "time": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
for (name, isa), v in res.items():
    a = np.array(v)
    print(f"{name:8s} {isa:11s} ns/256 median {np.median(a[:, 0]):7.1f}  compute ceiling {np.median(a[:, 1]):6.2f} GB/s/thread")
