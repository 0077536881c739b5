"""Cross-check of memfit's MoE models against llama.cpp itself (llama-cpp-python), on tiny
random files written by memfit's test-model writer. Three steps, two environments:

    python tools/moe_llamacpp_check.py write DIR      # memfit's venv: tiny files + memfit logits
    LLAMA_PY tools/moe_llamacpp_check.py llama DIR    # a venv with llama-cpp-python + numpy
    python tools/moe_llamacpp_check.py compare DIR    # memfit's venv: the table

llama-cpp-python is not a memfit dependency (it builds llama.cpp from source); results are
recorded in docs/NOTES.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ARCHS = {
    "qwen3moe": dict(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, head_dim=128, rope_base=1e6,
                     n_expert=8, n_expert_used=2, n_ff_exp=256),
    "qwen2moe": dict(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, head_dim=64, rope_base=1e6,
                     n_expert=8, n_expert_used=2, n_ff_exp=256, n_ff_shexp=512),
    "mixtral": dict(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, head_dim=64, rope_base=1e4,
                    n_expert=4, n_expert_used=2, n_ff_exp=256),
    "olmoe": dict(n_embd=256, n_layer=2, n_head=4, n_head_kv=4, head_dim=64, rope_base=1e4,
                  n_expert=8, n_expert_used=3, n_ff_exp=256),
}
TYPES = ["F32", "F16", "Q8_0", "Q4_K", "Q6_K"]
IDS = [5, 17, 200, 33, 290, 0, 64, 64, 128, 7, 255, 1, 40, 41, 42, 43]


def write(d: Path) -> None:
    from memfit.models import load_model
    from memfit.models.synthetic import write_tiny_model
    from memfit.ops import get_ops
    d.mkdir(parents=True, exist_ok=True)
    for arch, cfg in ARCHS.items():
        for qt in TYPES:
            p = write_tiny_model(d / f"{arch}-{qt}.gguf", arch, qt, seed=11, tied=False, **cfg)
            for backend in ("numpy", "native"):
                m = load_model(p, ops=get_ops(backend))  # f16 KV as llama.cpp's default cache
                np.save(d / f"{arch}-{qt}.memfit-{backend}.npy",
                        m.forward(IDS, m.new_cache(32), all_logits=True))
                m.file.close()


def llama(d: Path) -> None:
    from llama_cpp import Llama
    for p in sorted(d.glob("*.gguf")):
        # whole prompt in one batch, and one token at a time
        for name, n_batch in (("batch", 512), ("seq", 1)):
            m = Llama(str(p), n_ctx=64, n_batch=n_batch, n_ubatch=n_batch, logits_all=True,
                      n_threads=2, verbose=False)
            m.eval(IDS)
            np.save(p.with_suffix(f".llama-{name}.npy"), np.array(m.scores[:len(IDS)], np.float32))
            del m


def compare(d: Path) -> None:
    rows = []
    for p in sorted(d.glob("*.gguf")):
        ref = np.load(p.with_suffix(".llama-batch.npy")).astype(np.float64)
        seq = np.load(p.with_suffix(".llama-seq.npy")).astype(np.float64)
        scale = np.max(np.abs(ref))
        row = {"file": p.stem, "llama_batch_vs_seq": float(np.max(np.abs(seq - ref)) / scale)}
        for backend in ("numpy", "native"):
            got = np.load(d / f"{p.stem}.memfit-{backend}.npy").astype(np.float64)
            row[backend] = float(np.max(np.abs(got - ref)) / scale)
            row[backend + "_top1"] = float(np.mean(got.argmax(1) == ref.argmax(1)))
        rows.append(row)
    print(f"{'file':18} {'llama b/s':>10} {'numpy':>10} {'top1':>5} {'native':>10} {'top1':>5}")
    for r in rows:
        print(f"{r['file']:18} {r['llama_batch_vs_seq']:10.2e} {r['numpy']:10.2e} "
              f"{r['numpy_top1']:5.2f} {r['native']:10.2e} {r['native_top1']:5.2f}")
    (d / "compare.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    {"write": write, "llama": llama, "compare": compare}[sys.argv[1]](Path(sys.argv[2]))
