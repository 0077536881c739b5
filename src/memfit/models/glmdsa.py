"""glm-dsa (GLM-5, 5.1, 5.2), as llama.cpp's src/models/glm-dsa.cpp reads it.

The deepseek2 layer (multi-head latent attention with the low-rank q, always the absorbed
form; dense leading layers; routed + shared experts) with glm4moe's routing defaults (sigmoid
when expert_gating_func is absent) and NextN layers (in the file, never computed: role skip),
plus DeepSeek sparse attention: a lightning indexer per layer (indexer.attn_q_b on the q
latent, indexer.attn_k with a LayerNorm, indexer.proj weights) scores every earlier key,
relu(q_i . k_t) weighted and summed over its heads, and the attention of each query keeps only
the top attention.indexer.top_k keys.

While a query sees at most top_k keys, the indexer keeps all of them and the attention is
exactly dense MLA: that is what memfit computes, and contexts are capped at top_k (2048 in
GLM-5) with a clear error above it. The indexer itself (its key cache and the per-query key
selection) is not implemented yet; its tensors are checked and not read.
"""

from __future__ import annotations

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
    kw["n_ff_shexp"] = kw["n_ff_exp"] * int(md.get(f"{arch}.expert_shared_count", 0) or 0)
    n_head, head, top_k = (key("attention.indexer.head_count"), key("attention.indexer.key_length"),
                           key("attention.indexer.top_k"))
    if min(n_head, head, top_k) <= 0:
        raise ModelError(f"{arch}: attention.indexer.* must be positive; the file's metadata is "
                         f"invalid")
    kw["indexer"] = (n_head, head, top_k)
    kw["max_ctx"] = top_k
    kw["max_ctx_why"] = (f"glm-dsa's sparse attention keeps the {top_k} best keys of each query; "
                         f"memfit computes that attention densely, which is the same up to "
                         f"{top_k} tokens (the indexer for longer contexts is not implemented yet)")
    return kw


def _write(w, c):
    deepseek2._write(w, c)
    n_head, head, top_k = c.indexer
    w.add_uint32(f"{c.arch}.attention.indexer.head_count", n_head)
    w.add_uint32(f"{c.arch}.attention.indexer.key_length", head)
    w.add_uint32(f"{c.arch}.attention.indexer.top_k", top_k)
    if c.n_layer_nextn:
        w.add_uint32(f"{c.arch}.nextn_predict_layers", c.n_layer_nextn)


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


class GlmDsa(Deepseek2):
    """deepseek2's block (dense MLA while a query sees at most indexer.top_k keys)."""
    spec = SPEC
