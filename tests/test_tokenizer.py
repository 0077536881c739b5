"""Tokenizer from GGUF metadata: llama.cpp's ids for every golden case of both real models,
plus small hand-built vocabularies that pin down the SPM merge order, byte fallback, special
token handling and the BPE pre-tokenizer regexes."""

from __future__ import annotations

import time

import pytest

from conftest import GOLDEN, load_jsonl
from memfit.errors import MemfitError, ModelError, UnsupportedError
from memfit.gguf import open_gguf
from memfit.tokenizer import Tokenizer

MODELS = {"smollm2": "SmolLM2-135M-Instruct.Q4_1", "gemma": "gemma-3-270m-q4_k_m"}


def _cases(kind: str) -> list:
    params = []
    for model, stem in MODELS.items():
        path = GOLDEN / f"{kind}_{stem}.jsonl"
        if not path.is_file():
            params.append(pytest.param(model, None, marks=pytest.mark.skip(f"no {path}")))
            continue
        for i, case in enumerate(load_jsonl(path)):
            params.append(pytest.param(model, case, id=f"{model}-{i}"))
    return params


@pytest.fixture(scope="module")
def metadata(smollm2_path, gemma_path):
    out = {}
    for name, path in (("smollm2", smollm2_path), ("gemma", gemma_path)):
        f = open_gguf(path)
        out[name] = f.metadata
        f.close()
    return out


@pytest.fixture(scope="module")
def toks(metadata):
    return {name: Tokenizer.from_metadata(md) for name, md in metadata.items()}


@pytest.mark.realmodel
@pytest.mark.parametrize("model,case", _cases("tokenizer"))
def test_golden_tokenizer(toks, model, case):
    tok = toks[model]
    text = case["text"]
    assert tok.encode(text, add_special=False, parse_special=False) == case["ids_plain"]
    assert tok.encode(text, add_special=True, parse_special=False) == case["ids_with_special"]
    assert tok.decode(case["ids_plain"]) == case["detok"]


@pytest.mark.realmodel
@pytest.mark.parametrize("model,case", _cases("greedy"))
def test_golden_prompt_ids(toks, model, case):
    # /completion tokenizes with add_special and parse_special (<|im_start|>, <start_of_turn>)
    assert toks[model].encode(case["prompt"], add_special=True, parse_special=True) == case["prompt_ids"]


@pytest.mark.realmodel
def test_real_model_properties(toks):
    s, g = toks["smollm2"], toks["gemma"]
    assert (s.kind, s.pre, s.n_vocab, s.add_bos, s.bos_id, s.eos_id) == ("gpt2", "smollm", 49152, False, 1, 2)
    assert (g.kind, g.n_vocab, g.add_bos, g.bos_id, g.eos_id) == ("llama", 262144, True, 2, 1)
    # llama.cpp's EOG sets: <|endoftext|>, <|im_end|>, <reponame> (fim rep) / <eos>, <end_of_turn>, </s>
    assert s.eog_ids == {0, 2, 4}
    assert g.eog_ids == {1, 106, 212}
    assert s.chat_template and "<|im_start|>" in s.chat_template
    assert g.chat_template is None
    assert s.token_text(1) == "<|im_start|>"
    hello = s.encode(" hello", add_special=False)
    assert [s.token_text(i) for i in hello] == ["Ġhello"] and s.piece(hello[0]) == " hello"
    assert g.token_to_bytes(g.token_id("<0x0A>")) == b"\n"


@pytest.mark.realmodel
def test_parse_special_switch(toks):
    s, g = toks["smollm2"], toks["gemma"]
    text = "<|im_start|>user\nHi<|im_end|>"
    parsed = s.encode(text, add_special=False, parse_special=True)
    assert parsed[0] == 1 and parsed[-1] == 2
    plain = s.encode(text, add_special=False, parse_special=False)
    assert 1 not in plain and 2 not in plain
    assert s.decode(plain) == text == s.decode(parsed)
    # control tokens vanish with skip_special; the text around them stays
    assert s.decode(parsed, skip_special=True) == "user\nHi"
    ids = g.encode("<start_of_turn>user\nHi<end_of_turn>", add_special=True, parse_special=True)
    assert ids[:2] == [2, 105] and ids[-1] == 106


@pytest.mark.realmodel
def test_gemma_builds_fast(metadata):
    # CPU time of this process: other tests running beside (pytest-xdist) do not count
    t0 = time.process_time()
    tok = Tokenizer.from_metadata(metadata["gemma"])
    tok.encode("warm up the byte table: \U000e0001")
    assert time.process_time() - t0 < 2.0


@pytest.mark.realmodel
def test_gemma_byte_fallback(toks):
    g = toks["gemma"]
    text = "a\U000e0001b"             # a tag character with no piece in the vocab
    ids = g.encode(text, add_special=False)
    byte_ids = [i for i in ids if g.token_type(i) == 6]
    assert [g.token_to_bytes(i) for i in byte_ids] == list(bytes([b]) for b in "\U000e0001".encode())
    assert g.decode(ids) == text


# -- hand-built vocabularies ---------------------------------------------------------------

def _spm_md(pieces: dict[str, float], **kw) -> dict:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(pieces)
    types = [2, 3, 3] + [6] * 256 + [4 if p.startswith("<u") else 1 for p in pieces]
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + list(pieces.values())
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
          "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    md.update(kw)
    return md


def test_spm_merge_order_by_score():
    # "abc": ab (-1) beats bc (-2), then "ab"+"c" has no piece -> [ab, c]; with bc scored
    # higher the merge goes the other way -> [a, bc]
    pieces = {"a": -10.0, "b": -10.0, "c": -10.0, "ab": -1.0, "bc": -2.0, "▁": -5.0}
    tok = Tokenizer.from_metadata(_spm_md(pieces))
    ids = tok.encode("abc", add_special=False)
    assert [tok.token_text(i) for i in ids] == ["▁", "ab", "c"]  # add_space_prefix defaults on
    pieces.update({"bc": -0.5})
    tok = Tokenizer.from_metadata(_spm_md(pieces, **{"tokenizer.ggml.add_space_prefix": False}))
    assert [tok.token_text(i) for i in tok.encode("abc", add_special=False)] == ["a", "bc"]
    assert tok.encode("abc") == [1] + tok.encode("abc", add_special=False)


def test_spm_tie_breaks_leftmost_and_bytes():
    pieces = {"a": -1.0, "aa": -1.0, "▁": -1.0}
    tok = Tokenizer.from_metadata(_spm_md(pieces, **{"tokenizer.ggml.add_space_prefix": False}))
    ids = tok.encode("aaa", add_special=False)
    assert [tok.token_text(i) for i in ids] == ["aa", "a"]
    ids = tok.encode("aé", add_special=False)  # é has no piece: its two UTF-8 bytes
    assert [tok.token_text(i) for i in ids] == ["a", "<0xC3>", "<0xA9>"]
    assert tok.decode(ids) == "aé"


def test_spm_user_defined_always_split_control_only_when_parsing():
    pieces = {"a": -1.0, "<u>": -1.0, "▁": -1.0}
    tok = Tokenizer.from_metadata(_spm_md(pieces, **{"tokenizer.ggml.add_space_prefix": False}))
    uid = tok.token_id("<u>")
    assert uid in tok.encode("a<u>a", add_special=False, parse_special=False)
    ids = tok.encode("a</s>", add_special=False, parse_special=False)
    assert 2 not in ids and tok.decode(ids) == "a</s>"
    assert tok.encode("a</s>", add_special=False, parse_special=True)[-1] == 2
    assert tok.decode([1, tok.token_id("a"), 2], skip_special=True) == "a"


def _bpe_md(pre: str) -> dict:
    from memfit.tokenizer.bpe import BYTE_DECODER
    byte_chars = sorted(BYTE_DECODER, key=BYTE_DECODER.get)  # 256 byte-level characters
    tokens = ["<|endoftext|>"] + byte_chars + ["he", "ll", "hell", "hello", "Ġw"]
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3] + [1] * (len(tokens) - 1), "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 0}


@pytest.mark.parametrize("pre,digits", [
    ("default", ["123", "456", "7"]), ("smollm", list("1234567")), ("qwen2", list("1234567")),
    ("deepseek-r1-qwen", list("1234567")), ("llama-bpe", ["123", "456", "7"]),
    ("llama3", ["123", "456", "7"]), ("gpt-2", ["1234567"]),
])
def test_bpe_pre_tokenizers(pre, digits):
    tok = Tokenizer.from_metadata(_bpe_md(pre))
    pieces = [p for p, _ in tok._hf.pre_tokenizer.pre_tokenize_str("1234567")]
    assert pieces == digits
    ids = tok.encode("hello world", add_special=False)
    assert tok.token_text(ids[0]) == "hello" and tok.token_text(ids[1]) == "Ġw"
    assert tok.decode(ids) == "hello world"
    assert tok.add_bos == (pre in ("llama-bpe", "llama3"))


def test_errors_are_clear():
    with pytest.raises(UnsupportedError, match="pre-tokenizer.*'nonesuch'"):
        Tokenizer.from_metadata(_bpe_md("nonesuch"))
    with pytest.raises(UnsupportedError, match="'bert'"):
        Tokenizer.from_metadata({**_bpe_md("default"), "tokenizer.ggml.model": "bert"})
    with pytest.raises(ModelError, match="tokenizer.ggml.model"):
        Tokenizer.from_metadata({})
    tok = Tokenizer.from_metadata(_bpe_md("default"))
    with pytest.raises(MemfitError, match="out of range"):
        tok.decode([10**6])


@pytest.mark.realmodel
def test_perplexity_text_token_counts(toks):
    # llama-perplexity: one trailing newline stripped, add_special, no special parsing
    import json
    pj = GOLDEN / "perplexity.json"
    if not pj.is_file():
        pytest.skip(f"no {pj}")
    text = (GOLDEN / "GPL-3.txt").read_text(encoding="utf-8")
    text = text[:-1] if text.endswith("\n") else text
    counts = {r["model"]: r["n_tokens"] for r in json.loads(pj.read_text())["results"]}
    for model, stem in MODELS.items():
        assert len(toks[model].encode(text, add_special=True, parse_special=False)) == counts[stem + ".gguf"]


def test_ids_accept_numpy_and_reject_bad_input():
    import numpy as np
    tok = Tokenizer.from_metadata(_bpe_md("default"))
    ids = tok.encode("hello", add_special=False)
    assert tok.decode(np.array(ids, dtype=np.int32)) == "hello"
    with pytest.raises(MemfitError, match="not an integer"):
        tok.token_to_bytes("7")
    with pytest.raises(MemfitError, match="lone surrogate"):
        tok.encode("a\ud800b")
