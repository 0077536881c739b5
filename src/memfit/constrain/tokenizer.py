"""llguidance's view of a GGUF vocabulary: each token's bytes, the end-of-generation ids and an
encode function (llguidance.TokenizerWrapper needs nothing else).

Special tokens (control, unknown, and user-defined ones written like ``<tag>``) get the 0xFF
prefix llguidance reserves for them, as its llama.cpp wrapper does: a grammar then never
produces them as text. All end-of-generation ids are its EOS tokens: one is allowed exactly
where the grammar may end. Built once per tokenizer and kept on the tokenizer object.

Memory (peak RSS growth while it is built, measured): 49k tokens 12 MiB lean / 23 MiB with
llguidance's "slices" (token subsets precomputed for common lexemes, which make the first mask
of a new lexer state faster); 262k tokens 66 / 130 MiB. Under a memory budget
(``tokenizer.llg_lean``, set by the engine) the slices are left out: masks are cached per
lexer state, so decode speed changes little (benchmarks/constrain_bench.py --lean).
MEMFIT_LLG_SLICES=1 / 0 forces them on / off. ``table_bytes`` is the bound a planner can
reserve.
"""

from __future__ import annotations

import os
import threading
import weakref

from ..tokenizer.vocab import A_CONTROL, A_UNKNOWN, A_USER_DEFINED

_lock = threading.Lock()
LEAN_BYTES_PER_TOKEN = 320    # upper bounds of the measured peaks (module doc): 254-263 B
SLICES_BYTES_PER_TOKEN = 640  # and 499-518 B per token


def table_bytes(n_vocab: int, lean: bool = True) -> int:
    """Peak bytes that building llguidance's tables for an n_vocab-token vocabulary adds (an
    upper bound), for a planner that reserves room for constrained output."""
    return n_vocab * (LEAN_BYTES_PER_TOKEN if lean else SLICES_BYTES_PER_TOKEN)


class _Vocab:
    """The duck-typed tokenizer llguidance.TokenizerWrapper wraps."""

    def __init__(self, tok):
        # weakly: llguidance's (Rust) tokenizer keeps this object alive and the memfit
        # tokenizer keeps llguidance's; a strong reference would be a cycle through Rust that
        # Python's collector cannot see, keeping every model's tokenizer and tables forever
        self._tok = weakref.ref(tok)
        attrs = tok._attrs
        tokens, special = [], []
        cache = dict(tok._piece_cache)
        for i in range(tok.n_vocab):
            b = tok.token_to_bytes(i)
            a = attrs[i]
            if a & (A_CONTROL | A_UNKNOWN) or (a & A_USER_DEFINED and b.startswith(b"<")
                                               and b.endswith(b">")):
                b = b"\xff" + b
                special.append(i)
            tokens.append(b)
        # token_to_bytes cached every piece: keep only what the tokenizer had (the rest is a
        # vocabulary-sized dict the text path does not need)
        tok._piece_cache.clear()
        tok._piece_cache.update(cache)
        self.tokens = tokens
        self.special_token_ids = special
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else min(tok.eog_ids, default=0)
        self.bos_token_id = tok.bos_id

    def __call__(self, text):
        # llguidance calls this with str only after a bytes probe raises (TokenizerWrapper)
        if not isinstance(text, str):
            raise TypeError("text, not bytes")
        tok = self._tok()
        if tok is None:
            raise RuntimeError("the tokenizer this grammar was built for is gone")
        return tok.encode(text, add_special=False, parse_special=False)


def ll_tokenizer(tok):
    """The llguidance.LLTokenizer of a memfit Tokenizer (built on first use, then cached)."""
    llt = tok.__dict__.get("_llg_tokenizer")
    if llt is not None:
        return llt
    with _lock:
        llt = tok.__dict__.get("_llg_tokenizer")
        if llt is None:
            import llguidance as llg
            eos = sorted(tok.eog_ids) or ([tok.eos_id] if tok.eos_id is not None else None)
            env = os.environ.get("MEMFIT_LLG_SLICES")
            lean = env == "0" if env in ("0", "1") else bool(getattr(tok, "llg_lean", False))
            vocab = _Vocab(tok)
            wrapper = llg.TokenizerWrapper(vocab)
            llt = llg.LLTokenizer(wrapper, n_vocab=tok.n_vocab, eos_token=eos,
                                  slices=[] if lean else None)
            vocab.tokens = wrapper.tokens = None  # LLTokenizer holds its own copy
            tok._llg_tokenizer = llt
    return llt
