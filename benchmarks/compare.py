"""Paired memfit vs llama.cpp pp/tg benchmark: A B A B in one process group (never run in CI).

    python benchmarks/compare.py MODEL [MODEL...] -p 512 -n 128 -r 3 -t 2 --rounds 2

Each round runs `memfit bench --json` (A) then benchmarks/peer_llamacpp.py under the peer
interpreter (B) as child processes; samples of all rounds are pooled, and the ratio
memfit/llama.cpp of the medians is printed per test as a Markdown table (and JSON with --json).
Alternating rounds spreads the noise of a shared machine over both sides equally.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PEER_PY = os.environ.get("MEMFIT_PEER_PYTHON", "/root/peer-venv/bin/python")


def loadavg() -> float:
    return os.getloadavg()[0]


def run_json(cmd: list[str], timeout: float) -> list[dict]:
    # A child in our process group; its JSON lines are the result, stderr passes through.
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited with {p.returncode}: {' '.join(cmd)}")
    return [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="A B pairs per model")
    ap.add_argument("--memfit", default="memfit", help="memfit executable")
    ap.add_argument("--peer-python", default=DEFAULT_PEER_PY)
    ap.add_argument("--peer-repack", type=int, choices=(0, 1), default=1)
    ap.add_argument("--timeout", type=float, default=900.0, help="per child process, seconds")
    ap.add_argument("--json", action="store_true", help="also print one JSON line per test")
    a = ap.parse_args(argv)

    # One process group: an interrupt stops both sides and nothing keeps running.
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    signal.signal(signal.SIGTERM, lambda *_: (os.killpg(0, signal.SIGKILL)))

    common = ["-p", str(a.n_prompt), "-n", str(a.n_gen), "-r", str(a.repetitions),
              "-t", str(a.threads), "--json"]
    print("| model | test | threads | memfit tok/s | llama.cpp tok/s | memfit/llama.cpp | load (1-min) |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for model in a.models:
        rows = []
        pooled: dict[tuple[str, str], list[float]] = {}
        loads = [loadavg()]
        for rnd in range(a.rounds):
            for side, cmd in (
                ("memfit", [a.memfit, "bench", model] + common),
                ("llama.cpp", [a.peer_python, os.path.join(HERE, "peer_llamacpp.py"), model]
                 + common + ["--repack", str(a.peer_repack)]),
            ):
                t0 = time.time()
                for rec in run_json(cmd, a.timeout):
                    pooled.setdefault((rec["test"], side), []).extend(rec["samples"])
                loads.append(loadavg())
                print(f"# {os.path.basename(model)} round {rnd + 1} {side}: "
                      f"{time.time() - t0:.1f} s, load {loads[-1]:.2f}", file=sys.stderr, flush=True)
        tests = sorted({t for t, _ in pooled}, key=lambda t: (t[:2] != "pp", t))
        for test in tests:
            m = pooled.get((test, "memfit"), [])
            l = pooled.get((test, "llama.cpp"), [])
            mm = statistics.median(m) if m else float("nan")
            lm = statistics.median(l) if l else float("nan")
            rows.append({"model": os.path.basename(model), "test": test, "threads": a.threads,
                         "memfit_tokens_per_s": round(mm, 2), "llamacpp_tokens_per_s": round(lm, 2),
                         "ratio": round(mm / lm, 3) if l and m else None,
                         "memfit_samples": [round(x, 2) for x in m],
                         "llamacpp_samples": [round(x, 2) for x in l],
                         "load_min": round(min(loads), 2), "load_max": round(max(loads), 2)})
        # Rows of each model as soon as it is done (a long run can be stopped between models).
        for r in rows:
            print(f"| {r['model']} | {r['test']} | {r['threads']} | {r['memfit_tokens_per_s']:.2f} "
                  f"| {r['llamacpp_tokens_per_s']:.2f} | {r['ratio']:.2f}x "
                  f"| {r['load_min']:.2f}-{r['load_max']:.2f} |")
            if a.json:
                print(json.dumps(r))
        sys.stdout.flush()

    return 0


if __name__ == "__main__":
    sys.exit(main())
