"""The gateway's HTTP application (FastAPI): the app factory that puts the middlewares, the error
handlers and the endpoint families together over one llm.v1 connection to the scheduler.

Guarantees (each where its module says):
- every error is OpenAI's error body with an HTTP status mapped from the gRPC status (errors.py);
- a client that disconnects cancels the gRPC calls behind its request at once (streaming.py);
- a request body over max_request_bytes, or of more JSON values than max_request_values, is
  refused with 413 before it is read whole (and so before it is parsed), and
  every path but /health and /metrics requires `Authorization: Bearer KEY` when API keys are
  configured (middleware.py);
- /metrics counts every request, refusals included (metrics.py: its middleware is outermost).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.routing import APIRoute

from common.client import AsyncClient
from gateway import chat, completions, models, probes, responses, tokenize
from gateway.errors import install_handlers
from gateway.metrics import GatewayMetrics, HttpMetrics
from gateway.middleware import ApiKeyCheck, BodyDeadline, BodyLimit
from gateway.state import Gateway, GatewayConfig

logger = logging.getLogger(__name__)

__all__ = ["GatewayConfig", "create_app"]

OPEN_PATHS = ("/health", "/metrics")   # no API key: probes and scrapers carry no secrets


def create_app(config: GatewayConfig, client_factory: Callable[[], AsyncClient] | None = None) -> FastAPI:
    """The application; `client_factory` makes its scheduler client (tests give a fake one)."""
    metrics = GatewayMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # The gRPC aio channel belongs to the server's event loop: made here, not before.
        app.state.gateway = Gateway(config, metrics, client_factory() if client_factory else None)
        try:
            yield
        finally:
            await app.state.gateway.close()

    app = FastAPI(title="qwen3-serve OpenAI-compatible gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    if config.api_keys:
        app.add_middleware(ApiKeyCheck, keys=config.api_keys, open_paths=OPEN_PATHS)
    if config.max_request_bytes or config.max_request_values:
        app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes, max_values=config.max_request_values)
    if config.body_timeout:
        app.add_middleware(BodyDeadline, seconds=config.body_timeout)
    app.add_middleware(HttpMetrics, metrics=metrics)   # added last: outermost, so refusals count too
    install_handlers(app)
    for family in (completions, chat, responses, models, tokenize, probes):
        app.include_router(family.router)
        for route in family.router.routes:
            # HEAD as GET without the body (the server leaves it out), as RFC 9110 asks of every server
            # and Starlette's own routes do; FastAPI's answer 405, and an uptime monitor probing /health
            # by HEAD took the gateway for down. A route of its own: the schema lists GET alone.
            if isinstance(route, APIRoute) and "GET" in route.methods:
                app.add_api_route(route.path, route.endpoint, methods=["HEAD"], include_in_schema=False)
    return app
