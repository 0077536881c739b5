"""One sequence on a KV pool, as ``Model.forward(ids, cache)`` takes it: the single-sequence
path (perplexity, logprobs, KLD, benches, tests) runs in the same paged blocks, kernels and
ledger entry as the engine.

    with SeqKV(engine.pool, n_ctx) as cache:     # blocks of the engine's pool, freed on exit
        model.forward(ids, cache)                # positions cache.offset.., then advance

A forward of n tokens calls ``view(n)`` (blocks for them are allocated; RequestError when they
do not fit) and, once every layer has its rows, ``advance(n)``. Its blocks are not keyed in
the prefix cache: this path has no token list to key them by. ``trim(n)`` rolls back.
"""

from __future__ import annotations

import numpy as np

from ..errors import RequestError
from .manager import SeqBlocks
from .pool import BLOCK_SIZE, KVPool
from .view import BatchKV


class SeqKV:
    def __init__(self, pool: KVPool, n_ctx: int | None = None):
        cap = pool.n_blocks * pool.block_size
        n_ctx = cap if n_ctx is None else int(n_ctx)
        if n_ctx <= 0:
            raise RequestError(f"context size must be positive, got {n_ctx}")
        if n_ctx > cap:
            raise RequestError(f"a sequence of {n_ctx} tokens does not fit in the KV pool of "
                               f"{cap} tokens; load the model with a context of {n_ctx} or more "
                               f"(n_ctx / --ctx-size)")
        self.pool, self.n_ctx = pool, n_ctx
        self.state = SeqBlocks()
        self.kv_type, self.kv_type_v = pool.kv_type, pool.kv_type_v
        self._zeros = np.zeros(1, np.int32)

    @classmethod
    def new(cls, n_layer: int, n_ctx: int, n_kv_head: int, head_dim_k: int, head_dim_v=None,
            cache_type: str = "f16", cache_type_v: str | None = None, ledger=None,
            v_in_k: bool = False, aux_dim: int = 0, aux_layers=(), swa_layers=(),
            window: int = 0, n_blocks_swa: int = 0) -> SeqKV:
        """A sequence on a pool of its own, just large enough for n_ctx tokens (its window
        layers in n_blocks_swa blocks of their own when given: kv/pool.py)."""
        if n_ctx <= 0:
            raise RequestError(f"context size must be positive, got {n_ctx}")
        pool = KVPool(n_layer, -(-n_ctx // BLOCK_SIZE), n_kv_head, head_dim_k, head_dim_v,
                      cache_type, ledger=ledger, cache_type_v=cache_type_v, v_in_k=v_in_k,
                      aux_dim=aux_dim, aux_layers=aux_layers, swa_layers=swa_layers,
                      window=window, n_blocks_swa=n_blocks_swa)
        return cls(pool, n_ctx)

    @property
    def offset(self) -> int:
        """Tokens stored (== position of the next token)."""
        return self.state.n_computed

    def positions(self, n: int) -> np.ndarray:
        """Positions of the next n tokens (int32[n]); RequestError if they do not fit."""
        off = self.offset
        if off + n > self.n_ctx:
            raise RequestError(f"context overflow: {off} cached + {n} new tokens > "
                               f"context size {self.n_ctx}; use a larger context or a shorter "
                               f"prompt")
        return np.arange(off, off + n, dtype=np.int32)

    def view(self, n: int) -> BatchKV:
        """The BatchKV of the next n tokens, their blocks allocated (RequestError if they do not
        fit in the context or the pool has too few free blocks)."""
        pos = self.positions(n)
        p = self.pool
        if not p.manager.allocate_for(self.state, n):
            raise RequestError(f"the KV pool has {p.n_free} free blocks of {p.block_size} "
                               f"tokens; {n} more tokens after {self.offset} need more (other "
                               f"sequences hold the rest); retry when they finish")
        if not p.reserve_window(self.state, n):
            need = p.swa.need(self.state, n)
            if need > p.swa.n_blocks:
                raise RequestError(f"{n} tokens at once need {need} blocks of the KV pool's "
                                   f"sliding-window group, which has {p.swa.n_blocks}; feed "
                                   f"at most the engine's n_batch tokens per forward")
            raise RequestError(f"the KV pool's sliding-window group has {p.swa.blocks.n_free} "
                               f"free blocks of {p.block_size} tokens; {n} more tokens after "
                               f"{self.offset} need {need} (other sequences hold the rest); "
                               f"retry when they finish")
        bs = p.block_size
        tables = np.asarray(self.state.block_table, np.int32)
        slots = tables[pos // bs] * bs + pos % bs
        swa = None
        if p.swa is not None:  # the window layers' table, laid out like tables
            st = np.zeros_like(tables)
            st[:len(self.state.swa_table)] = self.state.swa_table
            np.maximum(st, 0, out=st)   # given back (-1): any block, before every window
            swa = (p.swa_layers, st[pos // bs] * bs + pos % bs, st)
        if self._zeros.size < n:
            self._zeros = np.zeros(max(n, 512), np.int32)
        return BatchKV(p.k, p.v, self.kv_type, pos, slots, self._zeros[:n], tables, bs,
                       kv_type_v=self.kv_type_v, v_in_k=p.v_in_k, aux=p.aux, swa=swa)

    def advance(self, n: int) -> None:
        self.pool.manager.commit(self.state, n)

    def trim(self, n: int) -> int:
        """Drop the last n tokens (speculative decoding / prompt reuse); returns how many:
        all of them when the window layers' blocks before the new end were given back
        (the sequence is then recomputed from its start)."""
        return self.pool.rollback(self.state, n)

    def reset(self) -> None:
        self.trim(self.offset)

    def close(self) -> None:
        """Give the blocks back to the pool (also on garbage collection)."""
        if self.state.block_table:
            self.pool.manager.free(self.state)
        self.state.n_computed = 0

    def __enter__(self) -> SeqKV:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    @property
    def k(self) -> list:
        """Per layer the pool's K rows [rows, Hkv, row] (this sequence's through its blocks)."""
        return self.pool.k

    @property
    def v(self) -> list:
        """Per layer the pool's V rows; empty when V is inside K (pool.v_in_k)."""
        return self.pool.v

    @property
    def nbytes(self) -> int:
        """Bytes of the pool this sequence lives in."""
        return self.pool.nbytes
