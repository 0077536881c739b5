"""Proposers: what guesses a sequence's next tokens.

The interface the engine drives (spec/policy.py Speculator calls it):

    class Proposer:
        name: str
        def propose(self, seqs, ks) -> list[list[int]]   # up to ks[i] tokens for seqs[i]
        def release(self, request_id) -> None            # the sequence is finished / aborted

``seqs`` are engine Sequences past their prefill, each with exactly one pending token: its
``tokens`` (prompt + generated, the last one sampled but not yet computed) are what the
proposal continues. A proposer keeps whatever state it wants per ``request_id`` (an index, a
draft model's KV) and must cope with ``tokens`` having moved on arbitrarily since its last call
(accepted tokens appended, rejected ones never there).

NGramProposer is prompt-lookup decoding (llama.cpp's ``--spec-type ngram-simple`` / the
"prompt lookup" family): the longest suffix of the text (n_max down to n_min tokens) that also
occurred earlier; the tokens that followed its most recent earlier occurrence are the
proposal. Costs a dictionary of n-gram positions per sequence (a few entries per token), no
model and no KV. Written here because the lookup is a dozen lines over memfit's own token lists.
"""

from __future__ import annotations


class Proposer:
    name = "base"

    def propose(self, seqs, ks) -> list[list[int]]:
        raise NotImplementedError

    def release(self, request_id: str) -> None:
        pass


class _NGramIndex:
    """Per sequence: for each n, the n-gram ending at position e (tokens[e-n:e]) -> the latest
    such e, over e < the sequence's current length (so a lookup never finds the suffix itself)."""

    __slots__ = ("maps", "upto")

    def __init__(self, ns):
        self.maps = {n: {} for n in ns}
        self.upto = 0  # positions e < upto are indexed

    def update(self, tokens, end: int) -> None:
        for e in range(max(self.upto, 1), end):
            for n, m in self.maps.items():
                if e >= n:
                    m[tuple(tokens[e - n:e])] = e
        self.upto = max(self.upto, end)


class NGramProposer(Proposer):
    name = "ngram"

    def __init__(self, n_min: int = 2, n_max: int = 4):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"ngram sizes {n_min}..{n_max}")
        self.ns = list(range(n_max, n_min - 1, -1))  # longest first
        self._idx: dict[str, _NGramIndex] = {}

    def propose(self, seqs, ks) -> list[list[int]]:
        return [self._one(s, k) for s, k in zip(seqs, ks)]

    def _one(self, s, k: int) -> list[int]:
        if k <= 0:
            return []
        toks = s.tokens
        L = len(toks)
        idx = self._idx.get(s.request_id)
        if idx is None:
            idx = self._idx[s.request_id] = _NGramIndex(self.ns)
        idx.update(toks, L)  # every position but the current end
        for n in self.ns:
            if L < n + 1:
                continue
            e = idx.maps[n].get(tuple(toks[L - n:L]))
            if e is not None:
                # the text after the earlier occurrence; past the current end it repeats with
                # period L - e (a loop continues as a loop)
                out = []
                for i in range(k):
                    j = e + i
                    out.append(toks[j] if j < L else out[j - L])
                return out
        return []

    def release(self, request_id: str) -> None:
        self._idx.pop(request_id, None)


class OracleProposer(Proposer):
    """Proposes the continuation of a known text (benchmarks: a model's own greedy output from
    an earlier run, so every proposal is right): the ceiling of the mechanism on a model whose
    random weights make real acceptance meaningless. ``texts``: full token lists (prompt +
    output); a sequence whose tokens are a prefix of one gets the rest of it."""
    name = "oracle"

    def __init__(self, texts):
        self.texts = [list(t) for t in texts]

    def propose(self, seqs, ks):
        out = []
        for s, k in zip(seqs, ks):
            n, d = len(s.tokens), []
            for t in self.texts:
                if len(t) > n and t[:n] == s.tokens:
                    d = t[n:n + k]
                    break
            out.append(d)
        return out
