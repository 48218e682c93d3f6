"""JSON as RFC 8259 reads it, for every text a client sends (HTTP bodies, schemas, tool parameters,
tool-call arguments). Python's json.loads also takes NaN, Infinity and -Infinity, and reads a
number past a float's range (1e999) as an infinity; `loads` refuses them. Whatever the text, a
problem is one JsonProblem whose message reads after a field's name ("not valid JSON: ...",
"nested ... deep"), never a RecursionError; the caller names the field and picks the status.
Stdlib only: the gateway, the scheduler and the worker all read it.
"""
from __future__ import annotations

import json
import math
from typing import Any


class JsonProblem(ValueError):
    """Why a text is refused. `number` is the text of a number JSON does not have and `path` where
    it sits ("tools[0].parameters.a"; None at the top or when not known); the parser's own error,
    for a text that is not JSON at all, is the `__cause__`."""

    def __init__(self, message: str, *, number: str | None = None, path: str | None = None) -> None:
        super().__init__(message)
        self.number, self.path = number, path


class _NonJsonNumber(ValueError):
    def __init__(self, number: str, problem: str) -> None:
        super().__init__(problem)
        self.number = number


def loads(text: str | bytes, *, max_depth: int | None = None) -> Any:
    """The value of `text`. JsonProblem for invalid JSON, a number JSON does not have, or nesting
    deeper than max_depth (or than the parser's recursion allows, whatever max_depth)."""
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except _NonJsonNumber as exc:
        raise JsonProblem(f"not valid JSON: {exc}", number=exc.number, path=_path_of_non_finite(text)) from None
    except RecursionError as exc:
        limit = f"more than {max_depth} levels deep, the limit" if max_depth is not None \
            else "deeper than the parser allows"
        raise JsonProblem(f"nested {limit}") from exc
    except ValueError as exc:     # JSONDecodeError, UnicodeDecodeError, or an integer too long to convert
        raise JsonProblem(f"not valid JSON: {exc}") from exc
    if max_depth is not None and (depth := measure(value)[0]) > max_depth:
        raise JsonProblem(f"nested {depth} levels deep, more than the limit of {max_depth}")
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


def _no_constant(name: str) -> Any:
    raise _NonJsonNumber(name, f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)     # a JSON number's text is never NaN; past a float's range it is an infinity
    if math.isinf(value):
        raise _NonJsonNumber(text, f"number {text[:40]} is out of range")
    return value


class _Members(list):
    """An object's members in the text's order, duplicate keys included."""


def _path_of_non_finite(text: str | bytes) -> str | None:
    """Where the first non-finite number of `text` sits, from Python's own reading of it; None
    when that reading fails."""
    try:
        value = json.loads(text, object_pairs_hook=_Members)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:     # depth first in the text's order, without recursion
        path, item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return path or None
        if isinstance(item, _Members):
            stack.extend((f"{path}.{_shown(key)}" if path else _shown(key), v) for key, v in reversed(item))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(item))))
    return None


def _shown(key: str, limit: int = 64) -> str:
    """A member's name as a path shows it: at most `limit` characters, a lone UTF-16 surrogate
    (which JSON's \\u escapes can spell and UTF-8 cannot carry back) as its escape."""
    return utf8_safe(key if len(key) <= limit else key[:limit] + "...")


def utf8_safe(text: str) -> str:
    """`text` with each lone UTF-16 surrogate (which JSON's \\u escapes can spell and UTF-8 cannot
    carry) as its backslash escape; any other text unchanged."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
