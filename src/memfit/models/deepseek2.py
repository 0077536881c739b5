"""deepseek2 (DeepSeek-V2/V2-Lite/V3/R1, Kimi K2), as llama.cpp's src/models/deepseek2.cpp
computes it.

Attention is multi-head latent attention (MLA). Per token:
  q      = attn_q_b(rms(attn_q_a h) * attn_q_a_norm)   (or attn_q h when q_lora_rank is 0)
           -> per head [q_nope (Dn) | q_pe (R)]
  ckv    = attn_kv_a_mqa h -> [c (kv_lora_rank C) | k_pe (R)], c = rms(c) * attn_kv_a_norm
  q_pe, k_pe: normal (adjacent-pair) RoPE with YaRN; k_pe is one head shared by all
Absorbed form (files with attn_k_b / attn_v_b, what current converters write): each head's
q_nope goes through attn_k_b into the latent space, q_abs (C); attention is then MQA with one
KV head of [c | k_pe] (C + R values per token and layer: all the cache holds) and values c;
each head's output (C) comes back through attn_v_b (Dv) into attn_output. Files with the one
attn_kv_b (the older form) decompress c into per-head k_nope and v and attend as MHA; in
exact arithmetic both are the same attention. The score scale is mscale^2 / sqrt(Dn + R), with
YaRN's mscale as llama.cpp pre-scales it.

FFN: the first leading_dense_block_count layers dense SiLU; then routed experts (softmax or
sigmoid; exp_probs_b correction bias for the choice; group-limited choice by
expert_group_count / expert_group_used_count; renormalized by expert_weights_norm; scaled by
expert_weights_scale) plus expert_shared_count shared experts as one ungated FFN.

The cache stores only K [c | k_pe] (ModelConfig.v_in_k, kv/storage.py kv_layout): the values
c are read as K's first C values, as llama.cpp's MLA cache does. A quantized cache (q8_0/q4_0)
rotates the K row, and V, inside it, carries that rotation (kv/quant.py check_v_in_k). The
fused decode layer is not used for MLA. Mistral-Large's attention temperature tuning is
refused.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import ModelError, UnsupportedError
from .layers import Model
from .spec import ArchSpec, Tensor, ffn_tensors, moe_tensors


def _hparams(md, arch, kw):
    def key(k, default=0):
        v = md.get(f"{arch}.{k}", default)
        return default if v is None else v
    if key("attention.temperature_scale", 0.0):
        raise UnsupportedError(f"{arch}: attention temperature tuning (Mistral-Large 3) is not "
                               f"supported")
    # llama.cpp reads no q_lora_rank for 26/27-layer files (DeepSeek-V2-Lite: a plain attn_q)
    lite = arch == "deepseek2" and kw["n_layer"] in (26, 27)
    kw["q_lora_rank"] = 0 if lite else int(key("attention.q_lora_rank"))
    if arch == "deepseek2" and f"{arch}.expert_gating_func" not in md and kw["n_layer"] in (47, 48) \
            and kw["n_vocab"] == 154880:
        kw["expert_gating_func"] = "sigmoid"   # llama.cpp: GLM-4.7-Flash files
    kw["kv_lora_rank"] = C = int(key("attention.kv_lora_rank"))
    kw["head_dim_k_mla"] = int(key("attention.key_length_mla"))
    kw["head_dim_v_mla"] = int(key("attention.value_length_mla"))
    R = kw["n_rot"]
    mla = kw["head_dim_k_mla"] > 0 and kw["head_dim_v_mla"] > 0
    if C <= 0 or R <= 0:
        raise ModelError(f"{arch}: attention.kv_lora_rank ({C}) and rope.dimension_count ({R}) "
                         f"must be positive; the file's metadata is invalid")
    if mla and (kw["head_dim_k"] != C + R or kw["head_dim_v"] != C or kw["n_head_kv"] != 1):
        raise ModelError(f"{arch}: an MLA file has key_length = kv_lora_rank + rope dims "
                         f"({C + R}), value_length = kv_lora_rank ({C}) and one KV head; got "
                         f"{kw['head_dim_k']}, {kw['head_dim_v']}, {kw['n_head_kv']}")
    dk = kw["head_dim_k_mla"] if mla else kw["head_dim_k"]
    if dk <= R:
        raise ModelError(f"{arch}: key length {dk} must exceed the rope dims {R}")
    kw["n_ff_shexp"] = kw["n_ff_exp"] * int(key("expert_shared_count"))
    # llama.cpp's kq_scale: mscale^2 / sqrt(Dn + R), mscale from YaRN (1 without)
    fs = kw.get("rope_freq_scale", 1.0)
    mscale = 1.0
    if kw.get("rope_scaling") == "yarn":
        org = kw["yarn_attn_factor"] * (1.0 + 0.1 * math.log(1.0 / fs))
        mscale = org * (1.0 + 0.1 * kw["yarn_log_mul"] * math.log(1.0 / fs))
    kw["attn_scale"] = mscale * mscale / math.sqrt(dk)
    return kw


def _write(w, c):
    a = c.arch
    w.add_uint32(f"{a}.attention.kv_lora_rank", c.kv_lora_rank)
    w.add_uint32(f"{a}.attention.q_lora_rank", c.q_lora_rank)
    if c.head_dim_k_mla:
        w.add_uint32(f"{a}.attention.key_length_mla", c.head_dim_k_mla)
        w.add_uint32(f"{a}.attention.value_length_mla", c.head_dim_v_mla)
    w.add_uint32(f"{a}.expert_shared_count", c.n_ff_shexp // c.n_ff_exp)


def mla_dims(c) -> tuple[int, int, int, int]:
    """(Dn, R, Dv, C): per-head nope and rope dims of q/k, value dims, latent rank."""
    mla = c.head_dim_k_mla > 0
    dk = c.head_dim_k_mla if mla else c.head_dim_k
    return dk - c.n_rot, c.n_rot, c.head_dim_v_mla if mla else c.head_dim_v, c.kv_lora_rank


def _layer(c, il):
    p, E, H = f"blk.{il}.", c.n_embd, c.n_head
    Dn, R, Dv, C = mla_dims(c)
    Q = c.q_lora_rank
    t = [Tensor(p + "attn_norm.weight", (E,))]
    if Q:
        t += [Tensor(p + "attn_q_a.weight", (Q, E)), Tensor(p + "attn_q_a_norm.weight", (Q,)),
              Tensor(p + "attn_q_b.weight", (H * (Dn + R), Q))]
    else:
        t.append(Tensor(p + "attn_q.weight", (H * (Dn + R), E)))
    t += [Tensor(p + "attn_kv_a_mqa.weight", (C + R, E)), Tensor(p + "attn_kv_a_norm.weight", (C,))]
    if c.head_dim_k_mla:
        t += [Tensor(p + "attn_k_b.weight", (H, C, Dn)), Tensor(p + "attn_v_b.weight", (H, Dv, C))]
    else:
        t.append(Tensor(p + "attn_kv_b.weight", (H * (Dn + Dv), C)))
    t += [Tensor(p + "attn_output.weight", (E, H * Dv)), Tensor(p + "ffn_norm.weight", (E,))]
    if c.is_moe(il):
        t += moe_tensors(c, il) + [Tensor(p + "exp_probs_b.bias", (c.n_expert,), False, "router")]
        if c.n_ff_shexp:
            t += ffn_tensors(c, il, "_shexp", c.n_ff_shexp, "shexp")
    else:
        t += ffn_tensors(c, il)
    return t


SPEC = ArchSpec("deepseek2", moe="always", routing_keys=True, n_ff_exp_key=True, yarn=True,
                hparams=_hparams, layer_table=_layer, write_extra=_write,
                synth_optional=("exp_probs_b.bias",))   # DeepSeek-V3's correction bias


class Deepseek2(Model):
    spec = SPEC

    def block(self, il, x, pos, cache, last):
        p = f"blk.{il}."
        h = self.mla_attention(il, self.norm(x, p + "attn_norm.weight"), pos, cache, last)
        x = (x if last is None else x[last]) + h
        h = self.norm(x, p + "ffn_norm.weight")
        if not self.config.is_moe(il):
            return x + self.ffn(il, h)
        return x + self.routed_shared_ffn(il, h, last)

    def mla_attention(self, il, x, pos, cache, last):
        c, ops, p = self.config, self.ops, f"blk.{il}."
        Dn, R, Dv, C = mla_dims(c)
        n, H = x.shape[0], c.n_head
        qr = None
        if c.q_lora_rank:
            qr = self.norm(self.linear(x, p + "attn_q_a"), p + "attn_q_a_norm.weight")
            q = self.linear(qr, p + "attn_q_b")
        else:
            q = self.linear(x, p + "attn_q")
        q = q.reshape(n, H, Dn + R)
        ckv = self.linear(x, p + "attn_kv_a_mqa")                       # [n, C + R]
        q_pe = self.rope(q[..., Dn:], pos, il, neox=False)
        k_pe = self.rope(ckv[:, None, C:], pos, il, neox=False)          # one head
        kv_c = self.norm(np.ascontiguousarray(ckv[:, :C]), p + "attn_kv_a_norm.weight")
        if c.head_dim_k_mla:
            # absorbed: MQA over the latent; per-head projections in and out of it
            q_abs = ops.matmul_heads(np.ascontiguousarray(q[..., :Dn]),
                                     self.weights.get(p + "attn_k_b.weight"), **self._rows_kw(x))
            qq = np.concatenate([q_abs, q_pe], axis=-1)                   # [n, H, C + R]
            k = np.concatenate([kv_c, k_pe[:, 0]], axis=-1)[:, None]    # [n, 1, C + R]
            # values: the latent, K's first C values (the cache stores K only: V inside K)
            o = self.mla_attend(il, x, qr, pos, cache, qq, k, kv_c[:, None], last)
            o = ops.matmul_heads(o, self.weights.get(p + "attn_v_b.weight"), **self._rows_kw(x))
        else:
            kv = self.linear(kv_c, p + "attn_kv_b").reshape(n, H, Dn + Dv)
            qq = np.concatenate([q[..., :Dn], q_pe], axis=-1)
            k = np.concatenate([kv[..., :Dn], np.broadcast_to(k_pe, (n, H, R))], axis=-1)
            o = cache.attend(il, ops, qq, k, np.ascontiguousarray(kv[..., Dn:]), last,
                             c.attn_scale, 0, 0.0)
        return self.linear(o.reshape(o.shape[0], H * Dv), p + "attn_output")

    def mla_attend(self, il, x, qr, pos, cache, q, k, v, last):
        """The absorbed MLA attention of layer il (q [n, H, C + R], k [n, 1, C + R], v the
        latent, K's first C values) over the cache: every earlier key (glm-dsa overrides it
        with its indexer's selection; x is the attention norm's output, qr the q latent)."""
        return cache.attend(il, self.ops, q, k, v, last, self.config.attn_scale, 0, 0.0)
