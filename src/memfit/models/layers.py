"""Shared blocks of decoder-only transformers and the Model base class.

An architecture file declares its tensors (``layer_tensors``) and composes one block
(``block``) from the functions here; loading, checks, the cache and the forward loop live in
Model. Tensor names are GGUF's; activations are float32 [n_tokens, ...].
"""

from __future__ import annotations

import numpy as np

from ..errors import ModelError, RequestError, UnsupportedError
from ..kv.cache import KVCache, round_f16
from ..quant.reference import dequantize
from ..quant.types import SUPPORTED, TYPES
from .config import ModelConfig


class Model:
    arch = ""
    act = "silu"              # gated FFN activation: silu | gelu

    # KV values rounded to f16 as llama.cpp's default cache (and its f16 flash attention reads
    # Q as f16); tests of exact float math switch it off.
    kv_f16 = True

    def __init__(self, config: ModelConfig, weights, ops=None):
        from ..ops import get_ops
        self.config = config
        self.weights = weights
        self.ops = ops if ops is not None else get_ops()
        self.specs = self.tensor_specs()
        self._check_tensors()
        # small 1-D tensors (norms, biases, rope factors) are kept as float32 for the whole run
        self.vec: dict[str, np.ndarray] = {}
        for name, (shape, _) in self.specs.items():
            if len(shape) == 1 and weights.has(name):
                q = weights.get(name)
                self.vec[name] = dequantize(q.type.id, q.data.reshape(-1), shape[0]).copy()
        self.output = "output.weight" if weights.has("output.weight") else "token_embd.weight"

    # --- tensors -------------------------------------------------------------------------
    def layer_tensors(self, il: int) -> dict[str, tuple[tuple[int, ...], bool]]:
        """name -> (numpy shape, required) for layer il; architectures extend this."""
        c = self.config
        p = f"blk.{il}."
        q_dim, k_dim, v_dim = c.n_head * c.head_dim_k, c.n_head_kv * c.head_dim_k, c.n_head_kv * c.head_dim_v
        return {
            p + "attn_norm.weight": ((c.n_embd,), True),
            p + "attn_q.weight": ((q_dim, c.n_embd), True),
            p + "attn_k.weight": ((k_dim, c.n_embd), True),
            p + "attn_v.weight": ((v_dim, c.n_embd), True),
            p + "attn_output.weight": ((c.n_embd, c.n_head * c.head_dim_v), True),
            p + "attn_q.bias": ((q_dim,), False),
            p + "attn_k.bias": ((k_dim,), False),
            p + "attn_v.bias": ((v_dim,), False),
            p + "attn_output.bias": ((c.n_embd,), False),
            p + "ffn_norm.weight": ((c.n_embd,), True),
            p + "ffn_gate.weight": ((c.n_ff, c.n_embd), True),
            p + "ffn_up.weight": ((c.n_ff, c.n_embd), True),
            p + "ffn_down.weight": ((c.n_embd, c.n_ff), True),
        }

    def tensor_specs(self) -> dict[str, tuple[tuple[int, ...], bool]]:
        c = self.config
        specs = {
            "token_embd.weight": ((c.n_vocab, c.n_embd), True),
            "output_norm.weight": ((c.n_embd,), True),
            "output.weight": ((c.n_vocab, c.n_embd), False),
        }
        for il in range(c.n_layer):
            specs.update(self.layer_tensors(il))
        return specs

    def _check_tensors(self) -> None:
        w = self.weights
        if w.has("blk.0.ffn_gate_inp.weight"):
            raise UnsupportedError(f"{self.arch}: mixture-of-experts models are not supported yet "
                                   f"(found blk.0.ffn_gate_inp.weight)")
        for name, (shape, required) in self.specs.items():
            if not w.has(name):
                if required:
                    raise ModelError(f"tensor {name} is missing; {self.arch} needs it with shape "
                                     f"{shape}")
                continue
            got, qtype = w.info(name)
            if tuple(got) != tuple(shape):
                raise ModelError(f"tensor {name} has shape {tuple(got)}, expected {shape} for this "
                                 f"{self.arch} config")
            if qtype.id not in SUPPORTED:
                names = ", ".join(sorted(TYPES[i].name for i in SUPPORTED))
                raise UnsupportedError(f"tensor {name} has type {qtype.name}, which memfit cannot "
                                       f"compute with; supported types: {names}")

    # --- compute -------------------------------------------------------------------------
    def new_cache(self, n_ctx: int) -> KVCache:
        c = self.config
        return KVCache(c.n_layer, n_ctx, c.n_head_kv, c.head_dim_k, c.head_dim_v,
                       f16_values=self.kv_f16)

    def forward(self, ids, cache: KVCache, all_logits: bool = False,
                hidden_from: int | None = None) -> np.ndarray:
        """Logits f32 [n_vocab] of the last token, or [n, n_vocab] with all_logits; the tokens
        are placed at positions cache.offset.. and the cache advances by len(ids).
        With hidden_from=k, returns the final-normed hidden states [n - k, n_embd] of rows
        k.. instead, for the caller to turn into logits in slices (``logits``)."""
        all_logits = all_logits or hidden_from is not None
        c, ops = self.config, self.ops
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise RequestError("forward needs at least one token")
        if ids.min() < 0 or ids.max() >= c.n_vocab:
            bad = int(ids[(ids < 0) | (ids >= c.n_vocab)][0])
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {c.n_vocab})")
        pos = cache.positions(ids.size)
        x = ops.get_rows(self.weights.get("token_embd.weight"), ids)
        if c.embd_scale != 1.0:
            x = x * np.float32(c.embd_scale)
        for il in range(c.n_layer):
            # only the last row is needed after the last layer's attention
            last = None if all_logits or il < c.n_layer - 1 else slice(-1, None)
            x = self.block(il, x, pos, cache, last)
        cache.advance(ids.size)
        if hidden_from is not None:
            x = x[hidden_from:]
        x = ops.rmsnorm(x, self.vec["output_norm.weight"], c.rms_eps)
        if hidden_from is not None:
            return x
        logits = self.logits(x)
        return logits if all_logits else logits[-1]

    def logits(self, h: np.ndarray) -> np.ndarray:
        """Final-normed hidden states [n, n_embd] -> logits [n, n_vocab]."""
        c = self.config
        logits = self.ops.matmul(np.ascontiguousarray(h), self.weights.get(self.output))
        if c.final_softcap > 0.0:
            logits = np.float32(c.final_softcap) * np.tanh(logits / np.float32(c.final_softcap))
        return logits

    def block(self, il: int, x: np.ndarray, pos: np.ndarray, cache: KVCache, last) -> np.ndarray:
        raise NotImplementedError

    # --- shared pieces -------------------------------------------------------------------
    def norm(self, x: np.ndarray, name: str) -> np.ndarray:
        return self.ops.rmsnorm(x, self.vec[name], self.config.rms_eps)

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        # y = x @ W^T (+ bias when the file has one)
        y = self.ops.matmul(x, self.weights.get(name + ".weight"))
        b = self.vec.get(name + ".bias")
        return y if b is None else y + b

    def linears(self, x: np.ndarray, names: tuple[str, ...]) -> list[np.ndarray]:
        """[linear(x, name) for name in names], as one backend call when it has matmul_multi
        (weights sharing x: Q/K/V, gate/up)."""
        mm = getattr(self.ops, "matmul_multi", None)
        if mm is None:
            return [self.linear(x, nm) for nm in names]
        ys = mm(x, [self.weights.get(nm + ".weight") for nm in names])
        for i, nm in enumerate(names):
            b = self.vec.get(nm + ".bias")
            if b is not None:
                ys[i] = ys[i] + b
        return ys

    def attention(self, il: int, x: np.ndarray, pos: np.ndarray, cache: KVCache, last, *,
                  qk_norm: bool = False, rope_base: float | None = None,
                  freq_scale: float | None = None, window: int = 0) -> np.ndarray:
        """Self-attention of x [n, n_embd] -> [n or 1, n_embd]: Q/K/V projections (+bias),
        optional per-head RMS norm of Q and K, RoPE, cached causal attention, output proj."""
        c, ops, p = self.config, self.ops, f"blk.{il}."
        n = x.shape[0]
        q, k, v = self.linears(x, (p + "attn_q", p + "attn_k", p + "attn_v"))
        q = q.reshape(n, c.n_head, c.head_dim_k)
        k = k.reshape(n, c.n_head_kv, c.head_dim_k)
        v = v.reshape(n, c.n_head_kv, c.head_dim_v)
        if qk_norm:
            q = self.norm(q, p + "attn_q_norm.weight")
            k = self.norm(k, p + "attn_k_norm.weight")
        base = c.rope_base if rope_base is None else rope_base
        fs = c.rope_freq_scale if freq_scale is None else freq_scale
        ff = self.vec.get("rope_freqs.weight")  # llama3-style per-dim frequency factors
        kw = {} if ff is None else {"freq_factors": ff}
        q = ops.rope(q, pos, c.n_rot, base, fs, c.rope_neox, **kw)
        k = ops.rope(k, pos, c.n_rot, base, fs, c.rope_neox, **kw)
        K, V, kv_pos = cache.update_and_fetch(il, k, v)
        if last is not None:
            q, pos = q[last], pos[last]
        q = np.ascontiguousarray(q)
        if cache.f16_values:
            q = round_f16(q, q)  # q is this layer's own rope output
        o = ops.attention(q, K, V, pos, kv_pos, c.attn_scale, window,
                          c.attn_softcap)
        return self.linear(o.reshape(o.shape[0], c.n_head * c.head_dim_v), p + "attn_output")

    def ffn(self, il: int, x: np.ndarray) -> np.ndarray:
        # gated FFN: down(act(gate x) * up x)
        p = f"blk.{il}."
        g, u = self.linears(x, (p + "ffn_gate", p + "ffn_up"))
        h = self.ops.silu_mul(g, u) if self.act == "silu" else self.ops.gelu_mul(g, u)
        return self.linear(h, p + "ffn_down")
