"""How a failure becomes an HTTP answer: gRPC status -> HTTP status, OpenAI's error body, and the
app's exception handlers (pydantic's complaint about a body as one 400 naming the parameter).

Every error the gateway returns has OpenAI's shape, so the `openai` client raises its usual
exception classes (BadRequestError for 400, RateLimitError for 429, ...):

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": "invalid_argument"}}

`code` is the gRPC status name in lower case when the scheduler refused the request, or the
gateway's own code (e.g. "model_not_found", "unsupported_parameter") when the gateway did.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.client import RequestError
from common.strict_json import JsonProblem, utf8_safe

logger = logging.getLogger(__name__)

# gRPC status name -> HTTP status. CANCELLED is nginx's 499 (the client closed the request): it
# can only be seen by a client that is gone, and then only in the access log.
HTTP_STATUS = {
    "OK": 200,
    "CANCELLED": 499,
    "UNKNOWN": 500,
    "INVALID_ARGUMENT": 400,
    "DEADLINE_EXCEEDED": 504,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "PERMISSION_DENIED": 403,
    "RESOURCE_EXHAUSTED": 429,
    "FAILED_PRECONDITION": 400,
    "ABORTED": 409,
    "OUT_OF_RANGE": 400,
    "UNIMPLEMENTED": 501,
    "INTERNAL": 500,
    "UNAVAILABLE": 503,
    "DATA_LOSS": 500,
    "UNAUTHENTICATED": 401,
}

# HTTP status -> OpenAI's error type.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    429: "rate_limit_error",
    501: "not_implemented_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}

# The scheduler's messages start with the path of the field they refuse ("sampling.top_p must be
# in (0, 1], got 1.5"); the OpenAI parameter behind each path, for the error's `param`.
_FIELD_PATH = re.compile(r"^(sampling\.[a-z_]+|text|token_ids|prompt|tool_choice|request_id|"
                         r"(?:messages|tools)(?:\[\d+\])?(?:\.[a-z_]+(?:\[\d+\])?)*)\b")
_PARAMS = {"text": "prompt", "token_ids": "prompt", "json_schema": "response_format", "json_object": "response_format",
           "regex": "structured_outputs", "grammar": "structured_outputs"}
# A chat's tools and calls are flat llm.v1 messages (tools[0].name); the chat endpoint nests their
# fields under `function` (tools[0].function.name), which the param, and the message, then name.
_CHAT_FIELD = re.compile(r"^((?:tools|messages\[\d+\]\.tool_calls)\[\d+\])\.(name|description|parameters_json|"
                         r"arguments_json)$")
_CHAT_FIELDS = {"parameters_json": "parameters", "arguments_json": "arguments"}


@dataclass
class GatewayError(Exception):
    """A request the gateway refuses or could not serve; `param` names the request field at fault."""
    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def bad_param(param: str, message: str, code: str = "invalid_parameter") -> GatewayError:
    return GatewayError(400, message, param, code)


def unsupported(param: str, why: str) -> GatewayError:
    """A parameter the API cannot honour: a clear 400, never a silent drop."""
    return GatewayError(400, f"{param} is not supported: {why}", param, "unsupported_parameter")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def from_request_error(error: RequestError) -> GatewayError:
    """The HTTP form of a failed gRPC call to the scheduler."""
    status = HTTP_STATUS.get(error.code, 500)
    param, message = None, error.message or error.code
    if 400 <= status < 500 and (match := _FIELD_PATH.match(error.message)):   # 409: a request_id in flight
        path = match.group(1).removeprefix("sampling.")
        param = _PARAMS.get(path, path)
        if field := _CHAT_FIELD.match(path):
            param = f"{field.group(1)}.function.{_CHAT_FIELDS.get(field.group(2), field.group(2))}"
            message = param + message[match.end():]
    return GatewayError(status, message, param, error.code.lower())


class ClientGone(Exception):
    """The client closed the connection before its (unstreamed) answer was ready."""


def _field(error: dict[str, Any]) -> Any:
    """The top-level request field a pydantic error is about (None: the body itself)."""
    return next((part for part in error.get("loc", ()) if part != "body"), None)


def validation_error(exc: RequestValidationError, required: Sequence[str] = ()) -> GatewayError:
    """pydantic's complaint about a request body as one 400 naming the first field at fault; a body
    that is no JSON object (empty, an array, ...) names the first of the `required` fields."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    # A union's members each complain about the field: the one whose path goes deepest matched the
    # value furthest, and that the value is not of a member's type says least.
    first = min([e for e in errors if _field(e) == _field(first)] or [first],
                key=lambda e: (-len(e.get("loc", ())), e.get("type", "").endswith("_type")))
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        why = first.get("ctx", {}).get("error", "")
        return GatewayError(400, f"the request body is not valid JSON: {why}".rstrip(": "), None, "invalid_json")
    if not loc and first.get("type") == "string_unicode":   # a field's name, not a field, is not text
        return GatewayError(400, "a field name in the request body holds a lone UTF-16 surrogate, which UTF-8 cannot "
                                 "carry", None, "invalid_parameter")
    if not loc:
        names = ", ".join(required) or "its parameters"
        return GatewayError(400, f"the request body must be a JSON object with {names}",
                            required[0] if required else None, "missing_parameter")
    # Unions report every alternative's path (messages.0.content.str); keep the field's own path.
    param = ""
    for part in loc:
        if part.isdigit():
            param += f"[{part}]"
        elif part == "NamedFunction":   # the Responses tool_choice's object: its fields are named within it
            continue
        elif part in ("str", "int", "list[str]", "list[int]", "list[list[int]]", "NamedToolChoice") or "[" in part \
                or part.startswith("literal"):
            break
        else:
            param += f".{part}" if param else part
    if first.get("type") == "extra_forbidden":
        return GatewayError(400, f"unrecognized request argument: {param}", param or None, "unknown_parameter")
    if first.get("type") == "missing":
        return GatewayError(400, f"{param} is required", param or None, "missing_parameter")
    return GatewayError(400, f"{param}: {first.get('msg', 'invalid value')}", param or None, "invalid_parameter")


def _respond(error: GatewayError) -> JSONResponse:
    return JSONResponse(_encodable(error.body()), status_code=error.status)


def _encodable(value):
    """An error body whose texts UTF-8 can carry: a lone surrogate from the request (a \\ud800 in
    a name that a message quotes) as its escape, not a reply that cannot be written."""
    if isinstance(value, str):
        return utf8_safe(value)
    if isinstance(value, dict):
        return {key: _encodable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_encodable(item) for item in value]
    return value


async def _on_gateway_error(_request: Request, exc: GatewayError) -> JSONResponse:
    return _respond(exc)


async def _on_request_error(_request: Request, exc: RequestError) -> JSONResponse:
    error = from_request_error(exc)
    if error.status >= 500:
        logger.warning("scheduler call failed: %s", exc)
    return _respond(error)


def _required_fields(request: Request) -> list[str]:
    """The required fields of the body model of the route that `request` reached."""
    body = getattr(request.scope.get("route"), "body_field", None)
    model = getattr(getattr(body, "field_info", None), "annotation", None)
    fields = getattr(model, "model_fields", {})
    return [name for name, f in fields.items() if f.is_required()]


def _media_refusal(request: Request, whole_body_refused: bool) -> GatewayError | None:
    """415 for a body the gateway cannot read as JSON by its headers: a Content-Encoding (gzip, ...)
    or a Content-Type other than JSON; None when the headers are fine."""
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        return GatewayError(415, f"Content-Encoding {encoding[:40]!r} is not supported: send the body uncompressed",
                            None, "unsupported_content_encoding")
    kind = request.headers.get("content-type")
    if kind is None:
        has_body = request.headers.get("content-length", "0") != "0" or "transfer-encoding" in request.headers
        if not (whole_body_refused and has_body):
            return None
    else:
        media = kind.partition(";")[0].strip().lower()
        if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
            return None
    return GatewayError(415, f"the request body must be JSON sent with Content-Type: application/json, "
                             f"got {kind[:60] if kind is not None else 'none'!r}", None, "unsupported_media_type")


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    whole_body = any(not [p for p in e.get("loc", ()) if p != "body"] for e in exc.errors())
    refusal = _media_refusal(request, whole_body)
    return _respond(refusal or validation_error(exc, _required_fields(request)))


def _unparsable_body(cause: BaseException | None) -> str:
    """What was wrong with a body that json.loads could not even read as text or build."""
    if isinstance(cause, UnicodeDecodeError):
        return f"the request body is not UTF-8 JSON: byte {cause.start} is {cause.reason}"
    if isinstance(cause, RecursionError):
        return "the request body nests its JSON deeper than the parser allows"
    if isinstance(cause, JsonProblem):     # a number JSON does not have (gateway/json_body.py)
        where = f" at {cause.path}" if cause.path else ""
        return (f"the request body holds the number {cause.number[:40]}{where}, "
                f"which JSON does not have (NaN and the infinities are not JSON)")
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return "the request body holds an integer of more digits than the parser allows"
    return "the request body is not valid JSON"


_HTTP_CODES = {400: "invalid_json", 408: "request_timeout", 413: "request_too_large"}
_BODY_NOT_PARSED = "There was an error parsing the body"   # FastAPI's, for what json.loads raised


async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 400 and exc.detail == _BODY_NOT_PARSED:
        cause = exc.__cause__
        param = cause.path if isinstance(cause, JsonProblem) else None
        return _respond(_media_refusal(request, True) or GatewayError(400, _unparsable_body(cause), param,
                                                                      "invalid_json"))
    code = _HTTP_CODES.get(exc.status_code)
    return JSONResponse(error_body(exc.status_code, str(exc.detail), code=code), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


async def _on_client_gone(_request: Request, _exc: ClientGone) -> JSONResponse:
    return JSONResponse(error_body(499, "the client closed the request", code="cancelled"), status_code=499)


async def _on_unexpected(_request: Request, exc: Exception) -> JSONResponse:
    logger.exception("request failed")   # the details go to the log, not to the client
    return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}", code="internal"), status_code=500)


def install_handlers(app: FastAPI) -> None:
    """Every exception a route raises becomes OpenAI's error body with its HTTP status."""
    app.add_exception_handler(GatewayError, _on_gateway_error)
    app.add_exception_handler(RequestError, _on_request_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(ClientGone, _on_client_gone)
    app.add_exception_handler(Exception, _on_unexpected)
