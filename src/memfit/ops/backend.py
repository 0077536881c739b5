"""Backends as objects: the ops of memfit.ops, what each backend declares it can do, and the
activation maths model code asks of it.

A backend is one object (``get_ops(name)``): the op functions of its module (the list in
memfit.ops), a declared set of capabilities (``caps``), and methods that always exist --
``matmul_multi``, ``route``, ``group_rows``, ``set_threads``/``get_threads`` -- with their
fallbacks inside the backend. Model code asks ``ops.has(cap)`` and never probes attributes,
so an accelerator backend is one more class here.

    caps
      matmul_multi     several weights sharing x in one call, into the caller's buffers
      moe_ffn          the routed experts of a layer in one call (csrc/moe.c)
      dense_decode     the fused one-token dense decoder layer (csrc/decode.c)
      moe_decode       the fused decoder layer with routed experts (csrc/decode.c)
      moe_stream_decode  that layer in two calls for experts the store streams
                       (decode_batch_route, then decode_batch_experts with each expert's bytes)
      moe_stream_table  that layer from the store's expert table: one call when every chosen
                       expert is at hand (decode_batch_moe, decode_batch_experts_at), else the
                       experts at hand while the rest load (decode_batch_experts_part)
      paged_attention  attention and KV stores straight on the paged pool (kv/view.py)
      batch_invariant  a row's result never depends on the other rows of its call
      threads          a kernel thread pool (set_threads / get_threads do something)

Routing (``route``) is llama.cpp's build_moe_ffn selection: probabilities by softmax, sigmoid
or the raw logits (softmax_weight: gpt-oss, whose weights are a softmax over the chosen k),
an optional selection bias (DeepSeek-V3/GLM's exp_probs_b: choice only, not weights),
group-limited choice (expert_group_count / _used_count), top-k with ties to the lower expert
index, then renormalization and scale. It is numpy on [n_tokens, n_expert] logits: small next
to the experts' matmuls, and the same numbers on every backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np

CAPS = ("matmul_multi", "moe_ffn", "dense_decode", "moe_decode", "moe_stream_decode",
        "moe_stream_table", "paged_attention", "batch_invariant", "threads")


@dataclass(frozen=True)
class RouteSpec:
    """How a layer's router logits become (experts, weights); the ModelConfig's keys."""
    k: int                        # expert_used_count
    gating: str = "softmax"       # softmax | sigmoid | softmax_weight
    norm: bool = False            # expert_weights_norm: chosen weights renormalized to sum 1
    scale: float = 1.0            # expert_weights_scale
    n_group: int = 0              # expert_group_count (0 or 1: no groups)
    n_group_used: int = 0         # expert_group_used_count


class Backend:
    """The ops of one module plus declared capabilities (see the module docstring)."""

    name = "custom"
    caps: frozenset = frozenset()

    def __init__(self, module, caps=None, name: str | None = None):
        self.module = module
        if caps is not None:
            self.caps = frozenset(caps)
        if name is not None:
            self.name = name
        # the module's functions as attributes of this object (no per-call forwarding)
        for k in dir(module):
            if not k.startswith("_") and not hasattr(type(self), k):
                setattr(self, k, getattr(module, k))

    def has(self, cap: str) -> bool:
        return cap in self.caps

    def __repr__(self) -> str:
        return f"<memfit backend {self.name} caps={sorted(self.caps)}>"

    # --- ops that always exist ------------------------------------------------------------
    def matmul_multi(self, x, ws, outs=None, rowwise=None):
        """[x @ W^T for W in ws]; one call where the backend has it (cap matmul_multi, which
        also takes ``outs``), else one matmul each."""
        if self.has("matmul_multi"):
            return self.module.matmul_multi(x, ws, outs, rowwise=rowwise)
        return [self.matmul(x, w, rowwise=bool(rowwise)) for w in ws]

    def set_threads(self, n: int) -> int:
        return self.module.set_threads(n) if self.has("threads") else 1

    def get_threads(self) -> int:
        return self.module.get_threads() if self.has("threads") else 1

    def dense_layer(self, params):
        """(prepared layer, its weight names in decode_batch's order) of the fused dense
        decoder layer (cap dense_decode) from a DenseLayerParams (ops/fused.py)."""
        return self._fused_layer(params, "dense_decode", "decode_layer", "fused decode layer")

    def moe_layer(self, params):
        """(prepared layer, its weight names in decode_batch's order) of the fused MoE decoder
        layer (cap moe_decode) from a MoeLayerParams (ops/fused.py)."""
        return self._fused_layer(params, "moe_decode", "moe_layer", "fused MoE decode layer")

    def _fused_layer(self, params, cap: str, prefix: str, what: str):
        """params packed by the slot names the module exports (``PREFIX_fields()``, read
        once), then ``PREFIX_new``."""
        from .fused import pack
        if not self.has(cap):
            raise NotImplementedError(f"backend {self.name} has no {what}")
        key = f"_{prefix}_fields"
        fields = self.__dict__.get(key)
        if fields is None:
            fields = self.__dict__[key] = getattr(self, prefix + "_fields")()
        iv, fv, vv, names = pack(params, fields)
        return getattr(self, prefix + "_new")(iv, fv, vv), names

    # --- activation maths -----------------------------------------------------------------
    def route(self, logits: np.ndarray, spec: RouteSpec, bias: np.ndarray | None = None):
        """Router logits [n, n_expert] -> (experts int64 [n, k], weights f32 [n, k])."""
        if spec.gating == "softmax":
            probs = self.softmax(logits)
        elif spec.gating == "sigmoid":
            probs = self.sigmoid(np.ascontiguousarray(logits, np.float32))
        else:                                  # softmax_weight: the logits themselves
            probs = np.asarray(logits, np.float32)
        sel_p = probs if bias is None else probs + bias
        n, X = sel_p.shape
        if spec.n_group > 1 and spec.n_group_used < spec.n_group:
            # groups of X / G contiguous experts scored by the sum of their two best; the
            # experts of all but the best n_group_used groups are out of the choice
            G = spec.n_group
            g = sel_p.reshape(n, G, X // G)
            top2 = -np.sort(-g, axis=2)[:, :, :2].sum(axis=2)                   # [n, G]
            keep = np.argsort(-top2, axis=1, kind="stable")[:, :spec.n_group_used]
            mask = np.full((n, G), -np.inf, np.float32)
            np.put_along_axis(mask, keep, 0.0, axis=1)
            sel_p = (g + mask[:, :, None]).reshape(n, X)
        sel = np.argsort(-sel_p, axis=1, kind="stable")[:, :spec.k]
        w = np.take_along_axis(probs, sel, axis=1)
        if spec.gating == "softmax_weight":
            w = self.softmax(np.ascontiguousarray(w, np.float32))
        if spec.norm:
            # llama.cpp's sum: in double, in slot order (as csrc/decode.c's fused layer); it
            # clamps the sum at 2^-14 (sigmoid weights may all be ~0)
            s = w[:, 0].astype(np.float64)
            for j in range(1, w.shape[1]):
                s += w[:, j]
            w = w / np.maximum(s.astype(np.float32)[:, None], np.float32(6.103515625e-5))
        if spec.scale not in (0.0, 1.0):
            w = w * np.float32(spec.scale)
        return sel, w.astype(np.float32, copy=False)

    def sigmoid(self, x: np.ndarray) -> np.ndarray:
        """1 / (1 + exp(-x)) float32: the module's (native: one scalar expf per value, what
        the fused MoE layer computes), else numpy's."""
        f = getattr(self.module, "sigmoid", None)
        if f is not None:
            return f(x)
        with np.errstate(over="ignore"):   # exp overflow -> inf -> 0
            return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)

    @staticmethod
    def group_rows(sel: np.ndarray, wts: np.ndarray):
        """(token, slot) picks grouped by expert: (experts sorted [m], starts [m + 1], rows,
        weights) with rows[starts[i]:starts[i+1]] the tokens of experts[i] in token order."""
        k = sel.shape[1]
        flat = sel.reshape(-1)
        order = np.argsort(flat, kind="stable")
        experts = np.unique(flat)
        starts = np.concatenate([[0], np.cumsum(np.bincount(flat)[experts])])
        return experts, starts, order // k, np.ascontiguousarray(wts.reshape(-1)[order])


class NumpyBackend(Backend):
    name = "numpy"
    caps = frozenset()


class NativeBackend(Backend):
    name = "native"
    caps = frozenset(CAPS)


_CACHE: dict[int, Backend] = {}


def as_backend(obj) -> Backend:
    """A Backend for a backend object, the reference or native module, or a stand-in
    namespace of op functions (tests): the one place where capabilities are read off
    attributes rather than declared."""
    if isinstance(obj, Backend):
        return obj
    if isinstance(obj, ModuleType):
        b = _CACHE.get(id(obj))
        if b is None:
            cls = NativeBackend if obj.__name__.endswith(".native") else \
                NumpyBackend if obj.__name__.endswith(".reference") else None
            b = cls(obj) if cls is not None else Backend(obj, _caps_of(obj), obj.__name__)
            _CACHE[id(obj)] = b
        return b
    return Backend(obj, _caps_of(obj))


def _caps_of(obj) -> frozenset:
    has = {"matmul_multi": "matmul_multi", "moe_ffn": "moe_ffn",
           "dense_decode": "decode_layer_new", "moe_decode": "moe_layer_new",
           "moe_stream_decode": "decode_batch_experts",
           "moe_stream_table": "decode_batch_moe",
           "paged_attention": "attention_paged",
           "threads": "set_threads"}
    caps = {c for c, attr in has.items() if hasattr(obj, attr)}
    if getattr(obj, "BATCH_INVARIANT", False):
        caps.add("batch_invariant")
    return frozenset(caps)
