"""The planner: a pure function (model description + budget + context + threads -> Plan).

It fills the budget in this order: runtime baseline (measured), scratch/activations, KV cache
for n_ctx, I/O staging, two streaming slots (double buffering of the largest streamed unit),
then pins weights by bytes touched per token, gives MoE experts a slot cache with what is
left, and leaves the rest in the file tier (streamed every token). Below the floor it raises
BudgetError stating the smallest budget that would work.

A streamed *unit* is what the store fetches at once: all streamed dense tensors of one layer
(blk.N), or one non-layer tensor (output.weight). MoE experts are units of (layer, expert):
the dense trunk is placed first, then the hot set (learned routing counts), then the expert
cache gets what is left; the floor is the trunk's streaming floor plus one layer's k slots.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..errors import BudgetError
from .bandwidth import Bandwidth
from .budget import GiB, MiB, format_size
from .io import PAGE

KINDS = ("embedding", "output", "norm", "attn", "ffn", "router", "expert", "other")
# pin order among tensors touched in full per token: small + always-needed first
_KIND_PRIORITY = {"norm": 0, "other": 1, "router": 2, "attn": 3, "output": 4, "ffn": 5,
                  "expert": 6, "embedding": 7}
# The store reads straight into its page-aligned slots/pinned buffers (O_DIRECT), so no bounce
# buffers exist; the ledger category stays for backends that need them.
IO_STAGING_BYTES = 0
# Runtime RSS predicted from the model alone, so `memfit plan` and `memfit run` agree on the
# floor (the planner takes max(prediction, measured RSS)). Measured on x86-64 Linux, Python
# 3.11: python + numpy + memfit + native ext + tokenizers imported = 31-35 MiB (40 below: the
# allowance for other numpy/BLAS builds); GGUF metadata parse + tokenizer build, peak above
# that, per vocabulary entry: BPE 440 B (+ 550 B per merge), SentencePiece 290 B (SmolLM2
# 49k+49k merges peaks at 83 MiB of the 86 predicted, Gemma-3 262k SPM at 104 of 112).
RUNTIME_BASE_BYTES = 40 * MiB
TOKENIZER_BYTES_PER_TOKEN = 440   # BPE; SentencePiece (tokenizer model 'llama') costs less
SPM_BYTES_PER_TOKEN = 290
TOKENIZER_BYTES_PER_MERGE = 550
# The runtime as it stays once loaded, predicted so that every process (plan, run, serve)
# plans the same bytes (a measured RSS differs by a few hundred KiB between processes): the
# interpreter and libraries (measured 33.8 MiB: IMPORT_BYTES), the parsed metadata (SmolLM2
# +13.2 MiB for 49k tokens + 49k merges, Gemma-3 +46.3 MiB for 262k SentencePiece tokens), and
# what the tokenizer keeps once built (SmolLM2 +24.9 MiB, Gemma-3 +23.1 MiB). runtime_bytes is
# the tokenizer's transient peak, which passes before any weight is loaded
# (runtime.Runtime.load builds the tokenizer first, then trims the heap).
IMPORT_BYTES = 37 * MiB
METADATA_PER_TOKEN = 145          # BPE, per token and per merge
METADATA_PER_MERGE = 145
SPM_METADATA_PER_TOKEN = 190
TOKENIZER_KEPT_PER_TOKEN = 270    # BPE, per token and per merge
TOKENIZER_KEPT_PER_MERGE = 270
SPM_KEPT_PER_TOKEN = 95
# `memfit serve` imports its web stack (uvicorn, starlette, the server's modules) after it
# plans: 14 MiB measured; and it has imported more than `run` when it plans (+6 MiB
# measured), which its prediction covers so that serve's plan too is the same in every process
SERVE_IMPORT_BYTES = 16 * MiB
SERVE_PLAN_IMPORT_BYTES = 8 * MiB
# after the plan: model objects, float32 norms, I/O + kernel thread stacks, allocator slack
# (SmolLM2's loaded runtime is 88 MiB of the 92 predicted with this, Gemma-3's 110 of 118)
RUNTIME_EXTRA_BYTES = 6 * MiB
# a prompt being templated and tokenized (the server does one at a time, tokenizer.vocab's
# encode_limited in pieces of at most MAX_PIECE_CHARS): peak RSS over idle measured <= 5 MiB
# for the worst pieces (16k-char words, SmolLM2 BPE and Gemma SPM) and a 1 MiB chat message
PROMPT_SCRATCH_BYTES = 8 * MiB
MIN_BATCH = 64                    # smallest prefill batch the planner will choose
THREAD_SCRATCH_BYTES = 2 * MiB    # per-thread kernel scratch (quantized activations, tiles)
ATTN_Q_BLOCK = 64                 # query rows whose scores over the context exist at once
# logits rows alive at once outside the forward (perplexity scores slices of this many rows;
# the sampler copies one row), each with an f32 shifted copy and f64 exp: 16 bytes per entry
LOGITS_SLICE_ROWS = 8
_LAYER_RE = re.compile(r"^blk\.(\d+)\.")
# work done by this process, by kind: 'describe' (a GGUF described), 'plan' (a pure plan),
# 'bandwidth' (the bandwidth record read), 'routing' (routing counts loaded): tests count a load
COUNTS: Counter = Counter()


@dataclass(frozen=True)
class TensorDesc:
    name: str
    nbytes: int
    layer: int | None
    kind: str
    touched_per_token: int  # bytes of this tensor read per decoded token (expected)
    row_bytes: int = 0


@dataclass(frozen=True)
class ModelDesc:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int       # K head size
    head_dim_v: int     # V head size
    n_vocab: int
    n_ff: int
    tensors: tuple[TensorDesc, ...]
    n_expert: int = 0
    n_expert_used: int = 0
    tied_output: bool = False
    file_bytes: int = 0
    name: str = ""
    tokenizer_model: str = ""   # tokenizer.ggml.model: 'gpt2' (BPE), 'llama' (SPM), ...
    n_merges: int = 0
    skipped_bytes: int = 0      # tensors in the file never computed (role skip: NextN layers)
    act_extra: int = 0          # f32 activations per token beyond the standard block's (MLA)
    v_in_k: bool = False        # the KV cache stores K only, V is read from it (MLA: kv_layout)
    kv_aux: int = 0             # auxiliary cache values per token (glm-dsa's indexer keys)
    ctx_extra: int = 0          # f32 values per context token held once in a layer (glm-dsa:
                                # a sequence's indexer keys in f32 and one row's scores)
    kv_swa_layers: tuple = ()   # sliding-window layers: the KV pool holds only their windows
    kv_window: int = 0          # ... of this many positions (gpt-oss, gemma3)

    @property
    def runtime_bytes(self) -> int:
        """Predicted RSS of the runtime with this model's metadata and tokenizer loaded."""
        per_tok = SPM_BYTES_PER_TOKEN if self.tokenizer_model == "llama" else TOKENIZER_BYTES_PER_TOKEN
        return (RUNTIME_BASE_BYTES + per_tok * self.n_vocab
                + TOKENIZER_BYTES_PER_MERGE * self.n_merges)

    @property
    def loaded_runtime_bytes(self) -> int:
        """Predicted RSS of the runtime once loaded, before any budgeted allocation: the
        interpreter and libraries, the parsed metadata and the built tokenizer."""
        if self.tokenizer_model == "llama":
            per_tok, per_merge = SPM_METADATA_PER_TOKEN + SPM_KEPT_PER_TOKEN, 0
        else:
            per_tok = METADATA_PER_TOKEN + TOKENIZER_KEPT_PER_TOKEN
            per_merge = METADATA_PER_MERGE + TOKENIZER_KEPT_PER_MERGE
        return IMPORT_BYTES + per_tok * self.n_vocab + per_merge * self.n_merges

    @property
    def tokenizer_kept_bytes(self) -> int:
        """Predicted RSS the built tokenizer keeps beyond the parsed metadata."""
        if self.tokenizer_model == "llama":
            return SPM_KEPT_PER_TOKEN * self.n_vocab
        return TOKENIZER_KEPT_PER_TOKEN * self.n_vocab + TOKENIZER_KEPT_PER_MERGE * self.n_merges

    @property
    def kv_bytes_per_token(self) -> int:
        """f32 K and V of every layer for one position (K only when V is inside K)."""
        return self.kv_cache_bytes(1, "f32", "f32")

    @property
    def kv_elems_per_token(self) -> int:
        return self.kv_bytes_per_token // 4

    def kv_cache_bytes(self, n_ctx: int, cache_type_k="f16", cache_type_v="f16") -> int:
        """Bytes of a KV cache of n_ctx tokens in the given cache types (f16, q8_0: 34 B
        per 32 values, q4_0: 18 B per 32): kv/storage.py's kv_bytes_per_token (K only when V
        is inside K: MLA; with glm-dsa's indexer key cache)."""
        from ..kv.storage import kv_bytes_per_token
        return n_ctx * kv_bytes_per_token(self.n_layer, self.n_head_kv, self.head_dim,
                                          self.head_dim_v, cache_type_k, cache_type_v,
                                          v_in_k=self.v_in_k, aux=self.kv_aux)

    def kv_pool_bytes(self, n_ctx: int, n_parallel: int = 1, n_batch: int = 512,
                      cache_type_k="f16", cache_type_v="f16", window_group: bool = True) -> int:
        """Bytes of the engine's KV pool for n_parallel sequences of n_ctx tokens and steps of
        n_batch rows (kv/storage.py KVLayout.pool_bytes: the sliding-window layers' group
        holds their windows only); window_group False: every layer for every position (a
        pool without the group: the draft's)."""
        from ..kv.storage import KVLayout
        # (the indexer keys' total per token stands as one layer's aux rows: same bytes)
        L = KVLayout(self.n_layer, self.n_head_kv, self.head_dim, self.head_dim_v, self.v_in_k,
                     self.kv_aux, (0,) if self.kv_aux else (),
                     self.kv_swa_layers if window_group else (), self.kv_window)
        return L.pool_bytes(n_ctx, n_parallel, n_batch, cache_type_k, cache_type_v)

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @staticmethod
    def from_gguf(f, name: str = "") -> "ModelDesc":
        """Description from an open GGUFFile (memfit.gguf.open_gguf)."""
        from ..kv.storage import kv_layout
        from ..models.spec import SKIP, config_from_gguf, tensor_roles
        COUNTS["describe"] += 1
        md = f.metadata
        c = config_from_gguf(f)   # the models' hyperparameter rules (models/spec.py)
        n_expert, n_used = c.n_expert, c.n_expert_used
        n_ff = c.n_ff or c.n_ff_exp * max(n_used, 1)
        tied = "output.weight" not in f.tensors
        roles = tensor_roles(f)   # the architecture file's table (models/spec.py)
        ts, skipped = [], 0
        for ti in f.tensors.values():
            if roles[ti.name] == SKIP:   # never loaded nor read: not in the plan
                skipped += ti.nbytes
                continue
            ts.append(describe_tensor(ti.name, ti.nbytes, ti.shape, tied, n_expert, n_used))
        merges = md.get("tokenizer.ggml.merges")
        return ModelDesc(c.arch, c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.head_dim_k,
                         c.head_dim_v, c.n_vocab, n_ff, tuple(ts), n_expert, n_used, tied,
                         int(getattr(f, "file_size", 0) or 0), name or str(md.get("general.name", "")),
                         str(md.get("tokenizer.ggml.model", "") or ""),
                         len(merges) if isinstance(merges, list) else 0, skipped,
                         _act_extra(c), kv_layout(c).v_in_k, kv_layout(c).aux, _ctx_extra(c),
                         kv_layout(c).swa_layers, kv_layout(c).window)


def _act_extra(c) -> int:
    """Per-token f32 values an architecture's block holds beyond Q/K/V, the FFN and the
    residual rows: MLA's q, its absorbed form and the per-head latent output (deepseek2);
    glm-dsa's indexer q, key, head weights and the row's selected keys (int32)."""
    if not c.head_dim_k_mla:
        return 0
    Hi, Di, K = c.indexer
    return (c.n_head * (c.head_dim_k_mla + 2 * c.kv_lora_rank + c.head_dim_v_mla) + c.q_lora_rank
            + Hi * Di + Di + Hi + K)


def _ctx_extra(c) -> int:
    """f32 values per context token the block holds at once: glm-dsa's indexer (a sequence's
    keys and one row's per-head scores, both float64, its summed score and selection mask)."""
    Hi, Di, _ = c.indexer
    return 2 * (Di + Hi) + 6 if Di else 0


def tensor_kind(name: str) -> str:
    base = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias", ".scale")) else name
    if base == "token_embd":
        return "embedding"
    if base == "output":
        return "output"
    if "norm" in base:
        return "norm"
    m = _LAYER_RE.match(base)
    if m:
        role = base[m.end():]
        if role.endswith("_exps"):
            # the stacked experts; their biases (gpt-oss) are small and read every token
            return "expert" if name.endswith(".weight") else "ffn"
        if role == "ffn_gate_inp" or role.startswith("ffn_gate_inp"):
            return "router"
        if role.startswith("attn"):
            return "attn"
        if role.startswith("ffn"):
            return "ffn"
    return "other"


def describe_tensor(name: str, nbytes: int, shape: tuple[int, ...], tied: bool = False,
                    n_expert: int = 0, n_used: int = 0) -> TensorDesc:
    kind = tensor_kind(name)
    m = _LAYER_RE.match(name)
    layer = int(m.group(1)) if m else None
    rows = shape[0] if shape else 1
    row_bytes = nbytes // rows if len(shape) >= 2 and rows else nbytes
    touched = nbytes
    if kind == "embedding":
        if tied:
            kind = "output"  # also the output matrix: read in full per token
        else:
            touched = row_bytes
    elif kind == "expert" and n_expert:
        touched = nbytes * n_used // n_expert
    return TensorDesc(name, nbytes, layer, kind, touched, row_bytes)


@dataclass
class Unit:
    name: str                 # 'blk.3', 'output.weight', 'blk.3.experts'
    tensors: list[str]
    nbytes: int               # bytes fetched per use (experts: n_used slices)


@dataclass
class Plan:
    budget_bytes: int
    n_ctx: int
    n_batch: int
    threads: int
    baseline_bytes: int
    scratch_bytes: int
    kv_bytes: int
    io_staging_bytes: int
    stream_slot_bytes: int           # both slots together
    tiers: dict[str, list[str]]      # 'pinned' | 'cache' | 'file' -> tensor names
    tier_bytes: dict[str, int]       # bytes of tensors in each tier (cache: tensors it serves)
    cache_bytes: int                 # memory of the cache tier's slots
    cache_slot_bytes: int
    cache_slots: int
    cache_hit_rate: float
    units: list[Unit]                # streamed units in execution order
    embedding_by_rows: str | None    # tensor read by rows from the file (not held), if any
    min_budget_bytes: int
    mem_bytes_per_token: int
    disk_bytes_per_token: int
    bandwidth: Bandwidth
    overlap_io: bool
    predicted_tg_tokens_per_s: float
    model_name: str = ""
    arch: str = ""
    n_layer: int = 0
    weight_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    tensor_bytes: dict[str, int] = field(default_factory=dict)
    floor_parts: dict[str, Any] = field(default_factory=dict)  # what min_budget_bytes is made of
    n_expert: int = 0
    n_expert_used: int = 0
    expert_bytes: int = 0            # all routed experts' bytes in the file
    hot_experts: list = field(default_factory=list)   # [(layer, expert)] pinned from counts
    hot_bytes: int = 0
    hot_coverage: float = 0.0        # share of the recorded routings the hot set serves
    expert_policy: str = "lru"
    cache_type_k: str = "f16"        # KV cache types (-ctk / -ctv) kv_bytes is counted in
    cache_type_v: str = "f16"
    kv_v_in_k: bool = False          # the cache holds K only, V is read from it (MLA)
    kv_aux: int = 0                  # indexer key values per token in kv_bytes (glm-dsa)
    kv_swa_layers: int = 0           # layers whose KV holds only a window (0: none bounded)
    kv_window: int = 0               # ... of this many positions
    # a draft model (speculative decoding, spec/draft.py), pinned whole before the target's
    # weights get the rest: {"name", "weights_bytes", "kv_bytes", "scratch_bytes"}
    draft: dict = field(default_factory=dict)
    server_bytes: int = 0            # what the server keeps between requests (Responses store)

    @property
    def draft_bytes(self) -> int:
        d = self.draft
        return d["weights_bytes"] + d["kv_bytes"] + d["scratch_bytes"] if d else 0

    @property
    def n_layer_moe(self) -> int:
        return len({n.split(".")[1] for n in self.tensor_bytes if "_exps." in n})

    def tier_of(self, name: str) -> str:
        for tier, names in self.tiers.items():
            if name in names:
                return tier
        raise KeyError(name)

    @property
    def planned_bytes(self) -> int:
        return (self.baseline_bytes + self.scratch_bytes + self.kv_bytes + self.io_staging_bytes
                + self.stream_slot_bytes + self.tier_bytes["pinned"] + self.hot_bytes
                + self.cache_bytes + self.draft_bytes + self.server_bytes)

    def breakdown(self) -> dict[str, int]:
        """Ledger categories -> planned bytes."""
        d = self.draft or {"weights_bytes": 0, "kv_bytes": 0, "scratch_bytes": 0}
        return {"baseline": self.baseline_bytes, "scratch": self.scratch_bytes + d["scratch_bytes"],
                "kv": self.kv_bytes + d["kv_bytes"],
                "resident_weights": self.tier_bytes["pinned"] + self.hot_bytes + d["weights_bytes"],
                "weight_cache": self.cache_bytes + self.stream_slot_bytes,
                "io_staging": self.io_staging_bytes, "server": self.server_bytes}

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model_name, "arch": self.arch, "n_layer": self.n_layer,
            "weight_bytes": self.weight_bytes,
            "budget_bytes": self.budget_bytes, "min_budget_bytes": self.min_budget_bytes,
            "floor": self.floor_parts,
            "planned_bytes": self.planned_bytes,
            "n_ctx": self.n_ctx, "n_batch": self.n_batch, "threads": self.threads,
            "baseline_bytes": self.baseline_bytes, "scratch_bytes": self.scratch_bytes,
            "kv_bytes": self.kv_bytes, "io_staging_bytes": self.io_staging_bytes,
            "cache_type_k": self.cache_type_k, "cache_type_v": self.cache_type_v,
            "kv_v_in_k": self.kv_v_in_k, "kv_aux": self.kv_aux,
            "kv_swa_layers": self.kv_swa_layers, "kv_window": self.kv_window,
            "stream_slot_bytes": self.stream_slot_bytes,
            "tiers": {t: {"bytes": self.tier_bytes[t], "n_tensors": len(n), "tensors": n}
                      for t, n in self.tiers.items()},
            "cache": {"bytes": self.cache_bytes, "slot_bytes": self.cache_slot_bytes,
                      "slots": self.cache_slots, "expected_hit_rate": self.cache_hit_rate},
            "n_expert": self.n_expert, "n_expert_used": self.n_expert_used,
            "expert_bytes": self.expert_bytes,
            "expert_cache_bytes": self.cache_bytes, "expert_slots": self.cache_slots,
            "expected_hit_rate": self.cache_hit_rate,
            "hot_experts": [list(k) for k in self.hot_experts], "hot_bytes": self.hot_bytes,
            "hot_coverage": self.hot_coverage, "expert_policy": self.expert_policy,
            "units": [{"name": u.name, "bytes": u.nbytes, "tensors": u.tensors} for u in self.units],
            "embedding_by_rows": self.embedding_by_rows,
            "mem_bytes_per_token": self.mem_bytes_per_token,
            "disk_bytes_per_token": self.disk_bytes_per_token,
            "mem_read_bytes_per_s": self.bandwidth.mem_read_bytes_per_s,
            "disk_read_bytes_per_s": self.bandwidth.disk_read_bytes_per_s,
            "bandwidth_source": self.bandwidth.source, "overlap_io": self.overlap_io,
            "predicted_tg_tokens_per_s": self.predicted_tg_tokens_per_s,
            "draft": dict(self.draft, bytes=self.draft_bytes) if self.draft else None,
            "server_bytes": self.server_bytes,
            "notes": self.notes,
        }

    def to_json_str(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    def format(self) -> str:
        def row(label, n, extra=""):
            return f"  {label:<28} {format_size(n):>11}  {extra}".rstrip()

        lines = [f"plan for {self.model_name or self.arch} ({self.arch}, {self.n_layer} layers, "
                 f"weights {format_size(self.weight_bytes)})",
                 f"budget {format_size(self.budget_bytes)} ({self.budget_bytes} bytes); "
                 f"floor {format_size(self.min_budget_bytes)} ({self.min_budget_bytes} bytes); "
                 f"planned {format_size(self.planned_bytes)}",
                 row("runtime baseline", self.baseline_bytes, "measured + allowance"),
                 row(f"scratch (n_batch {self.n_batch})", self.scratch_bytes),
                 row(f"KV cache (ctx {self.n_ctx})", self.kv_bytes,
                     (f"K {self.cache_type_k}, V inside K" if self.kv_v_in_k else
                      f"K {self.cache_type_k}, V {self.cache_type_v}")
                     + (", indexer keys" if self.kv_aux else "")
                     + (f", {self.kv_swa_layers} of {self.n_layer} layers hold only their "
                        f"{self.kv_window}-token window" if self.kv_swa_layers else "")),
                 row("I/O staging", self.io_staging_bytes),
                 row("stream slots (2 units)", self.stream_slot_bytes,
                     f"largest unit {format_size(self.stream_slot_bytes // 2)}"),
                 ]
        if self.draft:
            d = self.draft
            if d["weights_bytes"]:
                lines.append(row(f"draft model {d['name']}", self.draft_bytes,
                                 f"pinned whole: weights {format_size(d['weights_bytes'])}, KV "
                                 f"{format_size(d['kv_bytes'])}, scratch "
                                 f"{format_size(d['scratch_bytes'])}"))
            else:
                lines.append(row("resident-layers draft KV", self.draft_bytes,
                                 "the pinned layers' own KV (at most every layer's)"))
        if self.server_bytes:
            lines.append(row("server (Responses store)", self.server_bytes,
                             "stored responses, evicted past this"))
        for tier, label in (("pinned", "pinned weights"), ("cache", "weight cache"),
                            ("file", "file tier (streamed)")):
            names = self.tiers[tier]
            mem = self.tier_bytes[tier] if tier == "pinned" else (
                self.cache_bytes if tier == "cache" else 0)
            extra = f"{len(names)} tensors, {format_size(self.tier_bytes[tier])} of weights"
            if tier == "cache" and self.cache_slots:
                extra += (f", {self.cache_slots} slots x {format_size(self.cache_slot_bytes)}, "
                          f"expected hit rate {self.cache_hit_rate:.0%}")
            lines.append(row(label, mem, extra))
            if names:
                lines.append("      " + _summarize(names))
        if self.n_expert and not self.tiers["cache"]:
            lines.append(f"  experts: {format_size(self.expert_bytes)} in the file, "
                         f"{self.n_expert_used} of {self.n_expert} routed per token; all pinned")
        elif self.n_expert:
            lines.append(row("hot experts (pinned)", self.hot_bytes,
                             f"{len(self.hot_experts)} of {self.n_expert} x {self.n_layer_moe} "
                             f"experts, {self.hot_coverage:.0%} of recorded routings"))
            lines.append(f"  experts: {format_size(self.expert_bytes)} in the file, "
                         f"{self.n_expert_used} of {self.n_expert} routed per token; cache "
                         f"{self.cache_slots} slots x {format_size(self.cache_slot_bytes)}, hit "
                         f"rate >= {self.cache_hit_rate:.0%} (uniform routing), policy "
                         f"{self.expert_policy}")
        if self.embedding_by_rows:
            lines.append(f"  {self.embedding_by_rows} read by rows from the file (not held)")
        lines.append(f"per token: {format_size(self.mem_bytes_per_token)} read from memory, "
                     f"{format_size(self.disk_bytes_per_token)} from disk")
        lines.append(f"bandwidth ({self.bandwidth.source}): memory "
                     f"{self.bandwidth.mem_read_bytes_per_s / 1e9:.1f} GB/s, disk "
                     f"{self.bandwidth.disk_read_bytes_per_s / 1e9:.2f} GB/s -> predicted decode "
                     f"<= {self.predicted_tg_tokens_per_s:.2f} tokens/s"
                     + (" (I/O overlapped with compute)" if self.overlap_io else ""))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _summarize(names: list[str]) -> str:
    """'blk.*.attn_q.weight x32, output.weight' — group layer tensors by role."""
    c = Counter(_LAYER_RE.sub("blk.*.", n) for n in names)
    return ", ".join(f"{k} x{v}" if v > 1 else k for k, v in c.items())


def scratch_bytes(m: ModelDesc, n_batch: int, n_ctx: int, threads: int, *,
                  sample_rows: int = 1, scoring: bool = True, tokenize: bool = False,
                  serving: bool = False) -> int:
    """Activations and logits of a forward of n_batch tokens (f32 everywhere).
    sample_rows: logits rows one step returns at most (n_parallel x (1 + draft_max) when
    speculating: a verify step has a row per proposed token); scoring: perplexity, logprobs
    and KLD score slices of LOGITS_SLICE_ROWS rows (a draft and the server never score);
    tokenize: this runtime templates and tokenizes prompts (PROMPT_SCRATCH_BYTES; not a
    draft); serving: it does so while other sequences compute (memfit serve), where every
    other process does one thing at a time: its prompt is tokenized while only the forward's
    kept buffers exist, so the prompt's bytes and the forward's transient ones are a maximum,
    not a sum."""
    q_dim = m.n_head * m.head_dim
    kv_dim = m.n_head_kv * (m.head_dim + m.head_dim_v)
    # per row: the FFN's gate and up (buffers reused by every layer), Q/K/V and 4 rows of
    # n_embd (residual, norm, attention and FFN outputs); measured peaks of a 512-row
    # prefill: SmolLM2 7.7 MiB of the 12.4 this gives, Gemma-3 14.3 of 16
    per_tok = 2 * m.n_ff + 4 * m.n_embd + q_dim + kv_dim + m.act_extra
    # attention scores [rows, heads, n_ctx] for a block of at most ATTN_Q_BLOCK query rows
    scores = min(n_batch, ATTN_Q_BLOCK) * m.n_head * n_ctx
    scores += m.ctx_extra * n_ctx   # (glm-dsa's indexer)
    # Q8-style activation copy (csrc: 40 B per 32 or 320 B per 256 values, 1.25 bytes/elem)
    quant_act = n_batch * max(m.n_embd, m.n_ff) * 5 // 4
    forward = 4 * (n_batch * per_tok + scores) + quant_act + threads * THREAD_SCRATCH_BYTES
    # the FFN's gate and up buffers stay allocated between forwards (models/layers.py _scratch)
    kept = 4 * 2 * m.n_ff * n_batch + threads * THREAD_SCRATCH_BYTES
    # logits alive once the forward is done (its buffers stay allocated meanwhile): a step's
    # rows (f32), then the sampler's one row at a time (f32 shifted copy and f64 exp: 16 B)
    logits = m.n_vocab * (4 * min(sample_rows, n_batch) + 16)
    if scoring:
        logits = max(logits, m.n_vocab * 16 * LOGITS_SLICE_ROWS)
    extra = logits
    if tokenize:
        extra = (logits + PROMPT_SCRATCH_BYTES if serving
                 else max(logits, kept + PROMPT_SCRATCH_BYTES - forward))
    return forward + extra


def _units(m: ModelDesc, streamed: set[str]) -> list[Unit]:
    """Streamed units in execution order: per layer its streamed dense tensors, then
    non-layer tensors one per unit (experts are cached per expert, not streamed as units)."""
    by_layer: dict[int, list[TensorDesc]] = {}
    others = []
    for t in m.tensors:
        if t.name not in streamed or t.kind == "embedding":
            continue
        (by_layer.setdefault(t.layer, []) if t.layer is not None else others).append(t)
    units = []
    for layer in sorted(by_layer):
        ts = by_layer[layer]
        dense = [t for t in ts if t.kind != "expert"]
        if dense:
            units.append(Unit(f"blk.{layer}", [t.name for t in dense], sum(t.nbytes for t in dense)))
    # output_norm/output after the layers; anything else (rope_freqs...) too
    for t in others:
        units.append(Unit(t.name, [t.name], t.nbytes))
    return units


def _max_unit(units: list[Unit]) -> int:
    return max((u.nbytes for u in units), default=0)


def expert_tensor_names(il: int) -> tuple[str, str, str]:
    """The stacked expert tensors of layer il: (gate, up, down)."""
    return tuple(f"blk.{il}.ffn_{r}_exps.weight" for r in ("gate", "up", "down"))


def expert_slot_bytes(m: ModelDesc) -> int:
    """Bytes of one expert-cache slot: the largest layer's gate/up/down slices of one expert,
    each a page-aligned range (O_DIRECT reads whole pages: at most one page more per range)."""
    by_layer: dict[int, int] = {}
    for t in m.tensors:
        if t.kind == "expert" and m.n_expert:
            per = t.nbytes // m.n_expert
            by_layer[t.layer] = by_layer.get(t.layer, 0) + -(-per // PAGE) * PAGE + PAGE
    return max(by_layer.values(), default=0)


def kv_pool_tokens(n_ctx: int, n_parallel: int = 1) -> int:
    """Token rows of the engine's KV block pool: n_parallel sequences of n_ctx tokens, each
    rounded up to whole blocks (kv/storage.py kv_pool_blocks)."""
    from ..kv.storage import BLOCK_SIZE, kv_pool_blocks
    return kv_pool_blocks(n_ctx, n_parallel) * BLOCK_SIZE


def kv_bytes(m: ModelDesc, n_ctx: int, kv_bytes_per_elem: float | None, n_parallel: int = 1,
             cache_type_k: str = "f16", cache_type_v: str = "f16", n_batch: int = 512,
             window_group: bool = True) -> int:
    """The KV cache's line item: the engine's block pool for n_parallel sequences of n_ctx
    and steps of n_batch rows (its sliding-window layers hold their windows only), in its
    cache types (f16, q8_0, q4_0), or at kv_bytes_per_elem bytes per value when given."""
    if kv_bytes_per_elem is not None:
        return int(m.kv_pool_bytes(n_ctx, n_parallel, n_batch, "f32", "f32", window_group)
                   // 4 * kv_bytes_per_elem)
    return m.kv_pool_bytes(n_ctx, n_parallel, n_batch, cache_type_k, cache_type_v, window_group)


@dataclass
class _Floor:
    bytes: int
    trunk_need: int              # trunk weights that must be held (pinned units + 2 slots)
    best_k: int                  # trunk units pinned at the floor
    trunk_units: list[Unit]      # the trunk's units, largest first
    parts: dict[str, Any]


def _floor(m: ModelDesc, fixed, baseline: int, kv: int, min_batch: int, scratch) -> _Floor:
    """The smallest budget: fixed costs at the smallest batch, the trunk's streaming floor
    (pinning the k largest units costs them once; the rest streams through 2 slots) and slots
    for one layer's n_expert_used experts."""
    trunk = _units(m, {t.name for t in m.tensors if t.kind != "expert"})
    cand = sorted(trunk, key=lambda u: -u.nbytes)
    best_k, need = 0, None
    for k in range(len(cand) + 1):
        n = sum(u.nbytes for u in cand[:k]) + 2 * (cand[k].nbytes if k < len(cand) else 0)
        if need is None or n < need:
            best_k, need = k, n
        if k >= 16:
            break
    x_slots = m.n_expert_used * expert_slot_bytes(m) if m.n_expert else 0
    parts = {"baseline_bytes": baseline,
             "scratch_bytes": scratch(min_batch),
             "kv_bytes": kv, "io_staging_bytes": IO_STAGING_BYTES,
             "weights_bytes": need + x_slots, "pinned_units": [u.name for u in cand[:best_k]],
             "stream_unit_bytes": cand[best_k].nbytes if best_k < len(cand) else 0,
             "expert_slot_bytes": x_slots, "n_batch": min_batch}
    return _Floor(fixed(min_batch) + need + x_slots, need, best_k, cand, parts)


def _refuse(budget: int, fl: _Floor, n_ctx: int, cache_type_k: str) -> BudgetError:
    p = fl.parts
    unit = format_size(p["stream_unit_bytes"])
    parts = (f"baseline {format_size(p['baseline_bytes'])}, scratch "
             f"{format_size(p['scratch_bytes'])}, KV for ctx {n_ctx} {format_size(p['kv_bytes'])}"
             + (f", I/O staging {format_size(IO_STAGING_BYTES)}" if IO_STAGING_BYTES else "")
             + f", weights that must be held {format_size(fl.trunk_need)} ("
             + (f"the {fl.best_k} largest units pinned plus " if fl.best_k else "")
             + f"2 streaming slots of {unit})"
             + (f", expert slots for one layer {format_size(p['expert_slot_bytes'])}"
                if p["expert_slot_bytes"] else "")
             + (f", {p.get('draft_what', 'the draft model pinned whole')} "
                f"{format_size(p['draft_bytes'])}" if p.get("draft_bytes") else "")
             + (f", the server's Responses store {format_size(p['server_bytes'])} "
                f"(--response-store)" if p.get("server_bytes") else ""))
    return BudgetError(
        f"memory budget {format_size(budget)} ({budget} bytes) is below the floor for this "
        f"model: the smallest budget that works is {format_size(fl.bytes)} ({fl.bytes} bytes) "
        f"[{parts}]; raise --mem-budget to at least {_round_up_mib(fl.bytes)}MiB"
        + (" or lower --ctx" + (" or use a quantized KV cache (-ctk/-ctv q8_0)"
                                if str(cache_type_k).lower() == "f16" else "")
           if p["kv_bytes"] > fl.bytes // 4 else ""))


def _place_trunk(m: ModelDesc, room: int, fl: _Floor, skip: frozenset = frozenset()) -> set[str]:
    """Pinned trunk tensors within `room` bytes (their slots included): dense tensors by
    touched fraction, then kind priority, role, layer; candidates pin the k largest units
    and/or one role in every layer first, because a smaller largest unit frees slot memory.
    Tensors in `skip` are not pinned."""
    trunk = [t for t in m.tensors if t.kind != "expert" and t.name not in skip]

    def role(t: TensorDesc) -> str:
        return _LAYER_RE.sub("", t.name)

    cands = sorted(trunk, key=lambda t: (-(t.touched_per_token / max(t.nbytes, 1)),
                                         _KIND_PRIORITY[t.kind], role(t), t.layer or 0))
    size = {t.name: t.nbytes for t in trunk}

    def slots_for(pinned: set[str]) -> int:
        return 2 * _max_unit(_units(m, {t.name for t in trunk if t.name not in pinned}))

    def place(pre: list[str]) -> set[str] | None:
        pinned = set(pre)
        slots = slots_for(pinned)
        for _ in range(8):  # pinning shrinks the largest streamed unit, freeing slot memory
            left = room - slots - sum(size[n] for n in pinned)
            if left < 0:
                return None
            for t in cands:
                if t.name not in pinned and t.nbytes <= left:
                    pinned.add(t.name)
                    left -= t.nbytes
            new_slots = slots_for(pinned)
            if new_slots == slots:
                break
            slots = new_slots
        return pinned

    def streamed_bytes(pinned: set[str]) -> int:
        return sum(t.touched_per_token for t in trunk if t.name not in pinned)

    roles: list[str] = []
    for t in cands:
        if t.layer is not None and role(t) not in roles:
            roles.append(role(t))
    role_sets = [[]] + [[n for n in size if _LAYER_RE.sub("", n) in roles[:j]]
                        for j in range(1, len(roles) + 1)]
    best = None
    for k in sorted({0, 1, 2, 3, fl.best_k}):
        if k > len(fl.trunk_units):
            continue
        for rs in role_sets:
            p = place([n for u in fl.trunk_units[:k] for n in u.tensors] + rs)
            if p is not None and (best is None or streamed_bytes(p) < streamed_bytes(best)):
                best = p
    assert best is not None, "the floor check guarantees the floor's own placement fits"
    return best


@dataclass
class _Experts:
    pinned_whole: bool = False
    hot: list[tuple[int, int]] = field(default_factory=list)
    hot_bytes: int = 0
    hot_coverage: float = 0.0    # share of the recorded routings the hot set serves
    slot_bytes: int = 0
    slots: int = 0
    hit_rate: float = 0.0        # expected under uniform routing (a lower bound)


EXPERT_POLICIES = ("lru", "decay")   # policy.LRUPolicy, policy.DecayPolicy


def expert_switch(name: str) -> bool:
    """MEMFIT_EXPERT_HOTSET / MEMFIT_EXPERT_LOOKAHEAD: "0" turns that mechanism off (ablation
    benchmarks); unset, "" or "1" keeps it (the look-ahead: "1" at every step, unset as
    measured, memory/policy.py LookaheadDecision)."""
    import os
    v = os.environ.get(name, "").strip()
    if v not in ("", "0", "1"):
        from ..errors import RequestError
        raise RequestError(f"{name}={v!r} is not 0 or 1")
    return v != "0"
HOT_SHARE = 0.5   # at most this share of the expert memory above the floor goes to the hot set


def _place_experts(m: ModelDesc, room: int, counts) -> _Experts:
    """Experts within `room` bytes: all pinned when they fit; else the hottest recorded
    experts (routed more often than their layer's mean) pinned in up to HOT_SHARE of the
    room above one layer's k slots, and the cache gets the rest as slots."""
    experts = [t for t in m.tensors if t.kind == "expert"]
    total = sum(t.nbytes for t in experts)
    if not experts or not m.n_expert:
        return _Experts()
    if total <= room:
        return _Experts(pinned_whole=True, hit_rate=1.0)
    slot = expert_slot_bytes(m)
    layers = sorted({t.layer for t in experts})
    n_units = len(layers) * m.n_expert
    x = _Experts(slot_bytes=slot)
    if counts:
        hot_room = int(max(0, room - m.n_expert_used * slot) * HOT_SHARE)
        ranked = []
        for il in layers:
            c = list(counts.get(il, ())) if hasattr(counts, "get") else []
            tot = sum(c)
            if len(c) != m.n_expert or tot <= 0:
                continue
            mean = tot / m.n_expert
            ranked += [(v / tot, il, e) for e, v in enumerate(c) if v > mean]
        ranked.sort(reverse=True)
        for share, il, e in ranked:
            if x.hot_bytes + slot > hot_room:
                break
            x.hot.append((il, e))
            x.hot_bytes += slot
        all_c = sum(sum(counts.get(il, ())) for il in layers)
        hot_c = sum(counts[il][e] for il, e in x.hot)
        x.hot_coverage = hot_c / all_c if all_c else 0.0
        x.hot.sort()
    x.slots = min((room - x.hot_bytes) // slot, n_units - len(x.hot))
    x.hit_rate = min(1.0, (len(x.hot) + x.slots) / n_units)
    return x


def plan(model: ModelDesc, budget: int, n_ctx: int, threads: int, bandwidth: Bandwidth,
         *, baseline_bytes: int, n_batch: int = 512, overlap_io: bool = True,
         draft_rows: int = 0, kv_bytes_per_elem: float | None = None, n_parallel: int = 1,
         cache_type_k: str = "f16", cache_type_v: str = "f16", expert_counts=None, expert_policy: str = "lru",
         constrained: bool = False, draft: ModelDesc | None = None,
         resident_draft: bool = False, serving: bool = False, server_bytes: int = 0) -> Plan:
    """Place every tensor in a tier within `budget` bytes. Pure: no I/O, no measurement.
    baseline_bytes: the measured runtime RSS; kv_bytes_per_elem: 2 for the f16 cache (4 for f32);
    draft_rows: tokens a speculative step proposes per sequence at most (spec's draft_max; each
    is a logits row of the verify step);
    expert_counts: {layer: [routings per expert]} learned from earlier runs (hotset.py);
    constrained: reserve the structured-output tables (constrain.tokenizer.table_bytes: built
    once per vocabulary at the first constrained request; `memfit serve` always reserves them);
    draft: a draft model (speculative decoding), pinned whole with its own KV pool (K's cache
    type for K and V) and scratch: a fixed cost, counted before the target's weights;
    resident_draft: the resident-layers draft (spec/resident.py) runs the target's own pinned
    weights with a KV pool of its own, reserved at the size of every layer's (an upper bound:
    which layers it runs depends on this placement); serving: the plan of `memfit serve`
    (its web stack, imported after planning, and the structured-output tables);
    server_bytes: what `memfit serve` keeps between requests (its Responses store, which
    evicts when its ledger entry would pass this): a fixed cost like the draft's.
    Order: fixed costs (baseline, scratch, KV, staging), the dense trunk, the hot experts, the
    expert cache; below the floor BudgetError names the smallest budget that works."""
    assert n_ctx > 0 and threads > 0 and n_batch > 0 and n_parallel > 0
    COUNTS["plan"] += 1
    m = model
    if m.v_in_k:   # V is read from K (MLA): it has K's type and costs nothing of its own
        cache_type_v = cache_type_k
    n_batch = min(n_batch, n_ctx)  # a prefill batch never exceeds the context
    # the engine's pool at this n_batch (the engine runs at the plan's, never more)
    kv = kv_bytes(m, n_ctx, kv_bytes_per_elem, n_parallel, cache_type_k, cache_type_v, n_batch)
    # the runtime as it stays once loaded: the larger of its prediction (IMPORT_BYTES) and the
    # measured RSS (interpreter, libraries, the parsed file) plus what the tokenizer keeps. The
    # tokenizer's transient peak (runtime_bytes) comes and goes before any budgeted
    # allocation: it only bounds the budget from below (the floor below).
    kept = max(baseline_bytes + m.tokenizer_kept_bytes,
               m.loaded_runtime_bytes + (SERVE_PLAN_IMPORT_BYTES if serving else 0))
    load_peak = max(baseline_bytes, m.runtime_bytes) + RUNTIME_EXTRA_BYTES
    if serving:
        kept += SERVE_IMPORT_BYTES
        constrained = True
    baseline = kept + RUNTIME_EXTRA_BYTES
    if constrained:
        from ..constrain.tokenizer import table_bytes
        baseline += table_bytes(m.n_vocab, lean=True)

    def scratch(nb: int) -> int:
        """The target's forward at batch nb, the logits a step samples, a prompt tokenized."""
        return scratch_bytes(m, nb, n_ctx, threads, sample_rows=n_parallel * (1 + draft_rows),
                             scoring=not serving, tokenize=True, serving=serving)

    dparts = {}
    if draft is not None:   # the draft's pool keeps every layer's whole context
        dparts = {"name": draft.name or draft.arch, "weights_bytes": draft.weight_bytes,
                  "kv_bytes": kv_bytes(draft, n_ctx, kv_bytes_per_elem, n_parallel,
                                       cache_type_k, cache_type_k, window_group=False),
                  "scratch_bytes": scratch_bytes(draft, n_batch, n_ctx, threads,
                                                 sample_rows=n_parallel, scoring=False)}
    elif resident_draft:
        dparts = {"name": "(resident layers)", "weights_bytes": 0, "scratch_bytes": 0,
                  "kv_bytes": kv_bytes(m, n_ctx, kv_bytes_per_elem, n_parallel, cache_type_k,
                                       cache_type_v, window_group=False)}
    draft_total = sum(v for k, v in dparts.items() if k != "name")

    def fixed(nb: int) -> int:
        return (baseline + scratch(nb) + kv
                + IO_STAGING_BYTES + draft_total + server_bytes)

    min_batch = min(n_batch, MIN_BATCH)
    fl = _floor(m, fixed, baseline, kv, min_batch, scratch)
    fl.bytes = max(fl.bytes, load_peak)
    fl.parts["draft_bytes"] = draft_total
    fl.parts["server_bytes"] = server_bytes
    if dparts and not dparts["weights_bytes"]:
        fl.parts["draft_what"] = "the resident-layers draft's KV"
    if budget < fl.bytes:
        raise _refuse(budget, fl, n_ctx, cache_type_k)
    x_floor = fl.parts["expert_slot_bytes"]
    # largest prefill batch (halving from n_batch) that still fits
    nb = n_batch
    while nb > min_batch and fixed(nb) + fl.trunk_need + x_floor > budget:
        nb = max(min_batch, nb // 2)
    base_used = fixed(nb)

    # the trunk first (keeping one layer's expert slots), then the experts get what is left
    size = {t.name: t.nbytes for t in m.tensors}

    def trunk_then_experts(skip=frozenset()):
        pinned = _place_trunk(m, budget - base_used - x_floor, fl, skip)
        streamed = {t.name for t in m.tensors if t.name not in pinned and t.kind != "expert"}
        units = _units(m, streamed)
        slots = 2 * _max_unit(units)
        left = budget - base_used - slots - sum(size[n] for n in pinned)
        assert left >= x_floor, (left, budget, base_used, slots)
        return pinned, streamed, units, slots, _place_experts(m, left, expert_counts)

    pinned, streamed, units, slots, x = trunk_then_experts()
    emb0 = next((t for t in m.tensors if t.kind == "embedding"), None)
    if emb0 is not None and emb0.name in pinned and m.n_expert and not x.pinned_whole:
        # an untied token embedding is read one row per token (a few KiB from the file):
        # its bytes hold expert-cache slots instead, each worth a share of an expert's
        # megabytes every token
        pinned, streamed, units, slots, x = trunk_then_experts(frozenset({emb0.name}))
    experts = [t for t in m.tensors if t.kind == "expert"]
    if x.pinned_whole:
        pinned |= {t.name for t in experts}

    notes = []
    emb = next((t for t in m.tensors if t.kind == "embedding"), None)
    emb_rows = emb.name if emb is not None and emb.name not in pinned else None
    cache_names = [t.name for t in experts if not x.pinned_whole]
    if cache_names:
        notes.append(f"expert cache hit rate {x.hit_rate:.0%} assumes uniform routing (hot set "
                     "and cache share of all experts); real routing is skewed, so this is a "
                     "lower bound")
    elif units:
        notes.append("no weight cache for a dense model: every streamed weight is read once per "
                     "token in layer order, and an LRU cache smaller than that cyclic scan hits "
                     "~0%; the budget pins a fixed subset instead (the optimum for a scan)")
    tiers = {"pinned": [t.name for t in m.tensors if t.name in pinned],
             "cache": cache_names,
             "file": [t.name for t in m.tensors if t.name in streamed]}
    tier_bytes = {k: sum(size[n] for n in v) for k, v in tiers.items()}
    mem, disk, tps = _predict(m, streamed, x, emb_rows, bandwidth, overlap_io, notes)
    if nb < n_batch:
        notes.append(f"prefill batch lowered from {n_batch} to {nb} to fit the budget")
    return Plan(
        budget_bytes=budget, n_ctx=n_ctx, n_batch=nb, threads=threads, baseline_bytes=baseline,
        scratch_bytes=scratch(nb), kv_bytes=kv,
        io_staging_bytes=IO_STAGING_BYTES, stream_slot_bytes=slots, tiers=tiers,
        tier_bytes=tier_bytes, cache_bytes=x.slots * x.slot_bytes,
        cache_slot_bytes=x.slot_bytes, cache_slots=x.slots, cache_hit_rate=x.hit_rate,
        units=units, embedding_by_rows=emb_rows, min_budget_bytes=fl.bytes,
        mem_bytes_per_token=mem, disk_bytes_per_token=disk, bandwidth=bandwidth,
        overlap_io=overlap_io, predicted_tg_tokens_per_s=tps, model_name=m.name, arch=m.arch,
        n_layer=m.n_layer, weight_bytes=m.weight_bytes, notes=notes, tensor_bytes=size,
        floor_parts=fl.parts, n_expert=m.n_expert, n_expert_used=m.n_expert_used,
        expert_bytes=sum(t.nbytes for t in experts), hot_experts=x.hot,
        hot_bytes=x.hot_bytes, hot_coverage=x.hot_coverage, expert_policy=expert_policy,
        cache_type_k=str(cache_type_k).lower(), cache_type_v=str(cache_type_v).lower(),
        kv_v_in_k=m.v_in_k, kv_aux=m.kv_aux, draft=dparts, server_bytes=server_bytes,
        kv_swa_layers=len(m.kv_swa_layers) if m.kv_pool_bytes(n_ctx, n_parallel, n_batch) <
        m.kv_pool_bytes(n_ctx, n_parallel, n_batch, window_group=False) else 0,
        kv_window=m.kv_window)


def _predict(m: ModelDesc, streamed: set[str], x: _Experts, emb_rows, bandwidth: Bandwidth,
             overlap_io: bool, notes: list[str]) -> tuple[int, int, float]:
    """(bytes read from memory per token, from disk per token, predicted tokens/s)."""
    emb = next((t for t in m.tensors if t.kind == "embedding"), None)
    experts = [t for t in m.tensors if t.kind == "expert"]
    dense_streamed = sum(t.nbytes for t in m.tensors
                         if t.name in streamed and t.kind not in ("expert", "embedding"))
    expert_disk = 0 if x.pinned_whole else sum(t.touched_per_token for t in experts) * (1.0 - x.hit_rate)
    disk = dense_streamed + int(expert_disk) + (emb.touched_per_token if emb_rows else 0)
    mem = sum(t.touched_per_token for t in m.tensors)
    t_mem = mem / bandwidth.mem_read_bytes_per_s
    t_disk = disk / bandwidth.disk_read_bytes_per_s
    t = max(t_mem, t_disk) if overlap_io else t_mem + t_disk
    if disk:
        notes.append(f"decode is bounded by the disk: {format_size(disk)} streamed per token"
                     if t_disk >= t_mem else "decode is bounded by memory bandwidth")
        if t_disk >= t_mem and "observed" not in bandwidth.source:
            notes.append("disk rate from a probe (its second pass over the same bytes, as decode "
                         "re-reads them each token), not yet from the weight store; after one "
                         "run plans use the store's own rate")
    return mem, disk, (1.0 / t if t > 0 else float("inf"))


def _round_up_mib(n: int) -> int:
    return -(-n // MiB)


def plan_for_path(path, budget: int, n_ctx: int | None = None, threads: int | None = None, *,
                  baseline_bytes: int | None = None, bandwidth: Bandwidth | None = None,
                  measure_bandwidth: bool = False, n_batch: int = 512,
                  kv_bytes_per_elem: float | None = None, n_parallel: int = 1,
                  cache_type_k: str = "f16", cache_type_v: str = "f16", expert_counts=None,
                  expert_policy: str | None = None) -> Plan:
    """Convenience for the CLI/API: describe the GGUF (a path, or a GGUFFile already open,
    used as is: the API plans the file it has opened, not a second copy), measure baseline
    (this process's RSS) and bandwidth (cached/default unless measure_bandwidth), and plan.
    n_ctx defaults to min(model context_length, 4096)."""
    import os

    from ..gguf import open_gguf
    from .bandwidth import get_bandwidth
    from .budget import measure_baseline

    opened = None if hasattr(path, "tensors") else open_gguf(path)
    f = opened if opened is not None else path
    try:
        desc = ModelDesc.from_gguf(f)
        if n_ctx is None:
            n_ctx = min(int(f.metadata.get(f"{f.arch}.context_length", 4096) or 4096), 4096)
        path = f.paths[0]
    finally:
        if opened is not None:
            opened.close()
    if expert_policy is None:
        expert_policy = os.environ.get("MEMFIT_EXPERT_POLICY", "") or "lru"
    if expert_policy not in EXPERT_POLICIES:
        from ..errors import RequestError
        raise RequestError(f"expert cache policy {expert_policy!r} is not one of "
                           f"{', '.join(EXPERT_POLICIES)} (MEMFIT_EXPERT_POLICY)")
    if desc.n_expert and expert_counts is None and not expert_switch("MEMFIT_EXPERT_HOTSET"):
        expert_counts = {}  # no hot set: every expert goes through the cache
    if desc.n_expert and expert_counts is None:
        from .hotset import RoutingCounts
        expert_counts = RoutingCounts.load(path, desc.n_layer, desc.n_expert).by_layer()
    args = (desc, budget, n_ctx, threads or os.cpu_count() or 1)
    kw = dict(baseline_bytes=measure_baseline() if baseline_bytes is None else baseline_bytes,
              n_batch=n_batch, kv_bytes_per_elem=kv_bytes_per_elem, n_parallel=n_parallel,
              cache_type_k=cache_type_k, cache_type_v=cache_type_v, expert_counts=expert_counts, expert_policy=expert_policy)
    if bandwidth is None and measure_bandwidth:
        # refuse a budget below the floor before the probes allocate or write anything
        plan(*args, Bandwidth(source="default"), **kw)
    bw = bandwidth or get_bandwidth(path, measure=measure_bandwidth)
    return plan(*args, bw, **kw)


__all__ = ["TensorDesc", "ModelDesc", "Unit", "Plan", "plan", "plan_for_path", "scratch_bytes",
           "expert_tensor_names", "expert_slot_bytes", "kv_bytes",
           "tensor_kind", "describe_tensor", "IO_STAGING_BYTES", "LOGITS_SLICE_ROWS", "GiB"]
