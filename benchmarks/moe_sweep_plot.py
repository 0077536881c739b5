"""Decode tok/s against the memory limit for the MoE runs of moe_bench.py: table + PNG.

    python benchmarks/moe_sweep_plot.py benchmarks/moe_sweep.jsonl benchmarks/moe_30b.jsonl \
        --tags sweep,item1-round2 --out benchmarks/moe_sweep.png

Takes the tg test of every default-variant run with a fraction (unconstrained runs have none)
from the given JSONL files of benchmarks/moe_bench.py and draws them with budget_sweep.py's
table and plot (matplotlib: any interpreter that has it, e.g. a throwaway venv).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import budget_sweep  # noqa: E402


def rows_from(paths: list[str], tags: set[str]) -> list[dict]:
    rows = []
    for p in paths:
        for ln in open(p):
            r = json.loads(ln)
            if r.get("fraction") is None or r.get("variant", "default") != "default":
                continue
            if tags and r.get("tag") not in tags:
                continue
            tg = next((t for t in r.get("tests", []) if t["test"].startswith("tg")), None)
            rows.append({"side": r["side"], "fraction": r["fraction"], "limit_bytes": r["limit_bytes"],
                         "model_bytes": r["model_bytes"], "model": r["model"],
                         "tokens_per_s": tg["tokens_per_s"] if tg else None,
                         "peak_rss_bytes": tg.get("peak_rss_bytes") if tg else None,
                         "oom_kill": r.get("oom_kill")})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl", nargs="+")
    ap.add_argument("--tags", default="")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    rows = rows_from(a.jsonl, {t for t in a.tags.split(",") if t})
    print(budget_sweep.table(rows))
    budget_sweep.plot(rows, a.out, logy=True, title=f"{rows[0]['model']} (synthetic weights and routing): "
                      "decode vs memory limit, 2 threads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
