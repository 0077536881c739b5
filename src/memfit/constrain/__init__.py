"""Constrained decoding: JSON schemas, regular expressions and grammars through llguidance.

    g = compile_constraint(tokenizer, {"type": "json_schema", "schema": {...}, "strict": True})
    rid = engine.add_request(ids, params, constraint=g)   # every token obeys the grammar

llguidance (guidance-ai, on PyPI as an abi3 wheel) does the work: it compiles the spec to a
grammar, computes the next-token mask over the whole vocabulary (~50 us, GIL released) and the
tokens the grammar forces. This module only adapts it to memfit: a tokenizer wrapper built from
the GGUF vocabulary (tokenizer.py), the spec forms OpenAI / llama-server accept, one-line
errors (ConstraintError -> HTTP 400) and a small compile cache.

Spec forms (``compile_constraint``):
    {"type": "json_schema", "schema": {...}, "strict": bool}   OpenAI's json_schema
    {"type": "json_object"}                                     any JSON object
    {"type": "regex", "regex": "..."}
    {"type": "lark", "grammar": "..."}      llguidance Lark (may embed %json{...})
    {"type": "gbnf", "grammar": "..."}      llama.cpp GBNF (converted by llguidance.gbnf_to_lark)

JSON is generated in one fixed layout, ``{"a": 1, "b": [2, 3]}`` (no free whitespace): the
layout models write most, it makes the separators forced tokens, and it keeps a small model
from filling its answer with newlines. A schema may choose another with llguidance's
``"x-guidance"`` key (e.g. ``{"whitespace_flexible": true}``). Unbounded integers and numbers
are held to 16 integral digits (llama.cpp's limit). ``strict`` is accepted and changes
nothing: the schema is always enforced, and what llguidance cannot enforce is an error.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

from ..errors import RequestError
from .tokenizer import ll_tokenizer

__all__ = ["ConstraintError", "Grammar", "Matcher", "compile_constraint", "spec_from_kwargs",
           "validate_spec"]

# the JSON layout (see the module doc); "x-guidance" in a schema overrides these defaults
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 64          # compiled grammars kept per tokenizer (least recently used dropped)
_MAX_MESSAGE = 400        # characters of llguidance's message kept in a ConstraintError


class ConstraintError(RequestError):
    """A constraint spec that is malformed or that llguidance cannot compile (one line)."""


class Matcher:
    """The grammar state of one sequence (an llguidance LLMatcher): consume the tokens it
    generates, ask for the tokens the grammar forces next, and whether it is complete."""

    __slots__ = ("ll",)

    def __init__(self, ll):
        self.ll = ll  # llguidance.LLMatcher (the engine hands it to LLExecutor for masks)

    def consume(self, tokens: list[int]) -> bool:
        """Advance over tokens; False when one is not allowed (the matcher is then in error)."""
        return self.ll.consume_tokens(tokens)

    def forced(self) -> list[int]:
        """The tokens the grammar forces from here (only one continuation possible); [] if none."""
        return self.ll.compute_ff_tokens()

    @property
    def stopped(self) -> bool:
        """Complete: no token but end-of-generation can follow (or the matcher errored)."""
        return self.ll.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.ll.is_accepting()

    @property
    def error(self) -> str:
        return self.ll.get_error()


class Grammar:
    """A compiled constraint: immutable, shared by every sequence that uses it (thread-safe:
    ``matcher`` copies a validated prototype)."""

    def __init__(self, tokenizer, spec: dict, ll_grammar: str, proto):
        self.tokenizer = tokenizer    # the memfit Tokenizer it was compiled for
        self.spec = spec
        self.ll_grammar = ll_grammar  # llguidance's grammar text (JSON)
        self._proto = proto           # an LLMatcher in its start state, never advanced
        self.compile_s = 0.0          # seconds the compile took (0 for a cache hit's first user)

    def matcher(self) -> Matcher:
        """A fresh per-sequence state at the start of the grammar."""
        return Matcher(self._proto.deep_copy())

    def __repr__(self) -> str:
        return f"Grammar({self.spec.get('type')!r})"


def _one_line(msg: str) -> str:
    """llguidance's (sometimes multi-line, caret-pointing) message as one line."""
    parts = [p.strip() for p in str(msg).splitlines()]
    # drop the source excerpt and caret lines ("1 | start: /a(/", "^")
    text = " ".join(p for p in parts if p and set(p) - set("^ |0123456789")
                    and not re.match(r"\d+ \|", p))
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE - 3] + "..."


# Integers and numbers without a bound get one of 16 integral digits, as llama.cpp's schema
# converter gives them: a small model can otherwise write digits until max_tokens
NUMBER_LIMIT = 10**16 - 1
# keywords whose values are data or maps of names, not schemas of numbers
_DATA_KEYS = {"enum", "const", "default", "examples", "required", "x-guidance"}


def _bound_numbers(node):
    """A copy of a JSON schema where every integer/number schema without a minimum or a
    maximum gets +-NUMBER_LIMIT."""
    if isinstance(node, list):
        return [_bound_numbers(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in _DATA_KEYS else _bound_numbers(v) for k, v in node.items()}
    t = node.get("type")
    types = t if isinstance(t, list) else [t]
    if "integer" in types or "number" in types:
        if "minimum" not in node and "exclusiveMinimum" not in node:
            out["minimum"] = -NUMBER_LIMIT
        if "maximum" not in node and "exclusiveMaximum" not in node:
            out["maximum"] = NUMBER_LIMIT
    return out


def _ll_grammar(spec: dict) -> tuple[str, str]:
    """spec -> (llguidance grammar text, what it is for messages); ConstraintError if malformed."""
    import llguidance as llg

    if not isinstance(spec, dict):
        raise ConstraintError(f"a constraint must be an object with a 'type', got {type(spec).__name__}")
    kind = spec.get("type")
    if kind == "json_schema":
        schema = spec.get("schema")
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConstraintError(f"json_schema.schema is not valid JSON: {e}") from None
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, dict):
            raise ConstraintError("json_schema.schema must be a JSON object (the schema)")
        strict = spec.get("strict", False)
        if not isinstance(strict, bool) and strict is not None:
            raise ConstraintError(f"json_schema.strict must be a boolean, got {strict!r}")
        try:
            g = llg.LLMatcher.grammar_from_json_schema(_bound_numbers(schema),
                                                        defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise ConstraintError(f"json_schema.schema: {_one_line(e)}") from None
        return g, "json_schema.schema"
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS), \
            "json_object"
    if kind == "regex":
        rx = spec.get("regex")
        if not isinstance(rx, str) or not rx:
            raise ConstraintError("regex must be a non-empty string")
        return llg.LLMatcher.grammar_from_regex(rx), "regex"
    if kind in ("lark", "gbnf"):
        text = spec.get("grammar")
        if not isinstance(text, str) or not text.strip():
            raise ConstraintError(f"{kind} grammar must be a non-empty string")
        if kind == "gbnf":
            from llguidance.gbnf_to_lark import gbnf_to_lark
            try:
                text = gbnf_to_lark(text)
            except Exception as e:  # the converter raises its own parse errors and ValueErrors
                raise ConstraintError(f"gbnf grammar: {_one_line(e)}") from None
        return llg.LLMatcher.grammar_from_lark(text), f"{kind} grammar"
    raise ConstraintError(f"unknown constraint type {kind!r}; use json_schema, json_object, "
                          f"regex, lark or gbnf")


def _cache_key(spec: dict) -> str:
    try:
        return json.dumps(spec, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ConstraintError(f"the constraint is not JSON-serializable: {e}") from None


_lock = threading.Lock()


def compile_constraint(tokenizer, spec: dict) -> Grammar:
    """Compile spec (forms in the module doc) for tokenizer's vocabulary; cached per
    (tokenizer, spec). ConstraintError, naming what is wrong or unsupported, when llguidance
    cannot compile it."""
    import time

    import llguidance as llg

    key = _cache_key(spec)
    with _lock:
        cache = tokenizer.__dict__.setdefault("_llg_grammars", OrderedDict())
        g = cache.get(key)
        if g is not None:
            cache.move_to_end(key)
            return g
    t0 = time.perf_counter()
    text, what = _ll_grammar(spec)
    llt = ll_tokenizer(tokenizer)
    # the matcher builds (and checks) the grammar; it never raises for a bad grammar but
    # enters an error state (llguidance LLMatcher doc)
    proto = llg.LLMatcher(llt, text, log_level=0)
    if proto.is_error():
        raise ConstraintError(f"{what} cannot be compiled: {_one_line(proto.get_error())}")
    g = Grammar(tokenizer, spec, text, proto)
    g.compile_s = time.perf_counter() - t0
    with _lock:
        cache[key] = g
        while len(cache) > _CACHE_SIZE:
            cache.popitem(last=False)
    return g


def validate_spec(spec: dict) -> None:
    """Check spec without a vocabulary (the CLI does, before a model loads): ConstraintError
    as compile_constraint would raise it for the grammar itself."""
    import llguidance as llg

    text, what = _ll_grammar(spec)
    err = llg.LLMatcher.validate_grammar(text)
    if err:
        raise ConstraintError(f"{what} cannot be compiled: {_one_line(err)}")


def spec_from_kwargs(json_schema=None, grammar: str | None = None,
                     regex: str | None = None) -> dict | None:
    """The Python API's / CLI's keywords -> a spec (at most one of them): a grammar text is
    Lark when it looks like Lark (a ``start:`` rule or ``%llguidance``), else GBNF."""
    given = [n for n, v in (("json_schema", json_schema), ("grammar", grammar), ("regex", regex))
             if v is not None]
    if len(given) > 1:
        raise ConstraintError(f"give at most one of json_schema, grammar and regex (got "
                              f"{' and '.join(given)})")
    if json_schema is not None:
        return {"type": "json_schema", "schema": json_schema, "strict": True}
    if grammar is not None:
        if not isinstance(grammar, str):
            raise ConstraintError(f"grammar must be a string (Lark or GBNF), got {type(grammar).__name__}")
        from llguidance.gbnf_to_lark import is_lark_syntax
        return {"type": "lark" if is_lark_syntax(grammar) else "gbnf", "grammar": grammar}
    if regex is not None:
        return {"type": "regex", "regex": regex}
    return None
