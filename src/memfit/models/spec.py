"""One description per architecture: block flags, hyperparameter rules and the tensor table.

The models (layers.Model), the planner (memory/planner.py), `memfit synth` (synth.py) and the
test-model writer (models/synthetic.py) all read this, so a layer's tensors are written once:

    spec = get_spec(arch)                       # ArchSpec (the registry is models.REGISTRY)
    config = ModelConfig.from_metadata(md)      # hyperparameters, by spec.hparams rules
    spec.tensors(config)                        # [Tensor(name, numpy shape, required, role)]
    write_hparams(gguf_writer, config)          # the metadata keys from_metadata reads back
    config_from_gguf(f, check=True)             # config + every tensor checked, no data read
    tensor_roles(f)                             # name -> trunk | router | expert | shexp

Adding an architecture: one file with ``SPEC = ArchSpec(...)`` and a Model subclass, and one
line in models/__init__.py's REGISTRY.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..errors import ModelError, UnsupportedError
from ..quant.tables import ensure as ensure_tables
from ..quant.types import SUPPORTED, TYPES

if TYPE_CHECKING:
    from .config import ModelConfig

TRUNK, ROUTER, EXPERT, SHEXP = "trunk", "router", "expert", "shexp"
SKIP = "skip"   # in the file, never computed (NextN/MTP layers): not loaded, not in the plan
EXPERT_MATS = ("gate", "up", "down")   # blk.{il}.ffn_{m}_exps.weight, stacked over experts


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]   # numpy order (GGUF ne reversed)
    required: bool = True
    role: str = TRUNK        # trunk | router | expert (stacked routed experts) | shexp | skip

    @property
    def layer(self) -> int | None:
        return int(self.name.split(".")[1]) if self.name.startswith("blk.") else None


@dataclass(frozen=True)
class ArchSpec:
    name: str
    act: str = "silu"             # gated FFN activation: silu | gelu
    rope_neox: bool = False       # rotate (i, i + n_rot/2) instead of adjacent pairs
    qkv_bias: bool = False        # Q/K/V biases required (else optional)
    qk_norm: str = ""             # "" | "head" (per head: qwen3, gemma3) | "full" (whole vector: olmoe)
    post_norms: bool = False      # RMS norm of attention and FFN outputs too (gemma3)
    rope_freqs: bool = False      # optional rope_freqs.weight (llama3 frequency factors)
    moe: str = "never"            # routed experts: never | optional (llama: Mixtral) | always
    shared_expert: bool = False   # qwen2moe: ffn_*_shexp gated by sigmoid(ffn_gate_inp_shexp . x)
    expert_weights_norm: bool = False   # renormalize the top-k weights
    routing_keys: bool = False    # read expert_gating_func / _weights_norm / _weights_scale from the
                                  # file (llama.cpp does for deepseek-style archs; its llama,
                                  # qwen2moe, qwen3moe and olmoe graphs fix softmax, their own
                                  # norm rule and no scale, whatever the file says)
    n_ff_exp_key: bool = False    # experts' rows from expert_feed_forward_length (else n_ff /
                                  # n_expert_used); without it they are feed_forward_length
                                  # (llama.cpp's llama and olmoe loaders ignore the key)
    gating_default: str = "softmax"     # expert_gating_func 0 (absent): the arch's router
    yarn: bool = False                  # the graph applies YaRN rope scaling (factor > 1)
    hparams: Callable | None = None     # extra metadata rules: (md, arch, kw) -> kw
    layer_table: Callable | None = None  # (config, il) -> [Tensor]: the arch's own layer
                                         # table (else the flag table below); il runs over
                                         # the NextN layers too (n_layer..)
    write_extra: Callable | None = None  # (gguf writer, config): the arch's own metadata keys
    synth_optional: tuple = ()           # name suffixes of optional tensors that published
                                         # files carry: the synthetic writers write them

    # --- tensors -------------------------------------------------------------------------
    def layer_tensors(self, c: "ModelConfig", il: int) -> list[Tensor]:
        if self.layer_table is not None:
            return self.layer_table(c, il)
        p, E = f"blk.{il}.", c.n_embd
        q_dim, k_dim = c.n_head * c.head_dim_k, c.n_head_kv * c.head_dim_k
        T = Tensor
        t = [T(p + "attn_norm.weight", (E,))] + attn_tensors(c, il, self.qkv_bias)
        if self.qk_norm == "head":
            t += [T(p + "attn_q_norm.weight", (c.head_dim_k,)), T(p + "attn_k_norm.weight", (c.head_dim_k,))]
        elif self.qk_norm == "full":
            t += [T(p + "attn_q_norm.weight", (q_dim,)), T(p + "attn_k_norm.weight", (k_dim,))]
        if self.post_norms:
            t.append(T(p + "post_attention_norm.weight", (E,)))
        t.append(T(p + "ffn_norm.weight", (E,)))
        if c.is_moe(il):
            t += moe_tensors(c, il)
            if self.shared_expert:
                t += [T(p + "ffn_gate_inp_shexp.weight", (E,), role=SHEXP),
                      *ffn_tensors(c, il, "_shexp", c.n_ff_shexp, SHEXP)]
        else:
            t += ffn_tensors(c, il)
        if self.post_norms:
            t.append(T(p + "post_ffw_norm.weight", (E,)))
        return t

    def tensors(self, c: "ModelConfig") -> list[Tensor]:
        """Every tensor of the model in llama.cpp's file order (optional ones included)."""
        t = [Tensor("token_embd.weight", (c.n_vocab, c.n_embd))]
        if self.rope_freqs:
            t.append(Tensor("rope_freqs.weight", (c.n_rot // 2,), False))
        for il in range(c.n_layer + c.n_layer_nextn):
            t += self.layer_tensors(c, il)
        t += [Tensor("output_norm.weight", (c.n_embd,)),
              Tensor("output.weight", (c.n_vocab, c.n_embd), False)]
        return t


def get_spec(arch: str) -> ArchSpec | None:
    from . import REGISTRY
    cls = REGISTRY.get(arch)
    return None if cls is None else cls.spec


def check_tensors(spec: ArchSpec, c: "ModelConfig", info) -> None:
    """Presence, shape and type of every tensor, from ``info(name) -> (shape, type) | None``
    (no data touched): the same errors at plan time as at load time."""
    for t in spec.tensors(c):
        got = info(t.name)
        if got is None:
            if t.required:
                raise ModelError(f"tensor {t.name} is missing; {spec.name} needs it with shape "
                                 f"{t.shape}")
            continue
        shape, qtype = got
        if tuple(shape) != t.shape:
            what = " (stacked experts: n_expert, rows, cols)" if t.role == EXPERT else ""
            raise ModelError(f"tensor {t.name} has shape {tuple(shape)}, expected {t.shape}{what} "
                             f"for this {spec.name} config")
        if qtype.id not in SUPPORTED:
            names = ", ".join(sorted(TYPES[i].name for i in SUPPORTED))
            raise UnsupportedError(f"tensor {t.name} has type {qtype.name}, which memfit cannot "
                                   f"compute with; supported types: {names}")
        ensure_tables(qtype.id)  # the IQ lattice tables, when this type reads them


def config_from_gguf(f, check: bool = False) -> "ModelConfig":
    """ModelConfig of an open GGUFFile (vocab size from token_embd when the metadata has none);
    with check, every tensor is checked against the architecture's table too."""
    from .config import ModelConfig
    md = f.metadata
    arch = md.get("general.architecture")
    if check and get_spec(arch) is None:
        raise UnsupportedError(f"architecture {arch!r} is not supported; supported: "
                               f"{', '.join(sorted(_registry()))}")
    if isinstance(arch, str) and not md.get(f"{arch}.vocab_size") \
            and not md.get("tokenizer.ggml.tokens") and "token_embd.weight" in f.tensors:
        md = {**md, f"{arch}.vocab_size": f.tensors["token_embd.weight"].shape[0]}
    c = ModelConfig.from_metadata(md)
    if check:
        def info(name):
            t = f.tensors.get(name)
            return None if t is None else (t.shape, t.type)
        check_tensors(get_spec(c.arch), c, info)
    return c


def tensor_roles(f) -> dict[str, str]:
    """name -> trunk | router | expert | shexp for every tensor of an open GGUFFile (the
    planner's and the store's view of an MoE file); unknown extra tensors are trunk."""
    c = config_from_gguf(f)
    spec = get_spec(c.arch) or ArchSpec(c.arch)
    roles = {t.name: t.role for t in spec.tensors(c)}
    return {name: roles.get(name, TRUNK) for name in f.tensors}


def write_hparams(w, c: "ModelConfig", tied: bool = True) -> None:
    """Write the metadata keys ModelConfig.from_metadata reads for config c (gguf.GGUFWriter)."""
    a = c.arch
    w.add_uint32(f"{a}.block_count", c.n_layer + c.n_layer_nextn)
    w.add_uint32(f"{a}.context_length", c.n_ctx_train)
    w.add_uint32(f"{a}.embedding_length", c.n_embd)
    w.add_uint32(f"{a}.feed_forward_length", c.n_ff)
    w.add_uint32(f"{a}.attention.head_count", c.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", c.n_head_kv)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", c.rms_eps)
    w.add_float32(f"{a}.rope.freq_base", c.rope_base)
    w.add_uint32(f"{a}.rope.dimension_count", c.n_rot)
    w.add_uint32(f"{a}.vocab_size", c.n_vocab)
    if c.head_dim_k != c.n_embd // c.n_head or c.head_dim_v != c.head_dim_k:
        w.add_uint32(f"{a}.attention.key_length", c.head_dim_k)
        w.add_uint32(f"{a}.attention.value_length", c.head_dim_v)
    if c.sliding_window:
        w.add_uint32(f"{a}.attention.sliding_window", c.sliding_window)
    if c.rope_scaling in ("linear", "yarn"):
        w.add_string(f"{a}.rope.scaling.type", c.rope_scaling)
        w.add_float32(f"{a}.rope.scaling.factor", 1.0 / c.rope_freq_scale)
    if c.rope_scaling == "yarn":
        w.add_uint32(f"{a}.rope.scaling.original_context_length", c.n_ctx_orig)
        if c.yarn_log_mul:   # deepseek2's converter stores 0.1 * mscale_all_dim
            w.add_float32(f"{a}.rope.scaling.yarn_log_multiplier",
                          c.yarn_log_mul * (0.1 if a == "deepseek2" else 1.0))
    if c.final_softcap:
        w.add_float32(f"{a}.final_logit_softcapping", c.final_softcap)
    if c.n_expert:
        w.add_uint32(f"{a}.expert_count", c.n_expert)
        w.add_uint32(f"{a}.expert_used_count", c.n_expert_used)
        spec = get_spec(a)
        if spec is None or spec.n_ff_exp_key:
            w.add_uint32(f"{a}.expert_feed_forward_length", c.n_ff_exp)
        if c.n_ff_shexp:
            w.add_uint32(f"{a}.expert_shared_feed_forward_length", c.n_ff_shexp)
        if spec is not None and spec.routing_keys:
            w.add_uint32(f"{a}.expert_gating_func", GATING_IDS[c.expert_gating_func])
            w.add_bool(f"{a}.expert_weights_norm", c.expert_weights_norm)
            if c.expert_weights_scale != 1.0:
                w.add_float32(f"{a}.expert_weights_scale", c.expert_weights_scale)
            if c.expert_group_count:
                w.add_uint32(f"{a}.expert_group_count", c.expert_group_count)
                w.add_uint32(f"{a}.expert_group_used_count", c.expert_group_used_count)
            if c.n_layer_dense_lead:
                w.add_uint32(f"{a}.leading_dense_block_count", c.n_layer_dense_lead)
    spec = get_spec(a)
    if spec is not None and spec.write_extra is not None:
        spec.write_extra(w, c)


# llama.cpp's llama_expert_gating_func_type (0: none, the architecture's default)
GATING_IDS = {"softmax": 1, "sigmoid": 2, "softmax_weight": 3}


# --- pieces of layer tables (architecture files compose theirs from these) -----------------
def attn_tensors(c: "ModelConfig", il: int, bias: bool = False) -> list[Tensor]:
    """Q/K/V projections (+ biases, required when ``bias``) and the output projection (its
    bias optional)."""
    p, E = f"blk.{il}.", c.n_embd
    q, k, v = c.n_head * c.head_dim_k, c.n_head_kv * c.head_dim_k, c.n_head_kv * c.head_dim_v
    return [Tensor(p + "attn_q.weight", (q, E)), Tensor(p + "attn_k.weight", (k, E)),
            Tensor(p + "attn_v.weight", (v, E)),
            Tensor(p + "attn_q.bias", (q,), bias), Tensor(p + "attn_k.bias", (k,), bias),
            Tensor(p + "attn_v.bias", (v,), bias),
            Tensor(p + "attn_output.weight", (E, c.n_head * c.head_dim_v)),
            Tensor(p + "attn_output.bias", (E,), False)]


def ffn_tensors(c: "ModelConfig", il: int, suffix: str = "", n_ff: int | None = None,
                role: str = TRUNK) -> list[Tensor]:
    """A gated FFN's ffn_{gate,up,down}{suffix} (suffix "_shexp": a shared expert)."""
    p, E, F = f"blk.{il}.", c.n_embd, n_ff or c.n_ff
    return [Tensor(p + f"ffn_gate{suffix}.weight", (F, E), role=role),
            Tensor(p + f"ffn_up{suffix}.weight", (F, E), role=role),
            Tensor(p + f"ffn_down{suffix}.weight", (E, F), role=role)]


def moe_tensors(c: "ModelConfig", il: int, probs_bias: bool = False) -> list[Tensor]:
    """The router (+ the selection bias exp_probs_b, required when ``probs_bias``) and the
    stacked routed experts."""
    p, E, X, F = f"blk.{il}.", c.n_embd, c.n_expert, c.n_ff_exp
    t = [Tensor(p + "ffn_gate_inp.weight", (X, E), role=ROUTER)]
    if probs_bias:
        t.append(Tensor(p + "exp_probs_b.bias", (X,), role=ROUTER))
    return t + [Tensor(p + "ffn_gate_exps.weight", (X, F, E), role=EXPERT),
                Tensor(p + "ffn_up_exps.weight", (X, F, E), role=EXPERT),
                Tensor(p + "ffn_down_exps.weight", (X, E, F), role=EXPERT)]


def nextn_tensors(c: "ModelConfig", il: int) -> list[Tensor]:
    """A NextN (MTP) layer's own tensors, after its ordinary layer's (glm4moe, glm-dsa)."""
    p, E = f"blk.{il}.", c.n_embd
    return [Tensor(p + "nextn.eh_proj.weight", (E, 2 * E)), Tensor(p + "nextn.enorm.weight", (E,)),
            Tensor(p + "nextn.hnorm.weight", (E,)),
            Tensor(p + "nextn.embed_tokens.weight", (c.n_vocab, E), False),
            Tensor(p + "nextn.shared_head_head.weight", (c.n_vocab, E), False),
            Tensor(p + "nextn.shared_head_norm.weight", (E,), False)]


def as_skipped(ts: list[Tensor]) -> list[Tensor]:
    return [Tensor(t.name, t.shape, t.required, SKIP) for t in ts]


def _registry():
    from . import REGISTRY
    return REGISTRY


__all__ = ["ArchSpec", "Tensor", "TRUNK", "ROUTER", "EXPERT", "SHEXP", "SKIP", "get_spec",
           "attn_tensors", "ffn_tensors", "moe_tensors", "nextn_tensors", "as_skipped",
           "check_tensors", "config_from_gguf", "tensor_roles", "write_hparams", "GATING_IDS"]
