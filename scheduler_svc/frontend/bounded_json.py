"""JSON from clients (schemas, tool parameters, tool-call arguments), parsed with bounds: its
nesting depth and, for a schema, its number of values. Whatever the text, a problem is a
JsonProblem saying what is wrong (the caller names the field), never a RecursionError: the
parser's own recursion limit is met only by texts far deeper than any bound here, and that too is
reported as too deep.
"""
from __future__ import annotations

import json
import math
from typing import Any


class JsonProblem(ValueError):
    """Why a text is refused, e.g. "not valid JSON: ..." or "nested 40 levels deep, ..."."""


def parse_json(text: str, *, max_depth: int) -> Any:
    """The value of `text`; JsonProblem for invalid JSON or nesting deeper than max_depth."""
    value = _loads(text, max_depth)
    depth, _ = measure(value)
    _check_depth(depth, max_depth)
    return value


def parse_json_object(text: str, *, max_depth: int) -> dict[str, Any]:
    return _object(parse_json(text, max_depth=max_depth))


def parse_schema(text: str, *, max_depth: int, max_nodes: int) -> dict[str, Any]:
    """A JSON schema (an object) of at most max_nodes values (every object, array, member value
    and item counts), nested at most max_depth deep: what a grammar is built from, so its size
    bounds the build's cost."""
    value = _loads(text, max_depth)
    depth, nodes = measure(value)
    _check_depth(depth, max_depth)
    value = _object(value)
    if nodes > max_nodes:
        raise JsonProblem(f"has {nodes} JSON values, more than the limit of {max_nodes}")
    return value


def measure(value: Any) -> tuple[int, int]:
    """(nesting depth, number of values) of a parsed JSON value, without recursion: a scalar is
    depth 0, [] and {} depth 1. One level at a time, so the work per value is one C-level extend."""
    depth = nodes = 0
    level = [value]
    while level:
        nodes += len(level)
        children: list[Any] = []
        containers = False
        for item in level:
            if isinstance(item, dict):
                children.extend(item.values())
                containers = True
            elif isinstance(item, list):
                children.extend(item)
                containers = True
        depth += containers
        level = children
    return depth, nodes


def _loads(text: str, max_depth: int) -> Any:
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise JsonProblem(f"nested more than {max_depth} levels deep, the limit") from None
    except ValueError as exc:     # JSONDecodeError, or a number too long to convert
        raise JsonProblem(f"not valid JSON: {exc}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")     # Python's json reads NaN and Infinity; RFC 8259 does not


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _check_depth(depth: int, max_depth: int) -> None:
    if depth > max_depth:
        raise JsonProblem(f"nested {depth} levels deep, more than the limit of {max_depth}")


def _object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise JsonProblem(f"must be a JSON object, got {type(value).__name__}")
    return value
