"""memfit's validated GGUF reader (v2/v3, little-endian), zero-copy tensor views, split models.

Nothing read from the file is trusted before it is checked: every count and length is bounded
by the bytes that remain, so no allocation is ever sized by an unchecked number. Every
violation raises GGUFError naming the file, the byte offset and the field.

Layout (gguf.md): magic "GGUF", u32 version, u64 tensor_count, u64 kv_count, kv pairs
(string key, u32 value type, value), tensor infos (string name, u32 n_dims, u64 ne[n_dims],
u32 ggml type, u64 offset relative to the data section), padding to general.alignment, data.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import GGUFError, UnsupportedError
from ..quant.types import GGMLType, TYPES

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4
MAX_ELEMENTS = 1 << 62          # a larger shape product cannot be a real tensor (int64 overflow)
MAX_ARRAY_NESTING = 8           # nested arrays deeper than this are refused (no deep recursion)
SPLIT_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# GGUF metadata value types
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL = range(8)
T_STRING, T_ARRAY, T_UINT64, T_INT64, T_FLOAT64 = 8, 9, 10, 11, 12
VALUE_TYPE_NAMES = {
    T_UINT8: "uint8", T_INT8: "int8", T_UINT16: "uint16", T_INT16: "int16",
    T_UINT32: "uint32", T_INT32: "int32", T_FLOAT32: "float32", T_BOOL: "bool",
    T_STRING: "string", T_ARRAY: "array", T_UINT64: "uint64", T_INT64: "int64",
    T_FLOAT64: "float64",
}
# fixed-size value types: (struct, numpy dtype)
_FIXED = {
    T_UINT8: (struct.Struct("<B"), np.dtype("<u1")), T_INT8: (struct.Struct("<b"), np.dtype("<i1")),
    T_UINT16: (struct.Struct("<H"), np.dtype("<u2")), T_INT16: (struct.Struct("<h"), np.dtype("<i2")),
    T_UINT32: (struct.Struct("<I"), np.dtype("<u4")), T_INT32: (struct.Struct("<i"), np.dtype("<i4")),
    T_FLOAT32: (struct.Struct("<f"), np.dtype("<f4")), T_BOOL: (struct.Struct("<B"), np.dtype("<u1")),
    T_UINT64: (struct.Struct("<Q"), np.dtype("<u8")), T_INT64: (struct.Struct("<q"), np.dtype("<i8")),
    T_FLOAT64: (struct.Struct("<d"), np.dtype("<f8")),
}
INT_TYPES = frozenset((T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_UINT64, T_INT64))
# smallest encoding of one value of each type (string: u64 length; array: u32 type + u64 count)
_MIN_SIZE = {t: s.size for t, (s, _) in _FIXED.items()} | {T_STRING: 8, T_ARRAY: 12}
_MIN_KV = 8 + 4 + 1              # empty key, type, one byte value
_MIN_TENSOR_INFO = 8 + 4 + 4 + 8  # empty name, n_dims=0, type, offset
_HEADER = 4 + 4 + 8 + 8

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class GGUFUnsupportedError(GGUFError, UnsupportedError):
    """A GGUF variant memfit does not read (version 1, big-endian); catchable as either."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ne: tuple[int, ...]          # GGUF order, ne[0] innermost
    type: GGMLType
    offset: int                  # absolute byte offset in its file
    nbytes: int
    file_index: int = 0          # which split part holds it (index into GGUFFile.paths)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n


class _Parser:
    """Cursor over one file's bytes; every read is bounds-checked first."""

    def __init__(self, path: Path, buf, size: int):
        self.path, self.buf, self.size, self.pos = path, buf, size, 0

    def fail(self, field: str, what: str, at: int | None = None, cls=GGUFError):
        raise cls(f"{self.path}: byte {self.pos if at is None else at}: {field}: {what}")

    def need(self, n: int, field: str) -> None:
        left = self.size - self.pos
        if n > left:
            self.fail(field, f"needs {n} bytes but only {left} remain (file truncated or "
                             f"corrupt)")

    def u32(self, field: str) -> int:
        self.need(4, field)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, field: str) -> int:
        self.need(8, field)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, field: str) -> str:
        at = self.pos
        n = self.u64(field + " length")
        left = self.size - self.pos
        if n > left:
            self.fail(field, f"string length {n} exceeds the {left} bytes that remain", at)
        raw = self.buf[self.pos:self.pos + n]
        try:
            s = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            self.fail(field, f"string is not valid UTF-8 ({e.reason} at string byte {e.start})")
        self.pos += n
        return s

    def value(self, vtype: int, field: str, depth: int = 0):
        if vtype in _FIXED:
            st = _FIXED[vtype][0]
            self.need(st.size, field)
            (v,) = st.unpack_from(self.buf, self.pos)
            if vtype == T_BOOL:
                if v > 1:
                    self.fail(field, f"bool value is {v}, expected 0 or 1")
                v = bool(v)
            self.pos += st.size
            return v
        if vtype == T_STRING:
            return self.string(field)
        if vtype == T_ARRAY:
            return self.array(field, depth)
        self.fail(field, f"unknown value type {vtype} (known: 0..12)", self.pos - 4)

    def array(self, field: str, depth: int) -> list:
        at = self.pos
        if depth >= MAX_ARRAY_NESTING:
            self.fail(field, f"arrays nested deeper than {MAX_ARRAY_NESTING} levels")
        etype = self.u32(field + " element type")
        if etype not in _MIN_SIZE:
            self.fail(field, f"unknown array element type {etype} (known: 0..12)", self.pos - 4)
        count = self.u64(field + " count")
        left = self.size - self.pos
        if count > left // _MIN_SIZE[etype]:
            self.fail(field, f"array of {count} {VALUE_TYPE_NAMES[etype]} needs at least "
                             f"{count * _MIN_SIZE[etype]} bytes but only {left} remain", at)
        if etype in _FIXED:
            dt = _FIXED[etype][1]
            a = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
            if etype == T_BOOL:
                if count and int(a.max()) > 1:
                    self.fail(field, "bool array holds a value other than 0 or 1")
                a = a.astype(bool)
            self.pos += count * dt.itemsize
            return a.tolist()
        if etype == T_STRING:
            return self._string_array(field, count)
        return [self.array(f"{field}[{i}]", depth + 1) for i in range(count)]

    def _string_array(self, field: str, count: int) -> list[str]:
        # hot loop for 256k-entry vocabularies: locals only, one bounds check per string
        buf, size, pos, unpack = self.buf, self.size, self.pos, _U64.unpack_from
        out = [None] * count
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.fail(f"{field}[{i}] length", "truncated (needs 8 bytes)")
            (n,) = unpack(buf, pos)
            pos += 8
            if n > size - pos:
                self.pos = pos - 8
                self.fail(f"{field}[{i}]", f"string length {n} exceeds the {size - pos} "
                                           f"bytes that remain")
            try:
                out[i] = buf[pos:pos + n].decode("utf-8")
            except UnicodeDecodeError as e:
                self.pos = pos
                self.fail(f"{field}[{i}]", f"string is not valid UTF-8 ({e.reason} at "
                                           f"string byte {e.start})")
            pos += n
        self.pos = pos
        return out


def file_kind(mode: int) -> str:
    """What a non-regular file is, for error messages ("a FIFO", "a directory", ...)."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return f"it is {name}, which"
    return "it"


class _Part:
    """One parsed GGUF file (a whole model, or one part of a split model)."""

    def __init__(self, path: Path, file_index: int = 0):
        self.path = path
        try:
            # O_NONBLOCK: opening a FIFO would otherwise wait for a writer; fstat refuses it
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as e:
            raise GGUFError(f"{path}: cannot open GGUF file: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise GGUFError(f"{path}: cannot open GGUF file: {file_kind(st.st_mode)} is "
                                f"not a regular file")
            self.size = st.st_size
            if self.size < _HEADER:
                raise GGUFError(f"{path}: byte 0: header: file is {self.size} bytes, a GGUF "
                                f"header needs {_HEADER} (truncated or not a GGUF file)")
            try:
                self.mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:
                raise GGUFError(f"{path}: cannot mmap GGUF file: {e}") from None
        finally:
            os.close(fd)
        try:
            self._parse(file_index)
        except BaseException:
            self.close()
            raise

    def _parse(self, file_index: int) -> None:
        p = _Parser(self.path, self.mm, self.size)
        magic = bytes(self.mm[0:4])
        if magic != MAGIC:
            p.fail("magic", f"expected b'GGUF', found {magic!r} (not a GGUF file)", 0)
        p.pos = 4
        version = p.u32("header.version")
        if version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped in (1, 2, 3):
                p.fail("header.version", "big-endian GGUF is not supported; convert the model "
                       "to little-endian", 4, GGUFUnsupportedError)
            if version == 1:
                p.fail("header.version", "GGUF version 1 is not supported (only 2 and 3); "
                       "re-convert the model with a current llama.cpp", 4, GGUFUnsupportedError)
            p.fail("header.version", f"unknown GGUF version {version} (supported: 2, 3)", 4)
        self.version = version
        n_tensors = p.u64("header.tensor_count")
        n_kv = p.u64("header.kv_count")
        left = self.size - p.pos
        if n_kv > left // _MIN_KV:
            p.fail("header.kv_count", f"{n_kv} key/value pairs cannot fit in the {left} bytes "
                   f"that remain (each needs >= {_MIN_KV}; truncated or corrupt file)", 16)
        if n_tensors > left // _MIN_TENSOR_INFO or \
                n_kv * _MIN_KV + n_tensors * _MIN_TENSOR_INFO > left:
            p.fail("header.tensor_count", f"{n_tensors} tensor infos (+ {n_kv} kv pairs) cannot "
                   f"fit in the {left} bytes that remain (truncated or corrupt file)", 8)

        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, str] = {}
        self.value_offsets: dict[str, int] = {}  # where each value starts, for messages
        for i in range(n_kv):
            at = p.pos
            key = p.string(f"kv[{i}] key")
            if key in self.metadata:
                p.fail(f"kv[{i}] key", f"duplicate key {key!r}", at)
            vtype = p.u32(f"kv[{i}] {key!r} value type")
            if vtype not in _MIN_SIZE:
                p.fail(f"kv[{i}] {key!r} value type", f"unknown value type {vtype} "
                       f"(known: 0..12)", p.pos - 4)
            tname = VALUE_TYPE_NAMES[vtype]
            if vtype == T_ARRAY and p.size - p.pos >= 4:
                sub = _U32.unpack_from(self.mm, p.pos)[0]
                tname = f"array[{VALUE_TYPE_NAMES.get(sub, sub)}]"
            self.value_offsets[key] = p.pos
            self.metadata[key] = p.value(vtype, f"kv[{i}] {key!r}")
            self.value_types[key] = tname

        self.alignment = DEFAULT_ALIGNMENT
        if "general.alignment" in self.metadata:
            a = self.metadata["general.alignment"]
            t = self.value_types["general.alignment"]
            if t not in ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32",
                         "int64") or a <= 0 or a & (a - 1):
                p.fail("general.alignment", f"must be a nonzero power of two integer, got "
                       f"{a!r} ({t})", self.value_offsets["general.alignment"])
            self.alignment = a

        self.tensors: list[TensorInfo] = []
        rel: list[int] = []
        names: set[str] = set()
        for i in range(n_tensors):
            at = p.pos
            name = p.string(f"tensor_info[{i}] name")
            if name in names:
                p.fail(f"tensor_info[{i}] name", f"duplicate tensor name {name!r}", at)
            names.add(name)
            fld = f"tensor_info[{i}] {name!r}"
            n_dims = p.u32(fld + " n_dims")
            if n_dims > GGML_MAX_DIMS:
                p.fail(fld + " n_dims", f"{n_dims} dimensions, at most {GGML_MAX_DIMS} "
                       f"allowed", p.pos - 4)
            ne = []
            n_el = 1
            for d in range(n_dims):
                v = p.u64(f"{fld} ne[{d}]")
                if v == 0 or v > MAX_ELEMENTS:
                    p.fail(f"{fld} ne[{d}]", f"dimension {v} is out of range "
                           f"(1..2**62)", p.pos - 8)
                n_el *= v
                if n_el > MAX_ELEMENTS:
                    p.fail(f"{fld} ne[{d}]", f"shape product overflows (> 2**62 elements)",
                           p.pos - 8)
                ne.append(v)
            tid = p.u32(fld + " type")
            gt = TYPES.get(tid)
            if gt is None:
                p.fail(fld + " type", f"unknown ggml tensor type id {tid} for tensor {name!r}",
                       p.pos - 4)
            row = ne[0] if ne else 1
            if row % gt.block_size:
                p.fail(fld + " ne[0]", f"row length {row} is not a multiple of the "
                       f"{gt.name} block size {gt.block_size}", p.pos - 4)
            off = p.u64(fld + " offset")
            if off % self.alignment:
                p.fail(fld + " offset", f"data offset {off} is not a multiple of the "
                       f"alignment {self.alignment}", p.pos - 8)
            nbytes = n_el // gt.block_size * gt.type_size
            self.tensors.append(TensorInfo(name, tuple(ne), gt, off, nbytes, file_index))
            rel.append(off)

        # the data section starts at the next multiple of the alignment after the tensor infos
        self.header_end = p.pos
        self.data_start = -(-p.pos // self.alignment) * self.alignment
        data_size = self.size - self.data_start
        for i, t in enumerate(self.tensors):
            if t.offset > data_size or t.nbytes > data_size - t.offset:
                raise GGUFError(
                    f"{self.path}: byte {self.data_start + t.offset}: tensor {t.name!r}: data "
                    f"[{t.offset}, {t.offset + t.nbytes}) relative to the data section at byte "
                    f"{self.data_start} extends past the end of the file ({self.size} bytes)")
        by_off = sorted(self.tensors, key=lambda t: t.offset)
        for a, b in zip(by_off, by_off[1:]):
            if b.offset < a.offset + a.nbytes:
                raise GGUFError(
                    f"{self.path}: byte {self.data_start + b.offset}: tensor {b.name!r}: data "
                    f"overlaps tensor {a.name!r} ([{b.offset}, ...) starts inside "
                    f"[{a.offset}, {a.offset + a.nbytes}))")
        ds = self.data_start
        self.tensors = [TensorInfo(t.name, t.ne, t.type, ds + t.offset, t.nbytes, file_index)
                        for t in self.tensors]
        # one read-only byte view over the whole file; tensor views slice it (zero-copy)
        self.view = np.frombuffer(self.mm, dtype=np.uint8)

    def close(self) -> None:
        self.view = None
        mm, self.mm = getattr(self, "mm", None), None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # tensor views still alive; the map is released when they are


def _int_meta(part: _Part, key: str) -> int | None:
    if key not in part.metadata:
        return None
    v = part.metadata[key]
    if part.value_types[key] not in ("uint8", "uint16", "uint32", "uint64", "int8", "int16",
                                     "int32", "int64"):
        raise GGUFError(f"{part.path}: byte {part.value_offsets[key]}: metadata {key!r}: "
                        f"expected an integer, got "
                        f"{part.value_types[key]} {v!r}")
    return v


class GGUFFile:
    """A parsed GGUF model (all parts of a split model), tensor bytes mapped, not read."""

    def __init__(self, path: str | Path):
        path = Path(path)
        first = _Part(path, 0)
        parts = [first]
        try:
            parts += self._open_other_parts(first)
        except BaseException:
            for p in parts:
                p.close()
            raise
        self._parts = parts
        self.paths = [p.path for p in parts]
        self.version = first.version
        self.alignment = first.alignment
        self.header_end = first.header_end  # bytes of the first part's metadata + tensor infos
        self.metadata: dict[str, Any] = first.metadata
        self.metadata_types: dict[str, str] = first.value_types
        self.file_size = sum(p.size for p in parts)
        self.tensors: dict[str, TensorInfo] = {}
        for p in parts:
            for t in p.tensors:
                if t.name in self.tensors:
                    self.close()
                    raise GGUFError(f"{p.path}: tensor {t.name!r} also appears in "
                                    f"{self.paths[self.tensors[t.name].file_index]}")
                self.tensors[t.name] = t
        declared = _int_meta(first, "split.tensors.count")
        if len(parts) > 1 and declared is not None and declared != len(self.tensors):
            self.close()
            raise GGUFError(f"{path}: split.tensors.count says {declared} tensors but the "
                            f"{len(parts)} parts hold {len(self.tensors)}")

    @staticmethod
    def _open_other_parts(first: _Part) -> list[_Part]:
        count = _int_meta(first, "split.count")
        no = _int_meta(first, "split.no")
        if count is None or count == 1:
            return []
        if count < 1 or count > 99999:
            raise GGUFError(f"{first.path}: metadata 'split.count': {count} is out of range")
        m = SPLIT_RE.match(first.path.name)
        if no not in (None, 0) or (m and int(m["no"]) != 1):
            name = (f"{m['prefix']}-00001-of-{count:05d}.gguf" if m
                    else "the file ending in -00001-of-NNNNN.gguf")
            raise GGUFError(f"{first.path}: this is part {(no or 0) + 1} of a {count}-part "
                            f"split model; open the first part ({name}) instead")
        if m is None:
            raise GGUFError(f"{first.path}: split model (split.count={count}) but the file name "
                            f"does not follow NAME-00001-of-{count:05d}.gguf, so the other "
                            f"parts cannot be found")
        if int(m["count"]) != count:
            raise GGUFError(f"{first.path}: file name says {int(m['count'])} parts but "
                            f"metadata split.count is {count}")
        parts: list[_Part] = []
        try:
            for i in range(1, count):
                pp = first.path.with_name(f"{m['prefix']}-{i + 1:05d}-of-{count:05d}.gguf")
                if not pp.is_file():
                    raise GGUFError(f"{pp}: part {i + 1} of {count} of split model "
                                    f"{first.path.name} is missing; put all parts in "
                                    f"{first.path.parent}")
                part = _Part(pp, i)
                parts.append(part)
                pno, pcount = _int_meta(part, "split.no"), _int_meta(part, "split.count")
                if pno != i or pcount != count:
                    raise GGUFError(f"{pp}: split.no={pno}, split.count={pcount}; expected "
                                    f"split.no={i}, split.count={count} for this part")
        except BaseException:
            for p in parts:
                p.close()
            raise
        return parts

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def tensor_data(self, name: str) -> np.ndarray:
        """Read-only uint8 view of the tensor's bytes straight from the mapped file."""
        t = self.tensors[name]
        view = self._parts[t.file_index].view
        if view is None:
            raise GGUFError(f"{self.paths[t.file_index]}: file is closed")
        return view[t.offset:t.offset + t.nbytes]

    def close(self) -> None:
        for p in self._parts if hasattr(self, "_parts") else ():
            p.close()

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()

    def __repr__(self) -> str:
        return (f"GGUFFile({str(self.paths[0])!r}, arch={self.arch!r}, v{self.version}, "
                f"{len(self.tensors)} tensors, {len(self.metadata)} keys)")


def open_gguf(path: str | Path) -> GGUFFile:
    return GGUFFile(path)
