"""memfit on Ray Serve: engine replicas behind one OpenAI-compatible endpoint, routed by prefix.

    memfit serve MODEL --ray [--replicas N] [--max-replicas M] [--address ADDR]

Layout (one Serve application, APP_NAME):

- ``MemfitReplica`` (memfit.ray.replica), N replicas: each loads the model with its own
  --mem-budget and runs the same Starlette app, Guard and engine worker as `memfit serve`, so
  validation, limits, auth and error bodies are the same. Its budget is declared as the
  replica's Ray ``memory`` resource (and --threads as its ``num_cpus``), so Ray places a
  replica only on a node with that much unreserved memory.
- ``MemfitIngress`` (memfit.ray.ingress), one replica, no CPU reserved: Serve's HTTP proxy
  (bound to --host/--port) calls it; it forwards each request to a replica through a streaming
  deployment handle, retries requests that had not started when their replica died, ends a
  stream cut mid-way with an error event, and serves GET /ray/replicas and the merged
  GET /metrics.
- ``PrefixAffinityRouter`` (memfit.ray.router): Serve's request-router interface, ranking
  first the replica that served the request's first KV blocks last, when its load allows.
- a registry actor (memfit.ray.registry) where replicas post their stats and metrics.

Scaling: ``--replicas N`` fixes the count; with ``--max-replicas M`` (> N) Serve's autoscaler
keeps between N and M replicas, targeting --parallel ongoing requests per replica (Serve counts
a replica's running and queued requests plus those waiting at the handle). A replica that is
scaled down stops receiving requests and is stopped once its requests finished, or after
--drain-timeout seconds (Serve's graceful_shutdown_timeout_s). A replica whose process dies is
replaced by Serve's controller (health check every 2 s).

Without --address a local Ray cluster is started in this process's session, with no dashboard
(the HTTP endpoint binds --host, 127.0.0.1 by default; Ray's own ports use the node's address,
which Ray will not set to loopback, behind its token authentication); with --address
(``ray start --head`` on one machine, ``ray start --address HEAD:6379`` on the others) the application is deployed there, and the model file
must exist at the same path on every node (memfit pull on each). Ray is an optional extra:
``pip install "memfit[ray]"``.

Serve's non-blocking deploy (``serve._run(..., _blocking=False)``) is used so that the wait for
the replicas is bounded (--ray-timeout) and reported, rather than blocking without end.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

APP_NAME = "memfit"
_SIMPLE = (str, int, float, bool, type(None))


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def config_from_args(a, path, key: str | None, budget: int | None) -> dict:
    """The settings a replica and the ingress need (plain values: Ray ships them)."""
    from ..pull import DEFAULT_MODEL
    cfg = {k: v for k, v in vars(a).items()
           if isinstance(v, _SIMPLE)
           or (isinstance(v, list) and all(isinstance(x, str) for x in v))}
    cfg.update(model_path=str(path), model_arg=a.model or DEFAULT_MODEL, ray_app_name=APP_NAME,
               api_key_resolved=key, budget_bytes=budget)
    # the key travels in the deployment's arguments, not the file name a remote node lacks
    cfg.pop("api_key", None)
    cfg.pop("api_key_file", None)
    return cfg


def application(cfg: dict, replicas: int = 1, max_replicas: int | None = None,
                imbalance: int = 16, drain_timeout: float = 30.0, upscale_delay_s: float = 5.0,
                downscale_delay_s: float = 30.0, router: str = "prefix"):
    """The Serve application (ingress bound to the replica deployment); with ``max_replicas``
    above ``replicas`` Serve autoscales between them (the delays are its own settings).
    ``router="default"`` keeps Serve's own router (power of two random choices, the less
    loaded of the two) instead of the prefix-affinity one: the benchmark's baseline."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from .ingress import MemfitIngress
    from .replica import MemfitReplica
    from .router import PrefixAffinityRouter

    actor = {"num_cpus": cfg.get("threads") or 1}
    if cfg.get("budget_bytes"):
        actor["memory"] = int(cfg["budget_bytes"])
    opts = dict(name="MemfitReplica", ray_actor_options=actor,
                max_ongoing_requests=cfg["parallel"] + cfg["max_queue"],
                health_check_period_s=2.0, health_check_timeout_s=30.0,
                graceful_shutdown_wait_loop_s=0.5, graceful_shutdown_timeout_s=drain_timeout)
    if router == "prefix":
        opts["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixAffinityRouter,
            request_router_kwargs={"imbalance": imbalance})
    elif router != "default":
        raise ValueError(f"router {router!r}: 'prefix' or 'default'")
    if max_replicas is not None and max_replicas > replicas:
        opts["autoscaling_config"] = {
            "min_replicas": replicas, "initial_replicas": replicas,
            "max_replicas": max_replicas, "target_ongoing_requests": cfg["parallel"],
            "upscale_delay_s": upscale_delay_s, "downscale_delay_s": downscale_delay_s}
    else:
        opts["num_replicas"] = replicas
    rep = serve.deployment(MemfitReplica).options(**opts)
    ing = serve.deployment(MemfitIngress).options(
        name="MemfitIngress", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max(1000, cfg["max_connections"] * 4))
    return ing.bind(rep.bind(cfg), cfg)


def start_cluster(address: str | None = None, num_cpus: int | None = None) -> bool:
    """Connect to the cluster at ``address``, or start a local one bound to 127.0.0.1 (no
    dashboard). Returns True when a local cluster was started here."""
    import ray
    if ray.is_initialized():
        return False
    kw = dict(include_dashboard=False, log_to_driver=False, namespace="memfit",
              ignore_reinit_error=True)
    if address:
        _check_reachable(address)
        ray.init(address=address, **kw)
        return False
    # Ray itself replaces 127.0.0.1 by the node's address (services.resolve_ip_for_localhost)
    # and its internal ports are guarded by its token authentication, on by default; the HTTP
    # endpoint is Serve's proxy, bound to --host
    ray.init(address="local", num_cpus=num_cpus, **kw)
    return True


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """A HOST:PORT address must accept a TCP connection within ``timeout`` seconds: ray.init
    itself keeps retrying an unreachable head for minutes."""
    from ..errors import RequestError
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "/" in host:
        return  # "auto", "ray://...": left to Ray
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise RequestError(f"cannot reach the Ray cluster at {address}: "
                           f"{e.strerror or e}") from None


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def deploy(app, host: str, port: int, timeout: float = 300.0) -> None:
    """Start Serve's proxy on host:port (if not running) and deploy ``app``; wait at most
    ``timeout`` seconds for it to run (a failed deploy raises with Serve's message)."""
    from ray import serve
    serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port})
    serve._run(app, _blocking=False, name=APP_NAME, route_prefix="/")
    wait_running(timeout)


def wait_running(timeout: float, replicas: int | None = None) -> None:
    """Wait until the application runs (and, given ``replicas``, has that many replicas
    RUNNING); RuntimeError after ``timeout`` seconds or when the deploy failed."""
    from ..errors import RequestError
    from ray import serve
    t_end = time.monotonic() + timeout
    last = "?"
    while time.monotonic() < t_end:
        st = serve.status().applications.get(APP_NAME)
        if st is not None:
            last = str(st.status)
            if last.endswith("DEPLOY_FAILED"):
                raise RequestError(f"the Ray Serve deploy failed: {_failure(st)}")
            n = running_replicas()
            if last.endswith("RUNNING") and (replicas is None or n == replicas):
                return
        time.sleep(0.5)
    raise RequestError(f"the Ray Serve application was not running after {timeout:g} s "
                       f"(status {last}); see the Ray logs (/tmp/ray/session_latest/logs)")


def _failure(app_status) -> str:
    """The replica's own error (a memfit refusal such as a budget below the floor, measured
    in the Ray worker, whose baseline RSS is larger than `memfit serve`'s) out of Serve's
    traceback, else Serve's message."""
    import re
    for d in app_status.deployments.values():
        found = re.findall(r"memfit\.errors\.\w+: [^\n]+", d.message or "")
        if found:
            return found[-1]
    return app_status.message


def running_replicas() -> int:
    from ray import serve
    st = serve.status().applications.get(APP_NAME)
    if st is None or "MemfitReplica" not in st.deployments:
        return 0
    return st.deployments["MemfitReplica"].replica_states.get("RUNNING", 0)


def scale(cfg: dict, replicas: int, timeout: float = 300.0, **app_kw) -> None:
    """Set the replica count (Serve updates it in place: the other replicas keep running;
    removed ones drain first) and wait until that many run."""
    from ray import serve
    serve._run(application(cfg, replicas, **app_kw), _blocking=False, name=APP_NAME,
               route_prefix="/")
    wait_running(timeout, replicas)


def stop(started_local: bool) -> None:
    """Delete the application (its replicas drain), the registry, and the local cluster."""
    import ray
    from ray import serve

    from .registry import kill_registry
    try:
        serve.delete(APP_NAME)
        kill_registry(APP_NAME)
        if started_local:
            serve.shutdown()
    finally:
        ray.shutdown()


def args_for(model: str, *argv: str):
    """The parsed `memfit serve MODEL ARGV...` arguments (the Python way to make a config:
    ``cfg = plan(args_for(path, "--mem-budget", "400MiB"))``)."""
    from ..cli import build_parser
    from ..memory.budget import parse_size
    a = build_parser().parse_args(["serve", model, *argv])
    a.max_body = parse_size(a.max_body)
    return a


def plan(a) -> dict:
    """Check the arguments and make the per-replica memory plan as `memfit serve` does (a
    budget below the floor is refused here, before Ray starts); returns the replica config."""
    from ..errors import RequestError
    from ..pull import resolve_model
    from ..runtime import Runtime
    from ..server.security import is_loopback
    from ..server.serve import _api_key, _load_kwargs
    if a.parallel < 1:
        raise RequestError(f"--parallel {a.parallel} must be >= 1")
    if a.max_replicas is not None and a.max_replicas < a.replicas:
        raise RequestError(f"--max-replicas {a.max_replicas} is below --replicas {a.replicas}")
    key = _api_key(a)
    if not is_loopback(a.host) and key is None:
        raise RequestError(f"refusing to listen on {a.host} without an API key: give "
                           f"--api-key-file FILE (or MEMFIT_API_KEY), or bind 127.0.0.1")
    path = resolve_model(a.model, quiet=False)
    rt = Runtime(path, **_load_kwargs(a))
    budget = rt.budget if rt.plan is not None else None
    print(f"memfit: plan per replica: budget {_mib(rt.budget)} ({rt.budget_why}), ctx "
          f"{rt.n_ctx} x {rt.n_parallel}", file=sys.stderr, flush=True)
    rt.close()
    return config_from_args(a, path, key, budget)


def serve_ray(a) -> int:
    """`memfit serve --ray`: the same checks and plan as `memfit serve`, then the Serve app."""
    from ..errors import RequestError
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise RequestError('--ray needs Ray Serve: pip install "memfit[ray]"') from None
    cfg = plan(a)
    path = cfg["model_path"]
    port = a.port or _free_port(a.host)
    stop_event = threading.Event()
    try:
        started = start_cluster(a.address)
    except RequestError:
        raise
    except Exception as e:  # noqa: BLE001 - Ray's own errors are long; one line here
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        where = f"the Ray cluster at {a.address}" if a.address else "a local Ray cluster"
        raise RequestError(f"cannot start or reach {where}: {first}") from None
    try:
        where = f"the Ray cluster at {a.address}" if a.address else "a local Ray cluster"
        print(f"memfit: deploying {a.replicas}"
              f"{f'..{a.max_replicas}' if a.max_replicas else ''} replicas on {where}; "
              f"loading ...", file=sys.stderr, flush=True)
        deploy(application(cfg, a.replicas, a.max_replicas, a.prefix_imbalance,
                           a.drain_timeout), a.host, port, a.ray_timeout)
        shown = f"[{a.host}]" if ":" in a.host else a.host
        print(f"memfit: listening on http://{shown}:{port} (Ray Serve, {running_replicas()} "
              f"replicas of {os.path.basename(str(path))}); replica stats at /ray/replicas",
              file=sys.stderr, flush=True)
        # Ctrl-C / SIGTERM from here on: a clean stop (before, KeyboardInterrupt ends the
        # deploy and the finally below still stops everything)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop_event.set())
        while not stop_event.wait(0.5):
            pass
        print("memfit: stopping (replicas drain) ...", file=sys.stderr, flush=True)
    finally:
        stop(started)
    print("memfit: server stopped", file=sys.stderr)
    return 0
