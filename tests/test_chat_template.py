"""Chat templates: SmolLM2's real template reproduces llama-server's /apply-template output;
the jinja2 sandbox refuses attribute tricks; template errors are memfit errors."""

from __future__ import annotations

import pytest

from conftest import GOLDEN, load_jsonl
from memfit.errors import MemfitError, ModelError, RequestError
from memfit.gguf import open_gguf
from memfit.tokenizer import ChatTemplateMissing, Tokenizer, render_chat, require_template

STEM = "SmolLM2-135M-Instruct.Q4_1"


def _chat_cases():
    path = GOLDEN / f"greedy_{STEM}.jsonl"
    if not path.is_file():
        return [pytest.param(None, marks=pytest.mark.skip(f"no {path}"))]
    cases = [c for c in load_jsonl(path) if c["kind"] == "chat_template"]
    return [pytest.param(c, id=c["case"]) for c in cases]


@pytest.fixture(scope="module")
def smol_template(smollm2_path):
    f = open_gguf(smollm2_path)
    tok = Tokenizer.from_metadata(f.metadata)
    f.close()
    return tok


@pytest.mark.realmodel
@pytest.mark.parametrize("case", _chat_cases())
def test_smollm2_template_matches_golden(smol_template, case):
    tok = smol_template
    prompt = render_chat(tok.chat_template, case["messages"], add_generation_prompt=True)
    assert prompt == case["prompt"]
    assert tok.encode(prompt, add_special=True, parse_special=True) == case["prompt_ids"]


@pytest.mark.realmodel
def test_smollm2_template_system_and_no_generation_prompt(smol_template):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = render_chat(smol_template.chat_template, msgs, add_generation_prompt=False)
    assert out == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


@pytest.mark.realmodel
def test_model_without_template(gemma_path):
    f = open_gguf(gemma_path)
    tok = Tokenizer.from_metadata(f.metadata)
    f.close()
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateMissing, match="no chat template.*plain completion"):
        render_chat(tok.chat_template, [{"role": "user", "content": "Hi"}])
    assert issubclass(ChatTemplateMissing, RequestError)
    with pytest.raises(ChatTemplateMissing):
        require_template("")


MSGS = [{"role": "user", "content": "héllo"}]


@pytest.mark.parametrize("template", [
    "{{ messages.__class__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ messages[0].__class__ }}",
    "{% set _ = messages.append({'role': 'x'}) %}ok",
])
def test_sandbox_refuses_attribute_access(template):
    with pytest.raises(ModelError, match="unsafe operation.*not allowed"):
        render_chat(template, MSGS)


def test_raise_exception_is_a_request_error():
    t = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message is required') }}{% endif %}"
    with pytest.raises(RequestError, match="a system message is required"):
        render_chat(t, MSGS)


def test_broken_template_is_a_model_error():
    with pytest.raises(ModelError, match="does not compile"):
        render_chat("{% for m in messages %}", MSGS)
    with pytest.raises(MemfitError, match="failed"):
        render_chat("{{ messages[0]['content'] + 1 }}", MSGS)


def test_hf_style_helpers():
    t = ("{% for m in messages %}{{ m | tojson }}\n{% endfor %}"
         "{% if add_generation_prompt %}{{ bos_token }}A:{{ eos_token }}{% endif %}{{ extra }}")
    out = render_chat(t, MSGS, add_generation_prompt=True, bos_token="<s>", eos_token="</s>", extra="!")
    # tojson keeps non-ASCII text; trim_blocks eats the newline after a block tag
    assert out == '{"role": "user", "content": "héllo"}\n<s>A:</s>!'
    year = render_chat("{{ strftime_now('%Y') }}", MSGS)
    assert year.isdigit() and len(year) == 4
    with pytest.raises(RequestError, match="messages must be a list"):
        render_chat(t, "hello")
