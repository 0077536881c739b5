"""llama-bench-style throughput: pp (prefill of N random ids) and tg (N single-token decodes
from an empty context), each repeated r times after one warm-up, median and spread reported.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class BenchResult:
    model: str
    test: str  # "pp512" | "tg128"
    threads: int
    samples: list[float] = field(default_factory=list)  # tokens/s per repetition
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return statistics.median(self.samples)

    @property
    def stdev(self) -> float:
        return statistics.stdev(self.samples) if len(self.samples) > 1 else 0.0

    def to_dict(self) -> dict:
        d = {"model": self.model, "test": self.test, "threads": self.threads,
             "tokens_per_s": round(self.tokens_per_s, 3),
             "samples": [round(s, 3) for s in self.samples]}
        d.update(self.extra)
        return d


def _cache(model, pool, n: int):
    """One sequence of n tokens: on pool (the engine's, in the ledger) when given."""
    from ..kv.seq import SeqKV
    return SeqKV(pool, n) if pool is not None else model.new_cache(n)


def prompt_pieces(pool, n: int, n_batch: int | None) -> int:
    """Rows per forward for an n-token prompt: all at once, except on a pool whose
    sliding-window group holds steps of at most the engine's n_batch rows (kv/pool.py), where
    the prompt goes in n_batch pieces (as llama-bench's ubatches)."""
    if pool is not None and pool.swa is not None and n_batch:
        return max(1, min(n, n_batch))
    return max(1, n)


def _pp(model, ids: np.ndarray, pool=None, n_batch: int | None = None) -> float:
    step = prompt_pieces(pool, len(ids), n_batch)
    with _cache(model, pool, len(ids) + 1) as cache:
        t0 = time.perf_counter()
        for b in range(0, len(ids), step):
            model.forward(ids[b:b + step], cache)
        return len(ids) / (time.perf_counter() - t0)


def _tg(model, ids: np.ndarray, pool=None, n_batch: int | None = None) -> float:
    with _cache(model, pool, len(ids) + 1) as cache:
        t0 = time.perf_counter()
        for i in range(len(ids)):
            model.forward(ids[i:i + 1], cache)
        return len(ids) / (time.perf_counter() - t0)


def run_bench(model, name: str, n_vocab: int, n_prompt: int = 512, n_gen: int = 128,
              reps: int = 5, threads: int = 1, seed: int = 0, progress: bool = True,
              on_result=None, pool=None, n_batch: int | None = None) -> list[BenchResult]:
    """Measure pp{n_prompt} and tg{n_gen} (in blocks of ``pool``, the engine's KV pool, when
    given, whose n_batch is ``n_batch``: prompt_pieces); ``on_result(BenchResult)`` after each
    test."""
    rng = np.random.default_rng(seed)
    out = []
    for kind, n, fn in (("pp", n_prompt, _pp), ("tg", n_gen, _tg)):
        if n <= 0:
            continue
        res = BenchResult(name, f"{kind}{n}", threads)
        for r in range(reps + 1):  # first run is the warm-up
            ids = rng.integers(0, n_vocab, size=n, dtype=np.int32)
            tps = fn(model, ids, pool, n_batch)
            if progress:
                what = "warm-up" if r == 0 else f"rep {r}/{reps}"
                print(f"  {kind}{n} {what}: {tps:.2f} tok/s", file=sys.stderr, flush=True)
            if r > 0:
                res.samples.append(tps)
        out.append(res)
        if on_result:
            on_result(res)
    return out


def _tg_parallel(engine, n_vocab: int, n_par: int, n_prompt: int, n_gen: int, rng) -> tuple:
    """llama-batched-bench's S_TG: n_par sequences of n_prompt random ids prefilled, then
    n_gen decode steps with all of them in every step. (aggregate tokens/s, prefill tokens/s)."""
    from ..engine.sampler import SamplingParams
    p = SamplingParams(temperature=0, max_tokens=n_gen + n_par)
    t0 = time.perf_counter()
    rids = [engine.add_request(rng.integers(0, n_vocab, size=max(n_prompt, 1)).tolist(), p,
                               ignore_eos=True) for _ in range(n_par)]
    while any(engine.sequence(r).n_pending > 1 for r in rids):
        engine.step()
    t1 = time.perf_counter()
    for _ in range(n_gen):
        outs = engine.step()
        assert len(outs) == n_par
    t2 = time.perf_counter()
    for r in rids:
        engine.abort(r)
    engine.step()  # deliver the abort notices
    return n_par * n_gen / (t2 - t1), n_par * max(n_prompt, 1) / (t1 - t0)


def run_bench_parallel(engine, name: str, n_vocab: int, parallel: list[int], n_prompt: int = 512,
                       n_gen: int = 128, reps: int = 5, threads: int = 1, seed: int = 0,
                       progress: bool = True, on_result=None) -> list[BenchResult]:
    """For each N of ``parallel``: N sequences decoding together (test tg{n_gen}, extra
    ``parallel``: N); tokens_per_s is the aggregate over the N sequences."""
    rng = np.random.default_rng(seed)
    out = []
    for n_par in parallel:
        res = BenchResult(name, f"tg{n_gen}", threads, extra={"parallel": n_par,
                                                              "n_prompt": n_prompt})
        pps = []
        for r in range(reps + 1):
            tps, pp = _tg_parallel(engine, n_vocab, n_par, n_prompt, n_gen, rng)
            if progress:
                what = "warm-up" if r == 0 else f"rep {r}/{reps}"
                print(f"  tg{n_gen} x{n_par} {what}: {tps:.2f} tok/s", file=sys.stderr, flush=True)
            if r > 0:
                res.samples.append(tps)
                pps.append(pp)
        res.extra["pp_tokens_per_s"] = round(statistics.median(pps), 3)
        out.append(res)
        if on_result:
            on_result(res)
    return out


def markdown_table(results: list[BenchResult], backend: str) -> str:
    """llama-bench's table, plus peak RSS and, under a memory budget, the budget, the bytes
    the weight store has read so far and its time stalled on I/O (from ``extra``)."""
    from ..memory.budget import format_size
    budget = any("mem_budget_bytes" in r.extra for r in results)
    experts = any("expert_hit_rate" in r.extra for r in results)
    par = any("parallel" in r.extra for r in results)
    head = "| model | backend | threads | test |" + (" parallel |" if par else "") + " t/s | peak RSS |"
    rule = "|---|---|---:|---:|" + ("---:|" if par else "") + "---:|---:|"
    if budget:
        head += " budget | read from disk | I/O stall |"
        rule += "---:|---:|---:|"
    if experts:
        head += " read/token | expert hits | prefetch recall | wasted prefetch | stall/token (on misses) |"
        rule += "---:|---:|---:|---:|---:|"
    rows = [head, rule]
    for r in results:
        e = r.extra
        rss = format_size(e["peak_rss_bytes"]) if "peak_rss_bytes" in e else "?"
        row = (f"| {r.model} | {backend} | {r.threads} | {r.test} | "
               + (f"{e.get('parallel', 1)} | " if par else "")
               + f"{r.tokens_per_s:.2f} ± {r.stdev:.2f} | {rss} |")
        if budget:
            row += (f" {format_size(e.get('mem_budget_bytes', 0))} |"
                    f" {format_size(e.get('bytes_read', 0))} | {e.get('io_stall_s', 0.0):.2f} s |")
        if experts:
            row += (f" {format_size(int(e.get('bytes_read_per_token', 0)))} |"
                    f" {e.get('expert_hit_rate', 0.0):.0%} | {e.get('prefetch_recall', 0.0):.0%} |"
                    f" {format_size(e.get('prefetch_wasted_bytes', 0))} |"
                    f" {1e3 * e.get('io_stall_per_token_s', 0.0):.1f} ms"
                    f" ({1e3 * e.get('io_stall_demand_per_token_s', 0.0):.1f}) |")
        rows.append(row)
    return "\n".join(rows)
