"""gemma3: embeddings scaled by sqrt(n_embd); Q/K norm; RMS norms before and after both
attention and FFN (GGUF norm weights already include Gemma's +1); GELU-tanh gated FFN;
5 of every 6 layers use sliding-window attention with rope base 10000 and no rope scaling,
every 6th is global with {arch}.rope.freq_base and the file's scaling; tied output."""

from __future__ import annotations

from .layers import Model


class Gemma3(Model):
    arch = "gemma3"
    act = "gelu"
    qk_norm = True
    post_norms = True

    def layer_tensors(self, il):
        t = super().layer_tensors(il)
        c, p = self.config, f"blk.{il}."
        t[p + "attn_q_norm.weight"] = ((c.head_dim_k,), True)
        t[p + "attn_k_norm.weight"] = ((c.head_dim_k,), True)
        t[p + "post_attention_norm.weight"] = ((c.n_embd,), True)
        t[p + "post_ffw_norm.weight"] = ((c.n_embd,), True)
        return t

    def rope_params(self, il):
        c = self.config
        if c.is_swa(il):
            return c.rope_base_swa, 1.0, c.sliding_window
        return c.rope_base, c.rope_freq_scale, 0
