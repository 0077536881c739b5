"""qwen3: the llama block with per-head RMS norm of Q and K before RoPE, NeoX RoPE, and a
head dim that may differ from n_embd / n_head (attention.key_length)."""

from __future__ import annotations

from .layers import Model


class Qwen3(Model):
    arch = "qwen3"
    qk_norm = True

    def layer_tensors(self, il):
        t = super().layer_tensors(il)
        hd = self.config.head_dim_k
        t[f"blk.{il}.attn_q_norm.weight"] = ((hd,), True)
        t[f"blk.{il}.attn_k_norm.weight"] = ((hd,), True)
        return t
