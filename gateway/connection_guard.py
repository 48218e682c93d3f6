"""Bounds on the connections a client may hold, so that stalled ones are closed and cannot take
the gateway's sockets: uvicorn's h11 protocol with a header deadline and a connection limit.

A connection that is waiting for a request (a new one, or a kept-alive one between requests) must
send the whole header block within `header_timeout` seconds of when the wait began, however it
trickles the bytes in; else it is closed. A request that arrives while more than
`max_connections` connections are open (or as many requests are in flight) is answered 503 in
OpenAI's error shape. The body's deadline is middleware.BodyDeadline's.
"""
from __future__ import annotations

import asyncio
import json
import logging

import h11
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.errors import error_body

logger = logging.getLogger(__name__)


class GuardedH11Protocol(H11Protocol):
    header_timeout: float = 10.0
    max_connections: int = 512

    def handle_events(self) -> None:
        """As h11's, with a request over the connection limit answered by `_busy`."""
        app = self.app
        if len(self.connections) > self.max_connections or len(self.tasks) >= self.max_connections:
            self.app = self._busy
        try:
            super().handle_events()
        finally:
            self.app = app

    async def _busy(self, scope, receive, send) -> None:
        logger.warning("refusing a request: %d connections open (--max-connections %d)", len(self.connections),
                       self.max_connections)
        body = error_body(503, f"the gateway holds its limit of {self.max_connections} connections; retry later",
                          code="too_many_connections")
        await JSONResponse(body, status_code=503, headers={"connection": "close"})(scope, receive, send)

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse, answered in OpenAI's error shape (uvicorn's is plain text)."""
        body = json.dumps(error_body(400, f"malformed HTTP request: {msg}", code="invalid_http"),
                          separators=(",", ":")).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def _awaiting_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _watch_headers(self) -> None:
        """Arms the deadline when a wait for headers begins (not at each byte); disarms it once a
        request's headers are in."""
        if not self._awaiting_headers():
            self._stop_header_timer()
        elif self._header_timer is None and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self._awaiting_headers() and not self.transport.is_closing():
            logger.info("closing a connection that sent no complete request headers in %g s", self.header_timeout)
            self.transport.close()


def guarded_h11(header_timeout: float, max_connections: int) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn takes (`http=`), with these bounds."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout": header_timeout, "max_connections": max_connections})
