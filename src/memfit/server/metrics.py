"""Prometheus metrics (prometheus-client, a registry of our own; text format at GET /metrics).

Counters and histograms are updated by the handlers; gauges that mirror the engine, the weight
store and the process are read at scrape time from the worker's last stats snapshot.
"""

from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)

disable_created_metrics()  # no *_created series: they only add noise to every scrape

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("memfit_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("memfit_prompt_tokens", "prompt tokens processed", registry=r)
        self.cached_tokens = Counter("memfit_prompt_tokens_cached",
                                     "prompt tokens reused from the prefix cache", registry=r)
        self.generated_tokens = Counter("memfit_generated_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("memfit_time_to_first_token_seconds",
                              "time from request arrival to its first token", buckets=_LATENCY,
                              registry=r)
        self.itl = Histogram("memfit_inter_token_latency_seconds",
                             "time between consecutive tokens of a request", buckets=_LATENCY,
                             registry=r)
        self.disconnects = Counter("memfit_client_disconnects",
                                   "requests stopped because the client went away", registry=r)
        g = {}
        for name, doc in [
            ("requests_running", "requests decoding in the engine"),
            ("requests_queued", "requests waiting for a slot (server queue + engine)"),
            ("kv_blocks_total", "KV cache blocks in the pool"),
            ("kv_blocks_used", "KV cache blocks held by running requests"),
            ("kv_blocks_cached", "KV cache blocks kept for prefix reuse"),
            ("kv_swa_blocks_total", "blocks of the sliding-window layers' own group (0: none)"),
            ("kv_swa_blocks_used", "sliding-window group blocks held by running requests"),
            ("prefix_cache_queries_tokens", "prompt tokens looked up in the prefix cache"),
            ("prefix_cache_hits_tokens", "prompt tokens found in the prefix cache"),
            ("weight_store_bytes_read", "bytes the weight store read from the file"),
            ("weight_store_io_stall_seconds", "seconds compute waited for weight reads"),
            ("expert_cache_hit_rate", "expert cache hit rate (MoE models with an expert cache)"),
            ("mem_budget_bytes", "the memory budget (peak RSS cap), 0 when none"),
            ("rss_bytes", "resident set size of the server process"),
            ("peak_rss_bytes", "peak resident set size (VmHWM) of the server process"),
            ("rss_anon_bytes", "private (anonymous) resident memory of the server process"),
            ("rss_file_bytes", "file-backed resident memory (mapped file pages, page cache)"),
            ("rss_shmem_bytes", "shared-memory resident pages of the server process"),
            ("cgroup_page_cache_bytes", "page cache charged to the process's memory cgroup"),
            ("weight_store_reads", "read requests the weight store issued"),
            ("weight_store_bytes_per_read", "mean bytes per weight store read request"),
            ("response_store_bytes", "bytes the Responses store holds (booked in the ledger)"),
            ("response_store_max_bytes", "the Responses store's share of the budget"),
            ("response_store_entries", "stored responses"),
            ("response_store_evictions", "stored responses evicted to make room"),
            ("ledger_bytes", "bytes booked in the memory ledger (all categories)"),
        ]:
            g[name] = Gauge(f"memfit_{name}", doc, registry=r)
        self.gauges = g
        # speculative decoding (spec/), per proposer: running totals of the engine's counters
        self.spec = {name: Gauge(f"memfit_spec_{name}", doc, ["proposer"], registry=r)
                     for name, doc in [
                         ("drafts", "verify passes that carried proposed tokens"),
                         ("proposed_tokens", "proposed tokens verified"),
                         ("accepted_tokens", "proposed tokens accepted"),
                         ("acceptance_rate", "accepted / proposed"),
                         ("mean_accepted", "accepted tokens per verify pass")]}

    def render(self, worker, model, response_store=None) -> bytes:
        from ..memory.budget import current_rss, peak_rss

        g = self.gauges
        if worker is not None:
            s = worker.stats
            g["requests_running"].set(s.get("running", 0))
            g["requests_queued"].set(worker.queued + s.get("waiting", 0))
            for k in ("kv_blocks_total", "kv_blocks_used", "kv_blocks_cached",
                      "kv_swa_blocks_total", "kv_swa_blocks_used"):
                g[k].set(s.get(k, 0))
            g["prefix_cache_queries_tokens"].set(s.get("prefix_cache_queries", 0))
            g["prefix_cache_hits_tokens"].set(s.get("prefix_cache_hits", 0))
            for name, st in ((s.get("spec") or {}).get("proposers") or {}).items():
                for key, metric in (("drafts", "drafts"), ("proposed", "proposed_tokens"),
                                    ("accepted", "accepted_tokens"),
                                    ("acceptance_rate", "acceptance_rate"),
                                    ("mean_accepted", "mean_accepted")):
                    self.spec[metric].labels(proposer=name).set(st.get(key) or 0)
        if model is not None:
            store = getattr(model, "store", None)
            if store is not None:
                st = store.stats()
                g["weight_store_bytes_read"].set(st.get("bytes_read", 0))
                g["weight_store_io_stall_seconds"].set(st.get("io_stall_s", 0.0))
                g["weight_store_reads"].set(st.get("reads", 0))
                g["weight_store_bytes_per_read"].set(st.get("bytes_per_read", 0.0))
                if "expert_hit_rate" in st:
                    g["expert_cache_hit_rate"].set(st["expert_hit_rate"])
            ledger = getattr(model, "ledger", None)
            g["mem_budget_bytes"].set(ledger.budget if ledger is not None else 0)
            g["ledger_bytes"].set(ledger.total() if ledger is not None else 0)
        if response_store is not None:
            st = response_store.stats()
            g["response_store_bytes"].set(st["bytes"])
            g["response_store_max_bytes"].set(st["max_bytes"])
            g["response_store_entries"].set(st["entries"])
            g["response_store_evictions"].set(st["evicted"])
        g["rss_bytes"].set(current_rss())
        g["peak_rss_bytes"].set(peak_rss())
        from ..memory.procmem import process_memory
        pm = process_memory()
        for k in ("rss_anon_bytes", "rss_file_bytes", "rss_shmem_bytes"):
            g[k].set(pm[k])
        g["cgroup_page_cache_bytes"].set(pm.get("cgroup_file_bytes", 0))
        return generate_latest(self.registry)
