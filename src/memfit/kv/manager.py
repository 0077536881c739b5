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

Sliding-window layers (``WindowBlocks``, attached as ``BlockManager.swa``): their K/V live in a
block group of their own with a second block table per sequence, ``swa_table`` (vLLM's hybrid
allocator keeps one table per layer group the same way). Logical block i of that table holds
the same positions as block i of ``block_table``, so one query row addresses both through the
same table offset, but the blocks that fall wholly before every future query's window are
given back (their entries become -1) and the group's pool is sized for the windows of the
running sequences, not their contexts. Why tables and not a ring: a prefill chunk longer
than the window stores all its rows before any of them attends, so a ring of window size would
overwrite keys the chunk's earlier rows still read; with a table the chunk holds its blocks for
one step and gives the old ones back after it. The group's blocks are keyed like the full
ones (same key for block i); a prefix hit of h blocks needs the group's blocks that the query at
h * block_size reads (``hit_blocks``), else it is shortened until they are there (or to 0).
A sequence gives blocks back only at ``slide`` points its caller chooses (after a final
commit), so rollback of a step's rows never needs a given-back block; a rollback past them
(SeqKV.trim) takes the whole sequence back.
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
    swa_table: list[int] = field(default_factory=list)  # sliding-window layers' blocks (-1: given back)


class BlockManager:
    def __init__(self, n_blocks: int, block_size: int):
        self.n_blocks, self.block_size = n_blocks, block_size
        self.ref = np.zeros(n_blocks, np.int32)
        self._free = list(range(n_blocks - 1, -1, -1))  # never-keyed free blocks (a stack)
        self._cached: OrderedDict[int, None] = OrderedDict()  # keyed, unreferenced: LRU order
        self._by_key: dict[tuple, int] = {}
        self._key_of: dict[int, tuple] = {}
        self.swa: WindowBlocks | None = None  # the sliding-window layers' group (kv/pool.py)

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
        if self.swa is not None:  # only as far as the window layers' blocks are there too
            keys = keys[:self.swa.hit_blocks(keys)]
        return keys

    def admit(self, seq, tokens, hit: list | None = None, n_prompt: int | None = None) -> bool:
        """Give an empty seq the blocks of its cached prefix (``hit``: match_prefix's keys)
        and blocks for the rest of tokens; False (and no change) when they do not fit now."""
        hit = self.match_prefix(tokens, n_prompt) if hit is None else hit
        if self.swa is not None:
            hit = hit[:self.swa.hit_blocks(hit)]
        need = self.blocks_for(len(tokens)) - len(hit)
        cached_hits = sum(1 for k in hit if self.ref[self._by_key[k]] == 0)
        if need > self.n_free - cached_hits:
            return False
        seq.block_table = [self.lookup(k) for k in hit]
        seq.block_table += [self.allocate() for _ in range(need)]
        seq.n_computed = len(hit) * self.block_size
        seq.n_hashed = len(hit)
        seq.last_key = hit[-1] if hit else None
        if self.swa is not None:
            self.swa.admit(seq, hit)
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

    def commit(self, seq, n_tokens: int, tokens=None, n_prompt: int | None = None,
               slide: bool = True) -> None:
        """n_tokens more of seq are computed; with tokens (all of seq's tokens so far), the
        blocks that became full are keyed in the prefix cache (positions from n_prompt on as
        decode rows). With slide (a final commit: no rollback below this point follows), the
        window layers' blocks no later query reads are given back (WindowBlocks.slide)."""
        seq.n_computed += n_tokens
        assert seq.n_computed <= len(seq.block_table) * self.block_size
        if tokens is not None:
            bs = self.block_size
            while (seq.n_hashed + 1) * bs <= seq.n_computed:
                i = seq.n_hashed
                seq.last_key = _key_at(seq.last_key, tokens, i, bs, n_prompt)
                self.register(seq.block_table[i], seq.last_key)
                if self.swa is not None:
                    self.swa.register(seq, i, seq.last_key)
                seq.n_hashed += 1
        if self.swa is not None and slide:
            self.swa.slide(seq)

    def rollback(self, seq, n_tokens: int) -> tuple[int, list[tuple[int, int, int]]]:
        """Take back seq's last n_tokens computed tokens. Blocks past the new end go back to
        the pool unkeyed (when seq was their only owner); the block the new end falls in loses
        its key, or, when another sequence shares it, is replaced by a copy (with no free
        block for the copy, that whole block is taken back too). Returns (tokens taken back,
        copies [(src, dst, n_rows)] the storage must make). With window layers, an end whose
        window blocks were given back takes the whole sequence back (it is recomputed), and
        one inside a window block another sequence shares goes back to that block's start."""
        n = max(0, min(int(n_tokens), seq.n_computed))
        end = seq.n_computed - n
        bs = self.block_size
        while True:  # the end moves down until both groups can stop there
            e0 = end
            if self.swa is not None:
                end = self.swa.rollback_end(seq, end)
            if end % bs and self.ref[seq.block_table[self.blocks_for(end) - 1]] > 1 \
                    and self.n_free == 0:
                end -= end % bs
            if end == e0:
                break
        n = seq.n_computed - end
        keep = self.blocks_for(end)
        if self.swa is not None:
            self.swa.cut(seq, end)
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
        if self.swa is not None:
            self.swa.free(seq)


def window_span(n_positions: int, block_size: int) -> int:
    """Blocks that n_positions consecutive positions can touch (at any offset)."""
    return 0 if n_positions <= 0 else (n_positions + block_size - 2) // block_size + 1


class WindowBlocks:
    """The sliding-window layers' block group (see the module doc): its own blocks, reference
    counts and keys (a BlockManager), a window of ``window`` positions (query p reads keys
    p - window + 1..p) and each sequence's ``swa_table``: entries below the first block the
    next query reads are -1 once given back, those from it to the end are held."""

    def __init__(self, n_blocks: int, block_size: int, window: int):
        assert window > 0
        self.blocks = BlockManager(n_blocks, block_size)
        self.n_blocks, self.block_size, self.window = n_blocks, block_size, int(window)

    def lo(self, n: int) -> int:
        """The first logical block a query at position n or later reads."""
        return max(0, n - self.window + 1) // self.block_size

    def covered(self, seq, end: int) -> bool:
        """Whether seq holds the blocks the query at position ``end`` reads before it."""
        t = seq.swa_table
        return all(i < len(t) and t[i] >= 0
                   for i in range(self.lo(end), self.blocks.blocks_for(end)))

    # --- per step
    def need(self, seq, n_tokens: int) -> int:
        """Blocks to add so that seq's next n_tokens can be stored and attend."""
        end = self.blocks.blocks_for(seq.n_computed + n_tokens)
        return max(0, end - max(len(seq.swa_table), self.lo(seq.n_computed)))

    def reserve(self, seq, n_tokens: int) -> bool:
        """Hold the blocks of seq's next n_tokens; False (and no change) when too few are free."""
        need = self.need(seq, n_tokens)
        if need > self.blocks.n_free:
            return False
        t, lo = seq.swa_table, self.lo(seq.n_computed)
        if len(t) < lo:
            t.extend([-1] * (lo - len(t)))
        t.extend(self.blocks.allocate() for _ in range(need))
        return True

    def slide(self, seq) -> None:
        """Give back the blocks before the window of the query at seq.n_computed (oldest first,
        so the least recently used cached block is the oldest position)."""
        t = seq.swa_table
        hi = min(self.lo(seq.n_computed), len(t))
        i = hi
        while i > 0 and t[i - 1] >= 0:
            i -= 1
        for j in range(i, hi):
            self.blocks.release([t[j]])
            t[j] = -1

    # --- prefix cache
    def hit_blocks(self, keys) -> int:
        """The longest prefix (in blocks) of the full group's hit ``keys`` whose window this
        group holds: a hit of h blocks needs blocks lo(h * block_size)..h-1 keyed here."""
        have = [self.blocks.peek(k) is not None for k in keys]
        for h in range(len(keys), 0, -1):
            if all(have[self.lo(h * self.block_size):h]):
                return h
        return 0

    def admit(self, seq, keys) -> None:
        """seq's table for a hit of len(keys) blocks (hit_blocks checked them)."""
        lo = self.lo(len(keys) * self.block_size)
        seq.swa_table = [-1] * lo + [self.blocks.lookup(k) for k in keys[lo:]]

    def register(self, seq, i: int, key) -> None:
        """Key block i of seq's table with the full group's key of block i (when held)."""
        t = seq.swa_table
        if i < len(t) and t[i] >= 0:
            self.blocks.register(t[i], key)

    # --- rollback
    def rollback_end(self, seq, end: int) -> int:
        """Where a rollback to end can stop in this group: end; its block's start when that
        block is shared (no copy on write here); 0 when the window before it is given back."""
        if end % self.block_size and self.covered(seq, end) and \
                self.blocks.ref[seq.swa_table[end // self.block_size]] > 1:
            end -= end % self.block_size
        return end if self.covered(seq, end) else 0

    def cut(self, seq, end: int) -> None:
        """Release seq's blocks past end (rollback_end chose it); the block end falls in
        loses its key (its later rows change)."""
        keep, t = self.blocks.blocks_for(end), seq.swa_table
        for b in t[keep:]:
            if b >= 0:
                if self.blocks.ref[b] == 1:
                    self.blocks.unregister(b)
                self.blocks.release([b])
        del t[keep:]
        if end == 0:
            t.clear()
        elif end % self.block_size:
            assert self.blocks.ref[t[keep - 1]] == 1
            self.blocks.unregister(t[keep - 1])

    def free(self, seq) -> None:
        self.blocks.release([b for b in seq.swa_table if b >= 0])
        seq.swa_table = []
