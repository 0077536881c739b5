"""Saved sessions (memfit/session.py, Model.save_state / load_state): a restored session
continues exactly as the uninterrupted run; truncated, corrupt, foreign files are refused with
a clear error; a save killed mid-write leaves the old file or none, never a partial one."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time

import pytest

import memfit
from memfit.session import SessionError

pytestmark = pytest.mark.realmodel

PROMPT = ("The three primary colors are red, yellow and blue. Mixing two of them gives a "
          "secondary color: for example, red and yellow make")  # > one 32-token KV block
GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def smol(smollm2_path):
    with memfit.load(smollm2_path, n_ctx=256) as m:
        yield m


@pytest.mark.parametrize("ctype", ["f16", "q8_0"])
def test_restore_then_continue_equals_uninterrupted(smollm2_path, tmp_path, ctype):
    kw = dict(n_ctx=256, cache_type_k=ctype, cache_type_v=ctype)
    with memfit.load(smollm2_path, **kw) as m:  # uninterrupted: two turns in one process
        a1 = m.generate(PROMPT, max_tokens=12, **GREEDY)
        a2 = m.generate(a1.prompt_ids + a1.ids, max_tokens=12, **GREEDY)
        # the second turn reused the first prompt's full blocks (not those holding generated
        # tokens, computed as decode rows: engine/scheduler.py)
        assert a2.timings.cache_n == len(a1.prompt_ids) // 32 * 32
    with memfit.load(smollm2_path, **kw) as m:
        b1 = m.generate(PROMPT, max_tokens=12, **GREEDY)
        assert b1.ids == a1.ids
        size = m.save_state(tmp_path / "s.mfs", b1.prompt_ids + b1.ids, extra={"note": "x"})
        assert size == (tmp_path / "s.mfs").stat().st_size
    with memfit.load(smollm2_path, **kw) as m:  # a fresh load, as after a restart
        ids, extra = m.load_state(tmp_path / "s.mfs")
        assert extra == {"note": "x"} and ids == a1.prompt_ids + a1.ids
        c2 = m.generate(ids, max_tokens=12, **GREEDY)
        assert c2.timings.cache_n == (len(ids) - 1) // 32 * 32 >= 32  # every restored block
    assert c2.ids == a2.ids


def test_save_computes_a_sequence_not_in_the_cache(smollm2_path, smol, tmp_path):
    ids = smol.tokenize(PROMPT + " orange. " + PROMPT)
    smol.save_state(tmp_path / "cold.mfs", ids)
    with memfit.load(smollm2_path, n_ctx=256) as m:
        got, _ = m.load_state(tmp_path / "cold.mfs")
        r = m.generate(got, max_tokens=2, **GREEDY)
    assert got == ids and r.timings.cache_n == (len(ids) - 1) // 32 * 32 > 0


@pytest.fixture(scope="module")
def saved(smol, tmp_path_factory):
    p = tmp_path_factory.mktemp("sess") / "good.mfs"
    r = smol.generate(PROMPT, max_tokens=6, **GREEDY)
    smol.save_state(p, r.prompt_ids + r.ids)
    return p


def test_truncated_file_refused(smol, saved, tmp_path):
    data = saved.read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 40, 5):
        p = tmp_path / f"cut{cut}.mfs"
        p.write_bytes(data[:cut])
        with pytest.raises(SessionError) as e:
            smol.load_state(p)
        assert str(p) in str(e.value)
        assert any(w in str(e.value) for w in ("truncated", "not a memfit session", "corrupt"))
    p = tmp_path / "cut.mfs"
    p.write_bytes(data[:len(data) - 100])
    with pytest.raises(SessionError, match=r"truncated: \d+ bytes, expected \d+"):
        smol.load_state(p)


@pytest.mark.parametrize("where", ["ids", "kv", "checksum"])
def test_bit_flip_refused(smol, saved, tmp_path, where):
    data = bytearray(saved.read_bytes())
    hlen = int.from_bytes(data[12:16], "little")
    at = {"ids": 16 + hlen + 2, "kv": len(data) - 32 - 1000, "checksum": len(data) - 5}[where]
    data[at] ^= 0x10
    p = tmp_path / "flip.mfs"
    p.write_bytes(bytes(data))
    with pytest.raises(SessionError, match="corrupt: checksum mismatch"):
        smol.load_state(p)


def test_other_model_other_cache_types_and_garbage_refused(smollm2_path, gemma_path, saved, tmp_path):
    with memfit.load(gemma_path, n_ctx=256) as g:
        with pytest.raises(SessionError, match="saved with another model.*SmolLM2.*restore it with that model"):
            g.load_state(saved)
    with memfit.load(smollm2_path, n_ctx=256, cache_type_k="q8_0", cache_type_v="q8_0") as q:
        with pytest.raises(SessionError, match="KV cache types f16/f16.*-ctk f16 -ctv f16"):
            q.load_state(saved)
    junk = tmp_path / "junk.mfs"
    junk.write_bytes(b"GGUF" + os.urandom(300))
    with memfit.load(smollm2_path, n_ctx=256) as m:
        with pytest.raises(SessionError, match="not a memfit session file"):
            m.load_state(junk)
        with pytest.raises(SessionError, match="cannot read session file"):
            m.load_state(tmp_path / "missing.mfs")


def test_other_context_too_small_refused(smollm2_path, saved):
    from memfit.errors import RequestError
    with memfit.load(smollm2_path, n_ctx=8) as m:
        with pytest.raises(RequestError, match="--ctx-size"):
            m.load_state(saved)


SAVER = """
import sys, memfit
m = memfit.load(sys.argv[1], n_ctx=256)
r = m.generate(sys.argv[3], max_tokens=8, temperature=0)
print("generated", flush=True)
m.save_state(sys.argv[2], r.prompt_ids + r.ids)
print("saved", flush=True)
"""


def _kill_mid_save(model, target, prompt, tmp_dir):
    """Run a saver that sleeps between layers; SIGKILL it once its temporary file exists."""
    env = dict(os.environ, MEMFIT_TEST_SAVE_SLEEP="0.2")
    p = subprocess.Popen([sys.executable, "-c", SAVER, str(model), str(target), prompt],
                         stdout=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 120
    tmp = None
    while time.time() < deadline and tmp is None:
        found = [f for f in tmp_dir.iterdir() if f.name.startswith(f".{target.name}.tmp-")]
        if found and found[0].stat().st_size > 0:
            tmp = found[0]
        time.sleep(0.02)
    assert tmp is not None, "the saver never started writing"
    time.sleep(0.3)  # a few layers in
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL
    return tmp


@pytest.mark.timeout(300)
def test_kill_during_save_leaves_old_file_or_none(smollm2_path, smol, tmp_path):
    target = tmp_path / "chat.mfs"
    # no old file: the killed save leaves nothing at the target
    tmp = _kill_mid_save(smollm2_path, target, PROMPT, tmp_path)
    assert not target.exists() and tmp.exists()
    # an old file: the killed save leaves it untouched, and it still restores
    r = subprocess.run([sys.executable, "-c", SAVER, str(smollm2_path), str(target), "Hello " * 40],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "saved" in r.stdout, r.stderr
    before = hashlib.sha256(target.read_bytes()).hexdigest()
    _kill_mid_save(smollm2_path, target, PROMPT + " and", tmp_path)
    assert hashlib.sha256(target.read_bytes()).hexdigest() == before
    ids, _ = smol.load_state(target)
    assert smol.detokenize(ids).lstrip().startswith("Hello " * 12)


def _rebuild(data: bytes, header_text: str, body: bytes | None = None) -> bytes:
    """A session file with another header (and body), its checksum recomputed: what a
    hand-edited file looks like to load()."""
    import struct
    hlen = int.from_bytes(data[12:16], "little")
    hj = header_text.encode()
    rest = data[16 + hlen:-32] if body is None else body
    out = data[:8] + struct.pack("<II", 1, len(hj)) + hj + rest
    return out + hashlib.sha256(out).digest()


def _header(data: bytes) -> dict:
    import json
    hlen = int.from_bytes(data[12:16], "little")
    return json.loads(data[16:16 + hlen])


def _with(h: dict, path: str, value):
    import copy
    h = copy.deepcopy(h)
    *parents, last = path.split(".")
    d = h
    for p in parents:
        d = d[p]
    if value is _DELETE:
        del d[last]
    else:
        d[last] = value
    return h


_DELETE = object()
HAND_BUILT = [  # (field, value): each was an OverflowError/KeyError/AttributeError/TypeError or accepted
    ("n_tokens", 1e400), ("n_rows", float("nan")), ("n_layer", "30"), ("n_kv_head", True),
    ("row_bytes_k", 0), ("n_tokens", 2 ** 70), ("n_rows", -1), ("version", 2),
    ("cache_type_k", _DELETE), ("cache_type_v", "q5_0"), ("cache_type_k", ["f16"]),
    ("model", []), ("model", _DELETE), ("model.file_size", "98362432"),
    ("model.header_sha256", None), ("model.arch", 7), ("created", "yesterday"),
    ("extra", [1, 2]), ("extra", "x"), ("extra", _DELETE),
]


@pytest.mark.parametrize("field, value", HAND_BUILT, ids=[f"{f}=" + ("deleted" if v is _DELETE else repr(v))[:30] for f, v in HAND_BUILT])
def test_hand_built_header_is_the_session_error(smol, saved, tmp_path, field, value):
    import json
    data = saved.read_bytes()
    h = _with(_header(data), field, value)
    p = tmp_path / "hand.mfs"
    p.write_bytes(_rebuild(data, json.dumps(h)))  # 1e400 is written as Infinity, nan as NaN
    with pytest.raises(SessionError, match=f"{p} is corrupt: its header"):
        smol.load_state(p)


def test_hand_built_not_an_object_or_foreign_token_refused(smol, saved, tmp_path):
    import json
    import numpy as np
    data = saved.read_bytes()
    p = tmp_path / "hand.mfs"
    for text in ("[1, 2, 3]", "null", "17", '"header"', "[" * 5000 + "]" * 5000):
        p.write_bytes(_rebuild(data, text))
        with pytest.raises(SessionError, match="corrupt: its header"):
            smol.load_state(p)
    # a token id outside the vocabulary, checksum recomputed
    h = _header(data)
    hlen = int.from_bytes(data[12:16], "little")
    body = bytearray(data[16 + hlen:-32])
    body[0:4] = np.int32(10 ** 9).tobytes()
    p.write_bytes(_rebuild(data, json.dumps(h), bytes(body)))
    with pytest.raises(SessionError, match="token id 1000000000 is outside the vocabulary"):
        smol.load_state(p)
    # the unchanged header still loads (the rebuild itself is sound)
    p.write_bytes(_rebuild(data, json.dumps(h)))
    ids, extra = smol.load_state(p)
    assert len(ids) == h["n_tokens"] and extra == {}


def test_extra_must_be_a_json_object(smol, tmp_path):
    ids = smol.tokenize(PROMPT)
    for extra, why in (([1, 2], "extra must be a dict"), ({"f": object()}, "not JSON-able"),
                       ({"x": float("nan")}, "not JSON-able")):
        with pytest.raises(SessionError, match=why):
            smol.save_state(tmp_path / "e.mfs", ids, extra=extra)
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary left


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.timeout(300)
def test_next_save_removes_stale_temporaries_of_dead_savers_only(smollm2_path, smol, tmp_path):
    target = tmp_path / "chat.mfs"
    stale = _kill_mid_save(smollm2_path, target, PROMPT, tmp_path)  # a real kill -9 mid-save
    assert stale.exists() and stale.read_bytes()[:8] == b"MFSESSN\0"
    dead = _dead_pid()
    other_dead = tmp_path / f".notes.txt.tmp-{dead}"      # same name shape, not a session file
    other_dead.write_bytes(b"someone else's data")
    empty_dead = tmp_path / f".other.mfs.tmp-{dead}"     # killed before its first write
    empty_dead.write_bytes(b"")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / f".busy.mfs.tmp-{sleeper.pid}"  # a save still in progress elsewhere
        live.write_bytes(b"MFSESSN\0partial")
        smol.save_state(target, smol.tokenize(PROMPT))
        left = sorted(f.name for f in tmp_path.iterdir())
        assert left == sorted(["chat.mfs", other_dead.name, live.name]), left
    finally:
        sleeper.kill()
        sleeper.wait()
    ids, _ = smol.load_state(target)
    assert ids == smol.tokenize(PROMPT)
