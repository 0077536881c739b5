"""What a new user trips over (issue 9), driven as a user drives it: real `memfit` processes,
real files, the two real models."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def memfit(*args, check=True, timeout=300, env=None, stdin=None, cwd=None):
    e = dict(os.environ)
    e.pop("MEMFIT_MEM_BUDGET", None)
    e.update(env or {})
    p = subprocess.run([sys.executable, "-m", "memfit", *map(str, args)], capture_output=True,
                       text=True, timeout=timeout, env=e, input=stdin, cwd=cwd)
    assert "Traceback" not in p.stderr, p.stderr
    if check:
        assert p.returncode == 0, p.stderr
    return p


# ------------------------------------------------------------------ 1. chat on every model

@pytest.mark.realmodel
@pytest.mark.parametrize("fixture, named", [
    ("smollm2_path", "chat template: the model's own"),
    ("gemma_path", "chat template: gemma (built-in for gemma3; the GGUF has no tokenizer.chat_template)"),
])
def test_chat_works_on_both_models_and_names_the_template(request, fixture, named):
    path = request.getfixturevalue(fixture)
    p = memfit("run", path, "--chat", "-p", "Why is the sky blue?", "-n", "8", "--temp", "0", "-t", "2")
    assert named in p.stderr
    assert p.stdout.strip()                      # an answer, no echo of the template
    assert "<start_of_turn>" not in p.stdout and "<|im_start|>" not in p.stdout


@pytest.mark.realmodel
def test_chat_system_and_template_choice(gemma_path, tmp_path):
    p = memfit("run", gemma_path, "--chat", "--system", "Answer in French.", "-p", "Hi",
               "-n", "1", "--temp", "0", "--json")
    d = json.loads(p.stdout)
    from memfit.tokenizer.templates import BUILTIN
    want = BUILTIN["gemma"]([{"role": "system", "content": "Answer in French."},
                             {"role": "user", "content": "Hi"}], True)
    assert want == "<start_of_turn>user\nAnswer in French.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert d["chat_template"].startswith("gemma")
    tmpl = tmp_path / "t.jinja"
    tmpl.write_text("{% for m in messages %}<<{{ m.role }}>>{{ m.content }}{% endfor %}>>")
    p = memfit("run", gemma_path, "--chat", "--chat-template", tmpl, "-p", "Hi", "-n", "1",
               "--temp", "0", "--json")
    d = json.loads(p.stdout)
    assert d["chat_template"] == f"{tmpl} (jinja file)"
    assert d["prompt_ids"][0] == 2            # BOS, then the file's text
    p = memfit("run", gemma_path, "--chat", "--chat-template", "nope", "-p", "Hi", check=False)
    assert p.returncode == 1 and "nope" in p.stderr and "chatml" in p.stderr


def test_builtin_templates_render_llamacpp_formats():
    from memfit.tokenizer.templates import BUILTIN
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
            {"role": "assistant", "content": "A"}, {"role": "user", "content": "V"}]
    assert BUILTIN["chatml"](msgs[1:2], True) == "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert BUILTIN["llama3"](msgs[:2], True) == (
        "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert BUILTIN["llama2-sys"](msgs, True) == "[INST] <<SYS>>\nS\n<</SYS>>\n\nU [/INST]A</s>[INST] V [/INST]"
    assert BUILTIN["gemma"](msgs, True) == ("<start_of_turn>user\nS\n\nU<end_of_turn>\n<start_of_turn>model\n"
                                            "A<end_of_turn>\n<start_of_turn>user\nV<end_of_turn>\n"
                                            "<start_of_turn>model\n")
    assert BUILTIN["phi3"](msgs[1:2], True) == "<|user|>\nU<|end|>\n<|assistant|>\n"


@pytest.mark.realmodel
def test_control_tokens_are_not_text_unless_special(gemma_path):
    """As llama.cpp's token_to_piece(special=false): CONTROL tokens (<start_of_turn>, <pad>,
    <unusedN>) render as nothing, USER_DEFINED ones stay text. In this GGUF <start_of_image>
    is USER_DEFINED, and llama.cpp (llama-cpp-python 0.3.36) prints it too."""
    from memfit.gguf import open_gguf
    from memfit.tokenizer import StreamDecoder, Tokenizer
    with open_gguf(gemma_path) as f:
        tok = Tokenizer.from_metadata(f.metadata)
    sot = tok.token_id("<start_of_turn>")
    assert tok.is_control(sot)
    tok.render_special = False
    assert StreamDecoder(tok).push(sot) == ""
    assert StreamDecoder(tok).push(tok.token_id("<start_of_image>")) == "<start_of_image>"
    tok.render_special = True
    assert StreamDecoder(tok).push(sot) == "<start_of_turn>"
    # the CLI: what is printed is the decode without control tokens (with them under --special)
    args = ("run", gemma_path, "-p", "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
            "-n", "8", "--temp", "0", "--no-echo", "-t", "2")
    ids = json.loads(memfit(*args, "--json").stdout)["ids"]
    assert memfit(*args).stdout == tok.decode(ids, skip_special=True).rstrip("\n") + "\n" \
        or memfit(*args).stdout == tok.decode(ids, skip_special=True)
    shown = memfit(*args, "--special").stdout
    assert shown.startswith(tok.decode(ids, skip_special=False).rstrip("\n")[:20])


# ------------------------------------------------------------------ 4. honest budgets

@pytest.mark.realmodel
def test_budget_lowers_an_unset_context_and_says_why(smollm2_path):
    p = memfit("run", smollm2_path, "-p", "Hi", "-n", "1", "--temp", "0", "--mem-budget", "280MiB",
               "-t", "2")
    assert "streamed 0 MiB/token" in p.stderr
    assert "the largest that keeps every weight resident" in p.stderr
    p = memfit("run", smollm2_path, "-p", "Hi", "-n", "1", "--temp", "0", "--mem-budget", "280MiB",
               "-c", "4096", "-t", "2")
    note = [ln for ln in p.stderr.splitlines() if "MiB of weights per token" in ln]
    assert note and "KV cache for context 4096" in note[0] and "--ctx-size " in note[0]
    p = memfit("plan", smollm2_path, "--ctx", "10000000", "--no-measure", check=False)
    assert p.returncode == 1 and "training context 8192" in p.stderr


# ------------------------------------------------------------------ 7. smaller ones

@pytest.mark.realmodel
def test_file_dash_reads_stdin(smollm2_path):
    d = json.loads(memfit("tokenize", smollm2_path, "-f", "-", "--json", stdin="Hello world").stdout)
    assert d["ids"] == json.loads(memfit("tokenize", smollm2_path, "Hello world", "--json").stdout)["ids"]


@pytest.mark.realmodel
def test_tokenize_flag_before_text(gemma_path):
    d = json.loads(memfit("tokenize", gemma_path, "--no-parse-special", "--json", "<bos>x").stdout)
    assert d["ids"][0] == 2 and 2 not in d["ids"][1:]


@pytest.mark.realmodel
def test_threads_above_cores_warn(smollm2_path):
    n = (os.cpu_count() or 1) + 1
    p = memfit("run", smollm2_path, "-p", "Hi", "-n", "1", "-t", n, "--temp", "0")
    assert f"-t {n} is more than" in p.stderr


@pytest.mark.realmodel
def test_run_output_ends_with_newline_and_refused_prompt_is_not_echoed(smollm2_path):
    p = memfit("run", smollm2_path, "-p", "The capital of France is", "-n", "3", "--temp", "0")
    assert p.stdout.endswith("\n") and not p.stdout.endswith("\n\n")
    p = memfit("run", smollm2_path, "-p", "one two three four five six seven eight nine ten", "-c", "8",
               check=False)
    assert p.returncode == 1 and "context is 8" in p.stderr and p.stdout == ""


@pytest.mark.realmodel
def test_closed_budgeted_model_raises_memfit_error(smollm2_path):
    # a fresh process: the budget must not depend on how large the test runner has grown
    code = f"""
import memfit
from memfit.errors import MemfitError
m = memfit.load({str(smollm2_path)!r}, mem_budget="300MiB", threads=2)
assert m.store is not None
m.close()
for call in (lambda: m.generate("Hi", max_tokens=1), lambda: m.logprobs([1, 2])):
    try:
        call()
    except MemfitError as e:
        assert "closed" in str(e), e
    else:
        raise SystemExit("no error after close()")
print("ok")
"""
    e = dict(os.environ)
    e.pop("MEMFIT_MEM_BUDGET", None)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=e)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr
