"""Usage: python benchmarks/invariance_moe_switch.py MOE.gguf ROUNDS  (JSON lines, then a summary)

MoE prefill with batch-invariant expert groups (the prefill GEMM for every group) against
small groups (< 8 rows) on the one-row kernels, alternated in one process."""
import json, sys, time
import numpy as np
from memfit import _native
from memfit.api import Model
path, rounds = sys.argv[1], int(sys.argv[2])
m = Model(path, n_ctx=1024)
rng = np.random.default_rng(0)
def pp(P):
    ids = rng.integers(100, 1000, P)
    c = m.model.new_cache(P + 8)
    t = time.perf_counter(); m.model.forward(ids, c)
    return P / (time.perf_counter() - t)
res = {}
for P in (64, 512):
    pp(P)
    for r in range(rounds):
        for v in ((0, 8) if r % 2 == 0 else (8, 0)):
            _native.set_moe_vecdot_below(v)
            x = pp(P)
            res.setdefault((P, v), []).append(x)
            print(json.dumps({"test": f"pp{P}", "vecdot_below": v, "round": r, "tokens_per_s": round(x, 2), "load": open('/proc/loadavg').read().split()[0]}), flush=True)
_native.set_moe_vecdot_below(0)
for P in (64, 512):
    a, b = np.median(res[(P, 0)]), np.median(res[(P, 8)])
    print(f"pp{P}: invariant {a:.1f} (range {min(res[(P,0)]):.1f}-{max(res[(P,0)]):.1f}), small groups on one-row kernels {b:.1f} ({min(res[(P,8)]):.1f}-{max(res[(P,8)]):.1f}): invariant/opt-out {a/b:.3f}")
