"""A stand-in for the gateway's llm.v1 client (common.client.AsyncClient), for tests of the HTTP
application without processes: every call answers at once with a few fixed tokens, checks its
arguments as the wire would (each is turned into its protobuf request), and records them.

    app = create_app(GatewayConfig("unused"), client_factory=FakeScheduler)
"""
from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

from common.client import (ChatChunk, ChatCompletion, Completion, CompletionChunk, ModelInfo, RequestError,
                           SamplingParams, ToolCall, Usage)
from common.client import calls

MODEL = "fake-qwen3"
VOCAB = 1000


def _text_of(token_id: int) -> str:
    return f"<{token_id}>"


class FakeScheduler:
    """Answers each request with `tokens` (ids 5, 6, 7 by default), a logprob of -inf for the last
    one (as a constraint's ruled-out token has), and the prompt's logprobs when asked."""

    def __init__(self, tokens: Sequence[int] = (5, 6, 7), reasoning: str = "", tool_calls: Sequence[ToolCall] = ()):
        self.tokens = list(tokens)
        self.reasoning = reasoning
        self.tool_calls = list(tool_calls)
        self.calls: list[tuple[str, Any]] = []

    async def close(self) -> None:
        pass

    async def model_info(self, *, timeout=None) -> ModelInfo:
        return ModelInfo(MODEL, 4096, VOCAB, [2], 16, 100)

    async def health(self, service: str = "", *, timeout=None) -> str:
        return "SERVING"

    async def tokenize(self, text: str, *, add_special_tokens: bool = False, timeout=None) -> list[int]:
        self.calls.append(("tokenize", text))
        text.encode("utf-8")
        return [10 + (ord(c) % 90) for c in text] or [10]

    async def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False, timeout=None) -> str:
        self._check_ids(token_ids)
        return "".join(_text_of(t) for t in token_ids)

    async def token_texts(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False,
                          timeout=None) -> list[str]:
        self._check_ids(token_ids)
        return [_text_of(t) for t in token_ids]

    @staticmethod
    def _check_ids(token_ids: Sequence[int]) -> None:
        if any(not 0 <= t < VOCAB for t in token_ids):
            raise RequestError("INVALID_ARGUMENT", "token_ids holds an id beyond the vocabulary")

    def _logprobs(self, params: SamplingParams) -> list[float] | None:
        return [-0.5] * (len(self.tokens) - 1) + [float("-inf")] if params.logprobs or params.top_logprobs else None

    def _tops(self, count: int, params: SamplingParams):
        if not params.top_logprobs:
            return None
        k = params.top_logprobs
        return [(list(range(20, 20 + k)), [-0.1 * (r + 1) for r in range(k - 1)] + [float("-inf")])] * count

    def _chunks(self, prompt_ids: list[int] | None, params: SamplingParams) -> list[CompletionChunk]:
        usage = Usage(len(prompt_ids or [1, 2]), len(self.tokens), 0)
        prompt_lp = [-1.0] * (len(prompt_ids) - 1) if params.prompt_logprobs and prompt_ids else None
        chunks = []
        for index in range(params.n or 1):
            lps, tops = self._logprobs(params), self._tops(len(self.tokens), params)
            first = CompletionChunk("r", _text_of(self.tokens[0]), self.tokens[:1], lps and lps[:1], None, None, index,
                                    tops and tops[:1], None, prompt_lp if index == 0 else None,
                                    self._tops(len(prompt_lp), params) if prompt_lp and index == 0 else None)
            rest = CompletionChunk("r", "".join(map(_text_of, self.tokens[1:])), self.tokens[1:], lps and lps[1:],
                                   "length", usage, index, tops and tops[1:])
            chunks += [first, rest]
        return chunks

    async def stream(self, prompt, sampling: SamplingParams | None = None, *, request_id: str = "",
                     timeout=None, **options) -> AsyncIterator[CompletionChunk]:
        params = dataclasses.replace(sampling or SamplingParams(), **options)
        calls.generate(prompt, params, request_id).request.SerializeToString()   # what the wire would refuse
        self.calls.append(("generate", prompt))
        for chunk in self._chunks(None if isinstance(prompt, str) else list(prompt), params):
            yield chunk

    async def generate(self, prompt, sampling: SamplingParams | None = None, **kwargs) -> Completion:
        samples = {}
        async for chunk in self.stream(prompt, sampling, **kwargs):
            s = samples.setdefault(chunk.index, [])
            s.append(chunk)
        done = []
        for index, (first, rest) in sorted(samples.items()):
            done.append(Completion("r", first.text + rest.text, first.token_ids + rest.token_ids, "length", rest.usage,
                                   (first.logprobs or []) + (rest.logprobs or []) if first.logprobs else None,
                                   (first.top_logprobs or []) + (rest.top_logprobs or []) if first.top_logprobs
                                   else None, None, first.prompt_logprobs, first.prompt_top_logprobs, index))
        return dataclasses.replace(done[0], samples=done) if len(done) > 1 else done[0]

    async def stream_chat(self, messages, sampling: SamplingParams | None = None, *, tools=(), tool_choice="auto",
                          enable_thinking=None, request_id="", timeout=None, **options) -> AsyncIterator[ChatChunk]:
        params = dataclasses.replace(sampling or SamplingParams(), **options)
        calls.chat(messages, params, tools=tools, tool_choice=tool_choice, enable_thinking=enable_thinking,
                   request_id=request_id).request.SerializeToString()
        self.calls.append(("chat", messages))
        usage = Usage(12, len(self.tokens), 0)
        finish = "tool_calls" if self.tool_calls else "length"
        for index in range(params.n or 1):
            if self.reasoning:
                yield ChatChunk("r", "", self.reasoning, [], [], None, None, index)
            yield ChatChunk("r", "".join(map(_text_of, self.tokens)), "", list(self.tool_calls), self.tokens, finish,
                            usage, index, None, self._logprobs(params), self._tops(len(self.tokens), params),
                            [-1.0] * 11 if params.prompt_logprobs and index == 0 else None,
                            self._tops(11, params) if params.prompt_logprobs and index == 0 else None)

    async def chat(self, messages, sampling: SamplingParams | None = None, **kwargs) -> ChatCompletion:
        chunks = [c async for c in self.stream_chat(messages, sampling, **kwargs)]
        done = []
        for index in sorted({c.index for c in chunks}):
            mine = [c for c in chunks if c.index == index]
            last = mine[-1]
            done.append(ChatCompletion("r", "".join(c.text for c in mine), "".join(c.reasoning for c in mine),
                                       [t for c in mine for t in c.tool_calls], last.token_ids, last.finish_reason,
                                       last.usage, index, logprobs=last.logprobs, top_logprobs=last.top_logprobs,
                                       prompt_logprobs=last.prompt_logprobs,
                                       prompt_top_logprobs=last.prompt_top_logprobs))
        return dataclasses.replace(done[0], samples=done) if len(done) > 1 else done[0]
