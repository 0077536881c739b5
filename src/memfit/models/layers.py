"""Shared blocks of decoder-only transformers and the Model base class.

An architecture file declares its tensors (``layer_tensors``) and composes one block
(``block``) from the functions here; loading, checks, the cache and the forward loop live in
Model. Tensor names are GGUF's; activations are float32 [n_tokens, ...].
"""

from __future__ import annotations

import numpy as np

from ..errors import ModelError, RequestError, UnsupportedError
from ..kv.cache import KVCache
from .batch import Batch
from ..quant.reference import dequantize
from ..quant.types import SUPPORTED, TYPES
from .config import ModelConfig


class Model:
    arch = ""
    act = "silu"              # gated FFN activation: silu | gelu
    qk_norm = False           # per-head RMS norm of Q and K before RoPE (qwen3, gemma3)
    post_norms = False        # RMS norm of the attention and FFN outputs too (gemma3)

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
        self._fused: list | None = None  # prepared native decode layers, built on first use
        self._bufs: dict[str, np.ndarray] = {}  # prefill scratch reused across layers (_scratch)

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

    def forward(self, batch, cache: KVCache | None = None, all_logits: bool = False,
                hidden_from: int | None = None) -> np.ndarray:
        """``forward(batch)``: logits f32 [len(batch.out_rows), n_vocab] of a Batch
        (models/batch.py: flat rows of any sequences, the engine's runner builds it).

        ``forward(ids, cache)``: one sequence in a contiguous KVCache, logits f32 [n_vocab] of
        the last token, or [n, n_vocab] with all_logits; the tokens are placed at positions
        cache.offset.. and the cache advances by len(ids). With hidden_from=k, returns the
        final-normed hidden states [n - k, n_embd] of rows k.. instead, for the caller to turn
        into logits in slices (``logits``)."""
        if isinstance(batch, Batch):
            return self._forward(batch)
        ids = np.asarray(batch, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise RequestError("forward needs at least one token")
        self._check_ids(ids)
        n = ids.size
        kv = cache.view(n)  # RequestError on context overflow, before anything is written
        if hidden_from is not None:
            out = np.arange(hidden_from, n)
        else:
            out = np.arange(n) if all_logits else np.array([n - 1])
        b = Batch(ids, kv.pos, self._zero_seq(n), out, kv,
                  decode=n == 1 and not all_logits and hidden_from is None,
                  hidden=hidden_from is not None)
        r = self._forward(b)
        cache.advance(n)
        return r if all_logits or hidden_from is not None else r[-1]

    def _zero_seq(self, n: int) -> np.ndarray:
        z = self._bufs.get("seq0")
        if z is None or z.size < n:
            z = self._bufs["seq0"] = np.zeros(max(n, 512), np.int32)
        return z[:n]

    def _check_ids(self, ids: np.ndarray) -> None:
        c = self.config
        if ids.min() < 0 or ids.max() >= c.n_vocab:
            bad = int(ids[(ids < 0) | (ids >= c.n_vocab)][0])
            raise RequestError(f"token id {bad} is outside the vocabulary [0, {c.n_vocab})")

    def _forward(self, b: Batch) -> np.ndarray:
        c, ops = self.config, self.ops
        n = b.n
        x = ops.get_rows(self.weights.get("token_embd.weight"), b.ids)
        if c.embd_scale != 1.0:
            x = x * np.float32(c.embd_scale)
        fused = self._decode_layers() if b.decode else None
        if fused:
            # one native call per layer for all rows (csrc/decode.c): the same kernels in the
            # same order as block(); each weight matrix is read once for the whole batch
            get, kv = self.weights.get, b.kv
            x = np.ascontiguousarray(x)
            for il, (layer, names) in enumerate(fused):
                ops.decode_batch(layer, x, *kv.fused(il), *[get(nm).data for nm in names])
            if len(b.out_rows) < n:
                x = x[b.out_rows]
        else:
            out = b.out_rows
            # after the last layer's attention only the out rows are needed (at least one row
            # goes through it so that every row's K/V is stored)
            last = None if len(out) == n else (out if len(out) else np.array([n - 1]))
            for il in range(c.n_layer):
                x = self.block(il, x, b.pos, b.kv, last if il == c.n_layer - 1 else None)
            if len(out) == 0:
                x = x[:0]
        x = ops.rmsnorm(np.ascontiguousarray(x), self.vec["output_norm.weight"], c.rms_eps)
        if b.hidden:
            return x
        if x.shape[0] == 0:
            return np.zeros((0, c.n_vocab), np.float32)
        return self.logits(x)

    def logits(self, h: np.ndarray) -> np.ndarray:
        """Final-normed hidden states [n, n_embd] -> logits [n, n_vocab]."""
        c = self.config
        logits = self.ops.matmul(np.ascontiguousarray(h), self.weights.get(self.output))
        if c.final_softcap > 0.0:
            logits = np.float32(c.final_softcap) * np.tanh(logits / np.float32(c.final_softcap))
        return logits

    def rope_params(self, il: int) -> tuple[float, float, int]:
        """(rope base, rope frequency scale, attention window or 0) of layer il."""
        c = self.config
        return c.rope_base, c.rope_freq_scale, 0

    _LAYER_MATS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    _LAYER_VECS = ("attn_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight",
                   "post_attention_norm.weight", "ffn_norm.weight", "post_ffw_norm.weight",
                   "attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias")

    def _decode_layers(self) -> list | None:
        """[(native layer, its 7 matrix names)] for one-token decode when the backend has the
        fused layer (ops.decode_layer) and the block is the standard pre-norm one this file
        composes (llama/qwen2/qwen3/gemma3 flags above); else None: block() runs op by op."""
        if self._fused is None:
            self._fused = []
            new = getattr(self.ops, "decode_layer_new", None)
            if new is not None and type(self).block is Model.standard_block:
                c = self.config
                ff = self.vec.get("rope_freqs.weight")
                try:
                    for il in range(c.n_layer):
                        p = f"blk.{il}."
                        base, fs, window = self.rope_params(il)
                        types = [self.weights.info(p + m + ".weight")[1].id for m in self._LAYER_MATS]
                        vecs = [self.vec.get(p + v) for v in self._LAYER_VECS]
                        if not self.qk_norm:
                            vecs[1] = vecs[2] = None
                        if not self.post_norms:
                            vecs[3] = vecs[5] = None
                        layer = new((c.n_embd, c.n_head, c.n_head_kv, c.head_dim_k, c.head_dim_v,
                                     c.n_ff, c.n_rot, window, int(c.rope_neox),
                                     int(self.act == "gelu"), *types),
                                    (base, fs, c.rms_eps, c.attn_scale, c.attn_softcap),
                                    (*vecs, ff))
                        self._fused.append((layer, [p + m + ".weight" for m in self._LAYER_MATS]))
                except ValueError:  # a shape the fused kernel does not take: op by op instead
                    self._fused = []
        return self._fused or None

    # --- shared pieces -------------------------------------------------------------------
    def norm(self, x: np.ndarray, name: str) -> np.ndarray:
        return self.ops.rmsnorm(x, self.vec[name], self.config.rms_eps)

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        # y = x @ W^T (+ bias when the file has one)
        y = self.ops.matmul(x, self.weights.get(name + ".weight"))
        b = self.vec.get(name + ".bias")
        return y if b is None else y + b

    def linears(self, x: np.ndarray, names: tuple[str, ...], outs=None) -> list[np.ndarray]:
        """[linear(x, name) for name in names], as one backend call when it has matmul_multi
        (weights sharing x: Q/K/V, gate/up), into ``outs`` when given (native backend)."""
        mm = getattr(self.ops, "matmul_multi", None)
        if mm is None:
            return [self.linear(x, nm) for nm in names]
        ys = mm(x, [self.weights.get(nm + ".weight") for nm in names], outs)
        for i, nm in enumerate(names):
            b = self.vec.get(nm + ".bias")
            if b is not None:
                ys[i] = ys[i] + b
        return ys

    def attention(self, il: int, x: np.ndarray, pos: np.ndarray, cache: KVCache, last) -> np.ndarray:
        """Self-attention of x [n, n_embd] -> [n or 1, n_embd]: Q/K/V projections (+bias),
        per-head RMS norm of Q and K (qk_norm), RoPE (rope_params), cached causal attention,
        output projection."""
        c, ops, p = self.config, self.ops, f"blk.{il}."
        base, fs, window = self.rope_params(il)
        n = x.shape[0]
        q, k, v = self.linears(x, (p + "attn_q", p + "attn_k", p + "attn_v"))
        q = q.reshape(n, c.n_head, c.head_dim_k)
        k = k.reshape(n, c.n_head_kv, c.head_dim_k)
        v = v.reshape(n, c.n_head_kv, c.head_dim_v)
        if self.qk_norm:
            q = self.norm(q, p + "attn_q_norm.weight")
            k = self.norm(k, p + "attn_k_norm.weight")
        ff = self.vec.get("rope_freqs.weight")  # llama3-style per-dim frequency factors
        kw = {} if ff is None else {"freq_factors": ff}
        q = ops.rope(q, pos, c.n_rot, base, fs, c.rope_neox, **kw)
        k = ops.rope(k, pos, c.n_rot, base, fs, c.rope_neox, **kw)
        # the cache stores k/v and attends (q rows ``last`` only): its layout and type stay there
        o = cache.attend(il, ops, q, k, v, last, c.attn_scale, window, c.attn_softcap)
        return self.linear(o.reshape(o.shape[0], c.n_head * c.head_dim_v), p + "attn_output")

    def ffn(self, il: int, x: np.ndarray) -> np.ndarray:
        # gated FFN: down(act(gate x) * up x)
        p = f"blk.{il}."
        n, F = x.shape[0], self.config.n_ff
        if n > 1 and hasattr(self.ops, "matmul_multi"):
            # prefill on the native backend: gate, up and the activation (in place in gate) go
            # to buffers reused by every layer. Fresh [n, n_ff] arrays are new pages each
            # time: ~7-25 ms of page faults per 40 MB array here, ~3% of a 7B prefill.
            g, u = self.linears(x, (p + "ffn_gate", p + "ffn_up"),
                                [self._scratch(k, n * F).reshape(n, F) for k in ("gate", "up")])
            act = self.ops.silu_mul if self.act == "silu" else self.ops.gelu_mul
            h = act(g, u, out=g)
        else:
            g, u = self.linears(x, (p + "ffn_gate", p + "ffn_up"))
            h = self.ops.silu_mul(g, u) if self.act == "silu" else self.ops.gelu_mul(g, u)
        return self.linear(h, p + "ffn_down")

    def _scratch(self, key: str, size: int) -> np.ndarray:
        """A float32 buffer of `size` values kept by the model across layers and calls (grown
        when a larger batch comes); its contents are dead once the op that reads it is done."""
        buf = self._bufs.get(key)
        if buf is None or buf.size < size:
            buf = self._bufs[key] = np.empty(size, np.float32)
        return buf[:size]

    def standard_block(self, il: int, x: np.ndarray, pos: np.ndarray, cache: KVCache,
                       last) -> np.ndarray:
        """Pre-norm attention and gated FFN with residuals; with post_norms the outputs of both
        are RMS-normed before the residual add (gemma3). csrc/decode.c is this, fused."""
        p = f"blk.{il}."
        h = self.attention(il, self.norm(x, p + "attn_norm.weight"), pos, cache, last)
        if self.post_norms:
            h = self.norm(h, p + "post_attention_norm.weight")
        x = (x if last is None else x[last]) + h
        f = self.ffn(il, self.norm(x, p + "ffn_norm.weight"))
        if self.post_norms:
            f = self.norm(f, p + "post_ffw_norm.weight")
        return x + f

    block = standard_block
