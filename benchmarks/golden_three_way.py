"""Three-way distance on the golden greedy cases: memfit, llama.cpp built on this machine, and
the goldens (llama.cpp on an AVX-512 machine). Each is teacher-forced on the golden ids (the
prompt as one batch, then one decode per id) and the probability it gives the golden token at
each of 32 steps is compared pairwise. If memfit had a systematic error it would sit further
from both llama.cpp builds than they sit from each other. Never run in CI.

    /root/peer-venv/bin/python benchmarks/golden_three_way.py --dump-peer /tmp/peer.json
    python benchmarks/golden_three_way.py --compare /tmp/peer.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

GOLDEN = os.environ.get("MEMFIT_GOLDEN") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "golden")
MODELS = {"SmolLM2-135M-Instruct.Q4_1": "smollm2-135m", "gemma-3-270m-q4_k_m": "gemma3-270m"}
STEPS = 32


def _cases(stem: str) -> list[dict]:
    with open(os.path.join(GOLDEN, f"greedy_{stem}.jsonl")) as f:
        return [json.loads(line) for line in f]


def dump_peer(out_path: str, models_dir: str) -> None:
    """In the peer venv: llama.cpp's probability of each golden id, per case and step."""
    import llama_cpp as L
    from golden_peer import Peer  # same folder (run as a script)
    from peer_llamacpp import _quiet_logs
    keep = _quiet_logs(L)  # noqa: F841 (the callback must stay alive)
    L.llama_backend_init()
    out = {}
    for stem in MODELS:
        p = Peer(L, os.path.join(models_dir, stem + ".gguf"), repack=False)
        out[stem] = []
        for c in _cases(stem):
            forced = [s["id"] for s in c["steps"][:STEPS]]
            probs = p.stepwise(c["prompt_ids"], forced)
            out[stem].append([float(pr[g]) for pr, g in zip(probs, forced)])
        p.close()
    with open(out_path, "w") as f:
        json.dump(out, f)


def compare(peer_path: str) -> None:
    import memfit
    with open(peer_path) as f:
        peer = json.load(f)
    for stem, name in MODELS.items():
        d = {"memfit-peer": [], "memfit-golden": [], "peer-golden": []}
        with memfit.load(name) as m:
            for ci, c in enumerate(_cases(stem)):
                forced = [s["id"] for s in c["steps"][:STEPS]]
                cache = m.model.new_cache(len(c["prompt_ids"]) + STEPS + 1)
                logits = m.model.forward(c["prompt_ids"], cache)
                for k, g in enumerate(forced):
                    z = logits.astype(np.float64)
                    e = np.exp(z - z.max())
                    pm, pp = e[g] / e.sum(), peer[stem][ci][k]
                    d["memfit-peer"].append(abs(pm - pp))
                    top = c["steps"][k]["top5"][0]
                    if top[0] == g:  # the golden reports its own chosen token's probability
                        d["memfit-golden"].append(abs(pm - top[1]))
                        d["peer-golden"].append(abs(pp - top[1]))
                    if k + 1 < len(forced):
                        logits = m.model.forward([g], cache)
        for pair, v in d.items():
            v = np.array(v)
            print(f"{stem:28s} {pair:14s} |dp| median {np.median(v):.4f}  p90 "
                  f"{np.quantile(v, 0.9):.4f}  max {v.max():.4f}  <= 0.05: {np.mean(v <= 0.05):.1%}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--dump-peer", metavar="OUT.json")
    g.add_argument("--compare", metavar="PEER.json")
    ap.add_argument("--models-dir", default=os.path.expanduser("~/.cache/memfit/models"))
    a = ap.parse_args(argv)
    if a.dump_peer:
        dump_peer(a.dump_peer, a.models_dir)
    else:
        compare(a.compare)
    return 0


if __name__ == "__main__":
    sys.exit(main())
