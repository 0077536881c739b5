"""Learned hot set: routing counts per model file, kept in the user cache.

A record lives in routing/<sha256 of the file's absolute path>.json under memfit's directory
(memfit/paths.py: $MEMFIT_CACHE, default ~/.cache/memfit) and names the file it counts for by
size, mtime and the SHA-256 of its first HEADER_BYTES (the GGUF header: metadata and tensor
infos). The weight store adds every get_experts call's experts
and the record is rewritten when the store closes; at the next load the planner pins the
hottest experts that fit (planner._place_experts). A record that is corrupt, or counts for
another file (the model was replaced), is ignored with a HotSetWarning, never an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import numpy as np

HEADER_BYTES = 1 << 20
VERSION = 1


class HotSetWarning(UserWarning):
    """A routing-count record was ignored (corrupt, or for another file)."""


def _cache_dir() -> Path:
    from ..paths import data_dir
    return data_dir() / "routing"


def model_identity(path: str | os.PathLike) -> dict:
    st = os.stat(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(HEADER_BYTES))
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "header_sha256": h.hexdigest()}


def record_path(path: str | os.PathLike) -> Path:
    key = hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:32]
    return _cache_dir() / f"{key}.json"


class RoutingCounts:
    """counts[layer, expert]: how many get_experts calls routed to that expert."""

    def __init__(self, n_layer: int, n_expert: int, path=None, identity: dict | None = None):
        self.counts = np.zeros((n_layer, n_expert), np.int64)
        self.path = Path(path) if path is not None else None
        self.identity = identity

    def add(self, il: int, experts) -> None:
        # distinct experts; a loop over a row: fancy indexing with a list cost ~40 us a call,
        # once per layer and token of a streamed MoE decode
        row = self.counts[il]
        for e in experts:
            row[e] += 1

    def by_layer(self) -> dict[int, list[int]]:
        return {il: [int(v) for v in row] for il, row in enumerate(self.counts) if row.sum()}

    def as_prior(self) -> dict[tuple[int, int], float]:
        return {(il, e): float(v) for (il, e), v in np.ndenumerate(self.counts) if v}

    @classmethod
    def load(cls, path, n_layer: int, n_expert: int) -> "RoutingCounts":
        """The record for the model file at `path` (zeros when none or unusable; warns)."""
        from .planner import COUNTS
        COUNTS["routing"] += 1
        ident = model_identity(path)
        rc = cls(n_layer, n_expert, path, ident)
        rp = record_path(path)
        try:
            text = rp.read_text()
        except FileNotFoundError:
            return rc
        except OSError as e:
            warnings.warn(f"memfit: routing counts {rp} unreadable ({e}); ignored", HotSetWarning)
            return rc
        try:
            d = json.loads(text)
            assert isinstance(d, dict) and d.get("version") == VERSION, "unknown version"
            if d.get("model") != ident:
                warnings.warn(f"memfit: routing counts {rp} are for another file (the model "
                              f"changed: size, mtime or header differ); ignored", HotSetWarning)
                return rc
            c = np.asarray(d["counts"], dtype=np.int64)
            assert c.shape == (n_layer, n_expert), f"shape {c.shape}"
            assert (c >= 0).all(), "negative count"
            rc.counts[:] = c
        except (ValueError, TypeError, KeyError, AssertionError) as e:
            warnings.warn(f"memfit: routing counts {rp} are corrupt ({e}); ignored",
                          HotSetWarning)
        return rc

    def save(self) -> None:
        """Write the record atomically; never raises (a read-only cache only loses counts)."""
        if self.path is None or not self.counts.any():
            return
        rp = record_path(self.path)
        try:
            ident = model_identity(self.path)
            if ident != self.identity:  # the file changed under us: these counts are stale
                return
            rp.parent.mkdir(parents=True, exist_ok=True)
            tmp = rp.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"version": VERSION, "model": ident,
                                       "path": str(Path(self.path).resolve()),
                                       "counts": self.counts.tolist()}))
            os.replace(tmp, rp)
        except OSError:
            pass
