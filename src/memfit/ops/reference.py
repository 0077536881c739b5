"""The numpy backend: readable float32 definitions of every compute op (the oracle).

Weights are dequantized per use through memfit.quant.reference.dequantize: one whole tensor
per matmul, only the requested rows in get_rows; never the whole model. Signatures are those
in the docstring of memfit.ops.
"""

from __future__ import annotations

import numpy as np

from ..quant.reference import dequantize
from . import QTensor


# numpy's matmul (BLAS) may round a row differently with other rows beside it
BATCH_INVARIANT = False

def dequant(w: QTensor) -> np.ndarray:
    """The whole tensor as float32 in its numpy shape."""
    n = 1
    for d in w.shape:
        n *= d
    return dequantize(w.type.id, w.data.reshape(-1), n).reshape(w.shape)


def matmul(x: np.ndarray, w: QTensor, rowwise: bool = False) -> np.ndarray:
    # x[n, cols] @ W(rows, cols)^T -> y[n, rows] (rowwise: the native backend's kernel family;
    # numpy's product is taken as it comes)
    rows, cols = w.shape
    assert x.ndim == 2 and x.shape[1] == cols, (x.shape, w.name, w.shape)
    return np.ascontiguousarray(x, dtype=np.float32) @ dequant(w).T


def matmul_heads(x: np.ndarray, w: QTensor, rowwise: bool | None = None,
                 out: np.ndarray | None = None) -> np.ndarray:
    # x[n, H, cols], W(H, rows, cols): y[n, H, rows] with y[:, h] = x[:, h] @ W[h]^T (one
    # matrix per head: DeepSeek MLA's absorbed projections); rowwise as in matmul
    H, rows, cols = w.shape
    assert x.ndim == 3 and x.shape[1:] == (H, cols), (x.shape, w.name, w.shape)
    y = np.einsum("nhc,hrc->nhr", np.asarray(x, dtype=np.float32), dequant(w)).astype(np.float32)
    if out is None:
        return y
    out[...] = y
    return out


def get_rows(w: QTensor, ids: np.ndarray) -> np.ndarray:
    # W(vocab, dim): gather the raw bytes of the requested rows, dequantize only those
    rows, cols = w.shape
    rb = w.type.row_bytes(cols)
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    raw = w.data.reshape(-1)[: rows * rb].reshape(rows, rb)[ids]
    return dequantize(w.type.id, raw.reshape(-1), ids.size * cols).reshape(ids.size, cols)


def rmsnorm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    # x / sqrt(mean(x^2) + eps) over the last axis, times weight
    ms = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True)
    y = x * (1.0 / np.sqrt(ms + np.float32(eps)))
    if weight is not None:
        y = y * weight
    return y.astype(np.float32, copy=False)


def rope(x: np.ndarray, pos: np.ndarray, n_rot: int, theta_base: float, freq_scale: float,
         neox: bool, freq_factors: np.ndarray | None = None, *, ext_factor: float = 0.0,
         attn_factor: float = 1.0, corr_dims: tuple[float, float] = (0.0, 0.0)) -> np.ndarray:
    """x[n, heads, head_dim]; dims >= n_rot pass through. theta_i = pos * freq_scale *
    base^(-2i/n_rot) / freq_factors[i] (freq_factors: llama3-style rope_freqs, optional).

    YaRN (ggml's rope_yarn; corr_dims from memfit.ops.rope.yarn_corr_dims): with ext_factor
    != 0, pair i mixes in the unscaled angle pos * base^(-2i/n_rot) / ff[i] by ramp_i = (1 -
    clamp((i - lo) / max(0.001, hi - lo), 0, 1)) * ext_factor, and cos/sin are scaled by
    attn_factor * (1 + 0.1 ln(1 / freq_scale)); with ext_factor 0 by attn_factor alone."""
    half = n_rot // 2
    inv = theta_base ** (-np.arange(half, dtype=np.float64) * 2.0 / n_rot)
    if freq_factors is not None:
        inv = inv / np.asarray(freq_factors, dtype=np.float64)
    p = np.asarray(pos, dtype=np.float64)[:, None]
    ang = p * (freq_scale * inv)[None, :]  # [n, half]
    if ext_factor == 0.0 and attn_factor == 1.0:
        cos = np.cos(ang).astype(np.float32)[:, None, :]
        sin = np.sin(ang).astype(np.float32)[:, None, :]
    else:
        mscale = float(attn_factor)
        if ext_factor != 0.0:
            lo, hi = (float(c) for c in corr_dims)
            y = (np.arange(half, dtype=np.float64) - lo) / max(0.001, hi - lo)
            ramp = (1.0 - np.clip(y, 0.0, 1.0)) * ext_factor
            ang = ang * (1.0 - ramp) + (p * inv[None, :]) * ramp
            mscale *= 1.0 + 0.1 * np.log(1.0 / freq_scale)
        cos = (np.cos(ang) * mscale).astype(np.float32)[:, None, :]
        sin = (np.sin(ang) * mscale).astype(np.float32)[:, None, :]
    out = np.array(x, dtype=np.float32, copy=True)
    if neox:
        a, b = x[..., :half], x[..., half:n_rot]
        out[..., :half] = a * cos - b * sin
        out[..., half:n_rot] = a * sin + b * cos
    else:
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * cos - b * sin
        out[..., 1:n_rot:2] = a * sin + b * cos
    return out


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return (e / np.sum(e, axis=-1, keepdims=True)).astype(np.float32, copy=False)


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):   # exp overflow -> inf -> 0
        return (1.0 / (1.0 + np.exp(-x))).astype(np.float32, copy=False)


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return (gate / (1.0 + np.exp(-gate)) * up).astype(np.float32, copy=False)


_GELU_C = np.float32(np.sqrt(2.0 / np.pi))


def gelu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    # tanh approximation, as ggml_gelu
    g = 0.5 * gate * (1.0 + np.tanh(_GELU_C * (gate + np.float32(0.044715) * gate ** 3)))
    return (g * up).astype(np.float32, copy=False)


def swiglu_oai(gate: np.ndarray, up: np.ndarray, alpha: float = 1.702, limit: float = 7.0,
               out: np.ndarray | None = None) -> np.ndarray:
    # gpt-oss's clamped SwiGLU (ggml's swiglu_oai): the gate capped above, up clipped both ways
    x = np.minimum(gate, np.float32(limit))
    y = np.clip(up, np.float32(-limit), np.float32(limit))
    with np.errstate(over="ignore"):   # exp overflow -> inf -> x / inf = -0, as expf
        r = x / (np.float32(1) + np.exp(np.float32(-alpha) * x)) * (y + np.float32(1))
    if out is None:
        return r.astype(np.float32, copy=False)
    out[...] = r
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray,
              kv_pos: np.ndarray, scale: float, window: int = 0,
              softcap: float = 0.0, sinks: np.ndarray | None = None) -> np.ndarray:
    # q[n, Hq, D], k[T, Hkv, D], v[T, Hkv, Dv] -> [n, Hq, Dv]; q head h uses kv head h // G;
    # sinks f32[Hq]: one more logit per q head in the softmax denominator (no value row)
    n, hq, d = q.shape
    t, hkv, dv = v.shape
    g = hq // hkv
    k = k.astype(np.float32, copy=False)  # an f16 cache is read as the f32 values it holds
    v = v.astype(np.float32, copy=False)
    qg = q.reshape(n, hkv, g, d).transpose(1, 2, 0, 3).reshape(hkv, g * n, d)
    s = (qg @ k.transpose(1, 2, 0)) * np.float32(scale)            # [Hkv, G*n, T]
    s = s.reshape(hkv, g, n, t)
    if softcap > 0.0:
        s = np.float32(softcap) * np.tanh(s / np.float32(softcap))
    qp = np.asarray(q_pos)[:, None].astype(np.int64)
    kp = np.asarray(kv_pos)[None, :].astype(np.int64)
    allowed = kp <= qp
    if window > 0:
        allowed &= (qp - kp) < window   # llama.cpp: masked when q_pos - kv_pos >= n_swa
    s = np.where(allowed[None, None], s, np.float32(-np.inf))
    if sinks is None:
        p = softmax(s).reshape(hkv, g * n, t)
    else:
        # max over the scores and the sink (neither scaled nor capped), as ggml's soft_max
        sk = np.asarray(sinks, dtype=np.float32).reshape(hkv, g, 1, 1)
        m = np.maximum(np.max(s, axis=-1, keepdims=True), sk)
        e = np.exp(s - m)
        p = (e / (np.sum(e, axis=-1, keepdims=True) + np.exp(sk - m)))
        p = p.astype(np.float32, copy=False).reshape(hkv, g * n, t)
    o = p @ v.transpose(1, 0, 2)                                      # [Hkv, G*n, Dv]
    return np.ascontiguousarray(o.reshape(hkv, g, n, dv).transpose(2, 0, 1, 3).reshape(n, hq, dv),
                                dtype=np.float32)


def attention_kvq(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray,
                  kv_pos: np.ndarray, scale: float, window: int = 0, softcap: float = 0.0,
                  type_k: int = 1, type_v: int = 1, table=None, out=None, q_tab=None,
                  bs: int = 32, sinks: np.ndarray | None = None,
                  dv: int | None = None) -> np.ndarray:
    """attention over K/V rows in KV cache types (uint8 rows [..., Hkv, row_bytes], contiguous
    or a paged pool with a block table): llama.cpp's scores (kv/quant.py), float64 softmax
    (sinks as in attention). v None: V inside K, each K row's first dv values (out's last
    dim when out is given), type_v == type_k (MLA)."""
    from ..kv.quant import attention_paged_ref, attention_ref
    if v is None and dv is None:
        dv = out.shape[-1]
    if q_tab is not None:
        r = attention_paged_ref(q, k, v, q_pos, q_tab, table, bs, scale, window, softcap,
                                type_k, type_v, sinks=sinks, dv=dv)
    else:
        r = attention_ref(q, k, v, q_pos, kv_pos, scale, window, softcap, type_k, type_v, table,
                          sinks=sinks, dv=dv)
    if out is None:
        return r
    out[...] = r
    return out


def attention_fa16(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray,
                   kv_pos: np.ndarray, scale: float, window: int = 0, softcap: float = 0.0,
                   sinks: np.ndarray | None = None) -> np.ndarray:
    """attention over an f16 cache as llama.cpp computes it (ggml's CPU flash attention, its
    default): q rounded to f16, keys in position order with the running max M and sum S updated
    per key, the V accumulator rounded to f16 at every key, the sink after the keys, acc / S.
    The oracle of the native f16-cache kernels in their default numerics (csrc/ops.c)."""
    n, hq, d = q.shape
    t_all, hkv, dv = v.shape
    g = hq // hkv
    q16 = q.astype(np.float16).astype(np.float32)
    kf, vf = k.astype(np.float32), v.astype(np.float32)
    out = np.zeros((n, hq, dv), np.float32)
    for i in range(n):
        qp = int(q_pos[i])
        keys = [t for t in range(t_all) if kv_pos[t] <= qp and (window <= 0 or qp - kv_pos[t] < window)]
        for h in range(hq):
            acc = np.zeros(dv, np.float16)
            m, s_sum = np.float32(-np.inf), np.float32(0)
            for t in keys:
                s = np.float32(np.dot(q16[i, h].astype(np.float64), kf[t, h // g].astype(np.float64)))
                s = np.float32(s * np.float32(scale))
                if softcap > 0.0:
                    s = np.float32(softcap * np.tanh(s / softcap))
                ms = vs = np.float32(1)
                if s > m:
                    ms = np.float32(np.exp(np.float32(m - s))) if np.isfinite(m) else np.float32(0)
                    m = s
                    acc = (acc.astype(np.float32) * ms).astype(np.float16)
                else:
                    vs = np.float32(np.exp(np.float32(s - m)))
                acc = (acc.astype(np.float32) + vf[t, h // g] * vs).astype(np.float16)
                s_sum = np.float32(s_sum * ms + vs)
            o = acc.astype(np.float32)
            if sinks is not None:
                sk = np.float32(sinks[h])
                ms = vs = np.float32(1)
                if sk > m:
                    ms = np.float32(np.exp(np.float32(m - sk)))
                    o = o * ms
                else:
                    vs = np.float32(np.exp(np.float32(sk - m)))
                s_sum = np.float32(s_sum * ms + vs)
            out[i, h] = o * (np.float32(1) / s_sum if s_sum != 0 else np.float32(0))
    return out
