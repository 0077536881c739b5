"""Pure-ASGI guard in front of the app: connection limit, Host allowlist, API key, body size.

Runs before any route reads the body, so an oversized request is refused from its
Content-Length alone (413) and a chunked one as soon as it passes the limit. The key is
compared in constant time (hmac.compare_digest). /health answers without a key, as in
llama-server, so load balancers can probe it.
"""

from __future__ import annotations

import hmac
import ipaddress
import json

from .protocol import error_body

PUBLIC_PATHS = frozenset({"/health", "/v1/health"})
UNLIMITED_PATHS = PUBLIC_PATHS | {"/metrics"}  # probes and scrapes answer under any load
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


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


class BodyTooLarge(Exception):
    pass


async def send_error(send, status: int, message: str, headers: dict | None = None,
                     param: str | None = None) -> None:
    body = json.dumps(error_body(status, message, param)).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    hdrs += [(k.lower().encode(), str(v).encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


class Guard:
    def __init__(self, app, *, api_key: str | None, allowed_hosts: set[str] | None,
                 max_body: int, max_connections: int, max_header: int = 16384, on_reject=None):
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.allowed_hosts = allowed_hosts    # None: any Host
        self.max_body = max_body
        self.max_connections = max_connections
        self.max_header = max_header          # uvicorn's h11 limit only sees a head split over reads
        self.on_reject = on_reject            # (path, status) for metrics
        self.active = 0

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
            await send_error(send, status, msg, hdrs, param)

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
            if not given:
                return await reject(401, "missing API key: send the header "
                                         "'Authorization: Bearer <key>'",
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
        if self.active >= self.max_connections and path not in UNLIMITED_PATHS:
            return await reject(429, f"too many concurrent requests (limit "
                                     f"{self.max_connections}); retry later", {"Retry-After": 1})

        seen = 0
        started = False

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_body:
                    raise BodyTooLarge()
            return msg

        async def tracked_send(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        self.active += 1
        try:
            await self.app(scope, limited_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await reject(413, f"the request body is over the limit of {self.max_body} bytes "
                                  f"(--max-body)")
        finally:
            self.active -= 1
