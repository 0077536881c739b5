"""qwen2: the llama block with Q/K/V biases (required) and NeoX RoPE."""

from __future__ import annotations

from .layers import Model
from .spec import ArchSpec

SPEC = ArchSpec("qwen2", rope_neox=True, qkv_bias=True, rope_freqs=True)


class Qwen2(Model):
    spec = SPEC
    fused_decode = True   # csrc/decode.c computes this block for decode rows

    def block(self, il, x, pos, cache, last):
        p = f"blk.{il}."
        h = self.attention(il, self.norm(x, p + "attn_norm.weight"), pos, cache, last)
        x = (x if last is None else x[last]) + h
        return x + self.ffn(il, self.norm(x, p + "ffn_norm.weight"))
