"""Pure-ASGI guard in front of the app: Host allowlist, API key, body size and deadline,
request limit.

It reads the whole body before the app sees the request: an oversized one is refused from its
Content-Length alone (413) or as soon as it passes the limit, one that does not arrive within
the read timeout gets a 408, and a client that leaves mid-body is dropped without a word. Only
a request whose body is in counts against --max-connections, so stalled uploads cannot lock
out the rest. The key is compared in constant time (hmac.compare_digest). /health answers
without a key, as in llama-server, so load balancers can probe it. The key may come as
``Authorization: Bearer KEY`` (OpenAI) or ``x-api-key: KEY`` (Anthropic); either one is enough.
Requests to the Anthropic endpoints (/v1/messages...) are refused in Anthropic's error shape,
so that its client raises the right exception.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress

from .protocol import APIError

PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/"})  # "/": the chat page (server/page.py)
UNLIMITED_PATHS = PUBLIC_PATHS | {"/metrics"}  # probes and scrapes answer under any load
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def is_anthropic_path(path: str) -> bool:
    """The Anthropic Messages endpoints, whose errors have Anthropic's shape."""
    return path.startswith(("/v1/messages", "/messages"))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """'example.com:8080' -> 'example.com'; '[::1]:80' -> '::1' (lower case)."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


class Guard:
    def __init__(self, app, *, api_key: str | None, allowed_hosts: set[str] | None,
                 max_body: int, max_connections: int, max_header: int = 16384,
                 read_timeout: float = 30.0, on_reject=None):
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.allowed_hosts = allowed_hosts    # None: any Host
        self.max_body = max_body
        self.max_connections = max_connections
        self.max_header = max_header          # uvicorn's h11 limit only sees a head split over reads
        self.read_timeout = read_timeout      # seconds for the whole body, from the parsed head
        self.on_reject = on_reject            # (path, status) for metrics
        self.active = 0                       # requests in the app (their body read)
        self.held = 0                         # body bytes held, in the app or being read:
        #                                       at most max_connections x max_body in all

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = {}
        head_bytes = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        for k, v in scope.get("headers", []):
            head_bytes += len(k) + len(v) + 4
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))

        async def reject(status, msg, hdrs=None, param=None):
            if self.on_reject is not None:
                self.on_reject(path, status)
            err = APIError(status, msg, param, headers=hdrs)
            if is_anthropic_path(path):
                from .anthropic import error_response
                resp = error_response(err)
            else:
                resp = err.response()
            await resp(scope, receive, send)

        if head_bytes > self.max_header:
            return await reject(431, f"the request head has {head_bytes} bytes; the limit is "
                                     f"{self.max_header} (--max-header)")
        if self.allowed_hosts is not None:
            host = host_name(headers.get("host", ""))
            if host not in self.allowed_hosts:
                return await reject(403, f"Host header {headers.get('host', '')!r} is not allowed "
                                         f"(DNS rebinding guard); use one of "
                                         f"{sorted(self.allowed_hosts)} or start the server with "
                                         f"--allowed-host")
        if self.key is not None and path not in PUBLIC_PATHS and scope.get("method") != "OPTIONS":
            auth = headers.get("authorization", "")
            given = auth[7:].strip().encode() if auth[:7].lower() == "bearer " else b""
            if not given:  # Anthropic's clients send the key as x-api-key
                given = headers.get("x-api-key", "").strip().encode()
            if not given:
                return await reject(401, "missing API key: send the header "
                                         "'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                                    {"WWW-Authenticate": "Bearer"})
            if not hmac.compare_digest(given, self.key):
                return await reject(401, "invalid API key", {"WWW-Authenticate": "Bearer"})
        cl = headers.get("content-length")
        if cl is not None:
            if not cl.strip().isdigit():
                return await reject(400, f"Content-Length {cl!r} is not a number")
            if int(cl) > self.max_body:
                return await reject(413, f"the request body has {int(cl)} bytes; the limit is "
                                         f"{self.max_body} (--max-body)")

        chunks, seen = [], 0
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.read_timeout
            while True:
                try:
                    msg = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
                except asyncio.TimeoutError:
                    # close: the client is stalled mid-body, the connection cannot be reused
                    return await reject(408, f"the request body did not arrive within "
                                             f"{self.read_timeout:g} s (--timeout)",
                                        {"Connection": "close"})
                if msg["type"] == "http.disconnect":  # the client left (or h11 sent a 400)
                    if self.on_reject is not None:
                        self.on_reject(path, 499)
                    return
                chunk = msg.get("body", b"")
                if seen + len(chunk) > self.max_body:
                    return await reject(413, f"the request body is over the limit of "
                                             f"{self.max_body} bytes (--max-body)")
                if self.held + len(chunk) > self.max_body * self.max_connections:
                    return await reject(429, "the server is busy receiving other request "
                                             "bodies; retry later", {"Retry-After": 1})
                chunks.append(chunk)
                seen += len(chunk)
                self.held += len(chunk)
                if not msg.get("more_body", False):
                    break
            if self.active >= self.max_connections and path not in UNLIMITED_PATHS:
                return await reject(429, f"too many concurrent requests (limit "
                                         f"{self.max_connections}); retry later",
                                    {"Retry-After": 1})

            replayed = False

            async def replay():
                """The body once, then uvicorn's own receive (which reports a disconnect)."""
                nonlocal replayed
                if replayed:
                    return await receive()
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

            self.active += 1
            try:
                await self.app(scope, replay, send)
            finally:
                self.active -= 1
        finally:
            self.held -= seen
