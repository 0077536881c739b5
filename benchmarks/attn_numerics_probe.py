"""Which attention numerics llama.cpp uses, on one file (never in CI; issue 17/19 fidelity).

    PEER=/root/peer-venv/bin/python
    $PEER benchmarks/attn_numerics_probe.py llama MODEL DIR      # ids from DIR/ids.npy (moe_agreement.py)
    python benchmarks/attn_numerics_probe.py memfit MODEL DIR

llama: the logits of the first 24 ids with flash attention off (llama-cpp-python's default) and
on (llama-server / llama-perplexity: "auto" = on for the CPU). memfit: its attention replaced by
three numpy emulations over an f16 cache (q rounded to f16 in all three):
  f32   memfit's own (softmax in f32, P . V accumulated in f32) -- what memfit computes today
  fa16  ggml's CPU flash attention: keys in order, the running max / sum updated per key and
        the V accumulator kept in f16 (rounded at every key)
  nofa  ggml's non-flash graph: softmax in f32, P rounded to f16 before P . V
and prints the max |logit difference| per position against each llama.cpp mode. On a 1-layer
qwen3moe tiny file (all F32) both llama.cpp modes are matched to ~1e-6 by their emulation,
while memfit's f32 numerics sit 2e-4..2e-3 from either (docs/NOTES.md, session 9).
"""
from __future__ import annotations

import sys

import numpy as np

N = 24
F16 = np.float16


def llama(model, d):
    from llama_cpp import Llama
    ids = np.load(d + "/ids.npy").tolist()[:N]
    for fa in (False, True):
        m = Llama(model, n_ctx=64, n_batch=512, n_ubatch=512, logits_all=True, n_threads=2,
                  verbose=False, flash_attn=fa)
        m.eval(ids)
        np.save(d + f"/probe-llama-fa{int(fa)}.npy", np.array(m.scores[:N], np.float32))


def _row(mode, q, K, V, scale):
    q16 = q.astype(F16).astype(np.float64)
    if mode == "nofa":
        s = (K.astype(np.float64) @ q16).astype(np.float32) * np.float32(scale)
        e = np.exp(s - s.max())
        p = (e / e.sum()).astype(np.float32).astype(F16).astype(np.float64)
        return (p @ V.astype(np.float64)).astype(np.float32)
    M, S = -np.inf, np.float32(0)
    acc = np.zeros(V.shape[1], F16 if mode == "fa16" else np.float32)
    for t in range(K.shape[0]):
        s = np.float32(K[t].astype(np.float64) @ q16) * np.float32(scale)
        ms = vs = np.float32(1)
        if s > M:
            ms = np.float32(np.exp(np.float32(M - s))) if M != -np.inf else np.float32(0)
            M = s
            acc = (acc.astype(np.float32) * ms).astype(acc.dtype)
        else:
            vs = np.float32(np.exp(np.float32(s - M)))
        acc = (acc.astype(np.float32) + V[t].astype(np.float32) * vs).astype(acc.dtype)
        S = np.float32(S * ms + vs)
    return acc.astype(np.float32) / S


def memfit(model, d):
    sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0] + "/src")
    from memfit.models import load_model
    from memfit.ops import get_ops
    ids = np.load(d + "/ids.npy")[:N]
    refs = {fa: np.load(d + f"/probe-llama-fa{fa}.npy") for fa in (0, 1)}
    for mode in ("f32", "fa16", "nofa"):
        m = load_model(model, ops=get_ops("native"))
        c = m.config

        def attention(il, x, pos, cache, last, m=m, c=c, mode=mode):
            p, n = f"blk.{il}.", x.shape[0]
            q, k, v = m.linears(x, (p + "attn_q", p + "attn_k", p + "attn_v"))
            q = q.reshape(n, c.n_head, c.head_dim_k)
            k = k.reshape(n, c.n_head_kv, c.head_dim_k)
            v = v.reshape(n, c.n_head_kv, c.head_dim_v)
            if m.qk_norm:
                q, k = m.norm(q, p + "attn_q_norm.weight"), m.norm(k, p + "attn_k_norm.weight")
            q, k = m.rope(q, pos, il), m.rope(k, pos, il)
            cache.attend(il, m.ops, q.copy(), k, v, last, c.attn_scale, 0, 0.0)
            K, V, G = k.astype(F16), v.astype(F16), c.n_head // c.n_head_kv
            rows = range(n) if last is None else last
            o = np.zeros((len(rows), c.n_head, c.head_dim_v), np.float32)
            for j, i in enumerate(rows):
                for h in range(c.n_head):
                    o[j, h] = _row(mode, q[i, h], K[: i + 1, h // G], V[: i + 1, h // G], c.attn_scale)
            return m.linear(o.reshape(len(rows), -1), p + "attn_output")
        m.attention = attention
        z = m.forward(ids, m.new_cache(N + 8), all_logits=True)
        for fa, r in refs.items():
            print(f"memfit {mode:4s} vs llama.cpp flash_attn={fa}: max |dlogit| by position",
                  np.array2string(np.abs(r - z).max(1)[:8], precision=7))


if __name__ == "__main__":
    {"llama": llama, "memfit": memfit}[sys.argv[1]](sys.argv[2], sys.argv[3])
