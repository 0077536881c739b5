"""The KV block manager: who owns which block, in integers only (the arrays are kv/storage.py).

A sequence's state is four integers-and-lists (``SeqBlocks``; the engine's Sequence has the
same fields): its block table (block ids; logical position p lives in block
table[p // block_size]), ``n_computed`` tokens committed, ``n_hashed`` of its full blocks keyed
in the prefix cache, and the key of the last of them.

Prefix reuse (vLLM's scheme): a full block is keyed by (its parent block's key, its tokens);
a new sequence takes the blocks of its longest cached prefix. A block whose last owner lets go
keeps its key and stays reusable until the allocator needs it (least recently freed first).
Rollback drops a sequence's last tokens (speculative decoding, prompt reuse): blocks past the
new end are released, and a rolled-back block never stays keyed, so a later prefix match cannot
return rows of tokens that were taken back.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


def block_key(parent, tokens, decode_from: int | None = None) -> tuple:
    """The prefix-cache key of a full block: (parent key's hash, its tokens), and for a block
    whose K/V rows from offset ``decode_from`` on were computed as decode rows (generated
    tokens) that offset too: decode and prefill kernels round differently, so such a block
    only serves a sequence that computes those rows the same way (engine/scheduler.py)."""
    if decode_from is None:
        return (hash(parent), tuple(tokens))
    return (hash(parent), tuple(tokens), int(decode_from))


def _key_at(parent, tokens, i: int, bs: int, n_prompt: int | None) -> tuple:
    # block i of tokens, whose positions from n_prompt on are decode rows (None: none are)
    lo = i * bs
    df = None if n_prompt is None or lo + bs <= n_prompt else max(0, n_prompt - lo)
    return block_key(parent, tokens[lo:lo + bs], df)


@dataclass
class SeqBlocks:
    """One sequence's KV state (the fields the manager reads and writes)."""
    block_table: list[int] = field(default_factory=list)
    n_computed: int = 0
    n_hashed: int = 0
    last_key: tuple | None = None


class BlockManager:
    def __init__(self, n_blocks: int, block_size: int):
        self.n_blocks, self.block_size = n_blocks, block_size
        self.ref = np.zeros(n_blocks, np.int32)
        self._free = list(range(n_blocks - 1, -1, -1))  # never-keyed free blocks (a stack)
        self._cached: OrderedDict[int, None] = OrderedDict()  # keyed, unreferenced: LRU order
        self._by_key: dict[tuple, int] = {}
        self._key_of: dict[int, tuple] = {}

    # --- counts (integers the scheduler decides with)
    @property
    def n_free(self) -> int:
        """Blocks allocate() can hand out: never-keyed free ones and evictable cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def n_cached(self) -> int:
        return len(self._cached)

    @property
    def n_used(self) -> int:
        return self.n_blocks - self.n_free

    def blocks_for(self, n_tokens: int) -> int:
        return (n_tokens + self.block_size - 1) // self.block_size

    # --- single blocks
    def allocate(self) -> int:
        """A block with reference count 1 (evicting the least recently freed cached block when
        no plain free block is left)."""
        if self._free:
            b = self._free.pop()
        else:
            assert self._cached, "allocate() with no free block: the scheduler checks n_free"
            b, _ = self._cached.popitem(last=False)
            del self._by_key[self._key_of.pop(b)]
        assert self.ref[b] == 0
        self.ref[b] = 1
        return b

    def release(self, blocks) -> None:
        """Drop one reference to each block; unreferenced keyed blocks stay reusable."""
        for b in blocks:
            assert self.ref[b] > 0
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self._key_of:
                    self._cached[b] = None
                else:
                    self._free.append(b)

    def lookup(self, key) -> int | None:
        """The block cached under key, with one more reference; None when absent."""
        b = self._by_key.get(key)
        if b is None:
            return None
        if self.ref[b] == 0:
            del self._cached[b]
        self.ref[b] += 1
        return b

    def peek(self, key) -> int | None:
        return self._by_key.get(key)

    def key_of(self, block: int) -> tuple | None:
        return self._key_of.get(block)

    def register(self, block: int, key) -> None:
        """Key a full block so later sequences can reuse it (first writer wins)."""
        if key in self._by_key or block in self._key_of:
            return
        self._by_key[key] = block
        self._key_of[block] = key

    def unregister(self, block: int) -> None:
        """Forget a block's key (its rows are about to change)."""
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._by_key[key]
            if block in self._cached:  # unreferenced: now a plain free block
                del self._cached[block]
                self._free.append(block)

    # --- sequences
    def match_prefix(self, tokens, n_prompt: int | None = None) -> list[tuple]:
        """Keys of the longest cached prefix of tokens in whole blocks, leaving at least one
        token to compute (its logits); positions from n_prompt on are decode rows."""
        bs, keys, key = self.block_size, [], None
        for i in range((len(tokens) - 1) // bs):
            key = _key_at(key, tokens, i, bs, n_prompt)
            if self._by_key.get(key) is None:
                break
            keys.append(key)
        return keys

    def admit(self, seq, tokens, hit: list | None = None, n_prompt: int | None = None) -> bool:
        """Give an empty seq the blocks of its cached prefix (``hit``: match_prefix's keys)
        and blocks for the rest of tokens; False (and no change) when they do not fit now."""
        hit = self.match_prefix(tokens, n_prompt) if hit is None else hit
        need = self.blocks_for(len(tokens)) - len(hit)
        cached_hits = sum(1 for k in hit if self.ref[self._by_key[k]] == 0)
        if need > self.n_free - cached_hits:
            return False
        seq.block_table = [self.lookup(k) for k in hit]
        seq.block_table += [self.allocate() for _ in range(need)]
        seq.n_computed = len(hit) * self.block_size
        seq.n_hashed = len(hit)
        seq.last_key = hit[-1] if hit else None
        return True

    def can_allocate(self, seq, n_tokens: int) -> bool:
        return self.blocks_for(seq.n_computed + n_tokens) - len(seq.block_table) <= self.n_free

    def allocate_for(self, seq, n_tokens: int) -> bool:
        """Extend seq's block table to hold n_tokens more tokens; False (and no change) when
        the pool has too few free blocks."""
        need = self.blocks_for(seq.n_computed + n_tokens) - len(seq.block_table)
        if need > self.n_free:
            return False
        seq.block_table += [self.allocate() for _ in range(need)]
        return True

    def commit(self, seq, n_tokens: int, tokens=None, n_prompt: int | None = None) -> None:
        """n_tokens more of seq are computed; with tokens (all of seq's tokens so far), the
        blocks that became full are keyed in the prefix cache (positions from n_prompt on as
        decode rows)."""
        seq.n_computed += n_tokens
        assert seq.n_computed <= len(seq.block_table) * self.block_size
        if tokens is None:
            return
        bs = self.block_size
        while (seq.n_hashed + 1) * bs <= seq.n_computed:
            i = seq.n_hashed
            seq.last_key = _key_at(seq.last_key, tokens, i, bs, n_prompt)
            self.register(seq.block_table[i], seq.last_key)
            seq.n_hashed += 1

    def rollback(self, seq, n_tokens: int) -> tuple[int, list[tuple[int, int, int]]]:
        """Take back seq's last n_tokens computed tokens. Blocks past the new end go back to
        the pool unkeyed (when seq was their only owner); the block the new end falls in loses
        its key, or, when another sequence shares it, is replaced by a copy (with no free
        block for the copy, that whole block is taken back too). Returns (tokens taken back,
        copies [(src, dst, n_rows)] the storage must make)."""
        n = max(0, min(int(n_tokens), seq.n_computed))
        end = seq.n_computed - n
        bs = self.block_size
        keep = self.blocks_for(end)
        if end % bs and self.ref[seq.block_table[keep - 1]] > 1 and self.n_free == 0:
            end, keep = end - end % bs, keep - 1
            n = seq.n_computed - end
        copies = []
        for b in seq.block_table[keep:]:
            if self.ref[b] == 1:
                self.unregister(b)
            self.release([b])
        del seq.block_table[keep:]
        if end % bs and keep > 0:  # the last kept block is partial: its later rows change
            b = seq.block_table[keep - 1]
            if self.ref[b] == 1:
                self.unregister(b)
            elif b in self._key_of:  # shared with another sequence: copy on write
                nb = self.allocate()
                copies.append((b, nb, end % bs))
                self.release([b])
                seq.block_table[keep - 1] = nb
        seq.n_computed = end
        if seq.n_hashed * bs > end:
            seq.n_hashed = end // bs
            seq.last_key = self._key_of.get(seq.block_table[seq.n_hashed - 1]) \
                if seq.n_hashed else None
            if seq.last_key is None:  # its block lost the race to key it: rehash from 0
                seq.n_hashed = 0
        return n, copies

    def free(self, seq) -> None:
        """Return all of seq's blocks (its keyed full blocks stay in the prefix cache)."""
        self.release(seq.block_table)
        seq.block_table = []
