"""qwen3moe (Qwen3-30B-A3B, -235B-A22B): the qwen3 block (per-head Q/K norm, NeoX RoPE) with
routed experts for the FFN: softmax router, top-k, weights renormalized (norm_topk_prob)."""

from __future__ import annotations

from .layers import Model
from .spec import ArchSpec

SPEC = ArchSpec("qwen3moe", rope_neox=True, qk_norm="head", moe="always",
                expert_weights_norm=True, n_ff_exp_key=True)


class Qwen3Moe(Model):
    spec = SPEC
    fused_moe_decode = True   # csrc/decode.c's MoE layer computes this block for decode rows

    def block(self, il, x, pos, cache, last):
        p = f"blk.{il}."
        h = self.attention(il, self.norm(x, p + "attn_norm.weight"), pos, cache, last)
        x = (x if last is None else x[last]) + h
        return x + self.moe_ffn(il, self.norm(x, p + "ffn_norm.weight"), last)
