"""`memfit chat` driven as a person would, through a pseudo-terminal (pexpect): two turns (the
second reuses the first's KV through the engine's prefix cache), /save, /reset, /load (the
restored conversation continues with its KV reused), an unknown command, /exit."""

from __future__ import annotations

import re
import sys

import pytest

pexpect = pytest.importorskip("pexpect")

pytestmark = pytest.mark.realmodel

SUMMARY = re.compile(r"memfit: prompt (\d+) tok \((\d+) cached\).*context (\d+)/(\d+) \| "
                     r"peak RSS (\d+) MiB")


def _turn(child, text):
    child.sendline(text)
    child.expect(SUMMARY, timeout=120)
    prompt_n, cached, ctx, n_ctx, rss = map(int, child.match.groups())
    reply = child.before
    child.expect_exact("> ", timeout=30)
    return reply, prompt_n, cached, ctx


@pytest.mark.timeout(300)
def test_chat_two_turns_save_load_exit(smollm2_path, tmp_path):
    save = tmp_path / "conv.mfs"
    child = pexpect.spawn(sys.executable, ["-m", "memfit", "chat", str(smollm2_path), "-c", "512",
                                           "--temp", "0", "-n", "24"],
                          encoding="utf-8", timeout=120, dimensions=(40, 200))
    try:
        child.expect(r"loaded SmolLM2.*512 ctx.*RSS \d+ MiB")
        child.expect_exact("/exit to quit")
        child.expect_exact("> ")
        r1, p1, c1, ctx1 = _turn(child, "Hi! What is 2+2?")
        assert "4" in r1.split("\n", 1)[1] and c1 == 0 and p1 > 10  # after the echoed input
        r2, p2, c2, ctx2 = _turn(child, "And 3+3?")
        assert "6" in r2.split("\n", 1)[1]
        # the engine's prefix cache reuses the first turn's whole 32-token KV blocks (of the
        # ctx1 - 1 tokens computed: the last sampled token is never fed back)
        assert c2 == (ctx1 - 1) // 32 * 32 > 0 and p2 < ctx1 + 20 - c2

        child.sendline(f"/save {save}")
        child.expect(rf"saved {ctx2} tokens to {re.escape(str(save))}")
        child.expect_exact("> ")
        child.sendline("/reset")
        child.expect_exact("conversation reset")
        child.expect_exact("> ")
        child.sendline(f"/load {save}")
        child.expect(rf"loaded {ctx2} tokens, 4 messages")
        child.expect_exact("> ")
        _, _, c3, _ = _turn(child, "Thanks")
        assert c3 == (ctx2 - 1) // 32 * 32 > 0  # the restored blocks are reused

        child.sendline("/load /nonexistent/x.mfs")
        child.expect("error: cannot read session file")
        child.expect_exact("> ")
        child.sendline("/frobnicate")
        child.expect_exact("error: unknown command /frobnicate")
        child.expect_exact("> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF, timeout=30)
    finally:
        child.close()
    assert child.exitstatus == 0
    assert save.stat().st_size > 0


def _spawn(model, *extra):
    return pexpect.spawn(sys.executable, ["-m", "memfit", "chat", str(model), "-c", "1024",
                                          "--temp", "0", *extra],
                         encoding="utf-8", timeout=120, dimensions=(40, 200))


LONG = "Write a very long story about a dragon who learns to bake bread."


@pytest.mark.timeout(300)
def test_ctrl_c_stops_the_reply_keeps_the_conversation_then_twice_exits(smollm2_path, tmp_path):
    child = _spawn(smollm2_path, "-n", "600")
    try:
        child.expect_exact("/help")
        child.expect_exact("> ")
        child.sendline("/help")
        child.expect(r"/exit or /quit.*/reset.*/save FILE.*/load FILE.*Ctrl-C stops a reply")
        child.expect_exact("> ")
        # a hand-built session file (checksum recomputed, extra a list) is one error line
        bad = tmp_path / "bad.mfs"
        bad.write_bytes(b"MFSESSN\0" + (1).to_bytes(4, "little") + (2).to_bytes(4, "little")
                        + b"[]" + bytes(32))
        import hashlib
        data = bad.read_bytes()[:-32]
        bad.write_bytes(data + hashlib.sha256(data).digest())
        child.sendline(f"/load {bad}")
        child.expect(r"error: \S+bad\.mfs is corrupt: its header is a JSON list")
        child.expect_exact("> ")

        child.sendline(LONG)
        child.expect_exact(LONG)       # the echo of the typed line
        child.expect(r"\w+ \w+ \w+")   # the reply has started streaming
        child.sendintr()               # Ctrl-C: stops the reply, not the chat
        child.expect(r"reply stopped after (\d+) tokens; the conversation keeps them", timeout=60)
        n_kept = int(child.match.group(1))
        assert 3 <= n_kept < 600
        child.expect_exact("> ")
        # the chat goes on: the next turn reuses the interrupted conversation's KV blocks
        _, _, cached, ctx = _turn(child, "Now say just: The End.")
        assert cached >= 32 and ctx > n_kept
        # a second Ctrl-C in a row ends the chat
        child.sendline(LONG)
        child.expect_exact(LONG)
        child.expect(r"\w+ \w+ \w+")
        child.sendintr()
        child.expect(r"reply stopped after \d+ tokens", timeout=60)
        child.expect_exact("> ")
        child.sendintr()
        child.expect(pexpect.EOF, timeout=30)
        out = child.before
    finally:
        child.close()
    assert child.exitstatus == 0 and "Traceback" not in out and "interrupted" not in out


@pytest.mark.timeout(120)
def test_ctrl_c_on_an_empty_prompt_exits(smollm2_path):
    child = _spawn(smollm2_path)
    try:
        child.expect_exact("> ")
        child.sendintr()
        child.expect(pexpect.EOF, timeout=30)
    finally:
        child.close()
    assert child.exitstatus == 0 and "Traceback" not in child.before


def test_ctrl_c_works_when_started_with_sigint_blocked(smollm2_path):
    # a process inherits the signal mask of the thread that starts it (here: SIGINT blocked,
    # as a Python program's helper thread has it); memfit's main thread takes Ctrl-C again
    import signal
    child = pexpect.spawn(sys.executable, ["-m", "memfit", "chat", str(smollm2_path), "-c", "1024"],
                          encoding="utf-8", timeout=120, dimensions=(40, 200),
                          preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}))
    try:
        child.expect_exact("> ")
        child.sendintr()
        child.expect(pexpect.EOF, timeout=30)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0 and "Traceback" not in child.before


@pytest.mark.timeout(120)
def test_chat_on_a_base_model_says_so(gemma_path, smollm2_path):
    child = _spawn(gemma_path)
    try:
        child.expect(r"chat with gemma-3-270m\S* \(template: gemma")
        child.expect(r"no chat template of its own, so it is most likely a base model "
                     r"\(not instruction-tuned\): chat replies may be noise")
        child.expect_exact("> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF, timeout=30)
    finally:
        child.close()
    assert child.exitstatus == 0
    import subprocess
    p = subprocess.run([sys.executable, "-m", "memfit", "pull", "--list"], capture_output=True,
                       text=True, timeout=60)
    line = next(x for x in p.stdout.splitlines() if "gemma3-270m" in x)
    assert "base model (not instruction-tuned)" in line
    assert "base model" not in next(x for x in p.stdout.splitlines() if "smollm2-135m" in x)
    r = subprocess.run([sys.executable, "-m", "memfit", "run", str(gemma_path), "-p", "Hi",
                        "--chat", "-n", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "most likely a base model" in r.stderr, r.stderr
    # an instruction-tuned model with its own template gets no such note
    child = _spawn(smollm2_path)
    try:
        child.expect_exact("> ")
        assert "base model" not in child.before
        child.sendline("/exit")
        child.expect(pexpect.EOF, timeout=30)
    finally:
        child.close()
