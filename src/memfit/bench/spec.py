"""`memfit bench --spec`: what speculative decoding costs and gains on this machine.

  --spec        the verify-cost curve: one decode forward of w rows (a sequence's pending token
                and w - 1 proposed ones), w = 1, 2, 4, 8, 16, 24, after a prompt of -p tokens;
                ms per forward and its ratio to w = 1. Where it stays near 1 (weights streamed
                from disk: the reads are paid once per forward), every accepted token is nearly
                free; where it grows with w (a small resident model: each row costs compute),
                only high acceptance pays.
  --spec MODE   a copying task (rewrite a paragraph word for word) decoded greedily for -n
                tokens with MODE and with speculation off, alternated for -r repetitions:
                tokens/s of each, their ratio, and the proposers' acceptance.

Both drive the model's own engine (its KV pool in the ledger: a budget holds), so the cost of a
verify pass includes everything a real step pays (sampling w rows, rollback).
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from ..engine.sampler import SamplingParams
from ..spec import CostModel, Proposer, SpecConfig, Speculator

WIDTHS = (1, 2, 4, 8, 16, 24)

TASK = ("Memory is the limit that decides which language models a machine can run. A model "
        "whose weights do not fit is read from the disk for every token, and the disk is slower "
        "than memory by an order of magnitude. Speculative decoding guesses several tokens and "
        "checks them all in one pass over the weights, so each pass can yield more than one "
        "token. Guesses are cheap when the text repeats what came before: a quotation, a list, "
        "a piece of code being edited.")


class _Fixed(Proposer):
    """w - 1 random proposed tokens per step (the curve measures cost, not acceptance)."""
    name = "fixed"

    def __init__(self, n_vocab: int, seed: int = 0):
        self.k, self.rng, self.n_vocab = 0, np.random.default_rng(seed), n_vocab

    def propose(self, seqs, ks):
        return [self.rng.integers(0, self.n_vocab, min(self.k, k)).tolist() for k in ks]


class _Flat(CostModel):
    def cost(self, w):  # the curve's widths are forced: the policy keeps whole proposals
        return 1.0


def verify_curve(m, n_prompt: int, reps: int, widths=WIDTHS, progress: bool = True) -> list[dict]:
    eng, nv = m.engine, m.tokenizer.n_vocab
    old = eng.spec
    prop = _Fixed(nv)
    # each width forced: w - 1 proposed tokens, none cut (draft_min = draft_max = w - 1)
    specs = {w: Speculator(SpecConfig(mode="ngram", draft_max=w - 1, draft_min=w - 1), [prop],
                           _Flat()) if w > 1 else None for w in widths}
    times = {w: [] for w in widths}
    try:
        eng.set_spec(None)
        rng = np.random.default_rng(1)
        need = sum(widths) * (reps + 1) + 8
        n_prompt = max(1, min(n_prompt, m.n_ctx - need))
        rid = eng.add_request(rng.integers(0, nv, n_prompt).tolist(),
                              SamplingParams(temperature=0, max_tokens=need), ignore_eos=True)
        seq = eng.sequence(rid)
        while seq.n_computed < seq.n_prompt:
            eng.step()
        for r in range(reps + 1):  # the first round warms up
            for w in widths:
                prop.k = w - 1
                eng.set_spec(specs[w])
                t0 = time.perf_counter()
                eng.step()
                dt = time.perf_counter() - t0
                if r:
                    times[w].append(dt)
            if progress:
                print(f"  verify curve round {r}/{reps}", file=sys.stderr, flush=True)
        eng.abort(rid)
        eng.step()
    finally:
        eng.set_spec(old)
    t1 = statistics.median(times[widths[0]])
    return [{"test": "verify", "rows": w, "ms": round(statistics.median(times[w]) * 1e3, 3),
             "ms_spread": round((max(times[w]) - min(times[w])) * 1e3, 3),
             "ratio": round(statistics.median(times[w]) / t1, 3),
             "verified_rows": 1 + (specs[w].stats.totals().proposed // (reps + 1) if specs[w] else 0)}
            for w in widths]


def task_ids(m) -> list[int]:
    msg = f"Rewrite this paragraph word for word.\n\n{TASK}"
    if m.tokenizer.chat_template:
        text = m.apply_chat_template([{"role": "user", "content": msg}])
    else:
        text = msg + "\n\nRewritten:\n"
    return m.tokenize(text)


def mode_vs_off(m, mode: str, n_gen: int, reps: int, progress: bool = True) -> dict:
    eng = m.engine
    spec = eng.spec
    if spec is None:
        raise RuntimeError(f"--spec {mode}: no speculator was built")
    ids = task_ids(m)
    tps = {"off": [], mode: []}
    out_ids = {}
    try:
        for r in range(reps + 1):
            for which in ("off", mode):
                eng.set_spec(spec if which == mode else None)
                rid = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=n_gen),
                                      ignore_eos=True)
                seq = eng.sequence(rid)
                while seq.n_computed < seq.n_prompt:
                    eng.step()
                t0 = time.perf_counter()
                toks = []
                while eng.has_unfinished():
                    toks += [o.token for o in eng.step() if o.token is not None]
                dt = time.perf_counter() - t0
                out_ids.setdefault(which, toks)
                if r:
                    tps[which].append(len(toks) / dt)
                if progress:
                    print(f"  {which} round {r}/{reps}: {len(toks) / dt:.2f} tok/s",
                          file=sys.stderr, flush=True)
    finally:
        eng.set_spec(spec)
    a, b = statistics.median(tps["off"]), statistics.median(tps[mode])
    return {"test": f"tg{n_gen} copy", "mode": mode, "off_tokens_per_s": round(a, 3),
            "spec_tokens_per_s": round(b, 3), "ratio": round(b / a, 3),
            "off_samples": [round(x, 3) for x in tps["off"]],
            "spec_samples": [round(x, 3) for x in tps[mode]],
            "same_tokens": out_ids["off"] == out_ids[mode], "spec": spec.summary()}
