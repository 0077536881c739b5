"""`memfit tokenize` on a large text: streamed in pieces that cannot split a pre-token, an SPM
merge or a special token (ids identical to one whole-text encode), in bounded memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import GOLDEN, load_jsonl


def _tok(path):
    from memfit.gguf import open_gguf
    from memfit.tokenizer import Tokenizer
    with open_gguf(path) as f:
        return Tokenizer.from_metadata(f.metadata)


def _text() -> str:
    # real prose plus the golden tokenizer strings (special-token look-alikes, odd spacing,
    # CJK, emoji, newline runs): every kind of boundary the cut rules must respect
    gpl = (GOLDEN / "GPL-3.txt").read_text(encoding="utf-8")
    odd = "\n".join(c["text"] for c in load_jsonl(GOLDEN / "tokenizer_gemma-3-270m-q4_k_m.jsonl"))
    return gpl[:60000] + odd + "<start_of_turn>user\nHi  there<end_of_turn>\n\n\n  x>\u2581</y" + gpl[:20000]


@pytest.mark.realmodel
@pytest.mark.parametrize("fixture", ["smollm2_path", "gemma_path"])
@pytest.mark.parametrize("parse_special", [True, False])
def test_pieces_equal_whole_encode(request, fixture, parse_special):
    tok = _tok(request.getfixturevalue(fixture))
    text = _text()
    want = tok.encode(text, parse_special=parse_special)
    for piece in (300, 1000, 5000):
        parts = list(tok.iter_encode(text, parse_special=parse_special, piece_chars=piece))
        assert len(parts) > 10
        assert [i for p in parts for i in p] == want, piece




@pytest.mark.realmodel
def test_tokenize_5mb_in_bounded_memory(tmp_path, gemma_path):
    text = (GOLDEN / "GPL-3.txt").read_text(encoding="utf-8") * 150   # ~5.3 MB
    src = tmp_path / "big.txt"
    src.write_text(text, encoding="utf-8")
    # VmHWM of this process (ru_maxrss would carry the forking test runner's peak across exec)
    code = ("import sys; from memfit.cli import main; from memfit.memory.budget import peak_rss; "
            "rc = main(sys.argv[1:]); sys.stdout.flush(); print(peak_rss() // 1024, file=sys.stderr); "
            "sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code, "tokenize", str(gemma_path), "-f", str(src), "--ids"],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr
    peak_mib = int(p.stderr.strip().splitlines()[-1]) / 1024
    ids = json.loads(p.stdout)
    assert len(ids) > 1_000_000 and ids[0] == 2
    # interpreter + a 262k-entry vocabulary ~100 MiB; the 5 MB text must not add 8x its size
    assert peak_mib < 200, peak_mib
