"""KL divergence per weight type: memfit against llama.cpp on a synthetic model of that type,
next to llama.cpp's own spread (batch 512 vs batch 1). Never run in CI.

Run with the interpreter that has llama-cpp-python (the memfit venv writes the models and runs
memfit, MEMFIT_PY, default .venv/bin/python):
    /root/peer-venv/bin/python benchmarks/types_kld.py --types IQ2_XXS,IQ2_XS,IQ3_XXS \
        [--arch llama --size 1b] [--chunks 2] [--out /tmp/memfit-types-kld]

Per type: `memfit synth --arch A --size S --quant TYPE --pure` (every matrix of that type,
norms F32; cached as /tmp/models/types-kld-A-S-TYPE.gguf), the text tests/data/golden/GPL-3.txt
tokenized by llama.cpp, `--chunks` chunks of 512 tokens, each in a fresh context, scored on
rows 256..511 (kld_peer.py's machinery):
  1. llama.cpp, the chunk as ONE batch of 512 with logits everywhere -> base file
  2. llama.cpp, the chunk token by token (batch 1) -> statistics against the base
  3. `memfit perplexity MODEL --kl-divergence --kl-divergence-base FILE --json -t 2`
     -> statistics against the same base (skipped, and said, for a type memfit cannot
     compute yet)
Mean KLD and top-1 agreement ("same_top"), one JSON line per (type, path), appended to
benchmarks/types_kld.jsonl with the commit. The weights are random valid blocks, so the
distributions are a synthetic model's, not a trained one's: the numbers compare the two
runtimes' arithmetic on each type, not quantization quality.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))  # memfit.eval.kld, memfit.quant.types: numpy only
from golden_peer import Peer  # noqa: E402
from kld_peer import N_CTX, TEXT, rows_llamacpp, summary  # noqa: E402
from peer_llamacpp import _quiet_logs  # noqa: E402

from memfit.eval.kld import compare_rows, read_base, write_rows  # noqa: E402

MODEL_DIR = "/tmp/models"


def synth_model(memfit_py: str, arch: str, size: str, ty: str) -> str:
    """The cached single-type synthetic model of `ty` (written once)."""
    path = os.path.join(MODEL_DIR, f"types-kld-{arch}-{size}-{ty}.gguf")
    if not os.path.exists(path):
        os.makedirs(MODEL_DIR, exist_ok=True)
        p = subprocess.run([memfit_py, "-m", "memfit", "synth", path, "--arch", arch, "--size",
                            size, "--quant", ty, "--pure", "--json"], capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"memfit synth {ty} failed: {p.stderr.strip()}")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", required=True, help="comma-separated GGML types (IQ2_XXS,Q4_K,...)")
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--size", default="1b")
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--out", default="/tmp/memfit-types-kld", help="folder of the base files")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from memfit.quant.types import SUPPORTED_NAMES
    import llama_cpp as L
    _keep = _quiet_logs(L)  # noqa: F841
    L.llama_backend_init()
    os.makedirs(a.out, exist_ok=True)
    text = open(TEXT, encoding="utf-8").read().rstrip("\n")
    commit = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    memfit_py = os.environ.get("MEMFIT_PY", os.path.join(HERE, "..", ".venv", "bin", "python"))
    for ty in a.types.split(","):
        t0 = time.perf_counter()
        path = synth_model(memfit_py, a.arch, a.size, ty)
        model = f"{a.arch}-{a.size}-{ty}"
        extra = {"type": ty, "file": os.path.basename(path), "file_bytes": os.path.getsize(path),
                 "memfit_commit": commit, "llama_cpp_python": L.__version__, "n_ctx": N_CTX,
                 "threads": a.threads, "text": "tests/data/golden/GPL-3.txt",
                 "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        rows = []
        peer = Peer(L, path, repack=True)
        b = text.encode()
        buf = (L.llama_token * (len(b) + 16))()
        n = L.llama_tokenize(peer.vocab, b, len(b), buf, len(buf), True, False)
        toks = list(buf[:n])[:a.chunks * N_CTX]
        assert len(toks) == a.chunks * N_CTX, (len(toks), "text too short for --chunks")
        bos = L.llama_vocab_bos(peer.vocab) if L.llama_vocab_get_add_bos(peer.vocab) else None
        base_path = os.path.join(a.out, f"{model}.b512.kld")
        write_rows(base_path, N_CTX, peer.n_vocab, toks, lambda c: rows_llamacpp(peer, c, 512), bos)
        base = read_base(base_path)
        r1 = compare_rows(base, lambda c: rows_llamacpp(peer, c, 1), bos)
        rows.append(summary(model, "llama.cpp batch 1 vs llama.cpp batch 512", r1))
        print(json.dumps(rows[-1]), flush=True)
        peer.close()
        if ty in SUPPORTED_NAMES:
            p = subprocess.run([memfit_py, "-m", "memfit", "perplexity", path, "--kl-divergence",
                                "--kl-divergence-base", base_path, "--json", "-t", str(a.threads)],
                               capture_output=True, text=True)
            if p.returncode != 0:
                sys.exit(f"memfit perplexity on {ty} failed: {p.stderr.strip()[-2000:]}")
            rows.append(summary(model, "memfit vs llama.cpp batch 512", json.loads(p.stdout)))
            print(json.dumps(rows[-1]), flush=True)
        else:
            print(f"{ty}: memfit cannot compute this type yet; llama.cpp's spread only",
                  file=sys.stderr)
        with open(os.path.join(HERE, "types_kld.jsonl"), "a") as f:
            for r in rows:
                f.write(json.dumps({**r, **extra}) + "\n")
        print(f"{ty}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
