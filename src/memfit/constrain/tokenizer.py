"""llguidance's view of a GGUF vocabulary: each token's bytes, the end-of-generation ids and an
encode function (llguidance.TokenizerWrapper needs nothing else).

Special tokens (control, unknown, and user-defined ones written like ``<tag>``) get the 0xFF
prefix llguidance reserves for them, as its llama.cpp wrapper does: a grammar then never
produces them as text. All end-of-generation ids are its EOS tokens: one is allowed exactly
where the grammar may end. Built once per tokenizer (~0.2 s for 49k tokens, ~3 s for 262k)
and kept on the tokenizer object.
"""

from __future__ import annotations

import threading

from ..tokenizer.vocab import A_CONTROL, A_UNKNOWN, A_USER_DEFINED

_lock = threading.Lock()


class _Vocab:
    """The duck-typed tokenizer llguidance.TokenizerWrapper wraps."""

    def __init__(self, tok):
        self._tok = tok
        attrs = tok._attrs
        tokens, special = [], []
        for i in range(tok.n_vocab):
            b = tok.token_to_bytes(i)
            a = attrs[i]
            if a & (A_CONTROL | A_UNKNOWN) or (a & A_USER_DEFINED and b.startswith(b"<")
                                               and b.endswith(b">")):
                b = b"\xff" + b
                special.append(i)
            tokens.append(b)
        self.tokens = tokens
        self.special_token_ids = special
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else min(tok.eog_ids, default=0)
        self.bos_token_id = tok.bos_id

    def __call__(self, text):
        # llguidance calls this with str only after a bytes probe raises (TokenizerWrapper)
        if not isinstance(text, str):
            raise TypeError("text, not bytes")
        return self._tok.encode(text, add_special=False, parse_special=False)


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
            llt = llg.LLTokenizer(llg.TokenizerWrapper(_Vocab(tok)), n_vocab=tok.n_vocab,
                                  eos_token=eos)
            tok._llg_tokenizer = llt
    return llt
