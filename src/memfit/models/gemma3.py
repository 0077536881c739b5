"""gemma3: embeddings scaled by sqrt(n_embd); Q/K norm; RMS norms before and after both
attention and FFN (GGUF norm weights already include Gemma's +1); GELU-tanh gated FFN;
5 of every 6 layers use sliding-window attention with rope base 10000 and no rope scaling,
every 6th is global with {arch}.rope.freq_base and the file's scaling; tied output.
The sliding layers' KV holds only their window (attention.sliding_window: 512 or 1024) in
the engine's pool, as gpt-oss's (models/gptoss.py, kv/manager.py WindowBlocks) whenever that
window group is smaller than the context's blocks."""

from __future__ import annotations

import math

from .layers import Model
from .spec import ArchSpec


def _hparams(md, arch, kw):
    kw["embd_scale"] = math.sqrt(kw["n_embd"])
    kw["sliding_window"] = int(md.get(f"{arch}.attention.sliding_window", 0) or 0)
    kw["swa_pattern"] = 6                 # llama.cpp: hparams.set_swa_pattern(6)
    kw["rope_base_swa"] = 10000.0         # rope_freq_base_train_swa
    kw["attn_softcap"] = 0.0              # the gemma3 graph has no attention softcap
    hd = kw["head_dim_k"] or kw["n_embd"] // kw["n_head"]
    # query_pre_attn_scalar: head_dim, except the 27B (62 layers) which uses n_embd / n_head
    q_scalar = kw["n_embd"] // kw["n_head"] if kw["n_layer"] == 62 else hd
    kw["attn_scale"] = 1.0 / math.sqrt(q_scalar)
    return kw


SPEC = ArchSpec("gemma3", act="gelu", rope_neox=True, qk_norm="head", post_norms=True,
                hparams=_hparams)


class Gemma3(Model):
    spec = SPEC
    fused_decode = True   # csrc/decode.c computes this block for decode rows

    def block(self, il, x, pos, cache, last):
        p = f"blk.{il}."
        h = self.attention(il, self.norm(x, p + "attn_norm.weight"), pos, cache, last)
        x = (x if last is None else x[last]) + self.norm(h, p + "post_attention_norm.weight")
        f = self.ffn(il, self.norm(x, p + "ffn_norm.weight"))
        return x + self.norm(f, p + "post_ffw_norm.weight")

    def rope_params(self, il):
        c = self.config
        if c.is_swa(il):
            return c.rope_base_swa, 1.0, c.sliding_window
        return c.rope_base, c.rope_freq_scale, 0
