"""Prefill GEMM time per call (n X rows x a 4096x4096 W), the vec-dots run per (row, X row);
alternating types, median of trials; prints JSON lines."""
import json, sys, time
import numpy as np
from memfit import _native
from memfit.ops import QTensor
from memfit.ops import native as nat
from memfit.quant.random import random_blocks
from memfit.quant.types import BY_NAME

isa, commit = sys.argv[1], sys.argv[2]
_native.set_isa(isa)
rng = np.random.default_rng(0)
rows = cols = 4096
names = ["MXFP4", "NVFP4", "TQ1_0", "TQ2_0", "Q4_0", "Q4_K"]
ws = {n: QTensor("w", BY_NAME[n], (rows, cols), random_blocks(BY_NAME[n], rows * cols, rng)) for n in names}
X = rng.standard_normal((512, cols)).astype(np.float32)
for n in (64, 128, 512):
    samples = {k: [] for k in names}
    for trial in range(3):
        for k in names:
            nat.matmul(X[:n], ws[k], rowwise=False)
            c0 = time.process_time()
            nat.matmul(X[:n], ws[k], rowwise=False)
            samples[k].append(time.process_time() - c0)
    for k in names:
        s = sorted(samples[k])
        med = s[len(s) // 2]
        print(json.dumps({"run": "prefill_4096x4096", "type": k, "isa": isa, "n": n, "threads": _native.get_threads(),
                          "cpu_ms": round(med * 1e3, 2), "samples_cpu_ms": [round(v * 1e3, 2) for v in samples[k]],
                          "gops_per_cpu_s": round(2 * rows * cols * n / med / 1e9, 1), "memfit_commit": commit}), flush=True)
