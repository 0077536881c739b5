"""qwen2: the llama block with Q/K/V biases (required) and NeoX RoPE."""

from __future__ import annotations

from .layers import Model
from .spec import ArchSpec

SPEC = ArchSpec("qwen2", rope_neox=True, qkv_bias=True, rope_freqs=True)


class Qwen2(Model):
    spec = SPEC
