"""qwen2: the llama block with Q/K/V biases (required) and NeoX RoPE."""

from __future__ import annotations

from .llama import Llama


class Qwen2(Llama):
    arch = "qwen2"

    def layer_tensors(self, il):
        t = super().layer_tensors(il)
        for n in ("attn_q", "attn_k", "attn_v"):
            shape, _ = t[f"blk.{il}.{n}.bias"]
            t[f"blk.{il}.{n}.bias"] = (shape, True)
        return t
