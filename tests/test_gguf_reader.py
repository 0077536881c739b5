"""memfit's GGUF reader against files written by gguf.GGUFWriter and against gguf.GGUFReader."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from memfit.errors import GGUFError, UnsupportedError
from memfit.gguf import GGUFFile, TensorInfo, open_gguf
from memfit.gguf.reader import GGUFUnsupportedError

F32 = lambda x: float(np.float32(x))  # noqa: E731 - value after a float32 round trip

SCALARS = [  # (key, value, writer type, expected read value)
    ("t.u8", 200, V.UINT8, 200), ("t.i8", -100, V.INT8, -100),
    ("t.u16", 60000, V.UINT16, 60000), ("t.i16", -30000, V.INT16, -30000),
    ("t.u32", 4_000_000_000, V.UINT32, 4_000_000_000), ("t.i32", -2_000_000_000, V.INT32, -2_000_000_000),
    ("t.f32", 0.1, V.FLOAT32, F32(0.1)), ("t.bool_t", True, V.BOOL, True),
    ("t.bool_f", False, V.BOOL, False), ("t.str", "héllo ▁wörld 🦙", V.STRING, "héllo ▁wörld 🦙"),
    ("t.u64", 2**64 - 1, V.UINT64, 2**64 - 1), ("t.i64", -(2**63), V.INT64, -(2**63)),
    ("t.f64", 0.1, V.FLOAT64, 0.1),
]
ARRAYS = [  # (key, values, element type, expected)
    ("a.u8", [0, 255, 7], V.UINT8, [0, 255, 7]), ("a.i8", [-128, 127], V.INT8, [-128, 127]),
    ("a.u16", [1, 65535], V.UINT16, [1, 65535]), ("a.i16", [-5, 5], V.INT16, [-5, 5]),
    ("a.u32", [3, 2**32 - 1], V.UINT32, [3, 2**32 - 1]), ("a.i32", [-1, 2, -3], V.INT32, [-1, 2, -3]),
    ("a.f32", [0.5, -1.25, 0.1], V.FLOAT32, [0.5, -1.25, F32(0.1)]),
    ("a.bool", [True, False, True], V.BOOL, [True, False, True]),
    ("a.str", ["a", "", "▁the", "<|im_end|>", "日本"], V.STRING, ["a", "", "▁the", "<|im_end|>", "日本"]),
    ("a.u64", [2**64 - 1, 0], V.UINT64, [2**64 - 1, 0]), ("a.i64", [-(2**63), 1], V.INT64, [-(2**63), 1]),
    ("a.f64", [1e300, -0.1], V.FLOAT64, [1e300, -0.1]),
]


def _tensors(rng):
    # (name, array written, raw_dtype or None, expected ggml type name, expected ne)
    q8 = rng.integers(0, 256, size=(3, 2 * 34), dtype=np.uint8)  # 3 rows of 64 Q8_0 elements
    return [
        ("w.f32", rng.standard_normal((5, 7)).astype(np.float32), None, "F32", (7, 5)),
        ("w.f16", rng.standard_normal((2, 3, 4)).astype(np.float16), None, "F16", (4, 3, 2)),
        ("w.i32", np.arange(11, dtype=np.int32), None, "I32", (11,)),
        ("w.q8", q8, Q.Q8_0, "Q8_0", (64, 3)),
        ("w.4d", rng.standard_normal((2, 1, 3, 2)).astype(np.float32), None, "F32", (2, 3, 1, 2)),
    ]


def write_model(path: Path, *, alignment: int | None = None, tensors=True, arch="llama",
                split_max_tensors: int = 0, seed: int = 0) -> dict:
    """Write a GGUF with every value type; return what was written (for comparison)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    for k, v, t, _ in SCALARS:
        w.add_key_value(k, v, t)
    for k, v, t, _ in ARRAYS:
        w.add_key_value(k, v, V.ARRAY, sub_type=t)
    w.add_key_value("a.nested", [[1, 2, 3], [4], [5, 6]], V.ARRAY)  # inner arrays of int32
    w.add_key_value("a.nested_str", [["x", "yy"], ["zzz"]], V.ARRAY)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    ts = _tensors(rng) if tensors else []
    for name, arr, raw, _, _ in ts:
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    expected = {"general.architecture": arch}
    expected |= {k: e for k, _, _, e in SCALARS} | {k: e for k, _, _, e in ARRAYS}
    expected["a.nested"] = [[1, 2, 3], [4], [5, 6]]
    expected["a.nested_str"] = [["x", "yy"], ["zzz"]]
    if alignment is not None:
        expected["general.alignment"] = alignment
    return {"metadata": expected, "tensors": ts}


def test_all_value_types_and_tensors(tmp_path):
    p = tmp_path / "m.gguf"
    want = write_model(p)
    with open_gguf(p) as f:
        assert isinstance(f, GGUFFile)
        assert f.version == 3 and f.alignment == 32 and f.arch == "llama"
        assert f.paths == [p] and f.file_size == p.stat().st_size
        assert f.metadata == want["metadata"]
        assert list(f.metadata) == list(want["metadata"])  # file order
        for k, v in f.metadata.items():  # plain Python values only
            assert type(v) in (str, int, float, bool, list), k
        assert all(type(x) is bool for x in f.metadata["a.bool"])
        assert all(type(x) is float for x in f.metadata["a.f32"])
        assert f.metadata_types["t.u16"] == "uint16"
        assert f.metadata_types["a.str"] == "array[string]"
        assert list(f.tensors) == [t[0] for t in want["tensors"]]
        for name, arr, _, tname, ne in want["tensors"]:
            t = f.tensors[name]
            assert isinstance(t, TensorInfo)
            assert t.type.name == tname and t.ne == ne and t.shape == tuple(reversed(ne))
            assert t.n_elements == int(np.prod(ne)) and t.file_index == 0
            assert t.offset % 32 == 0
            data = f.tensor_data(name)
            assert data.dtype == np.uint8 and data.nbytes == t.nbytes == arr.nbytes
            assert data.tobytes() == arr.tobytes()
            # zero-copy: a read-only view of the mapped file, not a copy
            assert not data.flags.writeable and not data.flags.owndata
        np.testing.assert_array_equal(
            f.tensor_data("w.f32").view(np.float32).reshape(f.tensors["w.f32"].shape),
            want["tensors"][0][1])


def test_custom_alignment(tmp_path):
    p = tmp_path / "m.gguf"
    write_model(p, alignment=256)
    with open_gguf(p) as f:
        assert f.alignment == 256
        for name, t in f.tensors.items():
            assert t.offset % 256 == 0, name


def test_metadata_only_file(tmp_path):
    p = tmp_path / "m.gguf"
    want = write_model(p, tensors=False)
    with open_gguf(p) as f:
        assert f.tensors == {} and f.metadata == want["metadata"]


def _patch_version(p: Path, version: int) -> None:
    b = bytearray(p.read_bytes())
    b[4:8] = struct.pack("<I", version)
    p.write_bytes(bytes(b))


def test_version_2_reads_like_3(tmp_path):
    p = tmp_path / "m.gguf"
    want = write_model(p)
    _patch_version(p, 2)  # v2 and v3 have the same little-endian layout
    with open_gguf(p) as f:
        assert f.version == 2 and f.metadata == want["metadata"]
        assert f.tensor_data("w.i32").view(np.int32).tolist() == list(range(11))


@pytest.mark.parametrize("version,words", [(1, "version 1 is not supported"),
                                           (0x03000000, "big-endian"),
                                           (4, "unknown GGUF version 4")])
def test_unsupported_versions(tmp_path, version, words):
    p = tmp_path / "m.gguf"
    write_model(p)
    _patch_version(p, version)
    with pytest.raises(GGUFError, match=words) as ei:
        open_gguf(p)
    assert "header.version" in str(ei.value) and str(p) in str(ei.value)
    if version != 4:
        assert isinstance(ei.value, UnsupportedError) and isinstance(ei.value, GGUFUnsupportedError)


def test_not_a_file(tmp_path):
    with pytest.raises(GGUFError, match="cannot open"):
        open_gguf(tmp_path / "missing.gguf")
    with pytest.raises(GGUFError, match="cannot open"):
        open_gguf(tmp_path)
    (tmp_path / "e.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="header"):
        open_gguf(tmp_path / "e.gguf")


def test_tensor_views_survive_close(tmp_path):
    # a view taken before close() stays valid (the map is kept alive by the view)
    p = tmp_path / "m.gguf"
    write_model(p)
    f = open_gguf(p)
    v = f.tensor_data("w.i32")
    f.close()
    assert v.view(np.int32).tolist() == list(range(11))
    with pytest.raises(GGUFError, match="closed"):
        f.tensor_data("w.i32")


# ---- split models -------------------------------------------------------------------------

def _write_split(tmp_path) -> tuple[list[Path], dict]:
    base = tmp_path / "model.gguf"
    want = write_model(base, split_max_tensors=2)  # 5 tensors -> 3 parts
    parts = [tmp_path / f"model-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    assert all(p.is_file() for p in parts) and not base.exists()
    return parts, want


def test_split_model_merges_parts(tmp_path):
    parts, want = _write_split(tmp_path)
    with open_gguf(parts[0]) as f:
        assert f.paths == parts
        assert f.file_size == sum(p.stat().st_size for p in parts)
        assert f.metadata["split.count"] == 3 and f.metadata["split.no"] == 0
        assert f.metadata["t.str"] == want["metadata"]["t.str"]
        assert list(f.tensors) == [t[0] for t in want["tensors"]]
        assert [t.file_index for t in f.tensors.values()] == [0, 0, 1, 1, 2]
        for name, arr, *_ in want["tensors"]:
            assert f.tensor_data(name).tobytes() == arr.tobytes(), name


def test_split_model_errors(tmp_path):
    parts, _ = _write_split(tmp_path)
    with pytest.raises(GGUFError, match=r"part 2 of a 3-part .*model-00001-of-00003\.gguf"):
        open_gguf(parts[1])
    parts[2].rename(tmp_path / "elsewhere.gguf")
    with pytest.raises(GGUFError, match=r"model-00003-of-00003\.gguf: part 3 of 3 .* missing"):
        open_gguf(parts[0])
    # the first part under a name without the -NNNNN-of-NNNNN pattern
    lone = tmp_path / "renamed.gguf"
    parts[0].rename(lone)
    with pytest.raises(GGUFError, match="file name does not follow"):
        open_gguf(lone)


def test_split_part_out_of_order(tmp_path):
    parts, _ = _write_split(tmp_path)
    # swap parts 2 and 3: their split.no no longer matches their position
    tmp = tmp_path / "x.gguf"
    parts[1].rename(tmp)
    parts[2].rename(parts[1])
    tmp.rename(parts[2])
    with pytest.raises(GGUFError, match="split.no=2.*expected split.no=1"):
        open_gguf(parts[0])


# ---- real models: cross-check with gguf-py's reader (test-only oracle) ----------------------

def _crosscheck(path: Path) -> None:
    r = gguf.GGUFReader(str(path))
    with open_gguf(path) as f:
        ref_meta = {k: fl.contents() for k, fl in r.fields.items() if not k.startswith("GGUF.")}
        assert list(f.metadata) == list(ref_meta)
        for k, v in ref_meta.items():
            assert f.metadata[k] == v, k
        assert len(f.tensors) == len(r.tensors)
        for t, rt in zip(f.tensors.values(), r.tensors):
            assert t.name == rt.name
            assert t.ne == tuple(int(x) for x in rt.shape)
            assert t.type.id == int(rt.tensor_type)
            assert t.offset == int(rt.data_offset) and t.nbytes == int(rt.n_bytes)
        # tensor bytes come from the same place (first and last tensor)
        for i in (0, -1):
            rt = r.tensors[i]
            assert np.array_equal(f.tensor_data(rt.name), np.asarray(rt.data).view(np.uint8).ravel())


@pytest.mark.realmodel
def test_smollm2_matches_gguf_py(smollm2_path):
    _crosscheck(smollm2_path)


@pytest.mark.realmodel
@pytest.mark.slow
def test_gemma_matches_gguf_py(gemma_path):
    _crosscheck(gemma_path)  # gguf.GGUFReader needs ~25 s for gemma's 262144-token vocab


@pytest.mark.realmodel
def test_gemma_fast_and_consistent(gemma_path):
    t0 = time.perf_counter()
    f = open_gguf(gemma_path)
    dt = time.perf_counter() - t0
    with f:
        assert dt < 1.5, f"parsing gemma-3-270m's header took {dt:.2f}s"  # ~0.25 s unloaded
        toks = f.metadata["tokenizer.ggml.tokens"]
        assert len(toks) == 262144 and toks[:3] == ["<pad>", "<eos>", "<bos>"]
        assert len(f.metadata["tokenizer.ggml.scores"]) == 262144
        assert f.arch == "gemma3" and f.metadata["gemma3.block_count"] == 18
        assert f.tensors["token_embd.weight"].shape == (262144, 640)
        # tensors tile the data section without gaps bigger than the alignment padding
        ts = sorted(f.tensors.values(), key=lambda t: t.offset)
        for a, b in zip(ts, ts[1:]):
            assert 0 <= b.offset - (a.offset + a.nbytes) < f.alignment
        assert ts[-1].offset + ts[-1].nbytes == f.file_size


def test_split_bad_metadata_and_corrupt_part(tmp_path):
    parts, _ = _write_split(tmp_path)
    # a truncated later part: the error names that part
    data = parts[2].read_bytes()
    parts[2].write_bytes(data[:len(data) // 2])
    with pytest.raises(GGUFError, match=r"model-00003-of-00003\.gguf: byte \d+"):
        open_gguf(parts[0])
    # split.count must be an integer
    p = tmp_path / "odd-00001-of-00002.gguf"
    w = gguf.GGUFWriter(p, "llama")
    w.add_string("split.count", "2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match=r"byte \d+: metadata 'split.count': expected an integer"):
        open_gguf(p)
