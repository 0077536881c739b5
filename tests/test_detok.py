"""Streaming detokenization: pieces never split a character, and together equal decode()."""

from __future__ import annotations

import pytest

from memfit.gguf import open_gguf
from memfit.tokenizer import StreamDecoder, Tokenizer

TEXTS = [
    "Thumbs up 👍🏽 and flag 🇰🇷",
    "中文测试：你好，世界",
    "한국어 문장을 토큰화합니다.",
    "naïve café résumé",
    "tag \U000e0001 char and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math",
    "<|im_start|>user\nemoji 🤖<|im_end|>",
]


@pytest.fixture(scope="module")
def toks(smollm2_path, gemma_path):
    out = {}
    for name, path in (("smollm2", smollm2_path), ("gemma", gemma_path)):
        f = open_gguf(path)
        out[name] = Tokenizer.from_metadata(f.metadata)
        f.close()
    return out


def _stream(tok, ids):
    sd = StreamDecoder(tok)
    pieces = [sd.push(i) for i in ids]
    return pieces, sd.flush()


@pytest.mark.realmodel
@pytest.mark.parametrize("model", ["smollm2", "gemma"])
@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_decode(toks, model, text):
    tok = toks[model]
    ids = tok.encode(text, add_special=False, parse_special=True)
    pieces, tail = _stream(tok, ids)
    assert "".join(pieces) + tail == tok.decode(ids) == text
    # the text is valid, so no piece may carry a replacement char from a split character
    assert all("\ufffd" not in p for p in pieces) and tail == ""


@pytest.mark.realmodel
def test_multibyte_character_is_held_back(toks):
    g, s = toks["gemma"], toks["smollm2"]
    # gemma byte fallback: é as two byte tokens, pushed one at a time
    sd = StreamDecoder(g)
    assert sd.push(g.token_id("<0xC3>")) == "" and sd.pending
    assert sd.push(g.token_id("<0xA9>")) == "é" and not sd.pending
    # a 4-byte tag character that gemma has no piece for comes out as 4 byte tokens
    ids = g.encode("\U000e0001", add_special=False)
    assert len(ids) == 4
    pieces, tail = _stream(g, ids)
    assert pieces == ["", "", "", "\U000e0001"] and tail == ""
    # SmolLM2 byte-level BPE splits this emoji's bytes over several tokens
    ids = s.encode("🤖", add_special=False)
    assert len(ids) > 1
    pieces, _ = _stream(s, ids)
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "🤖"


@pytest.mark.realmodel
def test_invalid_and_truncated_bytes(toks):
    g = toks["gemma"]
    ff, c3 = g.token_id("<0xFF>"), g.token_id("<0xC3>")
    a = g.encode("a", add_special=False)
    ids = [ff] + a + [c3]
    pieces, tail = _stream(g, ids)
    # a byte that can never start a character is replaced at once; a cut-off one at flush
    assert pieces == ["\ufffd", "a", ""] and tail == "\ufffd"
    assert "".join(pieces) + tail == g.decode(ids)


@pytest.mark.realmodel
def test_skip_special_stream(toks):
    s = toks["smollm2"]
    ids = s.encode("<|im_start|>hi<|im_end|>", add_special=False, parse_special=True)
    sd = StreamDecoder(s, skip_special=True)
    assert "".join(sd.push(i) for i in ids) + sd.flush() == "hi"
