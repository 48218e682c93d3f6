"""Where a JSON schema nests other schemas: the keywords whose value is an object of schemas, one
schema, or a list of schemas (JSON Schema 2020-12 and draft 7 names), and the schemas each holds.
Dependency-free, and no recursion: a walker keeps its own stack or depth.
"""
from __future__ import annotations

from typing import Any

SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# `items` is one schema, or (draft 7's tuple form) a list of them.
SCHEMA_VALUES = ("additionalProperties", "items", "additionalItems", "propertyNames", "unevaluatedProperties",
                 "unevaluatedItems", "not", "contains", "if", "then", "else")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
# Every keyword that nests schemas, in the order a walker that goes by this table visits them.
SCHEMA_KEYWORDS = SCHEMA_MAPS + SCHEMA_VALUES + SCHEMA_LISTS


def subschemas(key: str, value: Any) -> list[tuple[str | int | None, Any]]:
    """The schemas nested in keyword `key`'s `value`, each with where it sits: (name, schema) per
    member of an object of schemas, (index, schema) per item of a list, (None, value) for a keyword
    that holds one schema. Empty for a keyword that holds none, or a map or list of another shape."""
    if key in SCHEMA_MAPS:
        return list(value.items()) if isinstance(value, dict) else []
    if key in SCHEMA_LISTS or key == "items" and isinstance(value, list):
        return list(enumerate(value)) if isinstance(value, list) else []
    if key in SCHEMA_VALUES:
        return [(None, value)]
    return []


def describes_an_object(schema: Any) -> bool:
    """Whether a tool's parameters schema may describe a call's arguments, which are a JSON object: its
    `type`, if given, is "object" (OpenAI refuses other types; a call constrained to one would write
    arguments no call parses)."""
    return not isinstance(schema, dict) or schema.get("type", "object") in ("object", ["object"])
