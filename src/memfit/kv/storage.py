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

With ``swa_layers`` and ``n_blocks_swa`` (the sliding-window layers of gpt-oss and gemma3 in
a block group of their own: kv/manager.py WindowBlocks) those layers' arrays have
n_blocks_swa blocks instead of n_blocks, addressed through the sequences' ``swa_table``; every
other layer as above.

``kv_bytes_per_token`` is the one definition of what a cached token costs and
``kv_pool_bytes`` of what the engine's pool holds (the window group included): the planner,
the API's fit check and this storage all count with them; ``kv_layout`` is the one place that
says how a model config's cache is laid out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import RequestError
from . import quant as kq
from .manager import window_span
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
    swa_layers: tuple = ()           # layers attending within the last `window` positions
    window: int = 0

    @property
    def aux(self) -> int:
        """Auxiliary values per token over all layers."""
        return self.aux_dim * len(self.aux_layers)

    def bytes_per_token(self, type_k: int | str | None = "f16",
                        type_v: int | str | None = None) -> int:
        return kv_bytes_per_token(self.n_layer, self.n_head_kv, self.head_dim_k, self.head_dim_v,
                                  type_k, type_v, v_in_k=self.v_in_k, aux=self.aux)

    def swa_blocks(self, n_ctx: int, n_parallel: int = 1, n_batch: int = 512) -> int | None:
        """Blocks of the engine pool's sliding-window group (kv_swa_pool_blocks), or None when
        the model has no window layers or the group would not be smaller than the context."""
        if not self.swa_layers or self.window <= 0:
            return None
        nb = kv_swa_pool_blocks(self.window, n_parallel, n_batch)
        return nb if nb < kv_pool_blocks(n_ctx, n_parallel) else None

    def pool_bytes(self, n_ctx: int, n_parallel: int = 1, n_batch: int = 512,
                   type_k: int | str | None = "f16", type_v: int | str | None = None) -> int:
        """Bytes of the engine's pool for n_parallel sequences of n_ctx tokens and steps of
        n_batch rows: the full layers' blocks for every position, the window layers' group."""
        full = kv_pool_blocks(n_ctx, n_parallel) * BLOCK_SIZE
        swa = self.swa_blocks(n_ctx, n_parallel, n_batch)
        if swa is None:
            return full * self.bytes_per_token(type_k, type_v)
        per = self.bytes_per_token(type_k, type_v) // self.n_layer   # no aux with windows
        ns = len(self.swa_layers)
        return per * ((self.n_layer - ns) * full + ns * swa * BLOCK_SIZE)


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
    window = int(getattr(c, "sliding_window", 0) or 0)
    swa = tuple(il for il in range(c.n_layer) if c.is_swa(il)) if window > 0 else ()
    return KVLayout(c.n_layer, c.n_head_kv, c.head_dim_k, c.head_dim_v, v_in_k, aux_dim,
                    aux_layers if aux_dim else (), swa, window if swa else 0)


def kv_pool_blocks(n_ctx: int, n_parallel: int = 1) -> int:
    """Blocks of a pool for n_parallel sequences of up to n_ctx tokens (the planner's KV)."""
    return n_parallel * -(-n_ctx // BLOCK_SIZE)


def kv_swa_pool_blocks(window: int, n_parallel: int = 1, n_batch: int = 512) -> int:
    """Blocks of the sliding-window group (kv/manager.py WindowBlocks) that always suffice:
    between steps each running sequence holds the blocks of its last window - 1 positions
    (at most w = window_span(max(window - 1, 1)) blocks); a step of at most max(n_batch,
    n_parallel) rows adds at most ceil(k / BLOCK_SIZE) blocks for a sequence's k rows; one
    more sequence's window and n_batch rows for the single-sequence path (SeqKV on the
    engine's pool: embeddings, logprobs, perplexity) between the engine's steps."""
    w = window_span(max(window - 1, 1), BLOCK_SIZE)
    rows = max(n_batch, n_parallel)
    return (n_parallel + 1) * w + (rows + n_parallel * (BLOCK_SIZE - 1)) // BLOCK_SIZE


class KVStorage:
    def __init__(self, n_layer: int, n_blocks: int, n_kv_head: int, head_dim_k: int,
                 head_dim_v: int | None = None, cache_type: str = "f16",
                 cache_type_v: str | None = None, ledger=None, name: str = "kv_pool",
                 v_in_k: bool = False, aux_dim: int = 0, aux_layers=(), swa_layers=(),
                 n_blocks_swa: int = 0):
        if n_blocks < 1:
            raise RequestError(f"the KV pool needs at least one block, got {n_blocks}")
        swa_layers = tuple(swa_layers) if n_blocks_swa > 0 else ()
        assert not (swa_layers and aux_dim), "window layers and indexer rows: not both"
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
        # the window layers' arrays have n_blocks_swa blocks (their own block ids)
        self.swa_layers, self.n_blocks_swa = swa_layers, n_blocks_swa if swa_layers else 0
        nbl = [self.n_blocks_swa if il in swa_layers else n_blocks for il in range(n_layer)]

        def blocks(t: int, d: int) -> list[np.ndarray]:
            # per layer [blocks, BLOCK_SIZE, Hkv, row] (INTERFACES.md §2): d values (f16/f32),
            # or q8_0 / q4_0 GGML blocks as uint8 [.., row_bytes]
            if kq.is_block(t):
                kq.check_head_dims(t, d)
                return [np.zeros((nb, BLOCK_SIZE, n_kv_head, kq.row_bytes(t, d)), np.uint8)
                        for nb in nbl]
            dt = np.float16 if t == kq.F16 else np.float32
            return [np.zeros((nb, BLOCK_SIZE, n_kv_head, d), dt) for nb in nbl]
        self.k_blocks = blocks(self.kv_type, head_dim_k)
        # V inside K: no V arrays (BatchKV reads V from K's rows)
        self.v_blocks = [] if self.v_in_k else blocks(self.kv_type_v, head_dim_v)
        self.k = [a.reshape(-1, n_kv_head, a.shape[-1]) for a in self.k_blocks]
        self.v = [a.reshape(-1, n_kv_head, a.shape[-1]) for a in self.v_blocks]
        # auxiliary rows (glm-dsa's indexer keys): per layer [n_blocks, BLOCK_SIZE, aux_dim] in
        # the layers aux_layers, None in the others; ``aux[l]`` the same memory as [rows, aux_dim]
        dt = aux_dtype(self.kv_type)
        self.aux_blocks = [np.zeros((n_blocks, BLOCK_SIZE, self.aux_dim), dt)
                           if il in aux_layers else None for il in range(n_layer)] \
            if aux_layers else []
        self.aux = [None if a is None else a.reshape(rows, self.aux_dim) for a in self.aux_blocks]
        assert self.nbytes == sum(nbl) * BLOCK_SIZE * self.bytes_per_token // n_layer \
            if swa_layers else self.nbytes == rows * self.bytes_per_token
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

    def _rows(self, il: int, blocks, swa_blocks) -> tuple[np.ndarray, np.ndarray | None]:
        # physical rows of layer il's blocks (its group's), and which are absent (window
        # blocks given back: -1) or None
        b = np.asarray(swa_blocks if il in self.swa_layers else blocks, np.int64)
        bs = self.block_size
        rows = (np.maximum(b, 0)[:, None] * bs + np.arange(bs)).reshape(-1)
        return rows, (np.repeat(b < 0, bs) if il in self.swa_layers else None)

    def read_blocks(self, blocks, swa_blocks=None) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Copies of the K and V rows of blocks (in order), per layer uint8
        [len(blocks) * BLOCK_SIZE, Hkv, row_bytes] in the cache types (sessions). With V
        inside K, the V rows are empty (row_bytes 0): K holds them; with auxiliary rows
        (indexer keys) they stand in the V rows' place, uint8 [.., 1, aux_row_bytes] per
        layer (zeros in layers without them: one row size for all layers). The window layers
        read swa_blocks (their group's ids for the same positions; -1: given back, zero rows:
        no later query reads them)."""
        if self.swa_layers:
            assert swa_blocks is not None and len(swa_blocks) == len(blocks)
            k, v = [], []
            for il in range(len(self.k)):
                rows, gone = self._rows(il, blocks, swa_blocks)
                for out, a in ((k, self.k[il]), (v, self.v[il] if self.v else None)):
                    if a is None:
                        out.append(np.zeros((len(rows), self.n_kv_head, 0), np.uint8))
                        continue
                    r = self._raw(a)[rows]
                    if gone is not None:
                        r[gone] = 0
                    out.append(r)
            return k, v
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

    def write_block(self, block: int | None, k: list[np.ndarray], v: list[np.ndarray],
                    swa_block: int | None = None) -> None:
        """Rows of one block from per layer uint8 [BLOCK_SIZE, Hkv, row_bytes] (sessions); with
        V inside K, v is read_blocks' empty rows (nothing to write), or its auxiliary rows.
        The window layers' rows go to swa_block of their group, the others' to block (either
        None: not written)."""
        bs = self.block_size
        if self.swa_layers:
            for il in range(len(self.k)):
                b = swa_block if il in self.swa_layers else block
                if b is None:
                    continue
                self._raw(self.k[il])[b * bs:(b + 1) * bs] = k[il]
                if self.v:
                    self._raw(self.v[il])[b * bs:(b + 1) * bs] = v[il]
            return
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
        """Rows 0..n_rows of block src into block dst, every layer of the full group (copy on
        write; the window group never copies: kv/manager.py WindowBlocks.rollback_end)."""
        full = [il for il in range(len(self.k_blocks)) if il not in self.swa_layers]
        arrays = [self.k_blocks[il] for il in full] + [self.v_blocks[il] for il in full
                                                       if self.v_blocks]
        for a in arrays + [x for x in self.aux_blocks if x is not None]:
            a[dst, :n_rows] = a[src, :n_rows]
