"""Where model code gets its weights: the WeightSource protocol and its plain GGUF implementation.

Model code only calls ``has``, ``info`` and ``get``; the memory-budget weight store implements
the same three, so the model never knows whether a weight was resident or paged in.

    has(name) -> bool
    info(name) -> (shape: tuple numpy order, type: GGMLType)   # no data touched
    get(name) -> QTensor                                          # bytes ready to compute on
"""

from __future__ import annotations

from typing import Protocol

from ..ops import QTensor
from ..quant.types import GGMLType


class WeightSource(Protocol):
    def has(self, name: str) -> bool: ...
    def info(self, name: str) -> tuple[tuple[int, ...], GGMLType]: ...
    def get(self, name: str) -> QTensor: ...


class GGUFWeights:
    """Zero-copy views into an open GGUF file (the OS pages them in on use)."""

    def __init__(self, gguf_file):
        self.file = gguf_file
        self._views: dict[str, QTensor] = {}  # views are immutable: build each once (hot path)

    def has(self, name: str) -> bool:
        return name in self.file.tensors

    def info(self, name: str) -> tuple[tuple[int, ...], GGMLType]:
        t = self.file.tensors[name]
        return t.shape, t.type

    def get(self, name: str) -> QTensor:
        q = self._views.get(name)
        if q is None:
            t = self.file.tensors[name]
            q = self._views[name] = QTensor(name, t.type, t.shape, self.file.tensor_data(name))
        return q
