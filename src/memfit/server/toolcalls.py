"""Tool calls and reasoning in a model's output: formats, an incremental parser, constraints.

Pure functions and classes, no HTTP: the server's chat, Responses and Messages paths use them
alike.

- ``validate_tools`` checks ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` as OpenAI
  does, raising ValueError with a one-line message that names the field.
- ``detect_format`` reads the chat template to find how the model writes a call: "hermes"
  (Qwen2.5/Qwen3, Hermes: ``<tool_call>{"name", "arguments"}</tool_call>``), "llama3" (a JSON
  object ``{"name", "parameters"}`` as the whole answer, or after ``<|python_tag|>``, and
  Llama 3.1's built-ins ``<|python_tag|>name.call(...)``), "mistral" (``[TOOL_CALLS][{...}]`` or ``[TOOL_CALLS]name[ARGS]{...}``), "functionary"
  (``<function=name>{...}</function>``), "deepseek" (``<｜tool▁calls▁begin｜>``, R1's
  ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>name`` + a ```json fence or V3.1's
  ``name<｜tool▁sep｜>{...}``), "qwen3_coder" (``<tool_call><function=name><parameter=k>v``
  ``</parameter></function></tool_call>``), "harmony" (gpt-oss: ``<|channel|>commentary
  to=functions.name <|constrain|>json<|message|>{...}``), and "generic" for a template that
  knows no tools: memfit then tells the model the JSON form ``{"tool_calls": [{"name",
  "arguments"}]}`` (tokenizer/templates.generic_tool_prompt), and the parser also takes
  Hermes tags and DeepSeek's tokens. Every format also reads a Llama-3 style answer
  ``{"name": ..., "parameters"|"arguments": {...}}`` (models write it whatever told).
- ``detect_reasoning`` finds the template's thinking markers (``<think>``...``</think>``, or
  gpt-oss's analysis channel) and whether the generation prompt already opened the block
  (DeepSeek-R1, Qwen3 thinking).
- ``OutputParser`` splits generated text, as it streams in, into content, reasoning and tool
  calls. It holds back text that may be the start of a marker, as a stop matcher does, so
  streamed and whole output give the same events. A call is announced (``tool_call``) once
  its name is read and the text can only be a call (never announced and then taken back);
  its arguments then follow in ``tool_args`` pieces as they are generated, checked as JSON
  by ``_ArgsStream`` and written without white space outside strings (the whole call's
  arguments are the same pieces joined, streamed or not). Arguments cut off by the end of the
  output (max_tokens) or broken by a syntax error are closed where they stop, so they parse
  (llama-server does the same); what follows an error is content. Shapes whose name comes
  after the arguments, string arguments and lists that do not start with a call are read
  whole, once complete; one that does not parse, or names a tool the request does not have,
  is given back as content.
- ``tool_call_constraint`` writes an llguidance Lark grammar that forces exactly the text the
  format's parser reads as a call, each function's arguments embedded as ``%json{schema}``
  (Qwen3-Coder: a parameter per property, text for strings), for ``tool_choice: "required"``
  or a named function.
- ``ThinkingBudget`` closes the reasoning after a number of tokens (forced tokens).

Llama 3.1's built-in tools (brave_search, wolfram_alpha, code_interpreter: a template with
``builtin_tools`` gets them there, tokenizer/templates.builtin_tools) are called as
``<|python_tag|>name.call(key="value", ...)``, each value JSON, read whole once the ")" is
there (any of the request's tools may be called so); the code interpreter (else a "python"
tool with a string "code", as llama.cpp reads it) may also be given the code itself after the
tag, read to the end of the output. A built-in call cut off by the
token limit is content. In the JSON-first formats (llama3, generic) an answer that starts with
"{" and is not a call's head is held back until the JSON value is complete, since only then
is it known whether it is a call.

The parsing is hand-written: the formats are small and fixed, llguidance has no parser that
reports where a call starts in free text, and neither jinja nor a JSON library can split a
stream; each format is a head (a few items matched as text streams in) or a recogniser over
one shared JSON-extent scanner, and one incremental JSON reader streams the arguments.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field

from ..tokenizer.templates import BUILTIN_TOOLS, builtin_tools

FORMATS = ("hermes", "llama3", "mistral", "functionary", "generic", "deepseek", "qwen3_coder",
           "harmony")

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ALNUM = string.ascii_letters + string.digits


def new_call_id() -> str:
    """An OpenAI-style call id: "call_" and 24 random alphanumerics."""
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


# --- request checks ----------------------------------------------------------------------------

def validate_tools(tools, tool_choice, parallel_tool_calls) -> None:
    """Raise ValueError (one line, naming the field) unless ``tools``, ``tool_choice`` and
    ``parallel_tool_calls`` are as OpenAI's chat completions API accepts them."""
    names: list[str] = []
    if tools is not None:
        if not isinstance(tools, list):
            raise ValueError("tools must be a list of tool objects")
        for i, t in enumerate(tools):
            w = f"tools[{i}]"
            if not isinstance(t, dict):
                raise ValueError(f"{w} must be an object like "
                                 '{"type": "function", "function": {"name": ...}}')
            if t.get("type") != "function":
                raise ValueError(f"{w}.type must be \"function\" (got {t.get('type')!r})")
            fn = t.get("function")
            if not isinstance(fn, dict):
                raise ValueError(f"{w}.function must be an object with a name")
            name = fn.get("name")
            if not isinstance(name, str) or not _NAME_RE.match(name):
                raise ValueError(f"{w}.function.name must be 1-64 characters of a-z, A-Z, 0-9, "
                                 f"_ or - (got {name!r})")
            if name in names:
                raise ValueError(f"{w}.function.name {name!r} is given twice; tool names must "
                                 f"be unique")
            names.append(name)
            desc = fn.get("description")
            if desc is not None and not isinstance(desc, str):
                raise ValueError(f"{w}.function.description must be a string")
            params = fn.get("parameters")
            if params is not None:
                if not isinstance(params, dict):
                    raise ValueError(f"{w}.function.parameters must be a JSON schema object")
                if params.get("type", "object") != "object":
                    raise ValueError(f"{w}.function.parameters must describe an object "
                                     f"(\"type\": \"object\"), got type {params.get('type')!r}")
                _check_schema(params, f"{w}.function.parameters")
            strict = fn.get("strict")
            if strict is not None and not isinstance(strict, bool):
                raise ValueError(f"{w}.function.strict must be true or false")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ValueError("parallel_tool_calls must be true or false")
    if tool_choice is None:
        return
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "none", "required"):
            raise ValueError(f"tool_choice must be \"auto\", \"none\", \"required\" or "
                             f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                             f"(got {tool_choice!r})")
        if tool_choice == "required" and not names:
            raise ValueError("tool_choice is \"required\" but no tools are given")
        return
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" \
            or not isinstance(tool_choice.get("function"), dict):
        raise ValueError('tool_choice must be "auto", "none", "required" or '
                         '{"type": "function", "function": {"name": ...}}')
    name = tool_choice["function"].get("name")
    if not isinstance(name, str):
        raise ValueError("tool_choice.function.name must be a string")
    if name not in names:
        raise ValueError(f"tool_choice.function.name {name!r} is not one of the tools "
                         f"({', '.join(names) or 'none given'})")


def _check_schema(schema: dict, where: str) -> None:
    try:
        import jsonschema
    except ImportError:         # optional: the grammar compiler reports bad schemas too
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in e.path)
        raise ValueError(f"{where}{path} is not a valid JSON schema: "
                         f"{e.message.splitlines()[0]}") from None


def _functions(tools) -> dict[str, dict]:
    """name -> the function's parameter schema (a function without parameters takes {})."""
    out = {}
    for t in tools or []:
        fn = t.get("function", {}) if isinstance(t, dict) else {}
        if isinstance(fn.get("name"), str):
            out[fn["name"]] = fn.get("parameters") or {
                "type": "object", "properties": {}, "additionalProperties": False}
    return out


# --- detection ---------------------------------------------------------------------------------

@dataclass
class ToolFormat:
    """How a model writes tool calls. ``markers`` maps each of the format's marker strings
    that is one token of the model's vocabulary (and so each thinking marker that is) to that
    token's id, so that a constraint can ask for the token itself rather than its spelling."""
    name: str
    markers: dict[str, int] = field(default_factory=dict)
    variant: str = ""       # deepseek: "r1" (function<sep>NAME ```json) or "v3.1" (NAME<sep>{})
    builtin: bool = False   # llama3: the template knows Llama 3.1's built-in tools


_MARKERS = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "llama3": ("<|python_tag|>",),
    "mistral": ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
    "functionary": ("<function=",),
    "generic": ("<tool_call>", "</tool_call>"),
    "deepseek": ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                 "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"),
    "qwen3_coder": ("<tool_call>", "</tool_call>"),
    "harmony": ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>",
                "<|call|>", "<|return|>"),
}

# DeepSeek's tool tokens (fullwidth bars, U+2581 for the spaces)
_DS_CALLS, _DS_CALL = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"
_DS_SEP, _DS_END, _DS_CALLS_END = "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"


def detect_format(template_src: str | None, tok) -> ToolFormat:
    """The tool-call format of a chat template (its source text), "generic" when it has none
    or knows no tools (the templates module then writes the generic prompt)."""
    src = template_src or ""
    if "tools" not in src:
        name = "generic"
    elif "<|channel|>" in src and "to=" in src and "functions." in src:
        name = "harmony"            # gpt-oss
    elif _DS_CALLS in src:
        name = "deepseek"
    elif "<function=" in src and "<parameter=" in src:
        name = "qwen3_coder"
    elif "<tool_call>" in src:
        name = "hermes"
    elif "[TOOL_CALLS]" in src:
        name = "mistral"
    elif "<function=" in src:
        name = "functionary"
    elif "<|python_tag|>" in src or ("<|start_header_id|>" in src and '"parameters"' in src):
        name = "llama3"
    else:
        name = "generic"
    markers = {}
    if tok is not None:
        for m in _MARKERS[name] + tuple(x for pair in _REASONING_MARKERS for x in pair[:2]):
            tid = tok.token_id(m)
            if tid is not None:
                markers[m] = tid
    variant = ""
    if name == "deepseek":
        variant = "r1" if "```json" in src else "v3.1"
    return ToolFormat(name, markers, variant, builtin=name == "llama3" and "builtin_tools" in src)


@dataclass
class Reasoning:
    """Thinking markers; ``starts_open``: the generation prompt ends inside an open block;
    ``harmony``: gpt-oss's channels (the analysis channel is the reasoning, the final channel
    the answer), read by the parser's harmony mode rather than as a marked block."""
    open: str
    close: str
    starts_open: bool = False
    harmony: bool = False

    @property
    def close_text(self) -> str:
        """What ends the reasoning when the server closes it (the thinking budget): the close
        marker, and for harmony the header of the final channel's message."""
        if self.harmony:
            return _HARMONY_CLOSE
        return "\n" + self.close + "\n\n"


_HARMONY_OPEN = "<|channel|>analysis<|message|>"
_HARMONY_CLOSE = "<|end|><|start|>assistant<|channel|>final<|message|>"


_REASONING_MARKERS = (("<think>", "</think>"), ("<seed:think>", "</seed:think>"),
                      ("[THINK]", "[/THINK]"))


def detect_reasoning(template_src: str | None, prompt_text: str) -> Reasoning | None:
    """The template's thinking markers, if it has any; ``starts_open`` when the rendered
    prompt ends with the opening marker (DeepSeek-R1's ``<｜Assistant｜><think>\\n``)."""
    if not template_src:
        return None
    if "<|channel|>analysis<|message|>" in template_src:
        return Reasoning(_HARMONY_OPEN, "<|end|>", False, harmony=True)
    for op, cl in _REASONING_MARKERS:
        if op in template_src and cl in template_src:
            return Reasoning(op, cl, prompt_text.rstrip().endswith(op))
    return None


# --- parsing -----------------------------------------------------------------------------------

def _json_scan(s: str, k: int, stack: list, in_str: bool, esc: bool):
    """Scan ``s`` from ``k`` in the state (open brackets, inside a string, after a backslash);
    returns (end, k, stack, in_str, esc): end is the index after the value, -1 when the
    brackets cannot match, None while it is incomplete (then the state to resume from)."""
    n = len(s)
    while k < n:
        ch = s[k]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            else:       # jump over plain string characters
                j = k + 1
                while j < n and s[j] not in '"\\':
                    j += 1
                k = j
                continue
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]":
            if not stack or stack.pop() != ch:
                return -1, k, stack, in_str, esc
            if not stack:
                return k + 1, k + 1, stack, in_str, esc
        elif not stack:
            return -1, k, stack, in_str, esc
        k += 1
    return None, k, stack, in_str, esc


def _json_end(s: str, i: int, memo: dict | None = None) -> int | None:
    """Where the JSON object or array starting at ``s[i]`` ends (index after it); None while
    it is incomplete; -1 when the brackets cannot match. With ``memo`` (kept by a parser
    whose buffer grows at its end) a scan resumes where the last one stopped."""
    state = memo.get(i) if memo is not None else None
    if state is not None and s.startswith(state[0]):
        k, stack, in_str, esc = len(state[0]), list(state[1]), state[2], state[3]
    else:
        k, stack, in_str, esc = i, [], False, False
    end, k, stack, in_str, esc = _json_scan(s, k, stack, in_str, esc)
    if end is None and memo is not None:
        memo.clear()
        memo[i] = (s[:k], stack, in_str, esc)
    return end


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


def _args_object(v):
    """Arguments as given by a model: an object, or JSON text of one; None if neither."""
    if isinstance(v, str):
        try:
            v = json.loads(v) if v.strip() else {}
        except json.JSONDecodeError:
            return None
    return v if isinstance(v, dict) else None


def _call_of(obj, arg_keys=("arguments", "parameters")):
    """(name, args) from {"name": ..., "arguments"|"parameters": {...}}; None if not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if obj.get("type") not in (None, "function"):
        return None
    if isinstance(obj.get("function"), dict):           # {"type": "function", "function": {}}
        return _call_of(obj["function"], arg_keys)
    for k in arg_keys:
        if k in obj:
            args = _args_object(obj[k])
            return None if args is None else (obj["name"], args)
    return obj["name"], {}


# --- streamed arguments ------------------------------------------------------------------------

_WS = " \t\r\n"
_ESCAPES = '"\\/bfnrtu'
_NUM_RE = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_LITERALS = ("true", "false", "null")


class _ArgsStream:
    """Reads one JSON object (a call's arguments) as it streams in, checking its syntax, and
    gives back its text without the white space outside strings, in pieces that are each
    safe to send: what has been given back can always be closed into valid JSON. Text that
    cannot be closed yet (a key and its colon, a comma, a number or literal being written,
    an escape) is held until the value after it begins.

    ``feed(s)`` -> (piece, used): ``used`` is how much of ``s`` was read (less than all once
    the object has closed, or at a syntax error: then ``error`` is set). ``heal()`` -> the
    text that closes what was given back (the open string and brackets), for a call cut off
    by the token limit or broken off by a syntax error."""

    def __init__(self):
        self.stack: list[str] = []      # closing brackets of the open objects/arrays
        self.state = "value"
        self.done = False
        self.error = False
        self._held = ""                 # read but not yet safe to give back
        self._tok = ""                  # the number or literal being read
        self._closer = ""               # what closes the text given back so far
        self._hex = 0                   # hex digits still expected in a \\u escape

    def _safe(self, out: list, in_str: bool) -> None:
        out.append(self._held)
        self._held = ""
        self._closer = ('"' if in_str else "") + "".join(reversed(self.stack))

    def heal(self) -> str:
        if self.done:
            return ""
        if (self.state == "num" and _NUM_RE.fullmatch(self._tok)) or \
                (self.state == "lit" and self._tok in _LITERALS):
            return self._held + self._tok + "".join(reversed(self.stack))
        return self._closer

    def feed(self, s: str) -> tuple[str, int]:
        out: list[str] = []
        i, n = 0, len(s)
        while i < n and not self.done and not self.error:
            ch = s[i]
            st = self.state
            if st in ("str", "key"):
                if self._hex:           # the four digits of a \\u escape
                    if ch not in "0123456789abcdefABCDEF":
                        self.error = True
                        break
                    self._held += ch
                    self._hex -= 1
                    i += 1
                elif ch == "\\":
                    if i + 1 >= n:
                        break           # the escape letter is still to come
                    e = s[i + 1]
                    if e not in _ESCAPES:
                        self.error = True
                        break
                    self._held += ch + e
                    self._hex = 4 if e == "u" else 0
                    i += 2
                elif ch == '"':
                    self._held += ch
                    i += 1
                    if st == "key":
                        self.state = "colon"
                    else:
                        self.state = "after"
                        self._safe(out, False)
                    continue
                elif ord(ch) < 0x20:
                    self.error = True
                    break
                else:                   # plain characters: take the run at once
                    j = i + 1
                    while j < n and s[j] not in '"\\' and ord(s[j]) >= 0x20:
                        j += 1
                    self._held += s[i:j]
                    i = j
                if st == "str" and not self._hex:
                    self._safe(out, True)
                continue
            if st in ("num", "lit"):
                if (st == "num" and ch in "0123456789+-.eE") or (st == "lit" and ch.isalpha()):
                    self._tok += ch
                    i += 1
                    if st == "lit" and not any(w.startswith(self._tok) for w in _LITERALS):
                        self.error = True
                    continue
                if (st == "num" and not _NUM_RE.fullmatch(self._tok)) or \
                        (st == "lit" and self._tok not in _LITERALS):
                    self.error = True
                    break
                self._held += self._tok
                self._tok = ""
                self.state = "after"
                self._safe(out, False)
                continue            # the character that ended it is read in "after"
            if ch in _WS:
                i += 1
                continue
            i += 1
            if st == "value" or st == "first_item":
                if st == "first_item" and ch == "]":
                    self._close(ch, out)
                elif ch in "{[":
                    if not self.stack and ch != "{":
                        self.error = True
                        i -= 1
                        break
                    self.stack.append("}" if ch == "{" else "]")
                    self._held += ch
                    self.state = "first_key" if ch == "{" else "first_item"
                    self._safe(out, False)
                elif not self.stack:
                    self.error = True       # arguments are an object
                    i -= 1
                elif ch == '"':
                    self._held += ch
                    self.state = "str"
                    self._safe(out, True)
                elif ch in "-0123456789":
                    self._tok, self.state = ch, "num"
                elif ch in "tfn":
                    self._tok, self.state = ch, "lit"
                else:
                    self.error = True
                    i -= 1
            elif st in ("first_key", "key_next"):
                if st == "first_key" and ch == "}":
                    self._close(ch, out)
                elif ch == '"':
                    self._held += ch
                    self.state = "key"
                else:
                    self.error = True
                    i -= 1
            elif st == "colon":
                if ch == ":":
                    self._held += ch
                    self.state = "value"
                else:
                    self.error = True
                    i -= 1
            elif st == "after":
                if ch == ",":
                    self._held += ch
                    self.state = "key_next" if self.stack[-1] == "}" else "value"
                elif ch in "}]" and ch == self.stack[-1]:
                    self._close(ch, out)
                else:
                    self.error = True
                    i -= 1
        return "".join(out), i

    def _close(self, ch: str, out: list) -> None:
        self.stack.pop()
        self._held += ch
        self.state = "after"
        self._safe(out, False)
        if not self.stack:
            self.done = True


_NEED = "need"      # a recogniser needs more text
_BAD = "bad"        # the text at the marker is not a call


class OutputParser:
    """Incremental splitter of generated text into content, reasoning and tool calls.

    ``push(text)`` and ``finish()`` return events, in order: ("content", s), ("reasoning", s),
    ("tool_call", index, id, name), ("tool_args", index, json_text). ``tool_calls`` holds the
    calls in OpenAI's shape; ``content`` and ``reasoning_text`` the whole texts so far."""

    def __init__(self, fmt: ToolFormat | None, reasoning: Reasoning | None, tools: list | None):
        self.fmt = fmt
        self.reasoning = reasoning
        self._fns = _functions(tools)
        self._tools = tools
        self._check_names = tools is not None
        self.tool_calls: list[dict] = []
        self.content = ""
        self.reasoning_text = ""
        self._buf = ""
        self._events: list[tuple] = []
        name = fmt.name if fmt else None
        self._json_first = name in ("llama3", "generic")     # a call may be the whole answer
        self._triggers = {
            "hermes": ("<tool_call>",), "generic": ("<tool_call>",),
            "llama3": ("<|python_tag|>",), "mistral": ("[TOOL_CALLS]",),
            "functionary": ("<function=",), "deepseek": (_DS_CALLS, _DS_CALL),
            "qwen3_coder": ("<tool_call>", "<function="), "harmony": (), None: (),
        }[name]
        if name == "generic":       # DeepSeek models write their own tokens whatever told
            self._triggers += (_DS_CALLS, _DS_CALL)
        if name == "harmony" or (reasoning is not None and reasoning.harmony):
            self._mode = "h_head"
        elif reasoning is None:
            self._mode = "start"
        elif reasoning.starts_open:
            self._mode = "reasoning"
        else:
            self._mode = "think?"
        self._lstrip = True         # drop white space at the start of a section
        self._memo: dict = {}       # where the last JSON scan of the buffer stopped
        self._heads = _FORMAT_HEADS.get(name, ((), ()))
        self._args: _ArgsStream | None = None    # the arguments being streamed
        self._outer = ""            # brackets still open around them (innermost last)
        self._tags: list[str] = []  # the closing tags expected after the call ("?": may miss)
        self._after = "content"     # the mode after the call

    # public
    def push(self, text: str) -> list[tuple]:
        self._buf += text
        return self._run(False)

    def finish(self) -> list[tuple]:
        return self._run(True)

    # events
    def _emit(self, kind: str, s: str) -> None:
        if not s:
            return
        if kind == "content":
            self.content += s
        else:
            self.reasoning_text += s
        if self._events and self._events[-1][0] == kind:
            self._events[-1] = (kind, self._events[-1][1] + s)
        else:
            self._events.append((kind, s))

    def _add_calls(self, calls: list[tuple[str, dict]]) -> bool:
        if not calls or (self._check_names and any(n not in self._fns for n, _ in calls)):
            return False
        for name, args in calls:
            self._announce(name)
            self._arg_piece(json.dumps(args, ensure_ascii=False, separators=(",", ":")))
        return True

    def _announce(self, name: str) -> None:
        """A new call: its entry in ``tool_calls`` (arguments to come) and its event."""
        idx, cid = len(self.tool_calls), new_call_id()
        self.tool_calls.append({"id": cid, "type": "function",
                                "function": {"name": name, "arguments": ""}})
        self._events.append(("tool_call", idx, cid, name))

    def _commit(self, head: str, name: str, buf: str, j: int, outer: str | None = None) -> bool:
        """Announce a call whose arguments start at ``buf[j]`` and stream them from there;
        False (nothing announced) when the request has no tool of that name."""
        if self._check_names and name not in self._fns:
            return False
        _, brackets, tags = _HEADS[head]
        self._announce(name)
        self._outer = brackets if outer is None else outer
        self._tags = list(tags)
        self._after = "after_json" if head in ("object", "python_tag", "wrapped_list",
                                               "wrapped_one") else "content"
        if head.startswith("xml"):     # Qwen3-Coder: <parameter=k>value</parameter>...
            self._xml_params = 0
            self._arg_piece("{")
            self._buf, self._mode = buf[j:], "xml"
        else:
            self._args = _ArgsStream()
            self._buf, self._mode = buf[j:], "args"
        return True

    def _arg_piece(self, text: str) -> None:
        if not text:
            return
        idx = len(self.tool_calls) - 1
        self.tool_calls[idx]["function"]["arguments"] += text
        last = self._events[-1] if self._events else None
        if last is not None and last[0] == "tool_args" and last[1] == idx:
            self._events[-1] = ("tool_args", idx, last[2] + text)
        else:
            self._events.append(("tool_args", idx, text))

    # the state machine
    def _run(self, final: bool) -> list[tuple]:
        while self._step(final):
            pass
        out, self._events = self._events, []
        return out

    def _strip_start(self, final: bool) -> bool:
        """Drop leading white space of a section; False while only white space is buffered."""
        if self._lstrip:
            self._buf = self._buf.lstrip(" \t\r\n")
            if not self._buf:
                return False
            self._lstrip = False
        return True

    def _step(self, final: bool) -> bool:
        """Consume what can be decided now; True if it should be called again."""
        buf, mode = self._buf, self._mode
        if mode == "think?":
            op = self.reasoning.open
            s = buf.lstrip(" \t\r\n")
            if s.startswith(op):
                self._buf, self._mode, self._lstrip = s[len(op):], "reasoning", True
                return True
            if op.startswith(s) and not final:
                return False
            self._mode = "start"
            return True
        if mode == "reasoning":
            if not self._strip_start(final):
                return False
            cl = self.reasoning.close
            k = self._buf.find(cl)
            if k >= 0:
                self._emit("reasoning", self._buf[:k].rstrip(" \t\r\n"))
                self._buf, self._mode, self._lstrip = self._buf[k + len(cl):], "start", True
                return True
            if final:
                self._emit("reasoning", self._buf.rstrip(" \t\r\n"))
                self._buf = ""
                return False
            # hold back a possible start of the close marker and the white space before it
            # (reasoning text is trimmed at its end)
            keep = _partial_suffix(self._buf, (cl,))
            head = self._buf[:len(self._buf) - keep]
            keep += len(head) - len(head.rstrip(" \t\r\n"))
            self._emit("reasoning", self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        if mode == "start":
            if not self._strip_start(final):
                return False
            if self._buf[0] == "{" and self._heads[1]:
                self._mode = "head_json"
            elif self._json_first and self._buf[0] == "[":
                self._mode = "json"
            else:
                self._mode = "content"
            return True
        if mode == "head_json":     # an answer that starts with "{": is it a call's head?
            r = _match_heads(self._heads[1], self._buf)
            if r is _NEED and not final:
                return False
            if r not in (_NEED, None) and self._commit(r[0], r[1], self._buf, r[2]):
                return True
            # not a streamable call: the JSON-first formats read it whole, others as text
            self._mode = "json" if self._json_first else "content"
            return True
        if mode == "args":
            a = self._args
            piece, used = a.feed(self._buf)
            self._arg_piece(piece)
            self._buf = self._buf[used:]
            if a.done:
                self._mode = "rest"
                return True
            if a.error or final:
                # a syntax error or the end of the output inside the arguments: the call was
                # announced, so it stays, its arguments closed where they were cut; what
                # follows a syntax error is content
                self._arg_piece(a.heal())
                if final:
                    self._buf = ""
                self._mode, self._lstrip = "content", False
                return True
            return False
        if mode == "rest":
            return self._rest(final)
        if mode == "xml":
            return self._xml(final)
        if mode in ("h_head", "h_body"):
            return self._harmony(final)
        if mode == "json":
            end = _json_end(self._buf, 0, self._memo)
            if end is None and not final:
                return False
            if end is not None and end > 0:
                calls = self._json_calls(self._buf[:end])
                if calls is not None and self._add_calls(calls):
                    self._buf, self._lstrip = self._buf[end:], True
                    self._mode = "after_json"
                    return True
            self._mode = "content"
            return True
        if mode == "after_json":   # llama3: more calls may follow, separated by ";"
            if not self._strip_start(final):
                return False
            if self._buf[0] == ";":
                self._buf, self._lstrip = self._buf[1:], True
                self._mode = "after_json_sep"
                return True
            self._mode = "content"
            return True
        if mode == "after_json_sep":
            if not self._strip_start(final):
                return False
            self._mode = "head_json" if self._buf[0] == "{" else "content"
            if self._mode == "content":
                self._buf = ";" + self._buf
            return True
        if mode == "content":
            if self._lstrip and self.tool_calls:     # white space between calls is not content
                if not self._strip_start(final):
                    return False
            self._lstrip = False
            pos, trig = _find_first(self._buf, self._triggers)
            if pos >= 0:
                self._emit("content", self._buf[:pos])
                self._buf, self._mode = self._buf[pos:], "call"
                return True
            keep = 0 if final else _partial_suffix(self._buf, self._triggers)
            self._emit("content", self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        if mode == "call":
            h = _match_heads(self._heads[0], self._buf)
            if h is _NEED and not final:
                return False
            if h not in (_NEED, None) and self._commit(h[0], h[1], self._buf, h[2]):
                return True
            r = self._recognise(self._buf, final)
            if r == _NEED:
                if final:
                    r = _BAD
                else:
                    return False
            if r != _BAD:
                calls, used = r
                if self._add_calls(calls):
                    self._buf, self._mode, self._lstrip = self._buf[used:], "content", True
                    return True
            # not a call: the marker is content, and scanning goes on after it
            _, trig = _find_first(self._buf, self._triggers)
            self._emit("content", self._buf[:len(trig)])
            self._buf, self._mode = self._buf[len(trig):], "content"
            return True
        raise AssertionError(mode)

    def _rest(self, final: bool) -> bool:
        """After a streamed call's arguments: the rest of the JSON around them (more keys of
        the call object, more calls of a list), then the closing tag. Anything else there
        ends the call's structure and is content."""
        b = self._buf.lstrip(" \t\r\n")
        self._buf = b
        if not b and not final:
            return False
        if not self._outer:
            while self._tags:
                t = self._tags[0]
                r = _expect(self._buf, 0, t.lstrip("?"), final)
                if r is _NEED:
                    return False
                if r is None and not t.startswith("?"):
                    break
                self._tags.pop(0)
                if r is not None:
                    self._buf = self._buf[r:]
            self._mode, self._lstrip = self._after, True
            return True
        if not b:
            self._mode = "content"
            return True
        top = self._outer[-1]
        if b[0] == top:
            self._outer = self._outer[:-1]
            self._buf = b[1:]
            return True
        if b[0] == "," and top == "}":      # other keys of the object ("id": ...)
            end = _json_scan(b, 1, ["}"], False, False)[0]
            if end is None and not final:
                return False
            if end is not None and end > 0:
                self._outer = self._outer[:-1]
                self._buf = b[end:]
                return True
        elif b[0] == "," and top == "]":    # the next call of a list
            j = _skip_ws(b, 1)
            if j >= len(b) and not final:
                return False
            if j < len(b) and b[j] == "{":
                r = _match_head(_OBJ, b, j)
                if r is _NEED and not final:
                    return False
                tags, after = self._tags, self._after   # those of the list
                if r not in (_NEED, None) and self._commit(
                        "object", r[0], b, r[1], outer=self._outer + "}"):
                    self._tags, self._after = tags, after
                    return True
                end = _json_end(b, j)
                if end is None and not final:
                    return False
                if end is not None and end > 0:
                    calls = self._json_calls(b[j:end])
                    if calls is not None and self._add_calls(calls):
                        self._buf = b[end:]
                        return True
        self._mode, self._lstrip = "content", False
        return True

    def _xml(self, final: bool) -> bool:
        """Qwen3-Coder's parameters, each sent as one piece of the arguments once it is
        complete: ``<parameter=k>\nvalue\n</parameter>``, up to ``</function>``. A value is
        text for a string parameter, else JSON when it parses (text when not)."""
        b = self._buf.lstrip(" \t\r\n")
        if b.startswith("<parameter="):
            k = b.find(">")
            e = b.find("</parameter>", k) if k >= 0 else -1
            if e < 0 and not final:
                return False
            if k >= 0:
                key = b[len("<parameter="):k]
                raw = b[k + 1:e] if e >= 0 else b[k + 1:]
                if raw.startswith("\n"):
                    raw = raw[1:]
                if raw.endswith("\n"):
                    raw = raw[:-1]
                self._arg_piece(("," if self._xml_params else "") + json.dumps(key) + ":"
                                + self._xml_value(key, raw))
                self._xml_params += 1
            self._buf = b[e + len("</parameter>"):] if e >= 0 else ""
            return True
        if not final and (not b or any(t.startswith(b) for t in ("<parameter=", "</function>"))):
            self._buf = b
            return False
        self._arg_piece("}")
        if b.startswith("</function>"):
            self._tags.pop(0)
            b = b[len("</function>"):]
        self._buf, self._mode = b, "rest"
        return True

    def _xml_value(self, key: str, raw: str) -> str:
        fn = self._fns.get(self.tool_calls[-1]["function"]["name"]) or {}
        prop = (fn.get("properties") or {}).get(key)
        types = prop.get("type") if isinstance(prop, dict) else None
        types = types if isinstance(types, list) else [types]
        if "string" not in types:
            try:
                return json.dumps(json.loads(raw), ensure_ascii=False, separators=(",", ":"))
            except json.JSONDecodeError:
                pass
        return json.dumps(raw, ensure_ascii=False)

    def _harmony(self, final: bool) -> bool:
        """gpt-oss's harmony messages: ``<|start|>assistant`` (absent for the first, which the
        prompt opened), a header with ``<|channel|>NAME`` and, for a call,
        ``to=functions.NAME``, then ``<|message|>`` and the body up to ``<|end|>``,
        ``<|call|>`` or ``<|return|>`` (those end the output, so they are often absent). The
        analysis channel is reasoning, final and commentary without a recipient content, a
        call's body its arguments."""
        b = self._buf
        if self._mode == "h_head":
            if not b:
                return False
            k = b.find("<|message|>")
            if k < 0:
                if not final and len(b) < 256 and (b.startswith("<|") or "<|".startswith(b)):
                    return False
                self._mode, self._lstrip = "content", False     # not harmony: plain text
                return True
            head = b[:k]
            if head.startswith("<|start|>"):
                head = head[len("<|start|>"):]
            rest = b[k + len("<|message|>"):]
            m = re.search(r"to=functions\.([A-Za-z0-9_.-]{1,64})", head)
            if m and self.fmt is not None and self._commit_harmony(m.group(1), rest):
                return True
            ch = re.search(r"<\|channel\|>(\w+)", head)
            self._h_kind = "reasoning" if ch and ch.group(1) == "analysis" and \
                self.reasoning is not None else "content"
            self._buf, self._mode = rest, "h_body"
            return True
        ends = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
        pos, trig = _find_first(b, ends)
        if pos >= 0:
            self._emit(self._h_kind, b[:pos])
            self._buf = b[pos + (0 if trig == "<|start|>" else len(trig)):]
            self._mode = "h_head"
            return True
        keep = 0 if final else _partial_suffix(b, ends)
        self._emit(self._h_kind, b[:len(b) - keep])
        self._buf = b[len(b) - keep:]
        return False

    def _commit_harmony(self, name: str, rest: str) -> bool:
        if self._check_names and name not in self._fns:
            return False
        self._announce(name)
        self._outer, self._tags, self._after = "", ["?<|call|>", "?<|end|>"], "h_head"
        self._args = _ArgsStream()
        self._buf, self._mode = rest.lstrip(" \t\r\n"), "args"
        return True

    def _json_calls(self, text: str):
        """A JSON answer read as calls [(name, args)], or None: a call object or a list of
        them; for "generic" also {"tool_calls": [...]} and {"tool_call": {...}}."""
        try:
            v = json.loads(text)
        except json.JSONDecodeError:
            return None
        if self.fmt.name == "generic" and isinstance(v, dict):
            if "tool_calls" in v:
                v = v["tool_calls"] if isinstance(v["tool_calls"], list) else None
            elif "tool_call" in v:
                v = v["tool_call"]
        items = v if isinstance(v, list) else [v]
        calls = [_call_of(c) for c in items]
        return calls if calls and None not in calls else None

    def _code_tool(self) -> str | None:
        """The request's code interpreter when the template knows Llama's built-ins: the
        built-in code_interpreter, else a tool named "python" with a string "code" (what
        llama.cpp reads code after the tag as)."""
        if not self.fmt.builtin:
            return None
        if "code_interpreter" in builtin_tools(self._tools):
            return "code_interpreter"
        props = (self._fns.get("python") or {}).get("properties") or {}
        if isinstance(props.get("code"), dict) and props["code"].get("type") == "string":
            return "python"
        return None

    def _recognise(self, buf: str, final: bool):
        """At a trigger marker: (calls, characters used), _NEED or _BAD."""
        name = self.fmt.name
        if name in ("hermes", "generic"):
            return _tagged_json(buf, "<tool_call>", "</tool_call>", final, self._memo)
        if name == "functionary":
            return _function_tag(buf, final, self._memo)
        if name == "mistral":
            return _mistral(buf, final, self._memo)
        if name == "llama3":
            i = _skip_ws(buf, len("<|python_tag|>"))
            if i >= len(buf):
                return _NEED
            if buf[i] not in "{[":
                r = _dot_call(buf, i)
                code = self._code_tool()
                # (a name.call( already read that is cut off is not code)
                if code is not None and (r is _BAD or (r is _NEED and final and
                                                       not _DOT_CALL.match(buf, i))):
                    # Llama 3.1's code interpreter: the code itself, up to the end (<|eom_id|>)
                    if not final:
                        return _NEED
                    return [(code, {"code": buf[i:].rstrip()})], len(buf)
                return r
            end = _json_end(buf, i, self._memo)
            if end is None:
                return _NEED
            if end < 0:
                return _BAD
            calls = self._json_calls(buf[i:end])
            if calls is None:
                return _BAD
            out, used = list(calls), end
            while True:         # more calls separated by ";"
                j = _skip_ws(buf, used)
                if j < len(buf) and buf[j] == ";":
                    k = _skip_ws(buf, j + 1)
                    if k >= len(buf):
                        if not final:
                            return _NEED
                        return out, j + 1
                    if buf[k] != "{":
                        return out, used
                    e = _json_end(buf, k, self._memo)
                    if e is None:
                        return _NEED if not final else (out, used)
                    more = self._json_calls(buf[k:e]) if e > 0 else None
                    if more is None:
                        return out, used
                    out += more
                    used = e
                    continue
                if j >= len(buf) and not final:
                    return _NEED
                return out, used
        return _BAD


def _find_first(buf: str, triggers) -> tuple[int, str]:
    best, trig = -1, ""
    for t in triggers:
        k = buf.find(t)
        if k >= 0 and (best < 0 or k < best or (k == best and len(t) > len(trig))):
            best, trig = k, t
    return best, trig


def _partial_suffix(buf: str, markers) -> int:
    """Length of the longest end of ``buf`` that is a proper beginning of a marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:n]):
                best = n
                break
    return best


def _expect(buf: str, i: int, lit: str, final: bool):
    """After white space at ``i``: index after ``lit``; _NEED if it may still come; None if
    something else is there (or the text ended)."""
    j = _skip_ws(buf, i)
    rest = buf[j:j + len(lit)]
    if rest == lit:
        return j + len(lit)
    if lit.startswith(rest) and not final:
        return _NEED
    return None


def _tagged_json(buf: str, open_tag: str, close_tag: str, final: bool, memo=None):
    """<tool_call> {"name", "arguments"} or [{...}, ...] </tool_call> (the close may be
    missing at the end of the output)."""
    i = _skip_ws(buf, len(open_tag))
    if i >= len(buf):
        return _NEED
    if buf[i] not in "{[":
        return _BAD
    end = _json_end(buf, i, memo)
    if end is None:
        return _NEED
    if end < 0:
        return _BAD
    try:
        v = json.loads(buf[i:end])
    except json.JSONDecodeError:
        return _BAD
    calls = [_call_of(c) for c in (v if isinstance(v, list) else [v])]
    if not calls or None in calls:
        return _BAD
    after = _expect(buf, end, close_tag, final)
    if after is _NEED:
        return _NEED
    return calls, (after if after is not None else end)


_FN_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


# The beginnings of calls whose arguments can be streamed: the name comes before the argument
# object. Items: a literal, None (optional white space), ("name",) a JSON string holding the
# function's name, ("raw",) a bare name, ("alt", ...) one of literals, ("callid",) Mistral's
# optional [CALL_ID]id, ("dsname",) DeepSeek's "function<sep>NAME" (R1) or "NAME<sep>" (V3.1),
# ("fence",) an optional ```json fence, ("args",) the "{" that opens the arguments (not
# consumed; a head without it ends after its last item: Qwen3-Coder's XML parameters).
# The closing tags after a call are a tuple; "?" marks one that may be missing.
_OBJ = ("{", None, '"name"', None, ":", None, ("name",), None, ",", None,
        ("alt", '"arguments"', '"parameters"'), None, ":", ("args",))
# head -> (items, closing brackets still open around the arguments, closing tag after them)
_DS_TAGS = ("?```", _DS_END, "?" + _DS_CALLS_END)
_HEADS = {
    "tagged": (("<tool_call>", None) + _OBJ, "}", ("?</tool_call>",)),
    "python_tag": (("<|python_tag|>", None) + _OBJ, "}", ()),
    "mistral_list": (("[TOOL_CALLS]", None, "[", None) + _OBJ, "]}", ()),
    "mistral_args": (("[TOOL_CALLS]", None, ("raw",), ("callid",), "[ARGS]", ("args",)), "", ()),
    "functionary": (("<function=", ("raw",), ">", ("args",)), "", ("?</function>",)),
    "object": (_OBJ, "}", ()),
    "wrapped_list": (("{", None, '"tool_calls"', None, ":", None, "[", None) + _OBJ, "}]}", ()),
    "wrapped_one": (("{", None, '"tool_call"', None, ":", None) + _OBJ, "}}", ()),
    "deepseek": ((_DS_CALLS, None, _DS_CALL, ("dsname",), None, ("fence",), ("args",)), "",
                 _DS_TAGS),
    "deepseek_next": ((_DS_CALL, ("dsname",), None, ("fence",), ("args",)), "", _DS_TAGS),
    "xml_tagged": (("<tool_call>", None, "<function=", ("raw",), ">"), "",
                   ("?</function>", "?</tool_call>")),
    "xml": (("<function=", ("raw",), ">"), "", ("?</function>",)),
}
_DS_HEADS = ("deepseek", "deepseek_next")
# format -> (heads at its trigger marker, in order of preference; heads of an answer that
# starts with "{")
_FORMAT_HEADS = {
    "hermes": (("tagged",), ("object",)),
    "generic": (("tagged",) + _DS_HEADS, ("wrapped_list", "wrapped_one", "object")),
    "llama3": (("python_tag",), ("object",)),
    "mistral": (("mistral_list", "mistral_args"), ("object",)),
    "functionary": (("functionary",), ("object",)),
    "deepseek": (_DS_HEADS, ("object",)),
    "qwen3_coder": (("tagged", "functionary", "xml_tagged", "xml"), ("object",)),
    "harmony": ((), ()),
}


def _match_head(items, buf: str, i: int):
    """(name, index of the arguments' "{") when ``buf[i:]`` begins with the head; _NEED
    while it may still; None when it does not."""
    name = None
    for it in items:
        if it is None:
            i = _skip_ws(buf, i)
        elif isinstance(it, str) or it[0] == "alt":
            alts = (it,) if isinstance(it, str) else it[1:]
            for a in alts:
                if buf.startswith(a, i):
                    i += len(a)
                    break
            else:
                rest = buf[i:]
                return _NEED if any(a.startswith(rest) for a in alts) else None
        elif it[0] in ("name", "raw"):
            q = it[0] == "name"
            if q:
                if i >= len(buf):
                    return _NEED
                if buf[i] != '"':
                    return None
            m = _FN_NAME.match(buf, i + q)
            if not m:
                return _NEED if i + q >= len(buf) else None
            k = m.end()
            if k >= len(buf):
                return _NEED if len(m.group()) < 64 else None
            if q:
                if buf[k] != '"':
                    return None
                k += 1
            name, i = m.group(), k
        elif it[0] == "dsname":
            m = _FN_NAME.match(buf, i)
            if not m:
                return _NEED if i >= len(buf) else None
            k = m.end()
            rest = buf[k:k + len(_DS_SEP)]
            if rest != _DS_SEP:
                return _NEED if _DS_SEP.startswith(rest) and len(m.group()) < 64 else None
            k += len(_DS_SEP)
            name, i = m.group(), k
            if name == "function":      # R1: the type, then the name after the separator
                if k >= len(buf):
                    return _NEED
                m = _FN_NAME.match(buf, k)
                if m:
                    if m.end() >= len(buf):
                        return _NEED if len(m.group()) < 64 else None
                    name, i = m.group(), m.end()
        elif it[0] == "fence":
            rest = buf[i:i + 7]
            if len(rest) < 7 and "```json".startswith(rest) and i + len(rest) == len(buf):
                return _NEED
            if buf.startswith("```", i):
                i += 3
                if buf.startswith("json", i):
                    i += 4
        elif it[0] == "callid":
            if buf.startswith("[CALL_ID]", i):
                k = buf.find("[ARGS]", i)
                if k < 0:
                    return _NEED if len(buf) - i < 80 else None
                i = k
            elif i < len(buf) and len(buf) - i < 9 and "[CALL_ID]".startswith(buf[i:]):
                return _NEED
        else:       # args
            i = _skip_ws(buf, i)
            if i >= len(buf):
                return _NEED
            return (name, i) if buf[i] == "{" else None
    return name, i


def _match_heads(names, buf: str, i: int = 0):
    """The first of the heads ``names`` (in order: one that may still match is waited for
    before a later one is taken) at ``buf[i]``: (head, name, index), _NEED or None."""
    for h in names:
        r = _match_head(_HEADS[h][0], buf, i)
        if r is _NEED:
            return _NEED
        if r is not None:
            return (h, *r)
    return None


def _args_at(buf: str, j: int, memo=None):
    """The JSON object of a call's arguments starting at ``buf[j]`` (after white space):
    (args, index after it), or _NEED while it is incomplete, _BAD when it is not one."""
    k = _skip_ws(buf, j)
    if k >= len(buf):
        return _NEED
    if buf[k] != "{":
        return _BAD
    end = _json_end(buf, k, memo)
    if end is None:
        return _NEED
    if end < 0:
        return _BAD
    args = _args_object(buf[k:end])
    return (args, end) if args is not None else _BAD


_DOT_CALL = re.compile(r"([A-Za-z0-9_-]{1,64})[ \t]*\.[ \t]*call[ \t]*\(")
# what may still grow into "name.call(" (a name, then part of ".call")
_DOT_CALL_PART = re.compile(r"[A-Za-z0-9_-]{0,64}[ \t]*(?:\.[ \t]*(?:c(?:a(?:l(?:l[ \t]*)?)?)?)?)?")
_ARG_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SCALAR = re.compile(r"[A-Za-z0-9.+-]+")


def _value_end(buf: str, k: int):
    """Where the JSON value at ``buf[k]`` ends: None while incomplete, -1 if it is none."""
    n = len(buf)
    if k >= n:
        return None
    if buf[k] == '"':
        j = k + 1
        while j < n:
            if buf[j] == "\\":
                j += 2
            elif buf[j] == '"':
                return j + 1
            else:
                j += 1
        return None
    if buf[k] in "{[":
        return _json_end(buf, k)
    m = _SCALAR.match(buf, k)
    if not m:
        return -1
    return None if m.end() >= n else m.end()


def _dot_call(buf: str, i: int):
    """Llama 3.1's built-in call at ``buf[i]``: ``name.call(key=value, ...)``, each value JSON
    (its template writes ``query="..."``): ([(name, args)], index after ")"), _NEED or _BAD."""
    m = _DOT_CALL.match(buf, i)
    if not m:
        part = _DOT_CALL_PART.match(buf, i)
        return _NEED if part.end() == len(buf) and len(buf) - i < 80 else _BAD
    name, k, args = m.group(1), m.end(), {}
    while True:
        k = _skip_ws(buf, k)
        if k >= len(buf):
            return _NEED
        if buf[k] == ")":
            return [(name, args)], k + 1
        if args:
            if buf[k] != ",":
                return _BAD
            k = _skip_ws(buf, k + 1)
        km = _ARG_KEY.match(buf, k)
        if not km:
            return _NEED if k >= len(buf) else _BAD
        k = _skip_ws(buf, km.end())
        if k >= len(buf):
            return _NEED
        if buf[k] != "=" or km.group() in args:
            return _BAD
        k = _skip_ws(buf, k + 1)
        end = _value_end(buf, k)
        if end is None:
            return _NEED
        if end < 0:
            return _BAD
        try:
            args[km.group()] = json.loads(buf[k:end])
        except json.JSONDecodeError:
            return _BAD
        k = end


def _function_tag(buf: str, final: bool, memo=None):
    """<function=name>{...}</function>"""
    i = len("<function=")
    m = _FN_NAME.match(buf, i)
    if not m:
        return _NEED if i == len(buf) else _BAD
    j = m.end()
    if j >= len(buf):
        return _NEED if len(m.group()) < 64 else _BAD
    if buf[j] != ">":
        return _BAD
    got = _args_at(buf, j + 1, memo)
    if got is _NEED or got is _BAD:
        return got
    args, end = got
    after = _expect(buf, end, "</function>", final)
    if after is _NEED:
        return _NEED
    return [(m.group(), args)], (after if after is not None else end)


def _mistral(buf: str, final: bool, memo=None):
    """[TOOL_CALLS][{"name", "arguments", "id"?}, ...]  or  [TOOL_CALLS]name[ARGS]{...}
    (newer Mistral tokenizers; [CALL_ID]id may sit before [ARGS])."""
    i = _skip_ws(buf, len("[TOOL_CALLS]"))
    if i >= len(buf):
        return _NEED
    if buf[i] == "[":
        end = _json_end(buf, i, memo)
        if end is None:
            return _NEED
        if end < 0:
            return _BAD
        try:
            v = json.loads(buf[i:end])
        except json.JSONDecodeError:
            return _BAD
        calls = [_call_of(c) for c in v] if isinstance(v, list) else []
        return (calls, end) if calls and None not in calls else _BAD
    m = _FN_NAME.match(buf, i)
    if not m:
        return _BAD
    j = m.end()
    if j >= len(buf):
        return _NEED
    if buf.startswith("[CALL_ID]", j):
        k = buf.find("[ARGS]", j)
        if k < 0:
            return _NEED if len(buf) - j < 64 else _BAD
        j = k
    for lit in ("[ARGS]",):
        if buf.startswith(lit, j):
            j += len(lit)
        elif lit.startswith(buf[j:]) or "[CALL_ID]".startswith(buf[j:]):
            return _NEED
        else:
            return _BAD
    got = _args_at(buf, j, memo)
    if got is _NEED or got is _BAD:
        return got
    args, end = got
    return [(m.group(), args)], end


# --- constraints -------------------------------------------------------------------------------

def _lark_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


# arguments written as json.dumps and the templates' tojson write them: ", " and ": ", no
# other white space (llguidance would otherwise let a model wander through blank lines)
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _json(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_STYLE}, ensure_ascii=False)


def _marker(fmt: ToolFormat, text: str) -> str:
    """A marker in a grammar: its token when it is one token of the vocabulary, else text."""
    tid = fmt.markers.get(text)
    return f"<[{tid}]>" if tid is not None else _lark_str(text)


def tool_call_constraint(fmt: ToolFormat, tools: list[dict], tool_choice, parallel: bool, *,
                         reasoning: Reasoning | None = None) -> dict:
    """An llguidance Lark grammar (``{"type": "lark", "grammar": ...}``) that lets the model
    write only what ``fmt``'s parser reads as a call (one, or one or more when ``parallel``)
    of the allowed tools, with arguments valid for each function's parameter schema.

    ``tool_choice`` is "required" (any tool) or {"type": "function", "function": {"name"}}.
    With ``reasoning``, a thinking block may come first (it must, if the prompt opened it)."""
    fns = _functions(tools)
    if isinstance(tool_choice, dict):
        name = tool_choice.get("function", {}).get("name")
        if name not in fns:
            raise ValueError(f"tool_choice.function.name {name!r} is not one of the tools")
        fns = {name: fns[name]}
    elif tool_choice != "required":
        raise ValueError(f"a call is constrained only for tool_choice \"required\" or a named "
                         f"function, not {tool_choice!r}")
    if not fns:
        raise ValueError("tool_choice asks for a call but no tools are given")
    names = list(fns)
    rules: list[str] = []

    def call_obj(args_key: str, names=names) -> str:
        schema = {"anyOf": [{"type": "object", "properties": {
            "name": {"const": n}, args_key: fns[n]}, "required": ["name", args_key],
            "additionalProperties": False} for n in names]}
        if len(names) == 1:
            schema = schema["anyOf"][0]
        return _json(schema)

    def per_fn(head, tail) -> str:
        alts = []
        for k, n in enumerate(names):
            rules.append(f"fn_{k}: {head(n)} {_json(fns[n])} {tail}".rstrip())
            alts.append(f"fn_{k}")
        return " | ".join(alts)

    many = parallel
    f = fmt.name
    if f == "hermes":
        rules.append(f"body: {call_obj('arguments')}")
        rules.append(f'call: {_marker(fmt, "<tool_call>")} "\\n" body "\\n" '
                     f'{_marker(fmt, "</tool_call>")}')
        calls = 'call ("\\n" call)*' if many else "call"
    elif f == "llama3":
        # Llama 3.1's built-ins as its template tells the model to call them:
        # <|python_tag|>name.call(query="..."); the other tools as {"name", "parameters"}
        builtin = [n for n in builtin_tools(tools) if n in fns] if fmt.builtin else []
        alts = []
        custom = [n for n in names if n not in builtin]
        if custom:
            rules.append(f"obj: {call_obj('parameters', custom)}")
            alts.append("obj")
        for k, n in enumerate(builtin):
            key = BUILTIN_TOOLS[n]
            rules.append(f"bt_{k}: {_marker(fmt, '<|python_tag|>')} "
                         f"{_lark_str(f'{n}.call({key}=')} "
                         f"{_json(fns[n]['properties'][key])} \")\"")
            alts.append(f"bt_{k}")
        rules.append("call: " + " | ".join(alts))
        # a built-in call ends the message (<|eom_id|>): only JSON calls are chained
        calls = 'call (";" call)*' if many and not builtin else "call"
    elif f == "functionary":
        rules.append("call: " + per_fn(lambda n: _lark_str(f"<function={n}>"),
                                       _lark_str("</function>")))
        calls = "call+" if many else "call"
    elif f == "mistral" and "[ARGS]" in fmt.markers:
        # newer Mistral vocabularies (an [ARGS] token): [TOOL_CALLS]name[ARGS]{...} per call
        tc, args = _marker(fmt, "[TOOL_CALLS]"), _marker(fmt, "[ARGS]")
        rules.append("call: " + per_fn(lambda n: f"{tc} {_lark_str(n)} {args}", ""))
        calls = "call+" if many else "call"
    elif f == "mistral":
        rules.append(f"body: {call_obj('arguments')}")
        calls_list = 'body (", " body)*' if many else "body"
        rules.append(f'calls: {_marker(fmt, "[TOOL_CALLS]")} "[" {calls_list} "]"')
        calls = "calls"
    elif f == "deepseek":
        b, sep = _marker(fmt, _DS_CALL), _marker(fmt, _DS_SEP)
        end = _marker(fmt, _DS_END)
        if fmt.variant == "v3.1":
            rules.append("call: " + per_fn(lambda n: f"{b} {_lark_str(n)} {sep}", end))
        else:
            rules.append("call: " + per_fn(
                lambda n: f'{b} "function" {sep} {_lark_str(n + chr(10) + "```json" + chr(10))}',
                f'"\\n```" {end}'))
        one = 'call ("\\n" call)*' if many else "call"
        calls = f"{_marker(fmt, _DS_CALLS)} {one} {_marker(fmt, _DS_CALLS_END)}"
    elif f == "qwen3_coder":
        alts = []
        for k, n in enumerate(names):
            params = []
            schema = fns[n]
            req = set(schema.get("required") or [])
            for j, (key, prop) in enumerate((schema.get("properties") or {}).items()):
                prop = prop if isinstance(prop, dict) else {}
                head = _lark_str(f"<parameter={key}>\n")
                tail = _lark_str("\n</parameter>\n")
                if prop.get("type") == "string" and "enum" not in prop:
                    lo, hi = prop.get("minLength", 0), prop.get("maxLength")
                    body = "(?s:.{%d,%s})" % (lo, "" if hi is None else hi) \
                        if (lo or hi is not None) else "(?s:.*)"
                    # the value is text up to the closing tag (the first one ends it)
                    rules.append(f"v_{k}_{j}[lazy]: /{body}\\n<\\/parameter>\\n/")
                    rules.append(f"p_{k}_{j}: {head} v_{k}_{j}")
                elif prop.get("type") == "string":
                    rules.append(f"p_{k}_{j}: {head} ("
                                 + " | ".join(_lark_str(str(e)) for e in prop["enum"])
                                 + f") {tail}")
                else:
                    rules.append(f"p_{k}_{j}: {head} {_json(prop)} {tail}")
                params.append(f"p_{k}_{j}" + ("" if key in req else "?"))
            rules.append(f"fn_{k}: {_lark_str(f'<function={n}>' + chr(10))} "
                         + " ".join(params) + ' "</function>\\n"')
            alts.append(f"fn_{k}")
        rules.append(f'call: {_marker(fmt, "<tool_call>")} "\\n" ({" | ".join(alts)}) '
                     f'{_marker(fmt, "</tool_call>")}')
        calls = 'call ("\\n" call)*' if many else "call"
    elif f == "harmony":
        # one call per message; <|call|> ends the output
        ch, msg = _marker(fmt, "<|channel|>"), _marker(fmt, "<|message|>")
        con = _marker(fmt, "<|constrain|>")
        rules.append("call: " + per_fn(
            lambda n: f'{ch} {_lark_str(f"commentary to=functions.{n} ")} {con} "json" {msg}',
            ""))
        calls = "call"
        if reasoning is not None:
            st = _marker(fmt, "<|start|>")
            if "<|end|>" in fmt.markers:
                rules.append(f"think_text: /(?s:.*)/ <[{fmt.markers['<|end|>']}]>")
            else:
                rules.append("think_text[lazy]: /(?s:.*)<\\|end\\|>/")
            calls = f'({ch} "analysis" {msg} think_text {st} "assistant")? call'
            reasoning = None
    else:       # generic
        item = {"anyOf": [{"type": "object", "properties": {
            "name": {"const": n}, "arguments": fns[n]}, "required": ["name", "arguments"],
            "additionalProperties": False} for n in names]}
        arr = {"type": "array", "items": item, "minItems": 1}
        if not many:
            arr["maxItems"] = 1
        schema = {"type": "object", "properties": {"tool_calls": arr},
                  "required": ["tool_calls"], "additionalProperties": False}
        rules.append("call: " + _json(schema))
        calls = "call"
    start = calls
    if reasoning is not None:
        # the thinking text ends at the close marker, written as text or as its token
        close = re.escape(reasoning.close).replace("/", "\\/")
        rules.append(f"think_text[lazy]: /(?s:.*){close}/")
        think = "think_text"
        if reasoning.close in fmt.markers:
            rules.append(f"think_tok: /(?s:.*)/ <[{fmt.markers[reasoning.close]}]>")
            think = "(think_text | think_tok)"
        op = _lark_str(reasoning.open)
        if reasoning.open in fmt.markers:
            op = f"(<[{fmt.markers[reasoning.open]}]> | {op})"
        if reasoning.starts_open:
            start = f'{think} /[ \\t\\r\\n]*/ {calls}'
        else:
            start = f'({op} {think} /[ \\t\\r\\n]*/)? {calls}'
    grammar = "%llguidance {}\nstart: " + start + "\n" + "\n".join(rules) + "\n"
    return {"type": "lark", "grammar": grammar}


# --- thinking budget ---------------------------------------------------------------------------

class ThinkingBudget:
    """A thinking budget as a constraint the engine runs like a grammar (``tokenizer``,
    ``matcher()``): the matcher counts the tokens of the reasoning and, once they reach
    ``budget``, has the engine append the reasoning's close text (``Reasoning.close_text``,
    e.g. ``\n</think>\n\n``) as forced tokens, after which the answer goes on as usual. The
    model closing its reasoning itself ends the count. ``inner`` is the call's grammar, if it
    has one (a forced tool call): it masks the tokens, and the close is forced only where it
    allows it. Anthropic's ``thinking.budget_tokens`` and llama-server's
    ``reasoning_budget`` / ``thinking_budget_tokens``."""

    def __init__(self, tokenizer, reasoning: "Reasoning", budget: int, inner=None):
        self.tokenizer = tokenizer
        self.reasoning = reasoning
        self.budget = budget
        self.inner = inner
        self.close_ids = tokenizer.encode(reasoning.close_text, add_special=False,
                                          parse_special=True)

    def matcher(self) -> "_BudgetMatcher":
        return _BudgetMatcher(self, self.inner.matcher() if self.inner is not None else None)

    def __repr__(self) -> str:
        return f"ThinkingBudget({self.budget}, inner={self.inner!r})"


class _BudgetMatcher:
    """The engine's matcher interface (consume, forced, stopped, accepting, error; ``ll`` for
    the mask worker, None when only the budget applies)."""

    def __init__(self, spec: ThinkingBudget, inner):
        self.spec, self.inner = spec, inner
        self.ll = inner.ll if inner is not None else None
        r = spec.reasoning
        # "wait": the output has not shown yet whether it opens a thinking block
        self.state = "think" if r.starts_open else "wait"
        self.n = 0              # reasoning tokens so far
        self.text = ""          # the output's text while it matters (up to the close)

    def consume(self, tokens: list[int]) -> bool:
        if self.inner is not None and not self.inner.consume(tokens):
            return False
        if self.state in ("wait", "think"):
            r, tok = self.spec.reasoning, self.spec.tokenizer
            for t in tokens:
                self.text += tok.token_to_bytes(t).decode("utf-8", "replace")
                if self.state == "wait":
                    s = self.text.lstrip(" \t\r\n")
                    if s.startswith(r.open):
                        self.state, self.text = "think", s[len(r.open):]
                    elif not r.open.startswith(s):
                        self.state = "done"         # an answer without thinking
                        break
                elif r.close in self.text:
                    self.state = "done"             # the model closed it
                    break
                else:
                    self.n += 1
                    self.text = self.text[-len(r.close):]
        return True

    def forced(self) -> list[int]:
        f = self.inner.forced() if self.inner is not None else []
        if f or self.state != "think" or self.n < self.spec.budget:
            return f
        ids = self.spec.close_ids
        if self.inner is not None and self.inner.ll.validate_tokens(ids) < len(ids):
            return []           # the grammar does not allow the close here
        self.state = "done"     # (consume then sees the close tokens while "done")
        return list(ids)

    @property
    def stopped(self) -> bool:
        return self.inner.stopped if self.inner is not None else False

    @property
    def accepting(self) -> bool:
        return self.inner.accepting if self.inner is not None else True

    @property
    def error(self) -> str:
        return self.inner.error if self.inner is not None else ""


__all__ = ["FORMATS", "OutputParser", "Reasoning", "ThinkingBudget", "ToolFormat",
           "detect_format", "detect_reasoning", "new_call_id", "tool_call_constraint",
           "validate_tools"]
