"""Synthetic GGUF models with the real shapes of named architectures, for budget tests/benchmarks.

    synth(path, arch="llama", size="7b", quant="Q4_K_M", seed=0, progress=True,
          routing_skew=0.0) -> SynthResult

The tensor table and the metadata keys come from the architecture's spec (models/spec.py).
Mixture-of-experts sizes: qwen3moe | mixtral (llama with experts) tiny, 2gb, and qwen3moe
30b-a3b (Qwen3-30B-A3B's shapes); qwen2moe and olmoe tiny. The routing of these files is
synthetic: a random router spreads tokens almost uniformly over the experts (the worst case for
an expert cache). routing_skew S > 0 adds a shared direction u to every token embedding
(norm S times the row's own) and gives router row e of each layer an alignment S * a_e with u
(a_e ~ N(0, 1) per layer and expert), so a few experts per layer become popular and choices
persist from token to token; the embedding is then written as Q8_0 to carry u.

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

# name -> hyperparameters (real shapes; vocab as the original tokenizer's embedding rows).
# "mixtral" is written as arch llama with experts.
_TINY_MOE = dict(n_embd=512, n_layer=4, n_head=8, n_head_kv=4, n_ff=1536, n_vocab=2048,
                 n_ctx=2048, rope_base=1e6, tied=False, n_expert=16, n_expert_used=4,
                 n_ff_exp=256)
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
    ("qwen3moe", "tiny"): dict(_TINY_MOE, head_dim=128),
    ("qwen2moe", "tiny"): dict(_TINY_MOE, n_ff_shexp=1024),
    ("olmoe", "tiny"): dict(_TINY_MOE, rope_base=10000.0),
    ("mixtral", "tiny"): dict(_TINY_MOE, rope_base=1e6, n_expert=8, n_expert_used=2,
                              n_ff_exp=1536),
    # ~2 GB at Q4_K_M: enough experts that a budget must cache them
    ("qwen3moe", "2gb"): dict(n_embd=1024, n_layer=24, n_head=16, n_head_kv=4, head_dim=128,
                              n_ff=3072, n_vocab=32000, n_ctx=32768, rope_base=1e6, tied=False,
                              n_expert=64, n_expert_used=8, n_ff_exp=768),
    ("mixtral", "2gb"): dict(n_embd=2048, n_layer=24, n_head=16, n_head_kv=4, n_ff=2816,
                             n_vocab=32000, n_ctx=32768, rope_base=1e6, tied=False,
                             n_expert=8, n_expert_used=2, n_ff_exp=2816),
    # Qwen3-30B-A3B: 48 layers, 32/4 heads of 128, 128 experts of 768, top-8 (~18 GB Q4_K_M)
    ("qwen3moe", "30b-a3b"): dict(n_embd=2048, n_layer=48, n_head=32, n_head_kv=4, head_dim=128,
                                  n_ff=6144, n_vocab=151936, n_ctx=40960, rope_base=1e6,
                                  tied=False, n_expert=128, n_expert_used=8, n_ff_exp=768),
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
    if is_vector or name.endswith("ffn_gate_inp.weight"):
        return BY_NAME["F32"]   # llama-quantize keeps norms, biases and routers in F32
    if quant in ("Q4_K_M", "Q5_K_M"):
        base = quant[:4]
        t = base
        if name == "output.weight":
            t = "Q6_K"
        elif name.endswith(("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight",
                            "ffn_down_shexp.weight")) \
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


def model_config(arch: str, cfg: dict):
    """ModelConfig of a CONFIGS entry (arch "mixtral": llama with experts)."""
    from .models.config import ModelConfig
    from .models.spec import get_spec
    file_arch = "llama" if arch == "mixtral" else arch
    spec = get_spec(file_arch)
    E, H = cfg["n_embd"], cfg["n_head"]
    hd = cfg.get("head_dim", E // H)
    n_expert = cfg.get("n_expert", 0)
    return ModelConfig(
        arch=file_arch, n_layer=cfg["n_layer"], n_embd=E, n_head=H, n_head_kv=cfg["n_head_kv"],
        # llama (Mixtral) and olmoe experts have feed_forward_length rows
        n_ff=cfg["n_ff"] if not n_expert or spec.n_ff_exp_key else cfg["n_ff_exp"],
        n_vocab=cfg["n_vocab"],
        rms_eps=1e-6 if file_arch.startswith(("qwen", "olmo")) else 1e-5,
        head_dim_k=hd, head_dim_v=hd, n_rot=hd, rope_base=cfg["rope_base"],
        n_ctx_train=cfg["n_ctx"], n_expert=n_expert,
        n_expert_used=cfg.get("n_expert_used", 0), n_ff_exp=cfg.get("n_ff_exp", 0),
        n_ff_shexp=cfg.get("n_ff_shexp", 0),
        expert_weights_norm=bool(n_expert) and spec.expert_weights_norm)


def model_tensors(arch: str, cfg: dict) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(name, numpy shape, layer) in llama.cpp's file order, from the architecture's spec."""
    from .models.spec import get_spec
    c = model_config(arch, cfg)
    return [(t.name, t.shape, t.layer) for t in get_spec(c.arch).tensors(c)
            if t.required or (t.name == "output.weight" and not cfg["tied"])]


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


def _rows(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape[:-1])) if len(shape) > 1 else 1


def _chunks(qt: GGMLType, shape: tuple[int, ...], rng: np.random.Generator, scale: float,
            direction: np.ndarray | None = None, skew: float = 0.0, name: str = ""):
    """Yield the tensor's bytes in row chunks of about CHUNK_BYTES (stacked experts: rows of
    all experts in order, so each expert is one contiguous range)."""
    from .quant.random import random_weight
    if len(shape) == 1:
        base = 1.0 if "norm" in name else 0.0   # norms around 1, the shared-expert gate around 0
        yield (base + 0.1 * rng.standard_normal(shape)).astype(np.float32).view(np.uint8)
        return
    rows, cols = _rows(shape), shape[-1]
    rb = qt.row_bytes(cols)
    step = max(1, CHUNK_BYTES // rb)
    a = None
    if direction is not None and name.endswith("ffn_gate_inp.weight"):
        a = rng.standard_normal(rows).astype(np.float32)   # each expert's popularity
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        if direction is None:
            yield random_weight(qt, (n, cols), rng, scale).reshape(-1)
            continue
        # routing skew: F32 router rows / Q8_0 embedding rows leaning along the direction
        z = (scale * rng.standard_normal((n, cols))).astype(np.float32)
        lean = skew * np.linalg.norm(z, axis=1, keepdims=True)
        if a is not None:
            lean = lean * a[r0:r0 + n, None]
        x = z + lean * direction
        yield (x.view(np.uint8) if qt.name == "F32" else _q8_0(x)).reshape(-1)


def _q8_0(x: np.ndarray) -> np.ndarray:
    """Rows of floats -> Q8_0 blocks (f16 scale max|x|/127, 32 int8 each)."""
    b = x.reshape(-1, 32)
    d = (np.abs(b).max(axis=1) / 127.0).astype(np.float16)
    inv = np.where(d > 0, 1.0 / np.maximum(d.astype(np.float32), 1e-30), 0.0)
    q = np.clip(np.rint(b * inv[:, None]), -127, 127).astype(np.int8)
    out = np.empty((b.shape[0], 34), np.uint8)
    out[:, :2] = d.view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q.view(np.uint8)
    return out


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
          progress: bool = True, routing_skew: float = 0.0, force: bool = False) -> SynthResult:
    """Write a synthetic GGUF; returns its size and write speed. See the module doc.
    An existing file is refused unless ``force``; a non-regular one always (check_output).
    A failed or interrupted write leaves no ``*.partial`` behind."""
    path = check_output(path, force)
    tmp = path.with_name(path.name + ".partial")
    try:
        return _write(path, arch, size, quant, seed, progress, routing_skew)
    except OSError as e:
        raise RequestError(f"cannot write {tmp}: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)


def _write(path: Path, arch: str, size: str, quant: str, seed: int, progress: bool,
           routing_skew: float) -> SynthResult:
    import gguf

    key = (arch, size.lower())
    if key not in CONFIGS:
        raise RequestError(f"no synthetic config {arch}-{size}; available: "
                           + ", ".join(f"{a}-{s}" for a, s in CONFIGS))
    if quant not in FILE_TYPES:
        raise RequestError(f"unknown quant mix {quant!r}; use one of {', '.join(FILE_TYPES)}")
    cfg = CONFIGS[key]
    if not (routing_skew >= 0.0 and np.isfinite(routing_skew)):
        raise RequestError(f"--routing-skew {routing_skew} must be >= 0 (0: random routing)")
    if routing_skew and not cfg.get("n_expert"):
        raise RequestError(f"--routing-skew needs a mixture-of-experts config; {arch}-{size} is dense")
    tokens, ttypes, merges, bos, eos = _vocab(cfg["n_vocab"])
    mc = model_config(arch, cfg)

    plan = []
    for name, shape, layer in model_tensors(arch, cfg):
        qt = tensor_type(quant, name, layer, cfg["n_layer"], shape[-1], len(shape) == 1)
        if routing_skew and name == "token_embd.weight":
            qt = BY_NAME["Q8_0"]   # carries the shared direction (random blocks cannot)
        plan.append((name, shape, qt))
    direction = None
    if routing_skew:
        u = np.random.default_rng([seed, 1 << 20]).standard_normal(mc.n_embd)
        direction = (u / np.linalg.norm(u)).astype(np.float32)

    tmp = path.with_name(path.name + ".partial")
    from .models.spec import write_hparams
    w = gguf.GGUFWriter(str(tmp), mc.arch)
    w.add_name(f"synthetic {arch}-{size} {quant}")
    w.add_file_type(FILE_TYPES[quant])
    write_hparams(w, mc)
    if routing_skew:
        w.add_float32("memfit.synth.routing_skew", float(routing_skew))
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
        nbytes = qt.row_bytes(shape[-1]) * _rows(shape)
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
    total = sum(qt.row_bytes(s[-1]) * _rows(s) for _, s, qt in plan)
    try:
        for idx, (name, shape, qt) in enumerate(plan):
            rng = np.random.default_rng([seed, idx])
            scale = min(0.05, 1.0 / np.sqrt(shape[-1]))
            if name.endswith(".bias"):
                data = (0.1 * rng.standard_normal(shape)).astype(np.float32).view(np.uint8)
                chunks = [data]
            else:
                skewed = direction is not None and (name == "token_embd.weight"
                                                    or name.endswith("ffn_gate_inp.weight"))
                chunks = _chunks(qt, shape, rng, scale, direction if skewed else None,
                                 routing_skew, name)
            n = 0
            for c in chunks:
                if err:
                    raise err[0]
                q.put(c)
                n += c.nbytes
            assert n == qt.row_bytes(shape[-1]) * _rows(shape), name
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


__all__ = ["CONFIGS", "FILE_TYPES", "SynthResult", "synth", "check_output", "tensor_type",
           "model_tensors", "model_config"]
