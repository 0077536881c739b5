"""`memfit serve` through the official openai client: chat, streamed chat with usage,
completions with logprobs, models.list, and greedy text equal to `memfit run`'s."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from _server import ServerProcess, run_cli

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.realmodel, pytest.mark.slow, pytest.mark.timeout(300)]

QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def server(smollm2_path):
    s = ServerProcess([str(smollm2_path), "--alias", "smollm2", "-c", "1024", "-np", "4",
                       "--cors-origin", "http://app.example"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def test_models_list(client):
    ids = [m.id for m in client.models.list()]
    assert ids == ["smollm2"]


def test_chat_greedy_equals_memfit_run(client, smollm2_path):
    r = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=24,
                                       messages=[{"role": "user", "content": QUESTION}])
    cli = run_cli(["run", str(smollm2_path), "-p", QUESTION, "--chat", "--temp", "0", "-n", "24",
                   "--json"])
    assert cli.returncode == 0, cli.stderr
    ref = json.loads(cli.stdout)
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert c.message.content == ref["text"]
    assert c.finish_reason == ("length" if ref["finish_reason"] == "length" else "stop")
    assert r.usage.prompt_tokens == len(ref["prompt_ids"])
    assert r.usage.completion_tokens == len(ref["ids"])
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.object == "chat.completion" and r.model == "smollm2"


def test_chat_stream_with_usage_equals_plain(client):
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours."}]
    plain = client.chat.completions.create(model="smollm2", messages=msgs, temperature=0,
                                           max_tokens=20)
    chunks = list(client.chat.completions.create(model="smollm2", messages=msgs, temperature=0,
                                                 max_tokens=20, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_logprobs(client):
    r = client.completions.create(model="smollm2", prompt="The capital of France is",
                                  max_tokens=8, temperature=0, logprobs=3)
    c = r.choices[0]
    lp = c.logprobs
    assert "".join(lp.tokens) == c.text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for tok, x, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and x <= 0
        best = max(top.values())
        assert math.isclose(x, best, abs_tol=1e-6), (tok, x, top)  # greedy: the best token
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-6
    assert r.usage.completion_tokens == 8 and c.finish_reason == "length"


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=6,
                                       messages=[{"role": "user", "content": "Say hi."}],
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert math.isclose(t.logprob, t.top_logprobs[0].logprob, abs_tol=1e-6)
        assert bytes(t.bytes).decode("utf-8", errors="replace") == t.token


def test_completion_token_ids_and_echo(client, server):
    text = "Once upon a time"
    ids = httpx.post(server.url + "/tokenize", json={"content": text, "add_special": True}
                     ).json()["tokens"]
    a = client.completions.create(model="smollm2", prompt=text, max_tokens=10, temperature=0)
    b = client.completions.create(model="smollm2", prompt=ids, max_tokens=10, temperature=0)
    e = client.completions.create(model="smollm2", prompt=text, max_tokens=10, temperature=0,
                                  echo=True)
    assert a.choices[0].text == b.choices[0].text
    assert e.choices[0].text == text + a.choices[0].text


def test_stop_and_seed(client):
    base = client.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=12,
                                     temperature=0)
    t = base.choices[0].text
    assert " 6" in t
    s = client.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=12,
                                  temperature=0, stop=[" 6"])
    assert s.choices[0].text == t[:t.index(" 6")] and s.choices[0].finish_reason == "stop"
    kw = dict(model="smollm2", prompt="My favourite animal is", max_tokens=12, temperature=1.0,
              seed=1234)
    assert client.completions.create(**kw).choices[0].text == \
        client.completions.create(**kw).choices[0].text


def test_tokenize_detokenize_health_metrics(server):
    r = httpx.post(server.url + "/tokenize", json={"content": "Hello world", "with_pieces": True})
    toks = r.json()["tokens"]
    assert "".join(t["piece"] for t in toks) == "Hello world"
    d = httpx.post(server.url + "/detokenize", json={"tokens": [t["id"] for t in toks]})
    assert d.json() == {"content": "Hello world"}
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    m = server.metrics()
    assert m['memfit_requests_total{endpoint="chat",status="200"}'] >= 1
    assert m["memfit_generated_tokens_total"] > 0 and m["memfit_prompt_tokens_total"] > 0
    assert m["memfit_time_to_first_token_seconds_count"] >= 1
    assert m["memfit_rss_bytes"] > 0 and m["memfit_requests_running"] == 0


def test_shared_system_prompt_is_prefilled_once(client, server):
    system = ("You are a careful assistant. Answer in plain words, keep every answer short, "
              "never invent facts, and say so when you do not know something. ") * 2
    before = server.metrics()
    rs = [client.chat.completions.create(model="smollm2", temperature=0, max_tokens=2,
                                         messages=[{"role": "system", "content": system},
                                                   {"role": "user", "content": q}])
          for q in ["Hi.", "What is 1+1?"]]
    assert rs[0].usage.prompt_tokens_details.cached_tokens in (0, rs[1].usage
                                                               .prompt_tokens_details.cached_tokens)
    cached = rs[1].usage.prompt_tokens_details.cached_tokens
    assert cached >= 32 and cached % 32 == 0 and cached < rs[1].usage.prompt_tokens
    after = server.metrics()
    assert after["memfit_prompt_tokens_cached_total"] - before["memfit_prompt_tokens_cached_total"] \
        >= cached
    assert after["memfit_prefix_cache_hits_tokens"] > before["memfit_prefix_cache_hits_tokens"]
    assert after["memfit_kv_blocks_cached"] >= cached // 32


def test_cors_only_for_given_origins(server):
    pre = {"Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(server.base_url + "/chat/completions",
                      headers={"Origin": "http://app.example", **pre})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
    r = httpx.options(server.base_url + "/chat/completions",
                      headers={"Origin": "http://evil.example", **pre})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(server.base_url + "/models", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers


def test_streamed_logprobs_and_stop(client):
    kw = dict(model="smollm2", temperature=0, max_tokens=12, logprobs=True, top_logprobs=1,
              messages=[{"role": "user", "content": "Count from one to ten in words."}])
    plain = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    toks = [t for c in chunks if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.content]
    assert [t.token for t in toks] == [t.token for t in plain.choices[0].logprobs.content]
    text = plain.choices[0].message.content
    assert "".join(t.token for t in toks) == text
    words = text.split()
    assert len(words) >= 3
    stop = words[2]
    s = list(client.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None},
                                            stream=True, stop=[stop]))
    got = "".join(c.choices[0].delta.content or "" for c in s if c.choices)
    assert got == text[:text.index(stop)]
    assert s[-1].choices[0].finish_reason == "stop"


def test_ignore_eos(client):
    kw = dict(model="smollm2", temperature=0, max_tokens=40,
              messages=[{"role": "user", "content": "Reply with just the word yes."}])
    plain = client.chat.completions.create(**kw)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 40
    r = client.chat.completions.create(**kw, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 40


def test_keepalive_requests_are_not_held_by_nagle(server):
    # the listening socket is TCP with TCP_NODELAY: a keep-alive response (headers and body
    # written apart) otherwise waits ~40 ms for the client's delayed ACK, on every request of
    # an OpenAI client. The fastest of 15 requests: Nagle's wait is on every one of them,
    # while a loaded machine (other tests running beside) delays only some
    import time
    with httpx.Client(base_url=server.base_url) as h:
        h.get("/health")
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            assert h.get("/health").status_code == 200
            times.append(time.perf_counter() - t0)
    assert min(times) < 0.025, times
