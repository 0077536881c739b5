"""llama: Llama 2/3, SmolLM2, Mistral, and Mixtral (llama with expert_count > 0 and stacked
ffn_*_exps: softmax router, top-k, weights renormalized). Pre-norm, SiLU-gated FFN, normal
(non-NeoX) RoPE: llama.cpp's converter permutes Q/K so adjacent pairs rotate. Output tied to
token_embd if the file has no output.weight."""

from __future__ import annotations

from .layers import Model
from .spec import ArchSpec

SPEC = ArchSpec("llama", rope_freqs=True, moe="optional", expert_weights_norm=True)


class Llama(Model):
    spec = SPEC
