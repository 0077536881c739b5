"""Where model code gets its weights: the WeightSource protocol and its plain GGUF implementation.

Model code only calls ``has``, ``info`` and ``get`` (and, for mixture-of-experts layers, the
three expert methods); the memory-budget weight store implements the same, so the model never
knows whether a weight was resident or paged in.

    has(name) -> bool
    info(name) -> (shape: tuple numpy order, type: GGMLType)   # no data touched
    get(name) -> QTensor                                          # bytes ready to compute on
    get_experts(il, experts) -> [(gate, up, down) QTensors]       # one per expert, in order;
                                                                  # valid until the next call
    prefetch_experts(il, experts) -> None                         # a hint; may do nothing
    experts_in_place(il) -> (gate, up, down) stacked QTensors | None   # all of layer il's
                               # experts resident for the whole run, read in place by the
                               # fused MoE decode layer; None: ask get_experts
    wants_expert_prediction: bool                                 # router look-ahead wanted
    expert_batch_limit: int                                       # experts per get_experts
                                                                  # call (0: any number)
    decode_step(seconds, rows) -> None                            # a decode forward's time
                               # (the store decides by it whether look-ahead pays)
"""

from __future__ import annotations

from typing import Protocol, Sequence

from ..ops import QTensor
from ..quant.types import GGMLType


class WeightSource(Protocol):
    def has(self, name: str) -> bool: ...
    def info(self, name: str) -> tuple[tuple[int, ...], GGMLType]: ...
    def get(self, name: str) -> QTensor: ...
    def get_experts(self, il: int, experts: Sequence[int]) -> list[tuple[QTensor, QTensor, QTensor]]: ...
    def prefetch_experts(self, il: int, experts: Sequence[int]) -> None: ...
    def experts_in_place(self, il: int) -> tuple[QTensor, QTensor, QTensor] | None: ...
    def decode_step(self, seconds: float, rows: int) -> None: ...
    wants_expert_prediction: bool
    expert_batch_limit: int


def expert_slice(stacked: QTensor, e: int) -> QTensor:
    """Expert e of a stacked (n_expert, rows, cols) tensor: its contiguous byte range, 2-D."""
    n_expert, rows, cols = stacked.shape
    assert 0 <= e < n_expert, (stacked.name, e)
    nb = rows * stacked.type.row_bytes(cols)
    return QTensor(f"{stacked.name}[{e}]", stacked.type, (rows, cols),
                   stacked.data[e * nb:(e + 1) * nb])


def expert_views(weights, il: int, experts: Sequence[int]) -> list[tuple[QTensor, QTensor, QTensor]]:
    """get_experts through a plain ``get`` of the stacked tensors (a WeightSource without the
    expert methods)."""
    st = [weights.get(f"blk.{il}.ffn_{m}_exps.weight") for m in ("gate", "up", "down")]
    return [tuple(expert_slice(t, e) for t in st) for e in experts]


class GGUFWeights:
    """Zero-copy views into an open GGUF file (the OS pages them in on use)."""

    wants_expert_prediction = False   # the OS pages experts in on use: nothing to prefetch
    expert_batch_limit = 0            # experts per get_experts call: 0, any number

    def decode_step(self, seconds: float, rows: int) -> None:
        """Nothing to decide: no look-ahead here."""

    def __init__(self, gguf_file):
        self.file = gguf_file
        self._views: dict[str, QTensor] = {}  # views are immutable: build each once (hot path)
        self._experts: dict[tuple[int, int], tuple[QTensor, QTensor, QTensor]] = {}

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

    def get_experts(self, il: int, experts: Sequence[int]) -> list[tuple[QTensor, QTensor, QTensor]]:
        out = []
        for e in experts:
            v = self._experts.get((il, e))
            if v is None:
                v = self._experts[(il, e)] = expert_views(self, il, (e,))[0]
            out.append(v)
        return out

    def prefetch_experts(self, il: int, experts: Sequence[int]) -> None:
        pass

    def experts_in_place(self, il: int) -> tuple[QTensor, QTensor, QTensor]:
        # the mapping holds every expert (the OS pages them in on use)
        return tuple(self.get(f"blk.{il}.ffn_{m}_exps.weight") for m in ("gate", "up", "down"))
