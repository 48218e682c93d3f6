"""POST /v1/completions: one llm.v1 Generate call per prompt, streamed as server-sent events or
answered whole.

A completion's choice index is prompt index * n + sample index, as OpenAI numbers a batch of
prompts; a request of more than max_sequences_per_request prompts x n is refused with 400.

`echo` puts the prompt before the completion, and with `logprobs` its tokens before the
completion's in OpenAI's legacy format (the first prompt token's logprob and top entry are null:
nothing predicts it); with max_tokens 0 the answer is the prompt alone. vLLM's `prompt_logprobs`
is each choice's list of the prompt tokens' logprobs. Both need the prompt's token ids, so a
text prompt is tokenized first (the Tokenize call tokenizes as Generate does) and sent as ids.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request, Response

from common.client import Completion, CompletionChunk, RequestError, Usage
from common.logging_setup import request_context
from gateway import outputs
from gateway.json_body import StrictJSONRoute
from gateway.errors import bad_param, from_request_error
from gateway.protocol import CompletionRequest
from gateway.state import Gateway, gateway_of
from gateway.streaming import EventStream, choice_events, gather, opened, unless_disconnected
from gateway.translate import completion_prompts, completion_sampling, generates_nothing, scores_prompt

logger = logging.getLogger(__name__)

ROUTE = "/v1/completions"
router = APIRouter(route_class=StrictJSONRoute)


@router.post(ROUTE)
async def post_completions(req: CompletionRequest, request: Request):
    return outputs.whole(await completions(gateway_of(request), req, request))


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request: what goes to Generate, and what the answer echoes of it."""
    call: str | list[int]
    token_ids: list[int] | None     # known when the answer needs them
    echo: str | None                # the text echoed before each of its choices (echo)


@dataclass(frozen=True)
class Plan:
    """What the answer holds beyond the completions' text."""
    n: int
    logprobs: int | None            # top logprobs of each token shown (None: no logprobs)
    prompt_logprobs: int | None     # vLLM's prompt_logprobs (None: none)
    echo: bool
    scored: bool                    # the prompt's logprobs are asked of the scheduler
    generates_nothing: bool         # max_tokens 0: the one token asked is left out


async def _prompt(gateway: Gateway, prompt: str | list[int], plan: Plan, tokenize: bool) -> Prompt:
    if isinstance(prompt, str):
        ids = await gateway.client.tokenize(prompt) if tokenize else None
        return Prompt(ids if ids is not None else prompt, ids, prompt if plan.echo else None)
    echo = await gateway.client.detokenize(prompt) if plan.echo else None
    return Prompt(prompt, prompt, echo)


async def completions(gateway: Gateway, req: CompletionRequest, request: Request):
    sampling = completion_sampling(req)
    n = sampling.n or 1
    plan = Plan(n, req.logprobs, req.prompt_logprobs, bool(req.echo), scores_prompt(req), generates_nothing(req))
    count = _prompt_count(req.prompt)   # before the prompts are read: their number bounds that work
    if count * n > gateway.config.max_sequences_per_request:
        raise bad_param("prompt", f"a request may ask for at most {gateway.config.max_sequences_per_request} "
                                  f"sequences (prompts x n); this one asks for {count} x {n}")
    texts = completion_prompts(req)
    model = await gateway.check_model(req.model)
    rid = req.request_id or uuid.uuid4().hex
    rids = [rid] if len(texts) == 1 else [f"{rid}-{i}" for i in range(len(texts))]
    base = {"id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()), "model": model}
    continuous = bool(req.stream and req.stream_options and req.stream_options.continuous_usage_stats)
    batch = len(texts) > 1
    with request_context(rid):
        prompts = await asyncio.gather(*(_of_prompt(i, _prompt(gateway, t, plan, plan.scored or continuous), batch)
                                         for i, t in enumerate(texts)))
        if req.stream:
            streams = [_stream_of_prompt(i, gateway.client.stream(p.call, sampling, request_id=r), batch)
                       for i, (p, r) in enumerate(zip(prompts, rids))]
            items = await opened(request, outputs.merge(streams))
            known = sum(len(p.token_ids or ()) for p in prompts)
            return EventStream(choice_events(
                lambda usage: _streamed_choices(gateway, items, prompts, plan, usage), base,
                req.stream_options, lambda usage: gateway.metrics.count_usage(ROUTE, usage), known))
        results: list[Completion] = await unless_disconnected(request, gather(
            [_of_prompt(i, gateway.client.generate(p.call, sampling, request_id=r), batch)
             for i, (p, r) in enumerate(zip(prompts, rids))]))
    usage = outputs.UsageTotal()
    choices = []
    for p, (prompt, result) in enumerate(zip(prompts, results)):
        for sample in result.samples or [result]:
            sample = _trimmed(sample, plan)
            usage.add(sample.usage, first_sample=sample.index == 0)
            choices.append(_encoded(await _whole_choice(gateway, p * n + sample.index, prompt, result, sample, plan)))
            await asyncio.sleep(0)   # the other clients' turn: see _answer
    gateway.metrics.count_usage(ROUTE, usage)
    return _answer(base, choices, usage.to_json())


def _encoded(value: Any) -> bytes:
    """`value` as JSONResponse encodes it."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _answer(base: dict[str, Any], choices: list[bytes], usage: dict[str, Any]) -> Response:
    """The unstreamed answer, {**base, "choices": [...], "usage": usage}, of choices encoded one at a
    time with the event loop let run between them. Built and encoded whole, a loglikelihood batch
    (16 prompts of 4,000 tokens, echo with 20 top logprobs and prompt_logprobs: 120 MB of JSON) held
    the loop that writes every other client's stream for 7 s; a choice at a time, for a choice's."""
    head = _encoded(base)[:-1]   # base's members, without the closing brace
    return Response(b"".join((head, b',"choices":[', b",".join(choices), b'],"usage":', _encoded(usage), b"}")),
                    media_type="application/json")


def _named(error: RequestError, index: int) -> RequestError:
    """A scheduler's refusal of one prompt of a batch, saying which: its message names the call's
    own field (token_ids[0], text), which a batch has one of per prompt."""
    if from_request_error(error).param != "prompt":
        return error
    return RequestError(error.code, f"prompt[{index}]: {error.message}")


async def _of_prompt(index: int, call, batch: bool):
    """`call` (a coroutine) of prompt `index`, whose refusal of the prompt names it in a batch."""
    try:
        return await call
    except RequestError as exc:
        if not batch:
            raise
        raise _named(exc, index) from None


def _stream_of_prompt(index: int, stream: AsyncIterator[CompletionChunk], batch: bool
                      ) -> AsyncIterator[CompletionChunk]:
    """`stream` of prompt `index`, whose refusal of the prompt names it in a batch."""
    if not batch:
        return stream

    async def named() -> AsyncIterator[CompletionChunk]:
        async with contextlib.aclosing(stream):
            try:
                async for chunk in stream:
                    yield chunk
            except RequestError as exc:
                raise _named(exc, index) from None
    return named()


def _prompt_count(prompt: str | list) -> int:
    """How many prompts `prompt` is: one text or one list of token ids, else one per item."""
    return 1 if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else len(prompt)


def _trimmed(sample, plan: Plan):
    """A sample (Completion or CompletionChunk) without its generated token, for max_tokens 0."""
    if not plan.generates_nothing:
        return sample
    usage = sample.usage and Usage(sample.usage.prompt_tokens, 0, sample.usage.cached_prompt_tokens)
    finish = "length" if sample.finish_reason is not None else None
    return dataclasses.replace(sample, text="", token_ids=[], logprobs=[], top_logprobs=None, usage=usage,
                               finish_reason=finish, matched_stop=None)


async def _whole_choice(gateway: Gateway, index: int, prompt: Prompt, first: Completion, sample: Completion,
                        plan: Plan) -> dict[str, Any]:
    """One choice of an unstreamed answer; `first` is sample 0, which holds the prompt's logprobs."""
    choice: dict[str, Any] = {"index": index, "text": (prompt.echo or "") + sample.text, "logprobs": None,
                              "finish_reason": sample.finish_reason, "stop_reason": sample.matched_stop}
    scores = (first.prompt_logprobs or [], first.prompt_top_logprobs)
    if plan.logprobs is not None:
        choice["logprobs"] = await _logprobs(gateway, prompt if plan.echo else None, scores, sample, plan, 0)
    if plan.prompt_logprobs is not None:
        choice["prompt_logprobs"] = await _prompt_logprobs(gateway, prompt, scores, plan)
    return choice


async def _logprobs(gateway: Gateway, echoed: Prompt | None, scores, sample, plan: Plan,
                    text_offset: int) -> dict[str, Any]:
    """OpenAI's legacy logprobs of a sample's tokens, after its echoed prompt's when `echoed`."""
    ids, logprobs, tops = list(sample.token_ids), list(sample.logprobs or []), outputs.cut_tops(
        sample.top_logprobs, plan.logprobs)
    if echoed is not None:
        prompt_logprobs, prompt_tops = scores
        prompt_tops = outputs.cut_tops(prompt_tops, plan.logprobs)
        ids = echoed.token_ids + ids
        logprobs = [None, *prompt_logprobs, *logprobs]
        if plan.logprobs:
            tops = [None, *(prompt_tops or [([], [])] * len(prompt_logprobs)), *(tops or [])]
    texts = await gateway.token_texts.texts(outputs.token_ids_of(ids, [t for t in tops or () if t]))
    return outputs.completion_logprobs(ids, logprobs, tops, texts, text_offset)


async def _prompt_logprobs(gateway: Gateway, prompt: Prompt, scores, plan: Plan) -> list[dict[str, Any] | None]:
    logprobs, tops = scores
    tops = outputs.cut_tops(tops, plan.prompt_logprobs)
    texts = await gateway.token_texts.texts(outputs.token_ids_of(prompt.token_ids, tops))
    return outputs.prompt_logprobs(prompt.token_ids, logprobs, tops, plan.prompt_logprobs, texts)


async def _streamed_choices(gateway: Gateway, items: AsyncIterator[tuple[int, CompletionChunk]],
                            prompts: list[Prompt], plan: Plan,
                            usage: outputs.UsageTotal) -> AsyncIterator[dict[str, Any]]:
    """The choices of a stream, in order per choice. A choice's first event echoes its prompt (and
    carries its prompt_logprobs); the prompt's logprobs come with sample 0's first chunk, so the
    other samples' chunks of a scored prompt wait for it.

    `items` is closed however this ends: a client that leaves while a choice waits for its tokens'
    texts cancels this generator there, not in `items`, which would otherwise be left suspended,
    its gRPC streams running to max_tokens, until the garbage collector found it."""
    scores: dict[int, tuple] = {}      # prompt index -> (logprobs, tops), once known
    held: dict[int, list[CompletionChunk]] = {}
    offsets: dict[int, int] = {}       # choice index -> length of its text so far (logprobs' text_offset)
    async with contextlib.aclosing(items):
        async for p, chunk in items:
            if plan.scored and p not in scores:
                if chunk.index != 0:
                    held.setdefault(p, []).append(chunk)
                    continue
                scores[p] = (chunk.prompt_logprobs or [], chunk.prompt_top_logprobs)
            for ready in [*held.pop(p, []), chunk]:
                async for choice in _chunk_choices(gateway, p, prompts[p], scores.get(p, ([], None)), ready, plan,
                                                   offsets, usage):
                    yield choice


async def _chunk_choices(gateway: Gateway, p: int, prompt: Prompt, scores, chunk: CompletionChunk, plan: Plan,
                         offsets: dict[int, int], usage: outputs.UsageTotal) -> AsyncIterator[dict[str, Any]]:
    index = p * plan.n + chunk.index
    chunk = _trimmed(chunk, plan)
    if index not in offsets:   # the choice's first event: its echo and prompt_logprobs
        offsets[index] = 0
        first: dict[str, Any] = {"index": index, "text": prompt.echo or "", "logprobs": None, "finish_reason": None}
        if plan.echo and plan.logprobs is not None:
            empty = dataclasses.replace(chunk, token_ids=[], logprobs=[], top_logprobs=None)
            first["logprobs"] = await _logprobs(gateway, prompt, scores, empty, plan, 0)
        if plan.prompt_logprobs is not None:
            first["prompt_logprobs"] = await _prompt_logprobs(gateway, prompt, scores, plan)
        offsets[index] = len(first["text"])
        if plan.echo or plan.prompt_logprobs is not None:
            yield first
    choice: dict[str, Any] = {"index": index, "text": chunk.text, "logprobs": None,
                              "finish_reason": chunk.finish_reason}
    if chunk.finish_reason is not None:
        choice["stop_reason"] = chunk.matched_stop
    if plan.logprobs is not None and chunk.token_ids:
        choice["logprobs"] = await _logprobs(gateway, None, scores, chunk, plan, offsets[index])
    offsets[index] += len(chunk.text)
    usage.streamed_tokens += len(chunk.token_ids)
    if chunk.usage is not None:
        usage.add(chunk.usage, first_sample=chunk.index == 0)
    # A chunk whose tokens end inside a UTF-8 character has no text yet: nothing to send.
    if chunk.text or chunk.finish_reason is not None or choice["logprobs"] is not None:
        yield choice
