"""The paged KV pool: the storage (kv/storage.py, arrays and their ledger entry) and the block
manager over it (kv/manager.py, integers: block tables, reference counts, the prefix cache,
allocate / commit / rollback / free). Every KV user goes through one: the engine's scheduler,
the single-sequence path (kv/seq.py: perplexity, logprobs, KLD, benches) and sessions.

Mechanism only: the scheduler decides who gets blocks.
"""

from __future__ import annotations

from .manager import BlockManager, block_key
from .storage import BLOCK_SIZE, KVLayout, KVStorage

__all__ = ["BLOCK_SIZE", "KVPool", "block_key"]


class KVPool:
    def __init__(self, n_layer: int, n_blocks: int, n_kv_head: int, head_dim_k: int,
                 head_dim_v: int | None = None, cache_type: str = "f16", ledger=None,
                 cache_type_v: str | None = None, v_in_k: bool = False, aux_dim: int = 0,
                 aux_layers=()):
        self.storage = KVStorage(n_layer, n_blocks, n_kv_head, head_dim_k, head_dim_v,
                                 cache_type, cache_type_v, ledger=ledger, v_in_k=v_in_k,
                                 aux_dim=aux_dim, aux_layers=aux_layers)
        self.manager = BlockManager(n_blocks, BLOCK_SIZE)
        st = self.storage
        self.cache_type, self.kv_type = st.cache_type, st.kv_type
        self.cache_type_v, self.kv_type_v = st.cache_type_v, st.kv_type_v
        self.v_in_k = st.v_in_k   # no V pools: V is K's first head_dim_v values (MLA)
        self.n_blocks, self.block_size = n_blocks, BLOCK_SIZE
        self.k_blocks, self.v_blocks, self.k, self.v = st.k_blocks, st.v_blocks, st.k, st.v
        self.aux = st.aux   # per layer the indexer key rows (glm-dsa) or None; [] without
        self.ledger = ledger
        m = self.manager
        self.ref = m.ref
        self.allocate, self.release, self.lookup = m.allocate, m.release, m.lookup
        self.peek, self.register = m.peek, m.register

    @classmethod
    def of(cls, layout: KVLayout, n_blocks: int, cache_type: str = "f16", ledger=None,
           cache_type_v: str | None = None) -> KVPool:
        """A pool of n_blocks for a model's KV layout (kv/storage.py kv_layout)."""
        return cls(layout.n_layer, n_blocks, layout.n_head_kv, layout.head_dim_k,
                   layout.head_dim_v, cache_type, ledger=ledger, cache_type_v=cache_type_v,
                   v_in_k=layout.v_in_k, aux_dim=layout.aux_dim, aux_layers=layout.aux_layers)

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes

    # --- counts (integers the scheduler decides with)
    @property
    def n_free(self) -> int:
        return self.manager.n_free

    @property
    def n_cached(self) -> int:
        return self.manager.n_cached

    @property
    def n_used(self) -> int:
        return self.manager.n_used

    def rollback(self, seq, n_tokens: int) -> int:
        """Take back seq's last n_tokens (kv/manager.py rollback), copying a shared block it
        would overwrite; returns how many were taken back."""
        n, copies = self.manager.rollback(seq, n_tokens)
        for src, dst, rows in copies:
            self.storage.copy_rows(src, dst, rows)
        return n
