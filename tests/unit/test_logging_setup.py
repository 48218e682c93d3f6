"""Text and JSON log lines, and request ids that follow the code handling a request."""
from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
import warnings

import pytest

from common.logging_setup import bind_request_id, request_context, setup_logging

log = logging.getLogger("tests.logging_setup")


@pytest.fixture(autouse=True)
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    hooks = sys.excepthook, threading.excepthook
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    sys.excepthook, threading.excepthook = hooks
    logging.captureWarnings(False)


def json_lines(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().err.splitlines()]


def test_json_lines_carry_the_fields_and_the_request_id_only_when_set(capsys):
    setup_logging("info", "json")
    log.debug("below the level")
    log.info("plain %d", 1)
    with request_context("req-7"):
        log.warning("tagged ü")
    try:
        raise ZeroDivisionError("boom")
    except ZeroDivisionError:
        log.exception("failed")
    plain, tagged, failed = json_lines(capsys)
    assert set(plain) == {"ts", "level", "logger", "msg"}
    assert (plain["level"], plain["logger"], plain["msg"]) == ("INFO", "tests.logging_setup", "plain 1")
    assert plain["ts"].endswith("Z") and len(plain["ts"]) == len("2025-01-01T00:00:00.000Z")
    assert (tagged["level"], tagged["msg"], tagged["request_id"]) == ("WARNING", "tagged ü", "req-7")
    assert "request_id" not in failed and "ZeroDivisionError: boom" in failed["exc"]


def test_text_lines_name_the_request(capsys):
    setup_logging("INFO")
    with request_context("abc"):
        log.info("inside")
    log.info("outside")
    inside, outside = capsys.readouterr().err.splitlines()
    assert inside.endswith("INFO tests.logging_setup: inside [request_id=abc]")
    assert outside.endswith("INFO tests.logging_setup: outside")


def test_setting_up_again_replaces_the_handler(capsys):
    setup_logging("INFO", "text")
    setup_logging("INFO", "json")
    log.info("once")
    assert [line["msg"] for line in json_lines(capsys)] == ["once"]
    with pytest.raises(ValueError, match="log format"):
        setup_logging("INFO", "xml")


def test_contexts_nest_and_an_explicit_id_wins(capsys):
    setup_logging("INFO", "json")
    with request_context("outer"):
        with request_context("inner"):
            log.info("a")
        log.info("b")
        log.info("c", extra={"request_id": "named"})
    log.info("d")
    assert [line.get("request_id") for line in json_lines(capsys)] == ["inner", "outer", "named", None]


def test_ids_stay_in_their_own_task_and_thread(capsys):
    setup_logging("INFO", "json")

    async def handler(request_id: str) -> None:
        bind_request_id(request_id)   # a gRPC aio handler's task ends with its request
        for step in range(3):
            log.info("%s step %d", request_id, step)
            await asyncio.sleep(0)      # interleave the two handlers

    async def both() -> None:
        await asyncio.gather(handler("r1"), handler("r2"))
        log.info("after")               # the tasks' bindings did not leak back

    asyncio.run(both())
    with request_context("main"):
        thread = threading.Thread(target=log.info, args=("from a thread",))
        thread.start()
        thread.join()
    lines = json_lines(capsys)
    assert len(lines) == 8
    for line in lines[:6]:
        assert line["msg"].startswith(line["request_id"] + " ")
    assert [line.get("request_id") for line in lines[6:]] == [None, None]


def test_warnings_and_uncaught_exceptions_in_threads_become_json_lines(capsys):
    setup_logging("INFO", "json")
    warnings.warn("deprecated thing", DeprecationWarning, stacklevel=1)

    def fail() -> None:
        raise RuntimeError("thread broke")

    thread = threading.Thread(target=fail, name="loader")
    thread.start()
    thread.join()
    warning, crash = json_lines(capsys)
    assert warning["logger"] == "py.warnings" and "deprecated thing" in warning["msg"]
    assert crash["level"] == "CRITICAL" and "thread loader" in crash["msg"]
    assert "RuntimeError: thread broke" in crash["exc"]
