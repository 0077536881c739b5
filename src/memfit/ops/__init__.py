"""Compute ops behind one interface, two backends.

``numpy`` (ops/reference.py) is the readable oracle; ``native`` (ops/native.py, over the C
extension memfit._native) is the fast default once built. Model code calls
``ops = get_ops(name)`` (a backend object, ops/backend.py: these functions, the capabilities
the backend declares, routing) and then only those, so it never knows which runs.

All activations are float32, C-contiguous numpy arrays. Weights arrive as QTensor (raw
GGUF bytes + type + numpy-order shape); a backend dequantizes per use, never the whole model.

    matmul(x[n, cols], w: QTensor(rows, cols)) -> y[n, rows]          # y = x @ W^T
    matmul_heads(x[n, H, cols], w: QTensor(H, rows, cols), rowwise=None, out=None)
        -> y[n, H, rows], y[:, h] = x[:, h] @ W[h]^T (one matrix per head, stored one after
        another: DeepSeek MLA's absorbed k_b / v_b); native: one call, each head equal to
        matmul of that head alone bit for bit
    get_rows(w: QTensor(vocab, dim), ids: int array[n]) -> [n, dim]     # embedding lookup
    rmsnorm(x[n, d], weight[d] f32 | None, eps) -> [n, d]               # x / rms(x) * weight
    rope(x[n, heads, head_dim], pos int32[n], n_rot, theta_base, freq_scale, neox: bool,
         freq_factors=None, *, ext_factor=0.0, attn_factor=1.0, corr_dims=(0.0, 0.0)) -> same
        (normal: rotate adjacent pairs (2i, 2i+1); neox: rotate (i, i + n_rot/2)); YaRN as
        ggml's rope_yarn: ext_factor != 0 mixes the unscaled angle into pairs below corr_dims'
        ramp and scales cos/sin by attn_factor * (1 + 0.1 ln(1 / freq_scale)), else by
        attn_factor; corr_dims from ops.rope.yarn_corr_dims(n_rot, n_ctx_orig, base,
        beta_fast, beta_slow). The defaults give the plain rotation bit for bit.
    softmax(x[..., k]) -> same (last axis, max-subtracted)
    sigmoid(x) -> 1 / (1 + exp(-x)) (native: scalar expf per value; routers' gates)
    silu_mul(gate[n, f], up[n, f]) -> silu(gate) * up
    gelu_mul(gate[n, f], up[n, f]) -> gelu_tanh(gate) * up
    swiglu_oai(gate, up, alpha=1.702, limit=7.0, out=None) -> gpt-oss's clamped SwiGLU:
        x = min(gate, limit), y = clip(up, -limit, limit), x / (1 + exp(-alpha x)) * (y + 1)
    attention(q[n, Hq, D], k[T, Hkv, D], v[T, Hkv, Dv], q_pos int32[n], kv_pos int32[T],
              scale, window: int = 0, softcap: float = 0.0, sinks=None) -> [n, Hq, Dv]
        causal on positions (kv_pos <= q_pos); window > 0 also masks q_pos - kv_pos >= window;
        softcap > 0 applies softcap * tanh(s / softcap) to scores; GQA maps q head h to
        kv head h // (Hq // Hkv). sinks f32[Hq] (gpt-oss): one more logit per q head in the
        softmax denominator only (not scaled, not capped, no value row).
    attention_kvq(q, k, v, q_pos, kv_pos, scale, window, softcap, type_k, type_v, table=None,
                  ..., sinks=None, dv=None)
        the same over K/V rows in KV cache types (uint8 [..., Hkv, row_bytes]; f16, q8_0, q4_0
        as GGML type ids), llama.cpp's numerics (kv/quant.py); with a block table, key t is
        row table[t // 32] * 32 + t % 32 of a paged pool. v None: V inside K (MLA), each K
        row's first dv values in K's type (type_v == type_k).

The native backend adds fused calls the model uses when present (ops/native.py): matmul_multi,
attention_paged(..., sinks=None) and kv_store over the paged pool (kv/view.py; V None: V is
K's first Dv values, Dv from out), decode layers,
and moe_ffn(x, mats, off, rows, wts, act, out, rowwise=False, biases=None) for a layer's routed
experts (act 0 silu, 1 gelu, 2 swiglu_oai; a bool reads as gelu or not; biases per group
(gate, up, down) f32 | None, added after their matmuls).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..quant.types import GGMLType


@dataclass(frozen=True)
class QTensor:
    """A weight as stored in the GGUF: raw bytes, type, numpy-order shape (rows, cols)."""

    name: str
    type: GGMLType
    shape: tuple[int, ...]
    data: np.ndarray  # uint8, len == rows * row_bytes(cols)


def get_ops(name: str | None = None):
    """The backend object (ops/backend.py) by name: 'numpy' or 'native'; default from
    MEMFIT_BACKEND, else native when the extension is importable, else numpy."""
    from .backend import as_backend
    name = name or os.environ.get("MEMFIT_BACKEND") or "auto"
    if name == "numpy":
        from . import reference
        return as_backend(reference)
    if name in ("native", "auto"):
        try:
            from . import native
            return as_backend(native)
        except ImportError:
            if name == "native":
                raise
            from . import reference
            return as_backend(reference)
    from ..errors import RequestError
    raise RequestError(f"unknown backend {name!r}; use 'numpy' or 'native'")
