"""V inside K (MLA): deepseek2's cache stores only K = [latent C | rope R] per token and layer and
reads V as K's first C values, as llama.cpp does. The logits are the same bits as with K and V
stored apart (prefill, decode, the engine's cached / chunked / batched / preempted runs; numpy
and native backends, every ISA path, f32 / f16 / q8_0 / q4_0 caches), the pool costs (C + R) *
2 bytes per token and layer in f16, and the planner counts what the pool allocates."""

from __future__ import annotations

import numpy as np
import pytest

from memfit.errors import RequestError
from memfit.kv import KVPool
from memfit.kv import quant as kq
from memfit.kv.storage import BLOCK_SIZE, KVLayout, kv_bytes_per_token, kv_layout, kv_pool_blocks
from memfit.models import load_model
from memfit.models.config import ModelConfig
from memfit.models.synthetic import write_tiny_model
from memfit.ops import get_ops

IDS = np.array([5, 17, 200, 33, 290, 0, 64, 64, 128, 7, 255, 1, 9, 40, 41, 42, 43, 44, 45, 46,
                47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 3], dtype=np.int32)  # > 1 block
C, R = 256, 32   # the tiny writer's deepseek2 latent and rope dims (models/synthetic.py)


def _tiny(tmp_path, seed=3, rope64=False, **kw):
    # rope64: R = 64 as DeepSeek-V2/V3 (K rows of 320 rotate in chunks of 64 when quantized,
    # like their 576, so a V of its own rotates exactly like the V inside K)
    if rope64:
        kw.update(n_rot=64, head_dim_k=C + 64, head_dim_k_mla=64 + 64)
    return write_tiny_model(tmp_path / f"ds{seed}{rope64}.gguf", "deepseek2", "Q4_K", seed=seed,
                            **kw)


@pytest.fixture
def apart(monkeypatch):
    """A context in which MLA configs store V apart from K (the layout before V inside K)."""
    def off():
        monkeypatch.setattr(ModelConfig, "v_in_k", property(lambda self: False))
    return off


def _run(path, backend, cache_type, f32=False):
    m = load_model(path, ops=get_ops(backend))
    m.cache_type_k = m.cache_type_v = cache_type
    m.kv_f16 = not f32
    cache = m.new_cache(64)
    full = m.forward(IDS, cache, all_logits=True)
    steps = [m.forward([t], cache) for t in (7, 99, 250)]
    return full, np.stack(steps), cache.pool


# --- the layout -------------------------------------------------------------------------------

def test_layout_of_configs(tmp_path):
    path = _tiny(tmp_path)
    c = load_model(path, ops=get_ops("numpy")).config
    assert kv_layout(c) == KVLayout(3, 1, C + R, C, True)
    legacy = write_tiny_model(tmp_path / "legacy.gguf", "deepseek2", "Q4_K", seed=1,
                              head_dim_k_mla=0, head_dim_v_mla=0, head_dim_k=96, head_dim_v=64,
                              n_head_kv=4)
    assert not kv_layout(load_model(legacy, ops=get_ops("numpy")).config).v_in_k  # MHA: V apart
    llama = write_tiny_model(tmp_path / "llama.gguf", "llama", "Q4_K", seed=1)
    assert not kv_layout(load_model(llama, ops=get_ops("numpy")).config).v_in_k


def test_deepseek_v3_bytes_per_token():
    # 61 layers, one KV head of 512 + 64: 70,272 B per token in f16 (was 132,736 with V apart)
    v3 = KVLayout(61, 1, 576, 512, True)
    assert v3.bytes_per_token("f16") == 61 * 576 * 2 == 70272
    assert KVLayout(61, 1, 576, 512).bytes_per_token("f16") == 61 * (576 + 512) * 2 == 132736
    assert v3.bytes_per_token("q8_0") == 61 * 576 // 32 * 34
    assert v3.bytes_per_token("q8_0", "f16") == v3.bytes_per_token("q8_0")  # V costs nothing
    assert kv_bytes_per_token(61, 1, 576, 512, "f16", v_in_k=True) == 70272


@pytest.mark.parametrize("t", ["f16", "q8_0", "q4_0"])
def test_pool_holds_k_only_and_the_planner_counts_it(tmp_path, t):
    from memfit.engine.engine import Engine
    from memfit.gguf import open_gguf
    from memfit.memory.planner import ModelDesc, kv_bytes
    from memfit.tokenizer import Tokenizer
    path = _tiny(tmp_path)
    f = open_gguf(path)
    m = load_model(f, ops=get_ops("native"))
    n_ctx, n_par = 100, 3
    eng = Engine(m, Tokenizer.from_metadata(f.metadata), n_ctx, n_par, cache_type=t)
    pool = eng.pool
    assert pool.v_in_k and pool.v_blocks == [] and pool.v == []
    per_tok = 3 * kq.row_bytes(kq.cache_type(t), C + R)
    if t == "f16":
        assert per_tok == 3 * (C + R) * 2
    assert pool.storage.bytes_per_token == per_tok
    assert pool.nbytes == kv_pool_blocks(n_ctx, n_par) * BLOCK_SIZE * per_tok
    desc = ModelDesc.from_gguf(f)
    assert desc.v_in_k
    assert kv_bytes(desc, n_ctx, None, n_par, t, t) == pool.nbytes
    assert kv_bytes(desc, n_ctx, None, n_par, t, "f16") == pool.nbytes   # V has K's type
    assert eng.stats()["kv_v_in_k"] is True


def test_plan_and_load_agree(tmp_path):
    # `memfit plan`'s KV line is what the loaded engine's pool books in the ledger; a -ctv other
    # than -ctk does not apply (V is read from K) and says so
    import psutil

    from memfit.runtime import Runtime
    path = _tiny(tmp_path)
    # the budget's floor starts at this process's RSS (pytest's grows over the suite)
    budget = psutil.Process().memory_info().rss + (1 << 30)
    rt = Runtime(path, mem_budget=budget, n_ctx=256, n_parallel=2, cache_type_k="q8_0",
                 cache_type_v="f16")
    try:
        assert (rt.cache_type_k, rt.cache_type_v) == ("q8_0", "q8_0")
        assert any("reads V from the K cache" in n for n in rt.notes)
        p = rt.plan
        assert p.kv_v_in_k and p.to_json()["kv_v_in_k"] is True
        assert "K q8_0, V inside K" in p.format()
        assert p.kv_bytes == kv_pool_blocks(256, 2) * BLOCK_SIZE * 3 * (C + R) // 32 * 34
        rt.load()
        assert rt.engine.pool.v_in_k and rt.engine.pool.nbytes == p.kv_bytes
    finally:
        rt.close()


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


def test_pool_refusals():
    # V has K's type: a pool told otherwise refuses; a shape the rotation does not tile too
    with pytest.raises(RequestError, match="V inside K"):
        KVPool(2, 2, 1, 96, 64, "q8_0", cache_type_v="f16", v_in_k=True)
    with pytest.raises(RequestError, match="cannot keep V inside K"):
        KVPool(2, 2, 1, 512, 448, "q4_0", v_in_k=True)
    KVPool(2, 2, 1, 512, 448, "f16", v_in_k=True)


# --- the same bits as V stored apart ------------------------------------------------------------

@pytest.mark.parametrize("cache", ["f32", "f16"])
@pytest.mark.parametrize("backend", ["numpy", "native"])
def test_prefill_and_decode_same_bits(tmp_path, apart, isa, backend, cache):
    path = _tiny(tmp_path)
    f32 = cache == "f32"
    full, steps, pool = _run(path, backend, "f16", f32)
    assert pool.v_in_k and pool.v == []
    apart()
    full0, steps0, pool0 = _run(path, backend, "f16", f32)
    assert not pool0.v_in_k and pool0.nbytes > pool.nbytes
    np.testing.assert_array_equal(full, full0)
    np.testing.assert_array_equal(steps, steps0)


@pytest.mark.parametrize("cache", ["q8_0", "q4_0"])
@pytest.mark.parametrize("backend", ["numpy", "native"])
def test_quantized_same_bits(tmp_path, apart, isa, backend, cache):
    # K rows of 320 = 256 + 64 rotate in chunks of 64, a V of its own too: the V inside the
    # rotated, quantized K row is the same blocks as that V, so the same bits
    path = _tiny(tmp_path, rope64=True)
    full, steps, pool = _run(path, backend, cache)
    assert pool.v_in_k and kq.rot_sizes(pool.kv_type, pool.kv_type, 320, 256, True) == (64, 64)
    apart()
    full0, steps0, _ = _run(path, backend, cache)
    np.testing.assert_array_equal(full, full0)
    np.testing.assert_array_equal(steps, steps0)


@pytest.mark.parametrize("cache", ["q8_0", "q4_0"])
@pytest.mark.parametrize("backend", ["numpy", "native"])
def test_quantized_unrotated_k(tmp_path, backend, cache):
    # the tiny file's K rows of 288 are not rotated, so neither is the V inside them (a V of its
    # own would rotate in chunks of 64: other bits): as near the f16 cache's result as the V
    # apart is (correlation 0.9997 / 0.93 with numpy, 0.994 / 0.94 native on this file; its
    # random routers flip for some tokens under a 4-bit cache)
    path = _tiny(tmp_path)
    full, steps, pool = _run(path, backend, cache)
    f16, steps16, _ = _run(path, backend, "f16")
    assert pool.v_in_k and kq.rot_sizes(pool.kv_type, pool.kv_type, C + R, C, True) == (0, 0)
    lo = 0.99 if cache == "q8_0" else 0.85
    for a, b in ((full, f16), (steps, steps16)):
        assert np.corrcoef(a.ravel(), b.ravel())[0, 1] > lo


@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_engine_runs_same_bits(tmp_path, monkeypatch, kv):
    # tests/test_exact.py's battery (cached, chunked, batched, preempted) with V inside K, each
    # run the same bits as the prompts run alone with V stored apart
    import test_exact as te
    from memfit.gguf import open_gguf
    from memfit.tokenizer import Tokenizer
    path = _tiny(tmp_path, seed=31, rope64=kv != "f16")
    f = open_gguf(path)
    tok = Tokenizer.from_metadata(f.metadata)
    tok.eog_ids = set()
    model = load_model(f, ops=get_ops("native"))
    with monkeypatch.context() as mp:
        mp.setattr(ModelConfig, "v_in_k", property(lambda self: False))
        cold = [te._alone(model, tok, kv, p) for p in te.PROMPTS]
        assert not te._engine(model, tok, kv).pool.v_in_k
    assert te._engine(model, tok, kv).pool.v_in_k
    te._battery(model, tok, kv, cold, f"deepseek2 V inside K {kv}")


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


# --- sessions, rollback: no V rows to copy ----------------------------------------------------

def test_storage_without_v(tmp_path):
    from memfit import session as ss
    pool = KVPool(2, 3, 1, 96, 64, "q8_0", v_in_k=True)
    assert pool.v_in_k and pool.nbytes == 2 * 3 * BLOCK_SIZE * kq.row_bytes(kq.Q8_0, 96)
    rng = np.random.default_rng(0)
    for a in pool.k_blocks:
        a[...] = rng.integers(0, 255, a.shape, dtype=np.uint8)
    k, v = pool.storage.read_blocks([2, 0])
    assert [x.shape for x in v] == [(2 * BLOCK_SIZE, 1, 0)] * 2
    # a session file of them (no V bytes) reads back, and its rows write into another pool
    ident = {"file_size": 1, "header_sha256": "0" * 64, "arch": "deepseek2", "name": "x"}
    ids = list(range(2 * BLOCK_SIZE + 3))
    ss.save(tmp_path / "s.bin", ident, ss.SessionState(ids, k, v, "q8_0", "q8_0"))
    geo = {"n_layer": 2, "n_kv_head": 1, "row_bytes_k": kq.row_bytes(kq.Q8_0, 96), "row_bytes_v": 0}
    st = ss.load(tmp_path / "s.bin", ident, "q8_0", "q8_0", geo)
    other = KVPool(2, 3, 1, 96, 64, "q8_0", v_in_k=True)
    other.storage.write_block(1, [x[:BLOCK_SIZE] for x in st.k], [x[:BLOCK_SIZE] for x in st.v])
    for a, b in zip(other.k_blocks, pool.k_blocks):
        np.testing.assert_array_equal(a[1], b[2])
    # copy on write (rollback of a shared block) copies K rows only
    pool.storage.copy_rows(2, 1, 5)
    for a in pool.k_blocks:
        np.testing.assert_array_equal(a[1, :5], a[2, :5])


@pytest.mark.parametrize("ctype", ["f16", "q8_0"])
def test_session_restore_then_continue(tmp_path, ctype):
    # a saved deepseek2 session holds K rows only (row_bytes_v 0) and continues as the
    # uninterrupted run does
    import memfit
    path = _tiny(tmp_path, seed=5)
    kw = dict(n_ctx=256, cache_type_k=ctype, cache_type_v=ctype)
    prompt = [int(i) for i in IDS] + [11, 12, 13]
    greedy = dict(temperature=0.0)
    with memfit.load(path, **kw) as m:
        a1 = m.generate(prompt, max_tokens=6, **greedy)
        a2 = m.generate(a1.prompt_ids + a1.ids, max_tokens=6, **greedy)
    with memfit.load(path, **kw) as m:
        b1 = m.generate(prompt, max_tokens=6, **greedy)
        assert b1.ids == a1.ids and m._kv_geometry()["row_bytes_v"] == 0
        m.save_state(tmp_path / "s.mfs", b1.prompt_ids + b1.ids)
    with memfit.load(path, **kw) as m:
        ids, _ = m.load_state(tmp_path / "s.mfs")
        c2 = m.generate(ids, max_tokens=6, **greedy)
        assert c2.timings.cache_n == (len(ids) - 1) // 32 * 32 >= 32
    assert c2.ids == a2.ids
