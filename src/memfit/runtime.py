"""One load, one plan: the runtime builder that the API, the CLI and the server share.

    rt = Runtime("smollm2-135m", mem_budget="300MiB")   # plan: nothing is loaded yet
    print(rt.n_ctx, rt.plan.format())                   # what `memfit plan` prints
    rt.load()                                           # ledger -> store -> model -> engine
    ...
    rt.close()                                          # saves what the next plan needs

Planning describes the GGUF once (planner.ModelDesc), reads the bandwidth record and the
routing counts once, then fits the context with the pure planner on that description
(memory/ctxfit.fit_context) and keeps the plan for that context. `memfit plan`, `run`,
`chat`, `bench` and `serve` all plan here, so they show and use the same configuration.
Each part registers its own bytes in the ledger: the runtime the baseline and the model's
scratch, the weight store its pinned tensors and slots, the KV pool its blocks.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .errors import BudgetError, RequestError


class Runtime:
    """A planned (then loaded) model. Attributes after planning: path, file, desc, budget,
    budget_why, n_ctx, plan (None when no budget could be detected), use_store (a weight
    store executes the plan: a budget was given, or the weights do not fit whole), n_batch,
    notes (start-up facts: context fitted, why weights stream). After load(): ledger, store,
    tokenizer, ops, model, config, engine."""

    def __init__(self, model: str | os.PathLike | None = None, *, threads: int | None = None,
                 n_ctx: int | None = None, backend: str | None = None, quiet: bool = True,
                 mem_budget: int | str | None = None, n_parallel: int = 1,
                 cache_type_k: str = "f16", cache_type_v: str = "f16", bandwidth=None,
                 constrained: bool = False, spec=None, model_draft=None,
                 serving: bool = False, server_bytes: int = 0):
        from .gguf import open_gguf
        from .pull import resolve_model

        self.store = self.ledger = self.engine = self.model = None
        self.draft = self.draft_file = self.draft_desc = None
        self.routing = None
        self.loaded = self.closed = False
        self.backend, self.quiet = backend, quiet
        self.constrained = constrained  # the plan reserves the structured-output tables
        self.serving = serving          # the plan of `memfit serve` (planner.plan serving)
        self.server_bytes = server_bytes  # ... and what `serve` keeps (its Responses store)
        from .spec.build import as_config
        self.spec = as_config(spec)      # speculative decoding (spec/): checked before loading
        self.path = Path(resolve_model(str(model) if model is not None else None, quiet=quiet))
        self.file = open_gguf(self.path)
        try:
            self._open_draft(model_draft)
            self._plan(threads, n_ctx, mem_budget, n_parallel, cache_type_k, cache_type_v,
                       bandwidth)
        except BaseException:
            self.close()
            raise

    def _open_draft(self, model_draft) -> None:
        """The draft model's file (speculative decoding, spec/draft.py), checked against the
        model's vocabulary before anything is planned; only modes that use it open it."""
        self.draft_path, self._draft_notes = None, []
        if model_draft is None:
            if self.spec.mode == "draft":
                raise RequestError("--spec draft needs a draft model: give --model-draft FILE "
                                   "(a GGUF with the same vocabulary)")
            return
        if self.spec.mode not in ("draft", "auto"):
            self._draft_notes = [f"--model-draft is not used with --spec {self.spec.mode}"]
            return
        from .gguf import open_gguf
        from .models import config_from_gguf
        from .pull import resolve_model
        from .spec.draft import check_vocab
        try:
            self.draft_path = Path(resolve_model(str(model_draft), quiet=self.quiet))
        except RequestError as e:
            raise RequestError(f"--model-draft: {e}") from None
        self.draft_file = open_gguf(self.draft_path)
        dc = config_from_gguf(self.draft_file, check=True)
        if dc.n_expert:
            raise RequestError(f"--model-draft {self.draft_path.name}: a mixture-of-experts "
                               f"draft is not supported; use a small dense model")
        check_vocab(self.file.metadata, config_from_gguf(self.file).n_vocab,
                    self.draft_file.metadata, dc.n_vocab, self.draft_path.name)

    # ---- planning (nothing loaded) ----
    def _plan(self, threads, n_ctx, mem_budget, n_parallel, cache_type_k, cache_type_v,
              bandwidth) -> None:
        from .kv.quant import NAMES, cache_type, check_head_dims, check_v_in_k
        from .kv.storage import kv_layout
        from .memory.ctxfit import check_ctx, default_ctx
        from .models import config_from_gguf

        if threads is not None and threads < 1:
            raise RequestError(f"threads must be >= 1, got {threads}")
        if n_ctx is not None and int(n_ctx) < 8:  # before the planner sizes the KV cache
            raise RequestError(f"context size {n_ctx} is too small (minimum 8)")
        if int(n_parallel) < 1:
            raise RequestError(f"n_parallel must be >= 1, got {n_parallel}")
        self.threads, self.n_parallel = threads, int(n_parallel)
        # architecture, hyperparameters and every tensor's shape and type, from the header
        # only: a file the model cannot run is refused before the store reads any weights
        cfg = config_from_gguf(self.file, check=True)
        # the training context (and the architecture's limit), before the planner sizes KV
        check_ctx(self.file, n_ctx, cfg.max_ctx, cfg.max_ctx_why)
        # KV cache types (llama.cpp's -ctk/-ctv): checked before the planner counts them
        self.cache_type_k = NAMES[cache_type(cache_type_k)]
        self.cache_type_v = NAMES[cache_type(cache_type_v)]
        self.notes: list[str] = list(self._draft_notes)
        if kv_layout(cfg).v_in_k:
            # MLA: the cache holds K only and V is K's first values, so V has K's type
            check_v_in_k(cache_type(self.cache_type_k), cfg.head_dim_k, cfg.head_dim_v)
            if self.cache_type_v != self.cache_type_k:
                self.notes.append(f"{cfg.arch} reads V from the K cache (MLA): V is "
                                  f"{self.cache_type_k} like K (-ctv {self.cache_type_v} "
                                  f"does not apply)")
                self.cache_type_v = self.cache_type_k
        check_head_dims(cache_type(self.cache_type_k), cfg.head_dim_k)
        check_head_dims(cache_type(self.cache_type_v), cfg.head_dim_v)
        self.plan = None
        self.budget, self.budget_why = self._budget(mem_budget)
        explicit = mem_budget is not None or bool(os.environ.get("MEMFIT_MEM_BUDGET"))
        default = default_ctx(self.file, cfg.max_ctx)
        if self.budget is None:  # nothing to plan for (no /proc/meminfo): map the model whole
            self.n_ctx, self.use_store = int(n_ctx) if n_ctx is not None else default, False
        else:
            self._fit(n_ctx, default, bandwidth)
            streams = bool(self.plan.tiers["file"] or self.plan.tiers["cache"])
            self.use_store = explicit or streams
            if streams and not explicit and not self.quiet:
                print(f"memfit: the model does not fit in memory ({self.budget_why}); streaming "
                      f"{self.plan.disk_bytes_per_token / 2**30:.2f} GiB per token from the file "
                      f"(set --mem-budget to choose the budget)", file=sys.stderr, flush=True)
        self.n_batch = int(self.plan.n_batch) if self.use_store else 512
        self._check_kv_fits()

    @staticmethod
    def _budget(mem_budget) -> tuple[int | None, str]:
        from .memory.budget import resolve_budget
        try:
            return resolve_budget(mem_budget)
        except (OSError, ValueError):  # no /proc/meminfo or cgroup files: nothing to plan for
            if mem_budget is not None or os.environ.get("MEMFIT_MEM_BUDGET"):
                raise
            return None, "no budget detected"

    def _fit(self, n_ctx, default: int, bandwidth) -> None:
        """Describe the file once, then fit the context and plan on that description."""
        from .memory.bandwidth import get_bandwidth
        from .memory.budget import measure_baseline
        from .memory.ctxfit import explain_streaming, fit_context
        from .memory.planner import EXPERT_POLICIES, ModelDesc, expert_switch, plan

        self.desc = d = ModelDesc.from_gguf(self.file)
        if self.draft_file is not None:
            self.draft_desc = ModelDesc.from_gguf(self.draft_file, self.draft_path.stem)
        policy = os.environ.get("MEMFIT_EXPERT_POLICY", "") or "lru"
        if policy not in EXPERT_POLICIES:
            raise RequestError(f"expert cache policy {policy!r} is not one of "
                               f"{', '.join(EXPERT_POLICIES)} (MEMFIT_EXPERT_POLICY)")
        counts = None
        if d.n_expert and expert_switch("MEMFIT_EXPERT_HOTSET"):
            from .memory.hotset import RoutingCounts
            self.routing = RoutingCounts.load(self.file.paths[0], d.n_layer, d.n_expert)
            counts = self.routing.by_layer()
        elif d.n_expert:
            counts = {}  # no hot set: every expert goes through the cache
        self.bandwidth = bandwidth or get_bandwidth(self.file.paths[0], measure=False)
        self.baseline = measure_baseline()
        threads = self.threads or os.cpu_count() or 1
        self._memo = memo = {}
        # a verify step has a logits row per proposed token (spec.policy caps them at draft_max)
        draft_rows = self.spec.draft_max if self.spec.mode != "off" else 0

        def plan_at(c: int, **kv):
            """The pure planner at context c (KV types overridable), memoized."""
            k = {"cache_type_k": self.cache_type_k, "cache_type_v": self.cache_type_v, **kv}
            key = (c, k["cache_type_k"], k["cache_type_v"])
            if key not in memo:
                try:
                    memo[key] = plan(d, self.budget, c, threads, self.bandwidth,
                                     baseline_bytes=self.baseline, n_parallel=self.n_parallel,
                                     expert_counts=counts, expert_policy=policy,
                                     constrained=self.constrained, draft=self.draft_desc,
                                     server_bytes=self.server_bytes,
                                     resident_draft=self.spec.mode == "resident",
                                     serving=self.serving, draft_rows=draft_rows, **k)
                except BudgetError as e:  # a refusal is remembered as well
                    memo[key] = e
            r = memo[key]
            if isinstance(r, BudgetError):
                raise r
            return r

        self._plan_at = plan_at
        self.n_ctx, note = fit_context(plan_at, default, n_ctx)
        if note:
            self.notes.append(note)
        self.plan = plan_at(self.n_ctx)
        if self.plan.tiers["file"] or self.plan.tiers["cache"]:
            self.notes.append(explain_streaming(plan_at, self.plan, self.budget))

    def replan(self, bandwidth) -> None:
        """The same plan with another bandwidth (only the predicted rate changes): `memfit
        plan` checks the floor with the default bandwidth before it probes."""
        if self.plan is None:
            return
        self.bandwidth = bandwidth
        self._memo.clear()
        self.plan = self._plan_at(self.n_ctx)

    def _check_kv_fits(self) -> None:
        """Refuse a context whose KV cache cannot fit in available memory (before allocating)."""
        import psutil

        from .kv.storage import kv_layout
        from .models import config_from_gguf
        c = config_from_gguf(self.file)
        # the engine's pool (its sliding-window layers hold their windows only)
        kv = kv_layout(c).pool_bytes(self.n_ctx, self.n_parallel, self.n_batch,
                                     self.cache_type_k, self.cache_type_v)
        avail = psutil.virtual_memory().available
        if kv > avail:
            raise RequestError(f"context size {self.n_ctx} x {self.n_parallel} sequences needs "
                               f"{kv / 2**30:.1f} GiB of KV cache but {avail / 2**30:.1f} GiB is "
                               f"available; lower --ctx-size or --parallel")

    def summary(self) -> dict:
        """The configuration in use, in `memfit plan --json`'s terms (run --json shows it)."""
        d = {"n_ctx": self.n_ctx, "n_parallel": self.n_parallel, "budget_bytes": self.budget,
             "weight_store": self.use_store}
        if self.plan is not None:
            p = self.plan
            d.update(n_batch=self.n_batch, kv_bytes=p.kv_bytes,
                     pinned_bytes=p.tier_bytes["pinned"], streamed_tensors=len(p.tiers["file"]),
                     cached_tensors=len(p.tiers["cache"]),
                     disk_bytes_per_token=p.disk_bytes_per_token, planned_bytes=p.planned_bytes)
            if p.draft:
                d["draft_bytes"] = p.draft_bytes
        return d

    # ---- loading ----
    def load(self) -> "Runtime":
        """ledger -> store -> tokenizer, model -> engine, as planned."""
        from .engine.engine import Engine
        from .models import load_model
        from .ops import get_ops
        from .tokenizer import Tokenizer

        if self.loaded:
            return self
        self.loaded = True
        try:
            # the tokenizer first: its build peaks above what it keeps (planner
            # TOKENIZER_KEPT_PER_TOKEN), and that peak passes before any weight is held
            self.tokenizer = Tokenizer.from_metadata(self.file.metadata)
            if self.use_store:
                from .memory.budget import trim_heap
                trim_heap()
                from .memory.ledger import Ledger
                from .memory.store import WeightStore
                p = self.plan
                self.ledger = Ledger(self.budget)
                self.ledger.alloc("baseline", "runtime", self.baseline)
                # the model's activations: the runtime owns the model, so it books them
                self.ledger.alloc("scratch", "model", p.scratch_bytes)
                routing = self.routing if p.n_expert and p.tiers["cache"] else None
                self.store = WeightStore(self.file, p, self.ledger, routing=routing)
            self.ops = get_ops(self.backend)
            if self.threads is not None:
                self.ops.set_threads(self.threads)
            self.model = load_model(self.file, weights=self.store, ops=self.ops)
            self.config = self.model.config
            self.model.cache_type_k, self.model.cache_type_v = self.cache_type_k, self.cache_type_v
            # the paged KV pool for n_parallel sequences of n_ctx tokens; it books itself
            kvt = None if self.cache_type_k == "f16" and self.cache_type_v == "f16" else \
                self.cache_type_k  # None: the model's default (f16, or f32 in exact-math tests)
            if self.draft_file is not None:
                from .spec.draft import load_draft
                dp = self.plan.draft if self.plan is not None else {}
                self.draft = load_draft(
                    self.draft_file, self.model, self.tokenizer, self.file.metadata,
                    n_ctx=self.n_ctx, n_parallel=self.n_parallel, n_batch=self.n_batch,
                    ledger=self.ledger, cache_type=self.cache_type_k if kvt else None,
                    ops=self.ops, scratch=dp.get("scratch_bytes"))
            from .spec.build import make_speculator
            if self.spec.mode == "resident":
                from .spec.resident import ResidentProposer
                self.draft = ResidentProposer.for_runtime(self)
            spec = make_speculator(self.spec, model=self.model, tokenizer=self.tokenizer,
                                   draft=self.draft if self.draft_file is not None else None,
                                   resident=self.draft if self.spec.mode == "resident" else None,
                                   plan=self.plan)
            self.engine = Engine(self.model, self.tokenizer, self.n_ctx, self.n_parallel,
                                 self.n_batch, ledger=self.ledger, cache_type=kvt,
                                 cache_type_v=None if kvt is None else self.cache_type_v,
                                 spec=spec)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Free the store (it saves the routing counts and the observed disk rate the next
        plan reads) and the file."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.draft is not None:
                self.draft.close()
            if self.store is not None:
                self.store.close()
        finally:
            if self.draft_file is not None:
                self.draft_file.close()
            self.file.close()


__all__ = ["Runtime"]
