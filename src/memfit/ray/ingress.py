"""The ingress deployment: one HTTP entry for the replicas (Ray Serve's HTTP proxy calls it).

Every request except two is forwarded whole (method, path, query, headers, body) to a replica,
whose copy of `memfit serve`'s app validates, authenticates and answers it
(memfit.ray.replica). The ingress adds:

- the prefix hash chain for the router (memfit.ray.router): the request's prompt templated and
  tokenized with the model's own tokenizer and chat template (read from the GGUF's metadata;
  no weights are loaded here), cut to its first PREFIX_BLOCKS KV blocks of BLOCK_SIZE tokens,
  each block's memfit block key (kv/manager.py) hashed along the chain;
- retries: a request whose replica fails before it yields anything (it had not started
  streaming; a non-streamed answer is sent whole) is sent again, to another replica, until
  RETRY_S; a stream whose replica fails mid-way ends with an error event in the endpoint's own
  shape (OpenAI ``data: {"error": ...}``, Anthropic ``event: error``), never a hang;
- GET /ray/replicas: each replica's stats (pid, running, queued, prefix-cache queries and hits,
  requests routed to it) from the registry, the router's decisions, retries and cut streams;
- GET /metrics: each replica's Prometheus text (the names of `memfit serve`) with a
  ``replica`` label, merged, and the ingress's own memfit_ray_* series.

These two routes check the API key and Host header the way security.Guard does; everything
else is checked by the replica's Guard.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import json
import time
from pathlib import Path

from ray.exceptions import ActorUnavailableError, RayActorError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .registry import get_registry

PREFIX_BLOCKS = 16          # blocks of the prompt that are hashed for routing
RETRY_S = 60.0              # how long a request that has not started is retried
RETRYABLE = (RayActorError, ActorUnavailableError)


def _error(status: int, msg: str, anthropic: bool = False, headers=None) -> JSONResponse:
    if anthropic:
        kind = {401: "authentication_error", 403: "permission_error", 413: "request_too_large",
                503: "overloaded_error"}.get(status, "api_error")
        body = {"type": "error", "error": {"type": kind, "message": msg}}
    else:
        body = {"error": {"message": msg, "type": "server_error" if status >= 500 else
                          "invalid_request_error", "param": None, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def stream_error_event(path: str, msg: str) -> bytes:
    """The error event that ends a stream cut mid-way, in the endpoint's streaming shape."""
    from ..server.security import is_anthropic_path
    if is_anthropic_path(path):
        body = {"type": "error", "error": {"type": "api_error", "message": msg}}
        return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"
    if path.rstrip("/").endswith("/responses"):
        body = {"type": "error", "code": "server_error", "message": msg, "param": None}
        return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"
    body = {"error": {"message": msg, "type": "server_error", "param": None, "code": 502}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _text_of(content) -> str:
    """Text of an OpenAI / Anthropic / Responses content value (a string or a list of parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict)
                       and isinstance(p.get("text"), str))
    return ""


def _messages_of(path: str, body: dict) -> list[dict] | None:
    """The conversation of a chat-like request in OpenAI's shape, for the prefix only."""
    p = path.rstrip("/")
    if p.endswith("/chat/completions"):
        msgs = body.get("messages")
        return msgs if isinstance(msgs, list) else None
    if p.endswith("/messages"):  # Anthropic
        out = []
        if body.get("system"):
            out.append({"role": "system", "content": _text_of(body["system"])})
        for m in body.get("messages") or []:
            if isinstance(m, dict):
                out.append({"role": m.get("role"), "content": _text_of(m.get("content"))})
        return out
    if p.endswith("/responses"):
        out = []
        if isinstance(body.get("instructions"), str):
            out.append({"role": "system", "content": body["instructions"]})
        inp = body.get("input")
        if isinstance(inp, str):
            out.append({"role": "user", "content": inp})
        elif isinstance(inp, list):
            for m in inp:
                if isinstance(m, dict) and m.get("role"):
                    role = "system" if m["role"] == "developer" else m["role"]
                    out.append({"role": role, "content": _text_of(m.get("content"))})
        return out
    return None


class PrefixHasher:
    """The hash chain of a request's first KV blocks, as the replicas' prefix cache keys them."""

    def __init__(self, model_path: str, chat_template: str | None):
        from ..gguf import open_gguf
        from ..kv.storage import BLOCK_SIZE
        from ..tokenizer import Tokenizer
        f = open_gguf(Path(model_path))
        self.tok = Tokenizer.from_metadata(f.metadata)
        self.arch = f.arch
        self.chat_template = chat_template
        self.bs = BLOCK_SIZE
        close = getattr(f, "close", None)
        if close is not None:
            close()

    def text(self, path: str, body: dict) -> str | None:
        from ..tokenizer.templates import apply_template
        msgs = _messages_of(path, body)
        if msgs is not None:
            tools = body.get("tools") if body.get("tool_choice") != "none" else None
            kw = {"tools": tools} if isinstance(tools, list) and tools else {}
            return apply_template(self.tok, self.arch, msgs, True, self.chat_template, **kw)[0]
        if path.rstrip("/").endswith("/completions"):
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                prompt = prompt[0]
            return prompt if isinstance(prompt, str) else None
        return None

    def chain(self, path: str, raw: bytes) -> tuple[int, ...]:
        """() when the request has no prompt the hasher understands (it is then routed by
        load alone); never raises: a malformed request is the replica's to refuse."""
        from ..kv.manager import block_key
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                return ()
            prompt = body.get("prompt") if path.rstrip("/").endswith("/completions") else None
            if isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
                ids, cut = prompt[:PREFIX_BLOCKS * self.bs], False
            else:
                text = self.text(path, body)
                if not text:
                    return ()
                n_chars = PREFIX_BLOCKS * self.bs * 8   # well past the blocks in any tokenizer
                cut = len(text) > n_chars
                ids = self.tok.encode(text[:n_chars], add_special=True, parse_special=True)
            n_full = min(len(ids) // self.bs, PREFIX_BLOCKS)
            if cut and n_full * self.bs >= len(ids) - 8:
                n_full -= 1     # the cut text's last tokens may differ from the whole text's
            out, parent = [], None
            for i in range(n_full):
                parent = block_key(parent, ids[i * self.bs:(i + 1) * self.bs])
                out.append(hash(parent))
            return tuple(out)
        except Exception:  # noqa: BLE001 - routing falls back to load; the replica answers
            return ()


class MemfitIngress:
    """The Serve deployment class of the HTTP entry (see memfit.ray.deployments)."""

    def __init__(self, replicas, cfg: dict):
        from ..server.security import LOOPBACK_HOSTS, is_loopback
        self.replicas = replicas.options(stream=True)
        self.cfg = cfg
        self.hasher = PrefixHasher(cfg["model_path"], cfg.get("chat_template"))
        self.registry = get_registry(cfg["ray_app_name"])
        self.key = cfg.get("api_key_resolved")
        self.allowed = None
        if cfg.get("allowed_host") or is_loopback(cfg["host"]):
            self.allowed = set(h.lower() for h in cfg.get("allowed_host") or ()) | (
                set(LOOPBACK_HOSTS) if is_loopback(cfg["host"]) else set())
        self.max_body = cfg["max_body"]
        self.retries = 0
        self.stream_errors = 0
        self.failed = 0
        self.routed = collections.Counter()

    # ----------------------------------------------------------------- local routes
    def _refused(self, request: Request) -> Response | None:
        from ..server.security import host_name
        if self.allowed is not None:
            h = request.headers.get("host", "")
            if host_name(h) not in self.allowed:
                return _error(403, f"Host header {h!r} is not allowed (DNS rebinding guard)")
        if self.key is not None:
            auth = request.headers.get("authorization", "")
            given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            given = given or request.headers.get("x-api-key", "").strip()
            if not given:
                return _error(401, "missing API key: send the header 'Authorization: Bearer "
                                   "<key>' or 'x-api-key: <key>'",
                              headers={"WWW-Authenticate": "Bearer"})
            if not hmac.compare_digest(given.encode(), self.key.encode()):
                return _error(401, "invalid API key", headers={"WWW-Authenticate": "Bearer"})
        return None

    async def _snapshot(self) -> dict:
        return await self.registry.snapshot.remote()

    def _router_decisions(self) -> dict:
        from .router import ROUTERS
        out = collections.Counter()
        for r in ROUTERS:
            out.update(r.decisions)
        return dict(out)

    async def replicas_json(self) -> dict:
        snap = await self._snapshot()
        reps = []
        for rid, e in sorted(snap.items()):
            s = dict(e["stats"])
            s.update(live=e["live"], report_age_s=round(e["age_s"], 2),
                     routed=self.routed.get(rid, 0))
            reps.append(s)
        return {"replicas": reps, "live": sum(1 for r in reps if r["live"]),
                "router": self._router_decisions(), "retries": self.retries,
                "streams_cut": self.stream_errors, "failed": self.failed}

    async def metrics_text(self) -> bytes:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.metrics_core import Metric
        from prometheus_client.parser import text_string_to_metric_families
        snap = await self._snapshot()
        fams: dict[str, Metric] = {}
        for rid, e in sorted(snap.items()):
            if not e["live"]:
                continue
            for fam in text_string_to_metric_families(e["metrics"]):
                f = fams.get(fam.name)
                if f is None:
                    f = fams[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for s in fam.samples:
                    f.add_sample(s.name, dict(s.labels, replica=rid), s.value, s.timestamp)
        own = [("memfit_ray_replicas_live", "gauge", "replicas reporting to the ingress",
                [({}, sum(1 for e in snap.values() if e["live"]))]),
               ("memfit_ray_retries", "counter", "requests sent again after their replica "
                "failed before streaming", [({}, self.retries)]),
               ("memfit_ray_streams_cut", "counter", "streams ended by an error event because "
                "their replica failed mid-way", [({}, self.stream_errors)]),
               ("memfit_ray_requests_failed", "counter", "requests that found no replica "
                "within the retry time", [({}, self.failed)]),
               ("memfit_ray_routing_decisions", "counter", "router choices: affinity (the "
                "prefix's replica), balanced (least loaded), no_prefix",
                [({"decision": k}, v) for k, v in self._router_decisions().items()])]
        for name, typ, doc, samples in own:
            f = Metric(name, doc, typ)
            for labels, v in samples:
                f.add_sample(name + ("_total" if typ == "counter" else ""), labels, v)
            fams[name] = f

        class _Collector:
            def collect(self):
                return list(fams.values())

        reg = CollectorRegistry(auto_describe=False)
        reg.register(_Collector())
        return generate_latest(reg)

    # ----------------------------------------------------------------- forwarding
    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        anthropic = path.startswith(("/v1/messages", "/messages"))
        if request.method == "GET" and path in ("/metrics", "/ray/replicas"):
            refused = self._refused(request)
            if refused is not None:
                return refused
            if path == "/metrics":
                return Response(await self.metrics_text(),
                                media_type="text/plain; version=0.0.4; charset=utf-8")
            return JSONResponse(await self.replicas_json())
        cl = request.headers.get("content-length", "")
        if cl.strip().isdigit() and int(cl) > self.max_body:
            return _error(413, f"the request body has {int(cl)} bytes; the limit is "
                               f"{self.max_body} (--max-body)", anthropic)
        chunks, seen = [], 0
        async for c in request.stream():
            seen += len(c)
            if seen > self.max_body:
                return _error(413, f"the request body is over the limit of {self.max_body} "
                                   f"bytes (--max-body)", anthropic)
            chunks.append(c)
        body = b"".join(chunks)
        chain = ()
        if request.method == "POST" and body:
            chain = await asyncio.to_thread(self.hasher.chain, path, body)
        client = request.client
        meta = {"method": request.method, "path": path, "query": request.url.query,
                "headers": list(request.headers.items()),
                "client": [client.host, client.port] if client else None}
        deadline = time.monotonic() + RETRY_S
        attempt = 0
        while True:
            gen = self.replicas.handle.remote(meta, body, prefix=chain, attempt=attempt)
            try:
                head = await gen.__anext__()
                break
            except RETRYABLE as e:
                gen.cancel()
                if time.monotonic() > deadline:
                    self.failed += 1
                    return _error(503, f"no replica could take the request within {RETRY_S:g} "
                                       f"s (last: {type(e).__name__})", anthropic,
                                  headers={"Retry-After": "1"})
                attempt += 1
                self.retries += 1
                await asyncio.sleep(min(0.1 * attempt, 1.0))
            except StopAsyncIteration:
                self.failed += 1
                return _error(502, "the replica ended the request without an answer", anthropic)
        self.routed[head["replica"]] += 1
        headers = {k: v for k, v in head["headers"]
                   if k.lower() not in ("content-length", "transfer-encoding")}
        if "body" in head:
            return Response(head["body"], status_code=head["status"], headers=headers)
        return StreamingResponse(self._rest(gen, path), status_code=head["status"],
                                 headers=headers)

    async def _rest(self, gen, path: str):
        try:
            async for chunk in gen:
                yield chunk
        except RETRYABLE as e:
            self.stream_errors += 1
            yield stream_error_event(path, f"the replica serving this stream failed mid-way "
                                           f"({type(e).__name__}); the answer is incomplete")
        except asyncio.CancelledError:
            gen.cancel()        # the client left: the replica aborts the generation
            raise
        except Exception as e:  # noqa: BLE001 - an error event, not a hang or a cut connection
            self.stream_errors += 1
            yield stream_error_event(path, f"the stream failed: {type(e).__name__}: {e}")
