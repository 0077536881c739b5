"""Speed per quant mix on a 7B-class file: memfit against llama.cpp, plus matvec GB/s per type.
Never run in CI.

Run with the interpreter that has llama-cpp-python (the memfit venv, MEMFIT_PY, default
.venv/bin/python, writes the files and runs memfit):
    /root/peer-venv/bin/python benchmarks/types_speed.py --mixes IQ2_XXS,IQ3_M,MXFP4_MOE \
        [--arch qwen2 --size 7b] [--rounds 3] [-p 512] [-n 32] [-t 2]

Per mix (a `memfit synth --quant` value: a llama-quantize mix or one type):
  1. the file `memfit synth --arch A --size S --quant MIX`, cached as
     /tmp/models/types-speed-A-S-MIX.gguf (random valid blocks: speed, not quality)
  2. --rounds alternated rounds (memfit then llama.cpp, then llama.cpp then memfit, ...), each
     side one process on the same file, resident (memory-mapped, warm page cache, no budget):
     `memfit bench FILE -p P -n N -r 1 --json` and benchmarks/peer_llamacpp.py (llama-bench's
     method: one warm-up, llama_perf timings). pp P and tg N per round; medians, min/max and
     the median of the per-round ratios memfit / llama.cpp.
  3. `memfit bench --kernels --types T --shapes ... --json`: matvec GB/s of each matrix type of
     the mix at the model's own shapes (n_embd x n_embd, n_ff x n_embd, n_embd x n_ff), next to
     the read-bandwidth probe of the same run (fraction_of_bandwidth).
A side whose types memfit cannot compute yet is skipped and said. JSON lines, with the commit,
appended to benchmarks/types_speed.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
MODEL_DIR = "/tmp/models"


def _rows(cmd: list[str]) -> list[dict]:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd[:4])} ... failed: {p.stderr.strip()[-2000:]}")
    return [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]


def _stats(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3),
            "max": round(max(xs), 3), "samples": [round(x, 3) for x in xs]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mixes", required=True, help="comma-separated --quant values")
    ap.add_argument("--arch", default="qwen2")
    ap.add_argument("--size", default="7b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--trials", type=int, default=5, help="kernel trials")
    ap.add_argument("--no-kernels", action="store_true")
    a = ap.parse_args()
    from memfit.quant.types import SUPPORTED_NAMES
    from memfit.synth import CONFIGS, plan_types
    memfit_py = os.environ.get("MEMFIT_PY", os.path.join(HERE, "..", ".venv", "bin", "python"))
    commit = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    cfg = CONFIGS[(a.arch, a.size)]
    E, F = cfg["n_embd"], cfg["n_ff"]
    out = open(os.path.join(HERE, "types_speed.jsonl"), "a")
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for mix in a.mixes.split(","):
        path = os.path.join(MODEL_DIR, f"types-speed-{a.arch}-{a.size}-{mix}.gguf")
        if not os.path.exists(path):
            os.makedirs(MODEL_DIR, exist_ok=True)
            _rows([memfit_py, "-m", "memfit", "synth", path, "--arch", a.arch, "--size", a.size,
                   "--quant", mix, "--json"])
        types = sorted({qt.name for _, s, qt in plan_types(mix, a.arch, cfg) if len(s) > 1})
        todo = [t for t in types if t not in SUPPORTED_NAMES]
        base = {"mix": mix, "file": os.path.basename(path), "file_bytes": os.path.getsize(path),
                "arch": a.arch, "size": a.size, "threads": a.threads, "types": types,
                "memfit_commit": commit, "date": date}
        sides = ["memfit", "llama.cpp"] if not todo else ["llama.cpp"]
        if todo:
            print(f"{mix}: memfit cannot compute {', '.join(todo)} yet; llama.cpp only",
                  file=sys.stderr)
        samples: dict[tuple[str, str], list[float]] = {}
        for r in range(a.rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            for side in order:
                if side == "memfit":
                    cmd = [memfit_py, "-m", "memfit", "bench", path]
                else:
                    cmd = [sys.executable, os.path.join(HERE, "peer_llamacpp.py"), path]
                rows = _rows(cmd + ["-p", str(a.n_prompt), "-n", str(a.n_gen), "-r", "1",
                                    "--json", "-t", str(a.threads)])
                for row in rows:
                    samples.setdefault((side, row["test"]), []).append(row["tokens_per_s"])
                print(f"# {mix} round {r + 1}/{a.rounds} {side}: "
                      + ", ".join(f"{row['test']} {row['tokens_per_s']:.2f} tok/s" for row in rows),
                      file=sys.stderr, flush=True)
        for test in (f"pp{a.n_prompt}", f"tg{a.n_gen}"):
            rec = {**base, "kind": "e2e", "test": test, "rounds": a.rounds}
            for side in sides:
                rec[side.replace(".", "")] = _stats(samples[(side, test)])
            if len(sides) == 2:
                ratios = [m / ll for m, ll in zip(samples[("memfit", test)], samples[("llama.cpp", test)])]
                rec["ratio_memfit_over_llamacpp"] = _stats(ratios)
            out.write(json.dumps(rec) + "\n")
            out.flush()
            print(json.dumps(rec), flush=True)
        ktypes = [t for t in types if t in SUPPORTED_NAMES and t not in ("F32", "F16", "BF16")]
        if a.no_kernels or not ktypes:
            continue
        shapes = f"{E}x{E},{F}x{E},{E}x{F}"
        for row in _rows([memfit_py, "-m", "memfit", "bench", "--kernels", "--types", ",".join(ktypes),
                          "--shapes", shapes, "--trials", str(a.trials), "--json", "-t", str(a.threads)]):
            rec = {**base, "kind": "kernel", "type": row["type"], "rows": row["rows"],
                   "cols": row["cols"], "isa": row["isa"], "gb_per_s": round(row["gb_per_s"], 3),
                   "samples_gb_per_s": [round(x, 3) for x in row["samples_gb_per_s"]],
                   "mem_read_gb_per_s": round(row["mem_read_gb_per_s"], 3),
                   "fraction_of_bandwidth": round(row["fraction_of_bandwidth"], 4)}
            out.write(json.dumps(rec) + "\n")
            out.flush()
            print(json.dumps(rec), flush=True)
    out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
