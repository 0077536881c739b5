"""KL divergence against a base run, in llama-perplexity's ``--kl-divergence-base`` file format,
so either program can write the base and either can compare with it.

File layout (little endian):
    b"_logits_"  int32 n_ctx  int32 n_vocab  int32 n_chunk  int32 tokens[n_chunk * n_ctx]
    then per chunk, for positions first = n_ctx // 2 .. n_ctx - 2 (the scored half; the row
    at position j predicts token j + 1), one row of nv = 2 * ((n_vocab + 1) // 2) + 4 uint16:
    float32 scale, float32 min_log_prob, then n_vocab uint16 q (padded to even), where
    log p(i) = scale * q[i] + min_log_prob; logits more than 16 below the top map to q = 0.
The tokens are the text's (BOS first where the model adds one); each chunk's first token is
replaced by BOS for evaluation, as llama-perplexity does.
"""

from __future__ import annotations

import math
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import RequestError

MAGIC = b"_logits_"


def row_width(n_vocab: int) -> int:
    """uint16 entries per row: 4 for (scale, min_log_prob) + the vocab padded to even."""
    return 2 * ((n_vocab + 1) // 2) + 4


def check_base_output(path) -> None:
    """Refuse a base output that cannot be written, before work starts."""
    p = Path(path)
    if p.is_dir():
        raise RequestError(f"--kl-divergence-base {p} is a directory; give a file path")
    if p.exists() and not p.is_file():
        raise RequestError(f"--kl-divergence-base {p} exists and is not a regular file")
    if not p.parent.is_dir():
        raise RequestError(f"the folder of --kl-divergence-base {p} ({p.parent}) does not exist")


def quantize_rows(lg: np.ndarray) -> np.ndarray:
    """logits f32 [rows, n_vocab] -> the file's uint16 rows [rows, row_width(n_vocab)]."""
    lg = np.asarray(lg, dtype=np.float32)
    rows, n_vocab = lg.shape
    mx = lg.max(axis=1)
    mn = np.maximum(lg.min(axis=1), mx - np.float32(16))
    lse = np.log(np.exp(lg - mx[:, None], dtype=np.float64).sum(axis=1)).astype(np.float32)
    min_log_prob = (mn - mx - lse).astype(np.float32)
    scale = ((mx - mn) / np.float32(65535)).astype(np.float32)
    out = np.zeros((rows, row_width(n_vocab)), dtype="<u2")
    out[:, :4] = np.stack([scale, min_log_prob], axis=1).astype("<f4").view("<u2")
    ok = scale > 0
    inv = np.where(ok, 1 / np.where(ok, scale, 1), 0).astype(np.float32)
    q = np.rint((lg - mn[:, None]) * inv[:, None])  # half to even, as the float trick
    q = np.where(lg > mn[:, None], q, 0)
    out[:, 4:4 + n_vocab] = np.clip(q, 0, 65535).astype("<u2")
    return out


def dequantize_rows(rows: np.ndarray, n_vocab: int) -> np.ndarray:
    """uint16 rows -> log-probabilities f32 [rows, n_vocab]."""
    hdr = np.ascontiguousarray(rows[:, :4]).view("<f4")
    return (hdr[:, :1] * rows[:, 4:4 + n_vocab].astype(np.float32) + hdr[:, 1:2]).astype(np.float32)


@dataclass
class BaseFile:
    path: Path
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray              # int32 [n_chunk * n_ctx]
    data_offset: int

    @property
    def rows_per_chunk(self) -> int:
        return self.n_ctx - 1 - self.n_ctx // 2

    def chunk_rows(self, c: int) -> np.ndarray:
        nv = row_width(self.n_vocab)
        n = self.rows_per_chunk * nv
        return np.fromfile(self.path, dtype="<u2", count=n,
                           offset=self.data_offset + c * n * 2).reshape(self.rows_per_chunk, nv)


def read_base(path) -> BaseFile:
    p = Path(path)
    try:
        with open(p, "rb") as f:
            head = f.read(20)
            if len(head) < 20 or head[:8] != MAGIC:
                raise RequestError(f"{p} is not a KL-divergence base file (no _logits_ header); "
                                   f"write one with --kl-divergence-base FILE -f TEXT")
            n_ctx, n_vocab, n_chunk = struct.unpack("<iii", head[8:20])
            if n_ctx < 16 or n_vocab < 2 or n_chunk < 1:
                raise RequestError(f"{p}: bad header (n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk})")
            tokens = np.fromfile(f, dtype="<i4", count=n_ctx * n_chunk)
    except OSError as e:
        raise RequestError(f"cannot read {p}: {e.strerror or e}") from None
    b = BaseFile(p, n_ctx, n_vocab, n_chunk, tokens, 20 + 4 * n_ctx * n_chunk)
    want = b.data_offset + 2 * n_chunk * b.rows_per_chunk * row_width(n_vocab)
    if len(tokens) != n_ctx * n_chunk or os.path.getsize(p) < want:
        raise RequestError(f"{p} is truncated: {os.path.getsize(p)} bytes, the header needs {want}")
    return b


@dataclass
class KLDResult:
    count: int = 0
    ppl: float = 0.0
    ppl_err: float = 0.0
    ppl_base: float = 0.0
    ppl_base_err: float = 0.0
    cor_ln_ppl: float = 0.0
    mean_kld: float = 0.0
    mean_kld_err: float = 0.0
    percentiles: dict = field(default_factory=dict)  # "max", "99.9", ... "min" -> KLD
    same_top: float = 0.0
    same_top_err: float = 0.0
    mean_dp: float = 0.0
    rms_dp: float = 0.0
    chunks: int = 0
    n_ctx: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def format(self) -> str:
        pc = self.percentiles

        def f(x: float, spec: str) -> str:  # never "-0.000000": a value that rounds to 0 is 0
            t = format(x, spec)
            return format(0.0, spec) if float(t) == 0 else t

        lines = [
            f"chunks {self.chunks} x {self.n_ctx} tokens, {self.count} positions scored, {self.seconds:.1f} s",
            "====== Perplexity statistics ======",
            f"Mean PPL(Q)                   : {f(self.ppl, '10.6f')} ± {f(self.ppl_err, '10.6f')}",
            f"Mean PPL(base)                : {f(self.ppl_base, '10.6f')} ± {f(self.ppl_base_err, '10.6f')}",
            f"Cor(ln(PPL(Q)), ln(PPL(base))): {f(100 * self.cor_ln_ppl, '6.2f')}%",
            "====== KL divergence statistics ======",
            f"Mean    KLD: {f(self.mean_kld, '10.6f')} ± {f(self.mean_kld_err, '10.6f')}",
        ] + [f"{k if k[0].isalpha() else k.strip() + '%':<8}KLD: {f(v, '10.6f')}" for k, v in pc.items()] + [
            "====== Token probability statistics ======",
            f"Mean    Δp: {f(100 * self.mean_dp, '8.3f')} %",
            f"RMS Δp    : {f(100 * self.rms_dp, '8.3f')} %",
            f"Same top p: {f(100 * self.same_top, '6.3f')} ± {f(100 * self.same_top_err, '5.3f')} %",
        ]
        return "\n".join(lines)


def _mean_err(s: float, s2: float, n: int) -> tuple[float, float]:
    mean = s / n
    var = s2 / n - mean * mean
    return mean, (math.sqrt(var / (n - 1)) if var > 0 and n > 1 else 0.0)


def _chunk_ids(tokens, c: int, n_ctx: int, bos: int | None) -> list[int]:
    chunk = [int(t) for t in tokens[c * n_ctx:(c + 1) * n_ctx]]
    if bos is not None:
        chunk[0] = bos
    return chunk


def _bos(m) -> int | None:
    return m.tokenizer.bos_id if m.tokenizer.add_bos else None


def write_base(m, text: str, path, n_ctx: int = 512, max_chunks: int | None = None,
               progress=None):
    """Run ``text`` in n_ctx chunks and write the base file; returns (ppl, ppl_err, chunks)."""
    from .logits import iter_logits, log_softmax
    toks = m.tokenize(text, add_special=True, parse_special=False)
    n_chunk = len(toks) // n_ctx
    if max_chunks:
        n_chunk = min(n_chunk, max_chunks)
    if n_chunk == 0:
        raise RequestError(f"the text has {len(toks)} tokens; a KL-divergence base needs at least "
                           f"{n_ctx} (one chunk of --ctx-size)")
    first = n_ctx // 2
    nll = nll2 = 0.0
    count = 0
    p = Path(path)
    tmp = p.with_name(p.name + ".partial")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<iii", n_ctx, m.tokenizer.n_vocab, n_chunk))
            f.write(np.asarray(toks[:n_chunk * n_ctx], dtype="<i4").tobytes())
            for c in range(n_chunk):
                chunk = _chunk_ids(toks, c, n_ctx, _bos(m))
                for row, lg in iter_logits(m, chunk, first):
                    k = min(len(lg), n_ctx - 1 - row)   # the last position predicts nothing
                    if k <= 0:
                        break
                    lg = lg[:k]
                    f.write(quantize_rows(lg).tobytes())
                    lp = log_softmax(lg)
                    v = -lp[np.arange(k), np.asarray(chunk[row + 1:row + 1 + k])].astype(np.float64)
                    nll += float(v.sum())
                    nll2 += float((v * v).sum())
                    count += k
                if progress:
                    progress(c + 1, n_chunk, math.exp(nll / count))
        os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)
    mean, err = _mean_err(nll, nll2, count)
    return math.exp(mean), math.exp(mean) * err, n_chunk


def write_rows(path, n_ctx: int, n_vocab: int, tokens, rows_of, bos: int | None) -> int:
    """Write a base file from any source of logits (``rows_of`` as in compare_rows); returns
    the number of chunks. memfit's own runs use write_base."""
    n_chunk = len(tokens) // n_ctx
    with open(path, "wb") as f:
        f.write(MAGIC + struct.pack("<iii", n_ctx, n_vocab, n_chunk))
        f.write(np.asarray(tokens[:n_chunk * n_ctx], dtype="<i4").tobytes())
        for c in range(n_chunk):
            chunk = _chunk_ids(tokens, c, n_ctx, bos)
            for row, lg in rows_of(chunk):
                k = min(len(lg), n_ctx - 1 - row)
                if k > 0:
                    f.write(quantize_rows(lg[:k]).tobytes())
    return n_chunk


def compare(m, base: BaseFile, max_chunks: int | None = None, progress=None) -> KLDResult:
    """KL divergence of this model's next-token distributions from the base file's, with
    llama-perplexity's statistics."""
    from .logits import iter_logits
    if base.n_vocab != m.tokenizer.n_vocab:
        raise RequestError(f"{base.path} was written for a vocabulary of {base.n_vocab}; this "
                           f"model has {m.tokenizer.n_vocab}")
    bad = base.tokens[(base.tokens < 0) | (base.tokens >= m.tokenizer.n_vocab)]
    if len(bad):
        raise RequestError(f"{base.path} holds token id {int(bad[0])}, outside this model's vocabulary")
    return compare_rows(base, lambda chunk: iter_logits(m, chunk, base.n_ctx // 2), _bos(m),
                        max_chunks, progress)


def compare_rows(base: BaseFile, rows_of, bos: int | None, max_chunks: int | None = None,
                 progress=None) -> KLDResult:
    """The statistics for any source of logits: ``rows_of(chunk_ids)`` yields (row, logits
    [k, n_vocab]) for rows n_ctx // 2 onwards (memfit's model, or llama.cpp in benchmarks/)."""
    from .logits import log_softmax
    t0 = time.perf_counter()
    n_chunk = min(base.n_chunk, max_chunks) if max_chunks else base.n_chunk
    n_ctx, first = base.n_ctx, base.n_ctx // 2
    klds, dps = [], []
    s = dict(nll=0.0, nll2=0.0, nb=0.0, nb2=0.0, nnb=0.0, same=0)
    for c in range(n_chunk):
        chunk = _chunk_ids(base.tokens, c, n_ctx, bos)
        brows = base.chunk_rows(c)
        for row, lg in rows_of(chunk):
            k = min(len(lg), n_ctx - 1 - row)
            if k <= 0:
                break
            lp = log_softmax(lg[:k]).astype(np.float64)
            blp = dequantize_rows(brows[row - first:row - first + k], base.n_vocab).astype(np.float64)
            tgt = np.asarray(chunk[row + 1:row + 1 + k])
            idx = np.arange(k)
            nll, nllb = -lp[idx, tgt], -blp[idx, tgt]
            pb = np.where(blp > -16, np.exp(blp), 0.0)
            # KL >= 0: a negative sum is rounding (pb is 16-bit quantized), so clamp it to +0.0
            klds.append(np.maximum((pb * (blp - lp)).sum(axis=1), 0.0) + 0.0)
            dps.append(np.exp(-nll) - np.exp(-nllb))
            s["same"] += int((lg[:k].argmax(axis=1) == blp.argmax(axis=1)).sum())
            s["nll"] += nll.sum()
            s["nll2"] += (nll * nll).sum()
            s["nb"] += nllb.sum()
            s["nb2"] += (nllb * nllb).sum()
            s["nnb"] += (nll * nllb).sum()
        if progress:
            progress(c + 1, n_chunk, float(np.concatenate(klds).mean()))
    kld = np.concatenate(klds)
    dp = np.concatenate(dps)
    n = len(kld)
    r = KLDResult(count=n, chunks=n_chunk, n_ctx=n_ctx)
    mean, err = _mean_err(s["nll"], s["nll2"], n)
    r.ppl, r.ppl_err = math.exp(mean), math.exp(mean) * err
    mb, errb = _mean_err(s["nb"], s["nb2"], n)
    r.ppl_base, r.ppl_base_err = math.exp(mb), math.exp(mb) * errb
    cov = s["nnb"] / n - mean * mb
    va, vb = s["nll2"] / n - mean * mean, s["nb2"] / n - mb * mb
    r.cor_ln_ppl = cov / math.sqrt(va * vb) if va > 0 and vb > 0 else 0.0
    r.mean_kld, r.mean_kld_err = _mean_err(float(kld.sum()), float((kld * kld).sum()), n)
    r.percentiles = {"Maximum": float(kld.max())}
    for q in (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0):
        r.percentiles["Median" if q == 50 else f"{q:4.1f}"] = float(np.percentile(kld, q))
    r.percentiles["Minimum"] = float(kld.min())
    r.same_top = s["same"] / n
    r.same_top_err = math.sqrt(r.same_top * (1 - r.same_top) / (n - 1)) if n > 1 else 0.0
    r.mean_dp = float(dp.mean())
    r.rms_dp = float(np.sqrt((dp * dp).mean()))
    r.seconds = time.perf_counter() - t0
    return r


__all__ = ["MAGIC", "BaseFile", "KLDResult", "compare", "compare_rows", "write_rows", "dequantize_rows", "quantize_rows",
           "read_base", "row_width", "write_base", "check_base_output"]
