"""What both clients share: the channel (address, TLS, bearer token, gRPC options), each call's
deadline, the streaming methods, and the polling of wait_ready. A client opens its kind of channel
(blocking or asyncio) and iterates its kind of stream; `_send` starts any call of
common/client/calls.py on the channel.
"""
from __future__ import annotations

import os
import pathlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, Unpack

import grpc
from grpc_health.v1 import health_pb2_grpc

from common.client import calls
from common.client.calls import GENERATION, HEALTH, Call, ChatMessage, Prompt
from common.client.results import RequestError, Tool
from common.client.sampling import SamplingOptions, SamplingParams, with_options
from common.pb.llm.v1 import generation_pb2_grpc as pb_grpc

CompletionChunks = TypeVar("CompletionChunks")   # the client's iterator of CompletionChunk
ChatChunks = TypeVar("ChatChunks")               # and of ChatChunk

# The scheduler accepts requests up to 64 MiB (a long prompt as token ids); gRPC's default send
# limit of 4 MiB would refuse them on this side first.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_TARGET = "127.0.0.1:50051"
TARGET_ENV = "QWEN3_SERVE_TARGET"     # where a client connects when given no target

UNSET: Any = object()   # "no timeout given on this call": use the client's


@dataclass(frozen=True)
class ChannelSettings:
    """How to reach the server: address, TLS, token and gRPC channel options."""
    target: str
    tls: bool
    ca_file: str | None
    client_cert: str | None
    client_key: str | None
    metadata: tuple[tuple[str, str], ...]
    options: tuple[tuple[str, object], ...]

    @classmethod
    def build(cls, target: str | None, *, tls: bool, ca_file, client_cert, client_key, token, token_file,
              channel_options) -> "ChannelSettings":
        target = target or os.environ.get(TARGET_ENV) or DEFAULT_TARGET
        if (client_cert is None) != (client_key is None):
            raise ValueError("client_cert and client_key go together")
        if token is not None and token_file is not None:
            raise ValueError("give token or token_file, not both")
        if token_file is not None:
            token = pathlib.Path(token_file).read_text().strip()
            if not token:
                raise ValueError(f"empty token in {token_file}")
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        options = (("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), *(channel_options or ()))
        return cls(target, tls or ca_file is not None or client_cert is not None,
                   str(ca_file) if ca_file else None, str(client_cert) if client_cert else None,
                   str(client_key) if client_key else None, metadata, tuple(options))

    def credentials(self) -> grpc.ChannelCredentials:
        read = lambda path: pathlib.Path(path).read_bytes() if path else None  # noqa: E731
        return grpc.ssl_channel_credentials(root_certificates=read(self.ca_file), private_key=read(self.client_key),
                                            certificate_chain=read(self.client_cert))


class BaseClient(Generic[CompletionChunks, ChatChunks]):
    """One channel, reused by every call. Args:
        target: `host:port` of the scheduler (any gRPC target: `unix:PATH`, `dns:///name:port`);
            None: $QWEN3_SERVE_TARGET, else 127.0.0.1:50051.
        timeout: default deadline of each call in seconds (None: no deadline).
        tls: connect over TLS trusting the system's roots (implied by ca_file or client_cert).
        ca_file: PEM file of the CA that signed the server's certificate.
        client_cert, client_key: PEM files of this client's certificate, for mutual TLS.
        token, token_file: bearer token (or a file holding it) sent with every call.
        channel_options: extra gRPC channel arguments, e.g. [("grpc.keepalive_time_ms", 30000)].
    """

    def __init__(self, target: str | None = None, *, timeout: float | None = 600.0, tls: bool = False,
                 ca_file: str | pathlib.Path | None = None, client_cert: str | pathlib.Path | None = None,
                 client_key: str | pathlib.Path | None = None, token: str | None = None,
                 token_file: str | pathlib.Path | None = None,
                 channel_options: Sequence[tuple[str, object]] | None = None) -> None:
        self._settings = ChannelSettings.build(
            target, tls=tls, ca_file=ca_file, client_cert=client_cert, client_key=client_key, token=token,
            token_file=token_file, channel_options=channel_options)
        self.timeout = timeout
        self._channel = self._open(self._settings)
        self._stubs = {GENERATION: pb_grpc.GenerationStub(self._channel),
                       HEALTH: health_pb2_grpc.HealthStub(self._channel)}

    def stream(self, prompt: Prompt, sampling: SamplingParams | None = None, *, request_id: str = "",
               timeout: float | None = UNSET, **options: Unpack[SamplingOptions]) -> CompletionChunks:
        """Yields the request's chunks as they come; leave the loop (or close the iterator) to cancel
        the request."""
        return self._stream(calls.generate(prompt, with_options(sampling, options), request_id), timeout)

    def stream_chat(self, messages: Sequence[ChatMessage], sampling: SamplingParams | None = None, *,
                    tools: Sequence[Tool | dict[str, Any]] = (), tool_choice: str = "auto",
                    enable_thinking: bool | None = None, request_id: str = "", timeout: float | None = UNSET,
                    **options: Unpack[SamplingOptions]) -> ChatChunks:
        """Yields a chat turn's chunks as they come; leave the loop to cancel it."""
        call = calls.chat(messages, with_options(sampling, options), tools=tools, tool_choice=tool_choice,
                          enable_thinking=enable_thinking, request_id=request_id)
        return self._stream(call, timeout)

    def _open(self, settings: ChannelSettings):
        raise NotImplementedError

    def _stream(self, call: Call, timeout: float | None):
        """The call's chunks: an iterator of the client's kind (blocking or async)."""
        raise NotImplementedError

    def _send(self, call: Call, timeout: float | None):
        """Starts the call: its reply (or an awaitable of it), or for a stream an iterator of replies."""
        method = getattr(self._stubs[call.service], call.method)
        return method(call.request, timeout=self.timeout if timeout is UNSET else timeout,
                      metadata=self._settings.metadata)


class ReadyWait:
    """wait_ready's loop: ask for health every `pause` seconds until SERVING, or fail at the deadline."""
    pause = 0.2

    def __init__(self, target: str, timeout: float) -> None:
        self.target = target
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self.check_timeout = max(0.1, min(2.0, timeout))   # of each health check

    def ready(self, answer: str) -> bool:
        """True on SERVING; RequestError (DEADLINE_EXCEEDED, with the last answer) past the deadline."""
        if answer == "SERVING":
            return True
        if time.monotonic() >= self.deadline:
            raise RequestError("DEADLINE_EXCEEDED", f"{self.target} not SERVING after {self.timeout}s ({answer})")
        return False
