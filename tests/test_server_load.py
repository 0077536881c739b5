"""Concurrency on a real `memfit serve`: concurrent greedy requests get the texts sequential ones
get, a dropped stream stops its generation and frees its KV blocks, and a bounded load stays
inside the memory budget with no errors and no RSS growth."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from _server import ServerProcess

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.realmodel, pytest.mark.slow, pytest.mark.timeout(600)]

BUDGET_MIB = 400
PROMPTS = [f"Write one sentence about the number {i}." for i in range(8)]
SYSTEM = "You are a helpful assistant who answers briefly and precisely."  # shared prefix


@pytest.fixture(scope="module")
def server(smollm2_path):
    s = ServerProcess([str(smollm2_path), "--alias", "smollm2", "-c", "512", "-np", "8",
                       "--mem-budget", f"{BUDGET_MIB}MiB", "--max-queue", "64"])
    yield s
    s.stop()


def _chat(prompt: str) -> dict:
    return dict(model="smollm2", temperature=0, max_tokens=16,
                messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}])


def test_concurrent_equals_sequential(server):
    c = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=300)
    # one pass first, so both measured passes find the same prefix-cache state (prefill over a
    # cached prefix is not bit-identical to a cold prefill yet: see docs/NOTES.md, Server)
    for p in PROMPTS:
        c.chat.completions.create(**_chat(p))
    t0 = time.perf_counter()
    seq = [c.chat.completions.create(**_chat(p)) for p in PROMPTS]
    t_seq = time.perf_counter() - t0

    async def run_all():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0,
                                      timeout=300) as ac:
            return await asyncio.gather(*[ac.chat.completions.create(**_chat(p)) for p in PROMPTS])
    t0 = time.perf_counter()
    conc = asyncio.run(run_all())
    t_conc = time.perf_counter() - t0
    assert [r.choices[0].message.content for r in conc] == \
        [r.choices[0].message.content for r in seq]
    n_tok = sum(r.usage.completion_tokens for r in conc)
    cached = sum(r.usage.prompt_tokens_details.cached_tokens for r in conc)
    print(f"\n8 sequential: {n_tok / t_seq:.1f} tok/s; 8 concurrent: {n_tok / t_conc:.1f} tok/s; "
          f"prompt tokens from the prefix cache: {cached}")


def test_requests_join_the_running_batch(server):
    import threading
    done = {}

    def long_request():
        done["long"] = httpx.post(server.base_url + "/completions", timeout=120, json={
            "prompt": "1, 2, 3,", "max_tokens": 400, "temperature": 0, "ignore_eos": True})
    t = threading.Thread(target=long_request)
    t.start()
    assert _wait_metric(server, "memfit_requests_running", lambda v: v >= 1) >= 1
    r = httpx.post(server.base_url + "/completions", timeout=120,
                   json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200
    assert "long" not in done  # it finished while the long one was still decoding
    t.join()
    assert done["long"].json()["usage"]["completion_tokens"] == 400


def _wait_metric(server, name, pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        v = server.metrics()[name]
        if pred(v) or time.monotonic() > deadline:
            return v
        time.sleep(0.05)


def test_disconnect_frees_blocks(server):
    before = server.metrics()
    body = {"model": "smollm2", "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 400,
            "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", server.base_url + "/completions", json=body) as r:
            assert r.status_code == 200
            n = 0
            for line in r.iter_lines():
                n += line.startswith("data: ")
                if n == 3:
                    # still reading: the request runs and holds KV blocks (leaving iter_lines
                    # closes the stream, so this is the moment to look)
                    mid = server.metrics()
                    assert mid["memfit_requests_running"] == 1, mid
                    assert mid["memfit_kv_blocks_used"] > 0, mid
                    break
    # the stream is closed: generation stops at once and its blocks go back to the pool
    assert _wait_metric(server, "memfit_requests_running", lambda v: v == 0) == 0
    assert _wait_metric(server, "memfit_kv_blocks_used", lambda v: v == 0) == 0
    after = server.metrics()
    assert after["memfit_client_disconnects_total"] == before["memfit_client_disconnects_total"] + 1
    assert after["memfit_generated_tokens_total"] - before["memfit_generated_tokens_total"] < 400
    time.sleep(0.5)
    assert server.metrics()["memfit_generated_tokens_total"] == after["memfit_generated_tokens_total"]
    c = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    assert c.completions.create(model="smollm2", prompt="Hi", max_tokens=3).choices[0].text


def test_non_streamed_disconnect_stops_generation(server):
    before = server.metrics()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/completions", timeout=0.5, json={
            "model": "smollm2", "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True})
    assert _wait_metric(server, "memfit_requests_running", lambda v: v == 0) == 0
    assert _wait_metric(server, "memfit_kv_blocks_used", lambda v: v == 0) == 0
    after = server.metrics()
    assert after["memfit_client_disconnects_total"] == before["memfit_client_disconnects_total"] + 1
    assert after["memfit_generated_tokens_total"] - before["memfit_generated_tokens_total"] < 400


def _rss(server) -> tuple[float, float]:
    m = server.metrics()
    return m["memfit_rss_bytes"], m["memfit_peak_rss_bytes"]


def test_bounded_load(server, smollm2_path):
    """200 requests from 16 concurrent clients; stops by itself."""
    n_clients = 16

    async def load(n_req):
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0,
                                      timeout=300) as ac:
            return await _load(ac, n_req)

    async def _load(ac, n_req):
        todo = list(range(n_req))
        errors, tokens = [], 0

        async def client(k):
            nonlocal tokens
            while todo:
                i = todo.pop()
                try:
                    if i % 2:  # the template's default system prompt is the shared prefix
                        r = await ac.chat.completions.create(
                            model="smollm2", max_tokens=4, temperature=0,
                            messages=[{"role": "user", "content": f"Hi {i}"}])
                    else:
                        r = await ac.completions.create(model="smollm2", max_tokens=4,
                                                        prompt=f"Item {i}:")
                    tokens += r.usage.completion_tokens
                except Exception as e:  # noqa: BLE001 - collected and asserted below
                    errors.append(repr(e))
        await asyncio.gather(*[client(k) for k in range(n_clients)])
        return errors, tokens

    asyncio.run(load(32))  # warm-up: scratch buffers, pools and caches reach their size
    rss0, _ = _rss(server)
    read0 = server.metrics()["memfit_weight_store_bytes_read"]
    t0 = time.perf_counter()
    n_req = 200
    errors, tokens = asyncio.run(load(n_req))
    dt = time.perf_counter() - t0
    rss1, peak = _rss(server)
    print(f"\nload: {n_req} requests, {n_clients} clients, {tokens / dt:.1f} tok/s aggregate, "
          f"RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB, peak {peak / 2**20:.1f} MiB "
          f"(budget {BUDGET_MIB} MiB)")
    assert errors == []
    assert peak <= BUDGET_MIB * 2**20
    assert abs(rss1 - rss0) <= 8 * 2**20
    m = server.metrics()
    assert m["memfit_requests_running"] == 0 and m["memfit_requests_queued"] == 0
    assert m["memfit_mem_budget_bytes"] == BUDGET_MIB * 2**20
    # at this budget every weight is pinned: read once at load (~ the file), never again
    assert read0 >= 0.9 * smollm2_path.stat().st_size
    assert m["memfit_weight_store_bytes_read"] == read0 and m["memfit_kv_blocks_total"] > 0
    assert m['memfit_requests_total{endpoint="chat",status="200"}'] >= n_req // 2
