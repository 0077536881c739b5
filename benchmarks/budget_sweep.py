"""Decode tokens/s against memory budget, memfit vs llama.cpp, cold cache (never run in CI).

    sudo python benchmarks/budget_sweep.py /tmp/bench/qwen2-7b.gguf \
        --fractions 1.0,0.8,0.6,0.45,0.35,0.3 -n 8 --out benchmarks/budget_sweep

For each fraction f of the model file size: a cgroup memory limit L = f * size
(benchmarks/in_cgroup.sh, page cache charged, caches dropped first); memfit runs
`bench -p 0 -n N -r 1 --mem-budget 0.96*L` inside it, llama.cpp (mmap, repack 0, its run capped
by --peer-max-seconds) inside the same limit. Results: OUT.jsonl (one line per run), a
Markdown table on stdout, OUT.png (matplotlib; falls back to the peer interpreter for it).
`--plot-from OUT.jsonl` only redraws the plot and the table.
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
GIB = 1 << 30


def run_limited(limit: int, cmd: list[str], timeout: float) -> dict:
    """Run cmd in a fresh cgroup of `limit` bytes, cold cache; parse its last JSON line."""
    full = ["timeout", "-s", "KILL", str(int(timeout)), os.path.join(HERE, "in_cgroup.sh"),
            str(limit)] + cmd
    t0 = time.time()
    p = subprocess.run(full, capture_output=True, text=True, env=dict(os.environ, DROP_CACHES="1"))
    rec = {"rc": p.returncode, "wall_s": round(time.time() - t0, 1)}
    for ln in p.stdout.splitlines():
        if ln.startswith("{"):
            rec.update(json.loads(ln))
    for ln in p.stderr.splitlines():
        if ln.startswith("# cgroup"):
            kv = dict(x.split("=", 1) for x in ln.split()[3:])
            rec["cgroup_peak_bytes"] = int(kv["peak_usage"]) if kv["peak_usage"].isdigit() else None
            rec["oom_kill"] = int(kv["oom_kill"]) if kv["oom_kill"].isdigit() else None
        if ln.startswith("tg progress:"):
            rec["progress"] = ln  # llama.cpp: how far a capped/killed run got
    if "tokens_per_s" not in rec:
        rec["tokens_per_s"] = None
    return rec


def _group(rows: list[dict]) -> dict:
    """(side, fraction) -> records; a JSONL may hold several sweeps (repeat runs)."""
    g: dict = {}
    for r in rows:
        g.setdefault((r["side"], r["fraction"]), []).append(r)
    return g


def _median(xs):
    xs = sorted(xs)
    return None if not xs else (xs[len(xs) // 2] if len(xs) % 2 else
                                (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2)


def table(rows: list[dict]) -> str:
    """Markdown: per fraction, median tok/s of each side (all runs in brackets), ratio."""
    g = _group(rows)
    out = ["| budget (fraction of file) | cgroup limit | memfit tok/s | memfit max peak RSS | "
           "llama.cpp tok/s | memfit / llama.cpp | OOM kills (memfit, llama.cpp) |",
           "|---|---|---|---|---|---|---|"]
    for f in sorted({k[1] for k in g}, reverse=True):
        m, l = g.get(("memfit", f), []), g.get(("llama.cpp", f), [])
        lim = (m or l)[0]["limit_bytes"]

        def cell(rs):
            v = [r["tokens_per_s"] for r in rs if r.get("tokens_per_s")]
            if not v:
                return "—", None
            md = _median(v)
            runs = f" ({', '.join(f'{x:.3f}' for x in v)})" if len(v) > 1 else ""
            return f"{md:.3f}{runs}", md
        mc, mm = cell(m)
        lc, lm = cell(l)
        rss = max((r.get("peak_rss_bytes") or 0) for r in m) if m else 0
        ratio = f"{mm / lm:.2f}x" if mm and lm else "—"
        ooms = (sum(r.get("oom_kill") or 0 for r in m), sum(r.get("oom_kill") or 0 for r in l))
        out.append(f"| {f:.0%} | {lim / GIB:.2f} GiB | {mc} | "
                   f"{rss / GIB:.2f} GiB | {lc} | {ratio} | {ooms[0]}, {ooms[1]} |")
    return "\n".join(out)


def plot(rows: list[dict], png: str, logy: bool = False, title: str | None = None) -> None:
    try:
        import matplotlib
    except ImportError:
        jl = png[:-4] + ".jsonl"
        subprocess.run([PEER_PY, os.path.abspath(__file__), "--plot-from", jl], check=True,
                       stdout=subprocess.DEVNULL)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    g = _group(rows)
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for side, mk, col in (("memfit", "o-", "C0"), ("llama.cpp", "s--", "C1")):
        fr = sorted(f for s_, f in g if s_ == side)
        xs, ys = [], []
        for f in fr:
            v = [r["tokens_per_s"] for r in g[(side, f)] if r.get("tokens_per_s")]
            lim = g[(side, f)][0]["limit_bytes"] / GIB
            if v:
                xs.append(lim)
                ys.append(_median(v))
                ax.scatter([lim] * len(v), v, s=12, color=col, alpha=0.4)
        if xs:
            ax.plot(xs, ys, mk, color=col, label=f"{side} (median; dots: runs)")
    size = rows[0]["model_bytes"] / GIB
    ax.axvline(size, color="grey", lw=0.8, ls=":")
    ax.text(size, ax.get_ylim()[1] * (0.7 if logy else 0.95), " model file", color="grey", fontsize=8, va="top")
    ax.set_xlabel("memory limit (cgroup), GiB")
    ax.set_ylabel("decode tokens/s (cold cache)" + (", log scale" if logy else ""))
    if logy:  # MoE: llama.cpp's in-limit decode is ~30x below memfit's
        ax.set_yscale("log")
    ax.set_title(title or f"{rows[0]['model']}: decode vs memory budget, 2 threads", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)
    print(f"wrote {png}", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--fractions", default="1.0,0.8,0.6,0.45,0.35,0.3")
    ap.add_argument("-n", "--n-gen", type=int, default=8)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--sides", default="memfit,llama.cpp")
    ap.add_argument("--peer-max-seconds", type=float, default=60.0)
    ap.add_argument("--timeout", type=float, default=420.0, help="per run, seconds (SIGKILL)")
    ap.add_argument("--out", default=os.path.join(HERE, "budget_sweep"))
    ap.add_argument("--plot-from", help="only redraw the plot and the table from a JSONL file")
    a = ap.parse_args(argv)

    if a.plot_from:
        rows = [json.loads(ln) for ln in open(a.plot_from) if ln.strip()]
        print(table(rows))
        plot(rows, a.plot_from[:-6] + ".png")
        return 0
    if not a.model:
        ap.error("MODEL is required")
    size = os.path.getsize(a.model)
    rows = []
    jl = a.out + ".jsonl"
    with open(jl, "a") as f:
        for frac in [float(x) for x in a.fractions.split(",")]:
            limit = int(frac * size)
            for side in a.sides.split(","):
                if side == "memfit":
                    cmd = ["memfit", "bench", a.model, "-p", "0", "-n", str(a.n_gen), "-r", "1",
                           "-t", str(a.threads), "--mem-budget", str(int(limit * 0.96)), "--json"]
                else:
                    cmd = [PEER_PY, os.path.join(HERE, "peer_llamacpp.py"), a.model, "-p", "0",
                           "-n", str(a.n_gen), "-r", "1", "-t", str(a.threads), "--repack", "0",
                           "--max-seconds", str(a.peer_max_seconds), "--json"]
                rec = run_limited(limit, cmd, a.timeout)
                rec.update(side=side, fraction=frac, limit_bytes=limit, model_bytes=size,
                           model=os.path.basename(a.model), load1=round(os.getloadavg()[0], 2),
                           omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"))
                rows.append(rec)
                f.write(json.dumps(rec) + "\n")
                f.flush()
                print(f"# {frac:.0%} {side}: {rec.get('tokens_per_s')} tok/s, rc {rec['rc']}, "
                      f"{rec['wall_s']} s, load {rec['load1']}", file=sys.stderr, flush=True)
    print(table(rows))
    plot(rows, a.out + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
