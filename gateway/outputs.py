"""What the endpoints' responses share: usage, OpenAI's two logprobs formats (and vLLM's
prompt_logprobs), SSE framing, and the merge of several gRPC streams into one (a batch of
prompts, streamed).

Every number is JSON: a logprob of minus infinity (a token a constraint or a bias rules out) is
sent as -9999.0, as OpenAI sends it, and `sse` refuses any other non-finite number.

Usage of a request with n samples counts the prompt once (every sample's usage names the same
prompt, and the samples after the first find it in the prefix cache) and adds up the samples'
completion tokens, as OpenAI counts it; a batch of prompts adds up its prompts.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi.responses import JSONResponse, Response

from common.client import TopLogprobs, Usage

DONE = "data: [DONE]\n\n"
MIN_LOGPROB = -9999.0   # what OpenAI sends for a logprob of minus infinity


# Characters JSON leaves as they are that str.splitlines() (and so clients reading a stream's lines with
# it, httpx's iter_lines among them) takes for line breaks, cutting an event in two: escaped in events.
_LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: dict[str, Any], event: str | None = None) -> str:
    data = json.dumps(payload, ensure_ascii=False, separators=(',', ':'), allow_nan=False)
    if not data.isascii():
        data = data.translate(_LINE_BREAKS_JSON_KEEPS)
    return f"event: {event}\ndata: {data}\n\n" if event else f"data: {data}\n\n"


def whole(answer: dict[str, Any] | Response) -> Response:
    """An endpoint's answer as the response to send: a whole answer is encoded by json.dumps alone,
    not first walked value by value in Python by FastAPI (jsonable_encoder took 5 s for a
    million token ids, on the event loop that writes every stream)."""
    return answer if isinstance(answer, Response) else JSONResponse(answer)


def finite(logprob: float) -> float:
    """A logprob as JSON can carry it: -inf (and NaN, which no sampler should give) as -9999.0."""
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB


class UsageTotal:
    """Adds up the usage of a request's samples (and prompts), as they finish; and, for a stream's
    usage so far (`so_far_json`), the tokens streamed and the prompt tokens known before the end."""

    def __init__(self, known_prompt_tokens: int = 0) -> None:
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.known_prompt_tokens = known_prompt_tokens   # of prompts tokenized before the call
        self.streamed_tokens = 0

    def add(self, usage: Usage, *, first_sample: bool) -> None:
        self.completion_tokens += usage.completion_tokens
        if first_sample:   # the prompt, counted once per prompt
            self.prompt_tokens += usage.prompt_tokens
            self.cached_tokens += usage.cached_prompt_tokens

    def to_json(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def so_far_json(self) -> dict[str, Any]:
        prompt = max(self.prompt_tokens, self.known_prompt_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": self.streamed_tokens,
                "total_tokens": prompt + self.streamed_tokens}


def cut_tops(tops: Sequence[TopLogprobs] | None, count: int) -> list[TopLogprobs] | None:
    """Each position's `count` most likely tokens (None for none)."""
    if not tops or not count:
        return None
    return [(list(ids[:count]), list(values[:count])) for ids, values in tops]


def token_ids_of(token_ids: Sequence[int], top_logprobs: Sequence[TopLogprobs] | None) -> set[int]:
    """Every token id whose text a logprobs answer names."""
    ids = set(token_ids)
    for top_ids, _ in top_logprobs or ():
        ids.update(top_ids)
    return ids


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[float], top_logprobs: Sequence[TopLogprobs] | None,
                  texts: dict[int, str]) -> dict[str, Any]:
    """Chat's format: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = texts[token_id]
        return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
        item = entry(token_id, logprob)
        tops = top_logprobs[i] if top_logprobs else ((), ())
        item["top_logprobs"] = [entry(t, lp) for t, lp in zip(*tops)]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[float | None],
                        top_logprobs: Sequence[TopLogprobs | None] | None, texts: dict[int, str],
                        text_offset: int) -> dict[str, Any]:
    """The completions format: parallel lists of tokens, their logprobs, a {token: logprob} dict
    of the top ones, and each token's offset in the choice's text (from `text_offset` on). A None
    logprob (and top entry) is an echoed prompt's first token, which nothing predicts."""
    tokens = [texts[t] for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    tops = None
    if top_logprobs is not None:
        tops = [None if top is None else {texts[t]: finite(lp) for t, lp in zip(*top)} for top in top_logprobs]
    return {"tokens": tokens, "token_logprobs": [None if lp is None else finite(lp) for lp in logprobs],
            "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(token_ids: Sequence[int] | None, logprobs: Sequence[float],
                    top_logprobs: Sequence[TopLogprobs] | None, num_top: int,
                    texts: dict[int, str]) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: None for the first prompt token, then per token {token id (a string):
    {"logprob", "rank", "decoded_token"}} for the prompt token (when its id is known: a chat's
    rendered prompt is not) and the `num_top` most likely ones. A rank is 1-based, and null for a
    prompt token outside the top ones."""
    out: list[dict[str, Any] | None] = [None]
    for i, logprob in enumerate(logprobs):
        top_ids, top_values = top_logprobs[i] if top_logprobs else ((), ())
        entry = {str(t): {"logprob": finite(lp), "rank": r + 1, "decoded_token": texts[t]}
                 for r, (t, lp) in enumerate(zip(top_ids[:num_top], top_values[:num_top]))}
        if token_ids is not None:
            token = token_ids[i + 1]
            rank = list(top_ids).index(token) + 1 if token in top_ids else None
            entry = {str(token): {"logprob": finite(logprob), "rank": rank, "decoded_token": texts[token]}, **entry}
        out.append(entry)
    return out


_END = object()


async def merge(streams: Sequence[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """(stream index, item) from every stream as items come. An error in one ends the merge
    with it; leaving the merge early (or an error) cancels every stream, which cancels their
    gRPC calls."""
    if len(streams) == 1:   # the common case: no tasks, no queue
        async with contextlib.aclosing(streams[0]):   # closed when left, not when garbage-collected
            async for item in streams[0]:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
            await queue.put((index, _END))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((index, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
