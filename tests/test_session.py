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

PROMPT = "The three primary colors are"
GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def smol(smollm2_path):
    with memfit.load(smollm2_path, n_ctx=256) as m:
        yield m


@pytest.mark.parametrize("ctype", ["f16", "q8_0"])
def test_restore_then_continue_equals_uninterrupted(smollm2_path, tmp_path, ctype):
    kw = dict(n_ctx=256, cache_type_k=ctype, cache_type_v=ctype)
    with memfit.load(smollm2_path, **kw) as m:
        full = m.generate(PROMPT, max_tokens=24, **GREEDY)
        assert full.finish_reason == "length"
        s = m.new_session()
        first = m.generate(PROMPT, max_tokens=12, session=s, **GREEDY)
        assert first.ids == full.ids[:12]
        # the cache holds the prompt and the tokens fed back (not the last one sampled)
        assert s.ids == full.prompt_ids + full.ids[:11]
        size = m.save_state(tmp_path / "s.mfs", s, extra={"note": "x"})
        assert size == (tmp_path / "s.mfs").stat().st_size
    with memfit.load(smollm2_path, **kw) as m2:  # a fresh load, as after a restart
        s2, extra = m2.load_state(tmp_path / "s.mfs")
        assert extra == {"note": "x"} and s2.ids == full.prompt_ids + full.ids[:11]
        rest = m2.generate(full.prompt_ids + first.ids, max_tokens=12, session=s2, **GREEDY)
        assert rest.timings.cache_n == len(full.prompt_ids) + 11 and rest.timings.prompt_n == 1
    assert first.ids + rest.ids == full.ids


def test_session_reuses_the_common_prefix(smol):
    s = smol.new_session()
    a = smol.generate(PROMPT, max_tokens=4, session=s, **GREEDY)
    assert a.timings.cache_n == 0
    before = list(s.ids)
    b = smol.generate(PROMPT + " red", max_tokens=4, session=s, **GREEDY)
    # the prompt's tokens in common with the session are not computed again (a one-token
    # decode step then differs from a batched prefill by float rounding only, so the ids may)
    common = 0
    while common < len(before) and before[common] == b.prompt_ids[common]:
        common += 1
    assert b.timings.cache_n == common > 0
    assert b.timings.prompt_n == len(b.prompt_ids) - common
    assert s.ids == (b.prompt_ids + b.ids)[:s.cache.offset]
    s.reset()
    assert s.n_tokens == 0 and smol.generate(PROMPT, max_tokens=4, session=s, **GREEDY).ids == a.ids


@pytest.fixture(scope="module")
def saved(smol, tmp_path_factory):
    p = tmp_path_factory.mktemp("sess") / "good.mfs"
    s = smol.new_session()
    smol.generate(PROMPT, max_tokens=6, session=s, **GREEDY)
    smol.save_state(p, s)
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
s = m.new_session()
m.generate(sys.argv[3], max_tokens=8, session=s, temperature=0)
print("generated", flush=True)
m.save_state(sys.argv[2], s)
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
    r = subprocess.run([sys.executable, "-c", SAVER, str(smollm2_path), str(target), "Hello"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "saved" in r.stdout, r.stderr
    before = hashlib.sha256(target.read_bytes()).hexdigest()
    _kill_mid_save(smollm2_path, target, PROMPT + " and", tmp_path)
    assert hashlib.sha256(target.read_bytes()).hexdigest() == before
    s, _ = smol.load_state(target)
    assert s.n_tokens > 0 and smol.detokenize(s.ids).lstrip().startswith("Hello")
