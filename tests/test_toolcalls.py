"""Tool calls and reasoning: real chat templates render tools, calls and results; each format
is detected from its template and parsed from model output, whole and streamed in random
pieces; a constraint grammar compiles in llguidance and every string it lets a model write
parses as a call whose arguments validate."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from memfit.errors import RequestError
from memfit.server.toolcalls import (FORMATS, OutputParser, Reasoning, ToolFormat, detect_format,
                                     detect_reasoning, tool_call_constraint, validate_tools)
from memfit.tokenizer.templates import apply_template, template_source

TEMPLATES = Path(__file__).parent / "data" / "templates"

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search-web", "description": "Search",
        "parameters": {"type": "object", "properties": {
            "q": {"type": "string"}, "top": {"type": "array", "items": {"type": "number"}}},
            "required": ["q", "top"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now"}},
]
CALL_ID = "call_" + "Ab3" * 8
HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": CALL_ID, "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": CALL_ID, "content": "RESULT-17C-SUNNY"},
    {"role": "assistant", "content": "It is 17C and sunny."},
    {"role": "user", "content": "Thanks!"},
]

# file -> (format, reasoning open marker or None)
CASES = {
    "Qwen-Qwen2.5-7B-Instruct.jinja": ("hermes", None),
    "Qwen-Qwen3-0.6B.jinja": ("hermes", "<think>"),
    "meta-llama-Llama-3.1-8B-Instruct.jinja": ("llama3", None),
    "meta-llama-Llama-3.2-3B-Instruct.jinja": ("llama3", None),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ("mistral", None),
    "meetkai-functionary-medium-v3.1.jinja": ("functionary", None),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": ("generic", "<think>"),
    "llama-cpp-deepseek-r1.jinja": ("deepseek", "<think>"),
    "Qwen3-Coder.jinja": ("qwen3_coder", None),
    "openai-gpt-oss-120b.jinja": ("harmony", "<|channel|>analysis<|message|>"),
}


@pytest.fixture(scope="module")
def tiny_tok():
    """A synthetic byte-level vocabulary with Qwen's markers (no model file needed)."""
    return _qwen_like_tokenizer()


@pytest.fixture(scope="module")
def smol_tok(smollm2_path):
    from memfit.gguf import open_gguf
    from memfit.tokenizer import Tokenizer
    f = open_gguf(smollm2_path)
    tok = Tokenizer.from_metadata(f.metadata)
    f.close()
    return tok


# --- templates ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CASES))
def test_real_template_renders_tools_calls_and_results(tiny_tok, name):
    path = str(TEMPLATES / name)
    prompt, where = apply_template(tiny_tok, "llama", HISTORY, True, path, tools=TOOLS)
    assert where.endswith("(jinja file)")
    assert "get_weather" in prompt and "search-web" in prompt          # the tool definitions
    assert "RESULT-17C-SUNNY" in prompt                                 # the tool result
    if name == "Qwen3-Coder.jinja":                                     # as XML parameters
        assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in prompt
    else:
        assert '"city": "Paris"' in prompt                              # arguments as JSON
    assert '\\"city\\"' not in prompt                                   # not JSON-in-a-string
    assert "It is 17C and sunny." in prompt and "Thanks!" in prompt
    # the history is really in the prompt: without the call and result it is shorter
    bare = [m for m in HISTORY if m["role"] != "tool" and not m.get("tool_calls")]
    short, _ = apply_template(tiny_tok, "llama", bare, True, path, tools=TOOLS)
    assert "RESULT-17C-SUNNY" not in short and len(short) < len(prompt)


def test_mistral_gets_nine_character_ids_that_match(tiny_tok):
    path = str(TEMPLATES / "mistralai-Mistral-Nemo-Instruct-2407.jinja")
    prompt, _ = apply_template(tiny_tok, "llama", HISTORY, True, path, tools=TOOLS)
    ids = re.findall(r'"id": "(\w+)"', prompt)
    results = re.findall(r'"call_id": "(\w+)"', prompt)
    assert len(ids) == 1 and len(ids[0]) == 9 and results == ids
    assert "[TOOL_CALLS]" in prompt and "[TOOL_RESULTS]" in prompt


def test_qwen3_enable_thinking_and_generation_prompt(tiny_tok):
    path = str(TEMPLATES / "Qwen-Qwen3-0.6B.jinja")
    msgs = [{"role": "user", "content": "Hi"}]
    on, _ = apply_template(tiny_tok, "qwen3", msgs, True, path)
    off, _ = apply_template(tiny_tok, "qwen3", msgs, True, path, enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n")
    assert off.endswith("<think>\n\n</think>\n\n")


@pytest.mark.realmodel
def test_template_without_tools_gets_generic_prompt(smol_tok):
    # SmolLM2's own chatml template has no `tools`: definitions go into the system message,
    # calls and results become text in the generic JSON form
    assert "tools" not in smol_tok.chat_template
    prompt, where = apply_template(smol_tok, "llama", HISTORY, tools=TOOLS)
    assert where.startswith("the model's own")
    system = prompt.split("<|im_end|>")[0]
    assert "You are terse." in system and '"name": "get_weather"' in system
    assert '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}' in prompt
    assert '{"tool_response": {"name": "get_weather"' in prompt
    assert "RESULT-17C-SUNNY" in prompt
    # no system message: one is added
    p2, _ = apply_template(smol_tok, "llama", HISTORY[1:2], tools=TOOLS)
    assert p2.startswith("<|im_start|>system\nYou can call the following tools")


def test_builtin_template_with_tools(tiny_tok):
    prompt, where = apply_template(tiny_tok, "llama", HISTORY, True, "llama3", tools=TOOLS)
    assert where == "llama3 (built-in, chosen)"
    assert "get_weather" in prompt and "RESULT-17C-SUNNY" in prompt
    assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_messages_are_normalised_and_checked(tiny_tok):
    path = str(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja")
    parts = [{"role": "user", "content": [{"type": "text", "text": "part one"},
                                          {"type": "text", "text": "part two"}]}]
    prompt, _ = apply_template(tiny_tok, "qwen2", parts, True, path)
    assert "part one\npart two" in prompt
    bad = HISTORY[:2] + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                     "arguments": "{city: Paris"}}]}]
    with pytest.raises(RequestError, match=r"messages\[2\]\.tool_calls\[0\]\.function\.arguments"):
        apply_template(tiny_tok, "qwen2", bad, True, path, tools=TOOLS)
    img = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(RequestError, match=r"messages\[0\]\.content\[0\].*image_url"):
        apply_template(tiny_tok, "qwen2", img, True, path)
    # the caller's messages are not modified
    before = json.dumps(HISTORY)
    apply_template(tiny_tok, "qwen2", HISTORY, True, path, tools=TOOLS)
    assert json.dumps(HISTORY) == before


# --- detection ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CASES))
def test_detect_format_and_reasoning(tiny_tok, name):
    src = (TEMPLATES / name).read_text(encoding="utf-8")
    fmt_name, think = CASES[name]
    assert detect_format(src, tiny_tok).name == fmt_name
    prompt, _ = apply_template(tiny_tok, "x", HISTORY[:2], True, str(TEMPLATES / name),
                               tools=TOOLS)
    r = detect_reasoning(src, prompt)
    assert (r.open if r else None) == think
    if r is not None and "DeepSeek-R1" in name:
        # thinking is on by default: the generation prompt opens the block
        assert prompt.endswith("<think>\n") and r.starts_open
        p2, _ = apply_template(tiny_tok, "x", HISTORY[:2], True, str(TEMPLATES / name),
                               enable_thinking=False)
        assert p2.endswith("<think>\n</think>") and not detect_reasoning(src, p2).starts_open
        p3, _ = apply_template(tiny_tok, "x", HISTORY[:2], True, str(TEMPLATES / name),
                               reasoning_effort="none")
        assert p3 == p2
    elif name == "llama-cpp-deepseek-r1.jinja":     # always opens the block
        assert prompt.endswith("<think>\n") and r.starts_open
    elif r is not None:
        assert not r.starts_open and r.harmony == ("gpt-oss" in name)


@pytest.mark.realmodel
def test_detect_format_without_template_and_markers(smol_tok):
    assert detect_format(None, smol_tok).name == "generic"
    assert detect_format(smol_tok.chat_template, smol_tok).name == "generic"
    assert detect_reasoning(None, "x") is None
    assert template_source(smol_tok, "llama", "chatml") is None
    # a marker that is one token of the vocabulary is recorded with its id
    fmt = detect_format("{{ tools }} <|im_start|> <tool_call>", smol_tok)
    assert fmt.name == "hermes" and fmt.markers == {}     # SmolLM2 has no <tool_call> token


# --- parsing -----------------------------------------------------------------------------------

def _collect(events):
    """Events folded: (content, reasoning, [(index, id, name, args)])."""
    content, reasoning, calls = "", "", {}
    for e in events:
        if e[0] == "content":
            content += e[1]
        elif e[0] == "reasoning":
            reasoning += e[1]
        elif e[0] == "tool_call":
            assert e[1] not in calls
            calls[e[1]] = [e[2], e[3], ""]
        else:
            calls[e[1]][2] += e[2]
    return content, reasoning, [(k, *v) for k, v in sorted(calls.items())]


def _parse(fmt, text, reasoning=None, tools=TOOLS, pieces=None):
    p = OutputParser(ToolFormat(fmt) if fmt else None, reasoning, tools)
    if pieces is None:
        events = p.push(text) + p.finish()
    else:
        events, i = [], 0
        for n in pieces:
            events += p.push(text[i:i + n])
            i += n
        events += p.push(text[i:]) + p.finish()
    content, reasoning_text, calls = _collect(events)
    assert content == p.content and reasoning_text == p.reasoning_text
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in p.tool_calls] == [c[1:] for c in calls]
    for c in p.tool_calls:
        assert re.fullmatch(r"call_[A-Za-z0-9]{24}", c["id"]) and c["type"] == "function"
    return content, reasoning_text, [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                     for c in p.tool_calls]


W = {"city": "Paris", "unit": "celsius"}
S = {"q": "a \"quoted\" {brace} </tool_call> [x]", "top": [1, 2.5]}
OUTPUTS = [
    # (format, reasoning, text, content, reasoning text, calls)
    ("hermes", None, '<tool_call>\n{"name": "get_weather", "arguments": '
     + json.dumps(W) + '}\n</tool_call>', "", "", [("get_weather", W)]),
    ("hermes", None, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
     + json.dumps(W) + '}\n</tool_call>\n<tool_call>\n{"name": "search-web", "arguments": '
     + json.dumps(S) + '}\n</tool_call>', "Let me look.\n", "",
     [("get_weather", W), ("search-web", S)]),
    ("hermes", Reasoning("<think>", "</think>"), '<think>\nThe user wants weather.\n</think>\n\n'
     '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', "",
     "The user wants weather.", [("now", {})]),
    ("hermes", None, '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',
     "", "", [("get_weather", {"city": "Paris"})]),          # string arguments, no close tag
    ("hermes", Reasoning("<think>", "</think>"), "Plain answer, no thinking.", 
     "Plain answer, no thinking.", "", []),
    ("llama3", None, '{"name": "get_weather", "parameters": ' + json.dumps(W) + "}", "", "",
     [("get_weather", W)]),
    ("llama3", None, '<|python_tag|>{"name": "search-web", "parameters": ' + json.dumps(S)
     + '}; {"name": "now", "parameters": {}}', "", "", [("search-web", S), ("now", {})]),
    ("llama3", None, '{"answer": 42}', '{"answer": 42}', "", []),      # JSON, not a call
    ("mistral", None, '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + json.dumps(W)
     + ', "id": "abcDEF123"}, {"name": "now", "arguments": {}}]', "", "",
     [("get_weather", W), ("now", {})]),
    ("mistral", None, "Sure.[TOOL_CALLS]search-web[ARGS]" + json.dumps(S), "Sure.", "",
     [("search-web", S)]),
    ("functionary", None, 'Checking.<function=get_weather>' + json.dumps(W)
     + '</function><function=now>{}</function>', "Checking.", "",
     [("get_weather", W), ("now", {})]),
    ("generic", None, json.dumps({"tool_calls": [{"name": "get_weather", "arguments": W},
                                                 {"name": "now", "arguments": {}}]}), "", "",
     [("get_weather", W), ("now", {})]),
    ("generic", Reasoning("<think>", "</think>", True), "I should call it.</think>"
     + json.dumps({"tool_call": {"name": "now", "arguments": {}}}), "", "I should call it.",
     [("now", {})]),
    ("generic", None, '<tool_call>[{"name": "now", "arguments": {}}]</tool_call> done',
     "done", "", [("now", {})]),
    ("generic", None, "Paris is sunny {today}.", "Paris is sunny {today}.", "", []),
    (None, Reasoning("<think>", "</think>"), "<think>a < b</think>\nAnswer <tool_call> x",
     "Answer <tool_call> x", "a < b", []),
    # DeepSeek R1 (type<sep>name, a ```json fence) and V3.1 (name<sep>{...}); the generic
    # format reads them too (DeepSeek's own templates know no tools)
    ("deepseek", Reasoning("<think>", "</think>", True), "Weather first.</think>\n\n"
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
     + json.dumps(W) + "\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>"
     "now\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "", "Weather first.",
     [("get_weather", W), ("now", {})]),
    ("generic", None, "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search-web<｜tool▁sep｜>"
     + json.dumps(S) + "<｜tool▁call▁end｜><｜tool▁calls▁end｜> Done.", "Sure.Done.", "",
     [("search-web", S)]),
    # Qwen3-Coder: XML parameters, a string's value as text, others as JSON
    ("qwen3_coder", None, "Let me see.\n<tool_call>\n<function=get_weather>\n<parameter=city>"
     "\nSan José, \"CA\"\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n"
     "</tool_call>\n<tool_call>\n<function=search-web>\n<parameter=q>\n[x]\n</parameter>\n"
     "<parameter=top>\n[1, 2.5]\n</parameter>\n</function>\n</tool_call>", "Let me see.\n", "",
     [("get_weather", {"city": 'San José, "CA"', "days": 3}),
      ("search-web", {"q": "[x]", "top": [1, 2.5]})]),
    ("qwen3_coder", None, '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', "", "",
     [("now", {})]),
    # gpt-oss harmony: the analysis channel is reasoning, final content, a recipient a call
    ("harmony", Reasoning("<|channel|>analysis<|message|>", "<|end|>", harmony=True),
     "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
     "commentary to=functions.get_weather <|constrain|>json<|message|>" + json.dumps(W)
     + "<|call|>", "", "Need the weather.", [("get_weather", W)]),
    (None, Reasoning("<|channel|>analysis<|message|>", "<|end|>", harmony=True),
     "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>"
     "Hello <b>there</b>.<|return|>", "Hello <b>there</b>.", "Easy.", []),
]


@pytest.mark.parametrize("case", OUTPUTS, ids=[f"{i}-{c[0]}" for i, c in enumerate(OUTPUTS)])
def test_parse_whole_and_streamed(case):
    fmt, reasoning, text, content, think, calls = case
    whole = _parse(fmt, text, reasoning)
    assert whole == (content, think, calls)
    rng = random.Random(len(text))
    for _ in range(25):
        pieces = [rng.randint(0, 4) for _ in range(len(text))]
        assert _parse(fmt, text, reasoning, pieces=pieces) == whole
    assert _parse(fmt, text, reasoning, pieces=[1] * len(text)) == whole


@pytest.mark.parametrize("fmt,text", [
    ("hermes", '<tool_call>\n{"name": "no_such_tool", "arguments": {}}\n</tool_call>'),
    ("hermes", "<tool_call>\nnot json\n</tool_call>"),
    ("functionary", "<function=get_weather>[1, 2]</function>"),
    ("mistral", "[TOOL_CALLS] I cannot call tools"),
    ("llama3", '{"name": "get_weather", "parameters": "Paris"'),   # string arguments, cut
    ("hermes", '<tool_call>\n{"arguments": {"city": "Par'),       # cut before the name
    ("generic", '{"tool_calls": [{"name": "get_weather", "arguments": "oops"}]}'),
])
def test_unparseable_calls_are_content(fmt, text):
    for pieces in (None, [3] * len(text)):
        assert _parse(fmt, text, pieces=pieces) == (text.lstrip(), "", [])


@pytest.mark.parametrize("fmt,text,content,args", [
    # cut off by the token limit once the name is known: the call stays, its arguments closed
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "",
     {"city": "Par"}),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"', "", {"city": "Paris"}),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"n": 12', "", {"n": 12}),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"a": "x\\u00', "", {"a": "x"}),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"a": [1, {"b": tr', "",
     {"a": [1, {}]}),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit', "", {"city": "Paris"}),
    # a syntax error inside announced arguments: they close before it, the rest is text
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
     "Paris}}\n</tool_call>", {}),
])
def test_cut_and_broken_arguments_are_closed(fmt, text, content, args):
    for pieces in (None, [3] * len(text), [1] * len(text)):
        assert _parse(fmt, text, pieces=pieces) == (content, "", [("get_weather", args)])


LONG = {"city": "Paris", "notes": "x " * 40, "days": [1, 2, 3], "deep": {"k": None, "b": True}}


@pytest.mark.parametrize("fmt,text", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(LONG, indent=1)
     + '}\n</tool_call>'),
    ("generic", json.dumps({"tool_calls": [{"name": "get_weather", "arguments": LONG}]})),
    ("llama3", '{"name": "get_weather", "parameters": ' + json.dumps(LONG) + "}"),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + json.dumps(LONG)
     + ', "id": "abcDEF123"}]'),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]" + json.dumps(LONG)),
    ("functionary", "<function=get_weather>" + json.dumps(LONG) + "</function>"),
    ("hermes", '{"name": "get_weather", "arguments": ' + json.dumps(LONG) + "}"),  # llama-3 style
])
def test_arguments_stream_in_pieces(fmt, text):
    """The call is announced once its name is read, before its arguments are complete, and
    the arguments follow in pieces (white space outside strings dropped) that add up to the
    whole call's arguments."""
    p = OutputParser(ToolFormat(fmt), None, TOOLS)
    events, announced_at, k = [], None, 0
    while k < len(text):
        events += p.push(text[k:k + 5])
        k += 5
        if announced_at is None and any(e[0] == "tool_call" for e in events):
            announced_at = k
    events += p.finish()
    assert announced_at is not None and announced_at < text.index('"notes"')
    pieces = [e[2] for e in events if e[0] == "tool_args"]
    assert len(pieces) > 10
    assert "".join(pieces) == json.dumps(LONG, separators=(",", ":"))
    assert p.tool_calls[0]["function"]["arguments"] == "".join(pieces)
    assert p.content == ""


def test_markers_are_held_back_while_streaming():
    p = OutputParser(ToolFormat("hermes"), Reasoning("<think>", "</think>"), TOOLS)
    assert p.push("<thi") == []
    assert p.push("nk>abc</th") == [("reasoning", "abc")]
    assert p.push("ink>Hello <tool") == [("content", "Hello ")]
    ev = p.push('_call>{"name": "now", "arguments": {}}</tool_call>')
    assert [e[0] for e in ev] == ["tool_call", "tool_args"] and ev[1][2] == "{}"
    assert p.finish() == []
    q = OutputParser(ToolFormat("hermes"), None, TOOLS)
    assert q.push("a <tool") == [("content", "a ")]
    assert q.finish() == [("content", "<tool")]


def test_no_tools_list_accepts_any_name_and_reasoning_only():
    assert _parse("hermes", '<tool_call>{"name": "x", "arguments": {}}</tool_call>',
                  tools=None)[2] == [("x", {})]
    r = Reasoning("<think>", "</think>", starts_open=True)
    assert _parse(None, "thinking to the end", r) == ("", "thinking to the end", [])


# --- request checks ----------------------------------------------------------------------------

@pytest.mark.parametrize("tools,choice,parallel,match", [
    ({"type": "function"}, None, None, r"^tools must be a list"),
    ([{"type": "retrieval"}], None, None, r"tools\[0\]\.type"),
    ([{"type": "function"}], None, None, r"tools\[0\]\.function must"),
    ([{"type": "function", "function": {"name": "a b"}}], None, None, r"tools\[0\]\.function\.name"),
    ([{"type": "function", "function": {"name": "x" * 65}}], None, None, r"function\.name"),
    (TOOLS + [TOOLS[0]], None, None, r"tools\[3\]\.function\.name 'get_weather' is given twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, None,
     r"tools\[0\]\.function\.parameters must be a JSON schema object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
     None, None, r"parameters must describe an object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}], None, None,
     r"tools\[0\]\.function\.parameters\.properties\.a\.type is not a valid JSON schema"),
    (TOOLS, "sometimes", None, r"^tool_choice must be"),
    (None, "required", None, r"tool_choice is \"required\" but no tools"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, None,
     r"tool_choice\.function\.name 'nope' is not one of the tools"),
    (TOOLS, {"type": "function"}, None, r"^tool_choice must be"),
    (TOOLS, "auto", "yes", r"parallel_tool_calls must be true or false"),
])
def test_validate_tools_rejects(tools, choice, parallel, match):
    if "valid JSON schema" in match:
        pytest.importorskip("jsonschema")      # the schema check needs it
    with pytest.raises(ValueError, match=match) as e:
        validate_tools(tools, choice, parallel)
    assert "\n" not in str(e.value)


def test_validate_tools_accepts():
    for choice in (None, "auto", "none", "required",
                   {"type": "function", "function": {"name": "search-web"}}):
        validate_tools(TOOLS, choice, True)
    validate_tools(None, None, None)
    validate_tools([], "none", False)


# --- constraints -------------------------------------------------------------------------------

def _lltokenizer(tok):
    """An llguidance tokenizer over memfit's vocabulary (a test helper; the engine's own
    wrapper lives in memfit.constrain)."""
    llguidance = pytest.importorskip("llguidance")

    class Vocab:
        def __init__(self):
            self.eos_token_id, self.bos_token_id = tok.eos_id, tok.bos_id
            self.tokens = [tok.token_to_bytes(i, True) for i in range(tok.n_vocab)]
            self.special_token_ids = [i for i in range(tok.n_vocab) if tok.is_control(i)]

        def __call__(self, s):
            if isinstance(s, bytes):
                raise TypeError("text only")
            return tok.encode(s, add_special=False, parse_special=False)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocab()))


def _sample(llguidance, llt, tok, grammar, rng, short, closers, limit=200):
    """Random tokens under the grammar's mask: mostly one-byte tokens at first, then, after 40,
    closing ones (a quote, a bracket, EOS) whenever the mask allows one, so that the text ends;
    the text, or None if it did not end within ``limit`` tokens."""
    import numpy as np
    m = llguidance.LLMatcher(llt, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not m.is_error(), m.get_error()
    ids = []
    for step in range(limit):
        if m.is_stopped():
            return tok.decode(ids)
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8),
                             bitorder="little")[:tok.n_vocab]
        allowed = np.flatnonzero(bits)
        assert len(allowed), "the mask allows nothing"
        pool = allowed
        if step >= 40:
            pool = np.intersect1d(allowed, closers, assume_unique=True)
        if step < 40 or not len(pool):
            sh = np.intersect1d(allowed, short, assume_unique=True)
            pool = sh if len(sh) and rng.random() < 0.9 else allowed
        t = int(rng.choice(pool))
        if t == tok.eos_id:
            assert m.is_accepting()
            return tok.decode(ids)
        assert m.consume_token(t), m.get_error()
        ids.append(t)
    return None


@pytest.fixture(scope="module")
def smol_llg(smol_tok):
    """(llguidance, its tokenizer over SmolLM2's vocabulary, the one-byte tokens + EOS)."""
    import numpy as np
    llguidance = pytest.importorskip("llguidance")
    tok = smol_tok
    short = np.array(sorted({i for i in range(tok.n_vocab) if len(tok.token_to_bytes(i)) == 1}
                            | {tok.eos_id}))
    closers = np.array(sorted({tok.token_id(c) for c in ('"', "}", "]")} | {tok.eos_id}))
    return llguidance, _lltokenizer(tok), short, closers


# Qwen3-Coder's string parameters are text up to a closing tag, which random sampling does
# not write: its tools bound every string, so the grammar closes them
BOUNDED = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search-web", "parameters": {"type": "object", "properties": {
            "q": {"type": "string", "minLength": 2, "maxLength": 9},
            "top": {"type": "array", "items": {"type": "number"}, "maxItems": 3}},
            "required": ["q", "top"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now"}}]


@pytest.mark.realmodel
@pytest.mark.parametrize("fmt", FORMATS)
def test_constraint_forces_valid_calls(smol_tok, smol_llg, fmt):
    import numpy as np
    jsonschema = pytest.importorskip("jsonschema")
    llguidance, llt, short, closers = smol_llg
    tools = BOUNDED if fmt == "qwen3_coder" else TOOLS
    params = {t["function"]["name"]: t["function"].get("parameters", {}) for t in tools}
    rng = np.random.default_rng(7)
    named = {"type": "function", "function": {"name": "search-web"}}
    for choice, parallel in (("required", False), ("required", True), (named, False)):
        spec = tool_call_constraint(ToolFormat(fmt), tools, choice, parallel)
        assert spec["type"] == "lark"
        grammar = llguidance.LLMatcher.grammar_from_lark(spec["grammar"])
        assert llguidance.LLMatcher.validate_grammar(grammar, llt) == "", spec["grammar"]
        done = 0
        for _ in range(6):
            text = _sample(llguidance, llt, smol_tok, spec["grammar"], rng, short, closers)
            if text is None:
                continue
            done += 1
            content, _, calls = _parse(fmt, text, tools=tools)
            assert content == "" and calls, text
            if not parallel:
                assert len(calls) == 1, text
            for name, args in calls:
                if choice is named:
                    assert name == "search-web"
                jsonschema.validate(args, params[name])
            # streamed in pieces, the same calls
            assert _parse(fmt, text, tools=tools, pieces=[2] * len(text))[2] == calls
        assert done >= 5, f"only {done} of 6 samples finished"


@pytest.mark.realmodel
def test_constraint_with_reasoning_compiles(smol_llg):
    llguidance, llt, _, _ = smol_llg
    for starts_open in (False, True):
        spec = tool_call_constraint(ToolFormat("hermes"), TOOLS, "required", True,
                                    reasoning=Reasoning("<think>", "</think>", starts_open))
        g = llguidance.LLMatcher.grammar_from_lark(spec["grammar"])
        assert llguidance.LLMatcher.validate_grammar(g, llt) == ""
        m = llguidance.LLMatcher(llt, g)
        text = ("" if starts_open else "<think>") + "hmm</think>\n" \
            + '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
        assert m.consume_tokens(llt.tokenize_str(text)), m.get_error()
        assert m.is_accepting()
        p = OutputParser(ToolFormat("hermes"), Reasoning("<think>", "</think>", starts_open),
                         TOOLS)
        p.push(text)
        p.finish()
        assert p.reasoning_text == "hmm" and p.tool_calls[0]["function"]["name"] == "now"


def test_constraint_rejects_what_it_cannot_force():
    with pytest.raises(ValueError, match="auto"):
        tool_call_constraint(ToolFormat("hermes"), TOOLS, "auto", False)
    with pytest.raises(ValueError, match="nope"):
        tool_call_constraint(ToolFormat("hermes"), TOOLS,
                             {"type": "function", "function": {"name": "nope"}}, False)


def _qwen_like_tokenizer():
    """memfit's tiny synthetic byte-level vocabulary plus Qwen's <tool_call>, </tool_call>,
    <think>, </think> as user-defined tokens and the Qwen2.5 template."""
    from memfit.models.synthetic import tiny_vocab
    from memfit.tokenizer import Tokenizer
    tokens, types, merges = tiny_vocab()
    extra = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
    src = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(encoding="utf-8")
    return Tokenizer.from_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens + extra, "tokenizer.ggml.token_type": types + [4] * 4,
        "tokenizer.ggml.merges": merges, "tokenizer.ggml.eos_token_id": len(tokens) - 1,
        "tokenizer.chat_template": src})


def test_constraint_names_marker_tokens():
    # a marker that is one token of the vocabulary is asked for as that token; the text the
    # model then writes (the token rendered as text) parses as the call
    import numpy as np
    llguidance = pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    tok = _qwen_like_tokenizer()
    fmt = detect_format(tok.chat_template, tok)
    open_id, close_id = tok.token_id("<tool_call>"), tok.token_id("</tool_call>")
    assert fmt.name == "hermes" and fmt.markers == {
        "<tool_call>": open_id, "</tool_call>": close_id,
        "<think>": tok.token_id("<think>"), "</think>": tok.token_id("</think>")}
    spec = tool_call_constraint(fmt, TOOLS, {"type": "function", "function": {"name": "get_weather"}},
                                False)
    assert f"<[{open_id}]>" in spec["grammar"] and f"<[{close_id}]>" in spec["grammar"]
    llt = _lltokenizer(tok)
    short = np.array(sorted({i for i in range(tok.n_vocab) if len(tok.token_to_bytes(i)) == 1}
                            | {tok.eos_id}))
    closers = np.array(sorted({tok.token_id(c) for c in ('"', "}", "]")} | {tok.eos_id}))
    rng = np.random.default_rng(3)
    m = llguidance.LLMatcher(llt, llguidance.LLMatcher.grammar_from_lark(spec["grammar"]))
    assert not m.is_error(), m.get_error()
    first = np.flatnonzero(np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8),
                                         bitorder="little")[:tok.n_vocab])
    assert first.tolist() == [open_id]        # the only allowed first token is <tool_call>
    done = 0
    for _ in range(5):
        text = _sample(llguidance, llt, tok, spec["grammar"], rng, short, closers)
        if text is None:
            continue
        done += 1
        assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
        content, _, calls = _parse("hermes", text)
        assert content == "" and [n for n, _ in calls] == ["get_weather"]
        jsonschema.validate(calls[0][1], TOOLS[0]["function"]["parameters"])
    assert done >= 4


def test_constraint_with_reasoning_marker_tokens():
    # thinking may end with the </think> token or its spelling; either way a call must follow
    llguidance = pytest.importorskip("llguidance")
    tok = _qwen_like_tokenizer()
    fmt = detect_format(tok.chat_template, tok)
    assert {"<think>", "</think>"} <= set(fmt.markers)
    llt = _lltokenizer(tok)
    call = tok.encode('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
                      add_special=False, parse_special=True)
    think = tok.encode("hmm, a < b", add_special=False, parse_special=False)
    t_open, t_close = fmt.markers["<think>"], fmt.markers["</think>"]
    spelled = tok.encode("</think>", add_special=False, parse_special=False)
    for starts_open in (False, True):
        spec = tool_call_constraint(fmt, TOOLS, "required", False,
                                    reasoning=Reasoning("<think>", "</think>", starts_open))
        g = llguidance.LLMatcher.grammar_from_lark(spec["grammar"])
        head = [] if starts_open else [t_open]
        for end in ([t_close], spelled):
            m = llguidance.LLMatcher(llt, g)
            assert m.consume_tokens(head + think + end + call), (end, m.get_error())
            assert m.is_accepting()
        m = llguidance.LLMatcher(llt, g)          # no call after the thinking: refused
        assert m.consume_tokens(head + think + [t_close])
        assert not m.is_accepting()
        assert m.validate_tokens(tok.encode("Hello", add_special=False)) == 0


@pytest.mark.realmodel
def test_constraint_mistral_args_style(smol_tok, smol_llg):
    # with an [ARGS] token in the vocabulary the newer Mistral form is forced
    llguidance, llt, short, closers = smol_llg
    fmt = ToolFormat("mistral", {})
    old = tool_call_constraint(fmt, TOOLS, "required", True)["grammar"]
    assert '"["' in old and "[ARGS]" not in old
    spec = tool_call_constraint(ToolFormat("mistral", {"[ARGS]": 17}), TOOLS, "required", True)
    assert '"[TOOL_CALLS]" "get_weather" <[17]>' in spec["grammar"]
    g = llguidance.LLMatcher.grammar_from_lark(spec["grammar"])
    assert llguidance.LLMatcher.validate_grammar(g, llt) == ""
    text = "[TOOL_CALLS]search-web[ARGS]" + json.dumps(S) + "[TOOL_CALLS]now[ARGS]{}"
    assert _parse("mistral", text)[2] == [("search-web", S), ("now", {})]


# --- thinking budget ---------------------------------------------------------------------------

@pytest.mark.parametrize("reasoning,head", [
    (Reasoning("<think>", "</think>", starts_open=True), ""),
    (Reasoning("<think>", "</think>"), "\n<think>"),
    (Reasoning("<|channel|>analysis<|message|>", "<|end|>", harmony=True),
     "<|channel|>analysis<|message|>"),
])
def test_thinking_budget_matcher(tiny_tok, reasoning, head):
    """The budget counts the reasoning's tokens (after the open marker, when the prompt did
    not open it) and then forces the close text once; a model that closes the reasoning
    itself, or answers without it, is never forced."""
    from memfit.server.toolcalls import ThinkingBudget
    tok = tiny_tok
    enc = lambda s: tok.encode(s, add_special=False, parse_special=True)  # noqa: E731
    b = ThinkingBudget(tok, reasoning, 3)
    assert tok.decode(b.close_ids) == reasoning.close_text
    m = b.matcher()
    assert m.ll is None and m.forced() == [] and m.accepting and not m.stopped
    words = enc("one two three four five six")
    assert m.consume(enc(head))
    fed = 0
    while fed < len(words) and not m.forced():
        assert m.consume(words[fed:fed + 1])
        fed += 1
    assert fed == 3                 # the close is due after three reasoning tokens
    # it is forced once
    m2 = b.matcher()
    if head:
        m2.consume(enc(head))
    m2.consume(words[:3])
    close = m2.forced()
    assert close == b.close_ids and m2.consume(close) and m2.forced() == []
    m2.consume(words[3:])
    assert m2.forced() == []
    # closed by the model before the budget: nothing forced
    m3 = b.matcher()
    if head:
        m3.consume(enc(head))
    m3.consume(words[:1] + enc(reasoning.close) + words[1:])
    assert m3.forced() == []
    # an answer that does not open the reasoning (the prompt did not): nothing forced
    if not reasoning.starts_open:
        m4 = b.matcher()
        m4.consume(enc("Hello there, no thinking at all"))
        assert m4.forced() == []


# --- Llama 3.1's built-in tools ----------------------------------------------------------------

def _fn(name, key, extra=None):
    props = {key: {"type": "string"}, **(extra or {})}
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": props, "required": [key]}}}


BUILTINS = [_fn("brave_search", "query"), _fn("wolfram_alpha", "query"),
            _fn("code_interpreter", "code"), _fn("get_weather", "city"), _fn("python", "code")]
LLAMA31 = ToolFormat("llama3", builtin=True)


def _parse_builtin(text, fmt=LLAMA31, tools=BUILTINS):
    whole = _parse_with(fmt, text, tools, None)
    for n in (1, 3, 7):     # streamed in pieces: the same events folded
        assert _parse_with(fmt, text, tools, n) == whole, n
    return whole


def _parse_with(fmt, text, tools, n):
    p = OutputParser(fmt, None, tools)
    events = p.push(text) if n is None else \
        [e for k in range(0, len(text), n) for e in p.push(text[k:k + n])]
    content, _, calls = _collect(events + p.finish())
    return content, [(name, json.loads(args)) for _, _, name, args in calls]


def test_llama31_template_knows_builtins(tiny_tok):
    src = (TEMPLATES / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()
    assert detect_format(src, tiny_tok).builtin
    assert not detect_format((TEMPLATES / "meta-llama-Llama-3.2-3B-Instruct.jinja").read_text(),
                             tiny_tok).builtin


@pytest.mark.parametrize("text,content,calls", [
    ('<|python_tag|>brave_search.call(query="weather in \\"Paris\\"")', "",
     [("brave_search", {"query": 'weather in "Paris"'})]),
    ('<|python_tag|> wolfram_alpha . call ( query = "2+2" )', "",
     [("wolfram_alpha", {"query": "2+2"})]),
    ('<|python_tag|>brave_search.call(query="a", count=3, safe=true)', "",
     [("brave_search", {"query": "a", "count": 3, "safe": True})]),
    # the code interpreter: the code itself after the tag (Meta's format)
    ('<|python_tag|>import sys\nprint(sys.version)\n', "",
     [("code_interpreter", {"code": "import sys\nprint(sys.version)"})]),
    ('<|python_tag|>code_interpreter.call(code="print(1)")', "",
     [("code_interpreter", {"code": "print(1)"})]),
    ('<|python_tag|>python.call(code="print(1)")', "", [("python", {"code": "print(1)"})]),
    # custom tools keep their JSON form, after the tag or as the whole answer
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', "",
     [("get_weather", {"city": "Oslo"})]),
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', "",
     [("get_weather", {"city": "Oslo"})]),
    ('Let me look. <|python_tag|>brave_search.call(query="x")', "Let me look. ",
     [("brave_search", {"query": "x"})]),
])
def test_builtin_calls_parse_whole_and_streamed(text, content, calls):
    assert _parse_builtin(text) == (content, calls)


@pytest.mark.parametrize("text,tools,fmt", [
    # a tool the request does not have
    ('<|python_tag|>image_gen.call(prompt="cat")', BUILTINS, LLAMA31),
    # cut by the token limit inside the call
    ('<|python_tag|>brave_search.call(query="weath', BUILTINS, LLAMA31),
    # malformed: a value that is not JSON, a repeated key
    ('<|python_tag|>brave_search.call(query=weather)', BUILTINS[:2], LLAMA31),
    ('<|python_tag|>brave_search.call(query="a", query="b")', BUILTINS[:2], LLAMA31),
    # raw code without a code interpreter, or on a template without built-ins
    ('<|python_tag|>print(1)', BUILTINS[:2], LLAMA31),
    ('<|python_tag|>print(1)', BUILTINS, ToolFormat("llama3")),
])
def test_builtin_non_calls_are_content(text, tools, fmt):
    assert _parse_builtin(text, fmt, tools) == (text, [])


def test_code_after_the_tag_goes_to_a_python_tool():
    """Without the built-in code interpreter, a "python" tool with a string "code" takes code
    written after the tag (llama.cpp reads it so)."""
    tools = BUILTINS[:2] + [_fn("python", "code")]
    assert _parse_builtin("<|python_tag|>print(2 + 2)", LLAMA31, tools) == \
        ("", [("python", {"code": "print(2 + 2)"})])
    other = BUILTINS[:2] + [_fn("python", "source")]
    assert _parse_builtin("<|python_tag|>print(2)", LLAMA31, other)[1] == []


def test_builtin_tools_render_as_the_template_means(tiny_tok):
    """Built-ins go to the template's builtin_tools (listed by name in the system prompt), not
    into the JSON definitions; their past calls render as name.call(...) ending in <|eom_id|>;
    a tool named like a built-in but with other parameters stays a custom tool."""
    tpl = str(TEMPLATES / "meta-llama-Llama-3.1-8B-Instruct.jinja")
    msgs = [{"role": "user", "content": "Search."},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function", "function": {
                    "name": "brave_search", "arguments": '{"query": "memfit"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "no results"}]
    text, _ = apply_template(tiny_tok, "qwen2", msgs, template=tpl, tools=BUILTINS)
    assert "Environment: ipython\nTools: brave_search, wolfram_alpha\n" in text
    assert '"name": "get_weather"' in text and '"name": "brave_search"' not in text
    assert '<|python_tag|>brave_search.call(query="memfit")<|eom_id|>' in text
    # (the template writes a result with tojson: a string comes out quoted)
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"no results"' in text
    # only built-ins: no custom tool block at all
    text, _ = apply_template(tiny_tok, "qwen2", msgs[:1], template=tpl, tools=BUILTINS[:1])
    assert "Tools: brave_search\n" in text and "Given the following functions" not in text
    # brave_search with other parameters is the client's own tool
    own = [_fn("brave_search", "q")]
    text, _ = apply_template(tiny_tok, "qwen2", msgs[:1], template=tpl, tools=own)
    assert "Tools:" not in text and '"name": "brave_search"' in text


@pytest.mark.realmodel
def test_builtin_constraint_forces_calls(smol_tok, smol_llg):
    """tool_choice required / named over built-ins and a custom tool: every sampled text is a
    call the parser reads, whole and streamed, with arguments valid for the schema."""
    import numpy as np
    jsonschema = pytest.importorskip("jsonschema")
    llguidance, llt, short, closers = smol_llg
    tools = [_fn("brave_search", "query"), _fn("code_interpreter", "code"), TOOLS[0]]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    rng = np.random.default_rng(3)
    named = {"type": "function", "function": {"name": "brave_search"}}
    seen = set()
    for choice in ("required", named):
        spec = tool_call_constraint(LLAMA31, tools, choice, True)
        grammar = llguidance.LLMatcher.grammar_from_lark(spec["grammar"])
        assert llguidance.LLMatcher.validate_grammar(grammar, llt) == "", spec["grammar"]
        done = 0
        for _ in range(8):
            text = _sample(llguidance, llt, smol_tok, spec["grammar"], rng, short, closers)
            if text is None:
                continue
            done += 1
            content, calls = _parse_builtin(text, LLAMA31, tools)
            assert content == "" and len(calls) == 1, text
            name, args = calls[0]
            assert choice == "required" or name == "brave_search"
            if name != TOOLS[0]["function"]["name"]:
                assert text.startswith(f"<|python_tag|>{name}.call("), text
            jsonschema.validate(args, params[name])
            seen.add(name)
        assert done >= 6, f"only {done} of 8 samples finished"
    assert "brave_search" in seen
