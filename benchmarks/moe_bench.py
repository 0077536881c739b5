"""MoE under a memory limit: memfit and llama.cpp alternately inside the same cgroup (never in CI).

    python benchmarks/moe_bench.py /work/data/qwen3moe-30b-a3b.gguf \
        --runs memfit:0.3,llama.cpp:0.3,memfit:0.5,llama.cpp:0.5,memfit:none,llama.cpp:none \
        -p 512 -n 16 --peer-n 8 --out benchmarks/moe_30b.jsonl

Each run: a fresh cgroup of limit L = fraction x file size (benchmarks/in_cgroup.sh; `none`: no
limit below the machine's RAM), page cache dropped first. memfit: `bench -p P -n N -r 1 -t 2
--mem-budget 0.96*L --json` (no --mem-budget for `none`: the detected budget), with the plan of
the same budget and context taken just before (its bandwidths give the bound), and quiet probes
of memory and random expert reads around the run (--probes: the bound at their median rates, and
the bounds each probe gives, since this disk's rate moves between minutes). llama.cpp:
benchmarks/peer_llamacpp.py, mmap, --repack 0 (use_extra_bufts=False), same threads, tg capped
by --peer-max-seconds; side `llama.cpp-repack`: --repack 1 (its repacked weights, the faster
configuration where the file fits). `memfit:0.3:lru-only` etc. add an ablation variant (see VARIANTS).
One JSON line per run is appended to OUT with the memfit commit, the time and the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PEER_PY = os.environ.get("MEMFIT_PEER_PYTHON", "/root/peer-venv/bin/python")
# ablation variants: environment of the memfit process
VARIANTS = {
    "default": {},
    "lru": {"MEMFIT_EXPERT_HOTSET": "0", "MEMFIT_EXPERT_LOOKAHEAD": "0", "MEMFIT_EXPERT_POLICY": "lru"},
    "lru+hot": {"MEMFIT_EXPERT_HOTSET": "1", "MEMFIT_EXPERT_LOOKAHEAD": "0", "MEMFIT_EXPERT_POLICY": "lru"},
    "lru+hot+lookahead": {"MEMFIT_EXPERT_HOTSET": "1", "MEMFIT_EXPERT_LOOKAHEAD": "1",
                          "MEMFIT_EXPERT_POLICY": "lru"},
    "decay+hot+lookahead": {"MEMFIT_EXPERT_HOTSET": "1", "MEMFIT_EXPERT_LOOKAHEAD": "1",
                            "MEMFIT_EXPERT_POLICY": "decay"},
    # issue 22's ablation: each row adds one mechanism; the last is the default (look-ahead
    # decided by measurement at run time, coalesced reads, hot set, LRU)
    "a1-lru": {"MEMFIT_EXPERT_HOTSET": "0", "MEMFIT_EXPERT_LOOKAHEAD": "0",
               "MEMFIT_EXPERT_POLICY": "lru", "MEMFIT_COALESCE": "0"},
    "a2-hot": {"MEMFIT_EXPERT_HOTSET": "1", "MEMFIT_EXPERT_LOOKAHEAD": "0",
               "MEMFIT_EXPERT_POLICY": "lru", "MEMFIT_COALESCE": "0"},
    "a3-lookahead": {"MEMFIT_EXPERT_HOTSET": "1", "MEMFIT_EXPERT_LOOKAHEAD": "1",
                     "MEMFIT_EXPERT_POLICY": "lru", "MEMFIT_COALESCE": "0"},
    "a4-coalesce": {"MEMFIT_EXPERT_HOTSET": "1", "MEMFIT_EXPERT_LOOKAHEAD": "1",
                    "MEMFIT_EXPERT_POLICY": "lru", "MEMFIT_COALESCE": "1"},
    "a5-decided": {"MEMFIT_EXPERT_HOTSET": "1", "MEMFIT_EXPERT_POLICY": "lru", "MEMFIT_COALESCE": "1"},
    # every MoE layer op by op (no fused MoE decode layer, in place or streamed)
    "nofused": {"MEMFIT_FUSED_MOE": "0"},
    # the streamed layer without the store's expert table (every layer asks get_experts and
    # passes each expert's buffers; the look-ahead in Python): the path before session 25
    "notable": {"MEMFIT_EXPERT_TABLE": "0"},
    # the table, but a layer with misses waits for them before running any expert
    "nooverlap": {"MEMFIT_EXPERT_OVERLAP": "0"},
    # the look-ahead forced on / off (the default decides by measurement)
    "lookahead": {"MEMFIT_EXPERT_LOOKAHEAD": "1"},
    "nolookahead": {"MEMFIT_EXPERT_LOOKAHEAD": "0"},
}


def commit() -> str:
    p = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", HERE, "status", "--porcelain", "--", "../src"],
                           capture_output=True, text=True).stdout.strip()
    return p.stdout.strip() + ("+dirty" if dirty else "")


def run_limited(limit: int | None, cmd: list[str], timeout: float, env: dict) -> dict:
    """cmd in a fresh cgroup (limit None: 1 TiB, i.e. only the machine's RAM), cold cache."""
    full = ["timeout", "-s", "KILL", str(int(timeout)), os.path.join(HERE, "in_cgroup.sh"),
            str(limit or (1 << 40))] + cmd
    t0 = time.time()
    p = subprocess.run(full, capture_output=True, text=True,
                       env=dict(os.environ, DROP_CACHES="1", **env))
    rec = {"rc": p.returncode, "wall_s": round(time.time() - t0, 1), "tests": []}
    for ln in p.stdout.splitlines():
        if ln.startswith("{"):
            rec["tests"].append(json.loads(ln))
    for ln in p.stderr.splitlines():
        if ln.startswith("# cgroup"):
            kv = dict(x.split("=", 1) for x in ln.split()[3:])
            rec["cgroup_peak_bytes"] = int(kv["peak_usage"]) if kv["peak_usage"].isdigit() else None
            rec["oom_kill"] = int(kv["oom_kill"]) if kv["oom_kill"].isdigit() else None
        if ln.startswith("tg progress:"):
            rec["progress"] = ln
    if p.returncode != 0:
        rec["stderr_tail"] = p.stderr[-1500:]
    return rec


def plan_json(model: str, budget: int | None, ctx: int, env: dict) -> dict | None:
    if budget is None:
        return None
    p = subprocess.run(["memfit", "plan", model, "--mem-budget", str(budget), "--ctx", str(ctx),
                        "--json"], capture_output=True, text=True, env=dict(os.environ, **env))
    if p.returncode != 0:
        return {"error": p.stderr[-500:]}
    d = json.loads(p.stdout)
    keep = ("budget_bytes", "min_budget_bytes", "expert_slots", "expected_hit_rate", "hot_bytes",
            "hot_coverage", "expert_policy", "mem_bytes_per_token", "disk_bytes_per_token",
            "mem_read_bytes_per_s", "disk_read_bytes_per_s", "bandwidth_source",
            "predicted_tg_tokens_per_s", "expert_bytes", "n_expert", "n_expert_used")
    out = {k: d.get(k) for k in keep}
    out["n_hot_experts"] = len(d.get("hot_experts") or ())
    return out


def bound_at_measured(plan: dict, tg: dict) -> float | None:
    """The plan's bound, t = max(memory bytes / memory rate, disk bytes / disk rate), with the
    disk bytes per token the run measured (its hit rate, its wasted prefetches) instead of the
    plan's uniform-routing guess."""
    if not plan or "error" in plan or not tg.get("bytes_read_per_token"):
        return None
    t_mem = plan["mem_bytes_per_token"] / plan["mem_read_bytes_per_s"]
    t_disk = tg["bytes_read_per_token"] / plan["disk_read_bytes_per_s"]
    return 1.0 / max(t_mem, t_disk)


def quiet_probe(model: str, threads: int, chunk: int = 1 << 20, seed: int = 0) -> dict:
    """The bound's rates measured now, in this process, just before a run: memory as `bench
    --kernels` and `--profile` take it (the best of the read strategies, `threads` threads) and
    the disk as a streamed decode reads it (random O_DIRECT requests of ~1 MB in the experts'
    bytes, the store's requests in flight; memory/bandwidth.py measure_disk_random)."""
    from memfit.gguf.reader import open_gguf
    from memfit.memory.bandwidth import measure_disk_random, read_bound
    from memfit.ops import native
    with open_gguf(model) as g:
        x = [t for t in g.tensors.values() if t.name.endswith("_exps.weight") and t.file_index == 0]
    lo = min((t.offset for t in x), default=0)
    hi = max((t.offset + t.nbytes for t in x), default=None)
    native.set_threads(threads)
    mem, st = read_bound()
    out = {"mem_read_bytes_per_s": mem, "mem_strategy": st}
    try:
        out["disk_random_bytes_per_s"] = measure_disk_random(model, chunk, lo, hi, seed=seed)
        out["disk_request_bytes"] = chunk
    except OSError as e:
        out["disk_error"] = str(e)
    return out


def median_probe(probes: list[dict]) -> dict | None:
    """The probes taken around a run as one: the median of each rate (memory and disk apart),
    and each rate's range."""
    import statistics
    ok = [p for p in probes if "disk_random_bytes_per_s" in p]
    if not ok:
        return probes[0] if probes else None
    out = {"n_probes": len(ok)}
    for k in ("mem_read_bytes_per_s", "disk_random_bytes_per_s"):
        v = [p[k] for p in ok]
        out[k] = statistics.median(v)
        out[k + "_range"] = [min(v), max(v)]
    return out


def bound_at_probe(plan: dict, probe: dict, tg: dict, serial: bool = False) -> float | None:
    """bound_at_measured with the quiet probe's rates instead of the plan's cached ones.
    serial: the misses read on demand cannot overlap the compute (a miss is known only once its
    layer has routed, and the layer's output waits for it): t = max(memory bytes / memory rate
    + demand bytes / disk rate, all bytes read / disk rate), what a decode can reach without
    predicting its misses; the plain bound is what perfect prediction would allow."""
    if not plan or "error" in plan or not probe or "disk_random_bytes_per_s" not in probe \
            or not tg.get("bytes_read_per_token") \
            or (serial and "expert_demand_bytes_per_token" not in tg):
        return None
    disk = probe["disk_random_bytes_per_s"]
    t = plan["mem_bytes_per_token"] / probe["mem_read_bytes_per_s"]  # the memory's time
    if serial:
        t += tg["expert_demand_bytes_per_token"] / disk
    return 1.0 / max(t, tg["bytes_read_per_token"] / disk)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--runs", required=True, help="side:fraction[:variant],... (fraction or none)")
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=16)
    ap.add_argument("--peer-n", type=int, default=8, help="llama.cpp tg tokens")
    ap.add_argument("--peer-p", type=int, default=None, help="llama.cpp pp tokens (default -p)")
    ap.add_argument("--peer-max-seconds", type=float, default=150.0)
    ap.add_argument("--peer-no-warmup", action="store_true",
                    help="llama.cpp: no warm-up (in a tight limit each pp batch re-reads the file)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--budget-share", type=float, default=0.96, help="memfit budget / cgroup limit")
    ap.add_argument("--parallel", default=None, metavar="N[,N...]",
                    help="memfit: aggregate decode of N sequences at once (bench --parallel; the "
                         "batch union of experts)")
    ap.add_argument("--no-probe", action="store_true",
                    help="memfit in a limit: no quiet probe of memory and random expert reads before "
                         "the run (the bound then comes from the plan's cached rates only)")
    ap.add_argument("--probes", type=int, default=3,
                    help="quiet probes around each memfit run in a limit: half (rounded up) "
                         "before, the rest after; the bound takes the median rates, and each "
                         "probe's own bound is kept (default 3)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    size = os.path.getsize(a.model)
    for spec in a.runs.split(","):
        side, frac, *var = spec.split(":")
        variant = var[0] if var else "default"
        f = None if frac == "none" else float(frac)
        limit = None if f is None else int(f * size)
        env = VARIANTS[variant]
        plan = None
        if side == "memfit":
            budget = None if limit is None else int(limit * a.budget_share)
            plan = plan_json(a.model, budget, a.n_prompt + a.n_gen + 8, env)
            cmd = ["memfit", "bench", a.model, "-p", str(a.n_prompt), "-n", str(a.n_gen), "-r", "1",
                   "-t", str(a.threads), "--json"] + ([] if budget is None else ["--mem-budget", str(budget)]) + (
                       ["--parallel", a.parallel] if a.parallel else [])
        else:
            pp = a.n_prompt if a.peer_p is None else a.peer_p
            cmd = [PEER_PY, os.path.join(HERE, "peer_llamacpp.py"), a.model, "-p", str(pp),
                   "-n", str(a.peer_n), "-r", "1", "-t", str(a.threads),
                   "--repack", "1" if side == "llama.cpp-repack" else "0",
                   "--max-seconds", str(a.peer_max_seconds), "--json"] + (
                       ["--no-warmup"] if a.peer_no_warmup else [])
        probes = []
        probing = side == "memfit" and limit is not None and not a.no_probe
        n_before = (a.probes + 1) // 2 if probing else 0
        for i in range(n_before):
            subprocess.run(["sync"])
            probes.append(quiet_probe(a.model, a.threads, seed=len(probes)))
        load0 = round(os.getloadavg()[0], 2)
        t0 = time.strftime("%H:%M:%S", time.gmtime())
        rec = run_limited(limit, cmd, a.timeout, env)
        for i in range(a.probes - n_before if probing else 0):
            probes.append(quiet_probe(a.model, a.threads, seed=len(probes)))
        probe = median_probe(probes)
        rec.update(side=side, fraction=f, variant=variant, env=env, limit_bytes=limit,
                   model_bytes=size, model=os.path.basename(a.model), commit=commit(),
                   start_utc=t0, load1_before=load0, load1_after=round(os.getloadavg()[0], 2),
                   tag=a.tag, plan=plan)
        tg = next((t for t in rec["tests"] if t["test"].startswith("tg")), None)
        if tg and plan:
            rec["bound_tg_tokens_per_s"] = bound_at_measured(plan, tg)
        if probe:
            rec["probe"] = probe
            rec["probes"] = probes
            if tg:
                rec["bound_tg_probe_tokens_per_s"] = bound_at_probe(plan, probe, tg)
                rec["bound_tg_probe_serial_tokens_per_s"] = bound_at_probe(plan, probe, tg, serial=True)
                each = [b for b in (bound_at_probe(plan, p, tg) for p in probes) if b]
                if each:
                    rec["bound_tg_probe_each"] = each
        with open(a.out, "a") as fh:
            fh.write(json.dumps(rec) + "\n")
        summ = "; ".join(f"{t['test']} {t['tokens_per_s']}" + (
            f" hit {t.get('expert_hit_rate', 0):.2f} recall {t.get('prefetch_recall', 0):.2f}"
            f" stall {1e3 * t.get('io_stall_per_token_s', 0):.1f} ms/token"
            f" (misses {1e3 * t.get('io_stall_demand_per_token_s', 0):.1f},"
            f" prefetches {1e3 * t.get('io_stall_prefetch_per_token_s', 0):.1f})"
            if "expert_hit_rate" in t else "") for t in rec["tests"])
        print(f"# {t0} {side} {frac} {variant}: {summ}; rc {rec['rc']} oom {rec.get('oom_kill')} "
              f"peak {rec.get('cgroup_peak_bytes')} wall {rec['wall_s']} s load {load0}"
              + (f" bound {rec['bound_tg_tokens_per_s']:.3f}" if rec.get("bound_tg_tokens_per_s") else "")
              + (f" probe bound {rec['bound_tg_probe_tokens_per_s']:.3f} "
                 f"[{min(rec.get('bound_tg_probe_each') or [0]):.3f}-"
                 f"{max(rec.get('bound_tg_probe_each') or [0]):.3f} over {len(probes)} probes] (mem "
                 f"{probe['mem_read_bytes_per_s'] / 1e9:.1f} GB/s, random reads "
                 f"{probe['disk_random_bytes_per_s'] / 1e9:.2f} GB/s)"
                 if rec.get("bound_tg_probe_tokens_per_s") else "")
              + (f" serial-miss bound {rec['bound_tg_probe_serial_tokens_per_s']:.3f}"
                 if rec.get("bound_tg_probe_serial_tokens_per_s") else ""),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
