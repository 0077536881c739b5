"""Sliding-window KV bounded by the window (kv/manager.py WindowBlocks): KV bytes reserved
before (every layer holds the whole context, masked) and after, and the blocks a real run uses.

    python benchmarks/swa_kv.py plan gpt-oss-20b.gguf [--ctx 8192 32768]
    python benchmarks/swa_kv.py run [gemma3-270m|PATH] [--prompt 2000] [--gen 16] [--ctx 4096]

``plan``: the plan's KV line (memory/planner.py: what the ledger reserves) at each context,
with the window group (after) and without (before, the old layout's formula), and the bytes
the engine's pool allocates for that file's layout (no weights are loaded).
``run``: one greedy request with a long prompt, window group off then on (the same process,
the same model): pool bytes, the most blocks each group had in use, tokens equal, seconds.
One JSON line per measurement on stdout.
"""

from __future__ import annotations

import argparse
import json
import time


def plan(path: str, ctxs: list[int], n_batch: int) -> None:
    from memfit.gguf import open_gguf
    from memfit.kv.pool import KVPool
    from memfit.kv.storage import kv_layout, kv_pool_blocks
    from memfit.memory.planner import ModelDesc
    from memfit.models import config_from_gguf
    f = open_gguf(path)
    m = ModelDesc.from_gguf(f)
    L = kv_layout(config_from_gguf(f))
    for ctx in ctxs:
        before = m.kv_pool_bytes(ctx, 1, n_batch, window_group=False)
        after = m.kv_pool_bytes(ctx, 1, n_batch)
        pool = KVPool.of(L, kv_pool_blocks(ctx, 1), n_blocks_swa=L.swa_blocks(ctx, 1, n_batch))
        print(json.dumps({"file": path, "arch": m.arch, "n_ctx": ctx, "n_batch": n_batch,
                          "swa_layers": len(L.swa_layers), "n_layer": L.n_layer,
                          "window": L.window, "kv_mib_before": before / 2**20,
                          "kv_mib_after": after / 2**20, "pool_mib_after": pool.nbytes / 2**20,
                          "swa_blocks": pool.n_swa_blocks, "full_blocks": pool.n_blocks}))
        del pool
    f.close()


def run(model: str, n_prompt: int, n_gen: int, ctx: int) -> None:
    import numpy as np

    import memfit
    from memfit.engine.engine import Engine
    from memfit.engine.sampler import SamplingParams
    with memfit.load(model, n_ctx=ctx, spec="off") as m:
        rng = np.random.default_rng(0)
        ids = [int(x) for x in rng.integers(100, m.tokenizer.n_vocab - 100, size=n_prompt)]
        outs = {}
        for window_kv in (False, True):
            eng = Engine(m.model, m.tokenizer, ctx, 1, m.n_batch, window_kv=window_kv)
            eng.add_request(ids, SamplingParams(temperature=0, max_tokens=n_gen), ignore_eos=True)
            t0, toks, used, swa_used = time.perf_counter(), [], 0, 0
            while eng.has_unfinished():
                for o in eng.step():
                    if o.token is not None:
                        toks.append(o.token)
                used = max(used, eng.pool.n_used)
                swa_used = max(swa_used, eng.pool.n_swa_used)
            outs[window_kv] = toks
            p = eng.pool
            print(json.dumps({"model": str(m.path.name), "n_ctx": ctx, "n_batch": m.n_batch,
                              "prompt": n_prompt, "gen": n_gen, "window_kv": window_kv,
                              "pool_mib": p.nbytes / 2**20, "full_blocks": p.n_blocks,
                              "full_blocks_used_max": used, "swa_blocks": p.n_swa_blocks,
                              "swa_blocks_used_max": swa_used,
                              "seconds": round(time.perf_counter() - t0, 2)}))
        print(json.dumps({"tokens_equal": outs[False] == outs[True]}))


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("path")
    p.add_argument("--ctx", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--n-batch", type=int, default=512)
    r = sub.add_parser("run")
    r.add_argument("model", nargs="?", default="gemma3-270m")
    r.add_argument("--prompt", type=int, default=2000)
    r.add_argument("--gen", type=int, default=16)
    r.add_argument("--ctx", type=int, default=4096)
    a = ap.parse_args()
    if a.cmd == "plan":
        plan(a.path, a.ctx, a.n_batch)
    else:
        run(a.model, a.prompt, a.gen, a.ctx)


if __name__ == "__main__":
    main()
