"""The blocking client: each method builds its call (common/client/calls.py) and sends it."""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any, Unpack

import grpc

from common.client import calls
from common.client.accumulator import Accumulator
from common.client.base import UNSET, BaseClient, ChannelSettings, ReadyWait
from common.client.calls import Call, ChatMessage, Prompt
from common.client.results import ChatChunk, ChatCompletion, Completion, CompletionChunk, ModelInfo, RequestError, Tool
from common.client.sampling import SamplingOptions, SamplingParams, with_options


class Client(BaseClient[Iterator[CompletionChunk], Iterator[ChatChunk]]):
    """Blocking client. One channel, reused by every call and safe to share between threads; close
    it with `close()` or a `with` block. Its arguments are BaseClient's."""

    def _open(self, s: ChannelSettings) -> grpc.Channel:
        return (grpc.secure_channel(s.target, s.credentials(), options=s.options) if s.tls
                else grpc.insecure_channel(s.target, options=s.options))

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(self, prompt: Prompt, sampling: SamplingParams | None = None, *, request_id: str = "",
                 timeout: float | None = UNSET, **options: Unpack[SamplingOptions]) -> Completion:
        """Runs one request to its end. Raises RequestError when the server refuses or fails it."""
        return self._fold(calls.generate(prompt, with_options(sampling, options), request_id), timeout).completion()

    def chat(self, messages: Sequence[ChatMessage], sampling: SamplingParams | None = None, *,
             tools: Sequence[Tool | dict[str, Any]] = (), tool_choice: str = "auto",
             enable_thinking: bool | None = None, request_id: str = "", timeout: float | None = UNSET,
             **options: Unpack[SamplingOptions]) -> ChatCompletion:
        """Runs one chat turn to its end. tool_choice: "auto", "none", "required" or a tool's name."""
        call = calls.chat(messages, with_options(sampling, options), tools=tools, tool_choice=tool_choice,
                          enable_thinking=enable_thinking, request_id=request_id)
        return self._fold(call, timeout).chat_completion()

    def tokenize(self, text: str, *, add_special_tokens: bool = False, timeout: float | None = UNSET) -> list[int]:
        """The token ids the server's tokenizer gives `text` (as a text prompt is tokenized)."""
        return self._unary(calls.tokenize(text, add_special_tokens), timeout)

    def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False,
                   timeout: float | None = UNSET) -> str:
        return self._unary(calls.detokenize(token_ids, skip_special_tokens, False), timeout)

    def token_texts(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False,
                    timeout: float | None = UNSET) -> list[str]:
        """The text of each token on its own, in one call (a piece of a multi-byte character is U+FFFD)."""
        return self._unary(calls.detokenize(token_ids, skip_special_tokens, True), timeout)

    def abort(self, request_id: str, *, timeout: float | None = UNSET) -> bool:
        """Ends a waiting or running request (its stream finishes with "abort"); False when the
        server knows no such request (it finished already, or never existed)."""
        return self._unary(calls.abort(request_id), timeout)

    def model_info(self, *, timeout: float | None = UNSET) -> ModelInfo:
        return self._unary(calls.model_info(), timeout)

    def health(self, service: str = "", *, timeout: float | None = UNSET) -> str:
        """The server's grpc.health.v1 answer for `service` ("" is the whole server): SERVING,
        NOT_SERVING or SERVICE_UNKNOWN. Raises RequestError when it cannot be asked."""
        return self._unary(calls.health(service), timeout)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Returns once the server reports SERVING on grpc.health.v1; raises RequestError
        (DEADLINE_EXCEEDED, with the last answer) after `timeout` seconds."""
        wait = ReadyWait(self._settings.target, timeout)
        while not wait.ready(self._health_answer(wait.check_timeout)):
            time.sleep(wait.pause)

    def _health_answer(self, timeout: float) -> str:
        try:
            return self.health(timeout=timeout)
        except RequestError as exc:
            return exc.code

    def _unary(self, call: Call, timeout: float | None):
        try:
            return call.decode(self._send(call, timeout))
        except grpc.RpcError as exc:
            raise RequestError.from_rpc_error(exc) from exc

    def _stream(self, call: Call, timeout: float | None) -> Iterator:
        rpc = self._send(call, timeout)
        try:
            for message in rpc:
                yield call.decode(message)
        except grpc.RpcError as exc:
            raise RequestError.from_rpc_error(exc) from exc
        finally:
            rpc.cancel()   # no-op after the end; aborts the request when the caller stopped early

    def _fold(self, call: Call, timeout: float | None) -> Accumulator:
        folded = Accumulator(call.params)
        for chunk in self._stream(call, timeout):
            folded.add(chunk)
        return folded
