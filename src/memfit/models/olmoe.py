"""olmoe (OLMoE-1B-7B): RMS norm of Q and K over the whole projected vector (not per head)
before RoPE, NeoX RoPE, routed experts (softmax, top-k, weights not renormalized)."""

from __future__ import annotations

from .layers import Model
from .spec import ArchSpec

SPEC = ArchSpec("olmoe", rope_neox=True, qk_norm="full", moe="always")


class Olmoe(Model):
    spec = SPEC

    def linears(self, x, names, outs=None):
        # the Q and K projections are followed by their full-vector norm (before the per-head
        # reshape in attention): done here so the shared attention stays one function
        ys = super().linears(x, names, outs)
        if len(names) == 3 and names[0].endswith(".attn_q"):
            p = names[0][: -len("attn_q")]
            ys[0] = self.norm(ys[0], p + "attn_q_norm.weight")
            ys[1] = self.norm(ys[1], p + "attn_k_norm.weight")
        return ys
