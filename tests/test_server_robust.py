"""A real `memfit serve` on a tiny synthetic model against misbehaving clients: stalled and
malformed bodies get a 4xx within the read timeout and never hold a request slot, deep JSON is
a 400, a client that leaves mid-body costs no traceback, every error body's `code` is a string
or null, and bad serve arguments are refused before the port opens. Every socket operation
has a timeout."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from _server import ServerProcess, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

KEY = "robust-test-key"
TIMEOUT = 3.0          # the server's --timeout (read deadline) in these tests
SLACK = 10.0           # how much later than the deadline an answer may come on a loaded machine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from memfit.synth import synth
    path = tmp_path_factory.mktemp("robust") / "tiny.gguf"
    synth(path, arch="llama", size="tiny", quant="Q8_0", progress=False)
    return path


@pytest.fixture(scope="module")
def srv(tiny, tmp_path_factory):
    kf = tmp_path_factory.mktemp("key") / "key.txt"
    kf.write_text(KEY + "\n")
    # one slot and no queue (a second generation is a 429); 64 requests at once (the default)
    s = ServerProcess([str(tiny), "--alias", "tiny", "-c", "2048", "-np", "1", "--max-queue", "0",
                       "--timeout", str(TIMEOUT), "--max-body", "64KiB",
                       "--api-key-file", str(kf)])
    s.headers = {"Authorization": f"Bearer {KEY}"}
    s.addr = ("127.0.0.1", int(s.url.rsplit(":", 1)[1]))
    yield s
    s.stop()


def head(path="/v1/completions", extra=b"") -> bytes:
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\n"
            b"Content-Type: application/json\r\n" + extra)


def connect(s, timeout=SLACK) -> socket.socket:
    sk = socket.create_connection(s.addr, timeout=timeout)
    sk.settimeout(timeout)
    return sk


def read_response(sk: socket.socket) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one response; raises socket.timeout when none comes."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        d = sk.recv(65536)
        if not d:
            raise ConnectionError(f"closed without a response: {buf!r}")
        buf += d
    hd, _, body = buf.partition(b"\r\n\r\n")
    lines = hd.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    n = int(headers.get("content-length", 0))
    while len(body) < n:
        d = sk.recv(65536)
        if not d:
            break
        body += d
    return status, headers, body


def check_error_object(body: bytes, status: int) -> dict:
    err = json.loads(body)["error"]
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert "param" in err, err
    code = err["code"]
    assert code is None or isinstance(code, str), f"{status}: code {code!r} is not a string or null"
    return err


def post(s, path, body=None, content=None, headers=None, timeout=30):
    return httpx.post(s.url + path, json=body, content=content,
                      headers={**s.headers, **(headers or {})}, timeout=timeout)


def healthy(s, within=5.0):
    t0 = time.monotonic()
    assert httpx.get(s.url + "/health", timeout=within).status_code == 200
    assert time.monotonic() - t0 < within
    r = post(s, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


def new_lines(s, since: int) -> list[str]:
    return [ln for ln in s.lines[since:] if ln.strip()]


# ------------------------------------------------------------------ stalled and broken bodies

def test_stalled_bodies_do_not_block_and_get_408(srv):
    stalled = []
    try:
        for _ in range(64):  # as many as --max-connections: the old guard counted all of them
            sk = connect(srv)
            sk.sendall(head(extra=b"Content-Length: 1000\r\n\r\n") + b'{"prompt":')
            stalled.append(sk)
        t_open = time.monotonic()
        # a normal request is served while they stall (not a 429)
        r = post(srv, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        assert time.monotonic() - t_open < TIMEOUT, "served only after the stalled ones timed out"
        # after the deadline every stalled request is answered with a 408 and closed
        for sk in stalled:
            status, headers, body = read_response(sk)
            assert status == 408, (status, body)
            assert headers.get("connection") == "close"
            assert "--timeout" in check_error_object(body, 408)["message"]
            assert sk.recv(100) == b""  # the server closed the connection
        assert time.monotonic() - t_open >= TIMEOUT * 0.9
    finally:
        for sk in stalled:
            sk.close()
    healthy(srv)


def test_content_length_larger_than_body_is_408_after_the_deadline(srv):
    with connect(srv) as sk:
        t0 = time.monotonic()
        sk.sendall(head(extra=b"Content-Length: 50\r\n\r\n") + b'{"prompt": "hi"}')
        status, _, body = read_response(sk)
        waited = time.monotonic() - t0
    assert status == 408
    check_error_object(body, 408)
    assert TIMEOUT * 0.9 <= waited < TIMEOUT + SLACK, waited
    healthy(srv)


def test_unterminated_chunk_line_is_4xx(srv):
    with connect(srv) as sk:
        sk.sendall(head(extra=b"Transfer-Encoding: chunked\r\n\r\n") + b"5")
        status, _, body = read_response(sk)
    assert 400 <= status < 500, status
    check_error_object(body, status)
    healthy(srv)


def test_huge_chunk_size_is_400(srv):
    with connect(srv) as sk:
        sk.sendall(head(extra=b"Transfer-Encoding: chunked\r\n\r\n")
                   + b"%x\r\n" % 2**80 + b'{"prompt": "hi"}')
        status, headers, body = read_response(sk)
    assert status == 400, (status, body)
    assert headers["content-type"] == "application/json"
    check_error_object(body, 400)
    healthy(srv)


def test_stalled_head_is_closed_after_the_deadline(srv):
    with connect(srv) as sk:
        t0 = time.monotonic()
        sk.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # no blank line
        assert sk.recv(100) == b""
        assert TIMEOUT * 0.9 <= time.monotonic() - t0 < TIMEOUT + SLACK
    healthy(srv)


def test_deep_json_is_400_without_a_traceback(srv):
    n0 = len(srv.lines)
    deep = b"[" * 1000 + b"]" * 1000
    for path in ["/v1/chat/completions", "/v1/completions", "/tokenize"]:
        r = post(srv, path, content=deep)
        assert r.status_code == 400, r.text
        assert "nested" in check_error_object(r.content, 400)["message"]
    deeper = b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    r = post(srv, "/v1/chat/completions", content=deeper)
    assert r.status_code == 400, r.text
    healthy(srv)
    assert not any("Traceback" in ln or "Error" in ln for ln in new_lines(srv, n0)), srv.lines[n0:]


def test_clients_leaving_mid_body_log_at_most_one_line(srv):
    n0 = len(srv.lines)
    socks = []
    try:
        for _ in range(64):
            sk = connect(srv)
            sk.sendall(head(extra=b"Content-Length: 1000\r\n\r\n") + b"0123456789")
            socks.append(sk)
        time.sleep(0.5)  # the requests are in the guard, waiting for their bodies
    finally:
        for sk in socks:
            sk.close()
    healthy(srv)  # /health answers within 5 s and a generation is served
    time.sleep(0.5)
    lines = new_lines(srv, n0)
    assert len(lines) <= 1 and not any("Traceback" in ln for ln in lines), lines


def test_bodies_being_read_are_bounded_in_bytes(tiny):
    """Bodies are read before the request limit applies, so their bytes are bounded instead:
    at most --max-connections x --max-body held at once (here 1 x 64 KiB)."""
    s = ServerProcess([str(tiny), "-c", "256", "-np", "1", "--max-connections", "1",
                       "--max-body", "64KiB", "--timeout", str(TIMEOUT)])
    try:
        s.addr = ("127.0.0.1", int(s.url.rsplit(":", 1)[1]))
        mid = {"prompt": "Hi", "max_tokens": 1, "pad": "a" * 20000}
        with socket.create_connection(s.addr, timeout=SLACK) as sk:
            sk.settimeout(SLACK)
            sk.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                       b"Content-Length: 60000\r\n\r\n" + b" " * 50000)  # 50 KB, then stalls
            time.sleep(0.5)
            r = httpx.post(s.url + "/v1/completions", json=mid, timeout=30)
            assert r.status_code == 429, r.text
            check_error_object(r.content, 429)
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                           timeout=30)
            assert r.status_code == 200, r.text  # a small body still fits
            assert read_response(sk)[0] == 408
        assert httpx.post(s.url + "/v1/completions", json=mid, timeout=30).status_code == 200
    finally:
        s.stop()


# ------------------------------------------------------------------ error bodies

def test_error_codes_are_strings_or_null(srv):
    cases = [
        post(srv, "/v1/completions", {"prompt": "Hi", "max_tokens": "ten"}),                  # 400
        post(srv, "/v1/completions", content=b'{"prompt": '),                                  # 400
        httpx.get(srv.url + "/v1/models", timeout=10),                                         # 401
        httpx.get(srv.url + "/v1/models", headers={**srv.headers, "Host": "evil.example"},
                  timeout=10),                                                                 # 403
        httpx.get(srv.url + "/v1/nothing", headers=srv.headers, timeout=10),                   # 404
        post(srv, "/v1/chat/completions", {"model": "gpt-4", "messages": [
            {"role": "user", "content": "x"}]}),                                               # 404
        httpx.delete(srv.url + "/v1/models", headers=srv.headers, timeout=10),                 # 405
        post(srv, "/v1/completions", content=b'{"prompt": "' + b"a" * 70000 + b'"}'),          # 413
    ]
    statuses = [r.status_code for r in cases]
    assert statuses == [400, 400, 401, 403, 404, 404, 405, 413], statuses
    for r in cases:
        assert r.headers["content-type"] == "application/json"
        check_error_object(r.content, r.status_code)
    # 429: one slot, no queue; a long streamed generation holds the slot
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", srv.url + "/v1/completions", headers=srv.headers, json={
                "prompt": "1, 2, 3", "max_tokens": 2000, "ignore_eos": True, "stream": True}) as st:
            assert st.status_code == 200  # answered at the first token: the slot is taken
            r = post(srv, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 429, r.text
            check_error_object(r.content, 429)
        # leaving the stream aborts the generation and frees the slot
    deadline = time.monotonic() + 30
    while srv.metrics()["memfit_requests_running"] > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    healthy(srv)


# ------------------------------------------------------------------ arguments

@pytest.mark.parametrize("args,words", [
    (["--port", "-1"], "--port"),
    (["--port", "70000"], "--port"),
    (["-ctk", "q5_0"], "q5_0"),
    (["-ctv", "q5_0"], "q5_0"),
    (["-c", "100000"], "100000"),
    (["--timeout", "0"], "--timeout"),
    (["--max-connections", "0"], "--max-connections"),
    (["--max-body", "lots"], "--max-body"),
])
def test_bad_serve_arguments_are_refused_before_listening(tiny, args, words):
    r = run_cli(["serve", str(tiny), *args] + ([] if "--port" in args else ["--port", "0"]),
                timeout=60)
    assert r.returncode not in (0, 70), r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], r.stderr
    assert "listening" not in r.stderr and "Traceback" not in r.stderr
