"""Tiny random models of every architecture x every supported type: memfit's forward pass
against an independent float64 recomputation (gguf-py reader + gguf.quants.dequantize), the
KV cache (prefill == token by token), sliding-window masking, and load-time errors."""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest

from memfit.errors import ModelError, RequestError, UnsupportedError
from memfit.models import load_model
from memfit.models.synthetic import write_tiny_model
from memfit.ops import get_ops
from memfit.quant.types import SUPPORTED_NAMES  # noqa: E402

ARCHS = ["llama", "qwen2", "qwen3", "gemma3"]
TYPES = list(SUPPORTED_NAMES)
# the hyperparameters each tiny model is written with (passed explicitly, read back by nobody)
CFG = {
    "llama": dict(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, rope_base=10000.0),
    "qwen2": dict(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, rope_base=1e6),
    "qwen3": dict(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, head_dim=128, n_ff=512, rope_base=1e6),
    "gemma3": dict(n_embd=256, n_layer=2, n_head=4, n_head_kv=1, head_dim=128, n_ff=512, rope_base=1e6,
                   sliding_window=4),
}
EPS = 1e-6
IDS = np.array([5, 17, 200, 33, 290, 0, 64, 64, 128, 7, 255, 1], dtype=np.int32)


def _weights(path) -> dict[str, np.ndarray]:
    r = gguf.GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        out[t.name] = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float64).reshape(shape)
    return out


def _rms(x, w):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * w


def _rope(x, pos, base, scale, neox):
    # x[n, h, d]: rotate pairs as complex numbers by pos * scale * base^(-2i/d)
    d = x.shape[-1]
    ang = np.exp(1j * pos[:, None, None] * scale * base ** (-np.arange(d // 2) * 2.0 / d))
    if neox:
        z = (x[..., : d // 2] + 1j * x[..., d // 2:]) * ang
        return np.concatenate([z.real, z.imag], axis=-1)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * ang
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def reference_logits(path, arch, ids, cfg, rope_scale=0.0, final_softcap=0.0, window=None):
    """All-position logits [n, vocab] in float64, written out plainly."""
    W = _weights(path)
    E, H, Hkv, D = cfg["n_embd"], cfg["n_head"], cfg["n_head_kv"], cfg["head_dim"]
    gemma = arch == "gemma3"
    n = len(ids)
    pos = np.arange(n, dtype=np.float64)
    x = W["token_embd.weight"][ids] * (math.sqrt(E) if gemma else 1.0)
    for il in range(cfg["n_layer"]):
        p = f"blk.{il}."
        h = _rms(x, W[p + "attn_norm.weight"])
        q = h @ W[p + "attn_q.weight"].T + W.get(p + "attn_q.bias", 0.0)
        k = h @ W[p + "attn_k.weight"].T + W.get(p + "attn_k.bias", 0.0)
        v = h @ W[p + "attn_v.weight"].T + W.get(p + "attn_v.bias", 0.0)
        q, k, v = q.reshape(n, H, D), k.reshape(n, Hkv, D), v.reshape(n, Hkv, D)
        if arch in ("qwen3", "gemma3"):
            q, k = _rms(q, W[p + "attn_q_norm.weight"]), _rms(k, W[p + "attn_k_norm.weight"])
        swa = gemma and (il + 1) % 6 != 0
        base = 10000.0 if swa else cfg["rope_base"]
        scale = 1.0 / rope_scale if rope_scale and not swa else 1.0
        q, k = _rope(q, pos, base, scale, arch != "llama"), _rope(k, pos, base, scale, arch != "llama")
        win = (cfg.get("sliding_window", 0) if window is None else window) if swa else 0
        o = np.zeros((n, H, D))
        for hh in range(H):
            kv = hh // (H // Hkv)
            s = q[:, hh] @ k[:, kv].T / math.sqrt(D)
            for i in range(n):
                for j in range(n):
                    if j > i or (win and i - j >= win):
                        s[i, j] = -np.inf
            s = np.exp(s - s.max(-1, keepdims=True))
            o[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, kv]
        a = o.reshape(n, H * D) @ W[p + "attn_output.weight"].T
        if gemma:
            a = _rms(a, W[p + "post_attention_norm.weight"])
        x = x + a
        h = _rms(x, W[p + "ffn_norm.weight"])
        g, u = h @ W[p + "ffn_gate.weight"].T, h @ W[p + "ffn_up.weight"].T
        if gemma:
            act = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))
        else:
            act = g / (1 + np.exp(-g))
        f = (act * u) @ W[p + "ffn_down.weight"].T
        if gemma:
            f = _rms(f, W[p + "post_ffw_norm.weight"])
        x = x + f
    out = W.get("output.weight", W["token_embd.weight"])
    logits = _rms(x, W["output_norm.weight"]) @ out.T
    if final_softcap:
        logits = final_softcap * np.tanh(logits / final_softcap)
    return logits


def rel_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def check_model(path, arch, cfg, ids=IDS, split=4, **ref_kw):
    m = load_model(path, ops=get_ops("numpy"))
    m.kv_f16 = False  # exact float32 math against the float64 recomputation
    ref = reference_logits(path, arch, ids, cfg, **ref_kw)
    # all positions at once
    full = m.forward(ids, m.new_cache(32), all_logits=True)
    assert full.shape == ref.shape and full.dtype == np.float32
    assert rel_err(full, ref) <= 1e-4, rel_err(full, ref)
    # prefill of `split` tokens, then one token at a time through the cache
    cache = m.new_cache(len(ids))
    steps = [m.forward(ids[:split], cache)]
    for t in ids[split:]:
        steps.append(m.forward(np.array([t]), cache))
    assert cache.offset == len(ids)
    step_logits = np.stack(steps)
    assert rel_err(step_logits, ref[split - 1:]) <= 1e-4
    assert rel_err(step_logits, full[split - 1:].astype(np.float64)) <= 1e-4
    return m, ref


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_forward_matches_float64(tmp_path, arch, qtype):
    cfg = CFG[arch]
    path = write_tiny_model(tmp_path / "m.gguf", arch, qtype, seed=hash((arch, qtype)) % 1000, **cfg)
    m, ref = check_model(path, arch, cfg)
    assert np.std(ref) > 0.1  # logits are not degenerate


def test_untied_output_and_final_softcap(tmp_path):
    cfg = CFG["llama"]
    path = write_tiny_model(tmp_path / "m.gguf", "llama", "Q8_0", seed=3, tied=False,
                            final_softcap=2.0, **cfg)
    m, ref = check_model(path, "llama", cfg, final_softcap=2.0)
    assert m.output == "output.weight"
    assert np.max(np.abs(ref)) < 2.0


def test_gemma3_sliding_window_and_global_layers(tmp_path):
    # 6 layers: 0-4 sliding window (rope base 1e4), 5 global (base 1e6, linear scaling x8)
    cfg = dict(CFG["gemma3"], n_layer=6, sliding_window=3)
    path = write_tiny_model(tmp_path / "m.gguf", "gemma3", "Q8_0", seed=4, rope_scale=8.0, **cfg)
    m, ref = check_model(path, "gemma3", cfg, rope_scale=8.0)
    assert [m.config.is_swa(i) for i in range(6)] == [True] * 5 + [False]
    # the window changes the answer for positions past it, so it was really exercised
    unmasked = reference_logits(path, "gemma3", IDS, cfg, rope_scale=8.0, window=0)
    assert np.allclose(unmasked[:3], ref[:3]) and rel_err(unmasked[3:], ref[3:]) > 1e-2


def test_cache_overflow_and_bad_ids(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "llama", "F16", seed=5, **CFG["llama"])
    m = load_model(path, ops=get_ops("numpy"))
    m.kv_f16 = False  # exact float32 math against the float64 recomputation
    cache = m.new_cache(4)
    m.forward(np.array([1, 2, 3]), cache)
    with pytest.raises(RequestError, match="context"):
        m.forward(np.array([4, 5]), cache)
    assert cache.offset == 3
    assert cache.trim(2) == 2 and cache.offset == 1
    m.forward(np.array([4, 5]), cache)
    with pytest.raises(RequestError, match="9999"):
        m.forward(np.array([9999]), m.new_cache(4))
    # layers x (K, V) x one block of 32 rows (4 tokens rounded up) x heads x dim x f32
    assert cache.nbytes == 2 * 2 * 32 * 2 * 64 * 4


def test_unknown_architecture(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "mamba9", "F32", seed=0)
    with pytest.raises(UnsupportedError, match="mamba9") as e:
        load_model(path)
    for arch in ARCHS:
        assert arch in str(e.value)


def test_missing_tensor(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "qwen2", "Q4_0", seed=0, skip={"blk.1.attn_k.bias"})
    with pytest.raises(ModelError, match=r"blk\.1\.attn_k\.bias.*missing"):
        load_model(path)


def test_wrong_tensor_shape(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "llama", "Q4_0", seed=0,
                            shapes={"blk.0.attn_k.weight": (256, 256)})
    with pytest.raises(ModelError, match=r"blk\.0\.attn_k\.weight.*\(256, 256\).*\(128, 256\)"):
        load_model(path)


def test_unsupported_tensor_type(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "gemma3", "Q4_K", seed=0,
                            types={"blk.0.ffn_down.weight": "Q8_1"})  # ggml's activation format
    with pytest.raises(UnsupportedError, match=r"blk\.0\.ffn_down\.weight.*Q8_1"):
        load_model(path)
