"""The planner: a pure function (model description + budget + context + threads -> Plan).

It fills the budget in this order: runtime baseline (measured), scratch/activations, KV cache
for n_ctx, I/O staging, two streaming slots (double buffering of the largest streamed unit),
then pins weights by bytes touched per token, gives MoE experts a slot cache with what is
left, and leaves the rest in the file tier (streamed every token). Below the floor it raises
BudgetError stating the smallest budget that would work.

A streamed *unit* is what the store fetches at once: all streamed dense tensors of one layer
(blk.N), or one non-layer tensor (output.weight), or for MoE n_expert_used expert slices.
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

KINDS = ("embedding", "output", "norm", "attn", "ffn", "router", "expert", "other")
# pin order among tensors touched in full per token: small + always-needed first
_KIND_PRIORITY = {"norm": 0, "other": 1, "router": 2, "attn": 3, "output": 4, "ffn": 5,
                  "expert": 6, "embedding": 7}
# The store reads straight into its page-aligned slots/pinned buffers (O_DIRECT), so no bounce
# buffers exist; the ledger category stays for backends that need them.
IO_STAGING_BYTES = 0
# Runtime RSS predicted from the model alone, so `memfit plan` and `memfit run` agree on the
# floor (the planner takes max(prediction, measured RSS)). Measured on x86-64 Linux, Python
# 3.11: python + numpy + memfit + native ext + tokenizers imported = 35 MiB; GGUF metadata
# parse + tokenizer build, peak above that, per vocabulary entry: BPE 440 B (+ 550 B per
# merge), SentencePiece 290 B (Qwen2-1.5B-shaped 152k BPE 65 MiB, SmolLM2 49k+49k merges
# 48 MiB, Gemma-3 262k SPM 72 MiB). The constants below carry ~10% on top of that.
RUNTIME_BASE_BYTES = 40 * MiB
TOKENIZER_BYTES_PER_TOKEN = 480   # BPE; SentencePiece (tokenizer model 'llama') costs less
SPM_BYTES_PER_TOKEN = 320
TOKENIZER_BYTES_PER_MERGE = 600
# after the plan: model objects, float32 norms, I/O + kernel thread stacks, allocator slack
RUNTIME_EXTRA_BYTES = 24 * MiB
MIN_BATCH = 64                    # smallest prefill batch the planner will choose
THREAD_SCRATCH_BYTES = 2 * MiB    # per-thread kernel scratch (quantized activations, tiles)
ATTN_Q_BLOCK = 64                 # query rows whose scores over the context exist at once
# logits rows alive at once outside the forward (perplexity scores slices of this many rows;
# the sampler copies one row), each with an f32 shifted copy and f64 exp: 16 bytes per entry
LOGITS_SLICE_ROWS = 8
_LAYER_RE = re.compile(r"^blk\.(\d+)\.")


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

    @property
    def runtime_bytes(self) -> int:
        """Predicted RSS of the runtime with this model's metadata and tokenizer loaded."""
        per_tok = SPM_BYTES_PER_TOKEN if self.tokenizer_model == "llama" else TOKENIZER_BYTES_PER_TOKEN
        return (RUNTIME_BASE_BYTES + per_tok * self.n_vocab
                + TOKENIZER_BYTES_PER_MERGE * self.n_merges)

    @property
    def kv_bytes_per_token(self) -> int:
        """f32 K and V of every layer for one position."""
        return self.kv_elems_per_token * 4

    @property
    def kv_elems_per_token(self) -> int:
        return self.n_layer * self.n_head_kv * (self.head_dim + self.head_dim_v)

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @staticmethod
    def from_gguf(f, name: str = "") -> "ModelDesc":
        """Description from an open GGUFFile (memfit.gguf.open_gguf)."""
        md, arch = f.metadata, f.arch

        def get(key, default=None):
            v = md.get(f"{arch}.{key}", default)
            if isinstance(v, list):  # per-layer arrays (e.g. head_count_kv): the largest
                v = max(v) if v else default
            return v

        n_layer = int(get("block_count", 0))
        n_embd = int(get("embedding_length", 0))
        n_head = int(get("attention.head_count", 1) or 1)
        n_head_kv = int(get("attention.head_count_kv", n_head) or n_head)
        head_dim = int(get("attention.key_length", n_embd // max(n_head, 1)))
        head_dim_v = int(get("attention.value_length", head_dim))
        toks = md.get("tokenizer.ggml.tokens")
        n_vocab = int(get("vocab_size", len(toks) if toks else 0))
        n_ff = int(get("feed_forward_length", 0) or 0)
        n_expert = int(get("expert_count", 0) or 0)
        n_used = int(get("expert_used_count", 0) or 0)
        tied = "output.weight" not in f.tensors
        if n_ff == 0 and n_expert:
            n_ff = int(get("expert_feed_forward_length", 0) or 0) * max(n_used, 1)
        ts = []
        for ti in f.tensors.values():
            ts.append(describe_tensor(ti.name, ti.nbytes, ti.shape, tied, n_expert, n_used))
        if not n_vocab and "token_embd.weight" in f.tensors:
            n_vocab = f.tensors["token_embd.weight"].shape[0]
        merges = md.get("tokenizer.ggml.merges")
        return ModelDesc(arch, n_layer, n_embd, n_head, n_head_kv, head_dim, head_dim_v,
                         n_vocab, n_ff, tuple(ts), n_expert, n_used, tied,
                         int(getattr(f, "file_size", 0) or 0), name or str(md.get("general.name", "")),
                         str(md.get("tokenizer.ggml.model", "") or ""),
                         len(merges) if isinstance(merges, list) else 0)


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
            return "expert"
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

    def tier_of(self, name: str) -> str:
        for tier, names in self.tiers.items():
            if name in names:
                return tier
        raise KeyError(name)

    @property
    def planned_bytes(self) -> int:
        return (self.baseline_bytes + self.scratch_bytes + self.kv_bytes + self.io_staging_bytes
                + self.stream_slot_bytes + self.tier_bytes["pinned"] + self.cache_bytes)

    def breakdown(self) -> dict[str, int]:
        """Ledger categories -> planned bytes."""
        return {"baseline": self.baseline_bytes, "scratch": self.scratch_bytes,
                "kv": self.kv_bytes, "resident_weights": self.tier_bytes["pinned"],
                "weight_cache": self.cache_bytes + self.stream_slot_bytes,
                "io_staging": self.io_staging_bytes}

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
            "stream_slot_bytes": self.stream_slot_bytes,
            "tiers": {t: {"bytes": self.tier_bytes[t], "n_tensors": len(n), "tensors": n}
                      for t, n in self.tiers.items()},
            "cache": {"bytes": self.cache_bytes, "slot_bytes": self.cache_slot_bytes,
                      "slots": self.cache_slots, "expected_hit_rate": self.cache_hit_rate},
            "units": [{"name": u.name, "bytes": u.nbytes, "tensors": u.tensors} for u in self.units],
            "embedding_by_rows": self.embedding_by_rows,
            "mem_bytes_per_token": self.mem_bytes_per_token,
            "disk_bytes_per_token": self.disk_bytes_per_token,
            "mem_read_bytes_per_s": self.bandwidth.mem_read_bytes_per_s,
            "disk_read_bytes_per_s": self.bandwidth.disk_read_bytes_per_s,
            "bandwidth_source": self.bandwidth.source, "overlap_io": self.overlap_io,
            "predicted_tg_tokens_per_s": self.predicted_tg_tokens_per_s,
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
                 row(f"KV cache (ctx {self.n_ctx})", self.kv_bytes),
                 row("I/O staging", self.io_staging_bytes),
                 row("stream slots (2 units)", self.stream_slot_bytes,
                     f"largest unit {format_size(self.stream_slot_bytes // 2)}"),
                 ]
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


def kv_pool_tokens(n_ctx: int, n_parallel: int = 1) -> int:
    """Token rows of the engine's KV block pool: n_parallel sequences of n_ctx tokens, each
    rounded up to whole blocks (engine.engine.kv_pool_blocks)."""
    from ..kv.pool import BLOCK_SIZE
    return n_parallel * -(-n_ctx // BLOCK_SIZE) * BLOCK_SIZE


def scratch_bytes(m: ModelDesc, n_batch: int, n_ctx: int, threads: int,
                  logits_all: bool = False) -> int:
    """Activation/scratch estimate for a batch of n_batch tokens (f32 everywhere)."""
    q_dim = m.n_head * m.head_dim
    kv_dim = m.n_head_kv * (m.head_dim + m.head_dim_v)
    per_tok = 6 * m.n_embd + q_dim + kv_dim + m.n_head * m.head_dim_v + 3 * m.n_ff
    per_tok *= 2  # numpy temporaries beside the named buffers
    # attention scores [rows, heads, n_ctx] for a block of at most ATTN_Q_BLOCK query rows
    scores = min(n_batch, ATTN_Q_BLOCK) * m.n_head * n_ctx
    logits = m.n_vocab * (4 * n_batch if logits_all else 16 * LOGITS_SLICE_ROWS)
    # Q8-style activation copy (csrc: 40 B per 32 or 320 B per 256 values, 1.25 bytes/elem)
    quant_act = n_batch * max(m.n_embd, m.n_ff) * 5 // 4
    return (4 * (n_batch * per_tok + scores) + logits + quant_act
            + threads * THREAD_SCRATCH_BYTES)


def _units(m: ModelDesc, streamed: set[str]) -> list[Unit]:
    """Streamed units in execution order: per layer its streamed dense tensors (+ expert
    slices), then non-layer tensors one per unit."""
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
        exps = [t for t in ts if t.kind == "expert"]
        if dense:
            units.append(Unit(f"blk.{layer}", [t.name for t in dense], sum(t.nbytes for t in dense)))
        if exps:
            units.append(Unit(f"blk.{layer}.experts", [t.name for t in exps],
                              sum(t.touched_per_token for t in exps)))
    # output_norm/output after the layers; anything else (rope_freqs...) too
    for t in others:
        units.append(Unit(t.name, [t.name], t.nbytes))
    return units


def _max_unit(units: list[Unit]) -> int:
    return max((u.nbytes for u in units), default=0)


def plan(model: ModelDesc, budget: int, n_ctx: int, threads: int, bandwidth: Bandwidth,
         *, baseline_bytes: int, n_batch: int = 512, overlap_io: bool = True,
         logits_all: bool = False, kv_bytes_per_elem: float = 2, n_parallel: int = 1) -> Plan:
    """Place every tensor in a tier within `budget` bytes. Pure: no I/O, no measurement.
    baseline_bytes: the measured runtime RSS; kv_bytes_per_elem: 2 for the f16 cache (4 for f32).
    The KV cache is the engine's block pool for n_parallel sequences of n_ctx tokens."""
    assert n_ctx > 0 and threads > 0 and n_batch > 0 and n_parallel > 0
    m = model
    kv = int(m.kv_elems_per_token * kv_pool_tokens(n_ctx, n_parallel) * kv_bytes_per_elem)
    # the larger of the measured RSS and the model's predicted runtime (see RUNTIME_BASE_BYTES)
    baseline = max(baseline_bytes, m.runtime_bytes) + RUNTIME_EXTRA_BYTES
    n_batch = min(n_batch, n_ctx)  # a prefill batch never exceeds the context
    all_stream = _units(m, {t.name for t in m.tensors})

    def fixed(nb: int) -> int:
        return baseline + scratch_bytes(m, nb, n_ctx, threads, logits_all) + kv + IO_STAGING_BYTES

    min_batch = min(n_batch, MIN_BATCH)
    # floor: pinning the k largest units costs them once; streaming the rest costs 2 slots
    cand_units = sorted((u for u in all_stream if not u.name.endswith(".experts")),
                        key=lambda u: -u.nbytes)
    exp_unit = max((u.nbytes for u in all_stream if u.name.endswith(".experts")), default=0)
    best_k, need = 0, None
    for k in range(len(cand_units) + 1):
        nxt = max(cand_units[k].nbytes if k < len(cand_units) else 0, exp_unit)
        n = sum(u.nbytes for u in cand_units[:k]) + 2 * nxt
        if need is None or n < need:
            best_k, need = k, n
        if k >= 16:
            break
    floor = fixed(min_batch) + need
    floor_parts = {"baseline_bytes": baseline,
                   "scratch_bytes": scratch_bytes(m, min_batch, n_ctx, threads, logits_all),
                   "kv_bytes": kv, "io_staging_bytes": IO_STAGING_BYTES,
                   "weights_bytes": need, "pinned_units": [u.name for u in cand_units[:best_k]],
                   "stream_unit_bytes": max(cand_units[best_k].nbytes
                                            if best_k < len(cand_units) else 0, exp_unit),
                   "n_batch": min_batch}
    if budget < floor:
        unit = format_size(floor_parts["stream_unit_bytes"])
        parts = (f"baseline {format_size(baseline)}, scratch "
                 f"{format_size(floor_parts['scratch_bytes'])}, KV for ctx {n_ctx} "
                 f"{format_size(kv)}"
                 + (f", I/O staging {format_size(IO_STAGING_BYTES)}" if IO_STAGING_BYTES else "")
                 + f", weights that must be held {format_size(need)} ("
                 + (f"the {best_k} largest units pinned plus " if best_k else "")
                 + f"2 streaming slots of {unit})")
        raise BudgetError(
            f"memory budget {format_size(budget)} ({budget} bytes) is below the floor for this "
            f"model: the smallest budget that works is {format_size(floor)} ({floor} bytes) "
            f"[{parts}]; raise --mem-budget to at least {_round_up_mib(floor)}MiB"
            + (" or lower --ctx" if kv > floor // 4 else ""))
    # largest prefill batch (halving from n_batch) that still fits
    nb = n_batch
    while nb > min_batch and fixed(nb) + need > budget:
        nb = max(min_batch, nb // 2)
    base_used = fixed(nb)

    # pin candidates: dense tensors by touched fraction, then kind priority, role, layer
    def role(t: TensorDesc) -> str:
        return _LAYER_RE.sub("", t.name)

    cands = sorted((t for t in m.tensors if t.kind != "expert"),
                   key=lambda t: (-(t.touched_per_token / max(t.nbytes, 1)),
                                  _KIND_PRIORITY[t.kind], role(t), t.layer or 0))
    size = {t.name: t.nbytes for t in m.tensors}

    def place(prepin: list[Unit]) -> set[str] | None:
        pinned = {n for u in prepin for n in u.tensors}
        streamed = {t.name for t in m.tensors if t.name not in pinned}
        slots = 2 * _max_unit(_units(m, streamed))
        for _ in range(8):  # pinning shrinks the largest streamed unit, freeing slot memory
            room = budget - base_used - slots - sum(size[n] for n in pinned)
            if room < 0:
                return None
            for t in cands:
                if t.name not in pinned and t.nbytes <= room:
                    pinned.add(t.name)
                    room -= t.nbytes
            streamed = {t.name for t in m.tensors if t.name not in pinned}
            new_slots = 2 * _max_unit(_units(m, streamed))
            if new_slots == slots:
                break
            slots = new_slots
        return pinned

    def streamed_bytes(pinned: set[str]) -> int:
        return sum(t.touched_per_token for t in m.tensors if t.name not in pinned)

    # candidates: pin the k largest units and/or one role (attn_q, ffn_up, ...) in every layer
    # before the greedy fill, because a smaller largest-streamed-unit frees slot memory
    roles: list[str] = []
    for t in cands:
        if t.layer is not None and role(t) not in roles:
            roles.append(role(t))
    role_sets = [[]] + [[n for n in size if _LAYER_RE.sub("", n) in roles[:j]]
                        for j in range(1, len(roles) + 1)]
    best = None
    for k in sorted({0, 1, 2, 3, best_k}):
        if k > len(cand_units):
            continue
        for rs in role_sets:
            pre = [Unit("", [n for u in cand_units[:k] for n in u.tensors] + rs, 0)]
            p = place(pre)
            if p is not None and (best is None or streamed_bytes(p) < streamed_bytes(best)):
                best = p
    assert best is not None, "the floor check guarantees the floor's own placement fits"
    pinned = best
    streamed = {t.name for t in m.tensors if t.name not in pinned}
    units = _units(m, streamed)
    slots = 2 * _max_unit(units)
    pinned_bytes = sum(t.nbytes for t in m.tensors if t.name in pinned)
    left = budget - base_used - slots - pinned_bytes
    assert left >= 0, (left, budget, base_used, slots, pinned_bytes)

    notes = []
    emb = next((t for t in m.tensors if t.kind == "embedding"), None)
    emb_rows = emb.name if emb is not None and emb.name not in pinned else None
    # MoE: what is left becomes a slot cache of expert slices (one expert of one tensor)
    experts = [t for t in m.tensors if t.kind == "expert"]
    cache_names, cache_bytes, slot_bytes, n_slots, hit = [], 0, 0, 0, 0.0
    expert_total = sum(t.nbytes for t in experts)
    if experts and m.n_expert:
        slot_bytes = max(t.nbytes // m.n_expert for t in experts)
        n_slots = left // slot_bytes if slot_bytes else 0
        cache_bytes = n_slots * slot_bytes
        cache_names = [t.name for t in experts]
        hit = min(1.0, cache_bytes / expert_total) if expert_total else 0.0
        notes.append(f"expert cache hit rate {hit:.0%} assumes uniform routing (cache share of "
                     "all expert bytes); real routing is skewed, so this is a lower bound")
    elif units:
        notes.append("no weight cache for a dense model: every streamed weight is read once per "
                     "token in layer order, and an LRU cache smaller than that cyclic scan hits "
                     "~0%; the budget pins a fixed subset instead (the optimum for a scan)")
    file_names = [t.name for t in m.tensors if t.name in streamed and t.kind != "expert"]
    tiers = {"pinned": [t.name for t in m.tensors if t.name in pinned],
             "cache": cache_names, "file": file_names}
    tb = {t.name: t.nbytes for t in m.tensors}
    tier_bytes = {k: sum(tb[n] for n in v) for k, v in tiers.items()}

    dense_streamed = sum(t.nbytes for t in m.tensors
                         if t.name in streamed and t.kind not in ("expert", "embedding"))
    expert_disk = sum(t.touched_per_token for t in experts) * (1.0 - hit)
    disk = dense_streamed + int(expert_disk) + (emb.touched_per_token if emb_rows else 0)
    mem = sum(t.touched_per_token for t in m.tensors)
    t_mem = mem / bandwidth.mem_read_bytes_per_s
    t_disk = disk / bandwidth.disk_read_bytes_per_s
    t = max(t_mem, t_disk) if overlap_io else t_mem + t_disk
    tps = 1.0 / t if t > 0 else float("inf")
    if disk:
        notes.append(f"decode is bounded by the disk: {format_size(disk)} streamed per token"
                     if t_disk >= t_mem else "decode is bounded by memory bandwidth")
        if t_disk >= t_mem and "observed" not in bandwidth.source:
            notes.append("disk rate from a cold probe, not yet from the weight store: decode "
                         "re-reads the same bytes each token, which a virtual disk's host cache "
                         "can serve faster; after one run plans use the store's own rate")
    if nb < n_batch:
        notes.append(f"prefill batch lowered from {n_batch} to {nb} to fit the budget")
    return Plan(budget, n_ctx, nb, threads, baseline, scratch_bytes(m, nb, n_ctx, threads,
                logits_all), kv, IO_STAGING_BYTES, slots, tiers, tier_bytes, cache_bytes,
                slot_bytes, n_slots, hit, units, emb_rows, floor, mem, disk, bandwidth,
                overlap_io, tps, m.name, m.arch, m.n_layer, m.weight_bytes, notes, tb,
                floor_parts)


def _round_up_mib(n: int) -> int:
    return -(-n // MiB)


def plan_for_path(path, budget: int, n_ctx: int | None = None, threads: int | None = None, *,
                  baseline_bytes: int | None = None, bandwidth: Bandwidth | None = None,
                  measure_bandwidth: bool = False, n_batch: int = 512,
                  kv_bytes_per_elem: float = 2, n_parallel: int = 1) -> Plan:
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
    args = (desc, budget, n_ctx, threads or os.cpu_count() or 1)
    kw = dict(baseline_bytes=measure_baseline() if baseline_bytes is None else baseline_bytes,
              n_batch=n_batch, kv_bytes_per_elem=kv_bytes_per_elem, n_parallel=n_parallel)
    if bandwidth is None and measure_bandwidth:
        # refuse a budget below the floor before the probes allocate or write anything
        plan(*args, Bandwidth(source="default"), **kw)
    bw = bandwidth or get_bandwidth(path, measure=measure_bandwidth)
    return plan(*args, bw, **kw)


__all__ = ["TensorDesc", "ModelDesc", "Unit", "Plan", "plan", "plan_for_path", "scratch_bytes",
           "tensor_kind", "describe_tensor", "IO_STAGING_BYTES", "LOGITS_SLICE_ROWS", "GiB"]
