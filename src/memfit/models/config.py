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
    rope_scaling: str = "none"
    rope_neox: bool = False
    n_ctx_train: int = 0
    sliding_window: int = 0        # 0: no sliding-window layers
    swa_pattern: int = 0           # layer il is SWA unless (il + 1) % swa_pattern == 0
    attn_scale: float = 0.0        # 0: 1 / sqrt(head_dim_k)
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    embd_scale: float = 1.0        # gemma: sqrt(n_embd)

    def __post_init__(self):
        self.head_dim_k = self.head_dim_k or self.n_embd // self.n_head
        self.head_dim_v = self.head_dim_v or self.head_dim_k
        self.n_rot = self.n_rot or self.head_dim_k
        self.attn_scale = self.attn_scale or 1.0 / math.sqrt(self.head_dim_k)
        for k in ("n_layer", "n_embd", "n_head", "n_head_kv", "n_ff", "n_vocab"):
            if getattr(self, k) <= 0:
                raise ModelError(f"{self.arch}: {k} = {getattr(self, k)} must be positive")
        if self.n_head % self.n_head_kv:
            raise ModelError(f"{self.arch}: head_count {self.n_head} is not a multiple of "
                             f"head_count_kv {self.n_head_kv}")
        if self.n_rot > self.head_dim_k or self.n_rot % 2:
            raise ModelError(f"{self.arch}: rope.dimension_count {self.n_rot} must be even and "
                             f"<= head dim {self.head_dim_k}")

    def is_swa(self, il: int) -> bool:
        return self.sliding_window > 0 and self.swa_pattern > 0 and (il + 1) % self.swa_pattern != 0

    @classmethod
    def from_metadata(cls, md: dict[str, Any]) -> "ModelConfig":
        arch = md.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise ModelError("metadata has no general.architecture")

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

        n_vocab = md.get(f"{arch}.vocab_size") or len(md.get("tokenizer.ggml.tokens") or [])
        n_embd = int(scalar("embedding_length"))
        n_head = int(scalar("attention.head_count"))
        kw: dict[str, Any] = dict(
            arch=arch,
            n_layer=int(get("block_count")),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=int(scalar("attention.head_count_kv", n_head)),
            n_ff=int(scalar("feed_forward_length")),
            n_vocab=int(n_vocab),
            rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            head_dim_k=int(get("attention.key_length", 0)),
            head_dim_v=int(get("attention.value_length", 0)),
            n_rot=int(get("rope.dimension_count", 0)),
            rope_base=float(get("rope.freq_base", 10000.0)),
            n_ctx_train=int(get("context_length", 0)),
            attn_scale=float(get("attention.scale", 0.0)),
            attn_softcap=float(get("attn_logit_softcapping", 0.0)),
            final_softcap=float(get("final_logit_softcapping", 0.0)),
        )
        # rope scaling: linear only (yarn / longrope change the rotation itself)
        stype = str(get("rope.scaling.type", "none") or "none")
        factor = float(get("rope.scaling.factor", 0.0) or get("rope.scale_linear", 0.0) or 0.0)
        if stype not in ("none", "linear") and not (stype == "yarn" and factor <= 1.0):
            raise UnsupportedError(f"{arch}: rope scaling type {stype!r} is not supported "
                                   f"(supported: none, linear)")
        kw["rope_scaling"] = stype
        if factor > 0.0 and stype != "none":
            kw["rope_freq_scale"] = 1.0 / factor
        return cls(**_ARCH_DEFAULTS.get(arch, _no_defaults)(md, arch, kw))


def _no_defaults(md, arch, kw):
    return kw


def _neox(md, arch, kw):
    kw["rope_neox"] = True
    return kw


def _gemma3(md, arch, kw):
    kw["rope_neox"] = True
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


_ARCH_DEFAULTS = {"qwen2": _neox, "qwen3": _neox, "gemma3": _gemma3}
