"""Built-in chat templates, for GGUFs without ``tokenizer.chat_template`` or chosen by name.

The names and formats are llama.cpp's (llama-chat.cpp, ``llm_chat_apply_template``): a model
whose file carries no template is formatted with the one its family uses (gemma for gemma*,
llama3 for a vocabulary with ``<|start_header_id|>``, chatml for ``<|im_start|>`` and as the
last resort, ...), and memfit says which. ``--chat-template NAME|FILE`` picks a built-in by name
or reads a jinja template from a file (rendered by chat.render_chat, sandboxed).

apply_template also takes OpenAI tools and tool-call history: see the section on messages,
tools and tool calls below.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from typing import Callable

from ..errors import RequestError


def _trim(s: str) -> str:
    return s.strip(" \t\n\r\f\v")


def _chatml(msgs, add_ass):
    out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)
    return out + ("<|im_start|>assistant\n" if add_ass else "")


def _gemma(msgs, add_ass):
    # no system role: the system text opens the first user turn
    out, system = "", ""
    for m in msgs:
        if m["role"] == "system":
            system += _trim(m["content"])
            continue
        role = "model" if m["role"] == "assistant" else m["role"]
        out += f"<start_of_turn>{role}\n"
        if system and role != "model":
            out += system + "\n\n"
            system = ""
        out += _trim(m["content"]) + "<end_of_turn>\n"
    return out + ("<start_of_turn>model\n" if add_ass else "")


def _llama3(msgs, add_ass):
    out = "".join(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{_trim(m['content'])}<|eot_id|>"
                  for m in msgs)
    return out + ("<|start_header_id|>assistant<|end_header_id|>\n\n" if add_ass else "")


def _llama2(system_tags: bool):
    def render(msgs, add_ass):
        out, inside = "[INST] ", True        # BOS comes from the tokenizer
        for m in msgs:
            c, role = m["content"], m["role"]
            if not inside:
                inside = True
                out += "[INST] "
            if role == "system":
                out += f"<<SYS>>\n{c}\n<</SYS>>\n\n" if system_tags else c + "\n"
            elif role == "user":
                out += c + " [/INST]"
            else:
                out += c + "</s>"
                inside = False
        return out
    return render


def _mistral_v7(msgs, add_ass):
    out = ""
    for m in msgs:
        c, role = m["content"], m["role"]
        if role == "system":
            out += f"[SYSTEM_PROMPT] {c}[/SYSTEM_PROMPT]"
        elif role == "user":
            out += f"[INST] {c}[/INST]"
        else:
            out += f" {c}</s>"
    return out


def _phi3(msgs, add_ass):
    out = "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in msgs)
    return out + ("<|assistant|>\n" if add_ass else "")


def _phi4(msgs, add_ass):
    out = "".join(f"<|im_start|>{m['role']}<|im_sep|>{m['content']}<|im_end|>" for m in msgs)
    return out + ("<|im_start|>assistant<|im_sep|>" if add_ass else "")


def _zephyr(msgs, add_ass):
    out = "".join(f"<|{m['role']}|>\n{m['content']}<|endoftext|>\n" for m in msgs)
    return out + ("<|assistant|>\n" if add_ass else "")


def _vicuna(msgs, add_ass):
    out = ""
    for m in msgs:
        if m["role"] == "system":
            out += m["content"] + "\n\n"
        elif m["role"] == "user":
            out += f"USER: {m['content']}\n"
        else:
            out += f"ASSISTANT: {m['content']}</s>\n"
    return out + ("ASSISTANT:" if add_ass else "")


BUILTIN: dict[str, Callable[[list[dict], bool], str]] = {
    "chatml": _chatml, "gemma": _gemma, "llama3": _llama3, "llama2": _llama2(False),
    "llama2-sys": _llama2(True), "mistral-v7": _mistral_v7, "phi3": _phi3, "phi4": _phi4,
    "zephyr": _zephyr, "vicuna": _vicuna,
}


def detect_builtin(arch: str, tok) -> str:
    """The built-in template for a model without one: by architecture, then by the
    vocabulary's marker tokens, chatml last (llama.cpp's own default)."""
    a = (arch or "").lower()
    has = lambda t: tok.token_id(t) is not None  # noqa: E731
    if a.startswith("gemma"):
        return "gemma"
    if has("<|start_header_id|>") and has("<|eot_id|>"):
        return "llama3"
    if has("<|im_sep|>"):
        return "phi4"
    if has("<|im_start|>"):
        return "chatml"
    if a.startswith("phi3") or has("<|assistant|>") and has("<|end|>"):
        return "phi3"
    if has("[SYSTEM_PROMPT]"):
        return "mistral-v7"
    if a == "llama" and has("[INST]"):
        return "llama2-sys"
    return "chatml"


def check_template_name(template: str) -> None:
    """A --chat-template is a built-in name or an existing file (checked before any loading)."""
    if template not in BUILTIN and not os.path.isfile(template):
        raise RequestError(f"chat template {template!r} is neither a built-in name "
                           f"({', '.join(BUILTIN)}) nor a file")
    if template not in BUILTIN and os.path.getsize(template) == 0:
        raise RequestError(f"chat template file {template} is empty; give a jinja template "
                           f"or a built-in name ({', '.join(BUILTIN)})")



# --- messages, tools and tool calls ----------------------------------------------------------
#
# OpenAI chat messages carry more than templates agree on: content may be None or a list of
# parts, assistant turns may hold tool_calls whose arguments are JSON text, tool results are
# role "tool" with a tool_call_id. What a template accepts is found out by rendering small
# probe conversations once per template (as llama.cpp's minja and HF transformers do): whether
# it renders tool definitions, assistant tool calls (with arguments as JSON text or only as an
# object), tool results, a system message, and call ids longer than 9 characters (Mistral's
# templates insist on exactly 9). Whatever a template cannot render is turned into text in the
# "generic" format memfit's parser reads back (see server/toolcalls.py).

_NEEDLE_TOOL = "memfit_probe_tool"
_NEEDLE_ARG = "memfit_probe_argument"
_NEEDLE_RESULT = "memfit_probe_result"
_NEEDLE_SYSTEM = "memfit_probe_system"
_PROBE_TOOL = {"type": "function", "function": {
    "name": _NEEDLE_TOOL, "description": "probe",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}


class TemplateCaps:
    """What one jinja chat template renders, found by probing it."""

    def __init__(self, src: str, render: Callable[..., str]):
        self.tools = "tools" in src and self._try(render, _probe_msgs(), tools=[_PROBE_TOOL],
                                                   needle=_NEEDLE_TOOL)
        str_args = self._try(render, _probe_msgs(call=True, args_obj=False), needle=_NEEDLE_ARG,
                             tools=[_PROBE_TOOL] if self.tools else None, quoted=True)
        obj_args = self._try(render, _probe_msgs(call=True, args_obj=True), needle=_NEEDLE_ARG,
                             tools=[_PROBE_TOOL] if self.tools else None, quoted=True)
        self.tool_calls = str_args or obj_args
        self.object_arguments = obj_args and not str_args
        self.long_ids = not self.tool_calls or self._try(
            render, _probe_msgs(call=True, args_obj=obj_args and not str_args, long_id=True),
            needle=_NEEDLE_ARG, tools=[_PROBE_TOOL] if self.tools else None, quoted=True)
        self.tool_results = self.tool_calls and self._try(
            render, _probe_msgs(call=True, args_obj=self.object_arguments, result=True,
                                long_id=self.long_ids),
            needle=_NEEDLE_RESULT, tools=[_PROBE_TOOL] if self.tools else None)
        self.system = self._try(render, _probe_msgs(system=True), needle=_NEEDLE_SYSTEM)

    @staticmethod
    def _try(render, msgs, needle: str, tools=None, quoted: bool = False) -> bool:
        try:
            out = render(msgs, tools)
        except Exception:  # noqa: BLE001 - a probe the template rejects means "not supported"
            return False
        if quoted:      # the argument's key as JSON renders it, not JSON-in-a-string (\"...\"),
            # or as Qwen3-Coder's XML parameter
            return f'"{needle}":' in out or f"'{needle}':" in out or \
                f"<parameter={needle}>" in out
        return needle in out


def _probe_msgs(*, system=False, call=False, args_obj=False, result=False, long_id=False):
    cid = "call_probe0probe0probe0probe" if long_id else "call12345"
    args = {_NEEDLE_ARG: "x"}
    msgs = [{"role": "system", "content": _NEEDLE_SYSTEM}] if system else []
    msgs.append({"role": "user", "content": "hello"})
    if call:
        msgs.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": cid, "type": "function", "function": {
                "name": _NEEDLE_TOOL, "arguments": args if args_obj else json.dumps(args)}}]})
    if result:
        msgs.append({"role": "tool", "tool_call_id": cid, "name": _NEEDLE_TOOL,
                     "content": _NEEDLE_RESULT})
        msgs.append({"role": "assistant", "content": "done"})
    return msgs


@lru_cache(maxsize=16)
def template_caps(src: str) -> TemplateCaps:
    from .chat import render_chat

    def render(msgs, tools):
        extra = {"tools": tools} if tools is not None else {}
        return render_chat(src, msgs, False, bos_token="", eos_token="", **extra)
    return TemplateCaps(src, render)


def _text_of(content, where: str) -> str:
    """Message content as text: None -> "", a list of text parts joined (OpenAI's form)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text") \
                    and isinstance(part.get("text"), str):
                out.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(f"{where}.content[{j}]: only text parts are supported "
                                   f"(got {kind!r})")
        return "\n".join(out)
    raise RequestError(f"{where}.content must be a string, null or a list of text parts")


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise RequestError('messages must be a list of objects like {"role": "user", "content": "..."}')


def _short_id(cid: str) -> str:
    """A stable 9-character alphanumeric id for templates that accept no other (Mistral's)."""
    if len(cid) == 9 and cid.isalnum():
        return cid
    digest = hashlib.sha256(cid.encode("utf-8")).hexdigest()
    return digest[:9]


def _tool_calls_of(m: dict, where: str) -> list[dict]:
    """An assistant message's tool_calls, checked: [{"id", "name", "arguments" (str), "args"
    (parsed object)}]."""
    calls = m.get("tool_calls")
    if not calls:
        return []
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls must be a list")
    out = []
    for j, c in enumerate(calls):
        w = f"{where}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"{w}.function.name must be a non-empty string")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                parsed = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise RequestError(f"{w}.function.arguments is not valid JSON: {e.msg}") from None
            text = args
        elif isinstance(args, dict):
            parsed, text = args, json.dumps(args, ensure_ascii=False)
        else:
            raise RequestError(f"{w}.function.arguments must be a JSON string")
        cid = c.get("id")
        if cid is not None and not isinstance(cid, str):
            raise RequestError(f"{w}.id must be a string")
        out.append({"id": cid or f"call_{len(out)}", "name": fn["name"], "arguments": text,
                    "args": parsed})
    return out


def generic_tool_prompt(tools: list[dict]) -> str:
    """The system text that tells a model whose template knows no tools how to call them, in
    the generic JSON form server/toolcalls.py parses (llama.cpp's "generic" format does the
    same)."""
    fns = []
    for t in tools:
        fn = t.get("function", t) if isinstance(t, dict) else {}
        d = {"name": fn.get("name")}
        if fn.get("description"):
            d["description"] = fn["description"]
        d["parameters"] = fn.get("parameters") or {"type": "object", "properties": {}}
        fns.append(json.dumps(d, ensure_ascii=False))
    return ("You can call the following tools:\n" + "\n".join(fns) + "\n\n"
            "To call one or more of them, answer with only a JSON object of this form:\n"
            '{"tool_calls": [{"name": "<tool name>", "arguments": {<the arguments>}}]}\n'
            "The results come back in a message of the form "
            '{"tool_response": {"name": "<tool name>", "content": "<result>"}}. '
            "To answer without calling a tool, write the answer as plain text.")


def _generic_call_text(content: str, calls: list[dict]) -> str:
    body = json.dumps({"tool_calls": [{"name": c["name"], "arguments": c["args"], "id": c["id"]}
                                      for c in calls]}, ensure_ascii=False)
    return f"{content}\n{body}" if content else body


def _generic_result_text(name: str | None, cid: str | None, content: str) -> str:
    d = {"name": name} if name else {}
    if cid:
        d["tool_call_id"] = cid
    d["content"] = content
    return json.dumps({"tool_response": d}, ensure_ascii=False)


def prepare_messages(messages: list[dict], caps: TemplateCaps | None,
                     tools: list[dict] | None) -> list[dict]:
    """OpenAI messages -> what the template can render (new dicts; the input is not changed).

    ``caps`` None stands for a built-in template (text only, system role understood)."""
    _check_messages(messages)
    # a template that does not know tools gets the whole conversation in the generic format,
    # even if it could render calls (DeepSeek-R1's): the model is told that format, and the
    # parser reads it (server/toolcalls.detect_format says "generic" for such a template)
    native_calls = caps is not None and caps.tools and caps.tool_calls
    native_results = native_calls and caps.tool_results
    names: dict[str, str] = {}      # tool_call id -> function name, to name tool results
    out: list[dict] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m["role"]
        nm = {k: v for k, v in m.items() if k not in ("content", "tool_calls")}
        nm["content"] = _text_of(m.get("content"), where)
        calls = _tool_calls_of(m, where) if role == "assistant" else []
        for c in calls:
            names[c["id"]] = c["name"]
        if calls and native_calls:
            ids = (lambda x: x) if caps.long_ids else _short_id
            nm["tool_calls"] = [{"id": ids(c["id"]), "type": "function", "function": {
                "name": c["name"],
                "arguments": c["args"] if caps.object_arguments else c["arguments"]}}
                for c in calls]
        elif calls:
            nm["content"] = _generic_call_text(nm["content"], calls)
        if role == "tool":
            cid = m.get("tool_call_id")
            name = m.get("name") or names.get(cid)
            if native_results:
                if name:
                    nm["name"] = name
                if isinstance(cid, str) and not caps.long_ids:
                    nm["tool_call_id"] = _short_id(cid)
            else:
                nm = {"role": "user", "content": _generic_result_text(name, cid, nm["content"])}
        out.append(nm)
    if tools and not (caps is not None and caps.tools):
        text = generic_tool_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": (out[0]["content"] + "\n\n" + text).lstrip("\n")}
        elif caps is None or caps.system:
            out.insert(0, {"role": "system", "content": text})
        else:
            first = next((k for k, m in enumerate(out) if m["role"] == "user"), None)
            if first is None:
                out.insert(0, {"role": "user", "content": text})
            else:
                out[first] = {**out[first], "content": text + "\n\n" + out[first]["content"]}
    return out


# Llama 3.1's built-in tools (its template's ``builtin_tools``): name -> the one string argument
# of the ``<|python_tag|>name.call(arg="...")`` call the model writes for it
BUILTIN_TOOLS = {"brave_search": "query", "wolfram_alpha": "query", "code_interpreter": "code"}


def builtin_tools(tools: list[dict] | None) -> list[str]:
    """The names of the request's tools that are Llama 3.1 built-ins: a function of a built-in's
    name whose parameters have that built-in's argument as a string property (a tool of the
    same name with other parameters is the client's own, rendered as a custom tool)."""
    out = []
    for t in tools or []:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or fn.get("name") not in BUILTIN_TOOLS:
            continue
        params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
        prop = (params.get("properties") or {}).get(BUILTIN_TOOLS[fn["name"]])
        if isinstance(prop, dict) and prop.get("type") == "string":
            out.append(fn["name"])
    return out


def _full_tools(tools: list[dict]) -> list[dict]:
    """Tools with OpenAI's defaults written out (description "", parameters an empty object
    schema): templates such as functionary's read both without checking."""
    out = []
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict):
            fn = {"description": "", "parameters": {"type": "object", "properties": {}}, **fn}
            t = {**t, "function": fn}
        out.append(t)
    return out


def thinking_kwargs(src: str, kwargs: dict) -> dict:
    """The template variables for a request, with thinking on by default where the template
    has an ``enable_thinking`` switch (llama-server does the same; DeepSeek-R1's template as
    llama.cpp keeps it closes the thinking block unless it is on). A ``reasoning_effort`` of
    "none" turns it off for a template that reads enable_thinking but no reasoning_effort."""
    extra = dict(kwargs)
    if "enable_thinking" in src and "enable_thinking" not in extra:
        off = extra.get("reasoning_effort") == "none" and "reasoning_effort" not in src
        extra["enable_thinking"] = not off
    return extra


def template_source(tok, arch: str, template: str | None = None) -> str | None:
    """The jinja source a chat request will be rendered with (a --chat-template file, else the
    GGUF's own), or None for a built-in template; what detect_format/detect_reasoning read."""
    if template is not None:
        if template in BUILTIN:
            return None
        check_template_name(template)
        try:
            with open(template, encoding="utf-8") as f:
                src = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise RequestError(f"cannot read chat template {template}: {e}") from None
        if not src.strip():
            raise RequestError(f"chat template file {template} is empty (or only white "
                               f"space); give a jinja template or a built-in name "
                               f"({', '.join(BUILTIN)})")
        return src
    return tok.chat_template or None


def apply_template(tok, arch: str, messages: list[dict], add_generation_prompt: bool = True,
                   template: str | None = None, *, tools: list[dict] | None = None,
                   **kwargs) -> tuple[str, str]:
    """Render ``messages``; returns (text, where the template came from). ``template`` is a
    built-in name or a jinja file; None means the GGUF's own, else the family's built-in.

    ``messages`` are OpenAI chat messages (content str | None | text parts; assistant
    ``tool_calls``; role "tool" results). ``tools`` (OpenAI tool objects) go to a template that
    knows tools as its ``tools`` variable (Llama 3.1's built-ins, for a template with
    ``builtin_tools``, as that variable instead: see builtin_tools); for one that does not (and for the built-ins) their
    definitions and the generic call format are written into the system message, and past
    calls and results are rendered as text. Other keyword arguments (enable_thinking,
    reasoning_effort, ...) are passed to a jinja template as variables."""
    from .chat import render_chat

    _check_messages(messages)
    tools = tools or None
    bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
    eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
    src = template_source(tok, arch, template)
    if src is not None:
        caps = template_caps(src)
        extra = thinking_kwargs(src, kwargs)
        builtin = builtin_tools(tools) if "builtin_tools" in src else []
        if builtin:
            # as Llama 3.1's template means them: built-ins named in ``builtin_tools`` (its
            # system prompt lists them; their calls render as name.call(...)), the other
            # tools as JSON definitions
            extra["builtin_tools"] = builtin
            tools = [t for t in tools if t.get("function", {}).get("name") not in builtin] or None
        msgs = prepare_messages(messages, caps, tools)
        if tools and caps.tools:
            extra["tools"] = _full_tools(tools)
        where = f"{template} (jinja file)" if template is not None \
            else "the model's own (tokenizer.chat_template)"
        return render_chat(src, msgs, add_generation_prompt, bos_token=bos, eos_token=eos,
                           **extra), where
    msgs = prepare_messages(messages, None, tools)
    if template is not None:
        return BUILTIN[template](msgs, add_generation_prompt), f"{template} (built-in, chosen)"
    name = detect_builtin(arch, tok)
    return (BUILTIN[name](msgs, add_generation_prompt),
            f"{name} (built-in for {arch}; the GGUF has no tokenizer.chat_template)")


__all__ = ["BUILTIN", "BUILTIN_TOOLS", "apply_template", "builtin_tools", "detect_builtin",
           "generic_tool_prompt",
           "prepare_messages", "template_caps", "template_source", "thinking_kwargs"]
