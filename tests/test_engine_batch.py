"""The engine runs many sequences at once: batched greedy decoding gives every sequence the
tokens it gets alone (tiny models of every architecture, the two real models), a row's logits
do not depend on its neighbours, the Python API takes a list of prompts, and add_request /
step / abort / stats behave as documented."""

from __future__ import annotations

import numpy as np
import pytest

from memfit.engine.engine import Engine
from memfit.engine.sampler import SamplingParams
from memfit.models import load_model
from memfit.models.synthetic import write_tiny_model
from memfit.ops import get_ops
from memfit.tokenizer import Tokenizer
from memfit.quant.types import SUPPORTED_NAMES  # noqa: E402

ARCHS = ["llama", "qwen2", "qwen3", "gemma3"]
# different lengths; two cross a 32-token block boundary while decoding
PROMPTS = [[5, 17, 200], [33, 290, 0, 64, 64, 128, 7], list(range(40, 69)), [255],
           [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], list(range(100, 160)), [9, 9, 9, 9], [77, 66]]
N_GEN = 10


def _tiny(tmp_path, arch, qtype="Q4_K", **kw):
    from memfit.gguf import open_gguf
    kw = {"sliding_window": 4, **kw} if arch == "gemma3" else kw
    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, qtype, seed=11, **kw)
    f = open_gguf(path)
    return load_model(f, ops=get_ops("native")), Tokenizer.from_metadata(f.metadata)


def _run(model, tok, prompts, n_parallel, n_batch=512, **kw):
    eng = Engine(model, tok, n_ctx=128, n_parallel=n_parallel, n_batch=n_batch, **kw)
    p = SamplingParams(temperature=0, max_tokens=N_GEN)
    rids = [eng.add_request(ids, p) for ids in prompts]
    got = {r: [] for r in rids}
    while eng.has_unfinished():
        for o in eng.step():
            if o.token is not None:
                got[o.request_id].append(o.token)
    assert eng.pool.n_used == 0  # every block went back
    return [got[r] for r in rids], eng


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_equals_alone_tiny(tmp_path, arch):
    model, tok = _tiny(tmp_path, arch)
    tok.eog_ids = set()  # random weights: generate N_GEN tokens whatever they are
    alone = [_run(model, tok, [p], 1)[0][0] for p in PROMPTS]
    assert all(len(a) == N_GEN for a in alone)
    for n in (2, 4, 8):
        got, eng = _run(model, tok, PROMPTS[:n], n)
        assert got == alone[:n], n
        assert eng.stats()["running"] == 0


# prompts of any length: a burst of them is prefilled in shared forwards (the kernels keep each
# row independent of the others, tests/test_batch_invariance_kernels.py)
LONG = [list(range(3, 3 + 16)), list(range(50, 90)), [7, 8, 9] * 7, list(range(200, 233)),
        list(range(120, 137)), [11] * 18, [4, 5], [9]]


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_prefill_equals_alone_tiny(tmp_path, arch):
    from memfit.ops import native
    model, tok = _tiny(tmp_path, arch)
    tok.eog_ids = set()
    alone = [_run(model, tok, [p], 1)[0][0] for p in LONG]
    got, eng = _run(model, tok, LONG, len(LONG), n_batch=64)
    st = eng.stats()
    assert st["prefill_chunks"] > st["prefill_steps"]  # some steps carried several prompts
    assert got == alone
    assert native.BATCH_INVARIANT


def _first_logits(model, tok, prompts):
    """Logits of the first engine step over prompts (one packed prefill step when several)."""
    eng = Engine(model, tok, n_ctx=128, n_parallel=len(prompts))
    for ids in prompts:
        eng.add_request(ids, SamplingParams(temperature=0, max_tokens=4))
    sched = eng.scheduler.schedule()
    assert len(sched.seqs) == len(prompts) and not sched.decode
    return eng.runner.run(sched)


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_prefill_logits_bit_identical(tmp_path, arch):
    # several sequences' last prompt rows go through the last layer and the output matrix
    # together: rowwise kernels keep each row's logits those of the prompt alone
    model, tok = _tiny(tmp_path, arch)
    packed = _first_logits(model, tok, LONG)
    for i, p in enumerate(LONG):
        np.testing.assert_array_equal(packed[i], _first_logits(model, tok, [p])[0])


def test_row_logits_do_not_depend_on_neighbours(tmp_path):
    from memfit.kv import KVPool
    from memfit.kv.view import BatchKV
    from memfit.models.batch import Batch
    model, _ = _tiny(tmp_path, "qwen3", "Q8_0")
    c = model.config
    pool = KVPool(c.n_layer, 8, c.n_head_kv, c.head_dim_k, c.head_dim_v)
    ids = np.array([5, 17, 200, 33], np.int64)

    def fwd(rows):  # each row its own one-block sequence at position 0
        n = len(rows)
        pos = np.zeros(n, np.int32)
        tabs = np.array(rows, np.int32)
        kv = BatchKV(pool.k, pool.v, pool.kv_type, pos, tabs * 32, np.arange(n, dtype=np.int32),
                     tabs, 32)
        return model.forward(Batch(ids[:n], pos, np.arange(n, dtype=np.int32),
                                   np.arange(n), kv, decode=True))
    one = fwd([0])
    four = fwd([1, 2, 3, 4])
    np.testing.assert_array_equal(one[0], four[0])


def test_pool_blocks_freed_and_reused(tmp_path):
    model, tok = _tiny(tmp_path, "llama")
    tok.eog_ids = set()
    eng = Engine(model, tok, n_ctx=64, n_parallel=2)
    total = eng.pool.n_blocks
    assert total == 4 and eng.pool.nbytes == sum(a.nbytes for a in eng.pool.k + eng.pool.v)
    p = SamplingParams(temperature=0, max_tokens=20)
    for _ in range(3):  # more requests than the pool holds at once, one after another
        rids = [eng.add_request(list(range(3, 40)), p), eng.add_request([4, 5, 6], p)]
        while eng.has_unfinished():
            eng.step()
            assert eng.pool.n_used <= total
        assert eng.pool.n_used == 0
    assert len(eng.pool.k[0]) == total * 32  # never grew


def test_abort_frees_blocks(tmp_path):
    model, tok = _tiny(tmp_path, "llama")
    tok.eog_ids = set()
    eng = Engine(model, tok, n_ctx=64, n_parallel=2)
    rid = eng.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=30))
    eng.step()
    eng.step()
    assert eng.pool.n_used > 0
    eng.abort(rid)
    assert eng.pool.n_used == 0
    outs = eng.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [(rid, True, "abort")]
    assert not eng.has_unfinished()


def test_preemption_recomputes_and_matches(tmp_path):
    model, tok = _tiny(tmp_path, "llama")
    tok.eog_ids = set()
    alone = [_run(model, tok, [p], 1)[0][0] for p in PROMPTS[:4]]
    # 4 sequences share a pool too small for all of them to grow: some are preempted
    got, eng = _run(model, tok, PROMPTS[:4], 4, n_blocks=4)
    assert eng.stats()["preempted"] > 0
    assert got == alone


@pytest.mark.realmodel
@pytest.mark.parametrize("which", ["smollm2_path", "gemma_path"])
def test_batched_greedy_equals_alone_real(request, which):
    import memfit
    path = request.getfixturevalue(which)
    prompts = ["The capital of France is", "Once upon a time, there was a little",
               "1, 2, 3, 4,", "def fib(n):", "The quick brown fox", "In 1969, the first",
               "Water boils at", "My favourite colour is"]
    with memfit.load(path, n_ctx=256, n_parallel=8) as m:
        alone = [m.generate(p, max_tokens=8, temperature=0) for p in prompts]
        for n in (1, 2, 4, 8):
            batch = m.generate(prompts[:n], max_tokens=8, temperature=0)
            assert isinstance(batch, list) and len(batch) == n
            assert [b.ids for b in batch] == [a.ids for a in alone[:n]], n
            assert [b.text for b in batch] == [a.text for a in alone[:n]]
        single = m.generate(prompts[0], max_tokens=8, temperature=0)
        assert not isinstance(single, list) and single.ids == alone[0].ids


@pytest.mark.realmodel
@pytest.mark.parametrize("which", ["smollm2_path", "gemma_path"])
def test_packed_prefill_equals_alone_real(request, which):
    """Prompts of 16+ tokens arriving together share prefill forwards (the server's burst)
    and still get the tokens they get alone, whatever their neighbours."""
    import memfit
    path = request.getfixturevalue(which)
    topics = ["a robot who learns to paint", "the history of the printing press",
              "why the sky is blue at noon and red at dusk", "a recipe for bread with seeds",
              "the rules of chess for a beginner", "a lighthouse keeper and a storm"]
    prompts = [f"Write a short, careful paragraph for a curious reader about {t}, "
               f"in plain words and without lists:" for t in topics]
    with memfit.load(path, n_ctx=256, n_parallel=len(prompts)) as m:
        ids = [m.tokenizer.encode(p) for p in prompts]
        assert min(map(len, ids)) >= 16
        alone = [_run(m.model, m.tokenizer, [i], 1)[0][0] for i in ids]
        got, eng = _run(m.model, m.tokenizer, ids, len(ids))
        assert eng.stats()["prefill_chunks"] > eng.stats()["prefill_steps"]
        assert got == alone


TYPES = list(SUPPORTED_NAMES)


def _paged_steps(model, fused: bool, kv_type: str):
    """Three sequences (prefill 3, 9 and 40 tokens) in scattered blocks, then two decode steps
    of all three at once: logits per step and the pool."""
    from memfit.kv import KVPool
    from memfit.kv.view import BatchKV
    from memfit.models.batch import Batch
    c = model.config
    model._fused = None if fused else []
    pool = KVPool(c.n_layer, 8, c.n_head_kv, c.head_dim_k, c.head_dim_v, kv_type)
    tabs = [[5], [2], [7, 0]]
    prompts = [[5, 17, 200], [33, 290, 0, 64, 64, 128, 7, 1, 2], list(range(60, 100))]
    flat = np.array(sum(tabs, []), np.int32)
    offs = [0, 1, 2]

    def batch(rows, decode):  # rows: [(seq, position, token)]
        pos = np.array([p for _, p, _ in rows], np.int32)
        s = np.array([q for q, _, _ in rows], np.int32)
        slots = np.array([tabs[q][p // 32] * 32 + p % 32 for q, p, _ in rows], np.int32)
        kv = BatchKV(pool.k, pool.v, pool.kv_type, pos, slots, np.array([offs[q] for q in s], np.int32),
                     flat, 32)
        out = np.arange(len(rows)) if decode else np.array([len(rows) - 1])
        return model.forward(Batch(np.array([t for _, _, t in rows], np.int64), pos, s, out, kv,
                                   decode=decode))
    for q, ids in enumerate(prompts):
        batch([(q, p, t) for p, t in enumerate(ids)], False)
    steps = []
    for step in range(2):
        steps.append(batch([(q, len(ids) + step, 11 + q + step) for q, ids in enumerate(prompts)],
                           True))
    return np.stack(steps), pool


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_batched_decode_equals_blocks(tmp_path, arch, qtype):
    # the native batched decode layer over paged KV against the op-by-op block, bit for bit
    kw = {"sliding_window": 4} if arch == "gemma3" else {}
    path = write_tiny_model(tmp_path / f"{arch}-{qtype}.gguf", arch, qtype, seed=3, **kw)
    model = load_model(path, ops=get_ops("native"))
    kv = "f16" if qtype in ("Q4_K", "F16", "Q8_0", "Q4_0") else "f32"
    a, pa = _paged_steps(model, True, kv)
    assert model._decode_layers() is not None
    b, pb = _paged_steps(model, False, kv)
    assert np.isfinite(a).all()
    np.testing.assert_array_equal(a, b)
    for il in range(len(pa.k)):
        np.testing.assert_array_equal(pa.k[il], pb.k[il])
        np.testing.assert_array_equal(pa.v[il], pb.v[il])


def test_mixed_prefill_and_decode_rows_in_one_forward(tmp_path):
    # the contract lets one forward carry a prefill chunk of one sequence and decode rows of
    # others; each sequence's logits match its own forward (within the tiled kernels' order)
    from memfit.kv import KVPool
    from memfit.kv.view import BatchKV
    from memfit.models.batch import Batch
    model, _ = _tiny(tmp_path, "qwen2", "Q8_0")
    c = model.config

    def run(groups):  # groups: [[(seq, pos, tok), ...], ...] forwarded one group per call
        pool = KVPool(c.n_layer, 6, c.n_head_kv, c.head_dim_k, c.head_dim_v, "f32")
        tabs = np.array([0, 1, 2, 3, 4, 5], np.int32)  # seq s owns blocks 2s, 2s + 1
        outs = {}
        for rows in groups:
            pos = np.array([p for _, p, _ in rows], np.int32)
            s = np.array([q for q, _, _ in rows], np.int32)
            kv = BatchKV(pool.k, pool.v, pool.kv_type, pos, (2 * s + pos // 32) * 32 + pos % 32,
                         2 * s, tabs, 32)
            # logits for the last row of each sequence in the group
            last = [i for i in range(len(rows)) if i == len(rows) - 1 or rows[i + 1][0] != rows[i][0]]
            lg = model.forward(Batch(np.array([t for _, _, t in rows], np.int64), pos, s,
                                     np.array(last), kv))
            for j, i in enumerate(last):
                outs.setdefault(rows[i][0], []).append(lg[j])
        return outs
    a = [(0, p, 3 + p) for p in range(20)]
    b = [(1, p, 7 + p) for p in range(5)]
    c2 = [(2, p, 50 + p) for p in range(40)]
    sep = run([a, b, c2, [(0, 20, 9)], [(1, 5, 8)], [(2, 40, 4)]])
    mixed = run([a, b, c2[:30], [(0, 20, 9), (1, 5, 8)] + c2[30:], [(2, 40, 4)]])
    for q in (0, 1, 2):
        np.testing.assert_allclose(mixed[q][-1], sep[q][-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("isa", ["scalar", "avx2"])
def test_fused_batched_decode_isa_and_threads(tmp_path, isa):
    # the scalar kernels too; and the result does not depend on the thread count
    from memfit import _native
    if isa == "avx2" and _native.isa_hw() == "scalar":
        pytest.skip("no AVX2")
    path = write_tiny_model(tmp_path / "m.gguf", "gemma3", "Q4_K", seed=8, sliding_window=5)
    model = load_model(path, ops=get_ops("native"))
    before, threads = _native.isa(), _native.get_threads()
    _native.set_isa(isa)
    try:
        a, _ = _paged_steps(model, True, "f16")
        b, _ = _paged_steps(model, False, "f16")
        _native.set_threads(1)
        c, _ = _paged_steps(model, True, "f16")
    finally:
        _native.set_isa(before)
        _native.set_threads(threads)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)


def test_request_larger_than_the_pool_is_refused(tmp_path):
    from memfit.errors import RequestError
    model, tok = _tiny(tmp_path, "llama")
    eng = Engine(model, tok, n_ctx=128, n_blocks=2)
    with pytest.raises(RequestError, match="KV pool"):
        eng.add_request(list(range(1, 40)), SamplingParams(temperature=0, max_tokens=40))
    with pytest.raises(RequestError, match="context"):
        eng.add_request(list(range(1, 200)), SamplingParams(temperature=0))
    tok.eog_ids = set()
    eng.add_request(list(range(1, 40)), SamplingParams(temperature=0, max_tokens=20))
    n = 0
    while eng.has_unfinished():
        n += sum(o.token is not None for o in eng.step())
    assert n == 20 and eng.pool.n_used == 0
