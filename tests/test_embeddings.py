"""Embeddings: `Model.embed` against a float64 recomputation on a tiny synthetic model, and
POST /v1/embeddings of a running `memfit serve` through the official openai client (SmolLM2)."""

from __future__ import annotations

import base64
import math
import threading

import httpx
import numpy as np
import pytest

from memfit.api import Model
from memfit.errors import RequestError
from memfit.kv.seq import SeqKV
from memfit.models import layers
from memfit.models.synthetic import write_tiny_model

from _server import ServerProcess
from test_models_synthetic import _rms, _rope, _weights

N_EMBD = 256
CFG = dict(n_embd=N_EMBD, n_layer=2, n_head=4, n_head_kv=2, head_dim=64, n_ff=512,
           rope_base=10000.0)
IDS = [5, 17, 200, 33, 290, 0, 64, 64, 128, 7, 255, 1, 99, 3, 42, 42, 180, 11, 260, 8, 77]


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x)


def reference_hidden(path, ids, cfg) -> np.ndarray:
    """Final-normed hidden states [n, n_embd] of a tiny llama in float64, written out plainly."""
    W = _weights(path)
    H, Hkv, D = cfg["n_head"], cfg["n_head_kv"], cfg["head_dim"]
    n = len(ids)
    pos = np.arange(n, dtype=np.float64)
    x = W["token_embd.weight"][ids]
    for il in range(cfg["n_layer"]):
        p = f"blk.{il}."
        h = _rms(x, W[p + "attn_norm.weight"])
        q = (h @ W[p + "attn_q.weight"].T).reshape(n, H, D)
        k = (h @ W[p + "attn_k.weight"].T).reshape(n, Hkv, D)
        v = (h @ W[p + "attn_v.weight"].T).reshape(n, Hkv, D)
        q = _rope(q, pos, cfg["rope_base"], 1.0, False)
        k = _rope(k, pos, cfg["rope_base"], 1.0, False)
        o = np.zeros((n, H, D))
        causal = np.triu(np.ones((n, n), bool), 1)
        for hh in range(H):
            kv = hh // (H // Hkv)
            s = np.where(causal, -np.inf, q[:, hh] @ k[:, kv].T / math.sqrt(D))
            s = np.exp(s - s.max(-1, keepdims=True))
            o[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + o.reshape(n, H * D) @ W[p + "attn_output.weight"].T
        h = _rms(x, W[p + "ffn_norm.weight"])
        g, u = h @ W[p + "ffn_gate.weight"].T, h @ W[p + "ffn_up.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ W[p + "ffn_down.weight"].T
    return _rms(x, W["output_norm.weight"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("emb") / "m.gguf", "llama", "F32", seed=7,
                            **CFG)
    # exact float math: an f32 KV cache instead of llama.cpp's f16 one (whose flash attention
    # also rounds Q and the V accumulator to f16), as test_models_synthetic's checks do
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layers.Model, "kv_f16", False)   # read when the engine's pool is made
        m = Model(path, n_ctx=64)
    m.model.kv_f16 = False
    assert m.engine.pool.kv_type == 0               # f32
    yield m, path
    m.close()


def test_embed_matches_float64_recomputation(tiny):
    m, path = tiny
    h = reference_hidden(path, np.array(IDS), CFG)
    want = {"mean": _unit(h.mean(axis=0)), "cls": _unit(h[0]), "last": _unit(h[-1])}
    for pooling, ref in want.items():
        got = m.embed([IDS], pooling=pooling)
        assert got.shape == (1, N_EMBD) and got.dtype == np.float32
        assert np.abs(got[0] - ref).max() <= 1e-5, (pooling, np.abs(got[0] - ref).max())
        assert abs(np.linalg.norm(got[0].astype(np.float64)) - 1) < 1e-6
    raw = m.embed(IDS, pooling="mean", normalize=False)[0]   # a flat id list is one input
    assert np.abs(raw - h.mean(axis=0)).max() <= 1e-5 * np.abs(h).max()


def test_embed_pools_teacher_forced_hidden_states_in_pieces(tiny):
    """The pieces of n_batch rows give what one forward over the whole sequence gives."""
    m, _ = tiny
    with SeqKV(m.engine.pool, len(IDS)) as cache:   # all rows at once, teacher forced
        h = m.model.forward(np.array(IDS), cache, hidden_from=0).astype(np.float64)
    whole = m.embed([IDS])[0]
    n_batch = m.n_batch
    m.n_batch = 4                                    # 21 tokens in 6 pieces
    try:
        pieces = {p: m.embed([IDS], pooling=p)[0] for p in ("mean", "cls", "last")}
    finally:
        m.n_batch = n_batch
    np.testing.assert_allclose(pieces["mean"], _unit(h.mean(axis=0)), rtol=0, atol=1e-6)
    np.testing.assert_allclose(pieces["cls"], _unit(h[0]), rtol=0, atol=1e-6)
    np.testing.assert_allclose(pieces["last"], _unit(h[-1]), rtol=0, atol=1e-6)
    np.testing.assert_allclose(whole, pieces["mean"], rtol=0, atol=1e-6)


def test_embed_inputs_and_errors(tiny):
    m, _ = tiny
    text = m.embed(["hello world", "the cat"])
    assert text.shape == (2, N_EMBD)
    ids = m.tokenize("hello world")
    assert np.array_equal(m.embed([ids])[0], text[0])
    assert np.array_equal(m.embed("hello world")[0], text[0])
    assert m.default_pooling() == "mean"
    with pytest.raises(RequestError, match="pooling 'max'"):
        m.embed("x", pooling="max")
    with pytest.raises(RequestError, match="input 1 is empty"):
        m.embed(["x", ""])
    with pytest.raises(RequestError, match="context is 64"):
        m.embed([list(range(65))])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        m.embed([[1, 10**6]])
    with pytest.raises(RequestError):
        m.embed([])


def test_default_pooling_from_gguf(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "llama", "F32", seed=3,
                            metadata={"llama.pooling_type": 3}, **CFG)
    with Model(path, n_ctx=32) as m:
        assert m.default_pooling() == "last"
        assert np.array_equal(m.embed("the cat"), m.embed("the cat", pooling="last"))


# ----------------------------------------------------------------------------- server

import openai  # noqa: E402  (the test extra)

SIMILAR = ["The cat sat on the mat.", "A cat is sitting on a mat."]
UNRELATED = "Quarterly revenue grew by four percent in the third quarter."


@pytest.fixture(scope="module")
def server(smollm2_path):
    s = ServerProcess([str(smollm2_path), "--alias", "smollm2", "-c", "512", "-np", "2"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def _vecs(resp) -> np.ndarray:
    assert [d.index for d in resp.data] == list(range(len(resp.data)))
    return np.array([d.embedding for d in resp.data], np.float64)


def _n_tokens(server, text: str) -> int:
    r = httpx.post(server.url + "/tokenize", json={"content": text, "add_special": True})
    return len(r.json()["tokens"])


@pytest.mark.realmodel
@pytest.mark.slow
@pytest.mark.timeout(300)
class TestServer:
    def test_shape_norm_usage(self, client, server):
        r = client.embeddings.create(model="smollm2", input=SIMILAR + [UNRELATED],
                                     encoding_format="float")
        v = _vecs(r)
        assert v.shape == (3, 576)
        np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
        assert r.model == "smollm2" and r.object == "list"
        n = sum(_n_tokens(server, t) for t in SIMILAR + [UNRELATED])
        assert r.usage.prompt_tokens == r.usage.total_tokens == n

    def test_same_text_identical_and_similar_closer(self, client):
        v = _vecs(client.embeddings.create(model="smollm2", encoding_format="float",
                                           input=[SIMILAR[0], SIMILAR[1], UNRELATED, SIMILAR[0]]))
        assert np.array_equal(v[0], v[3])
        again = _vecs(client.embeddings.create(model="smollm2", input=SIMILAR[0],
                                               encoding_format="float"))
        assert np.array_equal(again[0], v[0])
        close, far = v[0] @ v[1], v[0] @ v[2]
        assert close > far + 0.1, (close, far)

    def test_batch_equals_one_by_one(self, client):
        texts = SIMILAR + [UNRELATED, "hello"]
        batch = _vecs(client.embeddings.create(model="smollm2", input=texts,
                                               encoding_format="float"))
        one = np.concatenate([_vecs(client.embeddings.create(model="smollm2", input=t,
                                                             encoding_format="float"))
                              for t in texts])
        assert np.array_equal(batch, one)

    def test_base64_and_token_ids(self, client, server):
        floats = _vecs(client.embeddings.create(model="smollm2", input=SIMILAR,
                                                encoding_format="float"))
        r = httpx.post(server.base_url + "/embeddings", timeout=60,
                       json={"input": SIMILAR, "encoding_format": "base64"}).json()
        decoded = np.array([np.frombuffer(base64.b64decode(d["embedding"]), "<f4")
                            for d in r["data"]], np.float64)
        assert np.array_equal(decoded, floats)
        # the client's default (base64 on the wire, decoded by the client) is the same
        assert np.array_equal(_vecs(client.embeddings.create(model="smollm2", input=SIMILAR)),
                              floats)
        ids = [httpx.post(server.url + "/tokenize", json={"content": t, "add_special": True})
               .json()["tokens"] for t in SIMILAR]
        assert np.array_equal(_vecs(client.embeddings.create(model="smollm2", input=ids,
                                                             encoding_format="float")), floats)
        one = _vecs(client.embeddings.create(model="smollm2", input=ids[0],
                                             encoding_format="float"))
        assert np.array_equal(one[0], floats[0])

    def test_equals_python_api(self, client, smollm2_path):
        v = _vecs(client.embeddings.create(model="smollm2", input=SIMILAR,
                                           encoding_format="float"))
        with Model(smollm2_path, n_ctx=512) as m:
            np.testing.assert_allclose(m.embed(SIMILAR), v, rtol=0, atol=1e-6)

    def test_while_decoding(self, client):
        """Embeddings run on the engine thread between decode steps: same vectors while a
        long answer streams, and the answer completes."""
        before = _vecs(client.embeddings.create(model="smollm2", input=SIMILAR,
                                                encoding_format="float"))
        out = {}

        def chat():
            s = client.chat.completions.create(
                model="smollm2", max_tokens=120, temperature=0, stream=True,
                messages=[{"role": "user", "content": "Write a long story about a ship."}])
            out["text"] = "".join(c.choices[0].delta.content or "" for c in s if c.choices)

        t = threading.Thread(target=chat)
        t.start()
        during = [_vecs(client.embeddings.create(model="smollm2", input=SIMILAR,
                                                 encoding_format="float")) for _ in range(3)]
        t.join(120)
        assert len(out.get("text", "")) > 0
        for d in during:
            assert np.array_equal(d, before)

    @pytest.mark.parametrize("body,status,param", [
        ({"input": "hi", "dimensions": 64}, 400, "dimensions"),
        ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": ""}, 400, "input"),
        ({}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": [1, "a"]}, 400, "input"),
        ({"input": [[1, 2], [3, 10**7]]}, 400, "input"),
        ({"input": "hi", "model": "nope"}, 404, "model"),
        ({"input": "word " * 2000}, 400, "input"),
        ({"input": [list(range(513))]}, 400, "input"),
    ])
    def test_errors(self, server, body, status, param):
        r = httpx.post(server.base_url + "/embeddings", json=body, timeout=60)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["message"]
        if body.get("input") in ("word " * 2000, [list(range(513))]):
            assert err["code"] == "context_length_exceeded" and "context is 512" in err["message"]

    def test_whole_context(self, client):
        """An input may fill the context (nothing is generated after it)."""
        r = client.embeddings.create(model="smollm2", input=[list(range(512))])
        assert r.usage.prompt_tokens == 512 and len(r.data[0].embedding) == 576

    def test_openai_client_error(self, client):
        with pytest.raises(openai.BadRequestError, match="dimensions"):
            client.embeddings.create(model="smollm2", input="hi", dimensions=8)


@pytest.mark.realmodel
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pooling_and_prompt_cap_flags(smollm2_path):
    s = ServerProcess([str(smollm2_path), "-c", "256", "-np", "1", "--pooling", "last",
                       "--max-prompt-tokens", "16"])
    try:
        c = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120)
        name = c.models.list().data[0].id
        v = _vecs(c.embeddings.create(model=name, input=SIMILAR, encoding_format="float"))
        assert len(c.embeddings.create(model=name, input=[list(range(16))]).data) == 1
        with pytest.raises(openai.BadRequestError, match="max-prompt-tokens"):
            c.embeddings.create(model=name, input=[list(range(17))])
    finally:
        s.stop()
    with Model(smollm2_path, n_ctx=256) as m:
        np.testing.assert_allclose(m.embed(SIMILAR, pooling="last"), v, rtol=0, atol=1e-6)
        assert not np.allclose(m.embed(SIMILAR, pooling="mean"), v, atol=1e-3)


@pytest.mark.realmodel
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_under_a_budget_near_the_floor(smollm2_path):
    """Through the weight store at a budget near the floor (weights streamed from the file):
    the same vectors as a resident model, peak RSS (VmHWM) under the budget, and an oversized
    input refused from its first pieces."""
    from test_server_budget_prompts import _floor_mib, _status
    args = [str(smollm2_path), "-c", "1024", "-np", "1"]
    budget = (_floor_mib(args) + 2) << 20
    s = ServerProcess(["--mem-budget", str(budget), *args])
    texts = [SIMILAR[0], UNRELATED, " ".join(["lighthouse keeper"] * 500)]  # the last ~1000 tokens
    try:
        c = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=300)
        name = c.models.list().data[0].id
        r = c.embeddings.create(model=name, input=texts, encoding_format="float")
        assert r.usage.prompt_tokens > 1000
        with pytest.raises(openai.BadRequestError, match="context is 1024"):
            c.embeddings.create(model=name, input="lighthouse " * 90_000)
        assert _status(s.proc.pid)["VmHWM"] <= budget
        streamed = s.metrics()["memfit_weight_store_bytes_read"]
        assert streamed > 0
    finally:
        s.stop()
    with Model(smollm2_path, n_ctx=1024) as m:
        np.testing.assert_allclose(m.embed(texts), _vecs(r), rtol=0, atol=1e-6)
