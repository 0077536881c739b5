"""Constrained decoding speed: decode tok/s free vs under a JSON schema, the share of tokens
the grammar forces, and schema compile time, on real models (resident, one sequence).

    python benchmarks/constrain_bench.py [--models smollm2-135m gemma3-270m] [--schemas 8]
                                         [--repeat 3] [--lean] [--json out.json]

Per model, greedy:
  free       the same prompt without a constraint, ignore_eos, as many tokens as the
             constrained run made (the plain decode speed)
  json       each schema of tests/schemas.py (the first --schemas) as the constraint, forced
             tokens fed together in the next forward (the engine's default)
  json-noff  the same with fast_forward off (MEMFIT_FF=0): forced tokens one forward each
decode tok/s = generated tokens / time from the first sampled token to the last (the
engine's Timings: predicted_n / predicted_ms); the three modes run one after the other for
each prompt, --repeat times, and the fastest run of each counts (a shared machine's load
drifts alike for all, and the minimum is the least disturbed). compile = compile_constraint on a
cold cache (the tokenizer wrapper is built once before, its time shown apart).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def _generate(m, ids, constraint, max_tokens, fast_forward=True, ignore_eos=False):
    from memfit.engine.sampler import SamplingParams
    eng = m.engine
    eng.fast_forward = fast_forward
    f0, s0 = eng.n_forced, eng.n_steps
    rid = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=max_tokens),
                          constraint=constraint, ignore_eos=ignore_eos)
    text, t = "", None
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid:
                text += o.text
                if o.finished:
                    t = o.timings
    eng.fast_forward = True
    return {"n": t.predicted_n, "ms": t.predicted_ms, "ttft_ms": t.prompt_ms,
            "forced": eng.n_forced - f0,
            "steps": eng.n_steps - s0, "text": text}


def bench_model(name: str, n_schemas: int, max_tokens: int, repeat: int,
                mem_budget: str | None = None) -> dict:
    import memfit
    from memfit.constrain import compile_constraint
    from memfit.constrain.tokenizer import ll_tokenizer
    from memfit.pull import pull
    from schemas import SCHEMAS

    path = name if os.path.isfile(name) else str(pull(name, quiet=True))
    m = memfit.load(path, n_ctx=2048, mem_budget=mem_budget, constrained=True)
    tok = m.tokenizer
    t0 = time.perf_counter()
    ll_tokenizer(tok)
    tok_s = time.perf_counter() - t0
    chosen = SCHEMAS[:n_schemas]
    compile_ms = []
    grammars = []
    for _, schema in chosen:
        tok.__dict__.pop("_llg_grammars", None)  # a cold compile each time
        t0 = time.perf_counter()
        g = compile_constraint(tok, {"type": "json_schema", "schema": schema, "strict": True})
        compile_ms.append((time.perf_counter() - t0) * 1e3)
        grammars.append(g)
    def prompt(n, s, tag):
        # each run its own first words: no run takes its prompt from the prefix cache, so the
        # time to first token compares like with like
        return m.tokenize(m.apply_chat_template([{"role": "user", "content":
            f"({tag}) Reply with a JSON example of a {n.replace('_', ' ')} following this "
            f"schema: {json.dumps(s)}"}]))
    _generate(m, prompt("x", {}, "warm-up"), None, 8)
    rows = {"json": [], "json-noff": [], "free": []}

    def best(runs):  # the fastest of the repeats (the least disturbed by other processes)
        return min(runs, key=lambda r: r["ms"])

    for (sn, sc), g in zip(chosen, grammars):
        got = {k: [] for k in rows}
        for r in range(repeat):
            got["json"].append(_generate(m, prompt(sn, sc, f"a{r}"), g, max_tokens))
            got["json-noff"].append(_generate(m, prompt(sn, sc, f"b{r}"), g, max_tokens,
                                              fast_forward=False))
            n = max(8, got["json"][-1]["n"])
            got["free"].append(_generate(m, prompt(sn, sc, f"c{r}"), None, n, ignore_eos=True))
        for k in rows:
            rows[k].append(best(got[k]))
    out = {"model": os.path.basename(name), "mem_budget": mem_budget, "n_vocab": tok.n_vocab, "schemas": len(chosen), "repeat": repeat,
           "llg_slices": os.environ["MEMFIT_LLG_SLICES"] == "1",
           "tokenizer_build_s": round(tok_s, 3),
           "compile_ms_median": round(statistics.median(compile_ms), 2),
           "compile_ms_max": round(max(compile_ms), 2), "modes": {}}
    for mode, runs in rows.items():
        n, ms = sum(r["n"] for r in runs), sum(r["ms"] for r in runs)
        forced = sum(r["forced"] for r in runs)
        out["modes"][mode] = {"tokens": n, "decode_tok_s": round(n / (ms / 1e3), 2) if ms else 0.0,
                              "forced_share": round(forced / n, 3) if n else 0.0,
                              "forwards": sum(r["steps"] for r in runs),
                              "ttft_ms_median": round(statistics.median(
                                  r["ttft_ms"] for r in runs), 1)}
    free = out["modes"]["free"]["decode_tok_s"]
    for mode in ("json", "json-noff"):
        out["modes"][mode]["vs_free"] = round(out["modes"][mode]["decode_tok_s"] / free, 3)
    m.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--schemas", type=int, default=8, help="how many of tests/schemas.py")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3, help="runs per prompt and mode; the fastest counts")
    ap.add_argument("--lean", action="store_true",
                    help="llguidance's tables without slices, as under a memory budget")
    ap.add_argument("--mem-budget", default=None, help="e.g. 2.5GiB: weights streamed from disk")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    a = ap.parse_args()
    os.environ["MEMFIT_LLG_SLICES"] = "0" if a.lean else "1"
    results = [bench_model(n, a.schemas, a.max_tokens, a.repeat, a.mem_budget) for n in a.models]
    print(f"{'model':14s} {'mode':10s} {'tokens':>6s} {'tok/s':>8s} {'vs free':>7s} "
          f"{'forced':>6s} {'forwards':>8s} {'TTFT ms':>8s}")
    for r in results:
        for mode, d in r["modes"].items():
            print(f"{r['model']:14s} {mode:10s} {d['tokens']:6d} {d['decode_tok_s']:8.1f} "
                  f"{d.get('vs_free', 1.0):7.2f} {d['forced_share']:6.1%} {d['forwards']:8d} "
                  f"{d['ttft_ms_median']:8.1f}")
        print(f"{r['model']:14s} compile median {r['compile_ms_median']:.1f} ms, max "
              f"{r['compile_ms_max']:.1f} ms; tokenizer wrapper {r['tokenizer_build_s']:.2f} s "
              f"({r['n_vocab']} tokens)")
    if a.json:
        import platform
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                    if ln.startswith("model name")), platform.processor())
        machine = {"cpu": cpu, "cpus": os.cpu_count(), "load_avg": os.getloadavg()}
        Path(a.json).write_text(json.dumps({"machine": machine, "results": results}, indent=1)
                                + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
