"""Streaming detokenization: text as tokens arrive, never a broken UTF-8 sequence.

A token may end in the middle of a character (byte-fallback tokens, byte-level BPE pieces of
an emoji); the incremental decoder holds those trailing bytes until the character completes.
Bytes that can never form a character become U+FFFD, exactly as in ``Tokenizer.decode``, so
``"".join(push(i) for i in ids) + flush() == tok.decode(ids)``.
"""

from __future__ import annotations

import codecs


class StreamDecoder:
    def __init__(self, tok, skip_special: bool | None = None):
        self._tok = tok
        # default: the tokenizer's render_special (the CLI clears it: control tokens are not text)
        self._special = getattr(tok, "render_special", True) if skip_special is None \
            else not skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, tid: int) -> str:
        """Append one token; return the text it completes ('' while a character is pending)."""
        return self._dec.decode(self._tok.token_to_bytes(tid, self._special))

    def flush(self) -> str:
        """End of stream: any incomplete trailing bytes come out as U+FFFD."""
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out

    @property
    def pending(self) -> bool:
        """True while bytes of an unfinished character are held back."""
        return bool(self._dec.getstate()[0])
