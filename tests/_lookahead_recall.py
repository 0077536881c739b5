"""Run by tests/test_expert_lookahead.py in a fresh process (its RSS, and so the budget's
room for experts, does not depend on what the test session loaded before):

    python tests/_lookahead_recall.py MODEL.gguf N_DECODE

prints one JSON line: look-ahead recall, last-token baseline recall, routed experts counted,
and the hint sizes seen."""

import json
import sys

import numpy as np

import memfit
from memfit.runtime import Runtime


def _merge_by_layer(calls):
    """(il, experts) calls -> one entry per layer visit (a budgeted get may come in groups)."""
    out = []
    for il, e in calls:
        if out and out[-1][0] == il:
            out[-1] = (il, out[-1][1] | e)
        else:
            out.append((il, set(e)))
    return out


def main(path: str, n_decode: int) -> dict:
    rt = Runtime(path, n_ctx=128, mem_budget=16 << 30)  # the floor as this load plans it
    floor = rt.plan.min_budget_bytes
    rt.close()
    import os
    # one decode row per forward (no speculation): the look-ahead is judged token by token
    with memfit.load(path, n_ctx=128, mem_budget=floor + os.path.getsize(path) // 4,
                     spec="off") as m:
        st = m.store
        assert st.wants_expert_prediction, "experts are not cached: no look-ahead"
        routed, hinted = [], []
        get, hint, note = st.begin_experts, st.prefetch_experts, st.note_experts

        def spy_get(il, experts):  # records, then the store does its real work (get_experts
            routed.append((il, {int(e) for e in experts}))   # calls it too)
            return get(il, experts)

        def spy_note(il, experts):  # experts used where the store's table held them all
            routed.append((il, {int(e) for e in experts}))
            return note(il, experts)

        def spy_hint(il, experts):
            hinted.append((il, {int(e) for e in experts}))
            return hint(il, experts)

        st.begin_experts, st.prefetch_experts, st.note_experts = spy_get, spy_hint, spy_note
        ids = [int(i) for i in np.random.default_rng(0).integers(3, 2000, 8)]
        r = m.generate(ids, max_tokens=n_decode, temperature=1.0, seed=1)
        assert len(r.ids) == n_decode
        nl, k = m.config.n_layer, m.config.n_expert_used
    visits, hints = _merge_by_layer(routed), _merge_by_layer(hinted)
    # a forward per token: the prompt, then every sampled token but the last
    assert len(visits) == nl * n_decode and len(hints) == (nl - 1) * n_decode
    fwd = [visits[i:i + nl] for i in range(0, len(visits), nl)]
    pred = [hints[i:i + nl - 1] for i in range(0, len(hints), nl - 1)]
    hit = base = n = 0
    sizes = set()
    for t in range(2, len(fwd)):  # decode forwards with a decode forward before them
        for l in range(1, nl):
            real = fwd[t][l][1]
            assert fwd[t][l][0] == l and pred[t][l - 1][0] == l and len(real) == k
            sizes.add(len(pred[t][l - 1][1]))
            n += len(real)
            hit += len(real & pred[t][l - 1][1])
            base += len(real & fwd[t - 1][l][1])
    return {"look": hit / n, "base": base / n, "n": n, "k": k, "hint_sizes": sorted(sizes)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))))
