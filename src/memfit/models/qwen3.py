"""qwen3: the llama block with per-head RMS norm of Q and K before RoPE, NeoX RoPE, and a
head dim that may differ from n_embd / n_head (attention.key_length)."""

from __future__ import annotations

from .layers import Model


class Qwen3(Model):
    arch = "qwen3"

    def layer_tensors(self, il):
        t = super().layer_tensors(il)
        hd = self.config.head_dim_k
        t[f"blk.{il}.attn_q_norm.weight"] = ((hd,), True)
        t[f"blk.{il}.attn_k_norm.weight"] = ((hd,), True)
        return t

    def block(self, il, x, pos, cache, last):
        h = self.attention(il, self.norm(x, f"blk.{il}.attn_norm.weight"), pos, cache, last,
                           qk_norm=True)
        x = (x if last is None else x[last]) + h
        return x + self.ffn(il, self.norm(x, f"blk.{il}.ffn_norm.weight"))
