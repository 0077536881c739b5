"""Bad requests get the right status and an OpenAI error body, and the server stays healthy;
refusals at start (non-loopback bind without a key, budget below the floor) happen before the
port opens."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from _server import ServerProcess, run_cli

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.realmodel, pytest.mark.slow, pytest.mark.timeout(300)]

KEY = "s3cret-key-for-tests"
# A generation that holds the only slot while a test sends its next request: all of a 256-token
# context (SmolLM2 decodes up to ~300 tok/s here, so this lasts >= 0.8 s).
LONG = 240


@pytest.fixture(scope="module")
def keyed(smollm2_path, tmp_path_factory):
    kf = tmp_path_factory.mktemp("key") / "key.txt"
    kf.write_text(KEY + "\n")
    s = ServerProcess([str(smollm2_path), "--alias", "smollm2", "-c", "256", "-np", "1",
                       "--max-queue", "0", "--api-key-file", str(kf), "--max-body", "64KiB"])
    s.headers = {"Authorization": f"Bearer {KEY}"}
    yield s
    s.stop()


def post(s, path, body=None, content=None, headers=None):
    h = {**s.headers, **(headers or {})}
    return httpx.post(s.url + path, json=body, content=content, headers=h, timeout=60)


def assert_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err
    if param is not None:
        assert err["param"] == param, err
    return err


def healthy(s):
    assert httpx.get(s.url + "/health").status_code == 200
    r = post(s, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("body,param", [
    ({"messages": MSG, "max_tokens": -5}, "max_tokens"),
    ({"messages": MSG, "max_tokens": 10**12}, "max_tokens"),
    ({"messages": MSG, "max_tokens": "ten"}, "max_tokens"),
    ({"messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": MSG, "temperature": "hot"}, "temperature"),
    ({"messages": MSG, "temperature": 7}, "temperature"),
    ({"messages": MSG, "top_p": 0}, "top_p"),
    ({"messages": MSG, "stream": "yes"}, "stream"),
    ({"messages": MSG, "stop": [1, 2]}, "stop"),
    ({"messages": MSG, "n": 2}, "n"), ({"messages": MSG, "n": 17}, "n"),
    ({"messages": MSG, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": MSG, "model": 3}, "model"),
])
def test_invalid_fields_are_400(keyed, body, param):
    assert_error(post(keyed, CHAT, body), 400, param)


def test_malformed_json_and_unknown_fields(keyed):
    assert_error(post(keyed, CHAT, content=b'{"messages": [', headers={
        "Content-Type": "application/json"}), 400)
    assert_error(post(keyed, CHAT, content=b"[1, 2]"), 400)
    r = post(keyed, CHAT, {"messages": MSG, "max_tokens": 2, "frobnicate": {"x": 1},
                           "user": "u1", "temperature": 0})
    assert r.status_code == 200, r.text  # unknown parameters are ignored, as OpenAI does
    assert_error(post(keyed, "/v1/completions", {"prompt": ["a", "b"]}), 400, "prompt")
    assert_error(post(keyed, "/v1/completions", {"prompt": [10**9]}), 400, "prompt")
    healthy(keyed)


def test_prompt_longer_than_context(keyed):
    long = "word " * 400  # > 256 tokens
    err = assert_error(post(keyed, "/v1/completions", {"prompt": long, "max_tokens": 4}), 400,
                       "prompt")
    assert "context" in err["message"]
    healthy(keyed)


def test_unknown_model_is_404_and_never_a_path(keyed, smollm2_path):
    for name in ["gpt-4", str(smollm2_path), "../../etc/passwd"]:
        err = assert_error(post(keyed, CHAT, {"model": name, "messages": MSG}), 404, "model")
        assert err["code"] == "model_not_found"
    c = openai.OpenAI(base_url=keyed.base_url, api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-4", messages=MSG)
    healthy(keyed)


def test_body_over_limit_is_413_before_reading(keyed):
    big = b'{"prompt": "' + b"a" * 70000 + b'"}'
    assert_error(post(keyed, "/v1/completions", content=big), 413)
    # refused from Content-Length alone: the server answers without reading the body
    with socket.create_connection(socket.getaddrinfo(*httpx.URL(keyed.url).netloc.decode()
                                                     .rsplit(":", 1), type=socket.SOCK_STREAM)
                                  [0][4][:2], timeout=10) as sk:
        sk.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                   b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                   b"Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n")
        head = sk.recv(4096)
    assert head.startswith(b"HTTP/1.1 413"), head
    # chunked bodies (no Content-Length) are cut off as they pass the limit
    def gen():
        for _ in range(100):
            yield b"x" * 1000
    assert_error(post(keyed, "/v1/completions", content=gen()), 413)
    # a header block over --max-header is a 4xx, not a crash
    r = httpx.get(keyed.url + "/health", headers={"X-Big": "y" * 40000})
    assert 400 <= r.status_code < 500
    healthy(keyed)


def test_api_key(keyed):
    assert_error(httpx.get(keyed.url + "/v1/models"), 401)
    assert_error(httpx.get(keyed.url + "/v1/models", headers={"Authorization": "Bearer nope"}), 401)
    assert_error(httpx.get(keyed.url + "/metrics", headers={"Authorization": KEY}), 401)
    for key in ["wrong", KEY + "x"]:
        c = openai.OpenAI(base_url=keyed.base_url, api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
    c = openai.OpenAI(base_url=keyed.base_url, api_key=KEY, max_retries=0)
    assert [m.id for m in c.models.list()] == ["smollm2"]
    assert httpx.get(keyed.url + "/health").status_code == 200  # public, as in llama-server


def test_cors_is_off_by_default(keyed):
    r = httpx.options(keyed.base_url + "/models", headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "GET"})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(keyed.base_url + "/models", headers={**keyed.headers,
                                                       "Origin": "http://app.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_host_allowlist(keyed):
    r = httpx.get(keyed.url + "/v1/models", headers={**keyed.headers, "Host": "evil.example:80"})
    assert_error(r, 403)
    for host in ["localhost:1234", "127.0.0.1", "[::1]:8080"]:
        r = httpx.get(keyed.url + "/v1/models", headers={**keyed.headers, "Host": host})
        assert r.status_code == 200, (host, r.text)


def test_full_queue_is_429(keyed):
    # one slot, no queue: a long generation holds the slot; the next request is refused
    results = {}

    def long_request():
        results["long"] = post(keyed, "/v1/completions", {
            "prompt": "1, 2, 3, 4,", "max_tokens": LONG, "temperature": 0, "ignore_eos": True})
    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 30
    while keyed.metrics()["memfit_requests_running"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    r = post(keyed, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    err = assert_error(r, 429)
    assert r.headers["Retry-After"] == "1" and "busy" in err["message"]
    c = openai.OpenAI(base_url=keyed.base_url, api_key=KEY, max_retries=0)
    with pytest.raises(openai.RateLimitError):
        c.completions.create(model="smollm2", prompt="Hi", max_tokens=2)
    t.join()
    assert results["long"].status_code == 200
    healthy(keyed)


def test_refused_at_start(smollm2_path):
    r = run_cli(["serve", str(smollm2_path), "--host", "0.0.0.0", "--port", "0"], timeout=60)
    assert r.returncode not in (0, 70) and "API key" in r.stderr, r.stderr
    assert "listening" not in r.stderr
    r = run_cli(["serve", str(smollm2_path), "--mem-budget", "20MiB", "--port", "0"], timeout=60)
    assert r.returncode not in (0, 70), r.stderr
    assert "listening" not in r.stderr and "budget" in r.stderr.lower(), r.stderr


def test_health_is_503_while_loading():
    from starlette.testclient import TestClient

    from memfit.server.app import ServerState, build_app
    app = build_app(ServerState(model_ids=["m"], n_parallel=1, max_queue=0))
    with TestClient(app) as tc:
        r = tc.get("/health")
        assert_error(r, 503)
        assert r.json()["error"]["message"] == "Loading model"
        assert_error(tc.post("/v1/chat/completions", json={"messages": MSG}), 503)
        assert tc.get("/v1/models").json()["data"][0]["id"] == "m"
        assert_error(tc.get("/v1/nothing"), 404)


def test_queue_timeout_is_429(smollm2_path):
    s = ServerProcess([str(smollm2_path), "-c", "256", "-np", "1", "--max-queue", "4",
                       "--queue-timeout", "0.1"])
    try:
        results = {}

        def long_request():
            results["long"] = httpx.post(s.base_url + "/completions", timeout=60, json={
                "prompt": "1, 2, 3, 4,", "max_tokens": LONG, "temperature": 0,
                "ignore_eos": True})
        t = threading.Thread(target=long_request)
        t.start()
        deadline = time.monotonic() + 30
        while s.metrics()["memfit_requests_running"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        r = httpx.post(s.base_url + "/completions", json={"prompt": "Hi", "max_tokens": 2},
                       timeout=60)
        err = assert_error(r, 429)
        assert "queue" in err["message"] and r.headers["Retry-After"]
        t.join()
        assert results["long"].status_code == 200
        assert httpx.post(s.base_url + "/completions", json={"prompt": "Hi", "max_tokens": 2},
                          timeout=60).status_code == 200
    finally:
        s.stop()


def test_connection_limit_is_429(smollm2_path):
    s = ServerProcess([str(smollm2_path), "-c", "256", "-np", "1", "--max-connections", "1"])
    try:
        t = threading.Thread(target=lambda: httpx.post(s.base_url + "/completions", timeout=60,
                                                       json={"prompt": "1, 2, 3, 4,",
                                                             "max_tokens": LONG, "ignore_eos": True}))
        t.start()
        deadline = time.monotonic() + 30
        while s.metrics()["memfit_requests_running"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        r = httpx.get(s.base_url + "/models")
        err = assert_error(r, 429)
        assert "concurrent" in err["message"] and r.headers["Retry-After"] == "1"
        assert httpx.get(s.url + "/health").status_code == 200  # probes are not limited
        t.join()
        assert httpx.get(s.base_url + "/models").status_code == 200
    finally:
        s.stop()


def test_port_in_use_is_one_line(keyed, smollm2_path):
    port = keyed.url.rsplit(":", 1)[1]
    r = run_cli(["serve", str(smollm2_path), "--port", port], timeout=60)
    assert r.returncode not in (0, 70) and f"cannot listen on 127.0.0.1:{port}" in r.stderr
    assert "Traceback" not in r.stderr
    healthy(keyed)
