#!/usr/bin/env python3
"""A `llama-server` stand-in that starts `memfit serve`, for running llama.cpp's own server
test suite (tools/server/tests in the llama-cpp-python 0.3.36 sdist) against memfit.

The suite starts LLAMA_SERVER_BIN_PATH with llama-server's arguments; this maps the ones memfit
has (--port, --host, --ctx-size, --parallel, --alias, --api-key, --n-predict, --chat-template,
--chat-template-file, --reasoning-format, -ctk/-ctv, --threads, --embedding, --pooling) and
drops the rest (sampling defaults, GPU layers, slots, metrics switches, speculative settings).
The suite's models come from the Hugging Face hub, which is not reachable here: every model is
replaced by MEMFIT_SUITE_MODEL (default smollm2-135m). Not part of CI: see
benchmarks/llama_server_suite.sh.
"""

from __future__ import annotations

import os
import re
import sys

# llama-server flag -> (memfit flag or None to drop, takes a value)
MAP = {
    "--port": ("--port", True), "--host": ("--host", True),
    "--ctx-size": ("-c", True), "-c": ("-c", True),
    "--parallel": ("-np", True), "-np": ("-np", True),
    "--alias": ("--alias", True), "--api-key": ("--api-key", True),
    "--n-predict": ("-n", True), "-n": ("-n", True),
    "--chat-template": ("--chat-template", True),
    "--chat-template-file": ("--chat-template", True),
    "--reasoning-format": ("--reasoning-format", True),
    "-ctk": ("-ctk", True), "-ctv": ("-ctv", True),
    "--threads": ("-t", True), "-t": ("-t", True),
    "--embedding": ("--embedding", False), "--embeddings": ("--embedding", False),
    "--pooling": ("--pooling", True),
}
VALUED = {"--temp", "--seed", "--model", "-m", "--model-url", "--hf-repo", "-hfr", "--hf-file",
          "-hff", "--batch-size", "-b", "--ubatch-size", "-ub", "--n-gpu-layers", "-ngl",
          "--model-draft", "--models-dir", "--models-max", "--models-preset", "--cors-origins",
          "-fa", "--slot-save-path", "--grp-attn-n", "--grp-attn-w", "--lora", "--spec-type",
          "--spec-draft-n-max", "--spec-draft-n-min", "--spec-synth-len", "--spec-synth-rates",
          "--reasoning", "--mmproj-url", "--media-path", "--sleep-idle-seconds", "--cache-ram",
          "--tools", "--tools-runtime", "--mcp-servers-config", "--mcp-servers-json", "--tags"}


TEMPLATES = "../../../models/templates"    # from tools/server/tests, the suite's directory


def _family(name: str) -> str:
    """A model name without its size and quantisation: DeepSeek-R1-Distill-Qwen-7B-GGUF ->
    deepseek-r1-distill-qwen."""
    return re.sub(r"(-\d+(\.\d+)?[bm])?(-instruct)?(-gguf)?$", "", name.lower())


def _model_template(argv: list[str]) -> str | None:
    repo = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--hf-repo", "-hfr")),
                None)
    if repo is None or not os.path.isdir(TEMPLATES):
        return None
    fam = _family(repo.split("/")[-1])
    for f in sorted(os.listdir(TEMPLATES)):
        stem = f[:-len(".jinja")] if f.endswith(".jinja") else None
        if stem and _family(stem).endswith(fam):
            return os.path.join(TEMPLATES, f)
    return None


def main(argv: list[str]) -> int:
    model = os.environ.get("MEMFIT_SUITE_MODEL", "smollm2-135m")
    import subprocess
    # flags this memfit build has (so the shim works before and after a flag is added)
    known = subprocess.run([sys.executable, "-m", "memfit", "serve", "--help"],
                           capture_output=True, text=True).stdout
    out, dropped, i = [], [], 0
    while i < len(argv):
        a = argv[i]
        if a in MAP:
            flag, valued = MAP[a]
            if flag not in known:
                dropped.append(a)
                i += 2 if valued else 1
                continue
            out.append(flag)
            if valued:
                out.append(argv[i + 1])
                i += 1
        elif a in VALUED:
            dropped.append(f"{a} {argv[i + 1]}")
            i += 1
        else:
            dropped.append(a)
        i += 1
    # a GGUF carries its model's chat template: where a test names a Hugging Face model but no
    # template, the stand-in gets that model's template from the suite's models/templates
    # (matched by the repo's model name without its size), so a test of a reasoning model's
    # format runs on that format
    tpl = _model_template(argv) if "--chat-template" not in out and "--jinja" in argv else None
    if tpl is not None:
        out += ["--chat-template", tpl]
    # the suite's models have longer training contexts than the stand-in; memfit refuses a
    # context past the file's (llama-server warns), so cap it at MEMFIT_SUITE_MAX_CTX
    cap = int(os.environ.get("MEMFIT_SUITE_MAX_CTX", "8192"))
    if "-c" in out and int(out[out.index("-c") + 1]) > cap:
        out[out.index("-c") + 1] = str(cap)
    if "--host" in out and out[out.index("--host") + 1] not in ("127.0.0.1", "localhost", "::1") \
            and "--api-key" not in out:
        out[out.index("--host") + 1] = "127.0.0.1"
    print(f"llama_server_shim: memfit serve {model} {' '.join(out)} (dropped: {' '.join(dropped)})",
          file=sys.stderr, flush=True)
    os.execvp(sys.executable, [sys.executable, "-m", "memfit", "serve", model, *out])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
