"""KV storage: the arrays that hold K and V and their ledger entry (no bookkeeping of who
owns which block: that is kv/manager.py, in integers).

Per layer a K array [n_blocks, BLOCK_SIZE, n_kv_head, row] and a V array (float16 values for
cache type f16, float32 for f32; q8_0 / q4_0 hold raw GGML block bytes per row, kv/quant.py),
allocated once at its planned size and never grown. ``k[l]`` / ``v[l]`` are the same memory
as physical rows [n_blocks * BLOCK_SIZE, n_kv_head, row], the kernels' addressing
(kv/view.py): logical position p of a sequence is row table[p // BLOCK_SIZE] * BLOCK_SIZE +
p % BLOCK_SIZE.

With ``v_in_k`` (``kv_layout`` of an MLA config: deepseek2, glm-dsa) there are no V arrays:
V is each K row's first head_dim_v values (the latent; K = [latent | rope]), read in K's cache
type through K's row stride, as llama.cpp's MLA cache does.

With ``aux_dim`` (glm-dsa: the lightning indexer's key cache, models/glmdsa.py) the layers
``aux_layers`` also hold one row of aux_dim values per token, ``aux[l]`` [rows, aux_dim],
addressed like K (same physical rows: prefix-cache reuse, copy on write, sessions and
preemption carry it with K), float16 (float32 when K is f32), as llama.cpp's indexer cache.

``kv_bytes_per_token`` is the one definition of what a cached token costs: the planner, the
API's fit check and this storage all count with it; ``kv_layout`` is the one place that says
how a model config's cache is laid out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import RequestError
from . import quant as kq
from .view import KV_TYPES

BLOCK_SIZE = 32


def kv_type_id(t: int | str | None) -> int:
    """GGML type id of a cache type: a name ('f16', 'f32', 'q8_0', 'q4_0') or an id."""
    if isinstance(t, str) and t.strip().lower() == "f32":
        return kq.F32
    return kq.cache_type(t)


def kv_bytes_per_token(n_layer: int, n_head_kv: int, head_dim_k: int, head_dim_v: int | None = None,
                       type_k: int | str | None = "f16", type_v: int | str | None = None,
                       v_in_k: bool = False, aux: int = 0) -> int:
    """Bytes of K and V of one position over every layer, in cache types type_k / type_v
    (type_v defaults to type_k): rows of 2 B per value (f16), 4 (f32), 34 B per 32 values
    (q8_0), 18 B per 32 (q4_0). With v_in_k only K is stored (V is read from it; type_v and
    head_dim_v cost nothing). aux: auxiliary values per position over all layers (glm-dsa's
    indexer keys), 2 B each (4 when K is f32: aux_dtype)."""
    head_dim_v = head_dim_k if head_dim_v is None else head_dim_v
    tk = kv_type_id(type_k)
    tv = tk if type_v is None else kv_type_id(type_v)
    v_row = 0 if v_in_k else kq.row_bytes(tv, head_dim_v)
    aux_bytes = aux * np.dtype(aux_dtype(tk)).itemsize
    return n_layer * n_head_kv * (kq.row_bytes(tk, head_dim_k) + v_row) + aux_bytes


def aux_dtype(type_k: int | str | None):
    """Element type of the auxiliary rows (indexer keys) next to a K cache of type_k: float32
    with an f32 cache (tests of exact float math), else float16 (llama.cpp's f16 cache)."""
    return np.float32 if kv_type_id(type_k) == kq.F32 else np.float16


@dataclass(frozen=True)
class KVLayout:
    """What the KV cache of a model holds per token and layer: n_head_kv rows of head_dim_k
    K values and of head_dim_v V values, or with v_in_k K rows only (V = K[..., :head_dim_v])."""
    n_layer: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    v_in_k: bool = False
    aux_dim: int = 0                 # values per token of an auxiliary row (glm-dsa indexer)
    aux_layers: tuple = ()           # ... in these layers (the indexer's "full" layers)

    @property
    def aux(self) -> int:
        """Auxiliary values per token over all layers."""
        return self.aux_dim * len(self.aux_layers)

    def bytes_per_token(self, type_k: int | str | None = "f16",
                        type_v: int | str | None = None) -> int:
        return kv_bytes_per_token(self.n_layer, self.n_head_kv, self.head_dim_k, self.head_dim_v,
                                  type_k, type_v, v_in_k=self.v_in_k, aux=self.aux)


def kv_layout(c) -> KVLayout:
    """The KV layout of a ModelConfig (models/config.py): the one place the pools (Model.new_cache,
    the engine), the planner and the runtime's checks read it from. MLA configs (c.v_in_k:
    the absorbed latent attention of deepseek2 / glm-dsa) keep V inside K; glm-dsa's full
    indexer layers (c.indexer_full) add one indexer key row (c.indexer[1] values) per token."""
    v_in_k = bool(getattr(c, "v_in_k", False))
    if v_in_k and c.head_dim_v > c.head_dim_k:
        raise RequestError(f"{c.arch}: V inside K needs head_dim_v ({c.head_dim_v}) <= "
                           f"head_dim_k ({c.head_dim_k})")
    full = tuple(getattr(c, "indexer_full", ()) or ())
    aux_layers = tuple(il for il in range(c.n_layer) if il < len(full) and full[il])
    aux_dim = int(c.indexer[1]) if aux_layers else 0
    return KVLayout(c.n_layer, c.n_head_kv, c.head_dim_k, c.head_dim_v, v_in_k, aux_dim,
                    aux_layers if aux_dim else ())


def kv_pool_blocks(n_ctx: int, n_parallel: int = 1) -> int:
    """Blocks of a pool for n_parallel sequences of up to n_ctx tokens (the planner's KV)."""
    return n_parallel * -(-n_ctx // BLOCK_SIZE)


class KVStorage:
    def __init__(self, n_layer: int, n_blocks: int, n_kv_head: int, head_dim_k: int,
                 head_dim_v: int | None = None, cache_type: str = "f16",
                 cache_type_v: str | None = None, ledger=None, name: str = "kv_pool",
                 v_in_k: bool = False, aux_dim: int = 0, aux_layers=()):
        if n_blocks < 1:
            raise RequestError(f"the KV pool needs at least one block, got {n_blocks}")
        if v_in_k and cache_type_v not in (None, cache_type):
            raise RequestError(f"this cache keeps V inside K (MLA): V has K's cache type "
                               f"{cache_type!r}, not {cache_type_v!r}; use -ctv {cache_type}")
        cache_type_v = cache_type if cache_type_v is None else cache_type_v
        for t in (cache_type, cache_type_v):
            if t not in KV_TYPES:
                raise RequestError(f"KV cache type {t!r} is not supported; use one of "
                                   f"{', '.join(kq.CACHE_TYPES)}")
        head_dim_v = head_dim_k if head_dim_v is None else head_dim_v
        self.cache_type, self.kv_type = cache_type, KV_TYPES[cache_type]
        self.cache_type_v, self.kv_type_v = cache_type_v, KV_TYPES[cache_type_v]
        self.n_blocks, self.block_size = n_blocks, BLOCK_SIZE
        self.n_kv_head, self.head_dim_k, self.head_dim_v = n_kv_head, head_dim_k, head_dim_v
        self.v_in_k = bool(v_in_k)
        if self.v_in_k:
            kq.check_v_in_k(self.kv_type, head_dim_k, head_dim_v)
        aux_layers = tuple(aux_layers) if aux_dim else ()
        if aux_layers and not self.v_in_k:
            raise RequestError("auxiliary rows (the indexer cache) need a cache with V inside K")
        self.aux_dim, self.aux_layers = int(aux_dim) if aux_layers else 0, aux_layers
        self.bytes_per_token = kv_bytes_per_token(n_layer, n_kv_head, head_dim_k, head_dim_v,
                                                  self.kv_type, self.kv_type_v, self.v_in_k,
                                                  aux=self.aux_dim * len(aux_layers))
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
        self.k_blocks = blocks(self.kv_type, head_dim_k)
        # V inside K: no V arrays (BatchKV reads V from K's rows)
        self.v_blocks = [] if self.v_in_k else blocks(self.kv_type_v, head_dim_v)
        self.k = [a.reshape(rows, n_kv_head, a.shape[-1]) for a in self.k_blocks]
        self.v = [a.reshape(rows, n_kv_head, a.shape[-1]) for a in self.v_blocks]
        # auxiliary rows (glm-dsa's indexer keys): per layer [n_blocks, BLOCK_SIZE, aux_dim] in
        # the layers aux_layers, None in the others; ``aux[l]`` the same memory as [rows, aux_dim]
        dt = aux_dtype(self.kv_type)
        self.aux_blocks = [np.zeros((n_blocks, BLOCK_SIZE, self.aux_dim), dt)
                           if il in aux_layers else None for il in range(n_layer)] \
            if aux_layers else []
        self.aux = [None if a is None else a.reshape(rows, self.aux_dim) for a in self.aux_blocks]
        assert self.nbytes == rows * self.bytes_per_token
        self.ledger = ledger
        if ledger is not None:  # the storage books its own bytes (the plan counted them)
            ledger.alloc("kv", name, self.nbytes)

    @property
    def nbytes(self) -> int:
        return (sum(a.nbytes for a in self.k_blocks) + sum(a.nbytes for a in self.v_blocks)
                + sum(a.nbytes for a in self.aux_blocks if a is not None))

    @property
    def aux_row_bytes(self) -> int:
        """Bytes of one auxiliary row (0 without them): sessions carry them as the V rows."""
        return self.aux_dim * np.dtype(aux_dtype(self.kv_type)).itemsize

    @staticmethod
    def _raw(a: np.ndarray) -> np.ndarray:
        """A layer's rows [rows, Hkv, ...] as uint8 [rows, Hkv, row_bytes] (a view)."""
        return a.view(np.uint8).reshape(a.shape[0], a.shape[1], -1)

    def read_blocks(self, blocks) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Copies of the K and V rows of blocks (in order), per layer uint8
        [len(blocks) * BLOCK_SIZE, Hkv, row_bytes] in the cache types (sessions). With V
        inside K, the V rows are empty (row_bytes 0): K holds them; with auxiliary rows
        (indexer keys) they stand in the V rows' place, uint8 [.., 1, aux_row_bytes] per
        layer (zeros in layers without them: one row size for all layers)."""
        bs = self.block_size
        rows = (np.asarray(blocks, np.int64)[:, None] * bs + np.arange(bs)).reshape(-1)
        k = [self._raw(a)[rows] for a in self.k]
        if self.aux_layers:
            rb = self.aux_row_bytes
            return k, [np.zeros((len(rows), 1, rb), np.uint8) if a is None else
                       a.view(np.uint8).reshape(a.shape[0], 1, rb)[rows] for a in self.aux]
        if self.v_in_k:
            return k, [np.zeros((len(rows), self.n_kv_head, 0), np.uint8) for _ in self.k]
        return k, [self._raw(a)[rows] for a in self.v]

    def write_block(self, block: int, k: list[np.ndarray], v: list[np.ndarray]) -> None:
        """Rows of one block from per layer uint8 [BLOCK_SIZE, Hkv, row_bytes] (sessions); with
        V inside K, v is read_blocks' empty rows (nothing to write), or its auxiliary rows."""
        bs = self.block_size
        for a, src in zip(self.k, k):
            self._raw(a)[block * bs:(block + 1) * bs] = src
        if self.aux_layers:
            rb = self.aux_row_bytes
            for a, src in zip(self.aux, v):
                if a is not None:
                    a.view(np.uint8).reshape(a.shape[0], 1, rb)[block * bs:(block + 1) * bs] = src
            return
        if self.v_in_k:
            assert all(x.size == 0 for x in v), "V inside K: V rows have no bytes of their own"
            return
        for a, src in zip(self.v, v):
            self._raw(a)[block * bs:(block + 1) * bs] = src

    def copy_rows(self, src: int, dst: int, n_rows: int) -> None:
        """Rows 0..n_rows of block src into block dst, every layer (copy on write)."""
        for a in self.k_blocks + self.v_blocks + [x for x in self.aux_blocks if x is not None]:
            a[dst, :n_rows] = a[src, :n_rows]
