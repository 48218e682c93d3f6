"""POST /v1/completions: one llm.v1 Generate call per prompt, streamed as server-sent events or
answered whole.

A completion's choice index is prompt index * n + sample index, as OpenAI numbers a batch of
prompts; a request of more than max_sequences_per_request prompts x n is refused with 400.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from common.client import Completion, CompletionChunk
from common.logging_setup import request_context
from gateway import outputs
from gateway.errors import bad_param
from gateway.protocol import CompletionRequest
from gateway.state import Gateway, gateway_of
from gateway.streaming import EventStream, choice_events, gather, opened, unless_disconnected
from gateway.translate import completion_prompts, completion_sampling

logger = logging.getLogger(__name__)

ROUTE = "/v1/completions"
router = APIRouter()


@router.post(ROUTE)
async def post_completions(req: CompletionRequest, request: Request):
    return await completions(gateway_of(request), req, request)


async def completions(gateway: Gateway, req: CompletionRequest, request: Request):
    sampling = completion_sampling(req)
    prompts = completion_prompts(req)
    n = sampling.n or 1
    if len(prompts) * n > gateway.config.max_sequences_per_request:
        raise bad_param("prompt", f"a request may ask for at most {gateway.config.max_sequences_per_request} "
                                  f"sequences (prompts x n); this one asks for {len(prompts)} x {n}")
    model = await gateway.check_model(req.model)
    rid = req.request_id or uuid.uuid4().hex
    rids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
    base = {"id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()), "model": model}
    with request_context(rid):
        if req.stream:
            streams = [gateway.client.stream(p, sampling, request_id=r) for p, r in zip(prompts, rids)]
            items = await opened(outputs.merge(streams))
            return EventStream(choice_events(
                lambda usage: _completion_choices(gateway, items, n, bool(sampling.logprobs), usage), base,
                req.stream_options, lambda usage: gateway.metrics.count_usage(ROUTE, usage)))
        results: list[Completion] = await unless_disconnected(request, gather(
            [gateway.client.generate(p, sampling, request_id=r) for p, r in zip(prompts, rids)]))
    usage = outputs.UsageTotal()
    choices = []
    for p, result in enumerate(results):
        for sample in result.samples or [result]:
            usage.add(sample.usage, first_sample=sample.index == 0)
            logprobs = None
            if sampling.logprobs:
                texts = await gateway.token_texts.texts(outputs.token_ids_of(sample.token_ids, sample.top_logprobs))
                logprobs = outputs.completion_logprobs(sample.token_ids, sample.logprobs or [], sample.top_logprobs,
                                                       texts, 0)
            choices.append({"index": p * n + sample.index, "text": sample.text, "logprobs": logprobs,
                            "finish_reason": sample.finish_reason, "stop_reason": sample.matched_stop})
    gateway.metrics.count_usage(ROUTE, usage)
    return {**base, "choices": choices, "usage": usage.to_json()}


async def _completion_choices(gateway: Gateway, items: AsyncIterator[tuple[int, CompletionChunk]], n: int,
                              logprobs: bool, usage: outputs.UsageTotal) -> AsyncIterator[dict[str, Any]]:
    offsets: dict[int, int] = {}   # choice index -> length of its text so far (logprobs' text_offset)
    async for p, chunk in items:
        index = p * n + chunk.index
        choice: dict[str, Any] = {"index": index, "text": chunk.text, "logprobs": None,
                                  "finish_reason": chunk.finish_reason}
        if chunk.finish_reason is not None:
            choice["stop_reason"] = chunk.matched_stop
        if logprobs and chunk.token_ids:
            texts = await gateway.token_texts.texts(outputs.token_ids_of(chunk.token_ids, chunk.top_logprobs))
            choice["logprobs"] = outputs.completion_logprobs(chunk.token_ids, chunk.logprobs or [],
                                                             chunk.top_logprobs, texts, offsets.get(index, 0))
        offsets[index] = offsets.get(index, 0) + len(chunk.text)
        if chunk.usage is not None:
            usage.add(chunk.usage, first_sample=chunk.index == 0)
        # A chunk whose tokens end inside a UTF-8 character has no text yet: nothing to send.
        if chunk.text or chunk.finish_reason is not None or choice["logprobs"] is not None:
            yield choice
