"""The paged KV pool: the storage (kv/storage.py, arrays and their ledger entry) and the block
manager over it (kv/manager.py, integers: block tables, reference counts, the prefix cache,
allocate / commit / rollback / free). Every KV user goes through one: the engine's scheduler,
the single-sequence path (kv/seq.py: perplexity, logprobs, KLD, benches) and sessions.

Mechanism only: the scheduler decides who gets blocks.

With ``n_blocks_swa`` (a layout with sliding-window layers: gpt-oss, gemma3) those layers' K/V
live in a group of n_blocks_swa blocks of their own (kv/manager.py WindowBlocks, ``swa``): a
sequence holds there only the blocks its window reads. ``reserve_window`` takes the blocks of
a step's rows (the scheduler and SeqKV call it before a forward); the manager's commit gives
back what falls out of the window. ``kv_swa_pool_blocks`` sizes the group so that every
running sequence's step fits.
"""

from __future__ import annotations

from .manager import BlockManager, WindowBlocks, block_key
from .storage import BLOCK_SIZE, KVLayout, KVStorage

__all__ = ["BLOCK_SIZE", "KVPool", "block_key"]


class KVPool:
    def __init__(self, n_layer: int, n_blocks: int, n_kv_head: int, head_dim_k: int,
                 head_dim_v: int | None = None, cache_type: str = "f16", ledger=None,
                 cache_type_v: str | None = None, v_in_k: bool = False, aux_dim: int = 0,
                 aux_layers=(), swa_layers=(), window: int = 0, n_blocks_swa: int = 0):
        swa_layers = tuple(swa_layers) if window > 0 and n_blocks_swa > 0 else ()
        self.storage = KVStorage(n_layer, n_blocks, n_kv_head, head_dim_k, head_dim_v,
                                 cache_type, cache_type_v, ledger=ledger, v_in_k=v_in_k,
                                 aux_dim=aux_dim, aux_layers=aux_layers, swa_layers=swa_layers,
                                 n_blocks_swa=n_blocks_swa if swa_layers else 0)
        self.manager = BlockManager(n_blocks, BLOCK_SIZE)
        # the sliding-window layers' group (None: every layer keeps the whole context)
        self.swa = self.manager.swa = WindowBlocks(n_blocks_swa, BLOCK_SIZE, window) \
            if swa_layers else None
        self.swa_layers = swa_layers
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
           cache_type_v: str | None = None, n_blocks_swa: int | None = None) -> KVPool:
        """A pool of n_blocks for a model's KV layout (kv/storage.py kv_layout); its
        sliding-window layers in a group of n_blocks_swa blocks when that is given and fewer
        than n_blocks (else they keep the whole context, masked to the window)."""
        swa = layout.window > 0 and layout.swa_layers and n_blocks_swa is not None \
            and n_blocks_swa < n_blocks
        return cls(layout.n_layer, n_blocks, layout.n_head_kv, layout.head_dim_k,
                   layout.head_dim_v, cache_type, ledger=ledger, cache_type_v=cache_type_v,
                   v_in_k=layout.v_in_k, aux_dim=layout.aux_dim, aux_layers=layout.aux_layers,
                   swa_layers=layout.swa_layers if swa else (), window=layout.window,
                   n_blocks_swa=n_blocks_swa if swa else 0)

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

    @property
    def n_swa_blocks(self) -> int:
        """Blocks of the sliding-window layers' group (0 without one)."""
        return self.swa.n_blocks if self.swa is not None else 0

    @property
    def n_swa_used(self) -> int:
        return self.swa.blocks.n_used if self.swa is not None else 0

    def reserve_window(self, seq, n_tokens: int) -> bool:
        """The sliding-window layers' blocks for seq's next n_tokens (True without a group);
        False (and no change) when that group has too few free blocks."""
        return self.swa is None or self.swa.reserve(seq, n_tokens)

    def rollback(self, seq, n_tokens: int) -> int:
        """Take back seq's last n_tokens (kv/manager.py rollback), copying a shared block it
        would overwrite; returns how many were taken back (more when the window layers
        cannot stop there)."""
        n, copies = self.manager.rollback(seq, n_tokens)
        for src, dst, rows in copies:
            self.storage.copy_rows(src, dst, rows)
        return n
