"""Speed before/after a refactor (issue 19's architecture files): two builds alternated.

    python benchmarks/refactor_ab.py BASE_MEMFIT HEAD_MEMFIT MODEL [--rounds 4] [-p 512 -n 32]
        [--mem-budget SIZE] [--out benchmarks/refactor_ab.jsonl]

Each round runs `memfit bench MODEL -p P -n N -r 1 -t 2 --json` with A then B (B then A on odd
rounds); prints per build the median and spread of pp and tg tokens/s and the B/A ratio of
medians; appends one JSON line per bench result (build, round, load average) to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time


def bench(exe, a):
    cmd = [exe, "bench", a.model, "-p", str(a.p), "-n", str(a.n), "-r", "1", "-t", "2", "--json"]
    if a.mem_budget:
        cmd += ["--mem-budget", a.mem_budget]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("head")
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--mem-budget", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    res = {"base": {}, "head": {}}
    for r in range(a.rounds):
        order = [("base", a.base), ("head", a.head)]
        for name, exe in (order if r % 2 == 0 else order[::-1]):
            for row in bench(exe, a):
                t = row.get("test") or ("pp" if row.get("n_prompt") else "tg")
                res[name].setdefault(t, []).append(row["tokens_per_s"] if "tokens_per_s" in row else row["avg_ts"])
                if a.out:
                    with open(a.out, "a") as f:
                        f.write(json.dumps({**row, "build": name, "round": r, "model": os.path.basename(a.model),
                                            "loadavg": os.getloadavg()[0], "mem_budget": a.mem_budget,
                                            "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n")
    for t in sorted(res["base"]):
        b, h = res["base"][t], res["head"][t]
        mb, mh = statistics.median(b), statistics.median(h)
        print(f"{os.path.basename(a.model)} {t}: base {mb:.2f} ({min(b):.2f}-{max(b):.2f}) "
              f"head {mh:.2f} ({min(h):.2f}-{max(h):.2f}) head/base {mh / mb:.3f}")


if __name__ == "__main__":
    main()
