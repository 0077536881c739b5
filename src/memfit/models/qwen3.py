"""qwen3: the llama block with per-head RMS norm of Q and K before RoPE, NeoX RoPE, and a
head dim that may differ from n_embd / n_head (attention.key_length)."""

from __future__ import annotations

from .layers import Model
from .spec import ArchSpec

SPEC = ArchSpec("qwen3", rope_neox=True, qk_norm="head")


class Qwen3(Model):
    spec = SPEC
    fused_decode = True   # csrc/decode.c computes this block for decode rows

    def block(self, il, x, pos, cache, last):
        p = f"blk.{il}."
        # attention(): the per-head Q/K norm (spec qk_norm="head") before RoPE
        h = self.attention(il, self.norm(x, p + "attn_norm.weight"), pos, cache, last)
        x = (x if last is None else x[last]) + h
        return x + self.ffn(il, self.norm(x, p + "ffn_norm.weight"))
