"""Paged KV cache: a pool of fixed-size blocks, their reference counts and the prefix cache.

Per layer a K pool [n_blocks, BLOCK_SIZE, n_kv_head, head_dim_k] and a V pool (float16 for
cache type f16, float32 for f32; the quantized types store raw block bytes per row); the pool is allocated once at its planned size and never
grows. A sequence owns a block table (block ids); logical position p is row p % BLOCK_SIZE of
block table[p // BLOCK_SIZE].

Prefix reuse (vLLM's scheme): a full block is keyed by (its parent block's key, its tokens);
a new sequence takes the blocks of its longest cached prefix. A block whose last owner lets go
keeps its key and stays reusable until the allocator needs it (least recently freed first).
Mechanism only: the scheduler decides who gets blocks.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ..errors import RequestError
from .view import KV_TYPES

BLOCK_SIZE = 32


def block_key(parent, tokens, decode_from: int | None = None) -> tuple:
    """The prefix-cache key of a full block: (parent key's hash, its tokens), and for a block
    whose K/V rows from offset ``decode_from`` on were computed as decode rows (generated
    tokens) that offset too: decode and prefill kernels round differently, so such a block
    only serves a sequence that computes those rows the same way (engine/scheduler.py)."""
    if decode_from is None:
        return (hash(parent), tuple(tokens))
    return (hash(parent), tuple(tokens), int(decode_from))


class KVPool:
    def __init__(self, n_layer: int, n_blocks: int, n_kv_head: int, head_dim_k: int,
                 head_dim_v: int | None = None, cache_type: str = "f16", ledger=None,
                 cache_type_v: str | None = None):
        from . import quant as kq
        if n_blocks < 1:
            raise RequestError(f"the KV pool needs at least one block, got {n_blocks}")
        cache_type_v = cache_type if cache_type_v is None else cache_type_v
        for t in (cache_type, cache_type_v):
            if t not in KV_TYPES:
                raise RequestError(f"KV cache type {t!r} is not supported; use one of "
                                   f"{', '.join(kq.CACHE_TYPES)}")
        head_dim_v = head_dim_k if head_dim_v is None else head_dim_v
        self.cache_type, self.kv_type = cache_type, KV_TYPES[cache_type]
        self.cache_type_v, self.kv_type_v = cache_type_v, KV_TYPES[cache_type_v]
        self.n_blocks, self.block_size = n_blocks, BLOCK_SIZE
        rows = n_blocks * BLOCK_SIZE

        def blocks(t: int, d: int) -> list[np.ndarray]:
            # per layer [n_blocks, BLOCK_SIZE, Hkv, row] (INTERFACES.md §2): d values (f16/f32),
            # or q8_0 / q4_0 GGML blocks as uint8 [.., row_bytes]
            if kq.is_block(t):
                kq.check_head_dims(t, d)
                return [np.zeros((n_blocks, BLOCK_SIZE, n_kv_head, kq.row_bytes(t, d)), np.uint8)
                        for _ in range(n_layer)]
            dt = np.float16 if t == kq.F16 else np.float32
            return [np.zeros((n_blocks, BLOCK_SIZE, n_kv_head, d), dt) for _ in range(n_layer)]
        # k/v are the same memory as physical rows [n_blocks * BLOCK_SIZE, Hkv, row], the
        # kernels' addressing (kv/view.py)
        self.k_blocks = blocks(self.kv_type, head_dim_k)
        self.v_blocks = blocks(self.kv_type_v, head_dim_v)
        self.k = [a.reshape(rows, n_kv_head, a.shape[-1]) for a in self.k_blocks]
        self.v = [a.reshape(rows, n_kv_head, a.shape[-1]) for a in self.v_blocks]
        self.ref = np.zeros(n_blocks, np.int32)
        self._free = list(range(n_blocks - 1, -1, -1))  # never-keyed free blocks (a stack)
        self._cached: OrderedDict[int, None] = OrderedDict()  # keyed, unreferenced: LRU order
        self._by_key: dict[tuple, int] = {}
        self._key_of: dict[int, tuple] = {}
        self.ledger = ledger
        if ledger is not None:
            # the planner's KV reservation (the weight store books it as kv/plan) is this pool
            if "plan" in ledger.items("kv"):
                ledger.resize("kv", "plan", self.nbytes)
            else:
                ledger.alloc("kv", "kv_pool", self.nbytes)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k_blocks) + sum(a.nbytes for a in self.v_blocks)

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

    # --- allocation
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

    # --- prefix cache
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

    def register(self, block: int, key) -> None:
        """Key a full block so later sequences can reuse it (first writer wins)."""
        if key in self._by_key or block in self._key_of:
            return
        self._by_key[key] = block
        self._key_of[block] = key
