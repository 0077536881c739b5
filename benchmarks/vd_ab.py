"""Decode vec-dot A/B in one process: a base build against this tree, weights L2-resident.

    cp -r BASE_TREE/src/memfit /tmp/abpkg/memfit_base     # its _native built in place
    python benchmarks/vd_ab.py [TYPES] [--isa=avx2] [--rounds=N] [--out=F.jsonl]

A 64 x 4096 weight (<= 230 KB, in L2) dotted with one X row (the decode kernels) 200 times
per sample, one thread, timed by this thread's CPU time; base and new alternate A B B A
within one process, so both see the same moment of a shared host. Prints median ns per
256-value block of each side and their ratio, with the spread (min-max) of each.
"""
import json
import subprocess
import sys
import time

import numpy as np

from ab_tables import install_iq_tables  # noqa: E402

sys.path.insert(0, "/tmp/abpkg")
from memfit_base import _native as _nb  # noqa: E402
from memfit_base.ops import QTensor as QB  # noqa: E402
from memfit_base.ops import native as natb  # noqa: E402
from memfit_base.quant.types import BY_NAME as BB  # noqa: E402

from memfit import _native as _nn  # noqa: E402
from memfit.ops import QTensor  # noqa: E402
from memfit.ops import native as nat  # noqa: E402
from memfit.quant.random import random_blocks  # noqa: E402
from memfit.quant.types import BY_NAME  # noqa: E402

install_iq_tables(_nn, _nb)

args = [a for a in sys.argv[1:] if not a.startswith("--")]
opt = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--"))
types = (args[0] if args else "IQ2_XXS,IQ2_XS,IQ2_S").split(",")
rounds = int(opt.get("rounds", 10))
isa = opt.get("isa", _nn.isa())
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
for mod, nm in ((nat, _nn), (natb, _nb)):
    mod.set_threads(1)
    nm.set_isa(isa)
rng = np.random.default_rng(0)
rows, cols, reps = 64, 4096, 200
f = open(opt["out"], "a") if "out" in opt else None
for name in types:
    t = BY_NAME[name]
    raw = random_blocks(t, rows * cols, rng)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    sides = {"base": (natb, QB("w", BB[name], (rows, cols), raw)), "new": (nat, QTensor("w", t, (rows, cols), raw))}
    ya, yb = (m.matmul(x, w, rowwise=True) for m, w in sides.values())
    same = bool(np.array_equal(ya.view(np.uint32), yb.view(np.uint32)))
    res = {"base": [], "new": []}
    for r in range(rounds):
        for side in (("base", "new") if r % 2 == 0 else ("new", "base")):
            mod, w = sides[side]
            t0 = time.thread_time()
            for _ in range(reps):
                mod.matmul(x, w, rowwise=True)
            ns = (time.thread_time() - t0) / reps * 1e9 / (rows * cols / 256)
            res[side].append(ns)
            if f:
                f.write(json.dumps({"bench": "vd_ab_l2_1thread", "isa": isa, "type": name, "rows": rows, "cols": cols,
                                    "side": side, "round": r, "ns_per_256": round(ns, 2), "commit": commit,
                                    "time": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
    b, n = np.array(res["base"]), np.array(res["new"])
    print(f"{isa} {name:8s} ns/256 base {np.median(b):6.1f} ({b.min():.1f}-{b.max():.1f})  "
          f"new {np.median(n):6.1f} ({n.min():.1f}-{n.max():.1f})  base/new x{np.median(b) / np.median(n):.2f}  same bits: {same}")
