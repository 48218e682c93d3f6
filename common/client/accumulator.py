"""Folds a stream's chunks into one Completion (or ChatCompletion) per sample, for the clients'
generate() and chat(): sample 0's result, holding every sample's in `samples` when there are several."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

from common.client.results import (ChatChunk, ChatCompletion, Completion, CompletionChunk, FinishReason,
                                   RequestError, ToolCall, TopLogprobs, Usage)
from common.client.sampling import SamplingParams

T = TypeVar("T", Completion, ChatCompletion)


class _Sample:
    """One sample's chunks, folded."""

    def __init__(self) -> None:
        self.request_id = ""
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: list[ToolCall] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[TopLogprobs] = []
        self.prompt_logprobs: list[float] | None = None
        self.prompt_top_logprobs: list[TopLogprobs] | None = None
        self.finish_reason: FinishReason | None = None
        self.usage: Usage | None = None
        self.matched_stop: str | None = None

    def add(self, chunk: CompletionChunk | ChatChunk) -> None:
        self.request_id = chunk.request_id or self.request_id
        self.text.append(chunk.text)
        self.token_ids += chunk.token_ids
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.usage = chunk.usage or self.usage
        self.matched_stop = chunk.matched_stop or self.matched_stop
        self.logprobs += chunk.logprobs or ()
        self.top_logprobs += chunk.top_logprobs or ()
        if chunk.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs, self.prompt_top_logprobs = chunk.prompt_logprobs, chunk.prompt_top_logprobs
        if isinstance(chunk, ChatChunk):
            self.reasoning.append(chunk.reasoning)
            self.tool_calls += chunk.tool_calls

    def check(self) -> tuple[FinishReason, Usage]:
        if self.finish_reason is None or self.usage is None:
            raise RequestError("INTERNAL", "the stream ended without a finish reason")
        return self.finish_reason, self.usage


class Accumulator:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.samples: dict[int, _Sample] = {}

    def add(self, chunk: CompletionChunk | ChatChunk) -> None:
        self.samples.setdefault(chunk.index, _Sample()).add(chunk)

    def completion(self) -> Completion:
        def make(index: int, s: _Sample, reason: FinishReason, usage: Usage) -> Completion:
            return Completion(s.request_id, "".join(s.text), s.token_ids, reason, usage, self._logprobs(s),
                              self._top_logprobs(s), s.matched_stop, s.prompt_logprobs, s.prompt_top_logprobs, index)
        return self._fold(make)

    def chat_completion(self) -> ChatCompletion:
        def make(index: int, s: _Sample, reason: FinishReason, usage: Usage) -> ChatCompletion:
            return ChatCompletion(s.request_id, "".join(s.text), "".join(s.reasoning), s.tool_calls, s.token_ids,
                                  reason, usage, index, logprobs=self._logprobs(s), top_logprobs=self._top_logprobs(s),
                                  prompt_logprobs=s.prompt_logprobs, prompt_top_logprobs=s.prompt_top_logprobs)
        return self._fold(make)

    def _fold(self, make: Callable[[int, _Sample, FinishReason, Usage], T]) -> T:
        done = [make(index, self.samples[index], *self.samples[index].check()) for index in sorted(self.samples)]
        if not done:
            raise RequestError("INTERNAL", "the stream ended without a message")
        return dataclasses.replace(done[0], samples=done) if len(done) > 1 else done[0]

    def _logprobs(self, s: _Sample) -> list[float] | None:
        return s.logprobs if self.params.logprobs or self.params.top_logprobs else None

    def _top_logprobs(self, s: _Sample) -> list[TopLogprobs] | None:
        return s.top_logprobs if self.params.top_logprobs else None
