"""What model code sees of the KV cache during one forward pass: a BatchKV.

It stores each layer's new K/V rows and runs attention over every row's own sequence, so the
model never learns the layout (contiguous or paged blocks) nor the element type (f32, f16, and
the quantized types the kernels add). Rows are addressed as the native kernels take them
(csrc/ops.h mf_paged_args): token i goes to physical row ``slots[i]``; query row i at position
``pos[i]`` reads logical keys 0..pos[i] of its sequence, key t at physical row
``tables[q_tab[i] + t // bs] * bs + t % bs``.

With ``v_in_k`` (MLA: kv/storage.py kv_layout) the pool has no V: ``attend`` stores only k and
the kernels read each key's value as the first Dv values of its K row (V None to the native
calls, a slice of the gathered K rows on the numpy path); a quantized K carries V's rotation
(kv/quant.py rot_sizes).

Sliding-window layers with a block group of their own (kv/manager.py WindowBlocks): ``swa``
= (their layer numbers, the batch's slots in that group, its block tables laid out like
``tables``, so ``q_tab`` serves both); ``k[l]`` / ``v[l]`` of those layers are the group's
arrays. A table entry before a row's window is any valid block (the kernels start at the
window: csrc/ops.h mf_paged_args).

Auxiliary rows (``aux``: glm-dsa's lightning-indexer keys, kv/storage.py): ``store_aux`` writes
the batch's rows at ``slots`` like K, ``seq_keys`` gives each sequence's rows and the physical
rows of its positions 0..T-1, and ``attend_keys`` runs the same attention kernels over a chosen
set of keys per query row (the indexer's selection) through a block table of one-row blocks.
"""

from __future__ import annotations

import numpy as np

from ..ops.backend import as_backend

# cache type name -> element type id (GGML's numbering; csrc/ops.h MF_KV_*)
KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}
_NP = {0: np.float32, 1: np.float16}
_BLOCK = (2, 8)  # q4_0, q8_0: rows of GGML blocks (kv/quant.py)


class BatchKV:
    def __init__(self, k: list, v: list, kv_type: int, pos: np.ndarray, slots: np.ndarray,
                 q_tab: np.ndarray, tables: np.ndarray, bs: int, kv_type_v: int | None = None,
                 v_in_k: bool = False, aux: list | None = None, swa: tuple | None = None):
        # k[l], v[l]: the layer's pools as physical rows [rows, Hkv, D] (block types: uint8
        # [rows, Hkv, row_bytes]); kv_type is K's cache type, kv_type_v V's (default: the same);
        # v_in_k: no V pools (v unused), V is K's first Dv values, in K's type
        self.k, self.v, self.kv_type, self.v_in_k = k, v, kv_type, bool(v_in_k)
        self.kv_type_v = kv_type if kv_type_v is None or v_in_k else kv_type_v
        self.pos, self.slots, self.q_tab, self.tables, self.bs = pos, slots, q_tab, tables, bs
        # (window layers, their slots, their tables) or None: every layer uses slots/tables
        self.swa_layers, self.swa_slots, self.swa_tables = swa if swa else ((), None, None)
        # aux[l]: the layer's auxiliary rows [rows, aux_dim] (glm-dsa indexer keys) or None
        self.aux = aux if aux is not None else []
        # glm-dsa: the key selection of the last full indexer layer of this forward (KeySelection
        # or None: every row sees all its keys), for the shared layers after it
        self.selection = None

    def store_aux(self, il: int, x: np.ndarray) -> None:
        """Store the batch's auxiliary rows x [n, aux_dim] of layer il at its slots (rounded to
        the rows' type, float16 or float32)."""
        self.aux[il][self.slots] = x

    def seq_keys(self):
        """Per sequence of the batch: (its query rows, int64 [m]; the physical rows of its
        positions 0..T-1, int64 [T], T = 1 + its largest position in the batch)."""
        bs = self.bs
        for tab in np.unique(self.q_tab):
            sel = np.nonzero(self.q_tab == tab)[0]
            t = np.arange(int(self.pos[sel].max()) + 1)
            yield sel, self.tables[tab + t // bs].astype(np.int64) * bs + t % bs

    def attend_keys(self, il: int, ops, q: np.ndarray, k: np.ndarray, v: np.ndarray, rows,
                    scale: float, starts: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """``attend`` (store k, then attention of q's rows ``rows``, no window nor softcap) where
        query row i reads only the keys at physical rows keys[starts[i]:starts[i + 1]]
        (ascending position: with every key of the row in order the kernels give the dense
        result bit for bit): a block table of one-row blocks, the row's last key at position
        count - 1. Every kernel and cache type of ``attend`` (f16 rounding of q, quantized K)
        applies unchanged."""
        starts = np.asarray(starts, np.int64)
        sub = BatchKV(self.k, self.v, self.kv_type, (np.diff(starts) - 1).astype(np.int32),
                      self.slots, starts[:-1].astype(np.int32), np.asarray(keys, np.int32), 1,
                      kv_type_v=self.kv_type_v, v_in_k=self.v_in_k)
        return sub.attend(il, ops, q, k, v, rows, scale, 0, 0.0)

    @property
    def fusable(self) -> bool:
        """Whether the native fused decode layer can run on this cache: f32 / f16 (a quantized
        cache also rotates q, k, v and the output, which the fused layer does not) with V
        pools of its own (the fused layer stores and reads V rows)."""
        return self.kv_type in _NP and self.kv_type_v in _NP and not self.v_in_k

    def _addr(self, il: int) -> tuple[np.ndarray, np.ndarray]:
        """(slots, tables) of layer il: its group's."""
        if il in self.swa_layers:
            return self.swa_slots, self.swa_tables
        return self.slots, self.tables

    def fused(self, il: int) -> tuple:
        """Arguments of the native batched decode layer after x (opaque to model code)."""
        slots, tables = self._addr(il)
        return (self.pos, slots, self.q_tab, tables, self.bs, self.kv_type,
                self.k[il], self.v[il])

    def attend(self, il: int, ops, q: np.ndarray, k: np.ndarray, v: np.ndarray, rows,
               scale: float, window: int, softcap: float,
               sinks: np.ndarray | None = None) -> np.ndarray:
        """Store k[n, Hkv, Dk], v[n, Hkv, Dv] of the batch's tokens, then causal attention of
        q[n, Hq, Dk] (only the query rows ``rows`` when given) -> [n_rows, Hq, Dv]. q is the
        caller's own scratch: it may be rounded in place for the cache type. sinks: float32
        [Hq] attention sinks (gpt-oss; ops.attention), or None. With V inside K, v must be
        k[..., :Dv] (MLA's latent; only k is stored) and is not read."""
        K = self.k[il]
        V = None if self.v_in_k else self.v[il]
        pos, q_tab = self.pos, self.q_tab
        slots, tables = self._addr(il)
        if rows is not None:
            q, pos, q_tab = q[rows], pos[rows], q_tab[rows]
        q = np.ascontiguousarray(q, dtype=np.float32)
        # only a call with sinks passes the keyword (an ops object of before them still works)
        kw = {} if sinks is None else {"sinks": np.ascontiguousarray(sinks, np.float32)}
        if self.kv_type in _BLOCK or self.kv_type_v in _BLOCK:
            return self._attend_quantized(ops, K, V, q, k, v, pos, q_tab, scale, window, softcap,
                                          kw, slots, tables)
        ops = as_backend(ops)   # (tests hand the reference module in directly)
        if ops.has("paged_attention"):
            paged = ops.attention_paged
            ops.kv_store(self.kv_type, K, slots, np.ascontiguousarray(k, np.float32))
            if V is not None:
                ops.kv_store(self.kv_type, V, slots, np.ascontiguousarray(v, np.float32))
            out = np.empty((q.shape[0], q.shape[1], v.shape[2]), np.float32)
            paged(q, K, V, self.kv_type, pos, q_tab, tables, self.bs, scale, window, softcap, out,
                  **kw)
            return out
        return self._attend_reference(ops, K, V, q, k, v, pos, q_tab, scale, window, softcap, kw,
                                      slots, tables)

    def _attend_quantized(self, ops, K, V, q, k, v, pos, q_tab, scale, window, softcap, kw,
                          slots, tables):
        # q8_0 / q4_0 rows (llama.cpp's -ctk/-ctv): quantized as llama.cpp stores them, attended
        # with its numerics (csrc/kv_quant.c; ops.attention_kvq, the numpy reference stands in)
        # with llama.cpp's Hadamard rotation of quantized K / V (kv/quant.py rotate)
        from . import quant as kq
        tk, tv = self.kv_type, self.kv_type_v
        n = k.shape[0]
        # V inside K: V is the first Dv values of the rotated K row, so it has K's rotation
        rk, rv = kq.rot_sizes(tk, tv, k.shape[-1], v.shape[-1], V is None)
        kq.store_rows(tk, K, slots, kq.rotate(k, rk).reshape(n, -1))
        if V is not None:
            kq.store_rows(tv, V, slots, kq.rotate(v, rv).reshape(n, -1))
        else:
            kw["dv"] = v.shape[-1]
        o = ops.attention_kvq(np.ascontiguousarray(kq.rotate(q, rk)), K, V, pos, None, scale,
                              window, softcap, tk, tv, table=tables, q_tab=q_tab, bs=self.bs,
                              **kw)
        return kq.rotate(o, rv)

    def _attend_reference(self, ops, K, V, q, k, v, pos, q_tab, scale, window, softcap, kw,
                          slots, tables):
        # numpy backend: write through numpy's rounding, gather each sequence's keys, attend
        assert self.kv_type in _NP, "the numpy backend has f32 and f16 caches only"
        K[slots] = k
        if V is not None:
            V[slots] = v
        if self.kv_type == 1:
            q = q.astype(np.float16).astype(np.float32)  # llama.cpp's f16 path reads Q as f16
        dv = v.shape[2]
        out = np.empty((q.shape[0], q.shape[1], dv), np.float32)
        bs = self.bs
        for tab in np.unique(q_tab):
            sel = np.nonzero(q_tab == tab)[0]
            T = int(pos[sel].max()) + 1
            # keys 0..T-1, the window masks them (a given-back window block's table entry
            # names another block: finite rows, masked, the same sums)
            t = np.arange(T)
            phys = tables[tab + t // bs].astype(np.int64) * bs + t % bs
            kk = K[phys]
            vv = kk[..., :dv] if V is None else V[phys]   # V inside K: the K rows' first Dv
            out[sel] = ops.attention(np.ascontiguousarray(q[sel]), kk, vv, pos[sel],
                                     t.astype(np.int32), scale, window, softcap, **kw)
        return out
