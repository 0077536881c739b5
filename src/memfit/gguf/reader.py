"""TEMPORARY thin adapter over gguf.GGUFReader with the final interface.

To be replaced by memfit's own validated reader (see package docstring).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import GGUFError
from ..quant.types import GGMLType, TYPES


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ne: tuple[int, ...]          # GGUF order, ne[0] innermost
    type: GGMLType
    offset: int                  # absolute byte offset in its file
    nbytes: int
    file_index: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n


class GGUFFile:
    def __init__(self, path: str | Path):
        import gguf
        self.paths = [Path(path)]
        try:
            r = gguf.GGUFReader(str(path))
        except Exception as e:  # noqa: BLE001 - temporary adapter
            raise GGUFError(f"{path}: {e}") from None
        self._r = r
        self.version = 3
        self.alignment = r.alignment
        self.metadata: dict[str, Any] = {}
        for k, f in r.fields.items():
            if k.startswith("GGUF."):
                continue
            self.metadata[k] = f.contents()
        self.tensors: dict[str, TensorInfo] = {}
        for t in r.tensors:
            ne = tuple(int(x) for x in t.shape)
            self.tensors[t.name] = TensorInfo(t.name, ne, TYPES[int(t.tensor_type)],
                                              int(t.data_offset), int(t.n_bytes))
        self._mm = np.memmap(path, dtype=np.uint8, mode="r")
        self.file_size = self._mm.size

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def tensor_data(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        return self._mm[t.offset:t.offset + t.nbytes]

    def close(self) -> None:
        self._mm = None

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()


def open_gguf(path: str | Path) -> GGUFFile:
    return GGUFFile(path)
