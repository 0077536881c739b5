"""The one directory memfit keeps its files in: models, bandwidth probes, routing counts.

$MEMFIT_CACHE, else $XDG_CACHE_HOME/memfit, else ~/.cache/memfit. Everything memfit writes
outside the paths a user names lives under it, so two users (or tests) with their own
MEMFIT_CACHE never see each other's probes or counts.
"""

from __future__ import annotations

import os
from pathlib import Path


def data_dir() -> Path:
    """$MEMFIT_CACHE, else $XDG_CACHE_HOME/memfit, else ~/.cache/memfit (not created here)."""
    base = os.environ.get("MEMFIT_CACHE")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "memfit"
