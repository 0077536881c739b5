"""Load an OpenAI-compatible server (memfit serve or llama-server) with C concurrent streaming
clients; report aggregate generated tokens/s and p50/p99 time to first token and inter-token
latency per concurrency level. Never run in CI.

    python benchmarks/serve_bench.py --url http://127.0.0.1:8080 -c 1 4 16 -r 32 -n 64 --json

Each client sends streamed /v1/completions requests one after another until R requests per
level are done. TTFT is measured from sending to the first chunk with text; ITL is the gap
between consecutive text chunks of one request (both servers send one chunk per token).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import time

import httpx

PROMPTS = [f"Write a short story about a robot named Unit-{i} who learns to paint." for i in range(64)]


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


LOGPROBS = False


async def one(h: httpx.AsyncClient, url: str, prompt: str, n: int, ttft: list, itl: list) -> int:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if LOGPROBS:
        body["logprobs"] = 1
    t0 = time.perf_counter()
    last = None
    tokens = 0
    async with h.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("usage"):
                tokens = d["usage"]["completion_tokens"]
            ch = d.get("choices")
            if ch and (ch[0].get("text") or (LOGPROBS and ch[0].get("logprobs"))):
                now = time.perf_counter()
                if last is None:
                    ttft.append(now - t0)
                else:
                    itl.append(now - last)
                last = now
    return tokens


async def level(url: str, clients: int, requests: int, n: int) -> dict:
    ttft, itl, todo, retries = [], [], list(range(requests)), [0]
    total = 0
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=clients)) as h:
        async def client():
            nonlocal total
            while todo:
                i = todo.pop()
                for attempt in range(3):  # llama-server (cpp-httplib) may close an idle
                    try:                    # keep-alive connection as the next request goes out
                        got = await one(h, url, PROMPTS[i % len(PROMPTS)], n, ttft, itl)
                        break
                    except httpx.RemoteProtocolError:
                        retries[0] += 1
                else:
                    raise RuntimeError(f"request {i}: 3 disconnects in a row")
                total += got  # not `total += await ...`: that reads total before awaiting
        t0 = time.perf_counter()
        await asyncio.gather(*[client() for _ in range(clients)])
        dt = time.perf_counter() - t0
    return {"clients": clients, "requests": requests, "max_tokens": n, "seconds": round(dt, 3),
            "tokens": total, "tokens_per_s": round(total / dt, 2),
            "ttft_p50_ms": round(pct(ttft, 50) * 1e3, 1), "ttft_p99_ms": round(pct(ttft, 99) * 1e3, 1),
            "itl_p50_ms": round(pct(itl, 50) * 1e3, 1), "itl_p99_ms": round(pct(itl, 99) * 1e3, 1),
            "itl_mean_ms": round(statistics.fmean(itl) * 1e3, 1) if itl else None,
            "retries": retries[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("-c", "--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("-r", "--requests", type=int, default=32, help="requests per level")
    ap.add_argument("-n", "--max-tokens", type=int, default=64)
    ap.add_argument("--label", default="")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--logprobs", action="store_true", help="time chunks with logprobs too")
    a = ap.parse_args()
    global LOGPROBS
    LOGPROBS = a.logprobs
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    asyncio.run(level(a.url, 1, 2, 4))  # warm-up
    for c in a.clients:
        r = asyncio.run(level(a.url, c, max(a.requests, c), a.max_tokens))
        r.update(label=a.label, commit=commit, logprobs=a.logprobs, load1=round(os.getloadavg()[0], 2),
                 time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        print(json.dumps(r) if a.json else
              f"{a.label} c={c}: {r['tokens_per_s']} tok/s, TTFT p50 {r['ttft_p50_ms']} ms "
              f"p99 {r['ttft_p99_ms']} ms, ITL p50 {r['itl_p50_ms']} ms p99 {r['itl_p99_ms']} ms",
              flush=True)


if __name__ == "__main__":
    main()
