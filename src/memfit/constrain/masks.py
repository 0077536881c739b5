"""Token masks of a step's constrained rows, computed off the critical path.

``start(matchers)`` hands the matchers to a worker thread that has llguidance's LLExecutor
fill one int32 bitmask [rows, words] (llguidance.numpy.fill_next_token_bitmask_par: its own
threads, the GIL released) while the engine's thread runs the forward (whose native kernels
release the GIL too); ``join()`` waits for it and returns the bitmask, row i for matchers[i].
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_executor = None
_lock = threading.Lock()


def ll_executor():
    """The process's llguidance.LLExecutor (threads for masks of many rows at once)."""
    global _executor
    with _lock:
        if _executor is None:
            import llguidance as llg
            _executor = llg.LLExecutor(num_threads=max(1, min(8, (os.cpu_count() or 2) // 2)))
        return _executor


class MaskWorker:
    """One per engine: a thread and a bitmask buffer that grows to the largest step."""

    def __init__(self, n_vocab: int):
        self.words = (n_vocab + 31) // 32
        self._buf = np.zeros((0, self.words), np.int32)
        from ..memory.io import block_async_signals
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memfit-masks",
                                        initializer=block_async_signals)
        self._fut = None

    def start(self, matchers) -> None:
        from llguidance.numpy import fill_next_token_bitmask_par
        n = len(matchers)
        if self._buf.shape[0] < n:
            self._buf = np.zeros((max(n, 2 * self._buf.shape[0]), self.words), np.int32)
        out = self._buf[:n]
        pairs = [(m.ll, i) for i, m in enumerate(matchers)]
        self._fut = self._pool.submit(fill_next_token_bitmask_par, ll_executor(), pairs, out)
        self._out = out

    def join(self) -> np.ndarray:
        fut, self._fut = self._fut, None
        fut.result()
        return self._out
