"""glm4moe (GLM-4.5, GLM-4.5-Air, GLM-4.6, GLM-4.7), as llama.cpp's src/models/glm4-moe.cpp
reads it.

Pre-norm attention with Q/K/V biases, an optional per-head RMS norm of Q and K (the 355B),
NeoX RoPE on the first rope.dimension_count dims of each head only (partial rotary: 64 of
128), scale 1/sqrt(head dim). The pre-FFN norm is ``post_attention_norm``. The first
leading_dense_block_count layers have a dense SiLU FFN; the rest route: sigmoid router (the
default when expert_gating_func is absent), experts chosen on probability + exp_probs_b (the
correction bias, for the choice only), weights renormalized (expert_weights_norm) and scaled
(expert_weights_scale); plus a shared expert of expert_shared_count x
expert_feed_forward_length rows, added ungated.

block_count counts the NextN/MTP layers (nextn_predict_layers) at the end: their tensors are
in the file and checked, never computed, and not in the plan's bytes (role skip). They are a
draft model for speculative decoding, not used yet.
"""

from __future__ import annotations

from ..errors import UnsupportedError
from .layers import Model
from .spec import (ArchSpec, Tensor, as_skipped, attn_tensors, ffn_tensors, moe_tensors,
                   nextn_tensors)


def _hparams(md, arch, kw):
    if md.get(f"{arch}.rope.dimension_sections"):
        raise UnsupportedError(f"{arch}: multimodal rope sections (rope.dimension_sections) are "
                               f"not supported; a text-only glm4moe file has none")
    nextn = int(md.get(f"{arch}.nextn_predict_layers", 0) or 0)
    if not 0 <= nextn < kw["n_layer"]:
        from ..errors import ModelError
        raise ModelError(f"{arch}: nextn_predict_layers = {nextn} must be below block_count "
                         f"{kw['n_layer']}; the file's metadata is invalid")
    kw["n_layer"] -= nextn
    kw["n_layer_nextn"] = nextn
    kw["n_ff_shexp"] = kw["n_ff_exp"] * int(md.get(f"{arch}.expert_shared_count", 0) or 0)
    return kw


def _write(w, c):
    w.add_uint32(f"{c.arch}.expert_shared_count", c.n_ff_shexp // c.n_ff_exp)
    if c.n_layer_nextn:
        w.add_uint32(f"{c.arch}.nextn_predict_layers", c.n_layer_nextn)


def _layer(c, il):
    p, E, D = f"blk.{il}.", c.n_embd, c.head_dim_k
    t = [Tensor(p + "attn_norm.weight", (E,)), *attn_tensors(c, il, bias=True),
         Tensor(p + "attn_q_norm.weight", (D,), False), Tensor(p + "attn_k_norm.weight", (D,), False),
         Tensor(p + "post_attention_norm.weight", (E,))]
    if c.is_moe(il):
        t += moe_tensors(c, il, probs_bias=True)
        if c.n_ff_shexp:
            t += ffn_tensors(c, il, "_shexp", c.n_ff_shexp, "shexp")
    else:
        t += ffn_tensors(c, il)
    if il >= c.n_layer:   # a NextN layer: the layer above plus its projection and norms
        t += nextn_tensors(c, il)
        t = as_skipped(t)
    return t


SPEC = ArchSpec("glm4moe", rope_neox=True, qkv_bias=True, qk_norm="head", moe="always",
                routing_keys=True, n_ff_exp_key=True, gating_default="sigmoid",
                hparams=_hparams, layer_table=_layer, write_extra=_write)


class Glm4Moe(Model):
    spec = SPEC
    fused_moe_decode = True   # csrc/decode.c's MoE layer computes this block for decode rows
    shexp_ungated = True   # routed_shared_ffn: the shared expert added ungated
    ffn_norm_name = "post_attention_norm.weight"

    def block(self, il, x, pos, cache, last):
        p = f"blk.{il}."
        # attention(): biases, the per-head Q/K norm where the file has it, NeoX RoPE on the
        # first n_rot dims of each head
        h = self.attention(il, self.norm(x, p + "attn_norm.weight"), pos, cache, last)
        x = (x if last is None else x[last]) + h
        h = self.norm(x, p + "post_attention_norm.weight")
        if not self.config.is_moe(il):
            return x + self.ffn(il, h)
        return x + self.routed_shared_ffn(il, h, last)
