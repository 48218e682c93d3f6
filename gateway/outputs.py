"""What both endpoints' responses share: usage, OpenAI's two logprobs formats, SSE framing, and
the merge of several gRPC streams into one (a batch of prompts, streamed).

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

from common.client import TopLogprobs, Usage

DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class UsageTotal:
    """Adds up the usage of a request's samples (and prompts), as they finish."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0

    def add(self, usage: Usage, *, first_sample: bool) -> None:
        self.completion_tokens += usage.completion_tokens
        if first_sample:   # the prompt, counted once per prompt
            self.prompt_tokens += usage.prompt_tokens
            self.cached_tokens += usage.cached_prompt_tokens

    def to_json(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


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
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
        item = entry(token_id, logprob)
        tops = top_logprobs[i] if top_logprobs else ((), ())
        item["top_logprobs"] = [entry(t, lp) for t, lp in zip(*tops)]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[float],
                        top_logprobs: Sequence[TopLogprobs] | None, texts: dict[int, str],
                        text_offset: int) -> dict[str, Any]:
    """The completions format: parallel lists of tokens, their logprobs, a {token: logprob} dict
    of the top ones, and each token's offset in the choice's text (from `text_offset` on)."""
    tokens = [texts[t] for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    tops = None
    if top_logprobs is not None:
        tops = [{texts[t]: lp for t, lp in zip(ids, values)} for ids, values in top_logprobs]
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": tops, "text_offset": offsets}


_END = object()


async def merge(streams: Sequence[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """(stream index, item) from every stream as items come. An error in one ends the merge
    with it; leaving the merge early (or an error) cancels every stream, which cancels their
    gRPC calls."""
    if len(streams) == 1:   # the common case: no tasks, no queue
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
