"""One log format for every process, and request ids on the lines a request causes.

Text (the default) is for people reading a terminal; json writes one object a line (ts, level,
logger, msg, and request_id / exc when there are any) for log collectors. Python warnings and
uncaught exceptions (in the main thread or any other) go through the same handler, so a json
process writes nothing to stderr that is not a JSON line, save what C libraries print themselves. A request id lives in
a ContextVar, so it follows the code that handles the request, across awaits, and never leaks
into other asyncio tasks or threads: each task starts with a copy of its creator's context.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import threading
import time
from collections.abc import Iterator

LOG_FORMATS = ("text", "json")

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


def bind_request_id(request_id: str | None) -> None:
    """Tags this context's later log lines with request_id, for code whose context ends with
    the request anyway (a gRPC aio handler runs in a task of its own)."""
    _request_id.set(request_id)


@contextlib.contextmanager
def request_context(request_id: str | None) -> Iterator[None]:
    """Tags the log lines of the enclosed block with request_id, then restores the previous one."""
    token = _request_id.set(request_id)
    try:
        yield
    finally:
        _request_id.reset(token)


class _RequestIdFilter(logging.Filter):
    """Stamps each record with the request id of the context that logged it, unless the call
    named one (`extra={"request_id": ...}`, for a loop that serves many requests in one task).
    It sits on the handler, so only records that pass the level check pay for it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = _request_id.get()
        return True


class _TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        request_id = getattr(record, "request_id", None)
        return f"{line} [request_id={request_id}]" if request_id else line


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            # UTC with milliseconds, ISO 8601: sorts as text and parses everywhere.
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id:
            entry["request_id"] = request_id
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        elif record.stack_info:
            entry["exc"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Configures the root logger to write `fmt` lines to stderr; calling it again replaces the
    previous setup instead of adding a second handler."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    handler.addFilter(_RequestIdFilter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_uncaught_in_thread


def _log_uncaught(exc_type, exc, tb) -> None:
    if issubclass(exc_type, KeyboardInterrupt):   # Ctrl-C stays the usual one-line exit
        sys.__excepthook__(exc_type, exc, tb)
        return
    logging.getLogger("uncaught").critical("uncaught exception: %s", exc_type.__name__, exc_info=(exc_type, exc, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread else "?"
    logging.getLogger("uncaught").critical("uncaught exception in thread %s: %s", name, args.exc_type.__name__,
                                           exc_info=(args.exc_type, args.exc_value, args.exc_traceback))
