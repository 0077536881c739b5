"""Synthetic real-shape models: quant mix, validity, determinism, loadability."""

from __future__ import annotations

import hashlib
import re

import numpy as np
import pytest

from memfit.errors import RequestError
from memfit.gguf import open_gguf
from memfit.quant.reference import dequantize
from memfit.synth import CONFIGS, model_tensors, synth, tensor_type


def _sha(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("s") / "tiny.gguf", "llama", "tiny", "Q4_K_M",
                 seed=1, progress=False).path


def test_q4_k_m_mix_follows_llama_quantize():
    # use_more_bits over 32 layers: 0..3, 28..31 and every third layer from 6
    more = [i for i in range(32) if tensor_type("Q4_K_M", f"blk.{i}.attn_v.weight", i, 32,
                                                4096, False).name == "Q6_K"]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert tensor_type("Q4_K_M", "blk.5.ffn_down.weight", 5, 32, 11008, False).name == "Q4_K"
    assert tensor_type("Q4_K_M", "blk.5.ffn_gate.weight", 5, 32, 4096, False).name == "Q4_K"
    assert tensor_type("Q4_K_M", "output.weight", None, 32, 4096, False).name == "Q6_K"
    assert tensor_type("Q4_K_M", "token_embd.weight", None, 32, 4096, False).name == "Q4_K"
    assert tensor_type("Q4_K_M", "blk.0.attn_norm.weight", 0, 32, 4096, True).name == "F32"
    assert tensor_type("Q4_0", "output.weight", None, 32, 4096, False).name == "Q6_K"
    # k-quant rows must be multiples of 256: llama-quantize falls back the same way
    assert tensor_type("Q4_K_M", "blk.0.ffn_up.weight", 0, 32, 1600, False).name == "Q5_0"
    with pytest.raises(RequestError, match="Q9"):
        tensor_type("Q9", "x", 0, 1, 256, False)


def test_real_shapes_and_sizes():
    cfg = CONFIGS[("qwen2", "7b")]
    ts = {n: s for n, s, _ in model_tensors("qwen2", cfg)}
    assert ts["token_embd.weight"] == (152064, 3584) and ts["blk.27.ffn_down.weight"] == (3584, 18944)
    assert ts["blk.0.attn_k.weight"] == (512, 3584) and "blk.0.attn_q.bias" in ts
    total = 0
    for n, s, layer in model_tensors("qwen2", cfg):
        qt = tensor_type("Q4_K_M", n, layer, 28, s[-1], len(s) == 1)
        total += qt.row_bytes(s[-1]) * (s[0] if len(s) == 2 else 1)
    assert 4.3 < total / 2**30 < 4.45  # llama.cpp's qwen2-7b Q4_K_M is 4.36 GiB
    llama7 = CONFIGS[("llama", "7b")]
    assert (llama7["n_embd"], llama7["n_layer"], llama7["n_ff"], llama7["n_vocab"]) == (4096, 32, 11008, 32000)


def test_blocks_valid_finite_no_zero_runs(tiny):
    with open_gguf(tiny) as f:
        assert f.metadata["llama.block_count"] == 4
        assert len(f.metadata["tokenizer.ggml.tokens"]) == CONFIGS[("llama", "tiny")]["n_vocab"]
        types = {n: t.type.name for n, t in f.tensors.items()}
        assert types["output.weight"] == "Q6_K" and types["blk.3.attn_v.weight"] == "Q6_K"
        assert types["blk.1.attn_v.weight"] == "Q4_K" and types["blk.0.ffn_norm.weight"] == "F32"
        for name, t in f.tensors.items():
            raw = f.tensor_data(name)
            x = dequantize(t.type.id, raw, int(np.prod(t.shape)))
            assert np.isfinite(x).all(), name
            assert 0.005 < float(np.abs(x).mean()) < 2.0, name
            # no run of 32 zero bytes anywhere in the data
            z = (raw.reshape(-1) == 0).astype(np.int8)
            run = np.convolve(z, np.ones(32, np.int8), "valid").max() if raw.size >= 32 else 0
            assert run < 32, name


def test_deterministic_from_seed(tmp_path, tiny):
    a = synth(tmp_path / "a.gguf", "llama", "tiny", "Q4_K_M", seed=1, progress=False).path
    b = synth(tmp_path / "b.gguf", "llama", "tiny", "Q4_K_M", seed=2, progress=False).path
    assert _sha(a) == _sha(tiny)
    assert a.stat().st_size == b.stat().st_size and _sha(a) != _sha(b)


def test_help_lists_every_shape():
    from memfit.cli import SYNTH_ARCHS, SYNTH_SIZES
    sizes: dict[str, list[str]] = {}
    for arch, size in CONFIGS:
        sizes.setdefault(arch, []).append(size)
    assert SYNTH_ARCHS.split(" | ") == list(sizes)
    assert SYNTH_SIZES == "; ".join(f"{a} {'|'.join(s)}" for a, s in sizes.items())


def test_unknown_config_named(tmp_path):
    with pytest.raises(RequestError, match="llama-13x"):
        synth(tmp_path / "x.gguf", "llama", "13x", progress=False)
    assert not (tmp_path / "x.gguf").exists()


def test_loads_tokenizes_and_runs(tmp_path):
    from memfit.models import load_model
    from memfit.tokenizer import Tokenizer
    path = synth(tmp_path / "q.gguf", "qwen2", "tiny", "Q8_0", progress=False).path
    with open_gguf(path) as f:
        tok = Tokenizer.from_metadata(f.metadata)
        ids = tok.encode("hello world, the end", add_special=False)
        assert tok.decode(ids) == "hello world, the end"
    model = load_model(path)
    try:
        logits = model.forward(np.array(ids, np.int32), model.new_cache(64))
        assert logits.shape[-1] == CONFIGS[("qwen2", "tiny")]["n_vocab"]
        assert np.isfinite(logits).all()
    finally:
        model.file.close()


def _plan(quant, arch, size, **over):
    from memfit.synth import plan_types
    return {n: qt.name for n, _, qt in plan_types(quant, arch, {**CONFIGS[(arch, size)], **over})}


def test_low_bit_mixes_follow_llama_quantize():
    # llama-7b: n_gqa 1, 32 layers (ffn_down of the first 32/8 = 4 layers bumped)
    t = _plan("IQ2_XXS", "llama", "7b")
    assert (t["output.weight"], t["token_embd.weight"], t["blk.0.attn_v.weight"]) == ("Q5_K", "Q2_K", "Q2_K")
    assert [t[f"blk.{i}.ffn_down.weight"] for i in (0, 3, 4, 31)] == ["Q2_K", "Q2_K", "IQ2_XXS", "IQ2_XXS"]
    assert t["blk.5.attn_output.weight"] == t["blk.5.ffn_gate.weight"] == "IQ2_XXS"
    assert t["blk.5.attn_norm.weight"] == "F32"
    assert _plan("IQ2_XXS", "qwen2", "7b")["blk.9.attn_v.weight"] == "Q4_K"   # n_gqa 7
    t = _plan("IQ1_S", "llama", "7b")
    assert (t["blk.9.attn_output.weight"], t["blk.9.ffn_up.weight"]) == ("IQ2_XXS", "IQ1_S")
    assert _plan("IQ1_M", "llama", "7b")["blk.9.attn_q.weight"] == "IQ1_M"
    t = _plan("IQ2_S", "llama", "7b")   # default IQ2_XS, bumps to IQ3_S
    assert (t["blk.9.ffn_up.weight"], t["blk.9.attn_v.weight"], t["blk.0.ffn_down.weight"],
            t["blk.9.attn_output.weight"], t["token_embd.weight"]) == ("IQ2_XS",) + ("IQ3_S",) * 4
    assert _plan("IQ2_M", "llama", "7b")["blk.9.ffn_up.weight"] == "IQ2_S"
    assert _plan("IQ2_XS", "llama", "7b")["blk.9.ffn_up.weight"] == "IQ2_XS"
    t = _plan("IQ3_XXS", "llama", "7b")
    assert (t["blk.9.attn_q.weight"], t["blk.9.attn_k.weight"], t["blk.9.attn_v.weight"],
            t["blk.9.attn_output.weight"], t["blk.0.ffn_down.weight"], t["output.weight"],
            t["token_embd.weight"]) == ("IQ2_S", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ3_XXS", "Q5_K", "IQ3_S")
    t = _plan("IQ3_S", "qwen2", "7b")
    assert (t["output.weight"], t["blk.9.attn_v.weight"], t["blk.9.ffn_up.weight"]) == ("Q6_K", "Q4_K", "IQ3_S")
    assert _plan("IQ3_S", "llama", "7b")["blk.9.attn_v.weight"] == "IQ3_S"
    t = _plan("IQ3_M", "llama", "7b")
    assert [t[f"blk.{i}.ffn_down.weight"] for i in (3, 4)] == ["Q4_K", "IQ3_S"]
    assert t["blk.9.attn_v.weight"] == t["blk.9.attn_output.weight"] == "Q4_K"
    # MoE: experts (3-D) MXFP4, every other matrix Q8_0; expert counts >= 4 bump attn_v
    t = _plan("MXFP4_MOE", "qwen3moe", "30b-a3b")
    assert t["blk.3.ffn_down_exps.weight"] == t["blk.3.ffn_gate_exps.weight"] == "MXFP4"
    assert t["blk.3.attn_q.weight"] == t["output.weight"] == t["token_embd.weight"] == "Q8_0"
    assert t["blk.3.ffn_gate_inp.weight"] == "F32"
    t = _plan("IQ2_XXS", "qwen3moe", "30b-a3b")
    assert (t["blk.3.attn_v.weight"], t["blk.3.attn_k.weight"], t["blk.5.ffn_down_exps.weight"],
            t["blk.6.ffn_down_exps.weight"]) == ("Q4_K", "IQ2_XXS", "Q2_K", "IQ2_XXS")
    # 8 experts (Mixtral): attn_k Q4_K and attn_output Q5_K; IQ3_* attn_v/attn_k Q8_0
    t = _plan("IQ2_XXS", "mixtral", "2gb")
    assert (t["blk.9.attn_k.weight"], t["blk.9.attn_output.weight"]) == ("Q4_K", "Q5_K")
    t = _plan("IQ3_M", "mixtral", "2gb")
    assert (t["blk.9.attn_v.weight"], t["blk.9.attn_k.weight"], t["blk.9.attn_output.weight"],
            t["blk.9.ffn_down_exps.weight"], t["blk.11.ffn_down_exps.weight"]) == \
        ("Q8_0", "Q8_0", "Q5_K", "IQ3_S", "Q4_K")   # use_more_bits(11, 24)
    # shared experts: ffn_down* counted in llama-quantize's order (layer, then name), so of
    # 16 layers' 32 ffn_down tensors the first 2 (layer 0's experts and shared expert) bump
    t = _plan("IQ2_XXS", "qwen2moe", "tiny", n_layer=16)
    assert (t["blk.0.ffn_down_exps.weight"], t["blk.0.ffn_down_shexp.weight"],
            t["blk.1.ffn_down_exps.weight"]) == ("Q2_K", "Q2_K", "IQ2_XXS")
    # tied embeddings take the output's type
    t = _plan("IQ2_XXS", "qwen2", "1.5b")
    assert "output.weight" not in t and t["token_embd.weight"] == "Q5_K"


def test_low_bit_fallback_and_sizes():
    # rows that are not a multiple of 256: tensor_type_fallback's types, then F16
    assert tensor_type("IQ2_XXS", "blk.9.ffn_up.weight", 9, 32, 1600, False).name == "IQ4_NL"
    assert tensor_type("TQ1_0", "blk.9.ffn_up.weight", 9, 32, 1600, False).name == "Q4_0"
    assert tensor_type("IQ2_XXS", "blk.9.ffn_up.weight", 9, 32, 1608, False).name == "F16"
    assert tensor_type("IQ2_XXS", "output.weight", None, 32, 1600, False).name == "Q8_0"
    # bits per weight of the whole file: above the main type's (IQ2_XXS 2.06, IQ3_S 3.44),
    # below the next type up's, from the bumped tensors
    from memfit.synth import plan_types
    cfg = CONFIGS[("qwen2", "7b")]
    for quant, lo, hi in (("IQ2_XXS", 2.06, 2.5), ("IQ3_M", 3.44, 4.0), ("IQ1_S", 1.56, 2.06)):
        pl = [(s, qt) for _, s, qt in plan_types(quant, "qwen2", cfg) if len(s) > 1]
        bits = 8 * sum(qt.row_bytes(s[-1]) * int(np.prod(s[:-1])) for s, qt in pl)
        bpw = bits / sum(int(np.prod(s)) for s, _ in pl)
        assert lo < bpw < hi, (quant, bpw)


def test_single_type_files(tmp_path):
    from memfit.synth import FILE_TYPES, LLAMA_FTYPES, SINGLE_TYPES, resolve_quant
    assert {"TQ1_0", "NVFP4", "MXFP4", "IQ1_M", "Q2_K", "IQ4_XS", "BF16"} <= set(SINGLE_TYPES)
    for ty in SINGLE_TYPES:
        pure = ty in FILE_TYPES
        mix, single, ftype = resolve_quant(ty, pure)
        assert single == ty and ftype in LLAMA_FTYPES.values(), ty
        assert tensor_type(ty, "output.weight", None, 4, 512, False, pure=pure).name == ty
        assert tensor_type(ty, "blk.0.ffn_gate_inp.weight", 0, 4, 512, False, pure=pure).name == "F32"
    assert resolve_quant("IQ2_M", pure=True)[1:] == ("IQ2_S", 29)   # the mix's default type
    assert resolve_quant("IQ2_S", pure=True)[1:] == ("IQ2_S", 29)
    assert resolve_quant("Q4_K")[2] == 14 and resolve_quant("NVFP4")[2] == 39
    assert resolve_quant("IQ2_XXS")[1] is None   # a mix name without --pure is the mix
    with pytest.raises(RequestError, match="Q8_K"):
        resolve_quant("Q8_K")
    # small files of a few of them: the types written, valid blocks
    for ty in ("TQ1_0", "NVFP4", "IQ2_XXS"):
        p = synth(tmp_path / f"{ty}.gguf", "llama", "tiny", ty, progress=False,
                  pure=ty in FILE_TYPES).path
        with open_gguf(p) as f:
            assert f.metadata["general.file_type"] == resolve_quant(ty, ty in FILE_TYPES)[2]
            types = {n: t.type.name for n, t in f.tensors.items()}
            assert {types["output.weight"], types["blk.2.attn_k.weight"]} == {ty}
            assert types["blk.2.attn_norm.weight"] == "F32"
            t = f.tensors["blk.2.attn_k.weight"]
            x = dequantize(t.type.id, f.tensor_data(t.name), int(np.prod(t.shape)))
            assert np.isfinite(x).all() and 0.002 < float(np.abs(x).mean()) < 1.0, ty


def test_run_refuses_a_type_not_computable_yet(tmp_path):
    # synth writes any type; `memfit run` names the first tensor memfit cannot compute
    from memfit.quant.types import SUPPORTED_NAMES
    from memfit.synth import FILE_TYPES, SINGLE_TYPES
    from test_budget_e2e import memfit
    todo = [t for t in SINGLE_TYPES if t not in SUPPORTED_NAMES]
    if not todo:
        pytest.skip("every type memfit writes is computable")
    ty = todo[0]
    p = synth(tmp_path / "x.gguf", "llama", "tiny", ty, progress=False, pure=ty in FILE_TYPES).path
    r = memfit("run", p, "-p", "hi", "-n", 1)
    assert r.rc != 0 and "Traceback" not in r.err
    assert re.search(rf"tensor \S+\.weight has type {ty}, which memfit cannot compute", r.err), r.err[-2000:]
