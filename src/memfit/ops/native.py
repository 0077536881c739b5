"""The native backend: the ops of memfit.ops over the C extension memfit._native.

matmul, matmul_heads and get_rows run the quant kernels (csrc/quant*.c); rmsnorm, rope,
softmax, silu_mul, gelu_mul, swiglu_oai and attention come from csrc/ops.c when the extension
has them (else the numpy reference stands in, so get_ops('native') always works end to end).

Tolerance. On AVX2 and AVX-512 VNNI the quantized matmul quantizes each activation row to
8 bits per block as llama.cpp's vec_dot_type does (Q8_0-style per 32 values with an f16-rounded
scale for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/IQ4_NL; Q8_K-style per 256 for the K-quants and IQ4_XS),
then dots in integers. Against the float64 product of the dequantized weights with the
activations rounded that way (memfit.quant.activations) max|y - ref| / max|ref| is 5e-8..2e-7
for every type (tests/test_native_quant.py bounds it at 1e-5); against the plain float64
product ~3e-3..1.1e-2 (the 8-bit activations). F32/F16/BF16 weights use f32 FMA (~1e-7). The
scalar ISA path dequantizes each W row to f32 and dots in f32 (no activation quantization,
~3e-7).

Paths, chosen by the caller's mode and never by the row count (batch invariance,
csrc/quant_mm.c): decode (rowwise=True) runs integer vec-dots per W row (4/8 W rows per call
where that keeps each row's bits); prefill (rowwise=False) unpacks each W row once per task
and runs the type's batched kernel. Either way a row of y depends only on its x row, never on
how many rows share the call. avx512vnni has its own decode vec-dots for Q3_K..Q6_K (512-bit), Q4_0/Q4_1/Q5_0/Q5_1
and Q8_0 (VNNI), and a VNNI form of the K-quant prefill kernel (the same bits as AVX2);
other types run the AVX2 kernels. MEMFIT_ISA=scalar|avx2|avx512vnni or
memfit._native.set_isa() selects the ISA (tests); memfit._native.isas() lists those with
kernels of their own. MEMFIT_THREADS or set_threads() the pool size (default: physical cores).
"""

from __future__ import annotations

import os

import numpy as np

from .. import _native
from ..errors import UnsupportedError
from ..quant.tables import ensure as ensure_tables
from ..quant.types import SUPPORTED, SUPPORTED_NAMES, TYPES
from . import QTensor
from . import reference as _ref

# a row's results never depend on the other rows of its call (see Paths above).
# MEMFIT_BATCH_INVARIANT=0 opts out where it costs speed: a MoE prompt's expert groups of
# fewer than 8 rows take the one-row kernels (csrc/moe.c mf_moe_vecdot_below), so a prompt
# row's logits then depend on the rows that share its prefill step (BENCHMARKS.md: the cost).
BATCH_INVARIANT = os.environ.get("MEMFIT_BATCH_INVARIANT", "1").strip() != "0"
_native.set_moe_vecdot_below(0 if BATCH_INVARIANT else 8)

# An f16 KV cache is attended as llama.cpp's CPU flash attention does (its default: per-key
# running max and sum, an f16 accumulator; csrc/ops.c), or with MEMFIT_ATTN=f32 by the blocked
# kernels that accumulate in f32 (the result of the same values held as f32).
if os.environ.get("MEMFIT_ATTN") in ("llama", "f32"):
    _native.attn_numerics(os.environ["MEMFIT_ATTN"])

# the types the native core computes with -> elements per block
_BLOCK = {i: TYPES[i].block_size for i in SUPPORTED}


def _check(w: QTensor) -> None:
    if w.type.id not in _BLOCK:
        _unsupported(w)
    ensure_tables(w.type.id)


def _unsupported(w: QTensor):
    raise UnsupportedError(f"tensor {w.name!r}: type {w.type.name} has no native kernel; "
                           f"supported: {' '.join(SUPPORTED_NAMES)}")


def matmul(x: np.ndarray, w: QTensor, out: np.ndarray | None = None,
           rowwise: bool | None = None) -> np.ndarray:
    # x[n, cols] @ W(rows, cols)^T -> y[n, rows]; rowwise: the decode kernels (True) or the
    # prefill ones (False) for any n; None (callers outside the model: benches, tests) picks
    # decode for one row, prefill for more
    rows, cols = w.shape
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
    assert x.ndim == 2 and x.shape[1] == cols, (x.shape, w.name, w.shape)
    n = x.shape[0]
    if out is None:
        out = np.empty((n, rows), dtype=np.float32)
    _check(w)
    if rowwise is None:
        rowwise = n <= 1
    if rowwise:
        _native.matmul_rows(x, n, cols, w.type.id, w.data, rows, out)
    else:
        _native.matmul(w.type.id, w.data, rows, cols, x, n, out)
    return out


def matmul_multi(x: np.ndarray, ws: list[QTensor], outs: list[np.ndarray] | None = None,
                 rowwise: bool | None = None) -> list[np.ndarray]:
    """[x @ W^T for W in ws] (1..4 weights with equal cols) in one native call: x is quantized
    once and all row tiles run as one pool job; each result equals matmul(x, W) bit for bit.
    outs: preallocated float32 [n, rows_j] results (the caller's reusable buffers); rowwise as
    as in matmul."""
    cols = ws[0].shape[1]
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
    assert x.ndim == 2 and x.shape[1] == cols and 1 <= len(ws) <= 4, (x.shape, [w.name for w in ws])
    n = x.shape[0]
    args, ys = [x, n, cols], []
    for w in ws:
        _check(w)
        assert w.shape[1] == cols, (w.name, w.shape, cols)
        y = np.empty((n, w.shape[0]), dtype=np.float32) if outs is None else outs[len(ys)]
        assert y.shape == (n, w.shape[0]) and y.dtype == np.float32 and y.flags.c_contiguous
        args += (w.type.id, w.data, w.shape[0], y)
        ys.append(y)
    dec = n <= 1 if rowwise is None else rowwise
    (_native.matmul_rows if dec else _native.matmul_multi)(*args)
    return ys


def matmul_heads(x: np.ndarray, w: QTensor, rowwise: bool | None = None,
                 out: np.ndarray | None = None) -> np.ndarray:
    """x[n, H, cols] -> y[n, H, rows] with y[:, h] = x[:, h] @ W[h]^T, w of numpy shape (H, rows,
    cols) (one matrix per head, consecutive: DeepSeek MLA's absorbed k_b / v_b). One native call,
    one pool job over the heads; head h equals matmul(x[:, h], W[h], rowwise=...) bit for bit
    (rowwise as in matmul)."""
    H, rows, cols = w.shape
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
    assert x.ndim == 3 and x.shape[1:] == (H, cols), (x.shape, w.name, w.shape)
    n = x.shape[0]
    if out is None:
        out = np.empty((n, H, rows), dtype=np.float32)
    assert out.shape == (n, H, rows) and out.dtype == np.float32 and out.flags.c_contiguous
    _check(w)
    dec = n <= 1 if rowwise is None else rowwise
    _native.matmul_heads(w.type.id, w.data, H, rows, cols, x, n, out, bool(dec))
    return out


def get_rows(w: QTensor, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    # W(vocab, dim)[ids] -> [n, dim] f32
    rows, cols = w.shape
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if out is None:
        out = np.empty((ids.size, cols), dtype=np.float32)
    _check(w)
    _native.get_rows(w.type.id, w.data, rows, cols, ids, out)
    return out


def dequantize(type_id: int, raw: np.ndarray, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """n elements of raw GGUF bytes as float32 (bit-exact with gguf.quants.dequantize)."""
    if type_id not in _BLOCK:
        raise UnsupportedError(f"type id {type_id} has no native dequantize")
    ensure_tables(type_id)
    if out is None:
        out = np.empty(n, dtype=np.float32)
    _native.dequantize(type_id, raw, n, out)
    return out


def set_threads(n: int) -> int:
    """Restart the kernel pool with n threads (n <= 0: physical cores); returns the count."""
    return _native.set_threads(n)


def get_threads() -> int:
    return _native.get_threads()


def isa() -> str:
    return _native.isa()


def _pick(name):
    return getattr(_native, name, None) or getattr(_ref, name)


rmsnorm = _pick("rmsnorm")
rope = _pick("rope")
softmax = _pick("softmax")
sigmoid = _pick("sigmoid")
silu_mul = _pick("silu_mul")
gelu_mul = _pick("gelu_mul")
swiglu_oai = _pick("swiglu_oai")
attention = _pick("attention")

# moe_ffn activations: 0 silu, 1 gelu (the bool of before: gelu or not), 2 swiglu_oai
MOE_ACTS = {"silu": 0, "gelu": 1, "swiglu_oai": 2}


def _moe_act(act) -> int:
    if isinstance(act, str):
        a = MOE_ACTS.get(act, -1)
    elif isinstance(act, (bool, np.bool_)):
        a = int(bool(act))
    else:
        a = int(act)
    if a not in (0, 1, 2):
        raise ValueError(f"moe_ffn: activation {act!r} is not one of {sorted(MOE_ACTS)} (0, 1, 2)")
    return a


if hasattr(_native, "moe_ffn"):
    def moe_ffn(x: np.ndarray, mats, off: np.ndarray, rows: np.ndarray, wts: np.ndarray,
                act, out: np.ndarray, rowwise: bool = False, biases=None) -> np.ndarray:
        """The routed experts of one layer in one native call (csrc/moe.c): for expert group g
        (mats[g] = its gate, up, down QTensors), rows[off[g]:off[g+1]] of x[n, n_embd] get
        out[row] += wts[i] * (down(act(gate x + bg, up x + bu)) + bd); groups in the order
        given; rowwise: the decode kernels (as matmul). act: 0 / 'silu', 1 / 'gelu', 2 /
        'swiglu_oai' (gpt-oss: alpha 1.702, limit 7.0); a bool reads as gelu or not (the
        argument of before). biases: None, or per group a (gate f32[n_ff] | None, up f32[n_ff]
        | None, down f32[n_embd] | None) triple (llama.cpp's ffn_*_exps.bias rows)."""
        g0, u0, d0 = mats[0]
        n_ff, n_embd = g0.shape
        assert x.dtype == np.float32 and x.flags.c_contiguous and out.shape == x.shape
        args = [x, x.shape[0], n_embd, n_ff, g0.type.id, u0.type.id, d0.type.id,
                [q.data for m in mats for q in m], off, rows, wts, _moe_act(act), out, bool(rowwise)]
        if biases is not None:
            assert len(biases) == len(mats), (len(biases), len(mats))
            args.append([None if b is None else np.ascontiguousarray(b, np.float32)
                         for trip in biases for b in trip])
        _native.moe_ffn(*args)
        return out


def attention_kvq(q, k, v, q_pos, kv_pos, scale, window=0, softcap=0.0, type_k=1, type_v=1,
                  table=None, out=None, q_tab=None, bs=32, sinks=None, dv=None):
    """ops.attention over K/V rows in KV cache types (csrc/kv_quant.c; see ops/__init__);
    sinks f32[Hq] enter after the keys, as in ggml's flash attention. v None: V inside K,
    each K row's first dv values (out's last dim when out is given)."""
    if out is None:
        out = np.empty((q.shape[0], q.shape[1], dv if v is None else _dv(v, type_v)), np.float32)
    q_pos = np.ascontiguousarray(q_pos, np.int32)
    if sinks is not None:
        sinks = np.ascontiguousarray(sinks, np.float32)
    if q_tab is not None:  # paged, the engine's addressing (kv/view.py)
        return _native.attention_paged_kvq(q, k, v, int(type_k), int(type_v), q_pos,
                                           np.ascontiguousarray(q_tab, np.int32),
                                           np.ascontiguousarray(table, np.int32), int(bs),
                                           float(scale), int(window), float(softcap), out, sinks)
    return _native.attention_kvq(q, k, v, q_pos, np.ascontiguousarray(kv_pos, np.int32),
                                 float(scale), int(window), float(softcap), int(type_k), int(type_v),
                                 None if table is None else np.ascontiguousarray(table, np.int32), out,
                                 sinks)


def _dv(v, t: int) -> int:
    from ..kv.quant import QK, is_block, row_bytes
    rb = v.shape[-1] * v.itemsize
    return rb // row_bytes(t, QK) * QK if is_block(t) else rb // row_bytes(t, 1)

# One decoder layer for one token (csrc/decode.c); models/layers.py uses it for decode.
decode_layer_new = _native.decode_layer_new
decode_layer_fields = _native.decode_layer_fields
decode_layer = _native.decode_layer
# A decoder layer with routed experts (+ the shared expert) for decode rows (csrc/decode.c).
moe_layer_new = _native.moe_layer_new
moe_layer_fields = _native.moe_layer_fields

# Batches of decode rows through one layer over a paged KV pool; attention and KV stores over
# such a pool (csrc/decode.c, csrc/bind_kv.c). kv/view.py BatchKV uses them.
# attention_paged(q, K, V, kv_type, q_pos, q_tab, tables, bs, scale, window, softcap, out,
#                 sinks=None); the fused decode layers have no sinks (a model with them attends
#                 through BatchKV.attend).
decode_batch = _native.decode_batch
# A MoE layer whose experts the store streams, in two calls: attention + routing (the chosen
# experts out), then the experts given one by one (csrc/decode.c; models/layers.py
# Model._streamed_moe).
decode_batch_route = _native.decode_batch_route
decode_batch_experts = _native.decode_batch_experts
# ... or, from the store's expert table (one buffer, offsets per expert), in one call when every
# chosen expert is at hand (decode_batch_moe -> False: routed only; then decode_batch_experts_at)
decode_batch_moe = _native.decode_batch_moe
decode_batch_experts_at = _native.decode_batch_experts_at
# ... in two pieces around the store's wait: the experts at hand while the misses load
decode_batch_experts_part = _native.decode_batch_experts_part
# the route call with models/lookahead.py's observe and predict on its state arrays
decode_batch_route_ahead = _native.decode_batch_route_ahead
attention_paged = _native.attention_paged
kv_store = _native.kv_store
