"""One Ray Serve replica: one memfit engine behind the same Starlette app as `memfit serve`.

The replica loads the model the way server/serve.py does (the plan first, then the model, the
KV pool committed, the engine worker started), builds ``server.app.build_app`` and wraps it in
the same ``security.Guard`` (API key, Host allowlist, body and connection limits) and, with
--cors-origin, the same CORS middleware, so every route, its validation and its error bodies
are the ones of `memfit serve`. The ingress hands it a request as (method, path, query,
headers, body) and gets the app's ASGI messages back as a Ray Serve stream:

- a streamed answer (``text/event-stream``): first a head ``{"status", "headers",
  "replica"}``, then each body chunk as it is sent;
- any other answer: one head that carries the whole ``body`` too.

The app sends its head only once the first token exists (server/app.py waits for it), so
"nothing has been yielded yet" means "the request has not started streaming": the ingress may
retry it on another replica when this one dies.

Every half second a thread reports the replica's stats (its pid, the engine's running/queued
counts and prefix-cache counters) and its Prometheus text to the registry actor
(memfit.ray.registry) that the ingress reads for /ray/replicas and /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from pathlib import Path

from ray import serve

from .registry import get_registry

REPORT_PERIOD_S = 0.5


def _headers_list(headers: dict | list) -> list[tuple[bytes, bytes]]:
    items = headers.items() if isinstance(headers, dict) else headers
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in items]


class MemfitReplica:
    """The Serve deployment class of the engine replicas (see memfit.ray.deployments)."""

    def __init__(self, cfg: dict):
        from ..api import Model
        from ..constrain.tokenizer import ll_tokenizer
        from ..memory.budget import trim_heap
        from ..runtime import Runtime
        from ..server.app import ServerState, build_app
        from ..server.security import LOOPBACK_HOSTS, Guard, is_loopback
        from ..server.serve import _load_kwargs, _model_ids, _store_bytes
        from ..server.worker import EngineWorker

        a = argparse.Namespace(**cfg)
        self.app_name = cfg["ray_app_name"]
        path = Path(cfg["model_path"])
        t0 = time.perf_counter()
        rt = Runtime(path, **_load_kwargs(a))
        m = Model(runtime=rt)
        pool = getattr(m.engine, "pool", None)
        for arr in (*getattr(pool, "k", ()), *getattr(pool, "v", ())):
            arr.fill(0)  # the KV pool's pages committed now (serve.py does the same)
        m.tokenizer.encode_limited("warm up", m.n_ctx)
        ll_tokenizer(m.tokenizer)
        trim_heap()
        state = ServerState(model_ids=_model_ids(cfg["model_arg"], path, a.alias),
                            n_parallel=a.parallel, max_queue=a.max_queue,
                            max_prompt_tokens=a.max_prompt_tokens,
                            chat_template=a.chat_template, reasoning_format=a.reasoning_format,
                            n_predict=None if a.n_predict < 0 else a.n_predict,
                            response_store_bytes=_store_bytes(a))
        state.pooling = a.pooling
        state.model = m
        self.worker = EngineWorker(m.engine, a.parallel, a.queue_timeout)
        self.worker.start()
        state.worker = self.worker
        self.state = state
        allowed = None
        if a.allowed_host or is_loopback(a.host):
            allowed = set(h.lower() for h in a.allowed_host) | (
                set(LOOPBACK_HOSTS) if is_loopback(a.host) else set())
        metrics = state.metrics
        self.asgi = Guard(build_app(state), api_key=cfg.get("api_key_resolved"),
                          allowed_hosts=allowed,
                          max_body=a.max_body, max_connections=a.max_connections,
                          max_header=a.max_header, read_timeout=a.timeout,
                          on_reject=lambda p, s: metrics.requests.labels("guard", str(s)).inc())
        if a.cors_origin:  # as serve.py: browser origins only when asked for
            from starlette.middleware.cors import CORSMiddleware
            self.asgi = CORSMiddleware(self.asgi, allow_origins=a.cors_origin,
                                       allow_methods=["GET", "POST"],
                                       allow_headers=["Authorization", "Content-Type",
                                                      "x-api-key", "anthropic-version",
                                                      "anthropic-beta"])
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - constructed outside Serve (a unit test)
            self.replica_id = f"pid{os.getpid()}"
        self.pid = os.getpid()
        self.load_s = time.perf_counter() - t0
        self.started = time.time()
        self.served = 0
        self._stop = threading.Event()
        self.registry = get_registry(self.app_name)
        self._report()
        threading.Thread(target=self._report_loop, name="memfit-ray-report", daemon=True).start()
        print(f"memfit: ray replica {self.replica_id} (pid {self.pid}) ready: {path.name} in "
              f"{self.load_s:.1f} s", file=sys.stderr, flush=True)

    # ----------------------------------------------------------------- stats and metrics
    def stats(self) -> dict:
        w, m = self.worker, self.state.model
        s = dict(w.stats)
        ledger = getattr(m, "ledger", None)
        return {"replica": self.replica_id, "pid": self.pid, "node": _node_ip(),
                "started": self.started, "load_s": round(self.load_s, 3),
                "requests_served": self.served,
                "running": s.get("running", 0), "queued": w.queued + s.get("waiting", 0),
                "pending": w.pending,
                "prefix_cache_queries": s.get("prefix_cache_queries", 0),
                "prefix_cache_hits": s.get("prefix_cache_hits", 0),
                "kv_blocks_total": s.get("kv_blocks_total", 0),
                "kv_blocks_used": s.get("kv_blocks_used", 0),
                "kv_blocks_cached": s.get("kv_blocks_cached", 0),
                "mem_budget_bytes": ledger.budget if ledger is not None else 0}

    def _report(self) -> None:
        text = self.state.metrics.render(self.worker, self.state.model,
                                         getattr(self.state, "response_store", None)).decode()
        self.registry.report.remote(self.replica_id, self.stats(), text)

    def _report_loop(self) -> None:
        while not self._stop.wait(REPORT_PERIOD_S):
            try:
                self._report()
            except Exception as e:  # noqa: BLE001 - the registry restarts; try again later
                print(f"memfit: ray replica report failed: {e}", file=sys.stderr, flush=True)

    def check_health(self) -> None:
        """Ray Serve's health check: the engine thread must be alive."""
        if not self.worker._thread.is_alive():
            raise RuntimeError("the engine worker thread has stopped")

    def __del__(self):
        # Serve calls this when the replica is stopped (scale down: after it drained)
        stop = getattr(self, "_stop", None)
        if stop is None:
            return
        stop.set()
        try:
            self.registry.forget.remote(self.replica_id)
        except Exception:  # noqa: BLE001 - the cluster is going away
            pass
        try:
            self.worker.stop()
            self.state.model.close()
        except Exception:  # noqa: BLE001
            pass

    # ----------------------------------------------------------------- requests
    async def handle(self, meta: dict, body: bytes, prefix=None, attempt: int = 0):
        """Run one HTTP request through the app; yields the head (and body) as described in
        the module doc. ``prefix`` and ``attempt`` are for the router (memfit.ray.router)."""
        self.served += 1
        q: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        sent = False
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                 "http_version": "1.1", "method": meta["method"], "scheme": "http",
                 "path": meta["path"], "raw_path": meta["path"].encode(),
                 "query_string": meta.get("query", "").encode(), "root_path": "",
                 "headers": _headers_list(meta["headers"]),
                 "client": tuple(meta.get("client") or ("127.0.0.1", 0)),
                 "server": ("127.0.0.1", 0)}

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()  # the ingress went away (its client left): Starlette aborts
            return {"type": "http.disconnect"}

        async def send(msg):
            await q.put(msg)

        async def run():
            try:
                await self.asgi(scope, receive, send)
            except Exception as e:  # noqa: BLE001 - Starlette already sent its 500 and logged
                print(f"memfit: ray replica: {type(e).__name__}: {e}", file=sys.stderr)
            finally:
                await q.put(None)

        task = asyncio.create_task(run())
        head, chunks, streaming = None, [], False
        try:
            while True:
                msg = await q.get()
                if msg is None:
                    break
                if msg["type"] == "http.response.start":
                    hdrs = [(k.decode("latin-1"), v.decode("latin-1"))
                            for k, v in msg.get("headers", [])]
                    head = {"status": msg["status"], "headers": hdrs, "replica": self.replica_id}
                    ctype = next((v for k, v in hdrs if k.lower() == "content-type"), "")
                    streaming = ctype.startswith("text/event-stream")
                    if streaming:
                        yield head
                elif msg["type"] == "http.response.body":
                    chunk = msg.get("body", b"")
                    if streaming:
                        if chunk:
                            yield chunk
                    else:
                        chunks.append(chunk)
                    if not msg.get("more_body", False):
                        break
            if not streaming:
                if head is None:
                    head = {"status": 500, "headers": [("content-type", "application/json")],
                            "replica": self.replica_id}
                    chunks = [b'{"error": {"message": "the replica sent no response", '
                              b'"type": "server_error", "code": 500}}']
                head["body"] = b"".join(chunks)
                yield head
        finally:
            gone.set()
            if not task.done():
                try:
                    await asyncio.wait_for(task, 5)
                except (asyncio.TimeoutError, asyncio.CancelledError, Exception):  # noqa: BLE001
                    task.cancel()


def _node_ip() -> str:
    try:
        import ray
        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001
        return "?"
