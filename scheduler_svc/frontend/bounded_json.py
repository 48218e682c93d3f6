"""JSON from clients (schemas, tool parameters, tool-call arguments), parsed strictly
(common/strict_json.py) with bounds: its nesting depth and, for a schema, its number of values.
Whatever the text, a problem is a JsonProblem saying what is wrong (the caller names the field).
"""
from __future__ import annotations

from typing import Any

from common.strict_json import JsonProblem, loads, measure


def parse_json_object(text: str, *, max_depth: int) -> dict[str, Any]:
    return _object(loads(text, max_depth=max_depth))


def parse_schema(text: str, *, max_depth: int, max_nodes: int) -> dict[str, Any]:
    """A JSON schema (an object) of at most max_nodes values (every object, array, member value
    and item counts), nested at most max_depth deep: what a grammar is built from, so its size
    bounds the build's cost."""
    value = _object(loads(text, max_depth=max_depth))
    nodes = measure(value)[1]
    if nodes > max_nodes:
        raise JsonProblem(f"has {nodes} JSON values, more than the limit of {max_nodes}")
    return value


def _object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise JsonProblem(f"must be a JSON object, got {type(value).__name__}")
    return value
