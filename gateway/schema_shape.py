"""A light check that a client's JSON schema (a tool's parameters, a response format's schema) is
shaped as JSON Schema says: each keyword the service reads holds the kind of value it must (a
`type` names JSON types, `properties` maps names to schemas, `required` lists names, a bound is a
number, ...). A misshapen schema is refused by name before any work, whatever tool_choice says,
as OpenAI refuses it. Keywords outside this table pass; whether a well-shaped schema compiles into
a grammar is the worker's to say. Iterative: the depth of a schema costs no Python stack, and
its size is bounded (MAX_NODES).
"""
from __future__ import annotations

from numbers import Real
from typing import Any

from common.json_schema import SCHEMA_LISTS, SCHEMA_MAPS, SCHEMA_VALUES, subschemas

TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
_SCHEMA = tuple(key for key in SCHEMA_VALUES if key != "items")   # items: one schema or a list of them
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
           "maxContains")
_NUMBERS = ("minimum", "maximum")
_STRINGS = ("pattern", "format", "$ref")
# Subschemas checked at most, each on the event loop that serves every stream: four times the
# scheduler's own bound (--max-json-schema-nodes), which refuses a longer schema anyway. The
# schemas of one request's tools share it (check_schema's `nodes`), as they share the scheduler's.
MAX_NODES = 1 << 14


class SchemaProblem(ValueError):
    """What is wrong, starting with the path of the keyword inside the schema ("properties.a.type")."""


def _is_schema(value: Any) -> bool:
    return isinstance(value, (dict, bool))


def _is_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _keyword_problem(key: str, value: Any) -> str | None:
    """Why `value` cannot be keyword `key`'s, or None when it can (or the keyword is not checked)."""
    if key == "type":
        names = value if isinstance(value, list) else [value]
        if not names or not all(isinstance(n, str) and n in TYPES for n in names) or len(set(names)) < len(names):
            return f"must name JSON types ({', '.join(sorted(TYPES))}) once each, got {str(value)[:60]}"
    elif key in _SCHEMA and not _is_schema(value):
        return "must be a schema (an object or a boolean)"
    elif key in SCHEMA_MAPS and not (isinstance(value, dict) and all(_is_schema(v) for v in value.values())):
        return "must be an object of schemas"
    elif key in SCHEMA_LISTS and not (isinstance(value, list) and value and all(_is_schema(v) for v in value)):
        return "must be a non-empty list of schemas"
    elif key == "items" and not (_is_schema(value) or isinstance(value, list) and all(_is_schema(v) for v in value)):
        return "must be a schema or a list of schemas"
    elif key == "required" and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return "must be a list of property names"
    elif key == "enum" and not isinstance(value, list):
        return "must be a list"
    elif key in _COUNTS and not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return "must be a non-negative integer"
    elif key in _NUMBERS and not _is_number(value):
        return "must be a number"
    elif key in ("exclusiveMinimum", "exclusiveMaximum") and not (_is_number(value) or isinstance(value, bool)):
        return "must be a number"
    elif key == "multipleOf" and not (_is_number(value) and value > 0):
        return "must be a number above 0"
    elif key in _STRINGS and not isinstance(value, str):
        return "must be a string"
    return None


def _subschemas(key: str, value: Any) -> list[tuple[str, Any]]:
    """The (path, schema) pairs nested in a well-shaped keyword."""
    return [(key if step is None else f"{key}.{step}" if isinstance(step, str) else f"{key}[{step}]", schema)
            for step, schema in subschemas(key, value)]


def _count(key: str, value: Any) -> int:
    """How many subschemas keyword `key`'s `value` holds, counted before they are listed."""
    if key in SCHEMA_MAPS or key in SCHEMA_LISTS or key == "items" and isinstance(value, list):
        return len(value) if isinstance(value, (dict, list)) else 0
    return 1 if key in SCHEMA_VALUES else 0


class TooManySubschemas(SchemaProblem):
    """The schemas checked together hold more than MAX_NODES subschemas."""


def check_schema(schema: Any, nodes: int = 0) -> int:
    """Raises SchemaProblem when `schema` (a parsed JSON value) is not shaped as a JSON schema, and
    TooManySubschemas when it and the `nodes` subschemas checked before it (the other tools' of the
    request) hold more than MAX_NODES; returns the subschemas counted so far, its own included."""
    todo: list[tuple[str, Any]] = [("", schema)]
    nodes += 1
    while todo:
        path, node = todo.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            raise SchemaProblem(f"{path or 'the schema'} must be a schema (an object or a boolean)")
        for key, value in node.items():
            where = f"{path}.{key}" if path else key
            nodes += _count(key, value)
            if nodes > MAX_NODES:
                raise TooManySubschemas(f"{where}: the schema has more than {MAX_NODES} subschemas")
            if (problem := _keyword_problem(key, value)) is not None:
                raise SchemaProblem(f"{where} {problem}")
            todo.extend((f"{path}.{sub}" if path else sub, child) for sub, child in _subschemas(key, value))
    return nodes
