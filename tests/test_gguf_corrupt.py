"""A corpus of broken GGUF files: each must end in GGUFError, fast, without large allocations.

The files are derived from one small valid GGUF built byte by byte here, so every header
field's offset is known (truncate at its boundaries, overwrite it with huge values).
"""

from __future__ import annotations

import struct
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest

from memfit.errors import GGUFError
from memfit.gguf import open_gguf

ALIGN = 32


class Builder:
    """Writes GGUF v3 bytes and records (offset, struct format) of every structural field."""

    def __init__(self):
        self.b = bytearray()
        self.fields: dict[str, tuple[int, str]] = {}

    def put(self, fmt: str, v, name: str | None = None) -> None:
        if name:
            self.fields[name] = (len(self.b), fmt)
        self.b += struct.pack("<" + fmt, v)

    def raw(self, data: bytes) -> None:
        self.b += data

    def string(self, s: str | bytes, name: str | None = None) -> None:
        data = s.encode() if isinstance(s, str) else s
        self.put("Q", len(data), name)
        self.raw(data)


def build(kvs=None, tensors=None, *, version=3) -> tuple[bytes, dict, int]:
    """kvs: (key, writer fn); tensors: (name, ne, ggml type id, nbytes). Returns bytes, fields,
    data_start."""
    rng = np.random.default_rng(1)
    if kvs is None:
        kvs = default_kvs()
    if tensors is None:
        tensors = [("tok_embd", (64, 3), 8, 3 * 2 * 34), ("norm", (8, 4), 0, 128),
                   ("w16", (16,), 1, 32)]
    w = Builder()
    w.raw(b"GGUF")
    w.put("I", version, "version")
    w.put("Q", len(tensors), "n_tensors")
    w.put("Q", len(kvs), "n_kv")
    for i, (key, fn) in enumerate(kvs):
        w.string(key, f"kv{i}.key_len")
        fn(w, f"kv{i}")
    off = 0
    offsets = []
    for i, (name, ne, tid, nbytes) in enumerate(tensors):
        w.string(name, f"ti{i}.name_len")
        w.put("I", len(ne), f"ti{i}.n_dims")
        for d, n in enumerate(ne):
            w.put("Q", n, f"ti{i}.ne{d}")
        w.put("I", tid, f"ti{i}.type")
        w.put("Q", off, f"ti{i}.offset")
        offsets.append(off)
        off = -(-(off + nbytes) // ALIGN) * ALIGN
    data_start = -(-len(w.b) // ALIGN) * ALIGN
    w.raw(bytes(data_start - len(w.b)))
    for (name, ne, tid, nbytes), o in zip(tensors, offsets):
        w.raw(bytes(data_start + o - len(w.b)))
        w.raw(rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes())
    return bytes(w.b), w.fields, data_start


def kv_u32(v):
    def fn(w, f):
        w.put("I", 4, f + ".type")
        w.put("I", v, f + ".value")
    return fn


def kv_str(s):
    def fn(w, f):
        w.put("I", 8, f + ".type")
        w.string(s, f + ".str_len")
    return fn


def kv_arr(etype, count, payload: bytes):
    def fn(w, f):
        w.put("I", 9, f + ".type")
        w.put("I", etype, f + ".arr_type")
        w.put("Q", count, f + ".arr_count")
        w.raw(payload)
    return fn


def kv_str_arr(items):
    def fn(w, f):
        w.put("I", 9, f + ".type")
        w.put("I", 8, f + ".arr_type")
        w.put("Q", len(items), f + ".arr_count")
        for j, s in enumerate(items):
            w.string(s, f"{f}.item{j}_len")
    return fn


def kv_nested():
    # [[1, 2], [3]] as arrays of int32
    def fn(w, f):
        w.put("I", 9, f + ".type")
        w.put("I", 9, f + ".arr_type")
        w.put("Q", 2, f + ".arr_count")
        for j, items in enumerate(([1, 2], [3])):
            w.put("I", 5, f"{f}.sub{j}_type")
            w.put("Q", len(items), f"{f}.sub{j}_count")
            for x in items:
                w.put("i", x)
    return fn


def kv_bool(v):
    def fn(w, f):
        w.put("I", 7, f + ".type")
        w.put("B", v, f + ".value")
    return fn


def default_kvs():
    return [
        ("general.architecture", kv_str("llama")),
        ("llama.block_count", kv_u32(2)),
        ("general.alignment", kv_u32(ALIGN)),
        ("tokenizer.ggml.tokens", kv_str_arr(["<s>", "▁a", "b", ""])),
        ("tokenizer.ggml.scores", kv_arr(6, 4, np.arange(4, dtype="<f4").tobytes())),
        ("x.nested", kv_nested()),
        ("x.flag", kv_bool(1)),
    ]


VALID, FIELDS, DATA_START = build()
STRUCTURAL = [n for n in FIELDS if not n.endswith(".value")]


def write(tmp_path: Path, data: bytes, name="bad.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def patch(data: bytes, field: str, value: int) -> bytes:
    off, fmt = FIELDS[field]
    size = struct.calcsize(fmt)
    value &= (1 << (8 * size)) - 1
    b = bytearray(data)
    b[off:off + size] = struct.pack("<" + fmt.upper(), value)
    return bytes(b)


def expect_error(p: Path, match: str | None = None) -> GGUFError:
    with pytest.raises(GGUFError, match=match) as ei:
        open_gguf(p).close()
    msg = str(ei.value)
    assert str(p) in msg, msg
    return ei.value


def test_builder_makes_a_valid_file(tmp_path):
    # the corpus derives from this file, so it must be valid for both readers
    p = write(tmp_path, VALID, "ok.gguf")
    with open_gguf(p) as f:
        assert f.metadata["tokenizer.ggml.tokens"] == ["<s>", "▁a", "b", ""]
        assert f.metadata["x.nested"] == [[1, 2], [3]] and f.metadata["x.flag"] is True
        assert [t.type.name for t in f.tensors.values()] == ["Q8_0", "F32", "F16"]
        assert f.tensors["tok_embd"].offset == DATA_START
        last = list(f.tensors.values())[-1]
        assert last.offset + last.nbytes == len(VALID)  # no slack: every prefix is broken
    r = gguf.GGUFReader(str(p))
    assert [t.name for t in r.tensors] == ["tok_embd", "norm", "w16"]


def test_truncation_everywhere(tmp_path):
    boundaries = {off for off, _ in FIELDS.values()}
    boundaries |= {off + struct.calcsize(fmt) for off, fmt in FIELDS.values()}
    cuts = set(range(0, DATA_START + 1)) | boundaries  # every byte of the header
    cuts |= set(range(DATA_START, len(VALID), 7)) | {len(VALID) - 1}  # a sample of the data
    for n in sorted(cuts):
        p = write(tmp_path, VALID[:n])
        e = expect_error(p)
        assert "byte" in str(e), (n, str(e))


HUGE = [2**64 - 1, 2**63, 2**63 - 1, 2**32 + 5, 2**31, 10**12, len(VALID) + 1]


def test_huge_counts_and_lengths_no_allocation(tmp_path):
    # every count/length/dim field overwritten with huge values: error, no big allocation
    tracemalloc.start()
    try:
        n = 0
        for field in STRUCTURAL:
            if field in ("version",) or field.endswith("type") or field.endswith(".offset"):
                continue
            for v in HUGE:
                p = write(tmp_path, patch(VALID, field, v))
                expect_error(p)
                n += 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n > 100
    assert peak < 20 * 2**20, f"peak traced allocation {peak / 2**20:.1f} MiB"


def test_off_by_one_counts(tmp_path):
    # lengths/counts slightly off make the rest of the header misparse: must still be an error
    for field in ("n_tensors", "n_kv", "kv0.key_len", "kv3.arr_count", "kv3.item1_len",
                  "ti0.name_len", "ti2.n_dims", "kv5.arr_count", "kv5.sub0_count"):
        off, fmt = FIELDS[field]
        v = struct.unpack_from("<" + fmt, VALID, off)[0]
        for nv in (v + 1, v + 2, v + 100):
            expect_error(write(tmp_path, patch(VALID, field, nv)))


def test_bit_flips_never_crash(tmp_path):
    # a flip in a string's text or a value can leave a valid file; anything else is GGUFError
    rng = np.random.default_rng(0)
    for off in range(DATA_START):
        b = bytearray(VALID)
        b[off] ^= 1 << int(rng.integers(8))
        p = write(tmp_path, bytes(b))
        try:
            open_gguf(p).close()
        except GGUFError:
            pass
    # high bits of every structural field are always fatal
    for field in STRUCTURAL:
        off, fmt = FIELDS[field]
        b = bytearray(VALID)
        b[off + struct.calcsize(fmt) - 1] ^= 0x80
        expect_error(write(tmp_path, bytes(b)))


CASES = [  # (field, new value, message regex)
    ("version", 1, "version 1 is not supported"),
    ("version", 7, "unknown GGUF version 7"),
    ("kv1.type", 13, "unknown value type 13"),
    ("kv1.type", 0xFFFFFFFF, "unknown value type"),
    ("kv3.arr_type", 42, "unknown array element type 42"),
    ("kv5.sub1_type", 99, "unknown array element type 99"),
    ("ti1.type", 4, "unknown ggml tensor type id 4 for tensor 'norm'"),
    ("ti1.type", 1000, "unknown ggml tensor type id 1000"),
    ("ti0.ne0", 48, "48 is not a multiple of the Q8_0 block size 32"),
    ("ti1.n_dims", 5, "5 dimensions, at most 4"),
    ("ti1.ne1", 0, r"ne\[1\].*dimension 0 is out of range"),
    ("ti0.offset", 2**40, "past the end of the file"),
    ("ti2.offset", len(VALID), "past the end of the file"),
    ("ti2.offset", 1, "not a multiple of the alignment 32"),
    ("ti1.offset", 0, "overlaps tensor 'tok_embd'"),
    ("kv2.value", 0, "general.alignment.*nonzero power of two"),
    ("kv2.value", 48, "general.alignment.*nonzero power of two"),
    ("kv6.value", 2, "bool value is 2"),
    ("n_tensors", 4, None),
]


@pytest.mark.parametrize("field,value,match", CASES)
def test_field_violations(tmp_path, field, value, match):
    e = expect_error(write(tmp_path, patch(VALID, field, value)), match)
    assert "byte" in str(e)


def test_bad_magic(tmp_path):
    expect_error(write(tmp_path, b"GGML" + VALID[4:]), "magic.*not a GGUF file")
    expect_error(write(tmp_path, b"\x00" * 100), "magic")


def test_shape_product_overflow(tmp_path):
    data, _, _ = build(tensors=[("big", (2**31, 2**31, 2**31), 0, 4)])
    expect_error(write(tmp_path, data), r"'big' ne\[2\].*overflows")


def test_duplicates(tmp_path):
    data, _, _ = build(kvs=default_kvs() + [("llama.block_count", kv_u32(3))])
    expect_error(write(tmp_path, data), "duplicate key 'llama.block_count'")
    t = ("norm", (8,), 0, 32)
    data, _, _ = build(tensors=[t, t])
    expect_error(write(tmp_path, data), "duplicate tensor name 'norm'")


def test_invalid_utf8(tmp_path):
    data, _, _ = build(kvs=[(b"bad\xffkey", kv_u32(1))])
    expect_error(write(tmp_path, data), r"kv\[0\] key.*UTF-8")
    data, _, _ = build(kvs=[("tok", kv_str_arr(["ok", b"\xc3("]))])
    expect_error(write(tmp_path, data), r"'tok'\[1\].*UTF-8")
    data, _, _ = build(tensors=[(b"\xe2\x82", (8,), 0, 32)])
    expect_error(write(tmp_path, data), r"tensor_info\[0\] name.*UTF-8")


def test_alignment_must_be_an_integer(tmp_path):
    data, _, _ = build(kvs=[("general.alignment", kv_str("32"))])
    expect_error(write(tmp_path, data), "general.alignment")


def test_deeply_nested_array(tmp_path):
    def deep(w, f):
        w.put("I", 9)
        for _ in range(5000):  # each level: element type ARRAY, one element
            w.put("I", 9)
            w.put("Q", 1)
        w.put("I", 0)
        w.put("Q", 0)
    data, _, _ = build(kvs=[("deep", deep)])
    expect_error(write(tmp_path, data), "nested deeper")


def test_huge_array_of_arrays_no_allocation(tmp_path):
    # 2**40 empty sub-arrays would each need 12 bytes: refused before any list is built
    tracemalloc.start()
    try:
        data, _, _ = build(kvs=[("a", kv_arr(9, 2**40, b""))])
        expect_error(write(tmp_path, data), r"array of 1099511627776 array needs")
        data, _, _ = build(kvs=[("a", kv_arr(8, 2**61, b""))])
        expect_error(write(tmp_path, data), "array of .* string needs")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 10 * 2**20
