"""The fused decoder layers of decode rows (csrc/decode.c) as named parameter structs.

An architecture whose block is the dense pre-norm layer that csrc/decode.c computes (llama,
qwen2, qwen3, gemma3 without experts) declares ``fused_decode = True`` and builds one
``DenseLayerParams`` per layer (``Model.dense_layer_params``). The backend (``dense_layer``) packs it into the C
call by the slot names the extension exports (``_native.decode_layer_fields()``), so a field
is named once on each side and a mismatch is an error at build time, not a wrong number.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class DenseLayerParams:
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_ff: int
    n_rot: int
    window: int                 # sliding-window size, 0: full attention
    rope_neox: bool
    gelu: bool                  # FFN activation gelu-tanh (else silu)
    rope_base: float
    rope_freq_scale: float
    rms_eps: float
    attn_scale: float
    attn_softcap: float
    # matrix slot (attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down) -> tensor
    weights: dict[str, str] = field(default_factory=dict)
    types: dict[str, int] = field(default_factory=dict)       # slot -> GGML type id
    # vector slot (attn_norm, q_norm, k_norm, post_attention_norm, ffn_norm, post_ffw_norm,
    # bq, bk, bv, bo, freq_factors) -> float32 values; absent: not in this layer
    vecs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class MoeLayerParams:
    """A layer with routed experts for csrc/decode.c's MoE layer (``Model.moe_layer_params``):
    the attention of DenseLayerParams, then the routed experts (+ the shared expert)."""
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    n_rot: int
    window: int
    rope_neox: bool
    gelu: bool                  # experts' activation gelu-tanh (else silu)
    qk_norm_full: bool          # q_norm / k_norm over the whole projection (olmoe), else per head
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int             # 0: no shared expert
    sigmoid: bool               # router probabilities by sigmoid (else softmax)
    expert_weights_norm: bool
    shexp_gated: bool           # shared expert scaled by sigmoid(x . ffn_gate_inp_shexp) (qwen2moe)
    rope_base: float
    rope_freq_scale: float
    rms_eps: float
    attn_scale: float
    attn_softcap: float
    expert_weights_scale: float
    swiglu_oai: bool = False    # experts' activation gpt-oss's clamped SwiGLU
    softmax_weight: bool = False  # top-k by logit, weights a softmax over the chosen (gpt-oss)
    # YaRN as Model.rope applies it (ext_factor 0, attn_factor 1: none)
    yarn_ext_factor: float = 0.0
    yarn_attn_factor: float = 1.0
    yarn_corr_lo: float = 0.0
    yarn_corr_hi: float = 0.0
    # matrix slot (attn_q, ..., ffn_gate_inp, ffn_{gate,up,down}_exps, ffn_{gate,up,down}_shexp)
    # -> tensor (the shared expert's only where the layer has one)
    weights: dict[str, str] = field(default_factory=dict)
    types: dict[str, int] = field(default_factory=dict)
    # vector slot (attn_norm, q_norm, k_norm, ffn_norm, bq, bk, bv, bo, freq_factors,
    # router_bias, exp_probs_b, shexp_gate, sinks, gate_exps_b, up_exps_b, down_exps_b) ->
    # float32 values; absent: not in this layer
    vecs: dict[str, np.ndarray] = field(default_factory=dict)


def pack(p: DenseLayerParams | MoeLayerParams, fields) -> tuple[tuple, tuple, tuple, list[str]]:
    """(ints, floats, vecs) for decode_layer_new and the weight names in decode_batch's order,
    from ``fields`` = decode_layer_fields()."""
    ints, floats, wslots, vslots = fields
    known = set(p.weights) | set(p.vecs)
    unknown = known - set(wslots) - set(vslots)
    # a MoE layer without a shared expert leaves its 3 slots out (type -1)
    optional = {w for w in wslots if w.endswith("_shexp")} if isinstance(p, MoeLayerParams) else set()
    if unknown or set(wslots) - optional - set(p.weights):
        raise ValueError(f"layer slots {sorted(unknown or set(wslots) - optional - set(p.weights))} "
                         f"do not match the native layer's {wslots + vslots}")
    iv = tuple(int(getattr(p, k)) for k in ints) + tuple(int(p.types.get(w, -1)) for w in wslots)
    fv = tuple(float(getattr(p, k)) for k in floats)
    vv = tuple(p.vecs.get(v) for v in vslots)
    return iv, fv, vv, [p.weights[w] for w in wslots if w in p.weights]
