"""Prefill matmul A/B in one process: a base build (vec-dots in prefill) against this tree.

    cp -r BASE_TREE/src/memfit /tmp/iq3_abpkg/memfit_base     # its _native built in place
    python benchmarks/iq3_prefill_ab.py [TYPES] [--n=64,256,512] [--rounds=N] [--isa=avx2] [--out=F.jsonl]

W 4096 x 4096 of each type, X n x 4096, prefill mode (rowwise=False), one thread, timed by
this thread's CPU time (other processes on the shared host do not count); base and new
alternate A B B A. Prints the median ms per call and tokens/s per matrix.
"""
import json
import subprocess
import sys
import time

import numpy as np

from ab_tables import install_iq_tables  # noqa: E402  (the base build gets the IQ tables too)

sys.path.insert(0, "/tmp/iq3_abpkg")
from memfit_base.ops import QTensor as QB  # noqa: E402
from memfit_base.ops import native as natb  # noqa: E402

from memfit.ops import QTensor  # noqa: E402
from memfit.ops import native as nat  # noqa: E402
from memfit.quant.random import random_blocks  # noqa: E402
from memfit.quant.types import BY_NAME  # noqa: E402

from memfit import _native as _nn  # noqa: E402
from memfit_base import _native as _nb  # noqa: E402
install_iq_tables(_nn, _nb)

args = [a for a in sys.argv[1:] if not a.startswith("--")]
opt = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
types = (args[0] if args else "IQ3_XXS,IQ3_S,IQ1_S,IQ1_M").split(",")
ns = [int(v) for v in opt.get("n", "64,256,512").split(",")]
rounds = int(opt.get("rounds", 4))
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
nat.set_threads(1)
natb.set_threads(1)
isa = opt.get("isa", _nn.isa())  # --isa=avx2: the AVX2 prefill kernels (kblk) on both sides
_nn.set_isa(isa)
_nb.set_isa(isa)
rng = np.random.default_rng(0)
rows = cols = 4096
f = open(opt["out"], "a") if "out" in opt else None
for name in types:
    t = BY_NAME[name]
    raw = random_blocks(t, rows * cols, rng)
    from memfit_base.quant.types import BY_NAME as BB
    sides = {"base": (natb, QB("w", BB[name], (rows, cols), raw)), "new": (nat, QTensor("w", t, (rows, cols), raw))}
    for n in ns:
        x = rng.standard_normal((n, cols)).astype(np.float32)
        res = {"base": [], "new": []}
        for r in range(rounds):
            for side in (("base", "new") if r % 2 == 0 else ("new", "base")):
                mod, w = sides[side]
                mod.matmul(x, w, rowwise=False)
                t0 = time.thread_time()
                mod.matmul(x, w, rowwise=False)
                ms = (time.thread_time() - t0) * 1e3
                res[side].append(ms)
                if f:
                    f.write(json.dumps({"bench": "prefill_1thread", "isa": isa, "type": name, "rows": rows, "cols": cols, "n": n,
                                        "side": side, "round": r, "ms": round(ms, 3), "commit": commit,
                                        "time": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
        mb, mn = np.median(res["base"]), np.median(res["new"])
        print(f"{isa} {name:8s} n={n:4d} base {mb:8.1f} ms ({n / mb * 1e3:7.0f} tok/s)  new {mn:8.1f} ms ({n / mn * 1e3:7.0f} tok/s)  x{mb / mn:.2f}")
