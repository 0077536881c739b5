"""`memfit info MODEL`: what a GGUF file holds, without loading any weights.

describe(path) -> dict (JSON-serialisable, for `--json`); format_info(d) -> str (for humans).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .gguf import GGUFFile, open_gguf
from .quant.types import SUPPORTED

# (name in the report, key suffix after "{arch}.")
HYPERPARAMETERS = [
    ("context_length", "context_length"),
    ("embedding_length", "embedding_length"),
    ("block_count", "block_count"),
    ("feed_forward_length", "feed_forward_length"),
    ("head_count", "attention.head_count"),
    ("head_count_kv", "attention.head_count_kv"),
    ("key_length", "attention.key_length"),
    ("value_length", "attention.value_length"),
    ("rms_norm_eps", "attention.layer_norm_rms_epsilon"),
    ("norm_eps", "attention.layer_norm_epsilon"),
    ("sliding_window", "attention.sliding_window"),
    ("rope_dimension_count", "rope.dimension_count"),
    ("rope_freq_base", "rope.freq_base"),
    ("rope_scaling_type", "rope.scaling.type"),
    ("rope_scaling_factor", "rope.scaling.factor"),
    ("expert_count", "expert_count"),
    ("expert_used_count", "expert_used_count"),
    ("expert_feed_forward_length", "expert_feed_forward_length"),
    ("vocab_size", "vocab_size"),
]


# roles of `memfit info`'s mix table, in report order
ROLES = ("embeddings", "output", "attention", "dense FFN", "shared experts", "experts", "router",
         "norms & biases", "other")


def tensor_role(name: str, n_dims: int) -> str:
    """Which part of the model a tensor is, from its GGUF name (any architecture)."""
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "embeddings"
    if name == "output.weight":
        return "output"
    if n_dims == 1:
        return "norms & biases"
    if "ffn_gate_inp" in name:
        return "router"
    if "_exps." in name:
        return "experts"
    if "_shexp." in name:
        return "shared experts"
    if ".attn_" in name:
        return "attention"
    if ".ffn_" in name:
        return "dense FFN"
    return "other"


def _ftype_name(ftype: Any) -> str | None:
    from .synth import LLAMA_FTYPES
    for k, v in LLAMA_FTYPES.items():
        if v == ftype:
            return k
    return None


def _token(tokens: list | None, i: Any) -> str | None:
    if isinstance(tokens, list) and isinstance(i, int) and 0 <= i < len(tokens):
        return tokens[i]
    return None


def describe_file(f: GGUFFile) -> dict[str, Any]:
    """The report for an already open file."""
    md = f.metadata
    arch = f.arch
    hp = {}
    for name, suffix in HYPERPARAMETERS:
        key = f"{arch}.{suffix}"
        if key in md:
            hp[name] = md[key]
    tokens = md.get("tokenizer.ggml.tokens")
    bos, eos = md.get("tokenizer.ggml.bos_token_id"), md.get("tokenizer.ggml.eos_token_id")
    tok = {
        "model": md.get("tokenizer.ggml.model"),
        "pre": md.get("tokenizer.ggml.pre"),
        "vocab_size": len(tokens) if isinstance(tokens, list) else None,
        "bos_token_id": bos, "bos_token": _token(tokens, bos),
        "eos_token_id": eos, "eos_token": _token(tokens, eos),
        "add_bos": md.get("tokenizer.ggml.add_bos_token"),
        "add_eos": md.get("tokenizer.ggml.add_eos_token"),
        "merges": len(md["tokenizer.ggml.merges"]) if "tokenizer.ggml.merges" in md else None,
    }
    types: dict[str, dict[str, int]] = {}
    n_params = 0
    for t in f.tensors.values():
        e = types.setdefault(t.type.name, {"tensors": 0, "bytes": 0, "elements": 0})
        e["tensors"] += 1
        e["bytes"] += t.nbytes
        e["elements"] += t.n_elements
        n_params += t.n_elements
    types = dict(sorted(types.items(), key=lambda kv: -kv[1]["bytes"]))
    total = sum(e["bytes"] for e in types.values())
    for e in types.values():
        e["share"] = round(e["bytes"] / total, 6) if total else 0.0
    # role -> type -> {tensors, bytes}: which parts of the model carry which types
    roles: dict[str, dict[str, dict[str, int]]] = {}
    for t in f.tensors.values():
        r = roles.setdefault(tensor_role(t.name, len(t.shape)), {})
        e = r.setdefault(t.type.name, {"tensors": 0, "bytes": 0})
        e["tensors"] += 1
        e["bytes"] += t.nbytes
    roles = {k: dict(sorted(roles[k].items(), key=lambda kv: -kv[1]["bytes"]))
             for k in ROLES if k in roles}
    unsupported = sorted({t.type.name for t in f.tensors.values() if t.type.id not in SUPPORTED})
    template = md.get("tokenizer.chat_template")
    return {
        "path": str(f.paths[0]),
        "file_size": f.file_size,
        "gguf_version": f.version,
        "split_count": len(f.paths),
        "alignment": f.alignment,
        "architecture": arch,
        "name": md.get("general.name"),
        "size_label": md.get("general.size_label"),
        "file_type": md.get("general.file_type"),
        "file_type_name": _ftype_name(md.get("general.file_type")),
        "hyperparameters": hp,
        "tokenizer": tok,
        "chat_template": isinstance(template, str) and bool(template),
        "metadata_count": len(md),
        "tensor_count": len(f.tensors),
        "tensor_bytes": total,
        "n_params": n_params,
        "types": types,
        "roles": roles,
        "unsupported_types": unsupported,
        # how `memfit synth` made the file's routing (synth.py), where it did
        "synth": {k[len("memfit.synth."):]: v for k, v in md.items()
                  if k.startswith("memfit.synth.")},
    }


def describe(path: str | Path) -> dict[str, Any]:
    """Open, validate and summarise a GGUF model (a split model from its first part)."""
    with open_gguf(path) as f:
        return describe_file(f)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def _count(n: int) -> str:
    for div, s in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{s}"
    return str(n)


def format_info(d: dict[str, Any]) -> str:
    """Human-readable report of describe()'s dict."""
    lines = []
    name = d.get("name") or Path(d["path"]).name
    lines.append(f"model          {name}" + (f" ({d['size_label']})" if d.get("size_label") else ""))
    lines.append(f"architecture   {d['architecture'] or '(none)'}")
    parts = f", {d['split_count']} parts" if d["split_count"] > 1 else ""
    lines.append(f"file           {d['path']} ({_size(d['file_size'])}, GGUF v{d['gguf_version']}"
                 f"{parts})")
    lines.append(f"parameters     {_count(d['n_params'])}")
    hp = d["hyperparameters"]
    if hp:
        lines.append("hyperparameters")
        w = max(len(k) for k in hp)
        for k, v in hp.items():
            lines.append(f"  {k:<{w}}  {v:g}" if isinstance(v, float) else f"  {k:<{w}}  {v}")
    t = d["tokenizer"]
    if t["model"] is not None:
        desc = f"{t['model']}" + (f" (pre: {t['pre']})" if t["pre"] else "")
        if t["vocab_size"] is not None:
            desc += f", {t['vocab_size']} tokens"
        lines.append(f"tokenizer      {desc}")
        for k in ("bos", "eos"):
            if t[f"{k}_token_id"] is not None:
                lines.append(f"  {k:<11}  {t[f'{k}_token_id']} {t[f'{k}_token']!r}")
        for k in ("add_bos", "add_eos"):
            if t[k] is not None:
                lines.append(f"  {k:<11}  {str(t[k]).lower()}")
    else:
        lines.append("tokenizer      (none)")
    lines.append(f"chat template  {'yes' if d['chat_template'] else 'no'}")
    if d.get("file_type") is not None:
        ft = d.get("file_type_name")
        lines.append(f"file type      {d['file_type']}" + (f" ({ft})" if ft else ""))
    lines.append(f"tensors        {d['tensor_count']}, {_size(d['tensor_bytes'])}")
    for name, e in d["types"].items():
        mark = "" if name not in d["unsupported_types"] else "  (not supported by memfit)"
        lines.append(f"  {name:<8} {e['tensors']:>5} tensors  {_size(e['bytes']):>11}  "
                     f"{100 * e['share']:5.1f}%{mark}")
    if d.get("roles"):
        lines.append("mix by role")
        w = max(len(k) for k in d["roles"])
        for role, ts in d["roles"].items():
            parts = ", ".join(f"{t} {e['tensors']} ({_size(e['bytes'])})" for t, e in ts.items())
            lines.append(f"  {role:<{w}}  {parts}")
    sy = d.get("synth") or {}
    if sy:
        lines.append("synthetic      weights and routing made by memfit synth")
        for k, v in sy.items():
            lines.append(f"  {k:<28}  {v:.3f}" if isinstance(v, float) else f"  {k:<28}  {v}")
    return "\n".join(lines)
