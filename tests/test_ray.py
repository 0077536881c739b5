"""memfit on Ray Serve (memfit.ray): a local Ray cluster, 2 replicas of SmolLM2 (400 MiB budget,
1 thread each), the official openai client through the ingress; prefix affinity asserted from
the replicas' own prefix-cache counters; a replica killed mid-load (SIGKILL of its pid) loses no
request that had not started streaming and is replaced; 1 -> 2 -> 1 replicas under load without
a failed request; `memfit serve --ray` starts and stops on SIGTERM. Ray starts and stops inside
this module; every wait is bounded."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading
import time

import httpx
import pytest

from _server import ServerProcess

openai = pytest.importorskip("openai")
ray = pytest.importorskip("ray", reason="ray[serve] is not installed (pip install 'memfit[ray]')")

pytestmark = [pytest.mark.ray, pytest.mark.realmodel, pytest.mark.slow, pytest.mark.timeout(300),
              # Ray Serve's own pydantic models
              pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")]

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPLICA_ARGS = ["--mem-budget", "900MiB", "--threads", "1", "-np", "4", "-c", "1024"]
SYSTEM = ("You are the support assistant of the Northwind Lighthouse Museum. " * 3 +
          "Opening hours are nine to five, Tuesday to Sunday; tickets cost eight euros, "
          "children under twelve enter free; the tower has 212 steps and no lift; guided "
          "tours leave every hour on the hour from the gift shop; dogs on a leash are "
          "welcome in the garden but not in the tower; the cafe serves soup, sandwiches and "
          "cake; parking is free for visitors. Answer briefly and politely. " * 2)


def test_cli_serve_ray_starts_answers_and_stops(smollm2_path):
    """Before the module's cluster starts: the CLI path with its own local cluster."""
    try:
        s = ServerProcess([str(smollm2_path), "--ray", "--replicas", "1", *REPLICA_ARGS],
                          env={"MEMFIT_API_KEY": "sekrit"}, timeout=150)
    except RuntimeError as e:
        if "Ray" in str(e) and "memfit: plan" in str(e) and "deploying" not in str(e):
            pytest.skip(f"ray cannot start here: {str(e).splitlines()[-1]}")
        raise
    try:
        # the key is checked by the replica's Guard (forwarded routes) and by the ingress
        # (/metrics, /ray/replicas); /health answers without one, as in memfit serve
        bad = openai.OpenAI(base_url=s.base_url, api_key="wrong", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        for path in ("/metrics", "/ray/replicas"):
            assert httpx.get(s.url + path, timeout=10).status_code == 401
            assert httpx.get(s.url + path, timeout=10,
                             headers={"Authorization": "Bearer sekrit"}).status_code == 200
        c = openai.OpenAI(base_url=s.base_url, api_key="sekrit", max_retries=0, timeout=60)
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                      max_tokens=4, temperature=0)
        assert r.choices[0].message.content
        assert "Ray Serve, 1 replicas" in "".join(s.lines)
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=60) == 0
        time.sleep(0.5)  # the reader thread has the last lines
        assert "memfit: server stopped" in "".join(s.lines)
    finally:
        s.stop()


@pytest.fixture(scope="module")
def cluster(smollm2_path):
    import memfit.ray as mr
    cfg = mr.plan(mr.args_for(str(smollm2_path), *REPLICA_ARGS))
    try:
        started = mr.start_cluster(None)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"ray cannot start here: {type(e).__name__}: {e}")
    port = mr._free_port("127.0.0.1")
    try:
        mr.deploy(mr.application(cfg, 2), "127.0.0.1", port, timeout=180)
        yield {"url": f"http://127.0.0.1:{port}", "cfg": cfg}
    finally:
        mr.stop(started)


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster["url"] + "/v1", api_key="x", max_retries=0,
                         timeout=120)


def replicas(cluster, live_only=True) -> list[dict]:
    r = httpx.get(cluster["url"] + "/ray/replicas", timeout=10)
    r.raise_for_status()
    return [x for x in r.json()["replicas"] if x["live"] or not live_only]


def fresh_stats(cluster) -> dict:
    time.sleep(1.2)  # the replicas report every 0.5 s
    return {x["replica"]: x for x in replicas(cluster)}


def test_openai_routes_through_the_ingress(client, cluster):
    ids = [m.id for m in client.models.list()]
    assert ids == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    msgs = [{"role": "user", "content": "Name a colour."}]
    plain = client.chat.completions.create(messages=msgs, model=ids[0], max_tokens=8,
                                           temperature=0)
    assert plain.choices[0].message.content and plain.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(messages=msgs, model=ids[0], max_tokens=8,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    comp = client.completions.create(model=ids[0], prompt="The sky is", max_tokens=5,
                                     temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == 5 and len(lp.top_logprobs[0]) == 2
    assert all(x <= 0 for x in lp.token_logprobs)
    # the replica's validation, unchanged: a 400 naming the field
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(messages=msgs, model=ids[0], max_tokens=-3)
    assert e.value.body["param"] == "max_tokens"


def test_anthropic_messages_stream_through_the_ingress(cluster):
    anthropic = pytest.importorskip("anthropic")
    c = anthropic.Anthropic(base_url=cluster["url"], api_key="x", max_retries=0, timeout=60)
    with c.messages.stream(model="smollm2", max_tokens=6, system="Be brief.",
                           messages=[{"role": "user", "content": "Hello"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text and final.usage.output_tokens > 0


def test_shared_system_prompt_lands_on_one_replica(client, cluster):
    msgs0 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hours?"}]
    client.chat.completions.create(model=MODEL, messages=msgs0, max_tokens=2, temperature=0)
    before = fresh_stats(cluster)
    assert len(before) == 2

    def ask(i):
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": f"Question {i}: is the cafe open?"}],
            max_tokens=3, temperature=0)

    with cf.ThreadPoolExecutor(16) as ex:
        results = list(ex.map(ask, range(16)))
    assert all(r.choices[0].message.content is not None for r in results)
    after = fresh_stats(cluster)
    gained = {k: after[k]["requests_served"] - before[k]["requests_served"] for k in after}
    hits = {k: after[k]["prefix_cache_hits"] - before[k]["prefix_cache_hits"] for k in after}
    queries = {k: after[k]["prefix_cache_queries"] - before[k]["prefix_cache_queries"]
               for k in after}
    owner = max(gained, key=gained.get)
    other = next(k for k in after if k != owner)
    assert gained[owner] == 16 and gained[other] == 0, gained
    # the system prompt's blocks were found in the owner's cache by every request
    assert hits[owner] >= 16 * 32 * 4, hits
    assert queries[other] == 0, queries
    r = httpx.get(cluster["url"] + "/ray/replicas", timeout=10).json()
    assert r["router"].get("affinity", 0) >= 16


def test_metrics_merged_with_replica_label(cluster):
    text = httpx.get(cluster["url"] + "/metrics", timeout=10).text
    labels = {line.split('replica="')[1].split('"')[0] for line in text.splitlines()
              if line.startswith("memfit_prefix_cache_hits_tokens{")}
    assert labels == {x["replica"] for x in replicas(cluster)} and len(labels) == 2
    assert "memfit_ray_replicas_live 2.0" in text
    assert "# TYPE memfit_time_to_first_token_seconds histogram" in text
    assert text.count("# TYPE memfit_requests_total counter") == 1


def _load(client, n: int, stop: threading.Event | None = None, stream_every: int = 2):
    """Requests from 4 threads (every other one streamed): [(ok, started_streaming, error)]."""
    out, lock = [], threading.Lock()

    def one(i):
        started = False
        try:
            kw = dict(model=MODEL,
                      messages=[{"role": "user", "content": f"Count to ten, take {i}."}],
                      max_tokens=24, temperature=0)
            if i % stream_every == 0:
                for c in client.chat.completions.create(stream=True, **kw):
                    started = True
            else:
                client.chat.completions.create(**kw)
            res = (True, started, None)
        except Exception as e:  # noqa: BLE001 - recorded, asserted below
            res = (False, started, f"{type(e).__name__}: {e}")
        with lock:
            out.append(res)

    def worker(k):
        i = k
        while (stop is None and i < n) or (stop is not None and not stop.is_set()):
            one(i)
            i += 4

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    return threads, out


def test_stream_cut_mid_way_ends_with_an_error_event(client, cluster):
    import memfit.ray as mr
    got, err = [], []

    def long_stream():
        try:
            for c in client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "Tell a long story."}],
                    max_tokens=600, stream=True, extra_body={"ignore_eos": True}):
                got.append(c)
        except Exception as e:  # noqa: BLE001 - asserted below
            err.append(e)

    t = threading.Thread(target=long_stream)
    t.start()
    t_end = time.monotonic() + 30
    while len(got) < 3 and time.monotonic() < t_end:
        time.sleep(0.05)
    busy = [x for x in fresh_stats(cluster).values() if x["running"] > 0]
    assert len(got) >= 3 and len(busy) == 1, (len(got), busy)
    os.kill(busy[0]["pid"], signal.SIGKILL)
    t.join(timeout=60)
    assert not t.is_alive(), "the cut stream hung"
    assert err and isinstance(err[0], openai.APIError), err
    assert "failed mid-way" in str(err[0]), err[0]
    assert httpx.get(cluster["url"] + "/ray/replicas", timeout=10).json()["streams_cut"] >= 1
    mr.wait_running(120, replicas=2)


def test_killed_replica_retries_unstarted_requests_and_recovers(client, cluster):
    import memfit.ray as mr
    reps = replicas(cluster)
    assert len(reps) == 2
    stop = threading.Event()
    threads, out = _load(client, 0, stop)
    time.sleep(2.0)
    victim = max(fresh_stats(cluster).values(), key=lambda x: x["pending"])
    os.kill(victim["pid"], signal.SIGKILL)
    time.sleep(3.0)
    stop.set()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a request hung"
    failed_unstarted = [e for ok, started, e in out if not ok and not started]
    assert out and not failed_unstarted, failed_unstarted
    info = httpx.get(cluster["url"] + "/ray/replicas", timeout=10).json()
    print(f"killed {victim['pid']} with {victim['pending']} pending; {len(out)} requests, "
          f"retried {info['retries']}, streams cut {info['streams_cut']}, "
          f"failed after starting {sum(1 for ok, s, _ in out if not ok and s)}")
    assert victim["pending"] > 0
    assert info["retries"] + info["streams_cut"] >= 1   # the kill hit requests in flight
    # back to 2 healthy replicas: Serve replaces the dead one
    mr.wait_running(120, replicas=2)
    t_end = time.monotonic() + 60
    while time.monotonic() < t_end:
        live = replicas(cluster)
        if len(live) == 2 and victim["pid"] not in {x["pid"] for x in live}:
            break
        time.sleep(0.5)
    assert len(live) == 2 and victim["pid"] not in {x["pid"] for x in live}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_scale_1_2_1_under_load_without_failures(client, cluster):
    import memfit.ray as mr
    mr.scale(cluster["cfg"], 1, timeout=120)
    stop = threading.Event()
    threads, out = _load(client, 0, stop)
    try:
        time.sleep(1.0)
        mr.scale(cluster["cfg"], 2, timeout=120)
        time.sleep(2.0)
        mr.scale(cluster["cfg"], 1, timeout=120)
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    failures = [e for ok, _, e in out if not ok]
    assert len(out) >= 8 and not failures, failures
    assert mr.running_replicas() == 1


def test_autoscaling_on_ongoing_requests(client, cluster):
    """1..2 replicas on running + queued requests (Serve's target_ongoing_requests = -np):
    up under load, back down when idle; no request fails meanwhile."""
    import memfit.ray as mr
    mr.scale(cluster["cfg"], 1, timeout=120, max_replicas=2, upscale_delay_s=1.0,
             downscale_delay_s=2.0)
    stop = threading.Event()
    threads, out = _load(client, 0, stop)
    threads2, out2 = _load(client, 0, stop)    # 8 clients: above 4 ongoing per replica
    try:
        t_end = time.monotonic() + 90
        while mr.running_replicas() < 2 and time.monotonic() < t_end:
            time.sleep(0.5)
        up = mr.running_replicas()
    finally:
        stop.set()
        for t in threads + threads2:
            t.join(timeout=120)
    assert up == 2
    t_end = time.monotonic() + 90
    while mr.running_replicas() > 1 and time.monotonic() < t_end:
        time.sleep(0.5)
    assert mr.running_replicas() == 1
    failures = [e for ok, _, e in out + out2 if not ok]
    assert not failures, failures
