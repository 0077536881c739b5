"""glm-dsa (GLM-5, 5.1, 5.2), as llama.cpp's src/models/glm-dsa.cpp reads it.

The deepseek2 layer (multi-head latent attention with the low-rank q, always the absorbed
form; dense leading layers; routed + shared experts) with glm4moe's routing defaults (sigmoid
when expert_gating_func is absent) and NextN layers (in the file, never computed: role skip),
plus DeepSeek sparse attention (DSA): the attention of each query row reads only the
attention.indexer.top_k (K_idx) keys a "lightning indexer" picks for it.

The indexer of a "full" layer (h: the attention norm's output, qr: MLA's q latent
rms(attn_q_a h) * attn_q_a_norm):
  iq = indexer.attn_q_b(qr) -> [n, Hi, Di], normal (adjacent-pair) RoPE with the model's rope
       (YaRN included) on each head's first n_rot values
  ik = LayerNorm(indexer.attn_k(h)) * k_norm.weight + k_norm.bias -> [n, Di] (eps:
       attention.layer_norm_epsilon, 1e-6 when absent), the same RoPE on its first n_rot
  w  = indexer.proj(h) / sqrt(Di * Hi) -> [n, Hi]
  score[i, t] = sum_h relu(iq[i, h] . ik[t]) w[i, h] over the keys t <= pos_i of i's sequence
and the row keeps its min(visible, K_idx) best keys (ties: the lower position first;
llama.cpp's ggml_top_k leaves the order of ties undefined). llama.cpp also multiplies iq and ik
by a Hadamard matrix: orthogonal, so the dot products are the same in exact arithmetic; not
done here. ik is kept per token in an indexer key cache next to K (kv/storage.py aux rows:
same physical rows as K, so prefix-cache reuse, copy on write, sessions and preemption carry
it; float16 as llama.cpp's cache, float32 with an f32 cache). Layer types: the per-layer
array attention.indexer.types (1 full, 0 shared); without it every layer is full when
context_length < 1048576 (GLM-5, 5.1), else GLM-5.2's pattern (layers 0, 1, then every 4th
from 2). A shared layer reuses the selection of the last full layer before it and runs no
indexer of its own.

Rows that see at most K_idx keys keep them all: their attention is dense MLA through the
cache's usual attend, bit for bit as without the indexer (a forward where every row is such a
row computes no scores at all). When some row sees more, every row of the forward attends
through ``BatchKV.attend_keys``: the same kernels over a one-row-block table of its kept keys in
position order (so a row that keeps all its keys gets the dense result bit for bit, with the
f16 rounding of q and the quantized caches as ever). The indexer's maths is numpy: per layer
O(n x T) small vectors (Hi x Di per key) next to MLA's matmuls; scores are computed in float64
(a row's selection then does not hang on the BLAS call's shape, i.e. on the rows batched with
it) in chunks of rows (at most _SCORE_CHUNK values at once, or one row's).
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import ModelError
from . import deepseek2
from .deepseek2 import Deepseek2
from .glm4moe import _hparams as _glm_hparams
from .spec import ArchSpec, Tensor, as_skipped, nextn_tensors


def _hparams(md, arch, kw):
    def key(k):
        v = md.get(f"{arch}.{k}")
        if v is None:
            raise ModelError(f"metadata key {arch}.{k} is missing; the file is not a complete "
                             f"{arch} model")
        return int(v)
    kw = _glm_hparams(md, arch, kw)                       # NextN layers, shared experts
    kw = deepseek2._hparams(md, arch, kw)                 # MLA, kq scale
    if not (kw["q_lora_rank"] > 0 and kw["head_dim_k_mla"] > 0):
        raise ModelError(f"{arch}: needs MLA with the low-rank q (attention.q_lora_rank, "
                         f"attention.key_length_mla); the file's metadata is invalid")
    n_head, head, top_k = (key("attention.indexer.head_count"), key("attention.indexer.key_length"),
                           key("attention.indexer.top_k"))
    if min(n_head, head, top_k) <= 0:
        raise ModelError(f"{arch}: attention.indexer.* must be positive; the file's metadata is "
                         f"invalid")
    kw["indexer"] = (n_head, head, top_k)
    if head <= kw["n_rot"]:
        raise ModelError(f"{arch}: attention.indexer.key_length {head} must exceed the rope dims "
                         f"{kw['n_rot']}")
    eps = md.get(f"{arch}.attention.layer_norm_epsilon")
    kw["norm_eps"] = 1e-6 if eps is None else float(eps)
    n_layer = kw["n_layer"]
    types = md.get(f"{arch}.attention.indexer.types")
    if types is None:
        if kw.get("n_ctx_train", 0) < 1048576:   # GLM-5, 5.1: every layer full
            full = [1] * n_layer
        else:                                   # llama.cpp's GLM-5.2 default
            full = [1 if il < 2 or (il - 2) % 4 == 0 else 0 for il in range(n_layer)]
    else:
        full = [int(t) for t in (types if isinstance(types, (list, tuple)) else [types] * n_layer)]
        if len(full) < n_layer or any(t not in (0, 1) for t in full[:n_layer]):
            raise ModelError(f"{arch}: attention.indexer.types must hold 0 or 1 for each of the "
                             f"{n_layer} layers; the file's metadata is invalid")
        full = full[:n_layer]
    if not full[0]:
        raise ModelError(f"{arch}: layer 0 is a shared indexer layer (attention.indexer.types) "
                         f"with no full layer before it to share; the file's metadata is invalid")
    kw["indexer_full"] = tuple(full)
    return kw


def _write(w, c):
    deepseek2._write(w, c)
    n_head, head, top_k = c.indexer
    w.add_uint32(f"{c.arch}.attention.indexer.head_count", n_head)
    w.add_uint32(f"{c.arch}.attention.indexer.key_length", head)
    w.add_uint32(f"{c.arch}.attention.indexer.top_k", top_k)
    if c.n_layer_nextn:
        w.add_uint32(f"{c.arch}.nextn_predict_layers", c.n_layer_nextn)
    if c.indexer_full:
        w.add_array(f"{c.arch}.attention.indexer.types", [int(t) for t in c.indexer_full])


def _layer(c, il):
    p, E, Q = f"blk.{il}.", c.n_embd, c.q_lora_rank
    n_head, head, _ = c.indexer
    t = deepseek2._layer(c, il)
    t += [Tensor(p + "indexer.k_norm.weight", (head,), False),
          Tensor(p + "indexer.k_norm.bias", (head,), False),
          Tensor(p + "indexer.proj.weight", (n_head, E), False),
          Tensor(p + "indexer.attn_k.weight", (head, E), False),
          Tensor(p + "indexer.attn_q_b.weight", (n_head * head, Q), False)]
    if il >= c.n_layer:
        t += nextn_tensors(c, il)
        t = as_skipped(t)
    return t


SPEC = ArchSpec("glm-dsa", moe="always", routing_keys=True, n_ff_exp_key=True, yarn=True,
                gating_default="sigmoid", hparams=_hparams, layer_table=_layer, write_extra=_write,
                # GLM-5's files carry both (llama.cpp's graph reads the indexer's)
                synth_optional=("exp_probs_b.bias", "indexer.k_norm.weight", "indexer.k_norm.bias",
                                "indexer.proj.weight", "indexer.attn_k.weight",
                                "indexer.attn_q_b.weight"))


_INDEXER = ("k_norm.weight", "k_norm.bias", "proj.weight", "attn_k.weight", "attn_q_b.weight")
# floats of indexer scores computed at once ([rows, Hi, T] per chunk of query rows; at least
# one row: the planner counts a row's, memory/planner.py _ctx_extra)
_SCORE_CHUNK = 1 << 20


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm over the last axis (ggml_norm: mean and variance), times w plus b."""
    mu = x.mean(axis=-1, keepdims=True, dtype=np.float32)
    d = x - mu
    var = (d * d).mean(axis=-1, keepdims=True, dtype=np.float32)
    return (d / np.sqrt(var + np.float32(eps)) * w + b).astype(np.float32)


def top_keys(s: np.ndarray, k: int) -> np.ndarray:
    """Mask [m, T] of each row's k best scores of s [m, T] (-inf: not visible; each row has at
    least k visible); ties at the k-th score: the lower positions first."""
    T = s.shape[1]
    kth = np.partition(s, T - k, axis=1)[:, T - k][:, None]
    gt = s > kth
    eq = s == kth
    need = k - gt.sum(axis=1, keepdims=True)
    return gt | (eq & (np.cumsum(eq, axis=1) <= need))


class GlmDsa(Deepseek2):
    """deepseek2's block with DeepSeek sparse attention (the module docstring)."""
    spec = SPEC
    # when a list: (layer, kept keys int64 [n], visible keys int64 [n]) of every selection
    # made (tests and diagnostics)
    selection_log = None

    def __init__(self, config, weights, ops=None):
        super().__init__(config, weights, ops)
        for il in range(config.n_layer):
            if config.indexer_full[il]:
                miss = [t for t in _INDEXER if not weights.has(f"blk.{il}.indexer.{t}")]
                if miss:
                    raise ModelError(f"{config.arch}: layer {il} is a full indexer layer but the "
                                     f"file has no blk.{il}.indexer.{miss[0]}; the file is not a "
                                     f"complete {config.arch} model")

    def mla_attend(self, il, x, qr, pos, cache, q, k, v, last):
        c = self.config
        if c.indexer_full[il]:
            cache.selection = self.select_keys(il, x, qr, pos, cache)
        sel = cache.selection
        if sel is None:   # every row keeps all its keys: dense MLA
            return super().mla_attend(il, x, qr, pos, cache, q, k, v, last)
        starts, keys = sel
        return cache.attend_keys(il, self.ops, q, k, v, last, c.attn_scale, starts, keys)

    def select_keys(self, il, h, qr, pos, cache):
        """Layer il's indexer: store the batch's indexer keys, then the keys each query row
        reads: (starts int64 [n + 1], physical K rows int32 [starts[-1]], row i's at
        starts[i]:starts[i + 1] in position order), or None when every row sees at most K_idx
        keys (all of them: dense)."""
        c, p = self.config, f"blk.{il}."
        Hi, Di, K = c.indexer
        R, n = c.n_rot, h.shape[0]
        ik = layer_norm(self.linear(h, p + "indexer.attn_k"), self.vec[p + "indexer.k_norm.weight"],
                        self.vec[p + "indexer.k_norm.bias"], c.norm_eps)
        ik = np.concatenate([self.rope(ik[:, None, :R], pos, il, neox=False)[:, 0], ik[:, R:]],
                            axis=-1)
        cache.store_aux(il, ik)
        vis = pos.astype(np.int64) + 1
        if int(vis.max()) <= K:
            if self.selection_log is not None:
                self.selection_log.append((il, vis.copy(), vis.copy()))
            return None
        iq = self.linear(qr, p + "indexer.attn_q_b").reshape(n, Hi, Di)
        iq = np.concatenate([self.rope(iq[..., :R], pos, il, neox=False), iq[..., R:]], axis=-1)
        w = self.linear(h, p + "indexer.proj") * np.float32(1.0 / math.sqrt(Di * Hi))
        counts = np.minimum(vis, K)
        starts = np.zeros(n + 1, np.int64)
        np.cumsum(counts, out=starts[1:])
        keys = np.empty(int(starts[-1]), np.int32)
        A = cache.aux[il]
        for rows, phys in cache.seq_keys():
            dense = rows[vis[rows] <= K]
            for i in dense:                       # all of the row's keys, in order
                keys[starts[i]:starts[i + 1]] = phys[:vis[i]]
            sparse = rows[vis[rows] > K]
            if not len(sparse):
                continue
            T = len(phys)
            # float64: a row's scores depend on the GEMM's shape (the rows beside it, T) only
            # at ~1e-16, so its selection is the same cold, cached, chunked or batched unless
            # two scores are that close
            kk = np.ascontiguousarray(A[phys].T, dtype=np.float64)           # [Di, T]
            step = max(1, _SCORE_CHUNK // (Hi * T))
            for a in range(0, len(sparse), step):
                r = sparse[a:a + step]
                m = len(r)
                d = (iq[r].reshape(m * Hi, Di).astype(np.float64) @ kk).reshape(m, Hi, T)
                np.maximum(d, 0.0, out=d)
                d *= w[r].astype(np.float64)[:, :, None]
                s = d.sum(axis=1)                                             # [m, T]
                s[np.arange(T)[None, :] > pos[r, None]] = -np.inf
                ti = np.nonzero(top_keys(s, K))[1].reshape(m, K)              # ascending
                keys[(starts[r][:, None] + np.arange(K)).reshape(-1)] = phys[ti].reshape(-1)
        if self.selection_log is not None:
            self.selection_log.append((il, counts, vis))
        return starts, keys
