"""The budget's resident part as the draft (``--spec resident``): self-speculation by layer
skipping.

When a budget streams part of a dense model, a token costs the disk reads of the streamed
tensors. This draft runs the target itself with only the sub-blocks whose weights are pinned
in the weight store (plan.tiers["pinned"]): a layer's attention when its Q/K/V/output
projections are pinned, its FFN when gate/up/down are pinned; a sub-block whose weights stream
is skipped (its residual branch left out), so drafting reads nothing from the disk. The
planner pins by role across layers (all attention projections first, then FFN parts), so the
draft is usually "every layer's attention, few or no FFNs" rather than a subset of whole
layers. Then the final norm and the output head: a head that streams would be read per draft
token, so the mode is refused ("the output head streams"). The skipped layers' attention has
no K/V here: the draft keeps its own small paged pool for the attention it runs.

The proposals loop (shadows, rollback, catch-up, k greedy steps batched across sequences) is
DraftProposer's (spec/draft.py); this file gives it a model whose forward is the resident
subset.

Measured (greedy, per-token acceptance with the draft's p_min 0.75; docs/NOTES.md): at the
planner's placements for budgets that stream 30-60% of SmolLM2's or Gemma-3's weights, only the
attention projections are pinned and the attention-only draft proposes nothing confident
(0 accepted). Pinning the FFNs of half the layers instead gives 14-36% on SmolLM2 and 21-84%
on Gemma-3 (the high end on copying, which the n-gram proposer serves for free). Too low to
pay for a draft forward per guess, so ``auto`` never picks it (spec/build.py); ``--spec
resident`` runs it when asked.
"""

from __future__ import annotations

import numpy as np

from ..errors import RequestError
from ..kv.storage import KVLayout, kv_layout
from ..kv.view import BatchKV
from .draft import DraftProposer

ATTN = ("attn_q", "attn_k", "attn_v", "attn_output")
FFN = ("ffn_gate", "ffn_up", "ffn_down")


def resident_blocks(model, pinned) -> tuple[list[int], list[int]]:
    """(layers whose attention runs, layers whose FFN runs) given the pinned tensor names."""
    c = model.config
    pinned = set(pinned)

    def ok(il, mats):
        return all(f"blk.{il}.{m}.weight" in pinned for m in mats)

    return ([il for il in range(c.n_layer) if ok(il, ATTN)],
            [il for il in range(c.n_layer) if ok(il, FFN)])


class _ResidentModel:
    """forward(batch) of the target over its resident sub-blocks only (op by op), with a KV
    pool that has a layer for each attention it runs (the batch's K/V lists are remapped to
    the target's layer numbers)."""

    def __init__(self, model, attn: list[int], ffn: list[int]):
        self.target, self.attn, self.ffn = model, attn, set(ffn)
        self.config = model.config
        self.ops = model.ops
        self.kv_f16 = getattr(model, "kv_f16", True)
        self.file = None
        self._slot = {il: j for j, il in enumerate(attn)}

    def forward(self, b) -> np.ndarray:
        m, c, ops = self.target, self.config, self.ops
        kv = b.kv
        n_layer = c.n_layer
        k = [None] * n_layer
        v = [None] * n_layer
        for il, j in self._slot.items():
            k[il] = kv.k[j]
            if kv.v:
                v[il] = kv.v[j]
        kv = BatchKV(k, v, kv.kv_type, kv.pos, kv.slots, kv.q_tab, kv.tables, kv.bs,
                     kv_type_v=kv.kv_type_v, v_in_k=kv.v_in_k)
        x = ops.get_rows(m.weights.get("token_embd.weight"), b.ids)
        if c.embd_scale != 1.0:
            x = x * np.float32(c.embd_scale)
        m._decode = b.decode
        m._rows_seq, m._rows_pos = b.seq, b.pos
        post = m.post_norms
        try:
            for il in range(n_layer):
                p = f"blk.{il}."
                if il in self._slot:
                    h = m.attention(il, m.norm(x, p + "attn_norm.weight"), b.pos, kv, None)
                    if post:
                        h = m.norm(h, p + "post_attention_norm.weight")
                    x = x + h
                if il in self.ffn:
                    f = m.ffn(il, m.norm(x, p + "ffn_norm.weight"))
                    if post:
                        f = m.norm(f, p + "post_ffw_norm.weight")
                    x = x + f
            if len(b.out_rows) < b.n:
                x = x[b.out_rows]
            if x.shape[0] == 0:
                return np.zeros((0, c.n_vocab), np.float32)
            x = ops.rmsnorm(np.ascontiguousarray(x), m.vec["output_norm.weight"], c.rms_eps)
            return m.logits(x)
        finally:
            m._decode = False


class ResidentProposer(DraftProposer):
    name = "resident"

    def __init__(self, model, pinned, *, n_ctx: int, n_parallel: int = 1, n_batch: int = 512,
                 ledger=None, cache_type: str | None = None, eog_ids=()):
        c = model.config
        if c.n_expert or not getattr(model, "fused_decode", False):
            raise RequestError(f"--spec resident runs dense pre-norm models (llama, qwen2, "
                               f"qwen3, gemma3); {c.arch} is not one")
        pinned = set(pinned)
        if model.output not in pinned:
            raise RequestError(f"--spec resident: the output head ({model.output}) streams "
                               f"under this budget, so the draft cannot run without reading it "
                               f"every token; raise --mem-budget or use --spec ngram")
        attn, ffn = resident_blocks(model, pinned)
        if not attn:
            raise RequestError("--spec resident: no layer's attention is pinned under this "
                               "budget; raise --mem-budget or use --spec ngram")
        self.attn_layers, self.ffn_layers = attn, ffn
        L = kv_layout(c)
        layout = KVLayout(len(attn), L.n_head_kv, L.head_dim_k, L.head_dim_v, L.v_in_k)
        super().__init__(_ResidentModel(model, attn, ffn), n_ctx=n_ctx, n_parallel=n_parallel,
                         n_batch=n_batch, ledger=ledger, cache_type=cache_type, layout=layout,
                         eog_ids=eog_ids)

    def describe(self) -> str:
        n = self.model.config.n_layer
        return (f"resident draft: attention of {len(self.attn_layers)}/{n} layers, FFN of "
                f"{len(self.ffn_layers)}/{n}")

    @classmethod
    def for_runtime(cls, rt) -> ResidentProposer:
        """The resident draft of a loaded Runtime (its store's pinned tensors)."""
        if rt.store is None or rt.plan is None or not (rt.plan.tiers["file"] or
                                                       rt.plan.tiers["cache"]):
            raise RequestError("--spec resident needs a budget that streams part of the model "
                               "(--mem-budget below its size); use ngram, draft or auto")
        kvt = None if rt.cache_type_k == "f16" and rt.cache_type_v == "f16" else rt.cache_type_k
        return cls(rt.model, rt.plan.tiers["pinned"], n_ctx=rt.n_ctx, n_parallel=rt.n_parallel,
                   n_batch=rt.n_batch, ledger=rt.ledger, cache_type=kvt,
                   eog_ids=rt.tokenizer.eog_ids)
