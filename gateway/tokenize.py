"""POST /tokenize and POST /detokenize, as vLLM's server has them, over the scheduler's own
tokenizer (llm.v1 Tokenize / Detokenize): a text's token ids, as a text prompt is tokenized, and
the text of token ids. A chat's messages are not tokenized here: the scheduler renders them
(its template) only as part of a Chat call. Both need the API key, as /v1/* does.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from fastapi import APIRouter, Request

from common.client import RequestError
from gateway import outputs
from gateway.json_body import StrictJSONRoute
from gateway.errors import from_request_error, unsupported
from gateway.protocol import Ids, Items, _Strict
from gateway.state import gateway_of
from gateway.translate import UINT32, wire_int

logger = logging.getLogger(__name__)

router = APIRouter(route_class=StrictJSONRoute)
PATHS = ("/tokenize", "/detokenize")


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: Items[Any] | None = None       # refused: chats are rendered by the scheduler's Chat call
    add_special_tokens: bool = True          # what the tokenizer's post-processor adds (nothing for Qwen3)
    return_token_strs: bool | None = False   # each token's text too


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: Ids


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request):
    gateway = gateway_of(request)
    if req.messages is not None:
        raise unsupported("messages", "a chat is rendered by the scheduler only within a chat completion; "
                                      "tokenize a prompt")
    await gateway.check_model(req.model)
    ids = await gateway.client.tokenize(req.prompt or "", add_special_tokens=req.add_special_tokens)
    info = await gateway.model_info()
    answer = {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids, "token_strs": None}
    if req.return_token_strs:
        texts = await gateway.token_texts.texts(ids)
        answer["token_strs"] = list(map(texts.__getitem__, ids))
    return outputs.whole(answer)


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request):
    gateway = gateway_of(request)
    low, high = UINT32
    if req.tokens and not low <= min(req.tokens) <= max(req.tokens) <= high:   # one C-speed pass when all fit
        i = next(i for i, token in enumerate(req.tokens) if not low <= token <= high)
        wire_int(req.tokens[i], f"tokens[{i}]", UINT32)
    await gateway.check_model(req.model)
    try:
        return outputs.whole({"prompt": await gateway.client.detokenize(req.tokens)})
    except RequestError as exc:   # the scheduler names its token_ids, which are this route's tokens
        error = from_request_error(exc)
        raise dataclasses.replace(error, param="tokens") if error.param == "prompt" else error from None
