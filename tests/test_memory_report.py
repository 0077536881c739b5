"""Private against file-backed memory (memory/procmem.py) in `memfit run`'s summary and
--json, `memfit bench --json` and /metrics, on a real model: mapped (no budget: the weights
are file pages, RssFile) against a budget (the store's O_DIRECT reads land in private
buffers: anonymous shared mappings, RssShmem, so "own" = RssAnon + RssShmem)."""

from __future__ import annotations

import openai
import pytest

from _server import ServerProcess
from test_budget_e2e import MiB, memfit

pytestmark = [pytest.mark.realmodel, pytest.mark.timeout(300)]
FIELDS = ("rss_bytes", "rss_anon_bytes", "rss_file_bytes", "rss_shmem_bytes", "rss_own_bytes")


def _plausible(m: dict) -> None:
    for k in FIELDS:
        assert isinstance(m[k], int) and m[k] >= 0, (k, m)
    # /proc/self/status: VmRSS = RssAnon + RssFile + RssShmem (one read)
    assert abs(m["rss_anon_bytes"] + m["rss_file_bytes"] + m["rss_shmem_bytes"]
               - m["rss_bytes"]) <= 1 * MiB, m
    assert m["rss_own_bytes"] == m["rss_anon_bytes"] + m["rss_shmem_bytes"]
    assert m["rss_anon_bytes"] > 10 * MiB    # the interpreter alone has more


def test_run_reports_private_and_file_backed_memory(smollm2_path, tmp_path):
    size = smollm2_path.stat().st_size
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    mapped = memfit("run", smollm2_path, "-p", "Hello", "-n", 4, "--temp", 0, "--json", "-c", 256,
                    env=env).json()["memory"]
    _plausible(mapped)
    # no budget: the weights are the mapped file's pages, so file-backed
    assert mapped["rss_file_bytes"] > size // 2, (mapped, size)
    budget = int(size * 1.5 + 400 * MiB)
    r = memfit("run", smollm2_path, "-p", "Hello", "-n", 4, "--temp", 0, "--json", "-c", 256,
               "--mem-budget", budget, env=env)
    streamed = r.json()["memory"]
    _plausible(streamed)
    # under a budget the store reads the weights into its own buffers (O_DIRECT): owned
    assert streamed["rss_file_bytes"] < mapped["rss_file_bytes"] - size // 4, (streamed, mapped)
    assert streamed["rss_own_bytes"] > mapped["rss_own_bytes"] + size // 4, (streamed, mapped)
    text = memfit("run", smollm2_path, "-p", "Hello", "-n", 2, "--temp", 0, "-c", 256, env=env)
    assert "RSS own" in text.err and "file-backed" in text.err


def test_bench_json_has_the_memory_fields(smollm2_path, tmp_path):
    r = memfit("bench", smollm2_path, "-p", 16, "-n", 4, "-r", 1, "--json",
               env={"XDG_CACHE_HOME": str(tmp_path)})
    rows = [__import__("json").loads(ln) for ln in r.out.splitlines() if ln.startswith("{")]
    assert rows
    for row in rows:
        _plausible(row)


def test_metrics_has_the_memory_gauges(smollm2_path):
    s = ServerProcess([str(smollm2_path), "--alias", "smollm2", "-c", "512", "-np", "1"])
    try:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120)
        client.completions.create(model="smollm2", prompt="Hello", max_tokens=2)
        g = s.metrics()
        for k in ("memfit_rss_anon_bytes", "memfit_rss_file_bytes", "memfit_rss_shmem_bytes",
                  "memfit_cgroup_page_cache_bytes"):
            assert k in g, k
        assert g["memfit_rss_anon_bytes"] > 10 * MiB
        assert g["memfit_rss_file_bytes"] > smollm2_path.stat().st_size // 2   # mapped weights
        assert abs(g["memfit_rss_anon_bytes"] + g["memfit_rss_file_bytes"]
                   + g["memfit_rss_shmem_bytes"] - g["memfit_rss_bytes"]) < 16 * MiB
    finally:
        s.stop()
