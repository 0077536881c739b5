"""llama: Llama 2/3, SmolLM2, Mistral, and Mixtral (llama with expert_count > 0 and stacked
ffn_*_exps: softmax router, top-k, weights renormalized). Pre-norm, SiLU-gated FFN, normal
(non-NeoX) RoPE: llama.cpp's converter permutes Q/K so adjacent pairs rotate. Output tied to
token_embd if the file has no output.weight."""

from __future__ import annotations

from .layers import Model
from .spec import ArchSpec

SPEC = ArchSpec("llama", rope_freqs=True, moe="optional", expert_weights_norm=True)


class Llama(Model):
    spec = SPEC
    fused_moe_decode = True   # csrc/decode.c's MoE layer computes this block for decode rows
    fused_decode = True   # dense files: csrc/decode.c computes this block for decode rows

    def block(self, il, x, pos, cache, last):
        p = f"blk.{il}."
        h = self.attention(il, self.norm(x, p + "attn_norm.weight"), pos, cache, last)
        x = (x if last is None else x[last]) + h
        h = self.norm(x, p + "ffn_norm.weight")
        return x + (self.moe_ffn(il, h, last) if self.config.is_moe(il) else self.ffn(il, h))
