"""gpt-oss (gpt-oss-20b, gpt-oss-120b), as llama.cpp's src/models/openai-moe-iswa.cpp
computes it (GGUF arch ``gpt-oss``).

Pre-norm attention with Q/K/V and output biases, heads of attention.key_length (64), NeoX
RoPE with YaRN (factor 32: q and k come out scaled by 1 + 0.1 ln 32), scale 1/sqrt(64), and
attention sinks: one learned logit per head (attn_sinks) that joins each softmax's
denominator and carries no value. Even layers attend within a sliding window of
attention.sliding_window (128) tokens, odd layers to the whole context (llama.cpp's
swa pattern 2). The pre-FFN norm is ``post_attention_norm``. Every layer routes: router with
a bias, the top experts_used by logit, weights a softmax over the chosen (llama.cpp's
SOFTMAX_WEIGHT), no renormalization or scale; each expert's gate and up carry biases, then
the clamped SwiGLU (x = min(gate, 7), y = clip(up, -7, 7), x sigmoid(1.702 x) (y + 1)), then
down plus its bias. The experts ship as MXFP4.

The sliding layers' KV holds only their window: in the engine's paged pool they have a block
group of their own (kv/manager.py WindowBlocks, kv/storage.py kv_layout: the layers
``is_swa``), where a sequence keeps the blocks its next query's window reads, so a long
context costs the full layers' KV plus a fixed window group, about half of every layer's
(the planner counts it so: kv/storage.py KVLayout.pool_bytes). The attention itself is the
same masked kernel over the same keys, so the logits are the bits of a cache that kept them all.
"""

from __future__ import annotations

from .layers import Model
from .spec import ROUTER, ArchSpec, Tensor, attn_tensors, moe_tensors


def _hparams(md, arch, kw):
    kw["sliding_window"] = int(md.get(f"{arch}.attention.sliding_window", 0) or 0)
    kw["swa_pattern"] = 2                      # llama.cpp: hparams.set_swa_pattern(2)
    # llama.cpp's graph fixes the routing whatever the file says
    kw.update(expert_gating_func="softmax_weight", expert_weights_norm=False,
              expert_weights_scale=1.0)
    return kw


def _layer(c, il):
    p, E, H, X, F = f"blk.{il}.", c.n_embd, c.n_head, c.n_expert, c.n_ff_exp
    t = [Tensor(p + "attn_norm.weight", (E,))] + attn_tensors(c, il, bias=True)
    t[-1] = Tensor(p + "attn_output.bias", (E,))       # required here
    t += [Tensor(p + "attn_sinks.weight", (H,)), Tensor(p + "post_attention_norm.weight", (E,))]
    t += moe_tensors(c, il)
    t += [Tensor(p + "ffn_gate_inp.bias", (X,), role=ROUTER),
          Tensor(p + "ffn_gate_exps.bias", (X, F)), Tensor(p + "ffn_up_exps.bias", (X, F)),
          Tensor(p + "ffn_down_exps.bias", (X, E))]
    return t


SPEC = ArchSpec("gpt-oss", act="swiglu_oai", rope_neox=True, qkv_bias=True, moe="always",
                n_ff_exp_key=True, yarn=True, hparams=_hparams, layer_table=_layer)


class GptOss(Model):
    spec = SPEC
    fused_moe_decode = True   # csrc/decode.c's MoE layer: YaRN, sinks, expert biases, clamped SwiGLU
    ffn_norm_name = "post_attention_norm.weight"

    def rope_params(self, il):
        c = self.config
        return c.rope_base, c.rope_freq_scale, c.sliding_window if c.is_swa(il) else 0

    def block(self, il, x, pos, cache, last):
        p = f"blk.{il}."
        # attention(): biases, YaRN RoPE, the window on even layers, the sinks (attn_sinks)
        h = self.attention(il, self.norm(x, p + "attn_norm.weight"), pos, cache, last)
        x = (x if last is None else x[last]) + h
        # moe_ffn(): router bias, softmax over the chosen, expert biases, clamped SwiGLU
        return x + self.moe_ffn(il, self.norm(x, p + self.ffn_norm_name), last)
