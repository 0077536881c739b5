"""The chat page at GET / and GET /props (llama-server's name) that it polls.

The page is one self-contained file, static/index.html (inline CSS and JS, no external asset,
no build step): it streams /v1/chat/completions with fetch() and parses the SSE by hand, stops
with an AbortController (the server aborts a generation whose client left), and shows the
model, the memory budget, the memory in use and the last answer's tokens/s from /props and the
stream's ``timings``. The page itself is public (security.PUBLIC_PATHS); /props and the API
need the key, which the page asks for on a 401 and keeps in sessionStorage.
"""

from __future__ import annotations

from functools import lru_cache
from importlib.resources import files

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse
from starlette.routing import Route

from .. import __version__

# nothing but this origin: the page works offline and cannot be made to load foreign code
CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
       "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'none'")


@lru_cache(maxsize=1)
def page_html() -> bytes:
    return files("memfit.server").joinpath("static/index.html").read_bytes()


def props(state) -> dict:
    """What the page shows: model, context, slots, budget and memory (as /metrics reads them)."""
    from ..memory.budget import current_rss, peak_rss
    m = state.model
    worker = state.worker
    stats = worker.stats if worker is not None else {}
    # the budget the plan was made for: given (--mem-budget, enforced by the ledger) or detected
    rt = getattr(m, "runtime", None)
    ledger = getattr(m, "ledger", None)
    budget = ledger.budget if ledger is not None else getattr(rt, "budget", None)
    d = {"model_alias": state.model_ids[0], "ready": state.ready,
         "total_slots": state.n_parallel, "n_parallel": state.n_parallel,
         "build_info": f"memfit {__version__}",
         "mem_budget_bytes": budget or 0, "mem_budget_why": getattr(rt, "budget_why", None),
         "mem_budget_enforced": ledger is not None,
         "rss_bytes": current_rss(), "peak_rss_bytes": peak_rss(),
         "requests_running": stats.get("running", 0),
         "requests_queued": (worker.queued + stats.get("waiting", 0)) if worker else 0}
    store = getattr(state, "response_store", None)
    if store is not None:
        d["response_store"] = store.stats()
    if ledger is not None:
        d["ledger"] = ledger.breakdown()
    if m is not None:
        tok = m.tokenizer

        def piece(tid):
            return None if tid is None else tok.token_to_bytes(tid).decode("utf-8", "replace")
        d.update({"model_path": m.path.name, "n_ctx": m.n_ctx, "arch": m.config.arch,
                  "default_generation_settings": {"n_ctx": m.n_ctx},
                  "modalities": {"vision": False, "audio": False},
                  "bos_token": piece(tok.bos_id), "eos_token": piece(tok.eos_id),
                  "pooling": getattr(state, "pooling", None) or m.default_pooling()})
    return d


def routes(ctx) -> list[Route]:
    """``ctx``: the app's chat.AppContext."""
    state = ctx.state

    @ctx.endpoint("page")
    async def index(request: Request):
        return HTMLResponse(page_html(), headers={"Content-Security-Policy": CSP,
                                                  "X-Content-Type-Options": "nosniff",
                                                  "Cache-Control": "no-cache"})

    @ctx.endpoint("props")
    async def props_route(request: Request):
        return JSONResponse(props(state), headers={"Cache-Control": "no-store"})

    return [Route("/", index, methods=["GET"]),
            Route("/props", props_route, methods=["GET"])]
