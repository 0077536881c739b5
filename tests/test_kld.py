"""KL-divergence base files in llama-perplexity's format, and Model.logprobs."""

from __future__ import annotations

import json
import re
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from memfit.errors import MemfitError
from memfit.eval import kld


def test_row_quantization_round_trip():
    rng = np.random.default_rng(0)
    lg = (rng.standard_normal((5, 1001)) * 4).astype(np.float32)
    lg[2] = 1.5                                        # a flat row: scale 0
    rows = kld.quantize_rows(lg)
    assert rows.shape == (5, kld.row_width(1001)) == (5, 2 * 501 + 4) and rows.dtype == np.dtype("<u2")
    back = kld.dequantize_rows(rows, 1001)
    lp = lg - lg.max(1, keepdims=True)
    lp = lp - np.log(np.exp(lp.astype(np.float64)).sum(1, keepdims=True))
    keep = lg > lg.max(1, keepdims=True) - 16          # what the format keeps exactly
    scale = np.ascontiguousarray(rows[:, :4]).view("<f4")[:, 0]
    err = np.abs(back - lp)[keep & (scale[:, None] > 0)]
    assert err.max() <= scale.max() * 0.51 + 1e-5      # half a quantization step
    assert np.allclose(back[2], np.log(1 / 1001), atol=1e-5)


def test_base_file_layout(tmp_path):
    rng = np.random.default_rng(1)
    n_ctx, n_vocab = 32, 10
    toks = rng.integers(0, n_vocab, 2 * n_ctx + 5).tolist()

    def rows_of(chunk):  # fake logits source: one row per position from n_ctx // 2
        for r in range(n_ctx // 2, n_ctx, 4):
            yield r, rng.standard_normal((min(4, n_ctx - r), n_vocab)).astype(np.float32)

    p = tmp_path / "b.kld"
    assert kld.write_rows(p, n_ctx, n_vocab, toks, rows_of, bos=None) == 2
    raw = p.read_bytes()
    assert raw[:8] == b"_logits_" and struct.unpack("<iii", raw[8:20]) == (n_ctx, n_vocab, 2)
    assert list(np.frombuffer(raw[20:20 + 4 * 2 * n_ctx], "<i4")) == toks[:2 * n_ctx]
    rows = n_ctx - 1 - n_ctx // 2                       # the scored half, minus the last
    assert len(raw) == 20 + 4 * 2 * n_ctx + 2 * 2 * rows * kld.row_width(n_vocab)
    b = kld.read_base(p)
    assert (b.n_ctx, b.n_vocab, b.n_chunk, b.rows_per_chunk) == (n_ctx, n_vocab, 2, rows)
    p.write_bytes(raw[:-10])
    with pytest.raises(MemfitError, match="truncated"):
        kld.read_base(p)
    p.write_bytes(b"GGUF" + raw[4:])
    with pytest.raises(MemfitError, match="not a KL-divergence base"):
        kld.read_base(p)


def _memfit(*args):
    p = subprocess.run([sys.executable, "-m", "memfit", *map(str, args)], capture_output=True,
                       text=True, timeout=600)
    assert "Traceback" not in p.stderr, p.stderr
    return p


@pytest.mark.realmodel
def test_base_then_compare_through_the_cli(tmp_path, golden_dir, smollm2_path, gemma_path):
    text = tmp_path / "t.txt"
    text.write_text((golden_dir / "GPL-3.txt").read_text()[:9000])
    base = tmp_path / "smol.kld"
    p = _memfit("perplexity", smollm2_path, "-f", text, "--kl-divergence-base", base, "--chunks", 1,
                "--json", "-t", 2)
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["chunks"] == 1 and base.stat().st_size == 20 + 4 * 512 + 2 * 255 * kld.row_width(49152)
    r = json.loads(_memfit("perplexity", smollm2_path, "--kl-divergence", "--kl-divergence-base", base,
                           "--json", "-t", 2).stdout)
    # the same program against its own base: only the 16-bit quantization separates them
    assert r["count"] == 255 and abs(r["mean_kld"]) < 1e-4 and r["same_top"] == 1.0
    assert r["ppl"] == pytest.approx(d["ppl"], rel=1e-6) and r["ppl_base"] == pytest.approx(d["ppl"], rel=1e-3)
    text_out = _memfit("perplexity", smollm2_path, "--kl-divergence", "--kl-divergence-base", base,
                       "-t", 2).stdout
    for label in ("Mean    KLD:", "99.0%   KLD:", "Median  KLD:", "Same top p:", "Mean PPL(base)"):
        assert label in text_out
    # KL >= 0: rounding below zero is clamped, and nothing prints as a negative zero
    assert r["mean_kld"] >= 0.0 and r["percentiles"]["Minimum"] >= 0.0
    assert not re.search(r"-0\.0+\b", text_out), text_out
    assert re.search(r"Minimum KLD:\s+0\.000000$", text_out, re.M), text_out
    # -c: the chunks are the base file's; another size is refused in one line, the same honoured
    c = _memfit("perplexity", smollm2_path, "--kl-divergence", "--kl-divergence-base", base,
                "-c", 256)
    lines = c.stderr.strip().splitlines()
    assert c.returncode == 1 and len(lines) == 1 and "chunks of 512 tokens" in lines[0], c.stderr
    assert "drop -c 256" in lines[0] and c.stdout == ""
    same = json.loads(_memfit("perplexity", smollm2_path, "--kl-divergence", "--kl-divergence-base",
                              base, "-c", 512, "--json", "-t", 2).stdout)
    assert same["n_ctx"] == 512 and same["mean_kld"] == r["mean_kld"]
    # another vocabulary is refused, naming both sizes
    q = _memfit("perplexity", gemma_path, "--kl-divergence", "--kl-divergence-base", base)
    assert q.returncode == 1 and "49152" in q.stderr and "262144" in q.stderr
    assert sorted(os.listdir(tmp_path)) == ["smol.kld", "t.txt"]   # no .partial left


@pytest.mark.realmodel
def test_logprobs_teacher_forced(smollm2_path):
    import memfit
    with memfit.load(smollm2_path, threads=2) as m:
        ids = m.tokenize("The capital of France is Paris. The capital of Italy is")
        lp = m.logprobs(ids)
        assert lp.shape == (len(ids), m.tokenizer.n_vocab) and lp.dtype == np.float32
        assert np.allclose(np.exp(lp.astype(np.float64)).sum(1), 1, atol=1e-4)
        # row i is the distribution generate sees after ids[:i+1]; the two run different batch
        # shapes (13 rows at once vs a 5- or 13-token prefill), so probabilities move by up to
        # ~0.015 here, the order of llama.cpp's own batch-512-vs-1 spread
        for i in (4, len(ids) - 1):
            r = m.generate(ids[:i + 1], max_tokens=1, temperature=0, top_logprobs=3)
            top = r.top[0]
            assert int(np.argmax(lp[i])) == top[0][0]
            assert np.exp(lp[i][top[0][0]]) == pytest.approx(top[0][1], abs=0.03)
        with pytest.raises(MemfitError, match="outside the vocabulary"):
            m.logprobs([10 ** 7])
