"""The batch contract between the engine's runner and ``Model.forward`` (llama_batch-like).

Flat rows: token ``ids``, their positions ``pos`` and sequence slots ``seq`` (int32[n]); the
rows whose logits are wanted (``out_rows``, increasing); the KV cache view of these rows
(kv/view.py BatchKV: where each row's K/V go and which keys it reads). ``decode`` says every
row is the next token of a different sequence and all want logits (the fused native decode
layer then takes them in one call per layer). ``hidden`` returns the final-normed hidden
states of out_rows instead of logits (perplexity slices its logits itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Batch:
    ids: np.ndarray
    pos: np.ndarray
    seq: np.ndarray
    out_rows: np.ndarray
    kv: object
    decode: bool = False
    hidden: bool = False

    @property
    def n(self) -> int:
        return int(self.ids.shape[0])
