"""The cost of batch invariance: `memfit bench` pp/tg of two source trees, alternated A B B A.

    python benchmarks/invariance_ab.py BASE_TREE NEW_TREE MODEL [MODEL ...] [--rounds 3]
        [-p 512] [-n 128] [--extra "-ctk q8_0 -ctv q8_0"] [--out benchmarks/invariance_ab.jsonl]

Each tree is a checkout with its native extension built in place (`python setup.py
build_ext --inplace`); both run under this interpreter with PYTHONPATH=TREE/src. One JSON line
per bench test, with the tree's commit, the round, the side and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time


def commit(tree: str) -> str:
    r = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return r.stdout.strip() + ("+dirty" if dirty else "")


def bench(tree: str, model: str, p: int, n: int, reps: int, extra: list[str]) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.path.join(tree, "src")}
    cmd = [sys.executable, "-m", "memfit", "bench", model, "-p", str(p), "-n", str(n), "-r", str(reps),
           "--json", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if r.returncode:
        raise SystemExit(f"bench failed in {tree}: {r.stderr.strip().splitlines()[-1:]}")
    return [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("new")
    ap.add_argument("models", nargs="+")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--extra", default="")
    ap.add_argument("--out", default="benchmarks/invariance_ab.jsonl")
    a = ap.parse_args()
    sides = {"base": a.base, "new": a.new}
    commits = {k: commit(v) for k, v in sides.items()}
    extra = shlex.split(a.extra)
    with open(a.out, "a") as out:
        for model in a.models:
            for rnd in range(a.rounds):
                for side in (("base", "new") if rnd % 2 == 0 else ("new", "base")):
                    for row in bench(sides[side], model, a.p, a.n, a.r, extra):
                        row.update(side=side, commit=commits[side], round=rnd, extra=a.extra,
                                   loadavg=os.getloadavg()[0], time=time.strftime("%Y-%m-%dT%H:%M:%S"))
                        out.write(json.dumps(row) + "\n")
                        out.flush()
                        print(f"{os.path.basename(model)} {row['test']} {side}: {row['tokens_per_s']:.2f} tok/s",
                              flush=True)


if __name__ == "__main__":
    main()
