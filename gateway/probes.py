"""GET /health (the scheduler's grpc.health.v1 answer as 200 or 503) and GET /metrics
(Prometheus' text format). Neither needs an API key: probes and scrapers carry no secrets,
as vLLM's server has it."""
from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from common.client import RequestError
from gateway.errors import error_body
from gateway.state import HEALTH_TIMEOUT_S, gateway_of

logger = logging.getLogger(__name__)

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    """200 while the scheduler reports SERVING on grpc.health.v1, else 503 with its answer."""
    try:
        status = await gateway_of(request).client.health(timeout=HEALTH_TIMEOUT_S)
    except RequestError as exc:
        return JSONResponse(error_body(503, f"the scheduler cannot be asked: {exc}", code=exc.code.lower()),
                            status_code=503)
    if status != "SERVING":
        return JSONResponse(error_body(503, f"the scheduler reports {status}", code=status.lower()), status_code=503)
    return {"status": "ok", "scheduler": status}


@router.get("/metrics")
async def prometheus_metrics(request: Request):
    body, content_type = gateway_of(request).metrics.exposition()
    return Response(body, media_type=content_type)
