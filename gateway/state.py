"""What the routes share: the gateway's configuration and its state (the scheduler connection, the
served model's name, the token-text cache and the metrics), one `Gateway` per running app.

The gateway holds no model files: everything about the model is asked of the scheduler.
"""
from __future__ import annotations

import logging
import time

from fastapi import Request

from common.client import AsyncClient, ModelInfo
from gateway.errors import GatewayError
from gateway.config import GatewayConfig
from gateway.metrics import GatewayMetrics
from gateway.token_text import TokenTexts

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 5.0


class Gateway:
    """The state behind the routes: the scheduler connection, the served model's name, the
    cache of token texts (for logprobs) and the metrics."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics | None = None,
                 client: AsyncClient | None = None) -> None:
        self.config = config
        self.metrics = metrics or GatewayMetrics()
        self.client = client or AsyncClient(config.target, timeout=config.request_timeout, **config.client_options)
        self.token_texts = TokenTexts(self.client)
        self.created = int(time.time())
        self._model: ModelInfo | None = None

    async def close(self) -> None:
        await self.client.close()

    async def model_info(self, *, fresh: bool = False) -> ModelInfo:
        """The scheduler's model info; its name and length are asked once (a scheduler keeps its
        model for its life), `fresh` asks again (the worker groups' state changes)."""
        if self._model is None or fresh:
            self._model = await self.client.model_info(timeout=HEALTH_TIMEOUT_S)
        return self._model

    async def model_name(self) -> str:
        return (await self.model_info()).model

    async def check_model(self, requested: str | None) -> str:
        name = await self.model_name()
        if requested not in (None, "", name):
            shown = requested if len(requested) <= 64 else f"{requested[:64]}..."   # the name, not an echo of any size
            raise GatewayError(404, f"The model {shown!r} does not exist; this server serves {name!r}",
                               "model", "model_not_found")
        return name


def gateway_of(request: Request) -> Gateway:
    """The Gateway of the app serving `request` (set by the app's lifespan)."""
    return request.app.state.gateway
