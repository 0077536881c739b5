"""JSON schemas that constrained generation must satisfy (tests/test_constrain.py, and the
server's response_format tests import them): nested objects, arrays with min/maxItems, enums,
number ranges, optional fields, anyOf/oneOf/allOf, string patterns and formats, $ref, nullable
and OpenAI-strict schemas (every property required, additionalProperties false).

Strings and arrays are bounded where a small model could otherwise write on until max_tokens
(the output would then be cut, not invalid: the tests want complete documents)."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 30}

SCHEMAS: list[tuple[str, dict]] = [
    ("person", {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False}),
    ("nested_address", {
        "type": "object",
        "properties": {
            "name": NAME,
            "address": {
                "type": "object",
                "properties": {"street": NAME, "city": NAME,
                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False}),
    ("tags_2_to_4", {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 15},
                                "minItems": 2, "maxItems": 4}},
        "required": ["tags"], "additionalProperties": False}),
    ("color_enum", {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue", "yellow"]},
                       "shade": {"type": "string", "enum": ["light", "dark"]}},
        "required": ["color", "shade"], "additionalProperties": False}),
    ("temperature_range", {
        "type": "object",
        "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 60},
                       "humidity": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["celsius", "humidity"], "additionalProperties": False}),
    ("optional_fields", {
        "type": "object",
        "properties": {"title": NAME, "subtitle": NAME, "pages": {"type": "integer", "minimum": 1,
                                                                    "maximum": 2000}},
        "required": ["title"], "additionalProperties": False}),
    ("anyof_id", {
        "type": "object",
        "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99999},
                                        {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}]}},
        "required": ["id"], "additionalProperties": False}),
    ("phone_pattern", {
        "type": "object",
        "properties": {"phone": {"type": "string", "pattern": "^\\([0-9]{3}\\) [0-9]{3}-[0-9]{4}$"}},
        "required": ["phone"], "additionalProperties": False}),
    ("booleans", {
        "type": "object",
        "properties": {"is_open": {"type": "boolean"}, "has_parking": {"type": "boolean"}},
        "required": ["is_open", "has_parking"], "additionalProperties": False}),
    ("array_of_objects", {
        "type": "object",
        "properties": {"items": {
            "type": "array", "minItems": 1, "maxItems": 3,
            "items": {"type": "object",
                      "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                     "label": NAME},
                      "required": ["id", "label"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False}),
    ("const_version", {
        "type": "object",
        "properties": {"version": {"const": "1.0"}, "ok": {"type": "boolean"}},
        "required": ["version", "ok"], "additionalProperties": False}),
    ("nullable", {
        "type": "object",
        "properties": {"nickname": {"type": ["string", "null"], "maxLength": 20},
                       "score": {"type": ["integer", "null"], "minimum": 0, "maximum": 10}},
        "required": ["nickname", "score"], "additionalProperties": False}),
    ("date_and_email", {
        "type": "object",
        "properties": {"date": {"type": "string", "format": "date"},
                       "email": {"type": "string", "format": "email", "maxLength": 40}},
        "required": ["date", "email"], "additionalProperties": False}),
    ("matrix_2x2", {
        "type": "object",
        "properties": {"matrix": {"type": "array", "minItems": 2, "maxItems": 2,
                                  "items": {"type": "array", "minItems": 2, "maxItems": 2,
                                            "items": {"type": "integer", "minimum": -9,
                                                      "maximum": 9}}}},
        "required": ["matrix"], "additionalProperties": False}),
    ("defs_ref", {
        "$defs": {"point": {"type": "object",
                            "properties": {"x": {"type": "integer", "minimum": -100, "maximum": 100},
                                           "y": {"type": "integer", "minimum": -100, "maximum": 100}},
                            "required": ["x", "y"], "additionalProperties": False}},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"], "additionalProperties": False}),
    ("oneof_shape", {
        "type": "object",
        "properties": {"shape": {"oneOf": [
            {"type": "object", "properties": {"kind": {"const": "circle"},
                                              "radius": {"type": "integer", "minimum": 1, "maximum": 50}},
             "required": ["kind", "radius"], "additionalProperties": False},
            {"type": "object", "properties": {"kind": {"const": "square"},
                                              "side": {"type": "integer", "minimum": 1, "maximum": 50}},
             "required": ["kind", "side"], "additionalProperties": False}]}},
        "required": ["shape"], "additionalProperties": False}),
    ("allof_merge", {
        "allOf": [{"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["a"]},
                  {"type": "object", "properties": {"b": {"type": "string", "maxLength": 10}},
                   "required": ["b"]}]}),
    ("top_level_array", {
        "type": "array", "minItems": 1, "maxItems": 5,
        "items": {"type": "string", "enum": ["apple", "banana", "cherry", "date"]}}),
    ("openai_strict_event", {
        "type": "object",
        "properties": {
            "event": NAME,
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "attendees": {"type": "array", "maxItems": 3, "items": NAME},
            "location": {"type": "object",
                         "properties": {"city": NAME, "online": {"type": "boolean"}},
                         "required": ["city", "online"], "additionalProperties": False}},
        "required": ["event", "date", "attendees", "location"], "additionalProperties": False}),
    ("number_enum", {
        "type": "object",
        "properties": {"stars": {"enum": [1, 2, 3, 4, 5]},
                       "verdict": {"enum": ["good", "bad", None]}},
        "required": ["stars", "verdict"], "additionalProperties": False}),
    ("string_lengths", {
        "type": "object",
        "properties": {"code": {"type": "string", "minLength": 4, "maxLength": 6,
                                "pattern": "^[a-z0-9]+$"},
                       "word": {"type": "string", "minLength": 2, "maxLength": 8}},
        "required": ["code", "word"], "additionalProperties": False}),
    ("map_of_ints", {
        "type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 1000},
        "maxProperties": 3}),
    ("recipe", {
        "type": "object",
        "properties": {
            "title": NAME,
            "servings": {"type": "integer", "minimum": 1, "maximum": 12},
            "ingredients": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
                "type": "object",
                "properties": {"item": NAME,
                               "grams": {"type": "number", "exclusiveMinimum": 0, "maximum": 5000}},
                "required": ["item", "grams"], "additionalProperties": False}},
            "vegetarian": {"type": "boolean"}},
        "required": ["title", "servings", "ingredients", "vegetarian"],
        "additionalProperties": False}),
    ("tuple_prefix_items", {
        "type": "object",
        "properties": {"pair": {"type": "array", "prefixItems": [NAME, {"type": "integer", "minimum": 0,
                                                                        "maximum": 99}],
                                "items": False}},
        "required": ["pair"], "additionalProperties": False}),
]

# schemas llguidance refuses (a clear ConstraintError / HTTP 400 naming the keyword)
UNSUPPORTED: list[tuple[str, dict, str]] = [
    ("unique_items", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
     "uniqueItems"),
    ("not", {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
    ("bad_type", {"type": "object", "properties": {"a": {"type": "strnig"}}}, "strnig"),
    ("lookahead_pattern", {"type": "string", "pattern": "^(?=a)a+$"}, "look-around"),
    ("missing_ref", {"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}, "nope"),
]
