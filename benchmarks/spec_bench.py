"""Speculative decoding on this machine (issue 21; BENCHMARKS.md "Speculative decoding").

    python benchmarks/spec_bench.py curve   [--out F]   verify-cost curves (memfit bench --spec)
    python benchmarks/spec_bench.py accept  [--out F]   acceptance and tok/s per task (real models)
    python benchmarks/spec_bench.py oracle  [--out F]   the 7B-class file at 2.5 GiB, oracle drafts
    python benchmarks/spec_bench.py safety  [--out F]   auto vs off where speculation cannot pay

Every configuration runs in a fresh process (`memfit bench` or this file's `_inner`), so each
budget is a real process's budget; off and on are alternated inside it. Raw rows go to
benchmarks/spec_bench.jsonl with the commit and the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEVEN_B = os.environ.get("MEMFIT_7B", "/tmp/models/qwen2-7b-q4km.gguf")

PARA = ("Memory is the limit that decides which language models a machine can run. A model whose "
        "weights do not fit is read from the disk for every token, and the disk is slower than "
        "memory by an order of magnitude. Speculative decoding guesses several tokens and checks "
        "them all in one pass over the weights, so each pass can yield more than one token.")
CODE = '''def mean_and_spread(values):
    total = 0.0
    for v in values:
        total += v
    mean = total / len(values)
    spread = max(values) - min(values)
    return mean, spread
'''
DOC = ("The lighthouse at Cape Rell was built in 1871 from granite quarried two miles inland. Its "
       "lamp burned whale oil until 1902, then kerosene, and was electrified in 1936. The keeper's "
       "house has four rooms; the last keeper, Ada Munro, left in 1961 when the light was "
       "automated.")
TASKS = {
    "rewrite": f"Rewrite this paragraph word for word.\n\n{PARA}",
    "code_edit": f"Rename the variable `total` to `acc` in this function and return the whole "
                 f"function.\n\n```python\n{CODE}```",
    "quote": f"Document:\n{DOC}\n\nQuestion: When was the lamp electrified, and who was the last "
             f"keeper? Answer by quoting the sentences of the document.",
    "free": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def machine() -> str:
    name = platform.processor() or ""
    try:
        for ln in open("/proc/cpuinfo"):
            if ln.startswith("model name"):
                name = ln.split(":", 1)[1].strip()
                break
        fam = [ln for ln in open("/proc/cpuinfo") if ln.startswith(("cpu family", "model\t"))][:2]
        name += " " + " ".join(x.split(":")[1].strip() for x in fam)
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cpus"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, text=True,
                              capture_output=True).stdout.strip()
    except OSError:
        return "?"


def emit(out, row: dict) -> None:
    row = {**row, "commit": commit(), "machine": machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    print(json.dumps(row), flush=True)
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")


def _model(which: str) -> str:
    if which == "7b":
        return SEVEN_B
    from memfit.pull import pull
    return str(pull({"smollm2": "smollm2-135m", "gemma": "gemma3-270m"}[which]))


def streaming_budget(path: str, share: float) -> str:
    """The plan's floor plus ``share`` of the file: the rest of the weights stream."""
    from memfit.runtime import Runtime
    rt = Runtime(path, mem_budget="64GiB", n_ctx=1024)
    try:
        floor = rt.plan.min_budget_bytes
    finally:
        rt.close()
    return f"{int((floor + share * Path(path).stat().st_size) / 2**20) + 1}MiB"


def curve(out, reps: int) -> None:
    cfgs = [("smollm2", None), ("gemma", None), ("gemma", 0.02), ("7b", "2.5GiB")]
    for which, budget in cfgs:
        path = _model(which)
        if not Path(path).exists():
            print(f"skip {which}: {path} missing", file=sys.stderr)
            continue
        if isinstance(budget, float):  # the floor plus this share of the file
            budget = streaming_budget(path, budget)
        cmd = [sys.executable, "-m", "memfit", "bench", path, "--spec", "-p", "64", "-r",
               str(reps), "--json", "-t", str(os.cpu_count() or 1)]
        if budget:
            cmd += ["--mem-budget", budget]
        r = subprocess.run(cmd, text=True, capture_output=True)
        if r.returncode:
            print(r.stderr, file=sys.stderr)
            continue
        for ln in r.stdout.splitlines():
            emit(out, {"bench": "verify_curve", "which": which, "budget": budget, **json.loads(ln)})


def _inner(args: dict) -> None:
    """One configuration in this process: tasks x modes, off and on alternated."""
    import memfit
    from memfit.spec import CostModel, NGramProposer, OracleProposer, SpecConfig, Speculator
    from memfit.spec.policy import predicted_slope
    kw = {"n_ctx": args.get("n_ctx", 1024), "spec": "ngram", "draft_max": args.get("draft_max", 16)}
    if args.get("budget"):
        kw["mem_budget"] = args["budget"]
    with memfit.load(args["path"], **kw) as m:
        eng = m.engine
        rt = m.runtime
        slope = predicted_slope(rt.plan) if rt.plan is not None else None
        res = []
        for task in args["tasks"]:
            msg = TASKS.get(task, task)
            text = m.apply_chat_template([{"role": "user", "content": msg}]) \
                if m.tokenizer.chat_template else msg
            ids = m.tokenize(text)
            n = args.get("n", 96)
            ref = None
            rows = {"off": [], "ngram": [], "auto": [], "oracle": []}
            stats = {}
            for r in range(args.get("reps", 2)):
                for mode in ["off"] + args["modes"]:
                    if mode == "off":
                        eng.set_spec(None)
                    elif mode in ("ngram", "auto"):  # a fresh policy per run: no carried state
                        eng.set_spec(Speculator(SpecConfig(mode=mode, draft_max=args.get("draft_max", 16)),
                                                [NGramProposer()], CostModel(slope)))
                    elif mode == "oracle":
                        sp = Speculator(SpecConfig(mode="ngram", draft_max=args.get("draft_max", 16)),
                                        [OracleProposer([ids + ref])])
                        eng.set_spec(sp)
                    t0 = time.perf_counter()
                    c = m.generate(ids, max_tokens=n, temperature=args.get("temperature", 0.0),
                                   seed=args.get("seed", 1))
                    dt = time.perf_counter() - t0 - c.timings.prompt_ms / 1e3
                    if ref is None:
                        ref = c.ids
                    assert c.ids == ref, f"{mode}: tokens differ from the run without speculation"
                    rows[mode].append(len(c.ids) / dt)
                    if mode != "off":
                        stats[mode] = eng.spec.summary()
            for mode in args["modes"]:
                res.append({"task": task, "mode": mode, "n": len(ref),
                            "off_tok_s": round(statistics.median(rows["off"]), 3),
                            "spec_tok_s": round(statistics.median(rows[mode]), 3),
                            "ratio": round(statistics.median(rows[mode]) / statistics.median(rows["off"]), 3),
                            "off_samples": [round(x, 3) for x in rows["off"]],
                            "spec_samples": [round(x, 3) for x in rows[mode]],
                            "stats": stats.get(mode),
                            "peak_rss_bytes": memfit.api.peak_rss_bytes(),
                            "budget": args.get("budget"),
                            "disk_bytes_per_token": m.plan.disk_bytes_per_token if m.plan else 0})
        print("RESULT " + json.dumps(res), flush=True)


def _run_inner(args: dict) -> list[dict]:
    r = subprocess.run([sys.executable, __file__, "_inner", json.dumps(args)], text=True,
                       capture_output=True)
    for ln in r.stdout.splitlines():
        if ln.startswith("RESULT "):
            return json.loads(ln[7:])
    print(r.stderr[-3000:], file=sys.stderr)
    return []


def accept(out, reps: int) -> None:
    from memfit.pull import pull
    for which in ("smollm2", "gemma"):
        path = _model(which)
        cfgs = [None]
        if which == "gemma":
            cfgs.append(streaming_budget(path, 0.02))
        for budget in cfgs:
            rows = _run_inner({"path": path, "budget": budget, "tasks": list(TASKS),
                               "modes": ["ngram", "auto"], "reps": reps, "n": 96})
            for r in rows:
                emit(out, {"bench": "accept", "which": which, **r})
    del pull


def oracle(out, reps: int) -> None:
    if not Path(SEVEN_B).exists():
        sys.exit(f"{SEVEN_B} missing: memfit synth --arch qwen2 --size 7b {SEVEN_B}")
    for dm in (16,):
        rows = _run_inner({"path": SEVEN_B, "budget": "2.5GiB", "tasks": ["rewrite"],
                           "modes": ["oracle"], "reps": reps, "n": 48, "draft_max": dm,
                           "n_ctx": 512})
        for r in rows:
            emit(out, {"bench": "oracle_7b", "draft_max": dm, **r})


def safety(out, reps: int) -> None:
    """auto against off where speculation should not pay: sampled free text (temperature 1,
    seeded: the same tokens either way) on SmolLM2 resident and on the 30B-A3B-shaped MoE at
    30% of its file (synthetic weights and routing)."""
    moe = os.environ.get("MEMFIT_MOE", "/tmp/models/qwen3moe-30b-a3b.gguf")
    cfgs = [("smollm2", _model("smollm2"), None, 128, max(reps, 6))]
    if Path(moe).exists():
        cfgs.append(("moe30b", moe, f"{int(Path(moe).stat().st_size * 0.3 / 2**20)}MiB", 48, reps))
    for which, path, budget, n, r in cfgs:
        rows = _run_inner({"path": path, "budget": budget, "tasks": ["free"], "modes": ["auto"],
                           "reps": r, "n": n, "temperature": 1.0, "seed": 3, "n_ctx": 512})
        for row in rows:
            emit(out, {"bench": "policy_safety", "which": which, "temperature": 1.0, **row})


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "_inner":
        _inner(json.loads(sys.argv[2]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["curve", "accept", "oracle", "safety"])
    ap.add_argument("--out", default=str(HERE / "spec_bench.jsonl"))
    ap.add_argument("-r", "--reps", type=int, default=3)
    a = ap.parse_args()
    {"curve": curve, "accept": accept, "oracle": oracle, "safety": safety}[a.what](a.out, a.reps)


if __name__ == "__main__":
    main()
