"""`memfit info` data: describe() and format_info() on synthetic and real GGUF files."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from memfit.errors import GGUFError
from memfit.gguf import open_gguf
from memfit.info import describe, format_info


def _write_synthetic(path, *, template=True, split_max_tensors=0):
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "qwen3", split_max_tensors=split_max_tensors)
    w.add_name("Tiny Test")
    w.add_context_length(4096)
    w.add_embedding_length(64)
    w.add_block_count(2)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_key_length(16)
    w.add_value_length(16)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(8)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(["<a>", "<b>", "c", "d"])
    w.add_token_merges(["c d"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    if template:
        w.add_chat_template("{{ messages[0]['content'] }}")
    w.add_tensor("token_embd.weight", rng.standard_normal((4, 64)).astype(np.float32))
    w.add_tensor("blk.0.attn_q.weight", rng.standard_normal((64, 64)).astype(np.float16))
    w.add_tensor("blk.1.attn_q.weight", rng.standard_normal((64, 64)).astype(np.float16))
    q = rng.integers(0, 256, size=(64, 4 * 34), dtype=np.uint8)  # Q8_0 rows of 128 elements
    w.add_tensor("blk.0.ffn_up.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("odd.weight", rng.integers(0, 9, size=(7,), dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_describe_synthetic(tmp_path):
    p = tmp_path / "tiny.gguf"
    _write_synthetic(p)
    d = describe(p)
    assert json.loads(json.dumps(d)) == d  # the --json output
    assert d["architecture"] == "qwen3" and d["name"] == "Tiny Test"
    assert d["gguf_version"] == 3 and d["split_count"] == 1
    assert d["file_size"] == p.stat().st_size
    assert d["hyperparameters"] == {
        "context_length": 4096, "embedding_length": 64, "block_count": 2,
        "feed_forward_length": 128, "head_count": 4, "head_count_kv": 2, "key_length": 16,
        "value_length": 16, "rms_norm_eps": float(np.float32(1e-6)), "rope_freq_base": 1e6,
        "expert_count": 8}
    t = d["tokenizer"]
    assert (t["model"], t["pre"], t["vocab_size"], t["merges"]) == ("gpt2", "qwen2", 4, 1)
    assert (t["bos_token_id"], t["bos_token"], t["eos_token"], t["add_bos"]) == (1, "<b>", "<a>", False)
    assert d["chat_template"] is True
    assert d["tensor_count"] == 5
    shares = {k: e["share"] for k, e in d["types"].items()}
    assert shares["F16"] == round(2 * 64 * 64 * 2 / d["tensor_bytes"], 6)
    assert abs(sum(shares.values()) - 1.0) < 1e-5
    assert {k: {f: v for f, v in e.items() if f != "share"} for k, e in d["types"].items()} == {
        "Q8_0": {"tensors": 1, "bytes": 64 * 136, "elements": 64 * 128},
        "F16": {"tensors": 2, "bytes": 2 * 64 * 64 * 2, "elements": 2 * 64 * 64},
        "F32": {"tensors": 1, "bytes": 4 * 64 * 4, "elements": 256},
        "I32": {"tensors": 1, "bytes": 28, "elements": 7},
    }
    assert d["tensor_bytes"] == sum(e["bytes"] for e in d["types"].values())
    assert d["n_params"] == 64 * 128 + 2 * 64 * 64 + 256 + 7
    assert d["unsupported_types"] == ["I32"]
    text = format_info(d)
    for needle in ("architecture   qwen3", "tokenizer      gpt2 (pre: qwen2), 4 tokens",
                   "chat template  yes", "tensors        5", "expert_count", "I32",
                   "not supported by memfit", "context_length"):
        assert needle in text, needle


def test_describe_without_template_and_split(tmp_path):
    p = tmp_path / "tiny.gguf"
    _write_synthetic(p, template=False, split_max_tensors=2)
    first = tmp_path / "tiny-00001-of-00003.gguf"
    d = describe(first)
    assert d["chat_template"] is False and d["split_count"] == 3 and d["tensor_count"] == 5
    assert d["file_size"] == sum(f.stat().st_size for f in tmp_path.glob("tiny-*.gguf"))
    assert "chat template  no" in format_info(d) and "3 parts" in format_info(d)


def test_describe_bad_file(tmp_path):
    p = tmp_path / "junk.gguf"
    p.write_bytes(b"not a gguf file at all, just text")
    with pytest.raises(GGUFError, match="magic"):
        describe(p)


@pytest.mark.realmodel
def test_describe_smollm2(smollm2_path):
    d = describe(smollm2_path)
    assert d["architecture"] == "llama"
    assert d["tokenizer"]["model"] == "gpt2" and d["tokenizer"]["pre"] == "smollm"
    assert d["tokenizer"]["vocab_size"] == 49152 and d["tokenizer"]["add_bos"] is False
    assert d["chat_template"] is True
    hp = d["hyperparameters"]
    assert (hp["block_count"], hp["embedding_length"], hp["head_count"], hp["head_count_kv"],
            hp["context_length"]) == (30, 576, 9, 3, 8192)
    assert d["tensor_count"] == 272 and set(d["types"]) == {"Q4_1", "Q8_0", "F32"}
    with open_gguf(smollm2_path) as f:
        ts = sorted(f.tensors.values(), key=lambda t: t.offset)
        # per-type totals sum to the data section, up to alignment padding between tensors
        span = ts[-1].offset + ts[-1].nbytes - ts[0].offset
        assert d["tensor_bytes"] == sum(t.nbytes for t in ts)
        assert span - len(ts) * f.alignment < d["tensor_bytes"] <= span
    assert "chat template  yes" in format_info(d)


@pytest.mark.realmodel
def test_describe_gemma(gemma_path):
    d = describe(gemma_path)
    assert d["architecture"] == "gemma3" and d["chat_template"] is False
    assert d["tokenizer"]["model"] == "llama" and d["tokenizer"]["add_bos"] is True
    assert d["tokenizer"]["bos_token"] == "<bos>" and d["tokenizer"]["vocab_size"] == 262144
    assert d["hyperparameters"]["sliding_window"] == 512
    assert set(d["types"]) == {"Q8_0", "Q5_0", "Q4_K", "Q6_K", "F32"}
    assert d["unsupported_types"] == []


def test_describe_shows_the_mix(tmp_path):
    # a synthetic MoE in a low-bit mix: per type count/bytes/share, per role the types
    from memfit.synth import synth
    p = synth(tmp_path / "m.gguf", "qwen2moe", "tiny", "IQ2_XXS", progress=False).path
    d = describe(p)
    assert json.loads(json.dumps(d)) == d
    assert (d["file_type"], d["file_type_name"]) == (19, "IQ2_XXS")
    assert abs(sum(e["share"] for e in d["types"].values()) - 1.0) < 1e-5
    assert d["types"]["IQ2_XXS"]["share"] > 0.8
    r = d["roles"]
    assert list(r) == ["embeddings", "output", "attention", "shared experts", "experts",
                       "router", "norms & biases"]
    assert set(r["embeddings"]) == {"Q2_K"} and set(r["output"]) == {"Q5_K"}
    assert r["attention"]["Q4_K"]["tensors"] == 4   # attn_v of 4 layers (16 experts)
    assert r["attention"]["IQ2_XXS"]["tensors"] == 12
    assert set(r["experts"]) == {"IQ2_XXS"} and r["experts"]["IQ2_XXS"]["tensors"] == 12
    assert set(r["router"]) == {"F32"} and set(r["norms & biases"]) == {"F32"}
    assert sum(e["bytes"] for ts in r.values() for e in ts.values()) == d["tensor_bytes"]
    text = format_info(d)
    for needle in ("file type      19 (IQ2_XXS)", "mix by role", "  experts         IQ2_XXS 12 (",
                   "  attention       IQ2_XXS 12 (", "%"):
        assert needle in text, needle
