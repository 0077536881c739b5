"""`memfit serve`: plan, bind, load, serve.

Order matters: every argument is checked and the memory plan is made first (a context above
the model's or a budget below the floor is refused before any port opens), then the socket is
bound (a port in use or a non-loopback address without an API key is refused with one line),
then the model loads in a thread while /health answers 503, then the engine worker starts.

Dependencies: starlette (the ASGI app), uvicorn (the HTTP server; h11 so that the header size
limit applies) and prometheus-client (/metrics).
"""

from __future__ import annotations

import inspect
import os
import socket
import sys
import threading
import time
from pathlib import Path

from ..errors import MemfitError, RequestError


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def _api_key(a) -> str | None:
    if a.api_key_file:
        try:
            key = Path(a.api_key_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise RequestError(f"cannot read the API key file {a.api_key_file}: {e}") from None
        if not key:
            raise RequestError(f"the API key file {a.api_key_file} is empty")
        return key
    key = a.api_key or os.environ.get("MEMFIT_API_KEY") or None
    return key.strip() if key else None


def _model_ids(arg: str | None, path: Path, alias: str | None) -> list[str]:
    first = alias or (arg if arg and os.sep not in arg and not arg.endswith(".gguf") else path.name)
    ids = [first]
    for n in (arg, path.name, path.stem):  # names only: the field never opens a path
        if n and os.sep not in n and n not in ids:
            ids.append(n)
    return ids


def _bind(host: str, port: int) -> socket.socket:
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto given: asyncio sets TCP_NODELAY on accepted sockets only when sock.proto is TCP;
    # with Nagle on, a keep-alive response written as headers + body waited ~40 ms for the
    # client's delayed ACK (every request of an OpenAI client, which keeps connections alive)
    sock = socket.socket(fam, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise RequestError(f"cannot listen on {host}:{port}: {e.strerror}; choose another "
                           f"--port or --host") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _store_bytes(a) -> int:
    """--response-store as bytes (the Responses store's share of the budget)."""
    from ..memory.budget import parse_size
    from .responses import STORE_BYTES
    v = getattr(a, "response_store", STORE_BYTES)
    return parse_size(v) if isinstance(v, str) else int(v)


def _load_kwargs(a) -> dict:
    """Keywords for memfit.api.Model; the KV cache types only where the API has them (the
    quantized KV formats come from another branch)."""
    from ..api import Model
    kw = dict(threads=a.threads, n_ctx=a.ctx_size, backend=a.backend, quiet=True,
              mem_budget=a.mem_budget, n_parallel=a.parallel, constrained=True, serving=True,
              server_bytes=_store_bytes(a))
    from ..spec.build import as_config
    kw["spec"] = as_config(a.spec, a.draft_max, a.draft_min)
    kw["model_draft"] = a.model_draft
    sig = inspect.signature(Model.__init__).parameters
    for k in ("cache_type_k", "cache_type_v"):
        v = getattr(a, k)
        if k in sig:
            kw[k] = v
        elif v not in (None, "f16"):
            raise RequestError(f"--{k.replace('_', '-')} {v} is not supported by this build "
                               f"(f16 only)")
    return kw


def serve(a) -> int:
    if getattr(a, "ray", False):  # --ray: replicas on Ray Serve (memfit.ray)
        from ..ray import serve_ray
        return serve_ray(a)
    for flag, v in (("--replicas", getattr(a, "replicas", 1) != 1),
                    ("--max-replicas", getattr(a, "max_replicas", None) is not None),
                    ("--address", getattr(a, "address", None) is not None)):
        if v:
            raise RequestError(f"{flag} applies to --ray only; add --ray")
    from ..memory.budget import current_rss, peak_rss
    from ..pull import resolve_model

    if a.parallel < 1:
        raise RequestError(f"--parallel {a.parallel} must be >= 1")
    if a.ctx_size is not None and a.ctx_size < 8:
        raise RequestError(f"context size {a.ctx_size} is too small (minimum 8)")
    from .security import LOOPBACK_HOSTS, is_loopback
    key = _api_key(a)
    if not is_loopback(a.host) and key is None:
        raise RequestError(f"refusing to listen on {a.host} without an API key: give "
                           f"--api-key-file FILE (or MEMFIT_API_KEY), or bind 127.0.0.1")
    path = Path(resolve_model(a.model, quiet=False))
    # plan before binding (runtime.Runtime, as `memfit plan -np N` shows): a budget below the
    # floor, given or detected, is refused here, before the port opens; the load uses this plan
    from ..runtime import Runtime
    kw = _load_kwargs(a)
    rt = Runtime(path, **kw)
    if rt.plan is not None:
        plan = rt.plan
        tb = plan.tier_bytes
        print(f"memfit: plan: budget {_mib(rt.budget)} ({rt.budget_why}), floor "
              f"{_mib(plan.min_budget_bytes)}, ctx {rt.n_ctx} x {rt.n_parallel}, KV "
              f"{_mib(plan.kv_bytes)}, weights resident {_mib(tb.get('pinned', 0))}, "
              f"streamed {plan.disk_bytes_per_token / 2**20:.0f} MiB/token",
              file=sys.stderr, flush=True)
        for note in rt.notes:
            print(f"memfit: {note}", file=sys.stderr, flush=True)

    import uvicorn
    from starlette.middleware.cors import CORSMiddleware

    from .app import ServerState, build_app
    from .http11 import protocol_class
    from .security import Guard
    from .worker import EngineWorker

    from ..pull import DEFAULT_MODEL
    state = ServerState(model_ids=_model_ids(a.model or DEFAULT_MODEL, path, a.alias),
                        n_parallel=a.parallel,
                        max_queue=a.max_queue, max_prompt_tokens=a.max_prompt_tokens,
                        chat_template=a.chat_template, reasoning_format=a.reasoning_format,
                        n_predict=None if a.n_predict < 0 else a.n_predict,
                        response_store_bytes=_store_bytes(a))
    state.pooling = a.pooling  # /v1/embeddings (server/embeddings.py); None: the model's
    allowed = None
    if a.allowed_host or is_loopback(a.host):
        allowed = set(h.lower() for h in a.allowed_host) | (
            set(LOOPBACK_HOSTS) if is_loopback(a.host) else set())
    app = build_app(state)
    metrics = state.metrics
    asgi = Guard(app, api_key=key, allowed_hosts=allowed, max_body=a.max_body,
                 max_connections=a.max_connections, max_header=a.max_header,
                 read_timeout=a.timeout,
                 on_reject=lambda p, s: metrics.requests.labels("guard", str(s)).inc())
    if a.cors_origin:
        asgi = CORSMiddleware(asgi, allow_origins=a.cors_origin, allow_methods=["GET", "POST"],
                              allow_headers=["Authorization", "Content-Type", "x-api-key",
                                             "anthropic-version", "anthropic-beta"])
    try:
        sock = _bind(a.host, a.port)
    except BaseException:
        rt.close()
        raise
    port = sock.getsockname()[1]
    shown = f"[{a.host}]" if ":" in a.host else a.host
    print(f"memfit: listening on http://{shown}:{port} (model {state.model_ids[0]!r}, "
          f"{a.parallel} slots{', API key required' if key else ''}); loading ...",
          file=sys.stderr, flush=True)

    # h11 with a deadline for request heads and JSON 400s; the Guard times the body
    config = uvicorn.Config(asgi, http=protocol_class(a.timeout), lifespan="off",
                            log_level="warning", access_log=False, timeout_keep_alive=5,
                            timeout_graceful_shutdown=5,
                            limit_concurrency=a.max_connections + 64,
                            h11_max_incomplete_event_size=a.max_header)
    server = uvicorn.Server(config)
    failure: list[BaseException] = []

    def load():
        from ..api import Model
        t0 = time.perf_counter()
        try:
            m = Model(runtime=rt)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            failure.append(e)
            server.should_exit = True
            return
        # commit the KV pool's pages now, as llama-server clears its KV buffer at start: the
        # memory in use is printed as it will be under load, and RSS stays flat under load
        pool = getattr(m.engine, "pool", None)
        for arr in (*getattr(pool, "k", ()), *getattr(pool, "v", ())):
            arr.fill(0)
        # the bounded prompt tokenizer's tables and malloc_trim, before the first request's
        # queue wait is counting
        from ..memory.budget import trim_heap
        m.tokenizer.encode_limited("warm up", m.n_ctx)
        # structured output's token tables (the plan reserved them): built now, not on the
        # first constrained request
        from ..constrain.tokenizer import ll_tokenizer
        ll_tokenizer(m.tokenizer)
        trim_heap()
        state.model = m
        w = EngineWorker(m.engine, a.parallel, a.queue_timeout)
        w.start()
        state.worker = w
        budget = f" of budget {_mib(m.ledger.budget)}" if m.ledger is not None else ""
        print(f"memfit: ready: {path.name} ({m.config.arch}, ctx {m.n_ctx}) loaded in "
              f"{time.perf_counter() - t0:.1f} s; RSS {_mib(current_rss())}, peak "
              f"{_mib(peak_rss())}{budget}", file=sys.stderr, flush=True)

    loader = threading.Thread(target=load, name="memfit-load", daemon=True)
    loader.start()
    try:
        server.run(sockets=[sock])
    finally:
        loader.join()
        if state.worker is not None:
            state.worker.stop()
        if state.model is not None:
            state.model.close()
        rt.close()  # the load failed or never ran: the planned file is still open
        sock.close()
    if failure:
        e = failure[0]
        if isinstance(e, MemfitError):
            raise e
        raise RuntimeError(f"loading the model failed: {type(e).__name__}: {e}") from e
    print("memfit: server stopped", file=sys.stderr)
    return 0
