"""KV cache types (llama.cpp's -ctk / -ctv): names, row sizes, and the numpy reference.

A cache row is the head_dim values of one kv head at one position: float16 values (``f16``,
the default), or head_dim/32 ggml blocks stored as raw uint8 (``q8_0``: f16 d + 32 int8,
34 B; ``q4_0``: f16 d + 16 bytes of nibbles, 18 B). Type ids are GGML's.

The reference follows the C that llama.cpp runs on x86 (csrc/kv_quant.c is checked against it
bit for bit): rows are quantized as ggml's set_rows does (x86 quantize_row_q8_0: d = amax/127,
x * (127/amax) rounded half to even; quantize_row_q4_0_ref: d = max/-8, trunc(x/d + 8.5));
a quantized K is dotted with q quantized to q8_0 (the K type's vec_dot_type), in ggml's AVX2
order (8 lanes of 4-product integer sums, one fma per block and lane, hsum_float_8).
"""

from __future__ import annotations

import functools

import numpy as np

from ..errors import RequestError

F32, F16, Q4_0, Q8_0 = 0, 1, 2, 8
CACHE_TYPES = {"f16": F16, "q8_0": Q8_0, "q4_0": Q4_0}
NAMES = {v: k for k, v in CACHE_TYPES.items()} | {F32: "f32"}
QK = 32
_BLOCK_BYTES = {Q8_0: 34, Q4_0: 18}


def cache_type(name: str | int | None) -> int:
    """GGML type id of a cache type name ('f16', 'q8_0', 'q4_0'); RequestError otherwise."""
    if name is None:
        return F16
    if isinstance(name, int) and name in NAMES:
        return name
    key = str(name).strip().lower()
    if key not in CACHE_TYPES:
        raise RequestError(f"unknown KV cache type {name!r}; use one of {', '.join(CACHE_TYPES)}")
    return CACHE_TYPES[key]


def is_block(t: int) -> bool:
    return t in _BLOCK_BYTES


def row_bytes(t: int, n: int) -> int:
    """Bytes of one cache row of n values."""
    if t == F32:
        return 4 * n
    if t == F16:
        return 2 * n
    assert n % QK == 0, (NAMES[t], n)
    return n // QK * _BLOCK_BYTES[t]


def bytes_per_value(t: int) -> float:
    """Average bytes per cached value: 2 (f16), 34/32 (q8_0), 18/32 (q4_0)."""
    return row_bytes(t, QK) / QK


def check_head_dims(t: int, *dims: int) -> None:
    """A block type needs head dims that are multiples of 32 (as llama.cpp)."""
    for d in dims:
        if is_block(t) and d % QK:
            raise RequestError(f"KV cache type {NAMES[t]} needs a head dimension that is a "
                               f"multiple of {QK}; this model has {d}; use -ctk/-ctv f16")


# --- llama.cpp's rotation of a quantized cache (PR 21038: attn_rot_k / attn_rot_v) ----------
# A quantized K (V) cache holds K (V) multiplied by an orthonormal Walsh-Hadamard matrix per
# chunk of the head dimension, which spreads outlier channels over the block before it is
# quantized. q is rotated the same way (q.k is unchanged) and the attention output is rotated
# back (H @ H = I). On when the type is q8_0/q4_0 and the head dim is a multiple of 64; chunks
# of the largest power of two (>= 64) dividing the head dim for K, of 64 for V.
_HADAMARD: dict[int, np.ndarray] = {}


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Sylvester Walsh-Hadamard matrix float32[n, n] (ggml_gen_hadamard)."""
    h = _HADAMARD.get(n)
    if h is None:
        assert n >= 1 and n & (n - 1) == 0
        h = np.full((1, 1), 1.0 / np.sqrt(np.float32(n)), np.float32)
        while h.shape[0] < n:
            h = np.block([[h, h], [h, -h]])
        h = _HADAMARD[n] = np.ascontiguousarray(h, dtype=np.float32)
    return h


def rot_size(t: int, head_dim: int, is_k: bool) -> int:
    """The rotation chunk llama.cpp uses for a cache of type t (0: no rotation)."""
    if not is_block(t) or head_dim % 64:
        return 0
    if not is_k:
        return 64
    n = 64
    while head_dim % (2 * n) == 0:
        n *= 2
    return n


def rot_sizes(tk: int, tv: int, head_dim_k: int, head_dim_v: int,
              v_in_k: bool = False) -> tuple[int, int]:
    """(K's, V's) rotation chunks. With V inside K (MLA), V is the first head_dim_v values of
    the rotated K row, so it carries K's rotation (check_v_in_k: whole chunks) and the output
    is rotated back with K's chunk."""
    rk = rot_size(tk, head_dim_k, True)
    return (rk, rk) if v_in_k else (rk, rot_size(tv, head_dim_v, False))


def check_v_in_k(t: int, head_dim_k: int, head_dim_v: int) -> None:
    """A cache of type t can keep V inside K (V = K[..., :head_dim_v]) when V's values are whole
    blocks of the K row (block types: multiples of 32) and whole chunks of K's rotation (so that
    they are the rotated V and the output rotates back); RequestError otherwise. DeepSeek's
    576 = 512 + 64 rows rotate in chunks of 64: any type works."""
    check_head_dims(t, head_dim_k, head_dim_v)
    rk = rot_size(t, head_dim_k, True)
    if rk and head_dim_v % rk:
        raise RequestError(f"KV cache type {NAMES[t]} cannot keep V inside K for this model: its "
                           f"{head_dim_k}-value K rows rotate in chunks of {rk}, which V's "
                           f"{head_dim_v} values do not fill; use -ctk f16")


@functools.cache
def _native_fwht():
    # looked up once: rotate runs four times per layer per token
    try:
        from .. import _native
    except ImportError:  # pure-numpy installs: the butterflies below
        return None
    return getattr(_native, "fwht", None)


def rotate(x: np.ndarray, n: int) -> np.ndarray:
    """x [..., D] with each chunk of n values of the last axis multiplied by hadamard(n), as a
    fast Walsh-Hadamard transform: log2(n) butterfly passes of elementwise adds, so a row's
    result never depends on how many rows are rotated with it (a BLAS product by the matrix
    may take other kernels for other row counts; llama.cpp's matrix product rounds in another
    order, within float error of this)."""
    if n == 0:
        return x
    shape = x.shape
    scale = np.float32(1.0 / np.sqrt(np.float32(n)))
    native = _native_fwht()
    if native is not None:  # the same butterflies in C (csrc/ops.c mf_fwht_f32): the same bits
        return native(np.ascontiguousarray(x, dtype=np.float32), n, float(scale)).reshape(shape)
    y = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, n) * scale
    h = 1
    while h < n:
        v = y.reshape(-1, n // (2 * h), 2, h)
        a = v[:, :, 0, :].copy()
        b = v[:, :, 1, :]
        v[:, :, 0, :] += b
        v[:, :, 1, :] = a - b
        h *= 2
    return y.reshape(shape)


def store_rows(t: int, pool: np.ndarray, rows: np.ndarray, x: np.ndarray) -> None:
    """x float32[n, values of one token] into physical rows ``rows`` of a pool in type t (the
    native kv_store, else the numpy reference)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows = np.ascontiguousarray(rows, dtype=np.int32)
    if _kv_store is not None:
        _kv_store(t, pool, rows, x)
        return
    flat = pool.reshape(pool.shape[0], -1).view(np.uint8)
    flat[rows] = quantize_ref(t, x).reshape(len(rows), -1)


try:
    from .._native import kv_store as _kv_store
except ImportError:  # pragma: no cover - the numpy reference stands in
    _kv_store = None


# --- numpy reference ----------------------------------------------------------------------

def _f16_bytes(d: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(d.astype(np.float32).astype("<f2")).view(np.uint8)


def quantize_ref(t: int, x: np.ndarray) -> np.ndarray:
    """x float32[..., n] -> uint8[..., row_bytes(t, n)] (f16: the bytes of float16 values)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n = x.shape[-1]
    lead = x.shape[:-1]
    if t == F16:
        return x.astype("<f2").view(np.uint8).reshape(*lead, 2 * n)
    if t == F32:
        return x.view(np.uint8).reshape(*lead, 4 * n)
    xb = x.reshape(-1, QK)
    with np.errstate(divide="ignore", invalid="ignore"):
        if t == Q8_0:
            amax = np.abs(xb).max(axis=1, keepdims=True)
            d = amax / np.float32(127)
            inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
            q = np.rint(xb * inv).astype(np.int8).view(np.uint8)
        else:
            idx = np.abs(xb).argmax(axis=1)
            mx = xb[np.arange(xb.shape[0]), idx][:, None]
            mx = np.where(np.abs(mx) == 0, np.float32(0), mx).astype(np.float32)
            d = mx / np.float32(-8)
            inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
            v = np.trunc(xb * inv + np.float32(8.5)).astype(np.int8)
            qi = np.minimum(v, 15).astype(np.uint8)
            q = qi[:, :16] | (qi[:, 16:] << 4)
    out = np.concatenate([_f16_bytes(d).reshape(-1, 2), q], axis=1)
    return out.reshape(*lead, row_bytes(t, n))


def dequantize_ref(t: int, raw: np.ndarray, n: int) -> np.ndarray:
    """uint8[..., row_bytes(t, n)] -> float32[..., n]."""
    from ..quant.reference import dequantize
    raw = np.ascontiguousarray(raw).view(np.uint8)
    lead = raw.shape[:-1]
    m = int(np.prod(lead, dtype=np.int64)) * n
    if t == F16:
        return raw.reshape(-1).view("<f2").astype(np.float32).reshape(*lead, n)
    if t == F32:
        return raw.reshape(-1).view("<f4").reshape(*lead, n).copy()
    return dequantize(t, raw.reshape(-1), m).reshape(*lead, n)


def _blocks(t: int, raw: np.ndarray):
    """Block rows uint8[..., nb*bytes] -> (d float32[..., nb], int8 values [..., nb, 32])."""
    bb = _BLOCK_BYTES[t]
    b = raw.reshape(*raw.shape[:-1], -1, bb)
    d = np.ascontiguousarray(b[..., :2]).view("<f2")[..., 0].astype(np.float32)
    if t == Q8_0:
        return d, b[..., 2:].view(np.int8)
    qs = b[..., 2:]
    return d, (np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int8) - 8)


def dot_ref(tk: int, k_raw: np.ndarray, q_raw: np.ndarray) -> np.ndarray:
    """Scores of K rows uint8[T, rb_k] (q8_0/q4_0) with one q row in q8_0 (uint8[rb_q]):
    ggml's AVX2 vec_dot, float32[T]."""
    dk, kv = _blocks(tk, k_raw)                     # [T, nb], [T, nb, 32]
    dq, qv = _blocks(Q8_0, q_raw)                   # [nb], [nb, 32]
    isum = (kv.astype(np.int32) * qv.astype(np.int32)).reshape(*kv.shape[:-1], 8, 4).sum(-1)
    d = (dk * dq).astype(np.float32)                # exact: f16 x f16
    acc = np.zeros((kv.shape[0], 8), np.float32)
    for b in range(kv.shape[1]):                    # fma in float64: d * isum is exact there
        acc = (d[:, b, None].astype(np.float64) * isum[:, b] + acc).astype(np.float32)
    r = acc[:, :4] + acc[:, 4:]
    return (r[:, 0] + r[:, 2]) + (r[:, 1] + r[:, 3])


def attention_paged_ref(q, k, v, q_pos, q_tab, tables, bs, scale, window, softcap, tk, tv,
                        sinks=None, dv=None):
    """attention_ref over a paged pool: query row i sees logical keys 0..q_pos[i] of its
    sequence, key t at row tables[q_tab[i] + t // bs] * bs + t % bs. v None: V is each K row's
    first dv values (as attention_ref)."""
    n, hq, _ = q.shape
    hkv = k.shape[-2]
    kr = np.ascontiguousarray(k).view(np.uint8).reshape(-1, hkv, k.shape[-1] * k.itemsize)
    vr = None if v is None else \
        np.ascontiguousarray(v).view(np.uint8).reshape(-1, hkv, v.shape[-1] * v.itemsize)
    out = None
    for tab in np.unique(q_tab):
        sel = np.nonzero(np.asarray(q_tab) == tab)[0]
        T = int(np.asarray(q_pos)[sel].max()) + 1
        t = np.arange(T)
        phys = np.asarray(tables)[tab + t // bs].astype(np.int64) * bs + t % bs
        o = attention_ref(np.ascontiguousarray(q[sel]), kr[phys], None if vr is None else vr[phys],
                          np.asarray(q_pos)[sel], t.astype(np.int32), scale, window, softcap, tk,
                          tv, sinks=sinks, dv=dv)
        if out is None:
            out = np.zeros((n, hq, o.shape[-1]), np.float32)
        out[sel] = o
    return out


def attention_ref(q, k, v, q_pos, kv_pos, scale, window, softcap, tk, tv, table=None,
                  sinks=None, dv=None):
    """The reference of ops.attention_kvq: q f32[n, Hq, D]; k, v uint8 rows [..., Hkv, rb]
    (contiguous [T, ...] or a pool [n_blocks, 32, ...] with a block table). Scores as llama.cpp
    computes them (dot_ref for block K, f16-rounded q for f16 K), softmax in float64; sinks
    f32[Hq] (or None): one more logit per q head in the denominator, not scaled or capped.
    v None: V inside K (MLA), each K row's first dv values, in K's type (tv == tk)."""
    n, hq, dd = q.shape
    hkv = k.shape[-2]
    kr = np.ascontiguousarray(k).view(np.uint8).reshape(-1, hkv, row_bytes(tk, dd))
    T = len(kv_pos)
    rows = np.arange(T) if table is None else (np.asarray(table)[np.arange(T) // QK] * QK
                                                + np.arange(T) % QK)
    if v is None:
        assert tv == tk and dv is not None and 0 < dv <= dd, (tk, tv, dv, dd)
        vr = kr[rows][..., :row_bytes(tk, dv)]
        dv = row_bytes(tk, dv)
    else:
        dv = v.reshape(-1, v.shape[-2], v.shape[-1]).view(np.uint8).shape[-1]
        vr = np.ascontiguousarray(v).view(np.uint8).reshape(-1, hkv, dv)[rows]
    ndv = dv * QK // _BLOCK_BYTES[tv] if is_block(tv) else dv // (2 if tv == F16 else 4)
    V = dequantize_ref(tv, vr, ndv)                 # [T, Hkv, Dv]
    kr = kr[rows]
    out = np.zeros((n, hq, ndv), np.float32)
    g = hq // hkv
    sc = np.float32(scale / softcap if softcap > 0 else scale)
    for i in range(n):
        vis = (np.asarray(kv_pos) <= q_pos[i])
        if window > 0:
            vis &= (q_pos[i] - np.asarray(kv_pos)) < window
        if not vis.any():
            continue
        for h in range(hq):
            kk = kr[:, h // g]
            if is_block(tk):
                s = dot_ref(tk, kk, quantize_ref(Q8_0, q[i, h]))
            else:
                qf = q[i, h].astype(np.float16) if tk == F16 else q[i, h]  # f16 K: q as f16
                qf = qf.astype(np.float64)
                s = dequantize_ref(tk, kk, dd).astype(np.float64) @ qf
            s = s.astype(np.float64) * sc
            if softcap > 0:
                s = softcap * np.tanh(s)
            s = np.where(vis, s, -np.inf)
            m, extra = s.max(), 0.0
            if sinks is not None:
                sk = float(np.float32(sinks[h]))
                m = max(m, sk)
                extra = np.exp(sk - m)
            p = np.exp(s - m)
            out[i, h] = (p / (p.sum() + extra)) @ V[:, h // g].astype(np.float64)
    return out
