"""Synthetic GGUF models with the real shapes of named architectures, for budget tests/benchmarks.

    synth(path, arch="llama", size="7b", quant="Q4_K_M", seed=0, progress=True,
          routing_skew=0.0) -> SynthResult

The tensor table and the metadata keys come from the architecture's spec (models/spec.py).
Mixture-of-experts sizes: qwen3moe | mixtral (llama with experts) tiny, 2gb, and qwen3moe
30b-a3b (Qwen3-30B-A3B's shapes); qwen2moe and olmoe tiny. The routing of these files is
synthetic: a random router spreads tokens almost uniformly over the experts (the worst case for
an expert cache). routing_skew S > 0 adds a shared direction u to every token embedding
(norm S times the row's own) and gives router row e of each layer an alignment S * a_e with u
(a_e ~ N(0, 1) per layer and expert), so a few experts per layer become popular and choices
persist from token to token; the embedding is then written as Q8_0 to carry u.

routing_overlap F (`--routing-overlap`) calibrates the routers instead, to match published
statistics of real MoE models (consecutive-token overlap ~0.30-0.45 for top-8 of 128-256
experts, a popularity that differs by layer): after the file is written, the real forward is
run on random token sequences and each layer's router rows are computed from that layer's
router inputs (calibrate_routing / _router_rows: a mix of the hidden state's slowly drifting
and fresh directions, bisected to overlap F; routing_skew S is then the spread of per-layer
popularity offsets) and written in place. F <= k/n_expert gives routing as close to
uniform and independent from token to token as the data allows. The statistics asked for and
those measured on decoded held-out random tokens are stored as memfit.synth.routing_* and
shown by `memfit info`; the check decodes ROUTING_CHECK_SEQS held-out sequences of
ROUTING_CHECK_TOKENS tokens (one sequence's overlap varies by +-0.1, and overlap falls along a
sequence). Random Q/K weights attend almost uniformly, so the attention's output is the
prefix's average: a component of the hidden state that persists from token to token and points
somewhere new in every sequence, which any linear router turns into per-expert offsets that
last the sequence (qwen3moe's deep shapes measured 0.5-0.7 asked 0.4 in their later layers).
Calibrated qwen3moe files therefore also sharpen the attention (ATTN_GAIN_CALIBRATED times the
query path, memfit.synth.attention_gain; the families where it did not help keep 1). Asked 0.4
(docs/NOTES.md session 26): qwen3moe 2gb 0.42 (0.51 without the gain), 30b-a3b 0.455 and 0.403
on two sets of 8 held-out sequences (0.66 before), mixtral 2gb 0.40.
The measured value in the file is the one to quote.

Weights are random valid blocks (memfit.quant.random: finite fp16 scales, uniform random
quant bits, never runs of zeros), deterministic from (seed, tensor index, chunk). The file is
streamed to disk chunk by chunk (a writer thread overlaps generation and write), so memory
stays ~2 chunks whatever the model size. Quant mixes follow llama-quantize's rules (e.g.
Q4_K_M: Q4_K, attn_v/ffn_down Q6_K in use_more_bits layers, output Q6_K, norms F32).
The metadata carries a small gpt2 byte-level BPE tokenizer padded with unused tokens to the
config's n_vocab, and a ChatML template, so `memfit run` loads it.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import RequestError
from .quant.random import WRITABLE
from .quant.types import BY_NAME, GGMLType

# name -> hyperparameters (real shapes; vocab as the original tokenizer's embedding rows).
# "mixtral" is written as arch llama with experts.
_TINY_MOE = dict(n_embd=512, n_layer=4, n_head=8, n_head_kv=4, n_ff=1536, n_vocab=2048,
                 n_ctx=2048, rope_base=1e6, tied=False, n_expert=16, n_expert_used=4,
                 n_ff_exp=256)
# DeepSeek-V3-style routing: sigmoid, exp_probs_b, renormalized
_SIGMOID = dict(expert_gating_func="sigmoid", expert_weights_norm=True)
# CONFIGS keys that are ModelConfig fields as they are
_CONFIG_KEYS = ("n_rot", "n_layer_dense_lead", "n_layer_nextn", "expert_gating_func",
                "expert_weights_norm", "expert_weights_scale", "expert_group_count",
                "expert_group_used_count", "rms_eps", "q_lora_rank", "kv_lora_rank",
                "head_dim_k_mla", "head_dim_v_mla", "head_dim_k", "head_dim_v", "indexer",
                "rope_scaling", "rope_freq_scale", "n_ctx_orig", "yarn_log_mul",
                "sliding_window")


def _mla(C: int, R: int, Dn: int, Dv: int, Q: int) -> dict:
    """The MLA keys of a CONFIGS entry: one KV head of latent C + rope R per token."""
    return dict(n_head_kv=1, head_dim=C + R, head_dim_k=C + R, head_dim_v=C, n_rot=R,
                kv_lora_rank=C, q_lora_rank=Q, head_dim_k_mla=Dn + R, head_dim_v_mla=Dv)
CONFIGS: dict[tuple[str, str], dict] = {
    ("llama", "tiny"): dict(n_embd=512, n_layer=4, n_head=8, n_head_kv=4, n_ff=1536,
                            n_vocab=2048, n_ctx=2048, rope_base=10000.0, tied=False),
    ("qwen2", "tiny"): dict(n_embd=512, n_layer=4, n_head=8, n_head_kv=2, n_ff=1536,
                            n_vocab=2048, n_ctx=2048, rope_base=1e6, tied=False),
    ("llama", "1b"): dict(n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, n_ff=8192,
                          n_vocab=32000, n_ctx=4096, rope_base=500000.0, tied=False),
    # 1B layer shapes, 24 layers (~0.95 GB Q4_K_M): the budget tests' model, big enough that
    # 35% of the file clears the floor (two streaming slots of the 54 MB output matrix)
    ("llama", "1b-24l"): dict(n_embd=2048, n_layer=24, n_head=32, n_head_kv=8, n_ff=8192,
                              n_vocab=32000, n_ctx=4096, rope_base=500000.0, tied=False),
    ("llama", "7b"): dict(n_embd=4096, n_layer=32, n_head=32, n_head_kv=32, n_ff=11008,
                          n_vocab=32000, n_ctx=4096, rope_base=10000.0, tied=False),
    ("qwen2", "1.5b"): dict(n_embd=1536, n_layer=28, n_head=12, n_head_kv=2, n_ff=8960,
                            n_vocab=151936, n_ctx=32768, rope_base=1e6, tied=True),
    ("qwen2", "7b"): dict(n_embd=3584, n_layer=28, n_head=28, n_head_kv=4, n_ff=18944,
                          n_vocab=152064, n_ctx=32768, rope_base=1e6, tied=False),
    ("qwen3moe", "tiny"): dict(_TINY_MOE, head_dim=128),
    ("qwen2moe", "tiny"): dict(_TINY_MOE, n_ff_shexp=1024),
    ("olmoe", "tiny"): dict(_TINY_MOE, rope_base=10000.0),
    ("mixtral", "tiny"): dict(_TINY_MOE, rope_base=1e6, n_expert=8, n_expert_used=2,
                              n_ff_exp=1536),
    # ~2 GB at Q4_K_M: enough experts that a budget must cache them
    ("qwen3moe", "2gb"): dict(n_embd=1024, n_layer=24, n_head=16, n_head_kv=4, head_dim=128,
                              n_ff=3072, n_vocab=32000, n_ctx=32768, rope_base=1e6, tied=False,
                              n_expert=64, n_expert_used=8, n_ff_exp=768),
    ("mixtral", "2gb"): dict(n_embd=2048, n_layer=24, n_head=16, n_head_kv=4, n_ff=2816,
                             n_vocab=32000, n_ctx=32768, rope_base=1e6, tied=False,
                             n_expert=8, n_expert_used=2, n_ff_exp=2816),
    # Qwen3-30B-A3B: 48 layers, 32/4 heads of 128, 128 experts of 768, top-8 (~18 GB Q4_K_M)
    ("qwen3moe", "30b-a3b"): dict(n_embd=2048, n_layer=48, n_head=32, n_head_kv=4, head_dim=128,
                                  n_ff=6144, n_vocab=151936, n_ctx=40960, rope_base=1e6,
                                  tied=False, n_expert=128, n_expert_used=8, n_ff_exp=768),
    # the routed families below also set ModelConfig fields directly (_CONFIG_KEYS)
    ("glm4moe", "tiny"): dict(_TINY_MOE, head_dim=64, n_rot=32, n_ff_shexp=256,
                              n_layer_dense_lead=1, n_layer_nextn=1, **_SIGMOID),
    # GLM-4.5-Air (config.json): 46 layers + 1 NextN, 96/8 heads of 128, half of each rotated,
    # one dense layer (10944), 128 experts of 1408 (top 8) + 1 shared, QKV biases (~66 GB at
    # Q4_K_M)
    ("glm4moe", "4.5-air"): dict(n_embd=4096, n_layer=46, n_head=96, n_head_kv=8, head_dim=128,
                                 n_rot=64, n_ff=10944, n_vocab=151552, n_ctx=131072,
                                 rope_base=1e6, tied=False, n_expert=128, n_expert_used=8,
                                 n_ff_exp=1408, n_ff_shexp=1408, n_layer_dense_lead=1,
                                 n_layer_nextn=1, rms_eps=1e-5, **_SIGMOID),
    ("deepseek2", "tiny"): dict(_TINY_MOE, **_mla(256, 64, 64, 64, 256), n_ff_shexp=256,
                                n_layer_dense_lead=1, expert_group_count=4,
                                expert_group_used_count=2, expert_weights_scale=2.5, **_SIGMOID),
    # DeepSeek-V3 / R1 (config.json): 61 layers (3 dense), 128 heads, q rank 1536, latent 512
    # + rope 64, 256 experts of 2048 in 8 groups (4 used), top 8, 1 shared, scale 2.5, YaRN x40
    # (~380 GiB at Q4_K_M: write it with --layers)
    ("deepseek2", "v3"): dict(n_embd=7168, n_layer=61, n_head=128, **_mla(512, 64, 128, 128, 1536),
                              n_ff=18432, n_vocab=129280, n_ctx=163840, rope_base=10000.0,
                              tied=False, n_expert=256, n_expert_used=8, n_ff_exp=2048,
                              n_ff_shexp=2048, n_layer_dense_lead=3, expert_group_count=8,
                              expert_group_used_count=4, expert_weights_scale=2.5,
                              rope_scaling="yarn", rope_freq_scale=1 / 40, n_ctx_orig=4096,
                              yarn_log_mul=1.0, **_SIGMOID),
    # Kimi K2 (config.json): the V3 layer with 64 heads, 384 experts, one group, one dense
    # layer, scale 2.827, rope base 50000, YaRN x32 (~560 GiB at Q4_K_M)
    ("deepseek2", "kimi-k2"): dict(n_embd=7168, n_layer=61, n_head=64, **_mla(512, 64, 128, 128, 1536),
                                   n_ff=18432, n_vocab=163840, n_ctx=131072, rope_base=50000.0,
                                   tied=False, n_expert=384, n_expert_used=8, n_ff_exp=2048,
                                   n_ff_shexp=2048, n_layer_dense_lead=1,
                                   expert_weights_scale=2.827, rope_scaling="yarn",
                                   rope_freq_scale=1 / 32, n_ctx_orig=4096, yarn_log_mul=1.0,
                                   **_SIGMOID),
    ("gpt-oss", "tiny"): dict(_TINY_MOE, head_dim=64, n_head_kv=2, sliding_window=128,
                              rope_base=150000.0, rope_scaling="yarn", rope_freq_scale=1 / 32,
                              n_ctx_orig=4096, rms_eps=1e-5),
    # gpt-oss-20b / -120b (config.json): 2880 wide, heads of 64 (64 q / 8 kv), experts of
    # 2880 (top 4), window 128 on even layers, YaRN x32 over 4096 (~12 / ~61 GiB at MXFP4_MOE)
    ("gpt-oss", "20b"): dict(n_embd=2880, n_layer=24, n_head=64, n_head_kv=8, head_dim=64,
                             n_ff=2880, n_vocab=201088, n_ctx=131072, rope_base=150000.0,
                             tied=False, n_expert=32, n_expert_used=4, n_ff_exp=2880,
                             sliding_window=128, rope_scaling="yarn", rope_freq_scale=1 / 32,
                             n_ctx_orig=4096, rms_eps=1e-5),
    ("gpt-oss", "120b"): dict(n_embd=2880, n_layer=36, n_head=64, n_head_kv=8, head_dim=64,
                              n_ff=2880, n_vocab=201088, n_ctx=131072, rope_base=150000.0,
                              tied=False, n_expert=128, n_expert_used=4, n_ff_exp=2880,
                              sliding_window=128, rope_scaling="yarn", rope_freq_scale=1 / 32,
                              n_ctx_orig=4096, rms_eps=1e-5),
    ("glm-dsa", "tiny"): dict(_TINY_MOE, **_mla(256, 64, 64, 64, 256), n_ff_shexp=256,
                              n_layer_dense_lead=1, n_layer_nextn=1, indexer=(4, 128, 2048),
                              **_SIGMOID),
    # GLM-5 (744B-A40B; shapes as recalled from its config.json, not checked against a file):
    # 78 layers + 1 NextN (3 dense), 64 heads, q rank 2048, latent 512 + rope 64, nope 192,
    # values 256, 256 experts of 2048, top 8, 1 shared, indexer 32 heads of 128, top 2048
    ("glm-dsa", "5"): dict(n_embd=6144, n_layer=78, n_head=64, **_mla(512, 64, 192, 256, 2048),
                           n_ff=12288, n_vocab=154880, n_ctx=202752, rope_base=1e6, tied=False,
                           n_expert=256, n_expert_used=8, n_ff_exp=2048, n_ff_shexp=2048,
                           n_layer_dense_lead=3, n_layer_nextn=1, expert_weights_scale=2.5,
                           indexer=(32, 128, 2048), rms_eps=1e-5, **_SIGMOID),
}
# llama_ftype ids (llama.h LLAMA_FTYPE_MOSTLY_*), written as general.file_type
LLAMA_FTYPES = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10,
    "Q3_K_S": 11, "Q3_K_M": 12, "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16,
    "Q5_K_M": 17, "Q6_K": 18, "IQ2_XXS": 19, "IQ2_XS": 20, "Q2_K_S": 21, "IQ3_XS": 22,
    "IQ3_XXS": 23, "IQ1_S": 24, "IQ4_NL": 25, "IQ3_S": 26, "IQ3_M": 27, "IQ2_S": 28,
    "IQ2_M": 29, "IQ4_XS": 30, "IQ1_M": 31, "BF16": 32, "TQ1_0": 36, "TQ2_0": 37,
    "MXFP4_MOE": 38, "NVFP4": 39, "Q1_0": 40,
}
# the published low-bit mixes (llama-quantize's presets of those names), see _lowbit_type
LOWBIT_MIXES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_S",
                "IQ3_M", "MXFP4_MOE")
# the mixes synth writes: name -> llama_ftype id
FILE_TYPES = {q: LLAMA_FTYPES[q] for q in ("F16", "Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1",
                                           "Q4_K_M", "Q5_K_M", "Q6_K") + LOWBIT_MIXES}
# the type most tensors of a mix get (llama_ftype_get_default_type)
_DEFAULT = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "IQ2_S": "IQ2_XS", "IQ2_M": "IQ2_S",
            "IQ3_M": "IQ3_S", "MXFP4_MOE": "MXFP4"}
# single-type files (`--quant TYPE`, or `--pure`): every type memfit can write random valid
# blocks of; general.file_type is the llama_ftype whose default type it is (the _S variant)
SINGLE_TYPES = WRITABLE
_SINGLE_FTYPE = {"Q3_K": "Q3_K_S", "Q4_K": "Q4_K_S", "Q5_K": "Q5_K_S", "IQ2_S": "IQ2_M",
                 "MXFP4": "MXFP4_MOE"}
CHUNK_BYTES = 16 << 20    # generation/write unit; part of the determinism contract
# a row that is not a multiple of the type's block: llama-quantize's tensor_type_fallback
# (and F16 when the fallback's block does not divide the row either)
_FALLBACK = {"IQ1_S": "IQ4_NL", "IQ1_M": "IQ4_NL", "IQ2_XXS": "IQ4_NL", "IQ2_XS": "IQ4_NL",
             "IQ2_S": "IQ4_NL", "IQ3_XXS": "IQ4_NL", "IQ3_S": "IQ4_NL", "IQ4_XS": "IQ4_NL",
             "Q2_K": "Q4_0", "Q3_K": "Q4_0", "TQ1_0": "Q4_0", "TQ2_0": "Q4_0",
             "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _category(name: str) -> str:
    """llama-quantize's tensor category (tensor_get_category): matched by name part."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for part, cat in (("attn_qkv.weight", "attn_v"), ("attn_kv_b.weight", "attn_v"),
                      ("attn_v.weight", "attn_v"), ("attn_k.weight", "attn_k"),
                      ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"),
                      ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down")):
        if part in name:
            return cat
    return "other"


def resolve_quant(quant: str, pure: bool = False) -> tuple[str, str | None, int]:
    """(mix, single type or None, llama_ftype id) of a --quant value: a mix name (FILE_TYPES)
    is that mix unless ``pure``; a type name (SINGLE_TYPES) is a single-type file (with
    ``pure`` too where it also names a mix, e.g. IQ2_S: every matrix IQ2_S); ``pure`` with a
    mix-only name gives every matrix the mix's default type (Q4_K_M: Q4_K), as llama-quantize
    --pure does."""
    if quant in FILE_TYPES and not pure:
        return quant, None, FILE_TYPES[quant]
    if quant in FILE_TYPES and quant not in SINGLE_TYPES:
        return quant, _DEFAULT.get(quant, quant), FILE_TYPES[quant]
    if quant in SINGLE_TYPES:
        return quant, quant, LLAMA_FTYPES[_SINGLE_FTYPE.get(quant, quant)]
    raise RequestError(f"unknown quant {quant!r}; use a mix ({', '.join(FILE_TYPES)}) or a "
                       f"single type ({', '.join(t for t in SINGLE_TYPES if t not in FILE_TYPES)}"
                       f"; with --pure also {', '.join(t for t in SINGLE_TYPES if t in FILE_TYPES)})")


def _lowbit_type(q: str, cat: str, layer: int | None, n_layer: int, cols: int, n_gqa: int,
                 n_expert: int, tied: bool, i_ffn_down: int, stacked: bool) -> str:
    """llama_tensor_get_type_impl for the LOWBIT_MIXES (before the fallback); see tensor_type."""
    d = _DEFAULT.get(q, q)
    s2 = q in ("IQ2_S", "IQ2_M")
    if cat == "output" or (tied and cat == "token_embd"):
        if q == "MXFP4_MOE" or cols % BY_NAME[d].block_size:
            return "Q8_0"
        return "Q6_K" if q in ("IQ3_S", "IQ3_M") else "Q5_K"
    if q == "MXFP4_MOE":
        return "MXFP4" if stacked else "Q8_0"
    if cat == "token_embd":
        return "IQ3_S" if s2 or q.startswith("IQ3") else "Q2_K"
    if not q.startswith("IQ3"):   # IQ1_S IQ1_M IQ2_XXS IQ2_XS IQ2_S IQ2_M
        if cat == "attn_v":
            return "Q4_K" if n_gqa >= 4 or n_expert >= 4 else "IQ3_S" if s2 else "Q2_K"
        if cat == "attn_k" and n_expert == 8:
            return "Q4_K"
        if cat == "ffn_down":
            return ("IQ3_S" if s2 else "Q2_K") if i_ffn_down < n_layer // 8 else d
        if cat == "attn_output":
            return "Q5_K" if n_expert == 8 else "IQ2_XXS" if q.startswith("IQ1") \
                else "IQ3_S" if s2 else d
        return d
    # IQ3_XXS IQ3_S IQ3_M (with an importance matrix, as published files are made)
    if cat == "attn_v":
        if n_expert == 8:
            return "Q8_0"
        return "Q4_K" if n_gqa >= 4 or q == "IQ3_M" else d
    if cat == "attn_k":
        return "Q8_0" if n_expert == 8 else "IQ2_S" if q == "IQ3_XXS" else d
    if cat == "attn_q":
        return "IQ2_S" if q == "IQ3_XXS" else d
    if cat == "ffn_down":
        i = layer if n_expert > 1 and layer is not None else i_ffn_down
        if q == "IQ3_M" and (i < n_layer // 8 or (n_expert == 8 and _use_more_bits(i, n_layer))):
            return "Q4_K"
        return d
    if cat == "attn_output":
        if n_expert == 8:
            return "Q5_K"
        return {"IQ3_XXS": "IQ3_S", "IQ3_M": "Q4_K"}.get(q, d)
    return d


def tensor_type(quant: str, name: str, layer: int | None, n_layer: int, cols: int,
                is_vector: bool, *, n_gqa: int = 1, n_expert: int = 0, tied: bool = False,
                i_ffn_down: int | None = None, stacked: bool | None = None,
                pure: bool = False) -> GGMLType:
    """The GGML type llama-quantize's mix `quant` gives this tensor (llama_tensor_get_type).

    Every mix: 1-D tensors (norms, biases) and expert routers (ffn_gate_inp) stay F32; a row
    not a multiple of the chosen type's block falls back as tensor_type_fallback does (IQ1/2/3
    and IQ4_XS -> IQ4_NL; Q2_K, Q3_K, TQ1_0, TQ2_0 -> Q4_0; Q4_K -> Q5_0; Q5_K -> Q5_1;
    Q6_K -> Q8_0; then F16). Single-type files (resolve_quant) give every other tensor the type.

    Q4_K_M / Q5_K_M: Q4_K / Q5_K; attn_v and ffn_down (also the experts') Q6_K in use_more_bits
    layers (the first and last eighth, every third between), output Q6_K. Q4_0 ... Q6_K: the
    type, output Q6_K. (These model the dense, untied rules only.)

    The low-bit mixes (n_gqa = n_head / n_head_kv; "8 experts" is n_expert == 8, Mixtral):
      output (and a tied token_embd): Q5_K for IQ1_*/IQ2_*/IQ3_XXS, Q6_K for IQ3_S/IQ3_M,
        Q8_0 for MXFP4_MOE or a row that is not a multiple of 256.
      MXFP4_MOE: stacked experts (3-D) MXFP4, every other matrix Q8_0.
      token_embd: Q2_K for IQ1_S/IQ1_M/IQ2_XXS/IQ2_XS, IQ3_S for IQ2_S/IQ2_M/IQ3_*.
      IQ1_S/IQ1_M/IQ2_XXS/IQ2_XS/IQ2_S/IQ2_M (the default type is the mix's name, except
        IQ2_S -> IQ2_XS and IQ2_M -> IQ2_S):
        attn_v Q4_K if n_gqa >= 4 or n_expert >= 4, else IQ3_S (IQ2_S/M) or Q2_K;
        attn_k Q4_K with 8 experts;
        ffn_down (every tensor named ffn_down*, counted in file order by layer then name):
          the first n_layer/8 of them IQ3_S (IQ2_S/M) or Q2_K;
        attn_output Q5_K with 8 experts, else IQ2_XXS (IQ1_*), IQ3_S (IQ2_S/M).
      IQ3_XXS/IQ3_S/IQ3_M (default IQ3_XXS / IQ3_S / IQ3_S; made with an importance matrix):
        attn_v Q8_0 with 8 experts, else Q4_K if n_gqa >= 4 or IQ3_M;
        attn_k Q8_0 with 8 experts, else IQ2_S (IQ3_XXS); attn_q IQ2_S (IQ3_XXS);
        ffn_down (IQ3_M) Q4_K in layers < n_layer/8 and, with 8 experts, use_more_bits ones;
        attn_output Q5_K with 8 experts, else IQ3_S (IQ3_XXS), Q4_K (IQ3_M).
    Not modelled: llama.cpp's 70B attn_v bump (model type 70B), Falcon's rules.

    i_ffn_down: this tensor's index among the ffn_down tensors in llama-quantize's order
    (default: the layer, right unless a layer has several, e.g. shared experts);
    stacked: a 3-D expert tensor (default: "_exps" in the name)."""
    if is_vector or name.endswith(("ffn_gate_inp.weight", ".bias")):
        return BY_NAME["F32"]   # llama-quantize keeps norms, biases and routers in F32
    mix, single, _ = resolve_quant(quant, pure)
    if single is not None:
        t = single
    elif mix in LOWBIT_MIXES:
        t = _lowbit_type(mix, _category(name), layer, n_layer, cols, n_gqa, n_expert, tied,
                         layer if i_ffn_down is None else i_ffn_down,
                         "_exps." in name if stacked is None else stacked)
    elif mix in ("Q4_K_M", "Q5_K_M"):
        t = _DEFAULT[mix]
        if name == "output.weight":
            t = "Q6_K"
        elif name.endswith(("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight",
                            "ffn_down_shexp.weight")) \
                and layer is not None and _use_more_bits(layer, n_layer):
            t = "Q6_K"
    elif mix in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q6_K"):
        t = "Q6_K" if name == "output.weight" else mix
    else:   # Q8_0, F16
        t = mix
    qt = BY_NAME[t]
    if cols % qt.block_size:
        qt = BY_NAME[_FALLBACK.get(t, "F16")]
        if cols % qt.block_size:
            qt = BY_NAME["F16"]
    return qt


def _layer_of(name: str) -> int:
    if name.startswith("blk."):
        return int(name.split(".")[1])
    return -1


def plan_types(quant: str, arch: str, cfg: dict, pure: bool = False
               ) -> list[tuple[str, tuple[int, ...], GGMLType]]:
    """(name, shape, type) of every tensor of a CONFIGS entry under mix `quant`, in file order.
    ffn_down tensors are counted in llama-quantize's order (weight_name_comparer: by layer,
    then by name) for the low-bit mixes' "first n_layer/8 ffn_down" rule."""
    ts = model_tensors(arch, cfg)
    order = sorted(range(len(ts)), key=lambda i: (_layer_of(ts[i][0]), ts[i][0]))
    i_down = {}
    for i in order:
        name, shape = ts[i][0], ts[i][1]
        if len(shape) > 1 and _category(name) == "ffn_down":
            i_down[name] = len(i_down)
    kw = dict(n_gqa=cfg["n_head"] // cfg["n_head_kv"], n_expert=cfg.get("n_expert", 0),
              tied=cfg["tied"], pure=pure)
    return [(name, shape, tensor_type(quant, name, layer, cfg["n_layer"], shape[-1],
                                      len(shape) == 1, i_ffn_down=i_down.get(name),
                                      stacked=len(shape) == 3, **kw))
            for name, shape, layer in ts]


@dataclass
class SynthResult:
    path: Path
    nbytes: int
    n_tensors: int
    seconds: float

    @property
    def mb_per_s(self) -> float:
        return self.nbytes / 1e6 / max(self.seconds, 1e-9)


def model_config(arch: str, cfg: dict):
    """ModelConfig of a CONFIGS entry (arch "mixtral": llama with experts)."""
    from .models.config import ModelConfig
    from .models.spec import get_spec
    file_arch = "llama" if arch == "mixtral" else arch
    spec = get_spec(file_arch)
    E, H = cfg["n_embd"], cfg["n_head"]
    hd = cfg.get("head_dim", E // H)
    n_expert = cfg.get("n_expert", 0)
    kw = dict(
        arch=file_arch, n_layer=cfg["n_layer"], n_embd=E, n_head=H, n_head_kv=cfg["n_head_kv"],
        # llama (Mixtral) and olmoe experts have feed_forward_length rows
        n_ff=cfg["n_ff"] if not n_expert or spec.n_ff_exp_key else cfg["n_ff_exp"],
        n_vocab=cfg["n_vocab"],
        rms_eps=1e-6 if file_arch.startswith(("qwen", "olmo")) else 1e-5,
        head_dim_k=hd, head_dim_v=hd, n_rot=hd, rope_base=cfg["rope_base"],
        n_ctx_train=cfg["n_ctx"], n_expert=n_expert,
        n_expert_used=cfg.get("n_expert_used", 0), n_ff_exp=cfg.get("n_ff_exp", 0),
        n_ff_shexp=cfg.get("n_ff_shexp", 0),
        expert_weights_norm=bool(n_expert) and spec.expert_weights_norm)
    kw.update({k: cfg[k] for k in _CONFIG_KEYS if k in cfg})
    return ModelConfig(**kw)


def first_layers(cfg: dict, n: int | None) -> dict:
    """A CONFIGS entry cut to its first n layers (``--layers``): the leading dense layers that
    fit, no NextN layers; the rest of the shapes as they are."""
    if n is None:
        return cfg
    if not 1 <= n <= cfg["n_layer"]:
        raise RequestError(f"--layers {n} must be between 1 and the config's {cfg['n_layer']} layers")
    return {**cfg, "n_layer": n, "n_layer_nextn": 0,
            "n_layer_dense_lead": min(cfg.get("n_layer_dense_lead", 0), n)}


def model_tensors(arch: str, cfg: dict) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(name, numpy shape, layer) in llama.cpp's file order, from the architecture's spec."""
    from .models.spec import get_spec
    c = model_config(arch, cfg)
    spec = get_spec(c.arch)
    extra = spec.synth_optional
    return [(t.name, t.shape, t.layer) for t in spec.tensors(c)
            if t.required or (t.name == "output.weight" and not cfg["tied"])
            or (extra and t.name.endswith(extra))]


def _vocab(n_vocab: int) -> tuple[list[str], list[int], list[str], int, int]:
    from .models.synthetic import SPECIALS, tiny_vocab
    tokens, types, merges = tiny_vocab()
    assert len(tokens) <= n_vocab
    bos = tokens.index(SPECIALS[0])
    eos = tokens.index(SPECIALS[-1])
    pad = n_vocab - len(tokens)
    # unused filler rows so the embedding has the real vocab size (types 5 = UNUSED)
    tokens = tokens + [f"<unused_{i}>" for i in range(pad)]
    types = types + [5] * pad
    return tokens, types, merges, bos, eos


def _rows(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape[:-1])) if len(shape) > 1 else 1


def _chunks(qt: GGMLType, shape: tuple[int, ...], rng: np.random.Generator, scale: float,
            direction: np.ndarray | None = None, skew: float = 0.0, name: str = "",
            gain: float = 1.0):
    """Yield the tensor's bytes in row chunks of about CHUNK_BYTES (stacked experts: rows of
    all experts in order, so each expert is one contiguous range). gain multiplies the
    values (norm weights: base and noise alike)."""
    from .quant.random import random_weight
    if len(shape) == 1:
        base = 1.0 if "norm" in name else 0.0   # norms around 1, the shared-expert gate around 0
        v = gain * (base + 0.1 * rng.standard_normal(shape))
        yield v.astype(np.float32).view(np.uint8)
        return
    scale *= gain
    rows, cols = _rows(shape), shape[-1]
    rb = qt.row_bytes(cols)
    step = max(1, CHUNK_BYTES // rb)
    a = None
    if direction is not None and name.endswith("ffn_gate_inp.weight"):
        a = rng.standard_normal(rows).astype(np.float32)   # each expert's popularity
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        if direction is None:
            yield random_weight(qt, (n, cols), rng, scale).reshape(-1)
            continue
        # routing skew: F32 router rows / Q8_0 embedding rows leaning along the direction
        z = (scale * rng.standard_normal((n, cols))).astype(np.float32)
        lean = skew * np.linalg.norm(z, axis=1, keepdims=True)
        if a is not None:
            lean = lean * a[r0:r0 + n, None]
        x = z + lean * direction
        yield (x.view(np.uint8) if qt.name == "F32" else _q8_0(x)).reshape(-1)


# Calibrated routing's files multiply the attention's query path by this, per architecture (the
# scores by it): random Q/K weights give scores of spread ~1, nearly uniform attention whose
# output is the prefix's average, a component of the hidden state that persists from token to
# token and points somewhere new in each sequence, so no linear router can route such a
# sequence with little overlap (qwen3moe's deep shapes measured 0.5-0.7 asked 0.4 in their later
# layers). Measured asked 0.4 (docs/NOTES.md session 26): qwen3moe 2gb gain 1 0.51, 4 0.41-0.43,
# 9 0.43, 25 0.48 (too sharp: the attention fixes on one key and persists again); 30b-a3b 0.66
# -> 0.40-0.46 at 4. Other families keep 1: mixtral 2gb measured 0.40 either way, and gain 4
# raised the tiny deepseek2, glm4moe, glm-dsa and gpt-oss files from 0.44-0.50 to 0.58-0.72.
ATTN_GAIN_CALIBRATED = {"qwen3moe": 4.0}


def _query_path(names: list[str]) -> set[str]:
    """Per layer the last tensor on the attention's query path whose scale reaches the scores
    unnormalized: the per-head q norm where there is one (it rescales after Wq), else the
    low-rank query's second matrix (MLA), else Wq."""
    have = set(names)
    out = set()
    for n in names:
        if not n.startswith("blk.") or not n.endswith(".weight"):
            continue
        pre = n[: n.index(".", 4) + 1]
        for cand in ("attn_q_norm.weight", "attn_q_b.weight", "attn_q.weight"):
            if pre + cand in have:
                out.add(pre + cand)
                break
    return out


def _q8_0(x: np.ndarray) -> np.ndarray:
    """Rows of floats -> Q8_0 blocks (f16 scale max|x|/127, 32 int8 each)."""
    b = x.reshape(-1, 32)
    d = (np.abs(b).max(axis=1) / 127.0).astype(np.float16)
    inv = np.where(d > 0, 1.0 / np.maximum(d.astype(np.float32), 1e-30), 0.0)
    q = np.clip(np.rint(b * inv[:, None]), -127, 127).astype(np.int8)
    out = np.empty((b.shape[0], 34), np.uint8)
    out[:, :2] = d.view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q.view(np.uint8)
    return out


def check_output(path, force: bool = False) -> Path:
    """Refuse an output path that cannot or should not be written, before any work: a missing
    folder, a folder, anything that exists and is not a regular file (a device, a fifo, a
    socket), and an existing regular file unless ``force``."""
    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise RequestError(f"output {path} is a dangling symbolic link; give a file path")
    if path.exists() or path.is_symlink():
        import stat
        mode = path.stat().st_mode
        if stat.S_ISDIR(mode):
            raise RequestError(f"output {path} is a directory; give a file path such as {path}/model.gguf")
        if not stat.S_ISREG(mode):
            raise RequestError(f"output {path} exists and is not a regular file (a device, fifo or "
                               f"socket); memfit never replaces it")
        if not force:
            raise RequestError(f"output {path} already exists; add --force to overwrite it")
    parent = path.parent
    if not parent.is_dir():
        raise RequestError(f"the folder of output {path} ({parent}) does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise RequestError(f"the folder of output {path} ({parent}) is not writable")
    return path


def synth(path, arch: str = "llama", size: str = "7b", quant: str = "Q4_K_M", seed: int = 0,
          progress: bool = True, routing_skew: float = 0.0, force: bool = False,
          pure: bool = False, layers: int | None = None,
          routing_overlap: float | None = None) -> SynthResult:
    """Write a synthetic GGUF; returns its size and write speed. See the module doc.
    ``routing_overlap``: calibrate the routers (calibrate_routing) to that consecutive-token
    overlap, ``routing_skew`` then being the spread of the experts' popularity offsets.
    ``layers``: only the first N layers of the shape (a file the disk can hold).
    An existing file is refused unless ``force``; a non-regular one always (check_output).
    A failed or interrupted write leaves no ``*.partial`` behind."""
    path = check_output(path, force)
    tmp = path.with_name(path.name + ".partial")
    try:
        return _write(path, arch, size, quant, seed, progress, routing_skew, pure, layers,
                      routing_overlap)
    except OSError as e:
        raise RequestError(f"cannot write {tmp}: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)


def _write(path: Path, arch: str, size: str, quant: str, seed: int, progress: bool,
           routing_skew: float, pure: bool, layers: int | None = None,
           routing_overlap: float | None = None) -> SynthResult:
    import gguf

    key = (arch, size.lower())
    if key not in CONFIGS:
        raise RequestError(f"no synthetic config {arch}-{size}; available: "
                           + ", ".join(f"{a}-{s}" for a, s in CONFIGS))
    _, _, ftype = resolve_quant(quant, pure)
    cfg = first_layers(CONFIGS[key], layers)
    if not (routing_skew >= 0.0 and np.isfinite(routing_skew)):
        raise RequestError(f"--routing-skew {routing_skew} must be >= 0 (0: random routing)")
    if routing_skew and not cfg.get("n_expert"):
        raise RequestError(f"--routing-skew needs a mixture-of-experts config; {arch}-{size} is dense")
    if routing_overlap is not None:
        if not (0.0 <= routing_overlap <= 1.0):
            raise RequestError(f"--routing-overlap {routing_overlap} must be between 0 and 1 (the "
                               "share of a token's experts the previous token also chose)")
        if not cfg.get("n_expert"):
            raise RequestError(f"--routing-overlap needs a mixture-of-experts config; {arch}-{size} is dense")
    calibrated = routing_overlap is not None
    tokens, ttypes, merges, bos, eos = _vocab(cfg["n_vocab"])
    mc = model_config(arch, cfg)

    plan = []
    for name, shape, qt in plan_types(quant, arch, cfg, pure):
        if routing_skew and not calibrated and name == "token_embd.weight":
            qt = BY_NAME["Q8_0"]   # carries the shared direction (random blocks cannot)
        plan.append((name, shape, qt))
    direction = None
    if routing_skew and not calibrated:   # calibrated routers carry popularity themselves
        u = np.random.default_rng([seed, 1 << 20]).standard_normal(mc.n_embd)
        direction = (u / np.linalg.norm(u)).astype(np.float32)

    attn_gain = ATTN_GAIN_CALIBRATED.get(arch, 1.0) if calibrated else 1.0
    gained = _query_path([n for n, _, _ in plan]) if attn_gain != 1.0 else set()

    tmp = path.with_name(path.name + ".partial")
    from .models.spec import write_hparams
    w = gguf.GGUFWriter(str(tmp), mc.arch)
    w.add_name(f"synthetic {arch}-{size} {quant}{' pure' if pure else ''}"
               + (f" first {layers} layers" if layers else ""))
    w.add_file_type(ftype)
    write_hparams(w, mc)
    if routing_skew:
        w.add_float32("memfit.synth.routing_skew", float(routing_skew))
    if calibrated:
        # asked; the measured values are written in place after calibration (same size)
        w.add_float32("memfit.synth.routing_overlap", float(routing_overlap))
        w.add_float32("memfit.synth.routing_overlap_measured", 0.0)
        w.add_float32("memfit.synth.routing_top_share_measured", 0.0)
        w.add_uint32("memfit.synth.routing_calibration_tokens",
                     ROUTING_CALIB_SEQS * ROUTING_CALIB_TOKENS)
        w.add_uint32("memfit.synth.routing_check_tokens", ROUTING_CHECK_TOKENS)
        w.add_uint32("memfit.synth.routing_check_sequences", ROUTING_CHECK_SEQS)
        w.add_float32("memfit.synth.attention_gain", attn_gain)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(ttypes)
    w.add_token_merges(merges)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(False)
    from .models.synthetic import CHAT_TEMPLATE
    w.add_chat_template(CHAT_TEMPLATE)
    w.add_uint32("memfit.synth.seed", seed)
    for name, shape, qt in plan:
        nbytes = qt.row_bytes(shape[-1]) * _rows(shape)
        # byte shape + raw type: gguf-py converts it back to the element shape
        w.add_tensor_info(name, (*shape[:-1], qt.row_bytes(shape[-1])), np.dtype(np.uint8),
                          nbytes, raw_dtype=gguf.GGMLQuantizationType(qt.id))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    align = w.data_alignment
    fout.write(b"\0" * (-fout.tell() % align))
    fout.flush()

    # writer thread: generation (numpy) and write(2) overlap; bounded queue caps memory
    q: queue.Queue = queue.Queue(maxsize=2)
    err: list[BaseException] = []
    fd = fout.fileno()

    def writer():
        try:
            while (buf := q.get()) is not None:
                mv = memoryview(buf)
                while mv:
                    mv = mv[os.write(fd, mv):]
        except BaseException as e:  # re-raised by the producer
            err.append(e)
            while q.get() is not None:
                pass

    th = threading.Thread(target=writer, name="memfit-synth-writer", daemon=True)
    th.start()
    t0 = time.perf_counter()
    written, last = 0, t0
    total = sum(qt.row_bytes(s[-1]) * _rows(s) for _, s, qt in plan)
    try:
        for idx, (name, shape, qt) in enumerate(plan):
            rng = np.random.default_rng([seed, idx])
            scale = min(0.05, 1.0 / np.sqrt(shape[-1]))
            if name.endswith(".bias"):
                data = (0.1 * rng.standard_normal(shape)).astype(np.float32).view(np.uint8)
                chunks = [data]
            else:
                skewed = direction is not None and (name == "token_embd.weight"
                                                    or name.endswith("ffn_gate_inp.weight"))
                chunks = _chunks(qt, shape, rng, scale, direction if skewed else None,
                                 routing_skew, name, attn_gain if name in gained else 1.0)
            n = 0
            for c in chunks:
                if err:
                    raise err[0]
                q.put(c)
                n += c.nbytes
            assert n == qt.row_bytes(shape[-1]) * _rows(shape), name
            q.put(np.zeros(-n % align, np.uint8))
            written += n
            now = time.perf_counter()
            if progress and (now - last > 0.5 or idx == len(plan) - 1):
                last = now
                print(f"\rsynth {path.name}: {written / 1e6:8.0f} / {total / 1e6:.0f} MB, "
                      f"{written / 1e6 / (now - t0):6.0f} MB/s", end="", file=sys.stderr,
                      flush=True)
    finally:
        q.put(None)
        th.join()
        w.close()
    if err:
        raise err[0]
    if progress:
        print(file=sys.stderr)
    if calibrated:
        if progress:
            print(f"synth {path.name}: calibrating the routers to overlap {routing_overlap}",
                  file=sys.stderr, flush=True)
        r = calibrate_routing(tmp, routing_overlap, routing_skew, seed, progress=progress)
        _set_measured(tmp, r["overlap"], r["top_share"])
        if progress:
            print(f"synth {path.name}: measured overlap {r['overlap']:.3f}, top-{mc.n_expert_used} "
                  f"share {r['top_share']:.3f} ({ROUTING_CHECK_SEQS} x {ROUTING_CHECK_TOKENS} decoded random tokens)",
                  file=sys.stderr)
    dt = time.perf_counter() - t0
    os.replace(tmp, path)
    return SynthResult(path, path.stat().st_size, len(plan), dt)


# ---- calibrated routing (--routing-overlap) ----
ROUTING_CALIB_TOKENS = 64     # tokens of each calibration sequence (from position 0)
ROUTING_CALIB_SEQS = 16       # calibration sequences the router rows are fitted on
ROUTING_VAL_SEQS = 16         # and sequences they are not fitted on, where the overlap is bisected
ROUTING_CHECK_TOKENS = 64     # held-out tokens a sequence, decoded one at a time (as calibrated:
ROUTING_CHECK_SEQS = 8        # overlap falls along a sequence, 0.51 -> 0.38 over 64 tokens on
                              # 30b-a3b), in sequences (one sequence's overlap varied 0.35-0.56)
_PERSISTENT, _FRESH = 0.8, 0.15   # lag-1 autocorrelation bounds of the two direction sets


class _StopForward(Exception):
    """Ends a calibration forward once the layer being calibrated has its inputs."""


def routing_stats(sel: np.ndarray, n_expert: int) -> tuple[float, float]:
    """(overlap, top share) of one layer's choices sel [T, k] over consecutive tokens:
    overlap = mean |S_t & S_t-1| / k; top share = the share of all picks that went to the
    layer's k most picked experts (k/n_expert when popularity is flat)."""
    k = sel.shape[1]
    pairs = zip(sel[:-1].tolist(), sel[1:].tolist())
    overlap = float(np.mean([len(set(a) & set(b)) / k for a, b in pairs]))
    counts = np.bincount(sel.reshape(-1), minlength=n_expert)
    return overlap, float(np.sort(counts)[::-1][:k].sum() / sel.size)


def _topk(logits: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-logits, axis=1, kind="stable")[:, :k]


def _router_rows(xs: list[np.ndarray], n_expert: int, k: int, overlap: float, skew: float,
                 rng: np.random.Generator, val: list[np.ndarray] | None = None
                 ) -> tuple[np.ndarray, float]:
    """Router rows W [n_expert, n_embd] for one layer from its router inputs xs (one array
    [T, n_embd] per sequence, consecutive tokens from position 0), and the overlap they give
    on val (other sequences' inputs of the same layer; xs when None).

    The centered inputs are whitened on their leading principal directions and split by
    lag-1 autocorrelation (eigenvectors of the symmetrized lag-1 correlation of the whitened
    rows, pairs within a sequence): "persistent" directions (>= 0.8: the slowly drifting
    part of the hidden state that consecutive tokens share, attention over the same prefix)
    and "fresh" ones (|.| <= 0.15: what the token itself brings). Each expert's logit is
    cos(th) times a random mix of the persistent directions plus sin(th) times a random mix
    of the fresh ones; th is bisected until the top-k overlap of consecutive tokens is
    ``overlap`` (as far as the data allows: all-fresh gives ~k/n_expert) on val, inputs the
    directions were not fitted on: with as many dimensions as tokens (n_embd 2048, 1024
    tokens) the fitted fresh directions carry much more of the calibration rows' variance
    than of any other token's: normalized on xs, the fresh mix's logits on other tokens were
    a fraction of the persistent ones' and of the popularity offsets, and no th brought a
    held-out decode below ~0.6-0.7 overlap in the later layers (0.77 asked 0.4 on the
    30b-a3b shape); both mixes are scaled to unit variance on val. Popularity: expert
    e's logits get the constant offset skew * a_e (a_e ~ N(0, 1), new per layer; units of
    the logits' spread) through the mean input; skew 0 cancels the mean's contribution
    (flat popularity)."""
    x = np.concatenate(xs).astype(np.float64)
    N, d = x.shape
    ends = np.cumsum([len(a) for a in xs])
    prev = np.setdiff1d(np.arange(N - 1), ends - 1)     # rows with a successor in their sequence
    mu = x.mean(axis=0)
    z = x - mu
    _, s, vt = np.linalg.svd(z, full_matrices=False)
    # few directions for the rows: the lag-1 estimates of the rest would be mostly noise
    r = int(min(d, N // 16, np.count_nonzero(s > s[0] * 1e-6)))
    white = vt[:r].T / s[:r] * np.sqrt(N)          # [d, r]: z @ white has unit covariance
    y = z @ white
    c1 = (y[prev].T @ y[prev + 1] + y[prev + 1].T @ y[prev]) / (2 * len(prev))
    lam, q = np.linalg.eigh(c1)
    pers = q[:, lam >= _PERSISTENT]
    if pers.shape[1] == 0:
        pers = q[:, -1:]
    fresh = q[:, np.abs(lam) <= _FRESH]
    if fresh.shape[1] == 0:
        fresh = q[:, np.argsort(np.abs(lam))[: max(1, r // 4)]]

    xv, vends = (x, ends) if val is None else (np.concatenate(val).astype(np.float64),
                                               np.cumsum([len(a) for a in val]))
    zv = z if val is None else xv - mu

    def mix(basis):   # [d, n_expert]: unit-variance logits over val, random per expert
        m = white @ basis @ rng.standard_normal((basis.shape[1], n_expert))
        return m / np.maximum((zv @ m).std(axis=0), 1e-12)

    wp, wf = mix(pers), mix(fresh)
    offset = skew * rng.standard_normal(n_expert)

    def rows(th: float) -> np.ndarray:
        w = np.cos(th) * wp + np.sin(th) * wf
        # the mean input's logit becomes the offset; the component along the mean moves
        # each row's logits by (offset - mu.w) * (x.mu / |mu|^2), ~offset on these inputs
        w = w + np.outer(mu, offset - mu @ w) / (mu @ mu)
        return w

    def ov(th: float) -> float:
        sel = _topk(xv @ rows(th), k)
        return float(np.mean([routing_stats(sel[a:b], n_expert)[0]
                              for a, b in zip(np.r_[0, vends[:-1]], vends)]))

    lo, hi = 0.0, np.pi / 2          # overlap falls as th grows
    for _ in range(14):
        mid = (lo + hi) / 2
        if ov(mid) > overlap:
            lo = mid
        else:
            hi = mid
    th = (lo + hi) / 2
    w = rows(th)
    return (1.5 * w.T).astype(np.float32), ov(th)   # logits of spread ~1.5: softmax weights


def calibrate_routing(path, overlap: float, skew: float, seed: int,
                      n_tokens: int = ROUTING_CALIB_TOKENS, n_seqs: int = ROUTING_CALIB_SEQS,
                      n_check: int = ROUTING_CHECK_TOKENS, progress: bool = False,
                      n_val: int = ROUTING_VAL_SEQS) -> dict:
    """Replace the router rows of a written MoE file (F32, in place) by rows computed from the
    real forward's router inputs (_router_rows) so that the model, run on a sequence of
    random tokens, routes with consecutive-token overlap ``overlap`` and popularity offsets
    of spread ``skew``. n_seqs + n_val sequences of n_tokens random tokens go through the
    layers side by side (layer l's rows are fitted on the first n_seqs' inputs, their overlap
    bisected on the other n_val's, and all are routed with them before layer l+1 sees its
    inputs). Then
    ROUTING_CHECK_SEQS sequences of n_check other random tokens are decoded one at a time from a fresh load of the patched
    file and their choices measured: returns {"overlap", "top_share"} (means over the MoE
    layers) and the per-layer lists. progress: a line on stderr per layer (a 48-layer 30B
    takes minutes on 2 cores)."""
    from .gguf import open_gguf
    from .models import load_model
    rng = np.random.default_rng([seed, 1 << 21])
    m = load_model(path)
    c = m.config
    rows: dict[int, np.ndarray] = {}
    seqs = [rng.integers(3, c.n_vocab, n_tokens) for _ in range(n_seqs + n_val)]
    try:
        orig = m.route

        def route(l, x):
            if l in rows:
                logits = np.ascontiguousarray(x @ rows[l].T, dtype=np.float32)
                return m.ops.route(logits, m.route_spec, m.vec.get(f"blk.{l}.exp_probs_b.bias"))
            return orig(l, x)

        # the forward (Model._forward) layer by layer, all sequences side by side, so that
        # each layer's router rows are chosen from every sequence's inputs before the next
        # layer runs on what the chosen routing produced
        emb = m.weights.get("token_embd.weight")
        state = []
        for ids in seqs:
            cache = m.new_cache(n_tokens)
            kv = cache.view(n_tokens)
            x = m.ops.get_rows(emb, ids)
            if c.embd_scale != 1.0:
                x = x * np.float32(c.embd_scale)
            state.append([x, kv, cache])
        t0 = time.perf_counter()
        for il in range(c.n_layer):
            if progress:
                print(f"\rsynth {os.path.basename(path).removesuffix('.partial')}: calibrating layer {il + 1}/{c.n_layer}, "
                      f"{time.perf_counter() - t0:.0f} s", end="", file=sys.stderr, flush=True)
            if c.is_moe(il):
                xs: list[np.ndarray] = []

                def capture(l, x, xs=xs):
                    xs.append(np.array(x, np.float32))
                    raise _StopForward   # this layer's router inputs: all that is needed

                m.route = capture
                for x, kv, _ in state:   # (its attention's K/V are written again below, the same)
                    m._rows_seq, m._rows_pos = m._zero_seq(n_tokens), kv.pos
                    try:
                        m.block(il, x, kv.pos, kv, None)
                    except _StopForward:
                        pass
                rows[il], _ = _router_rows(xs[:n_seqs], c.n_expert, c.n_expert_used, overlap,
                                           skew, rng, xs[n_seqs:] or None)
            m.route = route
            for st in state:
                m._rows_seq, m._rows_pos = m._zero_seq(n_tokens), st[1].pos
                st[0] = m.block(il, st[0], st[1].pos, st[1], None)
    finally:
        m.file.close()
        if progress:
            print(file=sys.stderr)
    with open_gguf(path) as f:
        places = {il: (f.tensors[f"blk.{il}.ffn_gate_inp.weight"].offset,
                       f.tensors[f"blk.{il}.ffn_gate_inp.weight"].nbytes) for il in rows}
        # a router bias (gpt-oss) becomes zero: the rows were fitted and bisected without it
        # (the calibration forward routes on x @ rows alone) and carry the popularity offsets
        biases = [(f.tensors[nm].offset, f.tensors[nm].nbytes) for il in rows
                  if (nm := f"blk.{il}.ffn_gate_inp.bias") in f.tensors]
    fd = os.open(path, os.O_WRONLY)
    try:
        for il, w in rows.items():
            off, nbytes = places[il]
            assert w.nbytes == nbytes, (il, w.shape)
            os.pwrite(fd, np.ascontiguousarray(w).tobytes(), off)
        for off, nbytes in biases:
            os.pwrite(fd, bytes(nbytes), off)
    finally:
        os.close(fd)
    return measure_routing(path, n_check, seed=seed + 1)


def _set_measured(path, overlap: float, top_share: float) -> None:
    """Write the measured routing statistics into their float32 metadata slots, in place."""
    import gguf
    rd = gguf.GGUFReader(str(path), "r+")
    for key, v in (("memfit.synth.routing_overlap_measured", overlap),
                   ("memfit.synth.routing_top_share_measured", top_share)):
        f = rd.fields[key]
        f.parts[f.data[0]][0] = v
    rd.data.flush()
    del rd


def measure_routing(path, n_tokens: int = ROUTING_CHECK_TOKENS, seed: int = 1, ops=None,
                    n_seqs: int = ROUTING_CHECK_SEQS) -> dict:
    """Decode n_seqs sequences of n_tokens random tokens one at a time (each a forward with
    the cache, as decode runs) and measure each MoE layer's router choices: {"overlap",
    "top_share"} (means over the MoE layers of the per-sequence statistics' means) and per
    layer ("overlap_by_layer", "top_share_by_layer")."""
    from .models import load_model
    m = load_model(path, ops=ops)
    stats: dict[int, list] = {}
    try:
        orig = m.route
        m._fused = []   # the router observed in Python: every layer op by op (same choices)
        rng = np.random.default_rng([seed, 1 << 22])
        for _ in range(n_seqs):
            picks: dict[int, list] = {}

            def route(il, x, picks=picks):
                sel, wts = orig(il, x)
                picks.setdefault(il, []).append(np.asarray(sel)[-1])
                return sel, wts

            m.route = route
            cache = m.new_cache(n_tokens)
            for t in rng.integers(3, m.config.n_vocab, n_tokens).tolist():
                m.forward([t], cache)
            for il, p in picks.items():
                stats.setdefault(il, []).append(routing_stats(np.stack(p), m.config.n_expert))
    finally:
        m.file.close()
    ov, top = zip(*(np.mean(v, axis=0) for _, v in sorted(stats.items())))
    return {"overlap": float(np.mean(ov)), "top_share": float(np.mean(top)),
            "overlap_by_layer": [round(float(v), 3) for v in ov],
            "top_share_by_layer": [round(float(v), 3) for v in top]}


__all__ = ["CONFIGS", "FILE_TYPES", "LLAMA_FTYPES", "LOWBIT_MIXES", "SINGLE_TYPES", "SynthResult",
           "synth", "check_output", "calibrate_routing", "measure_routing", "routing_stats",
           "tensor_type", "plan_types", "resolve_quant",
           "model_tensors", "model_config"]
