"""Built-in chat templates, for GGUFs without ``tokenizer.chat_template`` or chosen by name.

The names and formats are llama.cpp's (llama-chat.cpp, ``llm_chat_apply_template``): a model
whose file carries no template is formatted with the one its family uses (gemma for gemma*,
llama3 for a vocabulary with ``<|start_header_id|>``, chatml for ``<|im_start|>`` and as the
last resort, ...), and memfit says which. ``--chat-template NAME|FILE`` picks a built-in by name
or reads a jinja template from a file (rendered by chat.render_chat, sandboxed).
"""

from __future__ import annotations

import os
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


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise RequestError('messages must be a list of objects like {"role": "user", "content": "..."}')


def check_template_name(template: str) -> None:
    """A --chat-template is a built-in name or an existing file (checked before any loading)."""
    if template not in BUILTIN and not os.path.isfile(template):
        raise RequestError(f"chat template {template!r} is neither a built-in name "
                           f"({', '.join(BUILTIN)}) nor a file")
    if template not in BUILTIN and os.path.getsize(template) == 0:
        raise RequestError(f"chat template file {template} is empty; give a jinja template "
                           f"or a built-in name ({', '.join(BUILTIN)})")


def apply_template(tok, arch: str, messages: list[dict], add_generation_prompt: bool = True,
                   template: str | None = None) -> tuple[str, str]:
    """Render ``messages``; returns (text, where the template came from). ``template`` is a
    built-in name or a jinja file; None means the GGUF's own, else the family's built-in."""
    from .chat import render_chat

    _check_messages(messages)
    bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
    eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
    if template is not None:
        if template in BUILTIN:
            return BUILTIN[template](messages, add_generation_prompt), f"{template} (built-in, chosen)"
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
        return (render_chat(src, messages, add_generation_prompt, bos_token=bos, eos_token=eos),
                f"{template} (jinja file)")
    if tok.chat_template:
        return (render_chat(tok.chat_template, messages, add_generation_prompt,
                            bos_token=bos, eos_token=eos), "the model's own (tokenizer.chat_template)")
    name = detect_builtin(arch, tok)
    return (BUILTIN[name](messages, add_generation_prompt),
            f"{name} (built-in for {arch}; the GGUF has no tokenizer.chat_template)")


__all__ = ["BUILTIN", "apply_template", "detect_builtin"]
