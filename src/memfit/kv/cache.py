"""Contiguous one-sequence KV cache (the single-sequence path: perplexity, tests, benches).

Per layer, K is [n_ctx, n_kv_head, head_dim_k] and V [n_ctx, n_kv_head, head_dim_v], stored
as float16 with ``f16_values`` (the model default, as llama.cpp's default KV cache: half the
memory of f32, and attention sees exactly the numbers llama.cpp's does; the attention kernels
read f16 directly), else float32 (tests of exact float math).
A forward pass of n tokens calls ``positions(n)`` once, ``update_and_fetch`` once per layer
(writes rows offset..offset+n), then ``advance(n)``; so ``offset`` only moves when every
layer has its rows. Model code never sees the layout: the model asks ``view(n)`` for the
BatchKV of its next n tokens (kv/view.py), the same interface the paged pool gives.
"""

from __future__ import annotations

import numpy as np

from ..errors import RequestError
from .view import KV_TYPES, BatchKV

try:  # float32 -> float16 -> float32 rounding in C (F16C), bit-identical to numpy's astype pair
    from .._native import round_f16 as _round_f16_native
except ImportError:  # pragma: no cover - the numpy path below stands in
    _round_f16_native = None


def round_f16(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x rounded to float16 precision, as float32 (into out when given; out may be x)."""
    if _round_f16_native is not None and x.dtype == np.float32 and x.flags.c_contiguous:
        return _round_f16_native(x, out)
    r = x.astype(np.float16).astype(np.float32)
    if out is None:
        return r
    out[...] = r
    return out


class KVCache:
    def __init__(self, n_layer: int, n_ctx: int, n_kv_head: int, head_dim_k: int,
                 head_dim_v: int | None = None, dtype=np.float32, f16_values: bool = False):
        if n_ctx <= 0:
            raise RequestError(f"context size must be positive, got {n_ctx}")
        head_dim_v = head_dim_k if head_dim_v is None else head_dim_v
        self.n_ctx = n_ctx
        dtype = np.float16 if f16_values else dtype
        self.k = [np.zeros((n_ctx, n_kv_head, head_dim_k), dtype) for _ in range(n_layer)]
        self.v = [np.zeros((n_ctx, n_kv_head, head_dim_v), dtype) for _ in range(n_layer)]
        self.offset = 0  # tokens stored (== position of the next token)
        self.f16_values = f16_values
        self._pos = np.arange(n_ctx, dtype=np.int32)
        self._zeros = np.zeros(max(n_ctx, 1), dtype=np.int32)
        self.kv_type = KV_TYPES["f16" if dtype == np.float16 else "f32"]

    def view(self, n: int) -> BatchKV:
        """The BatchKV of the next n tokens (positions offset..offset+n; RequestError if they do
        not fit): one block as long as the context, so logical row t is physical row t."""
        pos = self.positions(n)
        return BatchKV(self.k, self.v, self.kv_type, pos, pos, self._zeros[:n], self._zeros[:1],
                       self.n_ctx)

    def positions(self, n: int) -> np.ndarray:
        """Positions of the next n tokens (int32[n]); RequestError if they do not fit."""
        if self.offset + n > self.n_ctx:
            raise RequestError(f"context overflow: {self.offset} cached + {n} new tokens > "
                               f"context size {self.n_ctx}; use a larger context or a shorter "
                               f"prompt")
        return self._pos[self.offset:self.offset + n]

    def update_and_fetch(self, layer: int, k: np.ndarray, v: np.ndarray):
        """Store k[n, Hkv, Dk], v[n, Hkv, Dv] at offset; return (K, V, kv_pos) over all
        offset + n cached positions (views, not copies)."""
        n = k.shape[0]
        end = self.offset + n
        assert end <= self.n_ctx, "positions(n) must be called first"
        kd, vd = self.k[layer][self.offset:end], self.v[layer][self.offset:end]
        kd[...] = k  # to f16 (round to nearest even) when the cache is f16
        vd[...] = v
        return self.k[layer][:end], self.v[layer][:end], self._pos[:end]

    def layer_arrays(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The whole K and V arrays of a layer (float16 when f16_values), for a native decode
        step that writes row ``offset`` itself and reads rows 0..offset."""
        return self.k[layer], self.v[layer]

    def advance(self, n: int) -> None:
        assert self.offset + n <= self.n_ctx
        self.offset += n

    def trim(self, n: int) -> int:
        """Drop the last n tokens (for speculative decoding / prompt reuse); returns how many."""
        n = max(0, min(n, self.offset))
        self.offset -= n
        return n

    def reset(self) -> None:
        self.offset = 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)
