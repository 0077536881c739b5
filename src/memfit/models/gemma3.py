"""gemma3: embeddings scaled by sqrt(n_embd); Q/K norm; RMS norms before and after both
attention and FFN (GGUF norm weights already include Gemma's +1); GELU-tanh gated FFN;
5 of every 6 layers use sliding-window attention with rope base 10000 and no rope scaling,
every 6th is global with {arch}.rope.freq_base and the file's scaling; tied output."""

from __future__ import annotations

from .layers import Model


class Gemma3(Model):
    arch = "gemma3"
    act = "gelu"

    def layer_tensors(self, il):
        t = super().layer_tensors(il)
        c, p = self.config, f"blk.{il}."
        t[p + "attn_q_norm.weight"] = ((c.head_dim_k,), True)
        t[p + "attn_k_norm.weight"] = ((c.head_dim_k,), True)
        t[p + "post_attention_norm.weight"] = ((c.n_embd,), True)
        t[p + "post_ffw_norm.weight"] = ((c.n_embd,), True)
        return t

    def block(self, il, x, pos, cache, last):
        c, p = self.config, f"blk.{il}."
        if c.is_swa(il):
            rope = dict(rope_base=c.rope_base_swa, freq_scale=1.0, window=c.sliding_window)
        else:
            rope = dict(rope_base=c.rope_base, freq_scale=c.rope_freq_scale, window=0)
        h = self.attention(il, self.norm(x, p + "attn_norm.weight"), pos, cache, last,
                           qk_norm=True, **rope)
        x = (x if last is None else x[last]) + self.norm(h, p + "post_attention_norm.weight")
        f = self.ffn(il, self.norm(x, p + "ffn_norm.weight"))
        return x + self.norm(f, p + "post_ffw_norm.weight")
