"""Shared blocks of decoder-only transformers and the Model base class.

An architecture file declares its ArchSpec (spec.py: block flags, tensor table, hyperparameter
rules) and composes one block (``block``) from the functions here; loading, checks, the cache
and the forward loop live in Model. Tensor names are GGUF's; activations are float32
[n_tokens, ...]. Layers with experts run ``moe_ffn`` where dense ones run ``ffn``.
"""

from __future__ import annotations

import time

import numpy as np

from ..errors import RequestError
from ..kv.seq import SeqKV as KVCache
from ..ops.backend import RouteSpec
from ..ops import QTensor
from ..ops.fused import DenseLayerParams, MoeLayerParams
from ..ops.rope import yarn_corr_dims
from ..quant.reference import dequantize
from ..memory.planner import expert_switch
from ..quant.types import BY_NAME
from .batch import Batch
from .config import ModelConfig
from .lookahead import RouterLookahead
from .spec import SKIP, ArchSpec, check_tensors


def _uniq(a: np.ndarray) -> list[int]:
    """The distinct values of a small int array, ascending (np.unique's order and values) as
    Python ints: 1-1.7 us for a decode step's 8-32 expert ids where np.unique(...).tolist()
    took 4.4-5.3 us (Zen 3), 2-3 times a streamed MoE layer."""
    return sorted(set(a.ravel().tolist()))


class StreamedMoeLayer:
    """A MoE layer of the fused decode whose experts the store streams (Model._streamed_moe):
    the native layer, the matrices of decode_batch_route (attention, router), the dense ones
    of decode_batch_experts (router, shared expert) and of decode_batch_moe (both)."""
    __slots__ = ("layer", "route", "experts", "both")

    def __init__(self, layer, route: list[str], experts: list[str]):
        self.layer, self.route, self.experts = layer, route, experts
        self.both = route + experts[1:]


class Model:
    spec = ArchSpec("")       # each architecture file sets its own

    # block flags, from the spec
    arch = property(lambda self: self.spec.name)
    act = property(lambda self: self.spec.act)                        # silu | gelu
    qk_norm = property(lambda self: self.spec.qk_norm == "head")      # per-head Q/K norm
    post_norms = property(lambda self: self.spec.post_norms)          # gemma3

    # KV values rounded to f16 as llama.cpp's default cache (and its f16 flash attention reads
    # Q as f16); tests of exact float math switch it off.
    kv_f16 = True
    # KV cache types (kv/quant.py ids; llama.cpp's -ctk / -ctv), set by memfit.load
    cache_type_k: int | str = "f16"
    cache_type_v: int | str = "f16"

    def __init__(self, config: ModelConfig, weights, ops=None):
        from ..ops import get_ops
        self.config = config
        self.weights = weights
        self.ops = ops if ops is not None else get_ops()   # a Backend (ops/backend.py)
        self.specs = self.tensor_specs()
        self._check_tensors()
        # small 1-D tensors (norms, biases, rope factors) are kept as float32 for the whole run
        # (not those of layers the forward never runs: role skip, NextN)
        skip = {t.name for t in self.spec.tensors(config) if t.role == SKIP}
        self.vec: dict[str, np.ndarray] = {}
        for name, (shape, _) in self.specs.items():
            if len(shape) == 1 and weights.has(name) and name not in skip:
                q = weights.get(name)
                self.vec[name] = dequantize(q.type.id, q.data.reshape(-1), shape[0]).copy()
        self.output = "output.weight" if weights.has("output.weight") else "token_embd.weight"
        self._fused: list | None = None  # prepared native decode layers, built on first use
        # the streamed MoE layers' expert table and overlap (MEMFIT_EXPERT_TABLE=0 /
        # MEMFIT_EXPERT_OVERLAP=0 turn them off, for ablations; a bad value fails the load)
        self._x_table = self.ops.has("moe_stream_table") and expert_switch("MEMFIT_EXPERT_TABLE")
        self._x_overlap = expert_switch("MEMFIT_EXPERT_OVERLAP")
        self._ahead_done = -1   # the streamed layer whose look-ahead ran in its route call
        self._bufs: dict[str, np.ndarray] = {}  # prefill scratch reused across layers (_scratch)
        self._route_bufs: tuple | None = None   # decode_batch_route's outputs (_route_out)
        self._gate_rows: dict[str, QTensor] = {}  # shared-expert gates as 1-row matrices
        self._yarn_corr: dict[float, tuple[float, float]] = {}  # YaRN's ramp dims per rope base
        # expert prefetch hints (budgeted MoE)
        self._lookahead = RouterLookahead(config.n_layer, config.n_expert or 0)
        # streamed MoE layers of decode forwards: run fused (_streamed_moe), or op by op
        # because the batch's experts outnumbered expert_batch_limit; one_call: the fused ones
        # whose every expert was at hand in the store's table (one native call, no store call);
        # overlapped: the fused ones that ran the experts at hand while the misses loaded
        self.moe_stream_stats = {"fused": 0, "op_by_op": 0, "one_call": 0, "overlapped": 0}
        self._rows_seq = self._rows_pos = np.zeros(0, np.int32)
        # the kernel family of the forward in flight: decode rows (Batch.decode) take the decode
        # kernels, prompt rows the prefill ones, whatever the row count (ops/native.py), so a
        # row's logits depend only on its own sequence (batch invariance)
        self._decode = False

    @property
    def ops(self):
        return self._ops

    @ops.setter
    def ops(self, backend) -> None:
        from ..ops.backend import as_backend
        self._ops = as_backend(backend)

    # --- tensors -------------------------------------------------------------------------
    def layer_tensors(self, il: int) -> dict[str, tuple[tuple[int, ...], bool]]:
        """name -> (numpy shape, required) for layer il, from the spec."""
        return {t.name: (t.shape, t.required) for t in self.spec.layer_tensors(self.config, il)}

    def tensor_specs(self) -> dict[str, tuple[tuple[int, ...], bool]]:
        return {t.name: (t.shape, t.required) for t in self.spec.tensors(self.config)}

    def _check_tensors(self) -> None:
        w = self.weights
        check_tensors(self.spec, self.config, lambda n: w.info(n) if w.has(n) else None)

    # --- compute -------------------------------------------------------------------------
    def new_cache(self, n_ctx: int) -> KVCache:
        """One sequence of up to n_ctx tokens on a KV pool of its own (kv/seq.py); the API runs
        it on the engine's pool instead (SeqKV(engine.pool))."""
        from ..kv.quant import NAMES, cache_type
        from ..kv.storage import kv_layout
        L = kv_layout(self.config)
        tk, tv = NAMES[cache_type(self.cache_type_k)], NAMES[cache_type(self.cache_type_v)]
        if L.v_in_k:
            tv = tk  # V is read from K (MLA): K's type
        if (tk, tv) == ("f16", "f16") and not self.kv_f16:
            tk = tv = "f32"  # tests of exact float math
        return KVCache.new(L.n_layer, n_ctx, L.n_head_kv, L.head_dim_k, L.head_dim_v, tk, tv,
                           v_in_k=L.v_in_k, aux_dim=L.aux_dim, aux_layers=L.aux_layers)

    def forward(self, batch, cache: KVCache | None = None, all_logits: bool = False,
                hidden_from: int | None = None) -> np.ndarray:
        """``forward(batch)``: logits f32 [len(batch.out_rows), n_vocab] of a Batch
        (models/batch.py: flat rows of any sequences, the engine's runner builds it).

        ``forward(ids, cache)``: one sequence in a KVCache (kv/seq.py), logits f32 [n_vocab] of
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
        # the fused layer reads K and V of one cache type (BatchKV.fusable)
        fused = self._decode_layers() if b.decode and b.kv.fusable else None
        self._decode = b.decode
        self._rows_seq, self._rows_pos = b.seq, b.pos
        t0 = time.perf_counter()
        try:
            if fused:
                # one native call per layer for all rows (csrc/decode.c): the same kernels in
                # the same order as block(); each weight matrix is read once for the batch
                # (a MoE layer: each chosen expert once for the rows that chose it)
                get, kv = self.weights.get, b.kv
                x = np.ascontiguousarray(x)
                for il, f in enumerate(fused):
                    if f is None:   # a MoE layer the fused kernels do not take here: op by op
                        x = np.ascontiguousarray(self.block(il, x, b.pos, kv, None))
                    elif type(f) is StreamedMoeLayer:
                        x = self._streamed_moe(il, f, x, kv)
                    else:
                        ops.decode_batch(f[0], x, *kv.fused(il), *[get(nm).data for nm in f[1]])
                if len(b.out_rows) < n:
                    x = x[b.out_rows]
            else:
                out = b.out_rows
                # after the last layer's attention only the out rows are needed (at least one
                # row goes through it so that every row's K/V is stored)
                last = None if len(out) == n else (out if len(out) else np.array([n - 1]))
                for il in range(c.n_layer - 1):
                    x = self.block(il, x, b.pos, b.kv, None)
                x = self.block(c.n_layer - 1, x, b.pos, b.kv, last)
                if len(out) == 0:
                    x = x[:0]
            x = ops.rmsnorm(np.ascontiguousarray(x), self.vec["output_norm.weight"], c.rms_eps)
            if b.hidden:
                return x
            if x.shape[0] == 0:
                return np.zeros((0, c.n_vocab), np.float32)
            out = self.logits(x)
            if b.decode:
                self.weights.decode_step(time.perf_counter() - t0, n)
            return out
        finally:
            self._decode = False

    def logits(self, h: np.ndarray) -> np.ndarray:
        """Final-normed hidden states [n, n_embd] -> logits [n, n_vocab]."""
        c = self.config
        logits = self._matmul(np.ascontiguousarray(h), self.weights.get(self.output))
        if c.final_softcap > 0.0:
            logits = np.float32(c.final_softcap) * np.tanh(logits / np.float32(c.final_softcap))
        return logits

    def rope_params(self, il: int) -> tuple[float, float, int]:
        """(rope base, rope frequency scale, attention window or 0) of layer il."""
        c = self.config
        return c.rope_base, c.rope_freq_scale, 0

    # the architecture's block is the dense pre-norm layer csrc/decode.c computes (declared by
    # llama, qwen2, qwen3, gemma3); used for decode when no layer has experts
    fused_decode = False
    # the block of a file with experts is csrc/decode.c's MoE layer (pre-norm attention, then
    # the routed experts and the shared expert of moe_ffn / routed_shared_ffn) and its dense
    # layer where a layer has none (declared by qwen3moe, qwen2moe, olmoe, llama/mixtral, glm4moe,
    # gpt-oss)
    fused_moe_decode = False
    # the shared expert is added ungated (routed_shared_ffn: glm4moe), not by spec.shared_expert
    shexp_ungated = False
    # the FFN's pre-norm (glm4moe: post_attention_norm)
    ffn_norm_name = "ffn_norm.weight"

    def dense_layer_params(self, il: int) -> DenseLayerParams:
        """Layer il as the fused decode layer's named parameters (ops/fused.py)."""
        c, p = self.config, f"blk.{il}."
        base, fs, window = self.rope_params(il)
        mats = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
        vecs = {"attn_norm": "attn_norm.weight", "ffn_norm": self.ffn_norm_name,
                "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias", "bo": "attn_output.bias"}
        if self.qk_norm:
            vecs.update(q_norm="attn_q_norm.weight", k_norm="attn_k_norm.weight")
        if self.post_norms:
            vecs.update(post_attention_norm="post_attention_norm.weight",
                        post_ffw_norm="post_ffw_norm.weight")
        v = {k: self.vec[p + nm] for k, nm in vecs.items() if p + nm in self.vec}
        if "rope_freqs.weight" in self.vec:
            v["freq_factors"] = self.vec["rope_freqs.weight"]
        return DenseLayerParams(
            n_embd=c.n_embd, n_head=c.n_head, n_head_kv=c.n_head_kv, head_dim_k=c.head_dim_k,
            head_dim_v=c.head_dim_v, n_ff=c.n_ff, n_rot=c.n_rot, window=window,
            rope_neox=c.rope_neox, gelu=self.act == "gelu", rope_base=base, rope_freq_scale=fs,
            rms_eps=c.rms_eps, attn_scale=c.attn_scale, attn_softcap=c.attn_softcap,
            weights={m: p + m + ".weight" for m in mats},
            types={m: self.weights.info(p + m + ".weight")[1].id for m in mats}, vecs=v)

    def moe_layer_params(self, il: int) -> MoeLayerParams:
        """Layer il (with experts) as the fused MoE decode layer's named parameters
        (ops/fused.py); the expert slots name the stacked ffn_*_exps tensors, read in place
        or, where the store streams them, only their types and shapes (_decode_layers).
        ValueError for a block the fused layer does not compute (then every layer runs op by
        op)."""
        c, w, p = self.config, self.weights, f"blk.{il}."
        rs = self.route_spec
        for bad, why in ((self.act not in ("silu", "gelu", "swiglu_oai"), self.act),
                         (rs.gating not in ("softmax", "sigmoid", "softmax_weight"), rs.gating),
                         (rs.n_group > 1 and rs.n_group_used < rs.n_group, "group-limited routing"),
                         (self.post_norms, "post norms")):
            if bad:
                raise ValueError(f"the fused MoE layer does not compute {why}")
        base, fs, window = self.rope_params(il)
        y, yarn = self._yarn(base), {}
        if y:   # the arguments rope() passes
            yarn = dict(yarn_ext_factor=y["ext_factor"], yarn_attn_factor=y["attn_factor"],
                        yarn_corr_lo=y["corr_dims"][0], yarn_corr_hi=y["corr_dims"][1])
        mats = {m: p + m + ".weight" for m in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp")}
        mats.update({f"ffn_{m}_exps": f"{p}ffn_{m}_exps.weight" for m in ("gate", "up", "down")})
        gated = self.spec.shared_expert
        n_ff_sh = 0
        if gated or (self.shexp_ungated and c.n_ff_shexp):
            mats.update({f"ffn_{m}_shexp": f"{p}ffn_{m}_shexp.weight" for m in ("gate", "up", "down")})
            n_ff_sh = w.info(p + "ffn_gate_shexp.weight")[0][0]
            if any(f"{p}ffn_{m}_shexp.bias" in self.vec for m in ("gate", "up", "down")):
                raise ValueError("the fused MoE layer has no shared-expert biases")
        vecs = {"attn_norm": "attn_norm.weight", "ffn_norm": self.ffn_norm_name,
                "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias", "bo": "attn_output.bias",
                "router_bias": "ffn_gate_inp.bias", "exp_probs_b": "exp_probs_b.bias"}
        if self.qk_norm or self.spec.qk_norm == "full":
            vecs.update(q_norm="attn_q_norm.weight", k_norm="attn_k_norm.weight")
        if gated:
            vecs["shexp_gate"] = "ffn_gate_inp_shexp.weight"
        vecs["sinks"] = "attn_sinks.weight"
        v = {k: self.vec[p + nm] for k, nm in vecs.items() if p + nm in self.vec}
        if "rope_freqs.weight" in self.vec:
            v["freq_factors"] = self.vec["rope_freqs.weight"]
        eb = self._expert_biases(il)
        if eb is not None:   # [n_expert, rows] each, flat (views of F32 weights)
            v.update({k: np.ascontiguousarray(b, np.float32).reshape(-1)
                      for k, b in zip(("gate_exps_b", "up_exps_b", "down_exps_b"), eb)})
        g = w.info(mats["ffn_gate_exps"])[0]     # [n_expert, n_ff_exp, n_embd]
        return MoeLayerParams(
            n_embd=c.n_embd, n_head=c.n_head, n_head_kv=c.n_head_kv, head_dim_k=c.head_dim_k,
            head_dim_v=c.head_dim_v, n_rot=c.n_rot, window=window, rope_neox=c.rope_neox,
            gelu=self.act == "gelu", qk_norm_full=self.spec.qk_norm == "full",
            n_expert=g[0], n_expert_used=rs.k, n_ff_exp=g[1], n_ff_shexp=n_ff_sh,
            sigmoid=rs.gating == "sigmoid", expert_weights_norm=rs.norm, shexp_gated=gated,
            rope_base=base, rope_freq_scale=fs, rms_eps=c.rms_eps, attn_scale=c.attn_scale,
            attn_softcap=c.attn_softcap, expert_weights_scale=rs.scale,
            swiglu_oai=self.act == "swiglu_oai", softmax_weight=rs.gating == "softmax_weight",
            **yarn, weights=mats, types={k: w.info(nm)[1].id for k, nm in mats.items()}, vecs=v)

    def _decode_layers(self) -> list | None:
        """Per layer (native layer, its matrix names) for decode rows when the backend has the
        fused layers (caps dense_decode, moe_decode) and the architecture declares its block
        to be them (fused_decode without experts, fused_moe_decode with; MEMFIT_FUSED_MOE=0
        turns the latter off, for comparisons). A MoE layer whose experts are not in place
        (experts_in_place None: the store streams them) is a StreamedMoeLayer (cap
        moe_stream_decode), else None there and runs op by op. None: block() runs every
        layer op by op."""
        if self._fused is None:
            self._fused = []
            c, ops = self.config, self.ops
            try:
                if not c.n_expert and ops.has("dense_decode") and self.fused_decode:
                    for il in range(c.n_layer):
                        self._fused.append(ops.dense_layer(self.dense_layer_params(il)))
                elif c.n_expert and ops.has("moe_decode") and ops.has("dense_decode") \
                        and self.fused_moe_decode and expert_switch("MEMFIT_FUSED_MOE"):
                    in_place = getattr(self.weights, "experts_in_place", None)
                    for il in range(c.n_layer):
                        if c.is_moe(il):
                            mp = self.moe_layer_params(il)
                            if in_place is not None and in_place(il) is not None:
                                self._fused.append(ops.moe_layer(mp))
                            elif ops.has("moe_stream_decode"):
                                layer, names = ops.moe_layer(mp)
                                # names: attention 4, router, 3 stacked experts[, 3 shared]
                                self._fused.append(StreamedMoeLayer(layer, names[:5],
                                                                    names[4:5] + names[8:]))
                            else:
                                self._fused.append(None)
                        else:
                            self._fused.append(ops.dense_layer(self.dense_layer_params(il)))
                    if all(f is None for f in self._fused):
                        self._fused = []
            except ValueError:  # a shape or block the fused kernels do not take: op by op
                self._fused = []
        return self._fused or None

    def _yarn(self, base: float) -> dict:
        """The rope op's YaRN arguments for a rope base ({} without YaRN), the ramp's dims
        computed once per base; rope() and the fused MoE layer's parameters take them."""
        c = self.config
        if not c.yarn:
            return {}
        corr = self._yarn_corr.get(base)
        if corr is None:
            corr = self._yarn_corr[base] = yarn_corr_dims(
                c.n_rot, c.n_ctx_orig, base, c.yarn_beta_fast, c.yarn_beta_slow)
        return dict(ext_factor=1.0, attn_factor=c.yarn_attn_factor, corr_dims=corr)

    def rope(self, x: np.ndarray, pos: np.ndarray, il: int, neox: bool | None = None) -> np.ndarray:
        """RoPE of x [n, heads, head_dim] on its first n_rot dims at layer il (rope_params),
        with the file's frequency factors (rope_freqs) and YaRN as llama.cpp applies them."""
        c = self.config
        base, fs, _ = self.rope_params(il)
        kw = {}
        ff = self.vec.get("rope_freqs.weight")  # llama3-style per-dim frequency factors
        if ff is not None:
            kw["freq_factors"] = ff
        kw.update(self._yarn(base))
        return self.ops.rope(np.ascontiguousarray(x), pos, c.n_rot, base, fs,
                             c.rope_neox if neox is None else neox, **kw)

    # --- shared pieces -------------------------------------------------------------------
    def _rows_kw(self, x: np.ndarray) -> dict:
        # the forward's kernel family (see __init__): never chosen by the row count
        return {"rowwise": self._decode}

    def _matmul(self, x: np.ndarray, w) -> np.ndarray:
        return self.ops.matmul(x, w, **self._rows_kw(x))

    def norm(self, x: np.ndarray, name: str) -> np.ndarray:
        return self.ops.rmsnorm(x, self.vec[name], self.config.rms_eps)

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        # y = x @ W^T (+ bias when the file has one)
        y = self._matmul(x, self.weights.get(name + ".weight"))
        b = self.vec.get(name + ".bias")
        return y if b is None else y + b

    def linears(self, x: np.ndarray, names: tuple[str, ...], outs=None) -> list[np.ndarray]:
        """[linear(x, name) for name in names], as one backend call when it has matmul_multi
        (weights sharing x: Q/K/V, gate/up), into ``outs`` when given (native backend)."""
        ys = self.ops.matmul_multi(x, [self.weights.get(nm + ".weight") for nm in names], outs,
                                   **self._rows_kw(x))
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
        if self.spec.qk_norm == "full":   # olmoe: over the whole projection, before the heads
            q = self.norm(q, p + "attn_q_norm.weight")
            k = self.norm(k, p + "attn_k_norm.weight")
        q = q.reshape(n, c.n_head, c.head_dim_k)
        k = k.reshape(n, c.n_head_kv, c.head_dim_k)
        v = v.reshape(n, c.n_head_kv, c.head_dim_v)
        if self.qk_norm and p + "attn_q_norm.weight" in self.vec:   # (optional in glm4moe)
            q = self.norm(q, p + "attn_q_norm.weight")
            k = self.norm(k, p + "attn_k_norm.weight")
        q, k = self.rope(q, pos, il), self.rope(k, pos, il)
        # the cache stores k/v and attends (q rows ``last`` only): its layout and type stay there
        o = cache.attend(il, ops, q, k, v, last, c.attn_scale, window, c.attn_softcap,
                         sinks=self.vec.get(p + "attn_sinks.weight"))   # (gpt-oss)
        return self.linear(o.reshape(o.shape[0], c.n_head * c.head_dim_v), p + "attn_output")

    def ffn(self, il: int, x: np.ndarray, suffix: str = "") -> np.ndarray:
        # gated FFN: down(act(gate x) * up x) of ffn_{gate,up,down}{suffix} ("_shexp": the
        # shared expert)
        p = f"blk.{il}."
        n, F = x.shape[0], self.weights.info(f"{p}ffn_gate{suffix}.weight")[0][0]
        if n > 1 and self.ops.has("matmul_multi"):
            # prefill on the native backend: gate, up and the activation (in place in gate) go
            # to buffers reused by every layer. Fresh [n, n_ff] arrays are new pages each
            # time: ~7-25 ms of page faults per 40 MB array here, ~3% of a 7B prefill.
            g, u = self.linears(x, (p + "ffn_gate" + suffix, p + "ffn_up" + suffix),
                                [self._scratch(k, n * F).reshape(n, F) for k in ("gate", "up")])
            h = self._act_mul(g, u, out=g)
        else:
            g, u = self.linears(x, (p + "ffn_gate" + suffix, p + "ffn_up" + suffix))
            h = self._act_mul(g, u)
        return self.linear(h, p + "ffn_down" + suffix)

    def _act_mul(self, g: np.ndarray, u: np.ndarray, out=None) -> np.ndarray:
        """The gated activation of the architecture (spec act): silu(g) * u, gelu(g) * u or
        gpt-oss's clamped SwiGLU."""
        f = {"silu": self.ops.silu_mul, "gelu": self.ops.gelu_mul,
             "swiglu_oai": self.ops.swiglu_oai}[self.act]
        return f(g, u) if out is None else f(g, u, out=out)

    def _glu(self, x: np.ndarray, gate, up, down, bias=None) -> np.ndarray:
        # down(act(gate x + bg, up x + bu)) + bd for QTensors (one expert, or the shared
        # expert); bias: None or the (gate, up, down) bias rows of an expert (gpt-oss)
        kw = self._rows_kw(x)
        g, u = self.ops.matmul_multi(x, [gate, up], **kw)
        if bias is not None:
            g, u = g + bias[0], u + bias[1]
        y = self.ops.matmul(self._act_mul(g, u), down, **kw)
        return y if bias is None else y + bias[2]

    def _expert_biases(self, il: int):
        """(gate [X, F], up [X, F], down [X, E]) bias rows of layer il's experts as float32
        views of the weights (gpt-oss), or None."""
        p = f"blk.{il}.ffn_"
        if not self.weights.has(p + "gate_exps.bias"):
            return None
        out = []
        for m in ("gate", "up", "down"):
            q = self.weights.get(f"{p}{m}_exps.bias")
            if q.type.name == "F32":
                out.append(q.data.view(np.float32).reshape(q.shape))
            else:
                out.append(dequantize(q.type.id, q.data.reshape(-1), q.shape[0] * q.shape[1])
                           .reshape(q.shape))
        return tuple(out)

    def router_logits(self, il: int, x: np.ndarray) -> np.ndarray:
        """Layer il's router logits [n, n_expert] of x [n, n_embd]."""
        return self.linear(x, f"blk.{il}.ffn_gate_inp")

    @property
    def route_spec(self) -> RouteSpec:
        """How this model's routers choose and weigh experts (the backend's route)."""
        rs = self.__dict__.get("_route_spec")
        if rs is None:
            c = self.config
            rs = self.__dict__["_route_spec"] = RouteSpec(
                k=c.n_expert_used, gating=c.expert_gating_func, norm=c.expert_weights_norm,
                scale=c.expert_weights_scale, n_group=c.expert_group_count,
                n_group_used=c.expert_group_used_count)
        return rs

    def route(self, il: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Router of layer il on x [n, n_embd] -> (experts int64 [n, k], weights f32 [n, k]) as
        llama.cpp's build_moe_ffn (ops/backend.py route): logits (+ the router's bias), gating,
        the selection bias exp_probs_b where the file has one, group-limited top-k (ties: the
        lower expert index), renormalization and scale as the architecture says."""
        logits = self.router_logits(il, x)
        return self.ops.route(logits, self.route_spec, self.vec.get(f"blk.{il}.exp_probs_b.bias"))

    def routed_shared_ffn(self, il: int, x: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """The routed experts plus the ungated shared expert ffn_*_shexp where the model has one
        (expert_shared_count x expert_feed_forward_length rows; deepseek2, glm4moe, glm-dsa)."""
        f = self.moe_ffn(il, x, rows)
        return f + self.ffn(il, x, "_shexp") if self.config.n_ff_shexp else f

    def moe_ffn(self, il: int, x: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """Routed experts (+ the shared expert) of x [n, n_embd] -> [n, n_embd] (x holds the
        batch's rows, or those at ``rows`` of it in the last layer). All tokens are
        routed first; the union of their experts is asked of the weights once
        (get_experts); each expert's gate/up/down then runs once on its group of tokens."""
        w, p = self.weights, f"blk.{il}."
        x = np.ascontiguousarray(x, dtype=np.float32)
        sel, wts = self.route(il, x)
        # sorted by expert: each row's sum runs in expert order
        experts, starts, rows_all, wts_all = self.ops.group_rows(sel, wts)
        if w.wants_expert_prediction and self._ahead_done != il:
            # layer il+1's reads start now (the router's logits again: n_embd x n_expert per
            # row, against the experts' 3 n_embd x n_ff_exp x k)
            self._predict_experts(il, x, self.router_logits(il, x), rows)
        # a budgeted store holds at most expert_batch_limit experts at once: ask in groups
        limit = int(w.expert_batch_limit or len(experts))
        out = np.zeros_like(x)
        fused = self.ops.has("moe_ffn")
        eb = self._expert_biases(il)
        for i in range(0, len(experts), limit):
            group = experts[i:i + limit].tolist()
            mats = w.get_experts(il, group)
            biases = None if eb is None else [tuple(b[e] for b in eb) for e in group]
            if fused:
                a, b = starts[i], starts[i + len(group)]
                self.ops.moe_ffn(x, mats, starts[i:i + len(group) + 1] - a, rows_all[a:b],
                                 wts_all[a:b], self.act, out, **self._rows_kw(x),
                                 biases=biases)
                continue
            for j, (gate, up, down) in enumerate(mats):
                a, b = starts[i + j], starts[i + j + 1]
                rows = rows_all[a:b]            # a token picks an expert at most once
                y = self._glu(np.ascontiguousarray(x[rows]), gate, up, down,
                              None if biases is None else biases[j])
                out[rows] += y * wts_all[a:b][:, None]
        if self.spec.shared_expert:
            # [n]: one logit per token, x . ffn_gate_inp_shexp as an F32 matvec of one row (the
            # kernels' per-row order, as csrc/decode.c's MoE layer)
            gate = self._matmul(x, self._shexp_gate(il))[:, 0]
            s = self._glu(x, *(w.get(p + f"ffn_{m}_shexp.weight") for m in ("gate", "up", "down")))
            out += s * self.ops.sigmoid(np.ascontiguousarray(gate))[:, None]
        return out

    def _predict_experts(self, il: int, x: np.ndarray, logits: np.ndarray, rows) -> None:
        """Layer il+1's experts predicted from layer il's FFN input x [n, n_embd] and its real
        router logits [n, n_expert] (models/lookahead.py): their reads start now."""
        c = self.config
        seq, pos = self._rows_seq, self._rows_pos
        if rows is not None:
            seq, pos = seq[rows], pos[rows]
        self._lookahead.observe(il, logits, seq, pos)
        if il + 1 < c.n_layer and c.is_moe(il + 1):
            score = self._lookahead.predict(il + 1, self.router_logits(il + 1, x), seq, pos)
            nxt = np.argsort(-score, axis=1, kind="stable")[:, :c.n_expert_used]
            self.weights.prefetch_experts(il + 1, _uniq(nxt))

    def _streamed_moe(self, il: int, f: StreamedMoeLayer, x: np.ndarray, kv) -> np.ndarray:
        """Decode rows x [n, n_embd] through MoE layer il whose experts the store streams
        (csrc/decode.c). With the store's expert table (expert_table: every expert at hand,
        where) and no look-ahead, one call: attention, routing and, when every chosen expert is
        at hand, the experts (the store is told which were used: note_experts); else it stops
        routed. With look-ahead, attention and routing first, then the prediction's reads
        start. Then the union of the rows' experts is asked of the store at once (as moe_ffn
        asks it) and the experts run on their bytes. A union above expert_batch_limit runs the
        MoE half op by op (moe_ffn asks in groups). Returns x (updated in place when fused)."""
        w, get, ops = self.weights, self.weights.get, self.ops
        sel, h, lg = self._route_out(x.shape[0])
        table = getattr(w, "expert_table", None) if self._x_table else None
        if table is not None and il not in table[1]:   # this layer's experts are pinned
            table = None
        predict = w.wants_expert_prediction
        ahead = None
        if table is not None and not predict:
            xo = table[1][il]
            if ops.decode_batch_moe(f.layer, x, *kv.fused(il), sel, h, lg, table[0], xo,
                                    *[get(nm).data for nm in f.both]):
                w.note_experts(il, _uniq(sel))
                self.moe_stream_stats["fused"] += 1
                self.moe_stream_stats["one_call"] += 1
                return x
        elif table is not None:
            # the look-ahead's observe and predict in the same call (RouterLookahead's state)
            ahead = self._ahead_args(il, x.shape[0])
            ops.decode_batch_route_ahead(f.layer, x, *kv.fused(il), sel, h, lg, *ahead,
                                         *[get(nm).data for nm in f.route])
        else:
            ops.decode_batch_route(f.layer, x, *kv.fused(il), sel, h, lg,
                                   *[get(nm).data for nm in f.route])
        if ahead is not None and ahead[6] is not None:
            w.prefetch_experts(il + 1, _uniq(ahead[-1]))
        experts = _uniq(sel)                     # group_rows' order: expert index
        if len(experts) > int(w.expert_batch_limit or len(experts)):
            self.moe_stream_stats["op_by_op"] += 1
            self._ahead_done = il if ahead is not None else -1   # moe_ffn: not again
            try:
                return np.ascontiguousarray(self._moe_half(il, x))
            finally:
                self._ahead_done = -1
        if predict and ahead is None:
            self._predict_experts(il, h, lg, None)
        if table is not None:
            xbuf, xo = table[0], table[1][il]
            # the route call's h and logits ride along: the experts calls do not route again
            dense = [get(nm).data for nm in f.experts] + [h, lg]
            if (xo[experts, 0] >= 0).all():
                w.note_experts(il, experts)
                ops.decode_batch_experts_at(f.layer, x, xbuf, xo, *dense)
            else:
                # the misses' reads start; the experts at hand run while they load
                token = w.begin_experts(il, experts)
                if self._x_overlap and w.experts_pending(token):
                    yk, done = self._part_bufs(x.shape[0])
                    done[:] = 0
                    ops.decode_batch_experts_part(f.layer, x, xbuf, xo, yk, done, False, *dense)
                    w.end_experts(token)
                    ops.decode_batch_experts_part(f.layer, x, xbuf, xo, yk, done, True, *dense)
                    self.moe_stream_stats["overlapped"] += 1
                else:
                    w.end_experts(token)
                    ops.decode_batch_experts_at(f.layer, x, xbuf, xo, *dense)
        else:
            mats = w.get_experts(il, experts)
            ops.decode_batch_experts(f.layer, x, np.array(experts, np.int64), [q.data for m in mats for q in m],
                                     *[get(nm).data for nm in f.experts])
        self.moe_stream_stats["fused"] += 1
        return x

    def _moe_half(self, il: int, x: np.ndarray) -> np.ndarray:
        """x + the MoE FFN of the residual x [n, n_embd] op by op: the second half of the
        blocks the fused MoE layer computes (fused_moe_decode)."""
        h = self.norm(x, f"blk.{il}.{self.ffn_norm_name}")
        return x + (self.routed_shared_ffn(il, h) if self.shexp_ungated else self.moe_ffn(il, h))

    def _route_out(self, n: int):
        """(sel int64 [n, k], h [n, n_embd], logits [n, n_expert]) for decode_batch_route,
        kept across layers and forwards (grown when a larger batch comes)."""
        c, b = self.config, self._route_bufs
        if b is None or b[0].shape[0] < n:
            m = max(n, 8)
            b = self._route_bufs = (np.empty((m, c.n_expert_used), np.int64),
                                    np.empty((m, c.n_embd), np.float32),
                                    np.empty((m, c.n_expert), np.float32))
        return tuple(a[:n] for a in b)

    def _ahead_args(self, il: int, n: int) -> tuple:
        """decode_batch_route_ahead's look-ahead arguments for n decode rows at layer il (the
        rows' seq; RouterLookahead's four arrays; il; layer il + 1's router, its type and bias,
        or None, 0, None where no MoE layer follows; pred [n, k] int64, the last)."""
        c, la = self.config, self._lookahead
        seq = self._rows_seq
        la.ensure(seq)
        nr, nt, nb = None, 0, None
        if il + 1 < c.n_layer and c.is_moe(il + 1):
            q = self.weights.get(f"blk.{il + 1}.ffn_gate_inp.weight")
            nr, nt = q.data, q.type.id
            nb = self.vec.get(f"blk.{il + 1}.ffn_gate_inp.bias")
        pred = self._bufs.get("ahead_pred")
        if pred is None or pred.shape[0] < n:
            pred = self._bufs["ahead_pred"] = np.empty((max(n, 8), c.n_expert_used), np.int64)
        return (seq, la.real, la.real_pos, la.look, la.look_pos, il, nr, nt, nb, pred[:n])

    def _part_bufs(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(yk [n, k, n_embd] float32, done [n_expert] uint8) for decode_batch_experts_part,
        kept across layers and forwards."""
        c = self.config
        yk = self._scratch("moe_part_yk", n * c.n_expert_used * c.n_embd)
        done = self._bufs.get("moe_part_done")
        if done is None:
            done = self._bufs["moe_part_done"] = np.zeros(c.n_expert, np.uint8)
        return yk.reshape(n, c.n_expert_used, c.n_embd), done

    def _shexp_gate(self, il: int) -> QTensor:
        # ffn_gate_inp_shexp [n_embd] as a one-row F32 matrix over the float32 values kept
        name = f"blk.{il}.ffn_gate_inp_shexp.weight"
        q = self._gate_rows.get(name)
        if q is None:
            v = self.vec[name]
            q = self._gate_rows[name] = QTensor(name, BY_NAME["F32"], (1, v.size), v.view(np.uint8))
        return q

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
        h = self.norm(x, p + "ffn_norm.weight")
        f = self.moe_ffn(il, h, last) if self.config.is_moe(il) else self.ffn(il, h)
        if self.post_norms:
            f = self.norm(f, p + "post_ffw_norm.weight")
        return x + f

    block = standard_block
