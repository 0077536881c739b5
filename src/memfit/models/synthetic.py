"""Tiny complete model GGUFs with random weights, for tests (any architecture, any type).

    write_tiny_model(path, arch, qtype_name, seed, **overrides) -> Path

2-D weights are random valid blocks of `qtype_name` (memfit.quant.random), 1-D norms and
biases are F32. The file carries full metadata and a small gpt2 byte-level BPE tokenizer
(256 byte tokens + a few merges + ChatML specials), so the tokenizer can load it too.
Overrides: n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, n_ctx, rope_base,
rope_scale (linear factor), sliding_window, final_softcap, tied (bool), skip (tensor names to
leave out), shapes ({name: shape} to write instead), types ({name: type name}).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..quant.types import BY_NAME

_DEFAULTS = dict(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, head_dim=64, n_ff=512,
                 n_ctx=512, rope_base=10000.0, rope_scale=0.0, sliding_window=0,
                 final_softcap=0.0, tied=True)
_ARCH_DEFAULTS = {
    "qwen3": dict(head_dim=128),                        # head dim != n_embd / n_head
    "gemma3": dict(head_dim=128, n_head_kv=1, sliding_window=4, rope_base=1e6),
}
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


def write_tiny_model(path, arch: str, qtype_name: str, seed: int = 0, **overrides) -> Path:
    import gguf

    from ..quant.random import random_weight

    p = {**_DEFAULTS, **_ARCH_DEFAULTS.get(arch, {}), **overrides}
    skip = set(p.pop("skip", ()) or ())
    shapes = dict(p.pop("shapes", {}) or {})
    types = dict(p.pop("types", {}) or {})
    rng = np.random.default_rng(seed)
    tokens, ttypes, merges = tiny_vocab()
    n_vocab = len(tokens)
    E, H, Hkv, D, F = p["n_embd"], p["n_head"], p["n_head_kv"], p["head_dim"], p["n_ff"]

    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}-{qtype_name}")
    w.add_uint32(f"{arch}.block_count", p["n_layer"])
    w.add_uint32(f"{arch}.context_length", p["n_ctx"])
    w.add_uint32(f"{arch}.embedding_length", E)
    w.add_uint32(f"{arch}.feed_forward_length", F)
    w.add_uint32(f"{arch}.attention.head_count", H)
    w.add_uint32(f"{arch}.attention.head_count_kv", Hkv)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{arch}.rope.freq_base", p["rope_base"])
    if D != E // H:
        w.add_uint32(f"{arch}.attention.key_length", D)
        w.add_uint32(f"{arch}.attention.value_length", D)
    if arch == "llama":
        w.add_uint32(f"{arch}.rope.dimension_count", D)
        w.add_uint32(f"{arch}.vocab_size", n_vocab)
    if p["sliding_window"]:
        w.add_uint32(f"{arch}.attention.sliding_window", p["sliding_window"])
    if p["rope_scale"]:
        w.add_string(f"{arch}.rope.scaling.type", "linear")
        w.add_float32(f"{arch}.rope.scaling.factor", p["rope_scale"])
    if p["final_softcap"]:
        w.add_float32(f"{arch}.final_logit_softcapping", p["final_softcap"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(ttypes)
    w.add_token_merges(merges)
    w.add_bos_token_id(n_vocab - 3)
    w.add_eos_token_id(n_vocab - 1)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    mats = {"token_embd.weight": (n_vocab, E)}
    if not p["tied"]:
        mats["output.weight"] = (n_vocab, E)
    vecs = {"output_norm.weight": (E,)}
    for il in range(p["n_layer"]):
        b = f"blk.{il}."
        mats.update({b + "attn_q.weight": (H * D, E), b + "attn_k.weight": (Hkv * D, E),
                     b + "attn_v.weight": (Hkv * D, E), b + "attn_output.weight": (E, H * D),
                     b + "ffn_gate.weight": (F, E), b + "ffn_up.weight": (F, E),
                     b + "ffn_down.weight": (E, F)})
        vecs.update({b + "attn_norm.weight": (E,), b + "ffn_norm.weight": (E,)})
        if arch == "qwen2":
            vecs.update({b + "attn_q.bias": (H * D,), b + "attn_k.bias": (Hkv * D,),
                         b + "attn_v.bias": (Hkv * D,)})
        if arch in ("qwen3", "gemma3"):
            vecs.update({b + "attn_q_norm.weight": (D,), b + "attn_k_norm.weight": (D,)})
        if arch == "gemma3":
            vecs.update({b + "post_attention_norm.weight": (E,), b + "post_ffw_norm.weight": (E,)})

    for name, shape in {**mats, **vecs}.items():
        if name in skip:
            continue
        shape = tuple(shapes.get(name, shape))
        qt = BY_NAME[types.get(name, qtype_name if name in mats else "F32")]
        if len(shape) == 1 and qt.name == "F32":
            base = 0.0 if name.endswith(".bias") else 1.0
            arr = (base + 0.2 * rng.standard_normal(shape)).astype(np.float32)
            w.add_tensor(name, arr)
            continue
        rows, cols = (1, shape[0]) if len(shape) == 1 else shape
        try:
            raw = random_weight(qt, (rows, cols), rng)
        except Exception:  # a type memfit cannot generate (error tests): any bytes will do
            raw = np.frombuffer(rng.bytes(rows * qt.row_bytes(cols)), np.uint8).reshape(rows, -1)
        if qt.name == "F32":
            w.add_tensor(name, raw.view(np.float32).reshape(shape))
        else:
            w.add_tensor(name, raw.reshape(*shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType(qt.id))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
