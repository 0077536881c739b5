"""llama: Llama 2/3, SmolLM2, Mistral. Pre-norm, SiLU-gated FFN, normal (non-NeoX) RoPE:
llama.cpp's converter permutes Q/K so adjacent pairs rotate. Output tied to token_embd if
the file has no output.weight."""

from __future__ import annotations

from .layers import Model


class Llama(Model):
    arch = "llama"

    def tensor_specs(self):
        specs = super().tensor_specs()
        specs["rope_freqs.weight"] = ((self.config.n_rot // 2,), False)
        return specs
