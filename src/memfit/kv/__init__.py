"""KV caches: the protocol model code relies on (see cache.py)."""

from .cache import KVCache

__all__ = ["KVCache"]
