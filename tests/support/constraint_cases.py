"""Structured-output cases of the tests (and of the grammar-backend comparison in docs/STRUCTURED_OUTPUT.md):
random JSON schemas, 20 regexes, an EBNF grammar, and a compactness measure.

Each schema mixes what real response formats use: objects with required and optional
properties, nested objects, arrays with item bounds, enums (strings with quotes, backslashes and
non-ASCII, numbers, null), integers and numbers with inclusive and exclusive bounds, booleans,
strings with length bounds or a pattern. Sizes stay bounded (maxLength, maxItems) so that
sampling from random logits, where closing a string is one choice among hundreds, ends within
a few hundred tokens. Same seed => same schemas.
"""
from __future__ import annotations

import random
from typing import Any

_ENUM_STRINGS = ["red", "green", "blue", 'say "hi"', "back\\slash", "naïve", "東京", "tab\there", ""]
_PATTERNS = [r"[a-z]{1,6}", r"[A-Z][0-9]{2}", r"(yes|no)", r"\d{3}-\d{4}"]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema whose properties are random leaves, arrays and (up to depth 2) objects."""
    names = rng.sample(["id", "name", "tags", "score", "count", "ok", "kind", "meta", "items", "note", "unit"],
                       rng.randint(1, 4))
    properties = {name: _random_value(rng, depth) for name in names}
    required = [name for name in names if rng.random() < 0.6]
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


def _random_value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["string", "bounded_string", "pattern", "integer", "number", "boolean", "enum", "null_or_int", "array"]
    if depth < 2:
        kinds += ["object", "object"]
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 6)}
    if kind == "bounded_string":
        low = rng.randint(0, 3)
        return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 4)}
    if kind == "pattern":
        return {"type": "string", "pattern": "^" + rng.choice(_PATTERNS) + "$"}
    if kind == "integer":
        low = rng.randint(-1000, 1000)
        bounds = {"minimum": low, "maximum": low + rng.randint(0, 5000)}
        if rng.random() < 0.3:
            bounds = {"exclusiveMinimum": low, "exclusiveMaximum": low + rng.randint(2, 50)}
        return {"type": "integer", **bounds}
    if kind == "number":
        low = round(rng.uniform(-100, 100), 2)
        return {"type": "number", "minimum": low, "maximum": round(low + rng.uniform(0.5, 200), 2)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        values = rng.sample(_ENUM_STRINGS, rng.randint(1, 4)) + rng.sample([1, 2.5, -3, None, True], rng.randint(0, 2))
        return {"enum": values}
    if kind == "null_or_int":
        return {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0, "maximum": 99}]}
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": _random_value(rng, depth + 1), "minItems": low, "maxItems": low + rng.randint(0, 2)}
    return random_schema(rng, depth + 1)


def random_schemas(seed: int, count: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(count)]


# Bounded repetitions where a class has hundreds of tokens: under random logits, `[a-z]+` ends
# only when the one token that leaves it is drawn.
REGEXES = [
    r"[a-z]{3,8}", r"\d{1,4}", r"(cat|dog|bird)s?", r"[A-Z][a-z]{2,5} [A-Z][a-z]{2,5}", r"\d{3}-\d{3}-\d{4}",
    r"(true|false)", r"[0-9a-f]{8}", r"-?\d+\.\d{1,3}", r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)", r"(ab|cd){1,4}",
    r"#[0-9A-F]{6}", r"\(\d{2}\)", r"[^ \n]{1,10}", r"x*y+z?", r"(\w{1,6} ){1,3}end",
    r"\d{4}-\d{2}-\d{2}", r"[ACGT]{5,10}", r"(north|south)(east|west)?", r"[a-c]{2}[x-z]{2}", r"yes|no|maybe",
]

# Arithmetic expressions: an EBNF grammar whose outputs Python parses.
ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [1-9] [0-9]? [0-9]?
"""


def whitespace_run(text: str) -> int:
    """Longest run of whitespace outside JSON strings."""
    longest = run = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            in_string = escaped or ch != '"'
            escaped = not escaped and ch == "\\"
            continue
        if ch in " \t\r\n":
            run += 1
            longest = max(longest, run)
        else:
            run = 0
            in_string = ch == '"'
    return longest
