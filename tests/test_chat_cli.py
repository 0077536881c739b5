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
