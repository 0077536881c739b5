"""olmoe (OLMoE-1B-7B): RMS norm of Q and K over the whole projected vector (not per head)
before RoPE, NeoX RoPE, routed experts (softmax, top-k, weights not renormalized)."""

from __future__ import annotations

from .layers import Model
from .spec import ArchSpec

SPEC = ArchSpec("olmoe", rope_neox=True, qk_norm="full", moe="always")


class Olmoe(Model):
    spec = SPEC
    fused_moe_decode = True   # csrc/decode.c's MoE layer computes this block for decode rows

    def block(self, il, x, pos, cache, last):
        p = f"blk.{il}."
        # attention(): Q and K RMS-normed over the whole projection (spec qk_norm="full")
        h = self.attention(il, self.norm(x, p + "attn_norm.weight"), pos, cache, last)
        x = (x if last is None else x[last]) + h
        return x + self.moe_ffn(il, self.norm(x, p + "ffn_norm.weight"), last)
