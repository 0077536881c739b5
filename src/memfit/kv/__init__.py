"""KV caches: one implementation. kv/storage.py holds the arrays and their ledger entry (and
the one KV byte formula), kv/manager.py the block tables, reference counts and prefix cache in
integers, kv/pool.py puts the two together, kv/seq.py runs one sequence on a pool (the
single-sequence path) and kv/view.py is what model code sees during a forward pass."""

from .pool import BLOCK_SIZE, KVPool
from .seq import SeqKV
from .storage import kv_bytes_per_token
from .view import KV_TYPES, BatchKV

KVCache = SeqKV  # the name model code and tests use for one sequence's cache

__all__ = ["BLOCK_SIZE", "BatchKV", "KVCache", "KVPool", "KV_TYPES", "SeqKV", "kv_bytes_per_token"]
