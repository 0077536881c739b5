"""qwen3: the llama block with per-head RMS norm of Q and K before RoPE, NeoX RoPE, and a
head dim that may differ from n_embd / n_head (attention.key_length)."""

from __future__ import annotations

from .layers import Model
from .spec import ArchSpec

SPEC = ArchSpec("qwen3", rope_neox=True, qk_norm="head")


class Qwen3(Model):
    spec = SPEC
