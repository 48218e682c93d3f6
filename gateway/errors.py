"""How a failure becomes an HTTP answer: gRPC status -> HTTP status, and OpenAI's error body.

Every error the gateway returns has OpenAI's shape, so the `openai` client raises its usual
exception classes (BadRequestError for 400, RateLimitError for 429, ...):

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": "invalid_argument"}}

`code` is the gRPC status name in lower case when the scheduler refused the request, or the
gateway's own code (e.g. "model_not_found", "unsupported_parameter") when the gateway did.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from common.client import RequestError

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
_FIELD_PATH = re.compile(
    r"^(sampling\.[a-z_]+|text|token_ids|prompt|tool_choice|(?:messages|tools)(?:\[\d+\])?(?:\.[a-z_]+)*)\b")
_PARAMS = {"text": "prompt", "token_ids": "prompt", "json_schema": "response_format", "json_object": "response_format"}


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
    param = None
    if status == 400 and (match := _FIELD_PATH.match(error.message)):
        path = match.group(1).removeprefix("sampling.")
        param = _PARAMS.get(path, path)
    return GatewayError(status, error.message or error.code, param, error.code.lower())
