"""Tokenizer room: GGUF vocab -> llama.cpp-compatible encode/decode, chat templates, streaming.

    tok = Tokenizer.from_metadata(open_gguf(path).metadata)
    ids = tok.encode(text, add_special=True, parse_special=True)
    text = tok.decode(ids)
    sd = StreamDecoder(tok); sd.push(id) -> str; sd.flush() -> str
    prompt = render_chat(tok.chat_template, messages, add_generation_prompt=True)
"""

from .chat import ChatTemplateMissing, TemplateRaised, render_chat, require_template
from .stream import StreamDecoder
from .vocab import Tokenizer

__all__ = ["Tokenizer", "StreamDecoder", "render_chat", "require_template",
           "ChatTemplateMissing", "TemplateRaised"]
