"""Tiny complete model GGUFs with random weights, for tests (any architecture, any type).

    write_tiny_model(path, arch, qtype_name, seed, **overrides) -> Path

The tensor table and the metadata keys come from the architecture's spec (models/spec.py), so
the file is what the model code reads back. 2-D and stacked expert weights are random valid
blocks of `qtype_name` (memfit.quant.random), routers (ffn_gate_inp) F32 as llama-quantize
keeps them, 1-D norms, biases and the shared-expert gate F32. The file carries full metadata
and a small gpt2 byte-level BPE tokenizer (256 byte tokens + a few merges + ChatML specials),
so the tokenizer can load it too.
Overrides: n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, n_ctx, rope_base,
rope_scale (linear factor), sliding_window, final_softcap, tied (bool), skip (tensor names to
leave out), optional (name suffixes of optional tensors to write too), the ModelConfig fields
in _CONFIG_KEYS (n_rot, n_layer_dense_lead, n_layer_nextn, expert_group_*), shapes ({name: shape} to write instead), types ({name: type name}), arrays
({name: float32 array} written as F32 as given); experts: n_expert, n_expert_used, n_ff_exp,
n_ff_shexp, gating ("softmax" | "sigmoid"), expert_weights_norm (None: the arch's rule),
expert_weights_scale (the last three for architectures whose spec reads them, routing_keys),
metadata ({key: value} written as given, after the rest; lists as arrays), chat_template (the
jinja text to write instead of the ChatML one).
arch "mixtral" writes a llama file with experts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..quant.types import BY_NAME

_DEFAULTS = dict(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, head_dim=64, n_ff=512,
                 n_ctx=512, rope_base=10000.0, rope_scale=0.0, sliding_window=0,
                 final_softcap=0.0, tied=True, n_expert=0, n_expert_used=0, n_ff_exp=0,
                 n_ff_shexp=0, gating="softmax", expert_weights_norm=None,
                 expert_weights_scale=1.0)
_MOE = dict(n_expert=8, n_expert_used=2, n_ff_exp=256)   # rows of 256: k-quants fit
_ARCH_DEFAULTS = {
    "qwen3": dict(head_dim=128),                        # head dim != n_embd / n_head
    "gemma3": dict(head_dim=128, n_head_kv=1, sliding_window=4, rope_base=1e6),
    "qwen3moe": dict(_MOE, head_dim=128, rope_base=1e6),
    "qwen2moe": dict(_MOE, n_ff_shexp=256, rope_base=1e6),
    "olmoe": dict(_MOE),
    "mixtral": dict(_MOE, n_expert=4),
    # a dense first layer, two routed ones, one NextN layer; partial rotary (32 of 64)
    "glm4moe": dict(_MOE, n_layer=3, n_layer_dense_lead=1, n_layer_nextn=1, n_rot=32,
                    n_ff_shexp=256, gating="sigmoid", expert_weights_norm=True,
                    expert_weights_scale=1.5, rope_base=1e6),
    # MLA: latent 256 + rope 32 in one KV head; per head nope 64, values 64; q rank 256;
    # 8 experts in 4 groups (2 used), 1 shared, one dense leading layer
    "deepseek2": dict(_MOE, n_layer=3, n_head_kv=1, head_dim=64, head_dim_k=288, head_dim_v=256,
                      n_rot=32, q_lora_rank=256, kv_lora_rank=256, head_dim_k_mla=96,
                      head_dim_v_mla=64, n_layer_dense_lead=1, n_ff_shexp=256,
                      expert_group_count=4, expert_group_used_count=2, gating="sigmoid",
                      expert_weights_norm=True, expert_weights_scale=2.5),
}
# gpt-oss: heads of 64 (4 x 64 != n_embd), window 4, 8 experts (2 used), YaRN x32 over 128
_ARCH_DEFAULTS["gpt-oss"] = dict(_MOE, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
                                 sliding_window=4, rope_base=150000.0, rope_scaling="yarn",
                                 rope_freq_scale=1 / 32, n_ctx_orig=128)
# GLM-5: deepseek2's layer with glm4moe's NextN layer and an indexer (2 heads of 64, top 64)
_ARCH_DEFAULTS["glm-dsa"] = dict(_ARCH_DEFAULTS["deepseek2"], n_layer_nextn=1, expert_group_count=0,
                                 expert_group_used_count=0, expert_weights_scale=1.0,
                                 indexer=(2, 64, 64))
# ModelConfig fields a writer override may set directly
_CONFIG_KEYS = ("n_rot", "n_layer_dense_lead", "n_layer_nextn", "expert_group_count",
                "expert_group_used_count", "q_lora_rank", "kv_lora_rank", "head_dim_k_mla",
                "head_dim_v_mla", "head_dim_k", "head_dim_v", "indexer", "rope_scaling",
                "rope_freq_scale", "n_ctx_orig", "indexer_full")
_WORDS = ["Ġthe", "Ġand", "Ġof", "Ġto", "Ġa", "Ġin", "Ġis", "Ġit", "Ġhello", "Ġworld",
          "ing", "er", "on", "Ġthat", "Ġfor", "Ġwith", "Ġas", "Ġwas", "Ġhe", "Ġon"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_chars() -> list[str]:
    # GPT-2 byte -> printable unicode map, in byte order
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token_types, merges): bytes, merged words (built left to right), specials."""
    tokens = _byte_chars()
    have, merges = set(tokens), []
    for w in _WORDS:
        cur = w[0]
        for ch in w[1:]:
            m = f"{cur} {ch}"
            cur += ch
            if cur not in have:
                have.add(cur)
                tokens.append(cur)
                merges.append(m)
    types = [1] * len(tokens) + [3] * len(SPECIALS)
    return tokens + SPECIALS, types, merges


def tiny_config(arch: str, n_vocab: int, p: dict):
    """ModelConfig of a tiny model from the writer's parameters (arch as written in the file)."""
    from .config import ModelConfig
    from .spec import ArchSpec, get_spec
    spec = get_spec(arch) or ArchSpec(arch)
    n_expert = p["n_expert"]
    norm = p["expert_weights_norm"]
    keys = spec.routing_keys   # else the architecture's fixed routing rule
    # llama (Mixtral) and olmoe experts have feed_forward_length rows
    n_ff = p["n_ff_exp"] if n_expert and not spec.n_ff_exp_key else p["n_ff"]
    kw = dict(
        arch=arch, n_layer=p["n_layer"], n_embd=p["n_embd"], n_head=p["n_head"],
        n_head_kv=p["n_head_kv"], n_ff=n_ff, n_vocab=n_vocab, rms_eps=1e-6,
        head_dim_k=p["head_dim"], head_dim_v=p["head_dim"], n_rot=p["head_dim"],
        rope_base=p["rope_base"], rope_freq_scale=1.0 / p["rope_scale"] if p["rope_scale"] else 1.0,
        rope_scaling="linear" if p["rope_scale"] else "none", n_ctx_train=p["n_ctx"],
        sliding_window=p["sliding_window"], final_softcap=p["final_softcap"],
        n_expert=n_expert, n_expert_used=p["n_expert_used"] if n_expert else 0,
        n_ff_exp=p["n_ff_exp"] if n_expert else 0,
        n_ff_shexp=p["n_ff_shexp"] if n_expert else 0,
        expert_gating_func=p["gating"] if keys else "softmax",
        expert_weights_norm=spec.expert_weights_norm if norm is None or not keys else bool(norm),
        expert_weights_scale=p["expert_weights_scale"] if keys else 1.0)
    kw.update({k: p[k] for k in _CONFIG_KEYS if k in p})
    return spec, ModelConfig(**kw)


def write_tensor_data(w, name: str, shape: tuple[int, ...], qt, rng, scale: float | None = None):
    """Add one random tensor to a gguf.GGUFWriter: F32 vectors around 1 (norms) or 0 (biases,
    gates), random valid blocks of qt for matrices and stacked experts."""
    import gguf

    from ..quant.random import random_weight
    if len(shape) == 1 and qt.name == "F32":
        base = 1.0 if "norm" in name else 0.0
        w.add_tensor(name, (base + 0.2 * rng.standard_normal(shape)).astype(np.float32))
        return
    rows, cols = (1, shape[0]) if len(shape) == 1 else (int(np.prod(shape[:-1])), shape[-1])
    kw = {} if scale is None else {"scale": scale}
    try:
        raw = random_weight(qt, (rows, cols), rng, **kw)
    except Exception:  # a type memfit cannot generate (error tests): any bytes will do
        raw = np.frombuffer(rng.bytes(rows * qt.row_bytes(cols)), np.uint8).reshape(rows, -1)
    if qt.name == "F32":
        w.add_tensor(name, raw.view(np.float32).reshape(shape))
    else:
        w.add_tensor(name, raw.reshape(*shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType(qt.id))


def write_tiny_model(path, arch: str, qtype_name: str, seed: int = 0, **overrides) -> Path:
    import gguf

    from .spec import ROUTER, write_hparams

    p = {**_DEFAULTS, **_ARCH_DEFAULTS.get(arch, {}), **overrides}
    if arch == "mixtral":
        arch = "llama"
    skip = set(p.pop("skip", ()) or ())
    optional = p.pop("optional", None)   # name suffixes of optional tensors to write
    shapes = dict(p.pop("shapes", {}) or {})
    types = dict(p.pop("types", {}) or {})
    arrays = dict(p.pop("arrays", {}) or {})
    extra_md = dict(p.pop("metadata", {}) or {})
    chat_template = p.pop("chat_template", None) or CHAT_TEMPLATE
    rng = np.random.default_rng(seed)
    tokens, ttypes, merges = tiny_vocab()
    n_vocab = len(tokens)
    spec, cfg = tiny_config(arch, n_vocab, p)
    optional = tuple(spec.synth_optional if optional is None else optional)

    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}-{qtype_name}")
    write_hparams(w, cfg)
    for k, v in extra_md.items():
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_int32(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, (list, tuple)):
            w.add_array(k, list(v))   # element type from the first value (int: int32)
        else:
            w.add_string(k, v)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(ttypes)
    w.add_token_merges(merges)
    w.add_bos_token_id(n_vocab - 3)
    w.add_eos_token_id(n_vocab - 1)
    w.add_add_bos_token(False)
    w.add_chat_template(chat_template)

    for t in spec.tensors(cfg):
        if t.name in skip or not (t.required or (t.name == "output.weight" and not p["tied"])
                                  or (optional and t.name.endswith(optional))):
            continue
        if t.name in arrays:
            w.add_tensor(t.name, np.ascontiguousarray(arrays[t.name], np.float32))
            continue
        shape = tuple(shapes.get(t.name, t.shape))
        default = "F32" if len(t.shape) == 1 or t.role == ROUTER or t.name.endswith(".bias") \
            else qtype_name
        qt = BY_NAME[types.get(t.name, default)]
        if shape[-1] % qt.block_size:   # rows the type cannot hold (MLA's attn_k_b): Q8_0
            qt = BY_NAME["Q8_0" if shape[-1] % 32 == 0 else "F16"]
        write_tensor_data(w, t.name, shape, qt, rng)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
