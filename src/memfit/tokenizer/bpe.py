"""gpt2-style byte-level BPE from GGUF vocab + merges, built on HF `tokenizers`.

The pre-tokenizer follows llama.cpp (llama-vocab.cpp, llm_tokenizer_bpe): the regexes that
``tokenizer.ggml.pre`` names are applied one after another, each splitting every piece further
and keeping both the matches and the text between them ("isolated" splits), then the pieces are
byte-level encoded and merged by rank.
"""

from __future__ import annotations

from ..errors import UnsupportedError

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
           r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
          r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# pre name -> (regexes applied in order, ignore_merges); from llama.cpp's llama-vocab.cpp
_PRE: dict[str, tuple[tuple[str, ...], bool]] = {}
for _names, _spec in [
    (("default",), ((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"), False)),
    (("llama3", "llama-v3", "llama-bpe", "falcon3"), ((_LLAMA3,), True)),
    (("dbrx", "smaug-bpe"), ((_LLAMA3,), False)),
    (("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), ((_QWEN2,), False)),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
     ((r"\p{N}", _GPT2), False)),
    (("gpt-2", "phi-2", "mpt", "olmo", "jais", "roberta-bpe"), ((_GPT2,), False)),
    (("falcon",), ((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"), False)),
]:
    for _n in _names:
        _PRE[_n] = _spec

SUPPORTED_PRE = tuple(sorted(_PRE))


def build_bpe(tokens: list[str], merges: list[str], pre: str):
    """HF Tokenizer for a gpt2 vocab; tokens are byte-level strings (id = position)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    if pre not in _PRE:
        raise UnsupportedError(
            f"unknown BPE pre-tokenizer tokenizer.ggml.pre={pre!r}; memfit supports "
            f"{', '.join(SUPPORTED_PRE)}")
    regexes, ignore_merges = _PRE[pre]
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = []
    for m in merges:
        pos = m.find(" ", 1)                    # as llama.cpp: split at the first space after char 0
        if pos > 0:
            pairs.append((m[:pos], m[pos + 1:]))
    # BPE's vocab must hold every merge result; llama.cpp skips merges whose parts are unknown
    pairs = [(a, b) for a, b in pairs if a in vocab and b in vocab and a + b in vocab]
    model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges, fuse_unk=False,
                       byte_fallback=False)
    tk = Tokenizer(model)
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tk


def isolates_digits(pre: str | None) -> bool:
    """True when every digit is a pre-token of its own (a cut next to a digit is exact)."""
    regexes = _PRE.get(pre or "default", ((),))[0]
    return bool(regexes) and (regexes[0] == r"\p{N}" or r"|\p{N}|" in regexes[0])


def _byte_table() -> dict[str, int]:
    # GPT-2's reversible byte <-> printable-unicode map (inverse direction: char -> byte)
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


BYTE_DECODER = _byte_table()


def decode_bytelevel(text: str) -> bytes:
    """A gpt2 token's text -> raw bytes (llama.cpp llama_decode_text, incl. its [UNK_BYTE_0x..] form)."""
    out = bytearray()
    for ch in text:
        b = BYTE_DECODER.get(ch)
        if b is None:
            out += b"[UNK_BYTE_0x" + ch.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
        else:
            out.append(b)
    return bytes(out)
