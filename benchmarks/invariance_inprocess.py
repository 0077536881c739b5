"""Batch invariance's cost in one process: a base build against this tree, alternated.

    cp -r BASE_TREE/src/memfit /tmp/abpkg/memfit_base    # its _native built in place
    python benchmarks/invariance_inprocess.py MODEL PROMPT_TOKENS [ROUNDS] [--out FILE.jsonl]

Loads the model with both packages (memfit_base and memfit), then alternates A B B A: a
prefill of PROMPT_TOKENS random ids and 8 decode tokens through Model.forward. In one process
both sides see the same page cache and the same minute, so the ratio repeats where separate
processes do not. One JSON line per sample.
"""

import json
import sys
import time

import numpy as np

sys.path.insert(0, "/tmp/abpkg")
from memfit import api as new_api  # noqa: E402
from memfit_base import api as base_api  # noqa: E402


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--out")]
    out = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--out=")), None)
    path, P = args[0], int(args[1])
    rounds = int(args[2]) if len(args) > 2 else 6
    ms = {"base": base_api.Model(path, n_ctx=1024), "new": new_api.Model(path, n_ctx=1024)}
    ids = np.random.default_rng(0).integers(100, 1000, P)

    def pp(m):
        c = m.model.new_cache(P + 8)
        t = time.perf_counter()
        m.model.forward(ids, c)
        return P / (time.perf_counter() - t)

    def tg(m, n=8):
        c = m.model.new_cache(P + n + 8)
        m.model.forward(ids, c)
        t = time.perf_counter()
        for i in range(n):
            m.model.forward(ids[i:i + 1], c)
        return n / (time.perf_counter() - t)

    for m in ms.values():
        pp(m)
    res = {k: {"pp": [], "tg": []} for k in ms}
    f = open(out, "a") if out else None
    for r in range(rounds):
        for k in (("base", "new") if r % 2 == 0 else ("new", "base")):
            s = {"pp": pp(ms[k]), "tg": tg(ms[k])}
            for t, v in s.items():
                res[k][t].append(v)
                if f:
                    f.write(json.dumps({"model": path.rsplit("/", 1)[-1], "test": f"pp{P}" if t == "pp" else "tg8",
                                        "side": k, "round": r, "tokens_per_s": round(v, 3),
                                        "time": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
    for k in ms:
        print(k, "pp%d median %.1f" % (P, np.median(res[k]["pp"])), "tg median %.2f" % np.median(res[k]["tg"]))
    print("new/base pp %.3f tg %.3f" % (np.median(res["new"]["pp"]) / np.median(res["base"]["pp"]),
                                        np.median(res["new"]["tg"]) / np.median(res["base"]["tg"])))


if __name__ == "__main__":
    main()
