"""Chat templates: the model's ``tokenizer.chat_template`` rendered in a sandboxed jinja2.

The environment mirrors HF transformers' chat-template rendering: ImmutableSandboxedEnvironment
with trim_blocks/lstrip_blocks and loop controls, ``raise_exception``, ``strftime_now`` and a
``tojson`` filter that keeps non-ASCII text. Errors become memfit errors: a template that calls
``raise_exception`` rejects the request (RequestError); a broken or unsafe template is the
model's fault (ModelError).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

from ..errors import ModelError, RequestError


class ChatTemplateMissing(RequestError):
    """A chat request for a model whose GGUF has no tokenizer.chat_template."""


class TemplateRaised(RequestError):
    """The template itself rejected the messages (its raise_exception was called)."""


def _raise_exception(message):
    raise TemplateRaised(f"the chat template rejected the messages: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # a filter chain such as `tools | map(attribute='function') | tojson` (llama.cpp's
    # DeepSeek-R1 template) hands over a generator: written as the list it yields
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys, default=_json_iterable)


def _json_iterable(x):
    if hasattr(x, "__iter__") and not isinstance(x, (str, bytes, dict)):
        return list(x)
    raise TypeError(f"Object of type {type(x).__name__} is not JSON serializable")


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _env_class():
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Env(ImmutableSandboxedEnvironment):
        # jinja2 would return a silent Undefined for `x.__class__`; refuse at once instead
        def unsafe_undefined(self, obj, attribute):
            raise SecurityError(f"access to attribute {attribute!r} of a "
                                f"{type(obj).__name__} object is not allowed")

    return _Env


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2 import TemplateError

    env = _env_class()(trim_blocks=True, lstrip_blocks=True,
                       extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise ModelError(f"the chat template does not compile: {type(e).__name__}: {e}") from None


def require_template(template: str | None) -> str:
    """The template, or ChatTemplateMissing saying the model only does plain completion."""
    if not template:
        raise ChatTemplateMissing(
            "this model has no chat template (tokenizer.chat_template is not in its GGUF), so chat "
            "requests cannot be formatted; use plain completion with a prompt string instead")
    return template


def render_chat(template: str | None, messages: list[dict], add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", **extra) -> str:
    """Render ``messages`` ([{"role", "content"}, ...]) with the model's chat template."""
    from jinja2 import TemplateError
    from jinja2.exceptions import SecurityError

    template = require_template(template)
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise RequestError("messages must be a list of objects like {\"role\": ..., \"content\": ...}")
    tmpl = _compile(template)
    try:
        return tmpl.render(messages=messages, add_generation_prompt=add_generation_prompt,
                           bos_token=bos_token, eos_token=eos_token, **extra)
    except TemplateRaised:
        raise
    except SecurityError as e:
        raise ModelError(f"the chat template tried an unsafe operation and was stopped: {e}") from None
    except TemplateError as e:
        raise ModelError(f"the chat template failed to render: {type(e).__name__}: {e}") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        raise ModelError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
