"""Ray Serve path (memfit.ray) against plain `memfit serve`, on a workload of conversations.

Configurations, one after another on this machine (SmolLM2-135M Q4_1, --threads 1 and -np 4
per engine, 400 MiB budget each):

- plain:        `memfit serve` (one engine, no Ray)
- ray1:         memfit.ray, 1 replica (prefix-affinity router)
- ray2:         memfit.ray, 2 replicas, prefix-affinity router
- ray2-default: memfit.ray, 2 replicas, Serve's default router (power of two random choices)

Workload: CONVS conversations, each with its own system prompt (~8 KV blocks), TURNS turns
each; CLIENTS clients run the conversations concurrently, one turn at a time per conversation
(each turn appends the previous answer and a new question, so its prompt extends the last
one's: the prefix cache can serve it where that conversation ran before). Streamed requests,
greedy, MAX_TOKENS tokens. Per request: time to first token, latency, tokens. Per configuration:
aggregate completion tokens/s, p50/p99 TTFT, and the prefix-cache hit rate (prompt tokens found
in the cache / prompt tokens looked up, summed over the replicas' engine counters).

    nice python benchmarks/ray_bench.py [--out benchmarks/ray_bench.jsonl]

Raw samples and summaries go to the jsonl, one line each, with the commit.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

CONVS, TURNS, CLIENTS, MAX_TOKENS = 8, 3, 4, 16
ARGS = ["--mem-budget", "900MiB", "--threads", "1", "-np", "4", "-c", "1024"]
TOPICS = ["lighthouses", "bread baking", "bicycle repair", "tide pools", "chess openings",
          "bee keeping", "river kayaking", "star gazing"]


def system_prompt(i: int) -> str:
    t = TOPICS[i % len(TOPICS)]
    return (f"You are a patient expert on {t}. Conversation {i}. " +
            f"Answer questions about {t} in two short sentences, with one concrete tip, "
            f"and never change the subject away from {t}. " * 6)


def run_workload(base: str, model: str, label: str, commit: str, out) -> dict:
    def conversation(i: int) -> list[dict]:
        msgs = [{"role": "system", "content": system_prompt(i)}]
        rows = []
        with httpx.Client(timeout=120) as c:
            for turn in range(TURNS):
                msgs.append({"role": "user", "content": f"Question {turn + 1}: what should a "
                                                        f"beginner know?"})
                body = {"model": model, "messages": msgs, "max_tokens": MAX_TOKENS,
                        "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}}
                t0 = time.perf_counter()
                ttft, text, usage = None, [], {}
                with c.stream("POST", base + "/v1/chat/completions", json=body) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        ev = json.loads(line[6:])
                        if "error" in ev:
                            raise RuntimeError(ev["error"])
                        for ch in ev.get("choices") or []:
                            d = ch["delta"].get("content")
                            if d:
                                if ttft is None:
                                    ttft = time.perf_counter() - t0
                                text.append(d)
                        if ev.get("usage"):
                            usage = ev["usage"]
                lat = time.perf_counter() - t0
                msgs.append({"role": "assistant", "content": "".join(text)})
                rows.append({"config": label, "commit": commit, "conv": i, "turn": turn,
                             "ttft_s": round(ttft if ttft is not None else lat, 4),
                             "latency_s": round(lat, 4),
                             "prompt_tokens": usage.get("prompt_tokens"),
                             "completion_tokens": usage.get("completion_tokens")})
        return rows

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(CLIENTS) as ex:
        rows = [r for rs in ex.map(conversation, range(CONVS)) for r in rs]
    wall = time.perf_counter() - t0
    for r in rows:
        out.write(json.dumps(r) + "\n")
    ttfts = sorted(r["ttft_s"] for r in rows)

    def pct(p):
        return ttfts[min(len(ttfts) - 1, int(round(p / 100 * (len(ttfts) - 1))))]

    toks = sum(r["completion_tokens"] or 0 for r in rows)
    return {"config": label, "commit": commit, "requests": len(rows), "wall_s": round(wall, 2),
            "tokens_per_s": round(toks / wall, 1), "ttft_p50_s": round(pct(50), 4),
            "ttft_p99_s": round(pct(99), 4)}


def overhead(base: str, model: str, label: str, commit: str, out, n: int = 30) -> dict:
    """Per-request cost of the path: n sequential one-token chat requests, median latency."""
    lat = []
    with httpx.Client(timeout=60) as c:
        for i in range(n + 3):
            t0 = time.perf_counter()
            r = c.post(base + "/v1/chat/completions", json={
                "model": model, "max_tokens": 1, "temperature": 0,
                "messages": [{"role": "user", "content": "Hi"}]})
            r.raise_for_status()
            if i >= 3:  # warm-up
                lat.append(time.perf_counter() - t0)
    for v in lat:
        out.write(json.dumps({"config": label, "commit": commit, "phase": "overhead",
                              "latency_s": round(v, 5)}) + "\n")
    lat.sort()
    return {"one_token_p50_ms": round(1000 * lat[len(lat) // 2], 1),
            "one_token_p90_ms": round(1000 * lat[int(len(lat) * 0.9)], 1)}


def plain_counters(base: str) -> tuple[float, float]:
    text = httpx.get(base + "/metrics", timeout=10).text
    vals = {}
    for line in text.splitlines():
        if line.startswith(("memfit_prefix_cache_hits_tokens ",
                            "memfit_prefix_cache_queries_tokens ")):
            k, v = line.split()
            vals[k] = float(v)
    return vals["memfit_prefix_cache_hits_tokens"], vals["memfit_prefix_cache_queries_tokens"]


def ray_counters(base: str) -> tuple[float, float]:
    time.sleep(1.2)  # the replicas report every 0.5 s
    reps = httpx.get(base + "/ray/replicas", timeout=10).json()["replicas"]
    return (sum(r["prefix_cache_hits"] for r in reps if r["live"]),
            sum(r["prefix_cache_queries"] for r in reps if r["live"]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).with_suffix(".jsonl")))
    ap.add_argument("--configs", default="plain,ray1,ray2,ray2-default")
    a = ap.parse_args()
    from memfit.pull import pull
    model_path = str(pull("smollm2-135m", quiet=True))
    model = Path(model_path).name
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    configs = a.configs.split(",")
    summaries = []
    with open(a.out, "a") as out:
        if "plain" in configs:
            from _server import ServerProcess
            s = ServerProcess([model_path, *ARGS])
            try:
                h0, q0 = plain_counters(s.url)
                summ = run_workload(s.url, model, "plain", commit, out)
                h1, q1 = plain_counters(s.url)
                summ["prefix_hit_rate"] = round((h1 - h0) / max(q1 - q0, 1), 3)
                summ.update(overhead(s.url, model, "plain", commit, out))
                summaries.append(summ)
            finally:
                s.stop()
        ray_cfgs = [c for c in configs if c.startswith("ray")]
        if ray_cfgs:
            import memfit.ray as mr
            cfg = mr.plan(mr.args_for(model_path, *ARGS))
            started = mr.start_cluster(None)
            port = mr._free_port("127.0.0.1")
            base = f"http://127.0.0.1:{port}"
            try:
                for label in ray_cfgs:
                    n = 2 if label.startswith("ray2") else 1
                    router = "default" if label.endswith("default") else "prefix"
                    mr.deploy(mr.application(cfg, n, router=router), "127.0.0.1", port, 240)
                    h0, q0 = ray_counters(base)
                    summ = run_workload(base, model, label, commit, out)
                    h1, q1 = ray_counters(base)
                    summ["prefix_hit_rate"] = round((h1 - h0) / max(q1 - q0, 1), 3)
                    if label == "ray1":
                        summ.update(overhead(base, model, label, commit, out))
                    summaries.append(summ)
                    from ray import serve
                    serve.delete(mr.APP_NAME)
            finally:
                mr.stop(started)
        for summ in summaries:
            summ["summary"] = True
            summ["machine"] = f"{os.cpu_count()} CPUs, shared with other engineers' jobs"
            out.write(json.dumps(summ) + "\n")
    for summ in summaries:
        print(json.dumps(summ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
