"""Synthetic real-shape models: quant mix, validity, determinism, loadability."""

from __future__ import annotations

import hashlib

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
