"""GET /v1/models and /v1/models/{id}: the one model the scheduler serves, as OpenAI's model card
(with vLLM's max_model_len)."""
from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request

from gateway.errors import GatewayError
from gateway.state import Gateway, gateway_of

logger = logging.getLogger(__name__)

router = APIRouter()


async def model_card(gateway: Gateway) -> dict[str, Any]:
    info = await gateway.model_info(fresh=True)
    return {"id": info.model, "object": "model", "created": gateway.created, "owned_by": "qwen3-serve",
            "root": info.model, "parent": None, "max_model_len": info.max_model_len}


@router.get("/v1/models")
async def list_models(request: Request):
    return {"object": "list", "data": [await model_card(gateway_of(request))]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request):
    card = await model_card(gateway_of(request))
    if model_id != card["id"]:
        raise GatewayError(404, f"The model {model_id!r} does not exist; this server serves {card['id']!r}",
                           "model", "model_not_found")
    return card
