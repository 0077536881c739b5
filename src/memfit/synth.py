"""Synthetic GGUF models with the real shapes of named architectures, for budget tests/benchmarks.

    synth(path, arch="llama", size="7b", quant="Q4_K_M", seed=0, progress=True) -> SynthResult

Weights are random valid blocks (memfit.quant.random: finite fp16 scales, uniform random
quant bits, never runs of zeros), deterministic from (seed, tensor index, chunk). The file is
streamed to disk chunk by chunk (a writer thread overlaps generation and write), so memory
stays ~2 chunks whatever the model size. Quant mixes follow llama-quantize's rules (e.g.
Q4_K_M: Q4_K, attn_v/ffn_down Q6_K in use_more_bits layers, output Q6_K, norms F32).
The metadata carries a small gpt2 byte-level BPE tokenizer padded with unused tokens to the
config's n_vocab, and a ChatML template, so `memfit run` loads it.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import RequestError
from .quant.types import BY_NAME, GGMLType

# name -> hyperparameters (real shapes; vocab as the original tokenizer's embedding rows)
CONFIGS: dict[tuple[str, str], dict] = {
    ("llama", "tiny"): dict(n_embd=512, n_layer=4, n_head=8, n_head_kv=4, n_ff=1536,
                            n_vocab=2048, n_ctx=2048, rope_base=10000.0, tied=False),
    ("qwen2", "tiny"): dict(n_embd=512, n_layer=4, n_head=8, n_head_kv=2, n_ff=1536,
                            n_vocab=2048, n_ctx=2048, rope_base=1e6, tied=False),
    ("llama", "1b"): dict(n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, n_ff=8192,
                          n_vocab=32000, n_ctx=4096, rope_base=500000.0, tied=False),
    # 1B layer shapes, 24 layers (~0.95 GB Q4_K_M): the budget tests' model, big enough that
    # 35% of the file clears the floor (two streaming slots of the 54 MB output matrix)
    ("llama", "1b-24l"): dict(n_embd=2048, n_layer=24, n_head=32, n_head_kv=8, n_ff=8192,
                              n_vocab=32000, n_ctx=4096, rope_base=500000.0, tied=False),
    ("llama", "7b"): dict(n_embd=4096, n_layer=32, n_head=32, n_head_kv=32, n_ff=11008,
                          n_vocab=32000, n_ctx=4096, rope_base=10000.0, tied=False),
    ("qwen2", "1.5b"): dict(n_embd=1536, n_layer=28, n_head=12, n_head_kv=2, n_ff=8960,
                            n_vocab=151936, n_ctx=32768, rope_base=1e6, tied=True),
    ("qwen2", "7b"): dict(n_embd=3584, n_layer=28, n_head=28, n_head_kv=4, n_ff=18944,
                          n_vocab=152064, n_ctx=32768, rope_base=1e6, tied=False),
}
# llama_ftype ids written as general.file_type
FILE_TYPES = {"F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9,
              "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
CHUNK_BYTES = 16 << 20    # generation/write unit; part of the determinism contract
# k-quant fallback when a row is not a multiple of 256 (llama-quantize does the same)
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(quant: str, name: str, layer: int | None, n_layer: int, cols: int,
                is_vector: bool) -> GGMLType:
    """The GGML type llama-quantize's mix gives this tensor for ftype `quant`."""
    if is_vector:
        return BY_NAME["F32"]
    if quant in ("Q4_K_M", "Q5_K_M"):
        base = quant[:4]
        t = base
        if name == "output.weight":
            t = "Q6_K"
        elif (name.endswith("attn_v.weight") or name.endswith("ffn_down.weight")) \
                and layer is not None and _use_more_bits(layer, n_layer):
            t = "Q6_K"
    elif quant in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q6_K"):
        t = "Q6_K" if name == "output.weight" else quant
    elif quant in ("Q8_0", "F16"):
        t = quant
    else:
        raise RequestError(f"unknown quant mix {quant!r}; use one of {', '.join(FILE_TYPES)}")
    qt = BY_NAME[t]
    if cols % qt.block_size:
        qt = BY_NAME[_FALLBACK.get(t, "F16")]
        if cols % qt.block_size:
            qt = BY_NAME["F16"]
    return qt


@dataclass
class SynthResult:
    path: Path
    nbytes: int
    n_tensors: int
    seconds: float

    @property
    def mb_per_s(self) -> float:
        return self.nbytes / 1e6 / max(self.seconds, 1e-9)


def model_tensors(arch: str, cfg: dict) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(name, numpy shape, layer) in llama.cpp's file order."""
    E, H, Hkv, F, V = cfg["n_embd"], cfg["n_head"], cfg["n_head_kv"], cfg["n_ff"], cfg["n_vocab"]
    D = E // H
    out = [("token_embd.weight", (V, E), None)]
    for il in range(cfg["n_layer"]):
        b = f"blk.{il}."
        ts = [(b + "attn_norm.weight", (E,)), (b + "attn_q.weight", (H * D, E)),
              (b + "attn_k.weight", (Hkv * D, E)), (b + "attn_v.weight", (Hkv * D, E))]
        if arch == "qwen2":
            ts += [(b + "attn_q.bias", (H * D,)), (b + "attn_k.bias", (Hkv * D,)),
                   (b + "attn_v.bias", (Hkv * D,))]
        ts += [(b + "attn_output.weight", (E, H * D)), (b + "ffn_norm.weight", (E,)),
               (b + "ffn_gate.weight", (F, E)), (b + "ffn_up.weight", (F, E)),
               (b + "ffn_down.weight", (E, F))]
        out += [(n, s, il) for n, s in ts]
    out.append(("output_norm.weight", (E,), None))
    if not cfg["tied"]:
        out.append(("output.weight", (V, E), None))
    return out


def _vocab(n_vocab: int) -> tuple[list[str], list[int], list[str], int, int]:
    from .models.synthetic import SPECIALS, tiny_vocab
    tokens, types, merges = tiny_vocab()
    assert len(tokens) <= n_vocab
    bos = tokens.index(SPECIALS[0])
    eos = tokens.index(SPECIALS[-1])
    pad = n_vocab - len(tokens)
    # unused filler rows so the embedding has the real vocab size (types 5 = UNUSED)
    tokens = tokens + [f"<unused_{i}>" for i in range(pad)]
    types = types + [5] * pad
    return tokens, types, merges, bos, eos


def _chunks(qt: GGMLType, shape: tuple[int, ...], rng: np.random.Generator, scale: float):
    """Yield the tensor's bytes in row chunks of about CHUNK_BYTES."""
    from .quant.random import random_weight
    if len(shape) == 1:
        yield (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32).view(np.uint8)
        return
    rows, cols = shape
    rb = qt.row_bytes(cols)
    step = max(1, CHUNK_BYTES // rb)
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        yield random_weight(qt, (n, cols), rng, scale).reshape(-1)


def check_output(path, force: bool = False) -> Path:
    """Refuse an output path that cannot or should not be written, before any work: a missing
    folder, a folder, anything that exists and is not a regular file (a device, a fifo, a
    socket), and an existing regular file unless ``force``."""
    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise RequestError(f"output {path} is a dangling symbolic link; give a file path")
    if path.exists() or path.is_symlink():
        import stat
        mode = path.stat().st_mode
        if stat.S_ISDIR(mode):
            raise RequestError(f"output {path} is a directory; give a file path such as {path}/model.gguf")
        if not stat.S_ISREG(mode):
            raise RequestError(f"output {path} exists and is not a regular file (a device, fifo or "
                               f"socket); memfit never replaces it")
        if not force:
            raise RequestError(f"output {path} already exists; add --force to overwrite it")
    parent = path.parent
    if not parent.is_dir():
        raise RequestError(f"the folder of output {path} ({parent}) does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise RequestError(f"the folder of output {path} ({parent}) is not writable")
    return path


def synth(path, arch: str = "llama", size: str = "7b", quant: str = "Q4_K_M", seed: int = 0,
          progress: bool = True, force: bool = False) -> SynthResult:
    """Write a synthetic GGUF; returns its size and write speed. See the module doc.
    An existing file is refused unless ``force``; a non-regular one always (check_output).
    A failed or interrupted write leaves no ``*.partial`` behind."""
    path = check_output(path, force)
    tmp = path.with_name(path.name + ".partial")
    try:
        return _write(path, arch, size, quant, seed, progress)
    except OSError as e:
        raise RequestError(f"cannot write {tmp}: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)


def _write(path: Path, arch: str, size: str, quant: str, seed: int, progress: bool) -> SynthResult:
    import gguf

    key = (arch, size.lower())
    if key not in CONFIGS:
        raise RequestError(f"no synthetic config {arch}-{size}; available: "
                           + ", ".join(f"{a}-{s}" for a, s in CONFIGS))
    if quant not in FILE_TYPES:
        raise RequestError(f"unknown quant mix {quant!r}; use one of {', '.join(FILE_TYPES)}")
    cfg = CONFIGS[key]
    tokens, ttypes, merges, bos, eos = _vocab(cfg["n_vocab"])
    E, H = cfg["n_embd"], cfg["n_head"]

    plan = []
    for name, shape, layer in model_tensors(arch, cfg):
        qt = tensor_type(quant, name, layer, cfg["n_layer"], shape[-1], len(shape) == 1)
        plan.append((name, shape, qt))

    tmp = path.with_name(path.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_name(f"synthetic {arch}-{size} {quant}")
    w.add_file_type(FILE_TYPES[quant])
    w.add_uint32(f"{arch}.block_count", cfg["n_layer"])
    w.add_uint32(f"{arch}.context_length", cfg["n_ctx"])
    w.add_uint32(f"{arch}.embedding_length", E)
    w.add_uint32(f"{arch}.feed_forward_length", cfg["n_ff"])
    w.add_uint32(f"{arch}.attention.head_count", H)
    w.add_uint32(f"{arch}.attention.head_count_kv", cfg["n_head_kv"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6 if arch == "qwen2" else 1e-5)
    w.add_float32(f"{arch}.rope.freq_base", cfg["rope_base"])
    if arch == "llama":
        w.add_uint32(f"{arch}.rope.dimension_count", E // H)
        w.add_uint32(f"{arch}.vocab_size", cfg["n_vocab"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(ttypes)
    w.add_token_merges(merges)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(False)
    from .models.synthetic import CHAT_TEMPLATE
    w.add_chat_template(CHAT_TEMPLATE)
    w.add_uint32("memfit.synth.seed", seed)
    for name, shape, qt in plan:
        nbytes = qt.row_bytes(shape[-1]) * (shape[0] if len(shape) == 2 else 1)
        # byte shape + raw type: gguf-py converts it back to the element shape
        w.add_tensor_info(name, (*shape[:-1], qt.row_bytes(shape[-1])), np.dtype(np.uint8),
                          nbytes, raw_dtype=gguf.GGMLQuantizationType(qt.id))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    align = w.data_alignment
    fout.write(b"\0" * (-fout.tell() % align))
    fout.flush()

    # writer thread: generation (numpy) and write(2) overlap; bounded queue caps memory
    q: queue.Queue = queue.Queue(maxsize=2)
    err: list[BaseException] = []
    fd = fout.fileno()

    def writer():
        try:
            while (buf := q.get()) is not None:
                mv = memoryview(buf)
                while mv:
                    mv = mv[os.write(fd, mv):]
        except BaseException as e:  # re-raised by the producer
            err.append(e)
            while q.get() is not None:
                pass

    th = threading.Thread(target=writer, name="memfit-synth-writer", daemon=True)
    th.start()
    t0 = time.perf_counter()
    written, last = 0, t0
    total = sum(qt.row_bytes(s[-1]) * (s[0] if len(s) == 2 else 1) for _, s, qt in plan)
    try:
        for idx, (name, shape, qt) in enumerate(plan):
            rng = np.random.default_rng([seed, idx])
            scale = min(0.05, 1.0 / np.sqrt(shape[-1]))
            if name.endswith(".bias"):
                data = (0.1 * rng.standard_normal(shape)).astype(np.float32).view(np.uint8)
                chunks = [data]
            else:
                chunks = _chunks(qt, shape, rng, scale)
            n = 0
            for c in chunks:
                if err:
                    raise err[0]
                q.put(c)
                n += c.nbytes
            assert n == qt.row_bytes(shape[-1]) * (shape[0] if len(shape) == 2 else 1), name
            q.put(np.zeros(-n % align, np.uint8))
            written += n
            now = time.perf_counter()
            if progress and (now - last > 0.5 or idx == len(plan) - 1):
                last = now
                print(f"\rsynth {path.name}: {written / 1e6:8.0f} / {total / 1e6:.0f} MB, "
                      f"{written / 1e6 / (now - t0):6.0f} MB/s", end="", file=sys.stderr,
                      flush=True)
    finally:
        q.put(None)
        th.join()
        w.close()
    if err:
        raise err[0]
    dt = time.perf_counter() - t0
    if progress:
        print(file=sys.stderr)
    os.replace(tmp, path)
    return SynthResult(path, path.stat().st_size, len(plan), dt)


__all__ = ["CONFIGS", "FILE_TYPES", "SynthResult", "synth", "check_output", "tensor_type", "model_tensors"]
