"""The asyncio client: Client's methods as coroutines (`stream` and `stream_chat` are async
iterators), sending the same calls (common/client/calls.py)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any, Unpack

import grpc

from common.client import calls
from common.client.accumulator import Accumulator
from common.client.base import UNSET, BaseClient, ChannelSettings, ReadyWait
from common.client.calls import Call, ChatMessage, Prompt
from common.client.results import ChatChunk, ChatCompletion, Completion, CompletionChunk, ModelInfo, RequestError, Tool
from common.client.sampling import SamplingOptions, SamplingParams, with_options


class AsyncClient(BaseClient[AsyncIterator[CompletionChunk], AsyncIterator[ChatChunk]]):
    """Make it inside a running event loop; close it with `await close()` or an `async with` block.
    Its arguments are BaseClient's; its methods are Client's."""

    def _open(self, s: ChannelSettings) -> grpc.aio.Channel:
        return (grpc.aio.secure_channel(s.target, s.credentials(), options=s.options) if s.tls
                else grpc.aio.insecure_channel(s.target, options=s.options))

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def generate(self, prompt: Prompt, sampling: SamplingParams | None = None, *, request_id: str = "",
                       timeout: float | None = UNSET, **options: Unpack[SamplingOptions]) -> Completion:
        call = calls.generate(prompt, with_options(sampling, options), request_id)
        return (await self._fold(call, timeout)).completion()

    async def chat(self, messages: Sequence[ChatMessage], sampling: SamplingParams | None = None, *,
                   tools: Sequence[Tool | dict[str, Any]] = (), tool_choice: str = "auto",
                   enable_thinking: bool | None = None, request_id: str = "", timeout: float | None = UNSET,
                   **options: Unpack[SamplingOptions]) -> ChatCompletion:
        call = calls.chat(messages, with_options(sampling, options), tools=tools, tool_choice=tool_choice,
                          enable_thinking=enable_thinking, request_id=request_id)
        return (await self._fold(call, timeout)).chat_completion()

    async def tokenize(self, text: str, *, add_special_tokens: bool = False,
                       timeout: float | None = UNSET) -> list[int]:
        return await self._unary(calls.tokenize(text, add_special_tokens), timeout)

    async def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False,
                         timeout: float | None = UNSET) -> str:
        return await self._unary(calls.detokenize(token_ids, skip_special_tokens, False), timeout)

    async def token_texts(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False,
                          timeout: float | None = UNSET) -> list[str]:
        return await self._unary(calls.detokenize(token_ids, skip_special_tokens, True), timeout)

    async def abort(self, request_id: str, *, timeout: float | None = UNSET) -> bool:
        return await self._unary(calls.abort(request_id), timeout)

    async def model_info(self, *, timeout: float | None = UNSET) -> ModelInfo:
        return await self._unary(calls.model_info(), timeout)

    async def health(self, service: str = "", *, timeout: float | None = UNSET) -> str:
        return await self._unary(calls.health(service), timeout)

    async def wait_ready(self, timeout: float = 60.0) -> None:
        wait = ReadyWait(self._settings.target, timeout)
        while not wait.ready(await self._health_answer(wait.check_timeout)):
            await asyncio.sleep(wait.pause)

    async def _health_answer(self, timeout: float) -> str:
        try:
            return await self.health(timeout=timeout)
        except RequestError as exc:
            return exc.code

    async def _unary(self, call: Call, timeout: float | None):
        try:
            return call.decode(await self._send(call, timeout))
        except grpc.RpcError as exc:
            raise RequestError.from_rpc_error(exc) from exc

    async def _stream(self, call: Call, timeout: float | None) -> AsyncIterator:
        rpc = self._send(call, timeout)
        try:
            async for message in rpc:
                yield call.decode(message)
        except grpc.RpcError as exc:
            raise RequestError.from_rpc_error(exc) from exc
        finally:
            rpc.cancel()

    async def _fold(self, call: Call, timeout: float | None) -> Accumulator:
        folded = Accumulator(call.params)
        async for chunk in self._stream(call, timeout):
            folded.add(chunk)
        return folded
