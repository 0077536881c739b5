"""V inside K (MLA's cache): the paged attention kernels and the quantized-cache attention read
V as each K row's first Dv values when V is None, the same bits as a V pool of those values;
so do the numpy references. A quantized K keeps V inside it only where its rotation chunks
tile V."""

from __future__ import annotations

import numpy as np
import pytest

from memfit.errors import RequestError
from memfit.kv import quant as kq
from memfit.kv.storage import BLOCK_SIZE


def test_rotation_of_v_inside_k():
    # a quantized K whose rotation chunks V's values do not fill cannot hold V: one line, a fix
    with pytest.raises(RequestError, match="cannot keep V inside K.*use -ctk f16"):
        kq.check_v_in_k(kq.Q8_0, 512, 448)      # 512 rotates in one chunk of 512
    kq.check_v_in_k(kq.Q8_0, 576, 512)          # DeepSeek: chunks of 64
    kq.check_v_in_k(kq.Q4_0, 288, 256)          # the tiny file: 288 is not rotated
    kq.check_v_in_k(kq.F16, 512, 448)
    with pytest.raises(RequestError, match="multiple of 32"):
        kq.check_v_in_k(kq.Q8_0, 288, 240)
    assert kq.rot_sizes(kq.Q8_0, kq.Q8_0, 576, 512, True) == (64, 64)
    assert kq.rot_sizes(kq.Q8_0, kq.Q8_0, 288, 256, True) == (0, 0)
    assert kq.rot_sizes(kq.Q8_0, kq.Q8_0, 288, 256, False) == (0, 64)


# --- kernels: V None reads K's first Dv values ---------------------------------------------------

def _paged_case(rng, hkv, d, dv, n=5, n_blocks=4):
    bs = BLOCK_SIZE
    rows = n_blocks * bs
    k = rng.standard_normal((rows, hkv, d)).astype(np.float32)
    q = rng.standard_normal((n, 2 * hkv, d)).astype(np.float32)
    tables = np.array([2, 0, 3, 1], np.int32)
    q_pos = np.array([0, 5, 40, 77, 100], np.int32)[:n]
    q_tab = np.zeros(n, np.int32)
    return k, q, tables, q_pos, q_tab


@pytest.mark.parametrize("window,sinks", [(0, False), (16, True)])
@pytest.mark.parametrize("kv_type", [0, 1])
@pytest.mark.parametrize("hkv", [1, 2])
def test_attention_paged_v_none(isa, hkv, kv_type, window, sinks):
    from memfit.ops import native
    rng = np.random.default_rng(hkv * 10 + kv_type)
    d, dv = 96, 64
    k, q, tables, q_pos, q_tab = _paged_case(rng, hkv, d, dv)
    K = k.astype(np.float16) if kv_type == 1 else k
    V = np.ascontiguousarray(K[..., :dv])
    kw = {"sinks": rng.standard_normal(q.shape[1]).astype(np.float32)} if sinks else {}
    outs = []
    for v in (V, None):
        out = np.empty((q.shape[0], q.shape[1], dv), np.float32)
        native.attention_paged(q.copy(), K, v, kv_type, q_pos, q_tab, tables, BLOCK_SIZE, 0.1,
                               window, 0.0, out, **kw)
        outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="V inside K"):
        native.attention_paged(q.copy(), K, None, kv_type, q_pos, q_tab, tables, BLOCK_SIZE, 0.1,
                               0, 0.0, np.empty((q.shape[0], q.shape[1], d + 8), np.float32))


@pytest.mark.parametrize("t", [kq.F16, kq.Q8_0, kq.Q4_0])
@pytest.mark.parametrize("hkv", [1, 2])
def test_attention_kvq_v_none(isa, hkv, t):
    # native (paged and contiguous) and the numpy reference: V None == V as a pool of the K
    # rows' first Dv values (whole blocks), bit for bit
    from memfit.ops import native, reference
    rng = np.random.default_rng(7 + t + hkv)
    d, dv = 96, 64
    k, q, tables, q_pos, q_tab = _paged_case(rng, hkv, d, dv)
    raw = kq.quantize_ref(t, k)                                      # [rows, Hkv, rb_k]
    vraw = np.ascontiguousarray(raw[..., :kq.row_bytes(t, dv)])
    sinks = rng.standard_normal(q.shape[1]).astype(np.float32)
    for ops in (native, reference):
        a = ops.attention_kvq(q, raw, vraw, q_pos, None, 0.1, 0, 0.0, t, t, table=tables,
                              q_tab=q_tab, bs=BLOCK_SIZE, sinks=sinks)
        b = ops.attention_kvq(q, raw, None, q_pos, None, 0.1, 0, 0.0, t, t, table=tables,
                              q_tab=q_tab, bs=BLOCK_SIZE, sinks=sinks, dv=dv)
        np.testing.assert_array_equal(a, b)
        # contiguous: keys 0..T-1 in rows 0..T-1
        T = 50
        kv_pos = np.arange(T, dtype=np.int32)
        a = ops.attention_kvq(q, raw[:T], vraw[:T], q_pos, kv_pos, 0.1, 0, 0.0, t, t)
        b = ops.attention_kvq(q, raw[:T], None, q_pos, kv_pos, 0.1, 0, 0.0, t, t, dv=dv)
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="V inside K"):
        native.attention_kvq(q, raw, None, q_pos, None, 0.1, 0, 0.0, t,
                             kq.Q8_0 if t != kq.Q8_0 else kq.Q4_0, table=tables, q_tab=q_tab,
                             bs=BLOCK_SIZE, dv=dv)
