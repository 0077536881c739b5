"""Tokenizer from GGUF metadata with llama.cpp's semantics (llama-vocab.cpp).

    tok = Tokenizer.from_metadata(open_gguf(path).metadata)
    tok.encode(text, add_special=True, parse_special=True) -> list[int]
    tok.decode(ids, skip_special=False) -> str

``encode``: special-token text is split out first (llama.cpp tokenizer_st_partition: longest
token first; user-defined tokens always, control/unknown ones only with parse_special), then each
plain fragment goes through the model: gpt2 byte-level BPE (HF `tokenizers`, see bpe.py) or
llama SPM (spm.py). ``decode`` concatenates the pieces of llama.cpp's token_to_piece.
Token attributes follow llama.cpp's load-time fix-ups: end-of-generation texts (<|im_end|>,
<end_of_turn>, </s>, ...) become control tokens, so gemma's user-defined "</s>" is not split
out of plain text and is an EOG id, exactly as llama.cpp does.
"""

from __future__ import annotations

import collections
import operator
import re

import numpy as np

from ..errors import ModelError, RequestError, UnsupportedError
from .bpe import BYTE_DECODER, build_bpe, decode_bytelevel, isolates_digits
from .spm import SPMModel

# GGUF token types (llama.cpp LLAMA_TOKEN_TYPE_*)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# llama.cpp token attributes (bit flags; the type maps to one, fix-ups OR more in)
A_UNKNOWN, A_UNUSED, A_NORMAL, A_CONTROL, A_USER_DEFINED, A_BYTE = 1, 2, 4, 8, 16, 32
_TYPE_TO_ATTR = {UNKNOWN: A_UNKNOWN, UNUSED: A_UNUSED, NORMAL: A_NORMAL, CONTROL: A_CONTROL,
                 USER_DEFINED: A_USER_DEFINED, BYTE: A_BYTE}
_SPECIAL = A_UNKNOWN | A_CONTROL                # rendered only when special=True

# token texts llama.cpp treats as end-of-generation (and forces to CONTROL)
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
              "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
              "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
              "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[")
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
              "<end_of_utterance>")
_FIM_PAD = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP = ("<|file_sep|>",)

# candidate cut positions for streamed encoding (Tokenizer._safe_cut checks the rest)
_BPE_CUT = re.compile(r"(?<=[A-Za-z])[\x00-\x40\x5b-\x60\x7b-\x7f]|(?<=[^\s]) |(?<=[^\W_])[\t\n\r\f\v]")
# and where every digit is a pre-token of its own (smollm, qwen2, ...): around a digit
_BPE_CUT_DIGITS = re.compile(_BPE_CUT.pattern + r"|(?<=[^\s])[0-9]|(?<=[0-9]).", re.S)
# SPM: not after a literal '▁' (it would join the next word's '▁' run)
_SPM_CUT = re.compile("(?<=[^\\s\u2581]) ")
_SPM_CUT_NL = re.compile("(?<=[^\\s\u2581]) |(?<=\n)[^\\s]")


# the longest stretch without an exact cut that encode_limited tokenizes at once: its scratch
# (~80 bytes per UTF-8 byte in HF tokenizers, ~250 per char in the SPM merge) is what a
# prompt costs beyond its text; planner.PROMPT_SCRATCH_BYTES reserves it
MAX_PIECE_CHARS = 1 << 14


class UncuttableText(RequestError):
    """A stretch longer than encode_limited's max_piece with no place to cut it exactly."""


class TooManyTokens(RequestError):
    """The text has more tokens than the limit given to encode_limited (at least n)."""

    def __init__(self, n_at_least: int, limit: int):
        super().__init__(f"the text has at least {n_at_least} tokens; the limit is {limit}")
        self.n_at_least, self.limit = n_at_least, limit


class Tokenizer:
    """A GGUF vocabulary; build with ``Tokenizer.from_metadata``."""

    def __init__(self, *, kind: str, pre: str | None, tokens: list[str], types: list[int],
                 scores: list[float] | None, merges: list[str] | None, bos_id: int | None,
                 eos_id: int | None, add_bos: bool, add_eos: bool, add_space_prefix: bool,
                 chat_template: str | None, extra_ids: dict[str, int | None],
                 forced_control: frozenset[int] = frozenset()):
        self.kind = kind
        self.pre = pre
        self._tokens = tokens
        self._types = types
        self.n_vocab = len(tokens)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.add_space_prefix = add_space_prefix
        self.chat_template = chat_template
        # text -> id; on duplicate text the last id wins, as in llama.cpp's token_to_id map
        self._t2i = dict(zip(tokens, range(len(tokens))))

        # attributes as llama.cpp derives them (llama_vocab::impl::load)
        types_np = np.asarray(types, dtype=np.int64)
        table = np.zeros(8, dtype=np.int64)     # other types map to UNDEFINED (0)
        for t, a in _TYPE_TO_ATTR.items():
            table[t] = a
        attrs_np = table[np.where((types_np >= 0) & (types_np < 8), types_np, 7)]
        for i in forced_control:
            attrs_np[i] |= A_CONTROL            # eot/eom/fim tokens found by their text
        for i in np.flatnonzero(attrs_np & A_CONTROL).tolist():
            if "unused" in tokens[i]:
                attrs_np[i] |= A_UNUSED
        attrs = attrs_np.tolist()
        self._attrs = attrs
        eog = {i for i in (extra_ids.get("fim_pad"), extra_ids.get("fim_rep"),
                           extra_ids.get("fim_sep")) if i is not None}
        for text in _EOG_TEXTS:
            i = self._t2i.get(text)
            if i is not None:
                eog.add(i)
                attrs[i] |= A_CONTROL
        for i in (eos_id, extra_ids.get("eot"), extra_ids.get("eom")):
            if i is not None:
                eog.add(i)
        texts = {tokens[i]: i for i in eog}
        if "<|end|>" in texts and (("<|return|>" in texts and "<|call|>" in texts)
                                   or ("<|calls|>" in texts and "<|flush|>" in texts)):
            eog.discard(texts["<|end|>"])       # harmony / solar-open: <|end|> ends a message only
            attrs[texts["<|end|>"]] = A_USER_DEFINED
        if "<|tool_response>" in texts and "</s>" in texts:
            eog.discard(texts["</s>"])          # gemma4: </s> is plain text
            attrs[texts["</s>"]] = A_NORMAL
        self.eog_ids = frozenset(eog)

        # special tokens split out before the model runs: longest (in bytes) first
        mask = np.asarray(attrs, dtype=np.int64) & (A_CONTROL | A_USER_DEFINED | A_UNKNOWN)
        special = np.flatnonzero(mask).tolist()
        special.sort(key=lambda i: -len(tokens[i].encode("utf-8")))
        self._special = [(tokens[i], i, not attrs[i] & _SPECIAL) for i in special]

        self._piece_cache: dict[int, bytes] = {}
        if kind == "gpt2":
            self._hf = build_bpe(tokens, merges or [], pre or "default")
            self._spm = None
        else:
            self._hf = None
            if scores is None:
                scores = [0.0] * len(tokens)
            self._spm = SPMModel(self._t2i, scores)

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_metadata(cls, metadata: dict) -> "Tokenizer":
        md = metadata
        model = md.get("tokenizer.ggml.model")
        if model is None:
            raise ModelError("GGUF metadata has no tokenizer.ggml.model; the file carries no "
                             "tokenizer, so memfit cannot tokenize text for it")
        tokens = md.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens or set(map(type, tokens)) != {str}:
            raise ModelError("GGUF metadata tokenizer.ggml.tokens is missing, empty or not a "
                             "list of strings; the file's vocabulary is unusable")
        if "" in tokens:
            tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        n = len(tokens)
        types = md.get("tokenizer.ggml.token_type")
        if types is None:
            types = [NORMAL] * n
        elif len(types) != n:
            raise ModelError(f"tokenizer.ggml.token_type has {len(types)} entries but "
                             f"tokenizer.ggml.tokens has {n}")
        types = list(types)
        scores = md.get("tokenizer.ggml.scores")
        if scores is not None and len(scores) != n:
            raise ModelError(f"tokenizer.ggml.scores has {len(scores)} entries but "
                             f"tokenizer.ggml.tokens has {n}")
        if not set(map(type, types)) <= {int} or (
                scores is not None and not set(map(type, scores)) <= {int, float}):
            raise ModelError("tokenizer.ggml.token_type / tokenizer.ggml.scores hold values of the "
                             "wrong type (expected integers / numbers)")

        pre = md.get("tokenizer.ggml.pre")
        merges = None
        if model == "gpt2":
            merges = md.get("tokenizer.ggml.merges")
            if not isinstance(merges, list) or not set(map(type, merges)) <= {str}:
                raise ModelError("gpt2 tokenizer without a tokenizer.ggml.merges list of strings "
                                 "in the GGUF metadata")
            bos, eos, add_bos, add_eos, add_space_prefix = 11, 11, False, False, False
            pre = pre or "default"
            if pre in ("llama3", "llama-v3", "llama-bpe", "falcon3"):
                add_bos = True
        elif model == "llama":
            bos, eos, add_bos, add_eos, add_space_prefix = 1, 2, True, False, True
        else:
            raise UnsupportedError(
                f"tokenizer.ggml.model={model!r} is not supported; memfit supports 'gpt2' (BPE) "
                "and 'llama' (SPM)")

        def tok_id(key: str, default: int | None) -> int | None:
            v = md.get(key)
            if v is None:
                return default
            if not isinstance(v, int) or not 0 <= v < n:
                return default                  # llama.cpp: bad special id -> keep the default
            return v

        bos = tok_id("tokenizer.ggml.bos_token_id", bos)
        eos = tok_id("tokenizer.ggml.eos_token_id", eos)
        extra = {k: tok_id(f"tokenizer.ggml.{k}_token_id", None)
                 for k in ("eot", "eom", "fim_pad", "fim_rep", "fim_sep")}
        # ids not given in the metadata are found by token text, as llama.cpp does
        wanted = set(_EOT_TEXTS + _FIM_PAD + _FIM_REP + _FIM_SEP + ("<|eom_id|>",))
        forced: set[int] = set()
        by_text = {t: i for i, t in enumerate(tokens) if t in wanted}
        for key, texts in (("eot", _EOT_TEXTS), ("eom", ("<|eom_id|>",)), ("fim_pad", _FIM_PAD),
                           ("fim_rep", _FIM_REP), ("fim_sep", _FIM_SEP)):
            if extra[key] is None:
                extra[key] = next((by_text[t] for t in texts if t in by_text), None)
                if extra[key] is not None:
                    forced.add(extra[key])

        v = md.get("tokenizer.ggml.add_bos_token")
        if v is not None:
            add_bos = bool(v)
        v = md.get("tokenizer.ggml.add_eos_token")
        if v is not None:
            add_eos = bool(v)
        v = md.get("tokenizer.ggml.add_space_prefix")
        if v is not None:
            add_space_prefix = bool(v)
        if add_bos and bos is None:
            raise ModelError("tokenizer.ggml.add_bos_token is true but the model has no BOS token")
        template = md.get("tokenizer.chat_template")
        return cls(kind=model, pre=pre, tokens=tokens, types=types,
                   scores=list(scores) if scores is not None else None, merges=merges,
                   bos_id=bos, eos_id=eos, add_bos=add_bos, add_eos=add_eos,
                   add_space_prefix=add_space_prefix,
                   chat_template=template if isinstance(template, str) and template else None,
                   extra_ids=extra, forced_control=frozenset(forced))

    # -- encode -------------------------------------------------------------------------

    def _present_specials(self, text: str) -> list[tuple[str, int, bool]]:
        """The special tokens whose text occurs in ``text``, in partition order. Tokens are
        grouped by their first 4 characters, so one substring search rules out a whole group
        (gemma's 6k <unusedN> tokens cost one search, not 6k over the whole text)."""
        groups = getattr(self, "_special_groups", None)
        if groups is None:
            by: dict[str, list[int]] = {}
            for k, (t, _, _) in enumerate(self._special):
                by.setdefault(t[:4], []).append(k)
            groups = self._special_groups = list(by.items())
        found = [k for key, ks in groups if key in text for k in ks if self._special[k][0] in text]
        return [self._special[k] for k in sorted(found)]

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split special-token text out of ``text``: a list of plain str fragments and ids
        (llama.cpp's order: longest token first, each over every remaining fragment)."""
        frags: list[str | int] = [text]
        for tok_text, tid, user_defined in self._present_specials(text):
            if not parse_special and not user_defined:
                continue
            out: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or tok_text not in f:
                    out.append(f)
                    continue
                parts = f.split(tok_text)
                for k, p in enumerate(parts):
                    if k:
                        out.append(tid)
                    if p:
                        out.append(p)
            frags = out
        return frags

    def _check_text(self, text) -> int:
        if not isinstance(text, str):
            raise RequestError(f"text to tokenize must be a str, got {type(text).__name__}")
        try:
            return len(text.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise RequestError(f"text to tokenize is not valid Unicode (lone surrogate at "
                               f"character {e.start}); send UTF-8 text") from None

    def _encode_into(self, text: str, out: list[int], parse_special: bool,
                     prev_special: bool = True) -> bool:
        """Append the ids of ``text`` (no BOS/EOS); returns whether it ended in a special
        token (SPM adds the space prefix after one, so a streamed next piece continues it)."""
        frags = self._partition(text, parse_special) if text else []
        if self.kind == "llama":
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                    prev_special = True
                    continue
                if self.add_space_prefix and prev_special:
                    f = " " + f
                self._spm.encode(f.replace(" ", "\u2581"), out)
                prev_special = False
        else:
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                    prev_special = True
                else:
                    out.extend(self._hf.encode(f, add_special_tokens=False).ids)
                    prev_special = False
        return prev_special

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        self._check_text(text)
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)
        self._encode_into(text, out, parse_special)
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    def iter_encode(self, text: str, add_special: bool = True, parse_special: bool = True,
                    piece_chars: int = 1 << 16):
        """``encode`` in pieces of about piece_chars characters, cut only where no pre-token,
        SPM merge or special token can span the cut (see _safe_cut); yields lists of ids whose
        concatenation equals encode(text). Memory stays ~one piece whatever the text size."""
        self._check_text(text)
        if add_special and self.add_bos:
            yield [self.bos_id]
        start, prev = 0, True
        while start < len(text):
            end = self._safe_cut(text, start + piece_chars) if len(text) - start > 2 * piece_chars \
                else len(text)
            out: list[int] = []
            prev = self._encode_into(text[start:end], out, parse_special, prev)
            yield out
            start = end
        if add_special and self.add_eos:
            yield [self.eos_id]

    def encode_limited(self, text: str, limit: int, add_special: bool = True,
                       parse_special: bool = True, piece_chars: int = 1 << 12,
                       max_piece: int = MAX_PIECE_CHARS) -> list[int]:
        """``encode`` that stops once the ids pass ``limit``: raises TooManyTokens without
        tokenizing the rest. Pieces of ~piece_chars are cut as in iter_encode, so the ids equal
        encode(text); a piece is refused unseen when its units alone prove more tokens than
        are left (_min_tokens), and a stretch of more than max_piece characters with no exact
        cut is refused (RequestError), so the scratch is one piece whatever the text."""
        n_bytes = self._check_text(text)
        c = self._max_token_units()
        out: list[int] = [self.bos_id] if add_special and self.add_bos else []
        n_eos = 1 if add_special and self.add_eos else 0

        def check(n_at_least: int) -> None:
            if n_at_least + n_eos > limit:
                raise TooManyTokens(n_at_least + n_eos, limit)

        # the whole text first: a token covers at most c bytes (BPE) or characters (SPM)
        check(len(out) + -(-(n_bytes if self.kind == "gpt2" else len(text)) // c))
        start, prev, n = 0, True, len(text)
        while start < n:
            # a piece longer than (tokens left) * c characters cannot fit: search no further
            stop = min(n, start + (limit - len(out) - n_eos + 1) * c + 1)
            end = n if stop - start <= 2 * piece_chars and stop == n \
                else self._safe_cut(text, start + piece_chars, stop)
            if end - start > max_piece:
                end = self._safe_cut(text, start + 1, stop)     # the nearest cut instead
            if end >= stop and stop < n:
                check(len(out) + -(-(stop - start) // c))   # no cut before stop: too long
            piece = text[start:end]
            check(len(out) + self._min_tokens(piece))
            if len(piece) > max_piece:
                raise UncuttableText(
                    f"the text has {len(piece)} characters at position {start} with no word "
                    f"boundary where it can be split for tokenizing; memfit tokenizes at most "
                    f"{max_piece} at once")
            prev = self._encode_into(piece, out, parse_special, prev)
            del piece
            check(len(out))
            start = end
        if n_eos:
            out.append(self.eos_id)
        return out

    def _max_token_units(self) -> int:
        """The most text one token can stand for: bytes for byte-level BPE, chars for SPM."""
        self._unit_weights()
        return self._max_units

    def _unit_weights(self):
        """1 / the longest token (in units: bytes for byte-level BPE, chars for SPM, its '▁'
        standing for ' ') holding each unit; a unit in no token weighs 1 (its byte tokens)."""
        if getattr(self, "_weights", None) is None:
            longest: dict = {}
            for t, a in zip(self._tokens, self._attrs):
                if self.kind == "gpt2":
                    # a byte-level piece's bytes; split-out special text as UTF-8 (either for
                    # special-typed tokens, which the merges may produce too)
                    byte_level = BYTE_DECODER.keys() >= set(t)
                    units = [decode_bytelevel(t)] if byte_level else []
                    if a & (_SPECIAL | A_USER_DEFINED) or not byte_level:
                        units.append(t.encode("utf-8"))
                    for u in units:
                        for b in set(u):
                            if longest.get(b, 0) < len(u):
                                longest[b] = len(u)
                else:
                    for ch in set(t):
                        if longest.get(ch, 0) < len(t):
                            longest[ch] = len(t)
            if self.kind == "gpt2":
                w = np.ones(256)
                for b, k in longest.items():
                    w[b] = 1.0 / k
            else:
                w = {ch: 1.0 / k for ch, k in longest.items()}
                if "\u2581" in longest:
                    w[" "] = min(1.0, w.get(" ", 1.0), w["\u2581"])
            self._max_units = max(longest.values(), default=1)
            self._weights = w
        return self._weights

    def _min_tokens(self, piece: str) -> int:
        """A lower bound on the ids of ``piece``: a token of k units holds only units whose
        longest token is >= k, so the units' weights sum to <= 1 per token."""
        w = self._unit_weights()
        if self.kind == "gpt2":
            counts = np.bincount(np.frombuffer(piece.encode("utf-8"), np.uint8), minlength=256)
            total = float(counts @ w)
        else:
            total = sum(k * w.get(ch, 1.0) for ch, k in collections.Counter(piece).items())
        return int(total * (1 - 1e-9))

    def _safe_cut(self, text: str, at: int, stop: int | None = None) -> int:
        """The first position >= at (before ``stop``, else the end: len(text)) where the text
        can be cut without changing the ids. BPE: before a " " after a non-space, before other
        whitespace after a letter or digit, between an ASCII letter and an ASCII non-letter, and
        around a digit where each digit is a pre-token: no supported pre-tokenizer regex
        matches across these (letter runs end at a non-letter, punctuation and digit runs at a
        space, an optional prefix attaches to the letters after it) and the char before the cut
        is no space, so no end-of-text lookahead differs. SPM: before a " " after a non-space, where
        no vocabulary piece holding "x▁" straddles the cut (only those merge across words), or
        after a newline before a non-space when newline runs are special tokens (gemma) or no
        piece holds a newline. Never inside a special token's text."""
        n = len(text)
        stop = n if stop is None else min(stop, n)
        at = max(at, 1)
        if self.kind == "llama":
            rx = _SPM_CUT_NL if self._newline_cuts_ok() else _SPM_CUT
        else:
            rx = _BPE_CUT_DIGITS if isolates_digits(self.pre) else _BPE_CUT
        for m in rx.finditer(text, at, stop):
            i = m.start()
            if i < at or self._special_spans(text, i):
                continue
            if self.kind == "llama" and text[i] == " " and self._spm_spans(text, i):
                continue
            return i
        return n

    def _spm_spans(self, text: str, i: int) -> bool:
        """True when an SPM piece with a '▁' after another char could straddle position i."""
        sp = self._spm.spanning()
        if not sp:
            return False
        w = max(map(len, sp))
        window = text[max(0, i - w + 1):i + w - 1].replace(" ", "\u2581")
        off = max(0, i - w + 1)
        for t in sp:
            k = window.find(t)
            while k >= 0:
                if off + k < i < off + k + len(t):
                    return True
                k = window.find(t, k + 1)
        return False

    def _special_spans(self, text: str, i: int) -> bool:
        """True when a special token's text could straddle position i."""
        w = self._max_special_len()
        window = text[max(0, i - w + 1):i + w - 1]
        for t, _, _ in self._present_specials(window):
            k = window.find(t)
            while k >= 0:
                a = max(0, i - w + 1) + k
                if a < i < a + len(t):
                    return True
                k = window.find(t, k + 1)
        return False

    def _max_special_len(self) -> int:
        if not hasattr(self, "_max_special"):
            self._max_special = max((len(t) for t, _, _ in self._special), default=1)
        return self._max_special

    def _newline_cuts_ok(self) -> bool:
        # a cut after "\n" is exact when no piece merges across it: every token holding a
        # newline is a newline run split out as a special token first
        if not hasattr(self, "_nl_ok"):
            special = {t for t, _, _ in self._special}
            self._nl_ok = all(t in special and not t.strip("\n") for t in self._tokens if "\n" in t)
        return self._nl_ok

    # -- decode -------------------------------------------------------------------------

    def _check_id(self, tid) -> int:
        try:
            i = operator.index(tid)             # int or numpy integer
        except TypeError:
            raise RequestError(f"token id {tid!r} is not an integer") from None
        if not 0 <= i < self.n_vocab:
            raise RequestError(f"token id {tid!r} is out of range for a vocabulary of {self.n_vocab}")
        return i

    def token_to_bytes(self, tid: int, special: bool = True) -> bytes:
        """The raw bytes of one token (llama.cpp token_to_piece); control tokens only if special."""
        piece = self._piece_cache.get(tid)
        if piece is None:
            tid = self._check_id(tid)
            a, text = self._attrs[tid], self._tokens[tid]
            if a & (_SPECIAL | A_USER_DEFINED):
                piece = text.encode("utf-8")
            elif a & A_NORMAL:
                piece = (text.replace("\u2581", " ").encode("utf-8") if self.kind == "llama"
                         else decode_bytelevel(text))
            elif a & A_BYTE:
                piece = bytes([int(text[3:5], 16)])
            else:
                piece = b""                     # unused / undefined tokens render as nothing
            self._piece_cache[tid] = piece
        if not special and self._attrs[tid] & _SPECIAL:
            return b""
        return piece

    def decode_bytes(self, ids, skip_special: bool = False) -> bytes:
        return b"".join([self.token_to_bytes(i, not skip_special) for i in ids])

    def decode(self, ids, skip_special: bool = False) -> str:
        """Concatenated pieces (what llama-server's /detokenize returns); bad UTF-8 -> U+FFFD."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def token_text(self, tid: int) -> str:
        """The vocabulary entry as stored in the GGUF (byte-level / '▁'-escaped form)."""
        return self._tokens[self._check_id(tid)]

    def piece(self, tid: int) -> str:
        """One token as text (what llama-tokenize prints); a partial UTF-8 character -> U+FFFD."""
        return self.token_to_bytes(tid).decode("utf-8", errors="replace")

    def token_type(self, tid: int) -> int:
        """The GGUF token type (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte)."""
        return self._types[self._check_id(tid)]

    def token_id(self, text: str) -> int | None:
        """Id of a vocabulary entry given its stored text, or None."""
        return self._t2i.get(text)

    def is_control(self, tid: int) -> bool:
        """True for control/unknown tokens: decode(skip_special=True) drops them."""
        return bool(self._attrs[self._check_id(tid)] & _SPECIAL)

    def __repr__(self) -> str:
        return (f"Tokenizer(kind={self.kind!r}, pre={self.pre!r}, n_vocab={self.n_vocab}, "
                f"bos={self.bos_id}, eos={self.eos_id}, add_bos={self.add_bos})")
