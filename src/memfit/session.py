"""Saved sessions: a sequence's state (token ids + KV rows) in a file, restored later.

File layout (little-endian), independent of how the cache is laid out in memory:

    b"MFSESSN\\0" | u32 version | u32 header length | header JSON (UTF-8)
    | int32 token ids [n] | per layer: K rows [n_rows, n_kv_head, row_bytes_k], V rows [...]
    | sha256 of everything before it (32 bytes)

row_bytes_v is 0 for a cache that keeps V inside K (MLA: kv/storage.py kv_layout).

n_rows <= n: the K/V rows of the first n_rows tokens (whole 32-token blocks when saved from the
engine's paged pool: what its prefix cache can reuse; the rest is recomputed on use).

The header names the model (GGUF file size, sha256 of its header bytes, architecture), the
cache types and the geometry, so a restore refuses a file of another model, other cache types,
a truncated file or a corrupt one, each with its own message. Rows are stored in their cache
type (f16 values or q8_0 / q4_0 blocks, kv/quant.py), exactly as the cache held them, so a
greedy continuation after restore equals the uninterrupted one.

Writes are crash-safe: the file is written to a temporary name in the same directory,
fsync'd, renamed over the target and the directory fsync'd; a process killed mid-save leaves
the old file (or none) at the target, never a partial one. Its temporary (.NAME.tmp-PID) is
removed by the next save into that directory once process PID is gone.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import MemfitError

MAGIC = b"MFSESSN\0"
VERSION = 1
_HEAD = struct.Struct("<8sII")
_SUM = 32
_TMP = re.compile(r"^\.(.+)\.tmp-([0-9]+)$")  # save()'s temporary names
_CACHE_TYPES = ("f32", "f16", "q8_0", "q4_0")
_MAX_COUNT = 1 << 40  # bound on every count/size in a header: far above any real file


class SessionError(MemfitError):
    """A session file that cannot be restored here (other model, other cache types, truncated,
    corrupt, not a session file); the message says which and what to do."""


def model_identity(gguf) -> dict:
    """What a session file is bound to: the GGUF's size, its header's sha256, its architecture."""
    n = int(getattr(gguf, "header_end", 0) or 0) or min(gguf.file_size, 1 << 20)
    h = hashlib.sha256()
    with open(gguf.paths[0], "rb") as f:
        h.update(f.read(n))
    return {"file_size": int(gguf.file_size), "header_sha256": h.hexdigest(),
            "arch": gguf.arch, "name": Path(gguf.paths[0]).name}


@dataclass
class SessionState:
    """What a file holds: ids, per-layer K and V rows (uint8 [n_rows, n_kv_head, row_bytes]) of
    the first n_rows tokens."""

    ids: list[int]
    k: list[np.ndarray]
    v: list[np.ndarray]
    cache_type_k: str
    cache_type_v: str
    extra: dict[str, Any] = field(default_factory=dict)


def _geometry(st: SessionState) -> dict:
    k0, v0 = st.k[0], st.v[0]
    return {"n_layer": len(st.k), "n_kv_head": int(k0.shape[1]), "row_bytes_k": int(k0.shape[2]),
            "row_bytes_v": int(v0.shape[2])}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # another user's process (or not a pid we can ask about): keep its file
    return True


def _clean_stale_temporaries(d: Path) -> None:
    """Remove save()'s temporaries in d left by processes that are gone (killed mid-save):
    only names .NAME.tmp-PID whose PID is not running and whose bytes start as a session file
    (or are empty), never a file of another program."""
    try:
        names = os.listdir(d)
    except OSError:
        return
    for name in names:
        m = _TMP.match(name)
        if m is None or int(m.group(2)) == os.getpid() or _pid_alive(int(m.group(2))):
            continue
        f = d / name
        try:
            with open(f, "rb") as fh:
                head = fh.read(len(MAGIC))
            if head in (MAGIC, b"") and f.is_file():
                f.unlink()
        except OSError:
            pass  # raced with another cleaner, or not ours to remove


def save(path: str | os.PathLike, identity: dict, st: SessionState) -> int:
    """Write st to path crash-safely; returns the file size. MEMFIT_TEST_SAVE_SLEEP (seconds)
    pauses between layers so a test can kill the process mid-write."""
    path = Path(path)
    n, nr = len(st.ids), st.k[0].shape[0]
    assert st.k and nr <= n and all(a.shape[0] == nr and b.shape[0] == nr for a, b in zip(st.k, st.v))
    if not isinstance(st.extra, dict):
        raise SessionError(f"cannot save the session to {path}: extra must be a dict (a JSON "
                           f"object), not {type(st.extra).__name__}")
    header = {"version": VERSION, "model": identity, "cache_type_k": st.cache_type_k,
              "cache_type_v": st.cache_type_v, "n_tokens": n, "n_rows": nr, **_geometry(st),
              "created": time.time(), "extra": st.extra}
    try:
        hj = json.dumps(header, sort_keys=True, allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise SessionError(f"cannot save the session to {path}: extra is not JSON-able "
                           f"({e})") from None
    pause = float(os.environ.get("MEMFIT_TEST_SAVE_SLEEP", "0") or 0)
    d = path.parent if str(path.parent) else Path(".")
    if not d.is_dir():
        raise SessionError(f"cannot save the session to {path}: directory {d} does not exist")
    _clean_stale_temporaries(d)
    tmp = d / f".{path.name}.tmp-{os.getpid()}"
    h = hashlib.sha256()
    size = 0
    try:
        with open(tmp, "wb") as f:
            def put(b) -> None:
                nonlocal size
                if isinstance(b, np.ndarray):  # flat first: a view with 0 rows cannot cast
                    b = b.reshape(-1).view(np.uint8)
                mv = memoryview(b).cast("B")
                h.update(mv)
                f.write(mv)
                size += len(mv)
            put(_HEAD.pack(MAGIC, VERSION, len(hj)))
            put(hj)
            put(np.asarray(st.ids, dtype="<i4").tobytes())
            for k, v in zip(st.k, st.v):
                put(np.ascontiguousarray(k, dtype=np.uint8))
                put(np.ascontiguousarray(v, dtype=np.uint8))
                if pause:
                    f.flush()
                    time.sleep(pause)
            f.write(h.digest())
            size += _SUM
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise SessionError(f"cannot save the session to {path}: {e.strerror or e}") from None
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself is durable
    finally:
        os.close(fd)
    return size


def load(path: str | os.PathLike, identity: dict, cache_type_k: str, cache_type_v: str,
         geometry: dict) -> SessionState:
    """Read and check a session file against this model (identity), its cache types and KV
    geometry (n_layer, n_kv_head, row_bytes_k, row_bytes_v); SessionError if it does not fit."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SessionError(f"cannot read session file {path}: {e.strerror or e}") from None
    if len(data) < _HEAD.size or data[:8] != MAGIC:
        raise SessionError(f"{path} is not a memfit session file (bad magic); save one with "
                           f"/save or Model.save_state")
    _, version, hlen = _HEAD.unpack_from(data)
    if version != VERSION:
        raise SessionError(f"{path} is a session file of version {version}; this memfit reads "
                           f"version {VERSION}")
    try:
        header = json.loads(data[_HEAD.size:_HEAD.size + hlen])
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise SessionError(f"{path} is corrupt: its header cannot be read "
                           f"({len(data)} bytes); save the session again") from None
    bad = _header_problem(header)
    if bad:
        raise SessionError(f"{path} is corrupt: its header {bad}; save the session again")
    n, nr = header["n_tokens"], header["n_rows"]
    nl, hkv = header["n_layer"], header["n_kv_head"]
    rk, rv = header["row_bytes_k"], header["row_bytes_v"]
    if not 0 <= nr <= n:
        raise SessionError(f"{path} is corrupt: {nr} K/V rows for {n} tokens; save the session "
                           f"again")
    want = _HEAD.size + hlen + 4 * n + nl * nr * hkv * (rk + rv) + _SUM
    if len(data) != want:
        what = "truncated" if len(data) < want else "longer than its header says"
        raise SessionError(f"{path} is {what}: {len(data)} bytes, expected {want}; the save "
                           f"did not complete or the file was changed; save the session again")
    if hashlib.sha256(memoryview(data)[:-_SUM]).digest() != data[-_SUM:]:
        raise SessionError(f"{path} is corrupt: checksum mismatch; save the session again")
    m = header.get("model", {})
    if any(m.get(k) != identity[k] for k in ("file_size", "header_sha256", "arch")):
        raise SessionError(f"{path} was saved with another model ({m.get('name')}, "
                           f"{m.get('arch')}, {m.get('file_size')} bytes), not "
                           f"{identity['name']} ({identity['arch']}, {identity['file_size']} "
                           f"bytes); restore it with that model")
    if (header["cache_type_k"], header["cache_type_v"]) != (cache_type_k, cache_type_v):
        raise SessionError(f"{path} was saved with KV cache types {header['cache_type_k']}/"
                           f"{header['cache_type_v']}, this model is loaded with {cache_type_k}/"
                           f"{cache_type_v}; load it with -ctk {header['cache_type_k']} -ctv "
                           f"{header['cache_type_v']}")
    geo = {"n_layer": nl, "n_kv_head": hkv, "row_bytes_k": rk, "row_bytes_v": rv}
    if geo != geometry:  # same model file, so only a memfit bug could get here
        raise SessionError(f"{path} has KV geometry {geo}, this model has {geometry}")
    off = _HEAD.size + hlen
    ids = np.frombuffer(data, "<i4", n, off).astype(np.int64).tolist()
    off += 4 * n
    k, v = [], []
    buf = np.frombuffer(data, np.uint8)
    for _ in range(nl):
        k.append(buf[off:off + nr * hkv * rk].reshape(nr, hkv, rk))
        off += nr * hkv * rk
        v.append(buf[off:off + nr * hkv * rv].reshape(nr, hkv, rv))
        off += nr * hkv * rv
    return SessionState(ids, k, v, header["cache_type_k"], header["cache_type_v"],
                        header["extra"])


def _header_problem(h: Any) -> str | None:
    """What is wrong with a parsed header (type or range of a field), None if nothing: so
    that a hand-edited file with a recomputed checksum is refused like any corrupt one."""
    if not isinstance(h, dict):
        return f"is a JSON {type(h).__name__}, not an object"

    def count(key: str, lo: int = 0) -> str | None:
        x = h.get(key)
        if type(x) is not int:  # bool and float are not counts
            return f"field {key!r} is {x!r}, not an integer"
        if not lo <= x <= _MAX_COUNT:
            return f"field {key!r} = {x} is out of range"
        return None

    for key, lo in (("version", 0), ("n_tokens", 0), ("n_rows", 0), ("n_layer", 1),
                    ("n_kv_head", 1), ("row_bytes_k", 1), ("row_bytes_v", 0)):  # 0: V inside K
        if (p := count(key, lo)) is not None:
            return p
    if h["version"] != VERSION:
        return f"says version {h['version']} but its preamble says {VERSION}"
    for key in ("cache_type_k", "cache_type_v"):
        if h.get(key) not in _CACHE_TYPES:
            return f"field {key!r} is {h.get(key)!r}, not one of {', '.join(_CACHE_TYPES)}"
    m = h.get("model")
    if not isinstance(m, dict):
        return f"field 'model' is {m!r}, not an object"
    if type(m.get("file_size")) is not int or not 0 <= m["file_size"] <= 1 << 62:
        return f"field 'model.file_size' is {m.get('file_size')!r}, not a file size"
    for key in ("header_sha256", "arch", "name"):
        if not isinstance(m.get(key), str):
            return f"field 'model.{key}' is {m.get(key)!r}, not a string"
    c = h.get("created")
    if type(c) not in (int, float) or not math.isfinite(c):
        return f"field 'created' is {c!r}, not a time"
    if not isinstance(h.get("extra"), dict):
        return f"field 'extra' is {h.get('extra')!r}, not an object"
    return None


# --- the engine's paged pool ----------------------------------------------------------------

def export_prefix(pool, ids: list[int]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """K and V rows (per layer, copies) of the longest prefix of ids whose whole blocks are in
    the pool's prefix cache: a multiple of the block size, possibly 0. With a sliding-window
    group (kv/pool.py) only as far as its blocks for the last window are cached too; the
    window layers' rows before that window are zeros (no later query reads them)."""
    from .kv.pool import block_key
    bs, key, blocks, keys = pool.block_size, None, [], []
    for j in range(len(ids) // bs):
        key = block_key(key, ids[j * bs:(j + 1) * bs])
        b = pool.peek(key)
        if b is None:
            break
        blocks.append(b)
        keys.append(key)
    w = pool.swa
    if w is None:
        return pool.storage.read_blocks(blocks)
    h = w.hit_blocks(keys)
    lo = w.lo(h * bs)
    swa = [-1] * lo + [w.blocks.peek(kk) for kk in keys[lo:h]]
    return pool.storage.read_blocks(blocks[:h], swa)


def import_prefix(pool, ids: list[int], k: list[np.ndarray], v: list[np.ndarray]) -> int:
    """Put the rows of ids' first whole blocks into the pool's prefix cache (keyed by their
    tokens, unreferenced: a request with that prefix reuses them); returns the tokens placed
    (fewer when the pool has no free block left). With a sliding-window group the window
    layers' rows go into its blocks for the last window of what was placed."""
    from .kv.pool import block_key
    bs, key, keys = pool.block_size, None, []
    n = k[0].shape[0] // bs
    w = pool.swa
    for j in range(n):
        key = block_key(key, ids[j * bs:(j + 1) * bs])
        rows = ([x[j * bs:(j + 1) * bs] for x in k], [x[j * bs:(j + 1) * bs] for x in v])
        if pool.peek(key) is None:
            if pool.n_free == 0:
                n = j
                break
            b = pool.allocate()
            pool.storage.write_block(b, *rows)
            pool.register(b, key)
            pool.release([b])
        keys.append(key)
    if w is not None:
        for j in range(w.lo(n * bs), n):
            if w.blocks.peek(keys[j]) is not None:
                continue
            if w.blocks.n_free == 0:  # (the group always holds a window: kv_swa_pool_blocks)
                break
            b = w.blocks.allocate()
            pool.storage.write_block(None, [x[j * bs:(j + 1) * bs] for x in k],
                                     [x[j * bs:(j + 1) * bs] for x in v], swa_block=b)
            w.blocks.register(b, keys[j])
            w.blocks.release([b])
    return n * bs
