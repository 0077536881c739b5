"""`memfit tokenize` on a 5 MB text against llama.cpp's tokenizer on the same file: wall time,
peak RSS (GNU time's %M, the whole process) and the ids compared.

    /root/peer-venv/bin/python benchmarks/tokenize_peer.py [--reps 3]

The text is tests/data/golden/GPL-3.txt repeated 150 times (5.27 MB). llama.cpp: llama-cpp-
python (built on this machine), the model loaded vocab-only, one llama_tokenize call over the
whole text (add_special, parse_special as `memfit tokenize` defaults), ids written like --ids.
memfit: `memfit tokenize MODEL -f FILE --ids` (MEMFIT_PY, default .venv/bin/python).
Appends one JSON line per run to benchmarks/tokenize_peer.jsonl.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = {"smollm2-135m": "SmolLM2-135M-Instruct.Q4_1", "gemma3-270m": "gemma-3-270m-q4_k_m"}
MODEL_DIR = os.path.expanduser("~/.cache/memfit/models")

PEER = r'''
import ctypes, sys, llama_cpp as L
cb = L.llama_log_callback(lambda a, b, c: None)  # kept alive for the whole run
L.llama_log_set(cb, ctypes.c_void_p(0))
mp = L.llama_model_default_params(); mp.vocab_only = True
m = L.llama_model_load_from_file(sys.argv[1].encode(), mp)
v = L.llama_model_get_vocab(m)
b = open(sys.argv[2], "rb").read()
buf = (L.llama_token * (len(b) + 16))()
n = L.llama_tokenize(v, b, len(b), buf, len(buf), True, True)
assert n >= 0
sys.stdout.write("[" + ", ".join(map(str, buf[:n])) + "]\n")
'''


def timed(cmd) -> tuple[float, int, str]:
    with tempfile.NamedTemporaryFile("r") as tf:
        t0 = time.perf_counter()
        p = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", tf.name, *cmd], capture_output=True,
                           text=True)
        dt = time.perf_counter() - t0
        assert p.returncode == 0, p.stderr[-2000:]
        return dt, int(tf.read().split()[-1]) * 1024, p.stdout


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--models", default=",".join(MODELS))
    a = ap.parse_args()
    text = open(os.path.join(HERE, "..", "tests", "data", "golden", "GPL-3.txt"), encoding="utf-8").read()
    memfit_py = os.environ.get("MEMFIT_PY", os.path.join(HERE, "..", ".venv", "bin", "python"))
    commit = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "big.txt")
        with open(src, "w", encoding="utf-8") as f:
            f.write(text * 150)
        size = os.path.getsize(src)
        out = open(os.path.join(HERE, "tokenize_peer.jsonl"), "a")
        for name in a.models.split(","):
            stem = MODELS[name]
            path = os.path.join(MODEL_DIR, stem + ".gguf")
            for rep in range(a.reps):
                for tool, cmd in (("llama.cpp", [sys.executable, "-c", PEER, path, src]),
                                  ("memfit", [memfit_py, "-m", "memfit", "tokenize", path, "-f", src, "--ids"])):
                    dt, rss, ids = timed(cmd)
                    n = ids.count(",") + 1
                    rec = {"model": name, "tool": tool, "rep": rep, "text_bytes": size, "n_tokens": n,
                           "seconds": round(dt, 3), "peak_rss_bytes": rss, "ids_sha256": hashlib.sha256(ids.encode()).hexdigest()[:16],
                           "memfit_commit": commit, "load_avg_1m": os.getloadavg()[0],
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
                    print(json.dumps(rec), flush=True)
                    out.write(json.dumps(rec) + "\n")
                    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
