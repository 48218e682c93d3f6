"""Prometheus metrics of the gateway, served at its own /metrics (prometheus-client's text format).

HTTP requests by route, method and status; requests in progress; each request's time to the
first byte of its body (a stream's first chunk: the time to first token as the HTTP client sees
it) and to its last byte (a stream's [DONE]); the tokens of finished samples, as their usage
reports them. Routes are the gateway's own paths and "other", methods the standard ones and
"other", statuses the ones the gateway answers with: a client cannot grow the label set. The scheduler's /metrics (--metrics-port) counts the same requests from the inside.
"""
from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/tokenize", "/detokenize",
           "/health", "/metrics")
_METHODS = frozenset({"GET", "POST", "HEAD", "OPTIONS", "PUT", "DELETE", "PATCH"})


def route_of(path: str) -> str:
    """The label of a request path: one of the gateway's routes, or "other"."""
    if path in _ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return "other"


def method_of(method: str) -> str:
    """The label of an HTTP method: one of the standard ones, or "other"."""
    return method if method in _METHODS else "other"


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("llm_gateway_http_requests", "HTTP requests answered, by route, method and status",
                                ["route", "method", "status"], registry=r)
        self.in_progress = Gauge("llm_gateway_http_requests_in_progress", "HTTP requests being answered",
                                 ["route"], registry=r)
        self.first_byte = Histogram("llm_gateway_http_time_to_first_byte_seconds",
                                    "Arrival to the first byte of the response body (a stream's first chunk)",
                                    ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("llm_gateway_http_request_duration_seconds",
                                  "Arrival to the last byte of the response (a stream's [DONE])",
                                  ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("llm_gateway_prompt_tokens", "Prompt tokens of finished requests (once a prompt)",
                                     ["route"], registry=r)
        self.cached_prompt_tokens = Counter("llm_gateway_cached_prompt_tokens",
                                            "Prompt tokens served from the scheduler's prefix cache", ["route"],
                                            registry=r)
        self.completion_tokens = Counter("llm_gateway_completion_tokens", "Tokens generated for finished samples",
                                         ["route"], registry=r)

    def count_usage(self, route: str, usage) -> None:
        """Adds a request's usage (outputs.UsageTotal) to the token counters."""
        self.prompt_tokens.labels(route).inc(usage.prompt_tokens)
        self.cached_prompt_tokens.labels(route).inc(usage.cached_tokens)
        self.completion_tokens.labels(route).inc(usage.completion_tokens)

    def exposition(self) -> tuple[bytes, str]:
        """The body and content type of a scrape."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class HttpMetrics:
    """A plain ASGI middleware (as ApiKeyCheck, so a client's disconnect still reaches the routes)
    that times and counts every HTTP request. Outermost, so refusals (401) are counted too; a
    request whose handler raised before any response counts as status 500."""

    def __init__(self, app, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        m = self.metrics
        route = route_of(scope["path"])
        start = time.perf_counter()
        status = 500
        first_byte = False

        async def timed_send(message) -> None:
            nonlocal status, first_byte
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not first_byte and message.get("body"):
                first_byte = True
                m.first_byte.labels(route).observe(time.perf_counter() - start)
            await send(message)

        m.in_progress.labels(route).inc()
        try:
            await self.app(scope, receive, timed_send)
        finally:
            m.in_progress.labels(route).dec()
            m.requests.labels(route, method_of(scope["method"]), str(status)).inc()
            m.duration.labels(route).observe(time.perf_counter() - start)
