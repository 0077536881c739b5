"""qwen2moe (Qwen1.5-MoE, Qwen2-57B-A14B): the qwen2 block (Q/K/V biases, NeoX RoPE) with
routed experts (softmax, top-k, weights not renormalized) plus a shared expert whose output
is scaled by sigmoid(ffn_gate_inp_shexp . x)."""

from __future__ import annotations

from .layers import Model
from .spec import ArchSpec

SPEC = ArchSpec("qwen2moe", rope_neox=True, qkv_bias=True, moe="always", shared_expert=True,
                n_ff_exp_key=True)


class Qwen2Moe(Model):
    spec = SPEC
    fused_moe_decode = True   # csrc/decode.c's MoE layer computes this block for decode rows

    def block(self, il, x, pos, cache, last):
        p = f"blk.{il}."
        h = self.attention(il, self.norm(x, p + "attn_norm.weight"), pos, cache, last)
        x = (x if last is None else x[last]) + h
        # moe_ffn(): the routed experts plus the sigmoid-gated shared expert (spec shared_expert)
        return x + self.moe_ffn(il, self.norm(x, p + "ffn_norm.weight"), last)
