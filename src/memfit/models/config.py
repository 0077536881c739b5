"""ModelConfig: one flat dataclass read from GGUF metadata (keys as llama.cpp reads them)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import ModelError, UnsupportedError

_MISSING = object()


@dataclass
class ModelConfig:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_vocab: int
    rms_eps: float
    head_dim_k: int = 0            # 0: n_embd // n_head
    head_dim_v: int = 0
    n_rot: int = 0                 # 0: head_dim_k
    rope_base: float = 10000.0
    rope_base_swa: float = 10000.0  # gemma3 sliding-window layers
    rope_freq_scale: float = 1.0   # 1 / linear scaling factor
    rope_scaling: str = "none"     # none | linear | yarn
    # YaRN (rope_scaling "yarn"), as llama.cpp's context applies it: rope.scaling.*
    n_ctx_orig: int = 0            # rope.scaling.original_context_length
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_attn_factor: float = 1.0  # the rope's magnitude factor after llama.cpp's adjustment
    yarn_log_mul: float = 0.0      # rope.scaling.yarn_log_multiplier (deepseek2: mscale_all_dim)
    rope_neox: bool = False
    n_ctx_train: int = 0
    sliding_window: int = 0        # 0: no sliding-window layers
    swa_pattern: int = 0           # layer il is SWA unless (il + 1) % swa_pattern == 0
    attn_scale: float = 0.0        # 0: 1 / sqrt(head_dim_k)
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    embd_scale: float = 1.0        # gemma: sqrt(n_embd)
    # mixture of experts (n_expert 0: dense FFN)
    n_expert: int = 0
    n_expert_used: int = 0         # top-k
    n_ff_exp: int = 0              # rows of each routed expert's gate/up
    n_ff_shexp: int = 0            # shared expert (qwen2moe)
    expert_gating_func: str = "softmax"   # softmax | sigmoid | softmax_weight (ops/backend.py)
    expert_weights_norm: bool = False     # top-k weights renormalized to sum 1
    expert_weights_scale: float = 1.0     # top-k weights multiplied by this
    expert_group_count: int = 0           # group-limited routing: groups of experts (0: none)
    expert_group_used_count: int = 0      # ... of which the best this many are eligible
    n_layer_dense_lead: int = 0           # leading_dense_block_count: layers 0.. have a dense FFN
    n_layer_nextn: int = 0                # NextN/MTP layers after the n_layer computed ones
                                          # (in the file, never in the forward pass)
    # multi-head latent attention (deepseek2): low-rank q (0: a plain attn_q) and kv; the
    # per-head K/V sizes "decompressed" (key_length_mla = nope + rope dims, value_length_mla)
    q_lora_rank: int = 0
    indexer: tuple = (0, 0, 0)     # glm-dsa's sparse-attention indexer: heads, key length, top-k
    indexer_full: tuple = ()       # glm-dsa: per layer 1 = a full indexer layer, 0 = shared
    norm_eps: float = 1e-6         # attention.layer_norm_epsilon (glm-dsa's indexer LayerNorm)
    max_ctx: int = 0               # the architecture computes contexts up to this (0: any)
    max_ctx_why: str = ""
    kv_lora_rank: int = 0
    head_dim_k_mla: int = 0
    head_dim_v_mla: int = 0

    def __post_init__(self):
        def bad(k, v, why):
            raise ModelError(f"{self.arch}: {k} = {v} {why}; the file's metadata is invalid")
        for k in ("n_layer", "n_embd", "n_head", "n_head_kv", "n_vocab"):
            if getattr(self, k) <= 0:
                bad(k, getattr(self, k), "must be positive")
        if self.n_ff <= 0 and not self.n_expert:
            bad("n_ff (feed_forward_length)", self.n_ff, "must be positive")
        for k in ("head_dim_k", "head_dim_v", "n_rot", "n_ff", "sliding_window", "n_ctx_train"):
            if getattr(self, k) < 0:
                bad(k, getattr(self, k), "must not be negative")
        if not self.head_dim_k and self.n_embd % self.n_head:
            bad("head_count", self.n_head, f"does not divide embedding_length {self.n_embd}")
        self.head_dim_k = self.head_dim_k or self.n_embd // self.n_head
        self.head_dim_v = self.head_dim_v or self.head_dim_k
        self.n_rot = self.n_rot or self.head_dim_k
        self.attn_scale = self.attn_scale or 1.0 / math.sqrt(self.head_dim_k)
        if self.n_head % self.n_head_kv:
            raise ModelError(f"{self.arch}: head_count {self.n_head} is not a multiple of "
                             f"head_count_kv {self.n_head_kv}")
        if self.n_rot > self.head_dim_k or self.n_rot % 2:
            raise ModelError(f"{self.arch}: rope.dimension_count {self.n_rot} must be even and "
                             f"<= head dim {self.head_dim_k}")
        if not (self.rms_eps > 0 and math.isfinite(self.rms_eps)):
            bad("attention.layer_norm_rms_epsilon", self.rms_eps, "must be positive")
        if self.n_expert < 0:
            bad("expert_count", self.n_expert, "must not be negative")
        if self.n_expert:
            if not 1 <= self.n_expert_used <= self.n_expert:
                bad("expert_used_count", self.n_expert_used,
                    f"must be between 1 and expert_count {self.n_expert}")
            if self.n_ff_exp <= 0:
                bad("expert_feed_forward_length", self.n_ff_exp, "must be positive")
            if self.n_ff_shexp < 0:
                bad("expert_shared_feed_forward_length", self.n_ff_shexp, "must not be negative")
            if self.expert_gating_func not in ("softmax", "sigmoid", "softmax_weight"):
                raise UnsupportedError(f"{self.arch}: expert_gating_func {self.expert_gating_func!r}"
                                       f" is not supported (supported: softmax, sigmoid, "
                                       f"softmax_weight)")
            if not (self.expert_weights_scale > 0 and math.isfinite(self.expert_weights_scale)):
                bad("expert_weights_scale", self.expert_weights_scale, "must be positive")
            G, Gu = self.expert_group_count, self.expert_group_used_count
            if G < 0 or Gu < 0:
                bad("expert_group_count", G, "and expert_group_used_count must not be negative")
            if G > 1:
                if self.n_expert % G:
                    bad("expert_group_count", G, f"does not divide expert_count {self.n_expert}")
                if not 1 <= Gu <= G:
                    bad("expert_group_used_count", Gu, f"must be between 1 and expert_group_count {G}")
                if Gu * (self.n_expert // G) < self.n_expert_used:
                    bad("expert_group_used_count", Gu, f"leaves fewer experts than expert_used_count "
                        f"{self.n_expert_used}")
        if not 0 <= self.n_layer_dense_lead <= self.n_layer:
            bad("leading_dense_block_count", self.n_layer_dense_lead,
                f"must be between 0 and block_count {self.n_layer}")
        if self.n_layer_dense_lead and self.n_ff <= 0:
            bad("feed_forward_length", self.n_ff, "must be positive for the leading dense layers")
        if self.n_layer_nextn < 0:
            bad("nextn_predict_layers", self.n_layer_nextn, "must not be negative")

    def is_moe(self, il: int) -> bool:
        """Whether layer il's FFN is routed experts (else a dense gated FFN)."""
        return self.n_expert > 0 and il >= self.n_layer_dense_lead

    def is_swa(self, il: int) -> bool:
        return self.sliding_window > 0 and self.swa_pattern > 0 and (il + 1) % self.swa_pattern != 0

    @property
    def yarn(self) -> bool:
        return self.rope_scaling == "yarn"

    @property
    def v_in_k(self) -> bool:
        """Whether the KV cache holds V inside K (kv/storage.py kv_layout): absorbed MLA
        (deepseek2, glm-dsa) attends over one KV head of [latent C | rope R] with values the
        latent, K's first head_dim_v values, so only K is stored (as llama.cpp does)."""
        return self.head_dim_k_mla > 0

    @classmethod
    def from_metadata(cls, md: dict[str, Any]) -> "ModelConfig":
        """The one parser of hyperparameters (models, planner, synth all use it): keys as
        llama.cpp reads them, per-layer arrays only when uniform, ranges checked, then the
        architecture's own rules (spec.hparams)."""
        from .spec import ArchSpec, get_spec
        arch = md.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise ModelError("metadata has no general.architecture")
        spec = get_spec(arch) or ArchSpec(arch)

        def get(key: str, default: Any = _MISSING) -> Any:
            v = md.get(f"{arch}.{key}", default)
            if v is _MISSING:
                raise ModelError(f"metadata key {arch}.{key} is missing; the file is not a "
                                 f"complete {arch} model")
            return v

        def scalar(key: str, default: Any = _MISSING) -> Any:
            v = get(key, default)
            if isinstance(v, list):  # per-layer arrays: only uniform ones are supported
                if not v or any(x != v[0] for x in v):
                    raise UnsupportedError(f"{arch}.{key} varies per layer ({v[:8]}...); "
                                           f"memfit supports only uniform values")
                v = v[0]
            return v

        def num(key: str, default: Any = _MISSING, typ=int) -> Any:
            v = scalar(key, default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) \
                    or (typ is int and v != int(v)):
                raise ModelError(f"metadata key {arch}.{key} = {v!r} is not a number of type "
                                 f"{typ.__name__}; the file's metadata is invalid")
            return typ(v)

        n_vocab = md.get(f"{arch}.vocab_size") or len(md.get("tokenizer.ggml.tokens") or [])
        n_embd = num("embedding_length")
        n_head = num("attention.head_count")
        n_expert = num("expert_count", 0)
        kw: dict[str, Any] = dict(
            arch=arch,
            n_layer=num("block_count"),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=num("attention.head_count_kv", n_head),
            n_ff=num("feed_forward_length", 0 if n_expert else _MISSING),
            n_vocab=int(n_vocab),
            rms_eps=num("attention.layer_norm_rms_epsilon", 1e-5, float),
            head_dim_k=num("attention.key_length", 0),
            head_dim_v=num("attention.value_length", 0),
            n_rot=num("rope.dimension_count", 0),
            rope_base=num("rope.freq_base", 10000.0, float),
            n_ctx_train=num("context_length", 0),
            attn_scale=num("attention.scale", 0.0, float),
            attn_softcap=num("attn_logit_softcapping", 0.0, float),
            final_softcap=num("final_logit_softcapping", 0.0, float),
            rope_neox=spec.rope_neox,
        )
        for k, key in (("head_dim_k", "attention.key_length"), ("head_dim_v", "attention.value_length")):
            if f"{arch}.{key}" in md and kw[k] <= 0:
                raise ModelError(f"{arch}: {key} = {kw[k]} must be positive; the file's metadata "
                                 f"is invalid")
        if f"{arch}.rope.dimension_count" in md and kw["n_rot"] <= 0:
            raise ModelError(f"{arch}: rope.dimension_count = {kw['n_rot']} must be positive; "
                             f"the file's metadata is invalid")
        # rope scaling: linear, or yarn for the architectures whose graph applies it
        stype = str(get("rope.scaling.type", "none") or "none")
        factor = float(get("rope.scaling.factor", 0.0) or get("rope.scale_linear", 0.0) or 0.0)
        if stype not in ("none", "linear") and not (stype == "yarn" and (factor <= 1.0 or spec.yarn)):
            raise UnsupportedError(f"{arch}: rope scaling type {stype!r} is not supported "
                                   f"(supported: none, linear{', yarn' if spec.yarn else ''})")
        if stype == "yarn" and factor <= 1.0:
            stype = "none"
        kw["rope_scaling"] = stype
        if factor > 0.0 and stype != "none":
            kw["rope_freq_scale"] = 1.0 / factor
        if stype == "yarn":
            kw.update(_yarn(get, num, arch, factor, kw))
        if n_expert and spec.moe == "never":
            raise UnsupportedError(f"{arch}: expert_count {n_expert} > 0, but memfit runs {arch} "
                                   f"only dense; mixture-of-experts architectures: "
                                   f"llama (Mixtral), qwen2moe, qwen3moe, olmoe")
        if spec.moe == "always" and n_expert <= 0:
            raise ModelError(f"{arch}: expert_count = {n_expert} must be positive for this "
                             f"mixture-of-experts architecture")
        if n_expert:
            used = num("expert_used_count", 0)
            n_ff = kw["n_ff"]
            # as llama.cpp's loaders: the key (else n_ff / k) for qwen*moe, n_ff for llama/olmoe
            ff_exp = (num("expert_feed_forward_length", 0) or n_ff // max(used, 1)) \
                if spec.n_ff_exp_key else n_ff
            gating = num("expert_gating_func", 0)
            names = {0: spec.gating_default, 1: "softmax", 2: "sigmoid", 3: "softmax_weight"}
            if gating not in names:
                raise UnsupportedError(f"{arch}: expert_gating_func {gating} is not supported "
                                       f"(1: softmax, 2: sigmoid, 3: softmax_weight)")
            kw.update(n_expert=n_expert, n_expert_used=used, n_ff_exp=ff_exp,
                      n_ff_shexp=(num("expert_shared_feed_forward_length", 0) or n_ff)
                      if spec.shared_expert else 0,
                      expert_weights_norm=spec.expert_weights_norm)
            if spec.routing_keys:  # else the architecture's fixed rule, as llama.cpp's graph
                kw.update(expert_gating_func=names[gating],
                          expert_weights_norm=bool(scalar("expert_weights_norm",
                                                          spec.expert_weights_norm)),
                          expert_weights_scale=num("expert_weights_scale", 0.0, float) or 1.0,
                          expert_group_count=num("expert_group_count", 0),
                          expert_group_used_count=num("expert_group_used_count", 0),
                          n_layer_dense_lead=num("leading_dense_block_count", 0))
            if spec.shared_expert and kw["n_ff_shexp"] <= 0:
                raise ModelError(f"{arch}: expert_shared_feed_forward_length (or "
                                 f"feed_forward_length) must be positive for the shared expert")
        if spec.hparams is not None:
            kw = spec.hparams(md, arch, kw)
        return cls(**kw)


def _yarn(get, num, arch: str, factor: float, kw: dict) -> dict:
    """YaRN's parameters as llama.cpp's context sets them (llama-context.cpp, and the
    yarn_attn_factor adjustment of llama_hparams): the rope's magnitude factor is chosen so
    that ggml's rope_yarn, which multiplies by 1 + 0.1 ln(factor), ends at the model's mscale."""
    n_orig = num("rope.scaling.original_context_length", 0) or kw.get("n_ctx_train", 0)
    if n_orig <= 0:
        raise ModelError(f"{arch}: yarn rope scaling needs rope.scaling.original_context_length")
    beta_fast = num("rope.scaling.yarn_beta_fast", 32.0, float) or 32.0
    beta_slow = num("rope.scaling.yarn_beta_slow", 1.0, float) or 1.0
    ext = num("rope.scaling.yarn_ext_factor", -1.0, float)
    if ext not in (-1.0, 1.0):
        raise UnsupportedError(f"{arch}: rope.scaling.yarn_ext_factor {ext} is not supported (1)")
    log_mul = num("rope.scaling.yarn_log_multiplier", 0.0, float)
    if arch == "deepseek2":   # the converter stores 0.1 * mscale_all_dim
        log_mul /= 0.1

    def g(s, m):
        return 1.0 if s <= 1.0 else 1.0 + 0.1 * m * math.log(s)
    if log_mul != 0.0:
        m = log_mul if arch == "deepseek2" and log_mul != 1.0 else 1.0
        attn = g(factor, m) / g(factor, log_mul)
    else:
        attn = g(factor, 1.0)
    attn /= 1.0 + 0.1 * math.log(factor)
    attn *= num("rope.scaling.attn_factor", 1.0, float) or 1.0
    return dict(n_ctx_orig=n_orig, yarn_beta_fast=beta_fast, yarn_beta_slow=beta_slow,
                yarn_attn_factor=attn, yarn_log_mul=log_mul)

