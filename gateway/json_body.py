"""Request bodies read as JSON and nothing else: Python's json.loads also takes NaN, Infinity and
-Infinity, and reads 1e999 as an infinity, none of which JSON has and none of which a reply can
carry back (a Responses reply echoes the request's tools). The routes of the endpoints that take a
body read it with StrictJSONRoute, which refuses such a number as an unreadable body (400
invalid_json, naming it: gateway/errors.py)."""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute


class NonFiniteNumber(ValueError):
    def __init__(self, text: str, param: str | None = None) -> None:
        super().__init__(f"the request body holds the number {text[:40]}{f' at {param}' if param else ''}, "
                         f"which JSON does not have (NaN and the infinities are not JSON)")
        self.text, self.param = text, param


def _constant(text: str):
    raise NonFiniteNumber(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NonFiniteNumber(text)
    return value


def loads(body: bytes | str) -> Any:
    """The body's JSON; NonFiniteNumber (naming where it sits) for NaN, Infinity or 1e999."""
    try:
        return json.loads(body, parse_constant=_constant, parse_float=_float)
    except NonFiniteNumber as exc:
        raise NonFiniteNumber(exc.text, _path_of_non_finite(json.loads(body))) from None


def _path_of_non_finite(value: Any) -> str | None:
    """Where the first non-finite number of a parsed body sits ("tools[0].parameters.a"), found
    without recursion (bodies nest as deep as the parser allows)."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return path or None
        if isinstance(item, dict):
            stack.extend((f"{path}.{key}" if path else str(key), v) for key, v in reversed(list(item.items())))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(item))))
    return None


class _StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(_StrictJSONRequest(request.scope, request.receive))

        return strict
