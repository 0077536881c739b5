"""KV caches: the contiguous one-sequence cache (cache.py), the paged block pool with prefix
reuse (pool.py) and the view model code sees during a forward pass (view.py)."""

from .cache import KVCache
from .pool import BLOCK_SIZE, KVPool
from .view import KV_TYPES, BatchKV

__all__ = ["BLOCK_SIZE", "BatchKV", "KVCache", "KVPool", "KV_TYPES"]
