"""scheduler_svc.frontend.process.wait_attached: a frontend listens on the shared public port only
once the engine core's first status is in (else the kernel could hand it a connection it refuses as
UNAVAILABLE while the other frontends serve), and never waits on a core that went away, nor past
its timeout."""
from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

from scheduler_svc.frontend.process import wait_attached


def _frontend() -> SimpleNamespace:
    return SimpleNamespace(attached=asyncio.Event())


def test_it_returns_as_the_first_status_arrives():
    async def scenario():
        frontend = _frontend()
        events = asyncio.create_task(asyncio.sleep(60))   # the event stream, still running
        asyncio.get_running_loop().call_later(0.05, frontend.attached.set)
        started = time.monotonic()
        attached = await wait_attached(frontend, events, timeout_s=30)
        events.cancel()
        return attached, time.monotonic() - started

    attached, waited = asyncio.run(scenario())
    assert attached and waited < 10


def test_a_core_that_went_away_ends_the_wait_at_once(caplog):
    async def scenario():
        frontend = _frontend()

        async def lost():
            raise ConnectionError("no engine core")

        events = asyncio.create_task(lost())
        started = time.monotonic()
        attached = await wait_attached(frontend, events, timeout_s=30)
        return attached, time.monotonic() - started, events

    with caplog.at_level(logging.WARNING, logger="scheduler_svc.frontend.process"):
        attached, waited, events = asyncio.run(scenario())
    assert not attached and waited < 10 and isinstance(events.exception(), ConnectionError)
    assert "listening regardless" in caplog.text


def test_past_the_timeout_it_listens_regardless(caplog):
    async def scenario():
        events = asyncio.create_task(asyncio.sleep(60))
        attached = await wait_attached(_frontend(), events, timeout_s=0.05)
        events.cancel()
        return attached

    with caplog.at_level(logging.WARNING, logger="scheduler_svc.frontend.process"):
        assert asyncio.run(scenario()) is False
    assert "no status from the engine core after 0 s" in caplog.text
