"""A typed Python client for the public llm.v1.Generation API: `Client` (blocking) and
`AsyncClient` (asyncio), with the same methods and the same plain dataclasses.

    from common.client import Client

    with Client("127.0.0.1:50051") as client:      # Client(): $QWEN3_SERVE_TARGET or 127.0.0.1:50051
        out = client.generate("Once upon a time", max_tokens=32, temperature=0.7, seed=42)
        print(out.text, out.finish_reason, out.usage.completion_tokens)

- `generate(prompt, ...)` runs one request to its end and returns a `Completion` (text, token ids,
  finish reason, usage, and per-token logprobs when asked for); with `n=` samples, the Completion
  is sample 0's and `samples` lists every sample's;
- `stream(prompt, ...)` yields `CompletionChunk`s as the server sends them (the last one of each
  sample carries `finish_reason` and `usage`; `index` names the sample); leaving the loop early
  cancels the call, which aborts the request on the server and frees its KV-cache blocks;
- `chat(messages, tools=..., tool_choice=...)` and `stream_chat(...)`: a chat turn rendered by the
  model's chat template, its output split into `text`, `reasoning` and `tool_calls`;
- `tokenize(text)`, `detokenize(token_ids)`, `model_info()`, `abort(request_id)`, `health()`
  (one grpc.health.v1 check) and `wait_ready(timeout)` (polls grpc.health.v1).

A prompt is a string (tokenized by the server) or a sequence of token ids. Sampling options are
keyword arguments named as `SamplingParams`' fields, or a `SamplingParams` given as `sampling=`
(keywords override its fields); unset options take the server's defaults, documented on each field.

Every call has a deadline: `timeout=` on the call, else the client's `timeout` (None: no deadline).
For a stream it covers the whole stream. `ca_file=` (or `tls=True` for the system's roots) connects
over TLS; `client_cert=`/`client_key=` add a client certificate for mutual TLS; `token=` or
`token_file=` sends `authorization: Bearer <token>` with every call. Failures raise `RequestError`,
whose `code` is the gRPC status name (INVALID_ARGUMENT, DEADLINE_EXCEEDED, UNAVAILABLE, ...) and
whose message is the server's.

Structured output: `json_schema=` (a dict or its JSON text), `regex=`, `grammar=` (EBNF) or
`json_object=True`; the server samples every token under the constraint.

Adding an RPC: build its request in a module-level function (as `_generate_request`), turn its
replies into dataclasses in another (as `_chunk_from_proto`), and add a thin method to both
clients.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pathlib
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict, Unpack

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.pb.llm.v1 import generation_pb2 as pb
from common.pb.llm.v1 import generation_pb2_grpc as pb_grpc

# The scheduler accepts requests up to 64 MiB (a long prompt as token ids); gRPC's default send
# limit of 4 MiB would refuse them on this side first.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_TARGET = "127.0.0.1:50051"
TARGET_ENV = "QWEN3_SERVE_TARGET"     # where Client() connects when given no target

FinishReason = Literal["stop", "length", "abort", "tool_calls"]
_FINISH_REASONS: dict[int, FinishReason] = {
    pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
}
_CONSTRAINTS = ("json_schema", "regex", "grammar", "json_object")

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; None (or False, or empty) leaves an option to the server's default."""
    max_tokens: int | None = None            # unset: up to the model's context limit
    temperature: float | None = None         # [0, 100]; 0 is greedy; unset means 1.0
    top_p: float | None = None               # (0, 1]; unset means 1.0
    top_k: int | None = None                 # unset or 0: no top-k
    min_p: float | None = None               # [0, 1]; unset means 0
    seed: int | None = None                  # same seed and prompt: same tokens, whatever the batch
    min_tokens: int | None = None            # EOS and stop tokens are ignored before this many tokens
    ignore_eos: bool = False
    stop: Sequence[str] = ()                 # up to 16 stop strings, left out of the text
    stop_token_ids: Sequence[int] = ()
    repetition_penalty: float | None = None  # [0.01, 10]; 1 means none
    presence_penalty: float | None = None    # [-2, 2]
    frequency_penalty: float | None = None   # [-2, 2]
    logprobs: bool = False                   # return each sampled token's log-probability
    skip_special_tokens: bool = False        # leave special tokens out of the text
    n: int | None = None                     # samples of the prompt, 1..16
    top_logprobs: int | None = None          # 0..20 most likely tokens per sampled token (implies logprobs)
    prompt_logprobs: bool = False            # each prompt token's log-probability given the ones before it
    json_schema: dict[str, Any] | str | None = None   # structured output: one of these four
    regex: str | None = None
    grammar: str | None = None               # EBNF as xgrammar reads it (root ::= ...)
    json_object: bool = False
    priority: int | None = None              # lower is served first; unset means 0
    logit_bias: Mapping[int, float] | None = None   # token id -> [-100, 100] added to its logit (<= 1,024)

    def to_proto(self) -> pb.SamplingParams:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        given = [name for name in _CONSTRAINTS if values[name] not in (None, False)]
        if len(given) > 1:
            raise ValueError(f"give one constraint, not {' and '.join(given)}")
        if isinstance(values["json_schema"], dict):
            values["json_schema"] = json.dumps(values["json_schema"])
        if not values["json_object"]:
            del values["json_object"]   # a oneof member: set only when asked
        return pb.SamplingParams(**{name: value for name, value in values.items() if value is not None})


class SamplingOptions(TypedDict, total=False):
    """SamplingParams' fields as keyword arguments (for type checkers)."""
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    min_tokens: int
    ignore_eos: bool
    stop: Sequence[str]
    stop_token_ids: Sequence[int]
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: bool
    skip_special_tokens: bool
    n: int
    top_logprobs: int
    prompt_logprobs: bool
    json_schema: dict[str, Any] | str
    regex: str
    grammar: str
    json_object: bool
    priority: int
    logit_bias: Mapping[int, float]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int    # prompt tokens served from the prefix cache


# The most likely tokens at one position, most likely first: (token ids, logprobs).
TopLogprobs = tuple[list[int], list[float]]


@dataclass(frozen=True)
class CompletionChunk:
    """One message of a stream: what is new since the previous one of its sample."""
    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[float] | None          # one per token id, when requested
    finish_reason: FinishReason | None    # set on the sample's last chunk only
    usage: Usage | None                   # set on the sample's last chunk only
    index: int = 0                        # the sample (n)
    top_logprobs: list[TopLogprobs] | None = None   # one per token id, when requested
    matched_stop: str | None = None       # on the last chunk: the stop string or stop token that ended it
    prompt_logprobs: list[float] | None = None      # in sample 0's first chunk, when requested
    prompt_top_logprobs: list[TopLogprobs] | None = None


@dataclass(frozen=True)
class Completion:
    """A whole request's output (sample 0's, when it asked for n > 1: `samples` has all of them)."""
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    logprobs: list[float] | None = None   # one per token id, when requested
    top_logprobs: list[TopLogprobs] | None = None
    matched_stop: str | None = None
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[TopLogprobs] | None = None
    index: int = 0
    samples: list["Completion"] = field(default_factory=list)   # every sample, by index, when n > 1


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]             # the call's arguments, parsed


@dataclass(frozen=True)
class Tool:
    """A function the model may call; `parameters` is the JSON schema of its arguments object."""
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None


@dataclass(frozen=True)
class ChatChunk:
    """One message of a chat stream: content, reasoning and complete tool calls new in it."""
    request_id: str
    text: str
    reasoning: str
    tool_calls: list[ToolCall]
    token_ids: list[int]
    finish_reason: FinishReason | None    # "tool_calls" when the turn stopped after calls
    usage: Usage | None
    index: int = 0
    matched_stop: str | None = None
    logprobs: list[float] | None = None   # one per token id (reasoning and tool-call tokens too), when requested
    top_logprobs: list[TopLogprobs] | None = None


@dataclass(frozen=True)
class ChatCompletion:
    """A whole chat turn (sample 0's, when n > 1: `samples` has all of them)."""
    request_id: str
    text: str
    reasoning: str
    tool_calls: list[ToolCall]
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    index: int = 0
    samples: list["ChatCompletion"] = field(default_factory=list)
    logprobs: list[float] | None = None   # one per token id, when requested
    top_logprobs: list[TopLogprobs] | None = None


@dataclass(frozen=True)
class WorkerGroupInfo:
    addresses: list[str]                  # one per tensor-parallel rank, rank 0 first
    healthy: bool
    device: str
    attention_backend: str
    tensor_parallel_size: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_running: int
    num_preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    kv_cache_dtype: str = ""              # "bfloat16", "float32", "float8_e4m3fn"


@dataclass(frozen=True)
class ModelInfo:
    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    block_size: int
    num_kv_blocks: int
    worker_groups: list[WorkerGroupInfo] = field(default_factory=list)


class RequestError(Exception):
    """A call failed; `code` is the gRPC status name, `message` the server's explanation."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> "RequestError":
        code = error.code() if hasattr(error, "code") else None
        details = error.details() if hasattr(error, "details") else str(error)
        return cls(code.name if code is not None else "UNKNOWN", details or "")


# ---- requests and replies: shared by both clients ---------------------------------------------

def _sampling(sampling: SamplingParams | None, options: SamplingOptions) -> SamplingParams:
    try:
        return dataclasses.replace(sampling or SamplingParams(), **options)
    except TypeError as exc:   # an unknown keyword: name the ones that exist
        known = ", ".join(f.name for f in dataclasses.fields(SamplingParams))
        raise TypeError(f"{exc}; sampling options are: {known}") from None


def _generate_request(prompt: Prompt, sampling: SamplingParams, request_id: str) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=request_id, sampling=sampling.to_proto())
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, (bytes, bytearray)):
        raise TypeError("prompt must be a str or a sequence of token ids, not bytes")
    else:
        request.token_ids.ids.extend(prompt)
    return request


def _usage_from_proto(usage: pb.Usage) -> Usage:
    return Usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens)


def _tops(tops) -> list[TopLogprobs]:
    return [(list(t.token_ids), list(t.logprobs)) for t in tops]


def _chunk_from_proto(message: pb.GenerateResponse, params: SamplingParams) -> CompletionChunk:
    finished = message.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    want_top = bool(params.top_logprobs)
    prompt = params.prompt_logprobs and len(message.prompt_logprobs) > 0   # in sample 0's first message
    return CompletionChunk(
        request_id=message.request_id,
        text=message.text,
        token_ids=list(message.token_ids),
        logprobs=list(message.logprobs) if params.logprobs or want_top else None,
        finish_reason=_FINISH_REASONS.get(message.finish_reason) if finished else None,
        usage=_usage_from_proto(message.usage) if message.HasField("usage") else None,
        index=message.index,
        top_logprobs=_tops(message.top_logprobs) if want_top else None,
        matched_stop=message.matched_stop or None if finished else None,
        prompt_logprobs=list(message.prompt_logprobs) if prompt else None,
        prompt_top_logprobs=_tops(message.prompt_top_logprobs) if prompt and want_top else None,
    )


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
        if isinstance(chunk, ChatChunk):
            self.reasoning.append(chunk.reasoning)
            self.tool_calls += chunk.tool_calls
            return
        if chunk.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs, self.prompt_top_logprobs = chunk.prompt_logprobs, chunk.prompt_top_logprobs

    def check(self) -> tuple[FinishReason, Usage]:
        if self.finish_reason is None or self.usage is None:
            raise RequestError("INTERNAL", "the stream ended without a finish reason")
        return self.finish_reason, self.usage


class _Accumulator:
    """Folds a stream's chunks into one Completion (or ChatCompletion) per sample."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.samples: dict[int, _Sample] = {}

    def add(self, chunk: CompletionChunk | ChatChunk) -> None:
        self.samples.setdefault(chunk.index, _Sample()).add(chunk)

    def completion(self) -> Completion:
        p = self.params
        done = []
        for index in sorted(self.samples):
            s = self.samples[index]
            reason, usage = s.check()
            done.append(Completion(s.request_id, "".join(s.text), s.token_ids, reason, usage,
                                   s.logprobs if p.logprobs or p.top_logprobs else None,
                                   s.top_logprobs if p.top_logprobs else None, s.matched_stop,
                                   s.prompt_logprobs, s.prompt_top_logprobs, index))
        if not done:
            raise RequestError("INTERNAL", "the stream ended without a message")
        return dataclasses.replace(done[0], samples=done) if len(done) > 1 else done[0]

    def chat_completion(self) -> ChatCompletion:
        p = self.params
        done = []
        for index in sorted(self.samples):
            s = self.samples[index]
            reason, usage = s.check()
            done.append(ChatCompletion(s.request_id, "".join(s.text), "".join(s.reasoning), s.tool_calls, s.token_ids,
                                       reason, usage, index, logprobs=s.logprobs if p.logprobs or p.top_logprobs else None,
                                       top_logprobs=s.top_logprobs if p.top_logprobs else None))
        if not done:
            raise RequestError("INTERNAL", "the stream ended without a message")
        return dataclasses.replace(done[0], samples=done) if len(done) > 1 else done[0]


ChatMessage = dict[str, Any]   # {"role": ..., "content": ..., "tool_calls": [...], "tool_call_id": ...}


def _chat_request(messages: Sequence[ChatMessage], tools: Sequence[Tool | dict[str, Any]], tool_choice: str,
                  enable_thinking: bool | None, sampling: SamplingParams, request_id: str) -> pb.ChatRequest:
    """A ChatRequest from OpenAI-style messages (tool calls as {"id", "name", "arguments"} or
    {"id", "function": {"name", "arguments"}}, arguments a dict or its JSON text) and tools
    (Tool, or {"name", "description", "parameters"} dicts, optionally under "function")."""
    request = pb.ChatRequest(request_id=request_id, tool_choice=tool_choice, sampling=sampling.to_proto())
    for message in messages:
        msg = request.messages.add(role=message["role"], content=message.get("content") or "",
                                   tool_call_id=message.get("tool_call_id", ""))
        if message.get("reasoning_content") is not None:
            msg.reasoning_content = message["reasoning_content"]
        for call in message.get("tool_calls") or ():
            function = call.get("function", call)
            arguments = function.get("arguments", {})
            msg.tool_calls.add(id=call.get("id", ""), name=function["name"],
                               arguments_json=arguments if isinstance(arguments, str) else json.dumps(arguments))
    for tool in tools:
        if isinstance(tool, dict):
            tool = tool.get("function", tool)
            tool = Tool(tool["name"], tool.get("description", ""), tool.get("parameters"))
        request.tools.add(name=tool.name, description=tool.description,
                          parameters_json=json.dumps(tool.parameters) if tool.parameters is not None else "")
    if enable_thinking is not None:
        request.enable_thinking = enable_thinking
    return request


def _chat_chunk_from_proto(message: pb.ChatResponse, params: SamplingParams) -> ChatChunk:
    finished = message.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    want_top = bool(params.top_logprobs)
    return ChatChunk(
        request_id=message.request_id, text=message.text, reasoning=message.reasoning_text,
        tool_calls=[ToolCall(c.id, c.name, json.loads(c.arguments_json)) for c in message.tool_calls],
        token_ids=list(message.token_ids),
        finish_reason=_FINISH_REASONS.get(message.finish_reason) if finished else None,
        usage=_usage_from_proto(message.usage) if message.HasField("usage") else None,
        index=message.index, matched_stop=message.matched_stop or None if finished else None,
        logprobs=list(message.logprobs) if params.logprobs or want_top else None,
        top_logprobs=_tops(message.top_logprobs) if want_top else None)


def _model_info_from_proto(info: pb.ModelInfo) -> ModelInfo:
    groups = [WorkerGroupInfo(
        addresses=list(g.addresses), healthy=g.healthy, device=g.device, attention_backend=g.attention_backend,
        tensor_parallel_size=g.tensor_parallel_size, num_kv_blocks=g.num_kv_blocks,
        num_free_kv_blocks=g.num_free_kv_blocks, num_running=g.num_running, num_preemptions=g.num_preemptions,
        prefix_cache_queried_tokens=g.prefix_cache_queried_tokens, prefix_cache_hit_tokens=g.prefix_cache_hit_tokens,
        kv_cache_dtype=g.kv_cache_dtype,
    ) for g in info.worker_groups]
    return ModelInfo(info.model, info.max_model_len, info.vocab_size, list(info.eos_token_ids), info.block_size,
                     info.num_kv_blocks, groups)


@dataclass(frozen=True)
class _ChannelSettings:
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
              channel_options) -> "_ChannelSettings":
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


_UNSET = object()   # "no timeout given on this call": use the client's


class Client:
    """Blocking client. One channel, reused by every call and safe to share between threads;
    close it with `close()` or a `with` block.

    Args:
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
        self._settings = _ChannelSettings.build(
            target, tls=tls, ca_file=ca_file, client_cert=client_cert, client_key=client_key, token=token,
            token_file=token_file, channel_options=channel_options)
        self.timeout = timeout
        s = self._settings
        self._channel = (grpc.secure_channel(s.target, s.credentials(), options=s.options) if s.tls
                         else grpc.insecure_channel(s.target, options=s.options))
        self._stub = pb_grpc.GenerationStub(self._channel)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _timeout(self, timeout) -> float | None:
        return self.timeout if timeout is _UNSET else timeout

    def generate(self, prompt: Prompt, sampling: SamplingParams | None = None, *, request_id: str = "",
                 timeout: float | None = _UNSET, **options: Unpack[SamplingOptions]) -> Completion:
        """Runs one request to its end. Raises RequestError when the server refuses or fails it."""
        params = _sampling(sampling, options)
        acc = _Accumulator(params)
        for chunk in self._stream(prompt, params, request_id, timeout):
            acc.add(chunk)
        return acc.completion()

    def stream(self, prompt: Prompt, sampling: SamplingParams | None = None, *, request_id: str = "",
               timeout: float | None = _UNSET, **options: Unpack[SamplingOptions]) -> Iterator[CompletionChunk]:
        """Yields the request's chunks as they come; stop iterating (or close the iterator) to cancel it."""
        return self._stream(prompt, _sampling(sampling, options), request_id, timeout)

    def _stream(self, prompt: Prompt, params: SamplingParams, request_id: str, timeout) -> Iterator[CompletionChunk]:
        request = _generate_request(prompt, params, request_id)
        call = self._stub.Generate(request, timeout=self._timeout(timeout), metadata=self._settings.metadata)
        try:
            for message in call:
                yield _chunk_from_proto(message, params)
        except grpc.RpcError as exc:
            raise RequestError.from_rpc_error(exc) from exc
        finally:
            call.cancel()   # no-op after the end; aborts the request when the caller stopped early

    def chat(self, messages: Sequence[ChatMessage], sampling: SamplingParams | None = None, *,
             tools: Sequence[Tool | dict[str, Any]] = (), tool_choice: str = "auto",
             enable_thinking: bool | None = None, request_id: str = "", timeout: float | None = _UNSET,
             **options: Unpack[SamplingOptions]) -> ChatCompletion:
        """Runs one chat turn to its end. tool_choice: "auto", "none", "required" or a tool's name."""
        acc = _Accumulator(_sampling(sampling, options))
        for chunk in self.stream_chat(messages, sampling, tools=tools, tool_choice=tool_choice,
                                      enable_thinking=enable_thinking, request_id=request_id, timeout=timeout,
                                      **options):
            acc.add(chunk)
        return acc.chat_completion()

    def stream_chat(self, messages: Sequence[ChatMessage], sampling: SamplingParams | None = None, *,
                    tools: Sequence[Tool | dict[str, Any]] = (), tool_choice: str = "auto",
                    enable_thinking: bool | None = None, request_id: str = "", timeout: float | None = _UNSET,
                    **options: Unpack[SamplingOptions]) -> Iterator[ChatChunk]:
        """Yields a chat turn's chunks as they come; stop iterating to cancel it."""
        params = _sampling(sampling, options)
        request = _chat_request(messages, tools, tool_choice, enable_thinking, params, request_id)
        call = self._stub.Chat(request, timeout=self._timeout(timeout), metadata=self._settings.metadata)
        try:
            for message in call:
                yield _chat_chunk_from_proto(message, params)
        except grpc.RpcError as exc:
            raise RequestError.from_rpc_error(exc) from exc
        finally:
            call.cancel()

    def tokenize(self, text: str, *, add_special_tokens: bool = False, timeout: float | None = _UNSET) -> list[int]:
        """The token ids the server's tokenizer gives `text` (as a text prompt is tokenized)."""
        try:
            reply = self._stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens),
                                        timeout=self._timeout(timeout), metadata=self._settings.metadata)
        except grpc.RpcError as exc:
            raise RequestError.from_rpc_error(exc) from exc
        return list(reply.token_ids)

    def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False,
                   timeout: float | None = _UNSET) -> str:
        return self._detokenize(token_ids, skip_special_tokens, False, timeout).text

    def token_texts(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False,
                    timeout: float | None = _UNSET) -> list[str]:
        """The text of each token on its own, in one call (a piece of a multi-byte character is U+FFFD)."""
        return list(self._detokenize(token_ids, skip_special_tokens, True, timeout).token_texts)

    def _detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool, each_token: bool,
                    timeout: float | None) -> pb.DetokenizeResponse:
        try:
            return self._stub.Detokenize(pb.DetokenizeRequest(token_ids=token_ids, each_token=each_token,
                                                              skip_special_tokens=skip_special_tokens),
                                         timeout=self._timeout(timeout), metadata=self._settings.metadata)
        except grpc.RpcError as exc:
            raise RequestError.from_rpc_error(exc) from exc

    def abort(self, request_id: str, *, timeout: float | None = _UNSET) -> bool:
        """Ends a waiting or running request (its stream finishes with "abort"); False when the
        server knows no such request (it finished already, or never existed)."""
        try:
            reply = self._stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self._timeout(timeout),
                                     metadata=self._settings.metadata)
        except grpc.RpcError as exc:
            raise RequestError.from_rpc_error(exc) from exc
        return reply.found

    def model_info(self, *, timeout: float | None = _UNSET) -> ModelInfo:
        try:
            reply = self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self._timeout(timeout),
                                            metadata=self._settings.metadata)
        except grpc.RpcError as exc:
            raise RequestError.from_rpc_error(exc) from exc
        return _model_info_from_proto(reply)

    def health(self, service: str = "", *, timeout: float | None = _UNSET) -> str:
        """The server's grpc.health.v1 answer for `service` ("" is the whole server): SERVING,
        NOT_SERVING or SERVICE_UNKNOWN. Raises RequestError when it cannot be asked."""
        try:
            reply = health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=self._timeout(timeout))
        except grpc.RpcError as exc:
            raise RequestError.from_rpc_error(exc) from exc
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Returns once the server reports SERVING on grpc.health.v1; raises RequestError
        (DEADLINE_EXCEEDED, with the last answer) after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                last = self.health(timeout=max(0.1, min(2.0, timeout)))
                if last == "SERVING":
                    return
            except RequestError as exc:
                last = exc.code
            if time.monotonic() >= deadline:
                raise RequestError("DEADLINE_EXCEEDED", f"{self._settings.target} not SERVING after {timeout}s ({last})")
            time.sleep(0.2)


class AsyncClient:
    """asyncio client with Client's methods as coroutines (`stream` is an async iterator). Make it
    inside a running event loop; close it with `await close()` or an `async with` block. Takes
    the same arguments as Client."""

    def __init__(self, target: str | None = None, *, timeout: float | None = 600.0, tls: bool = False,
                 ca_file: str | pathlib.Path | None = None, client_cert: str | pathlib.Path | None = None,
                 client_key: str | pathlib.Path | None = None, token: str | None = None,
                 token_file: str | pathlib.Path | None = None,
                 channel_options: Sequence[tuple[str, object]] | None = None) -> None:
        self._settings = _ChannelSettings.build(
            target, tls=tls, ca_file=ca_file, client_cert=client_cert, client_key=client_key, token=token,
            token_file=token_file, channel_options=channel_options)
        self.timeout = timeout
        s = self._settings
        self._channel = (grpc.aio.secure_channel(s.target, s.credentials(), options=s.options) if s.tls
                         else grpc.aio.insecure_channel(s.target, options=s.options))
        self._stub = pb_grpc.GenerationStub(self._channel)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def _timeout(self, timeout) -> float | None:
        return self.timeout if timeout is _UNSET else timeout

    async def generate(self, prompt: Prompt, sampling: SamplingParams | None = None, *, request_id: str = "",
                       timeout: float | None = _UNSET, **options: Unpack[SamplingOptions]) -> Completion:
        """Runs one request to its end. Raises RequestError when the server refuses or fails it."""
        params = _sampling(sampling, options)
        acc = _Accumulator(params)
        async for chunk in self._stream(prompt, params, request_id, timeout):
            acc.add(chunk)
        return acc.completion()

    def stream(self, prompt: Prompt, sampling: SamplingParams | None = None, *, request_id: str = "",
               timeout: float | None = _UNSET, **options: Unpack[SamplingOptions]) -> AsyncIterator[CompletionChunk]:
        """Yields the request's chunks as they come; leave the `async for` (or `aclose()` the
        iterator) to cancel it."""
        return self._stream(prompt, _sampling(sampling, options), request_id, timeout)

    async def _stream(self, prompt: Prompt, params: SamplingParams, request_id: str,
                      timeout) -> AsyncIterator[CompletionChunk]:
        request = _generate_request(prompt, params, request_id)
        call = self._stub.Generate(request, timeout=self._timeout(timeout), metadata=self._settings.metadata)
        try:
            async for message in call:
                yield _chunk_from_proto(message, params)
        except grpc.RpcError as exc:
            raise RequestError.from_rpc_error(exc) from exc
        finally:
            call.cancel()

    async def chat(self, messages: Sequence[ChatMessage], sampling: SamplingParams | None = None, *,
                   tools: Sequence[Tool | dict[str, Any]] = (), tool_choice: str = "auto",
                   enable_thinking: bool | None = None, request_id: str = "", timeout: float | None = _UNSET,
                   **options: Unpack[SamplingOptions]) -> ChatCompletion:
        """Runs one chat turn to its end."""
        acc = _Accumulator(_sampling(sampling, options))
        async for chunk in self.stream_chat(messages, sampling, tools=tools, tool_choice=tool_choice,
                                            enable_thinking=enable_thinking, request_id=request_id,
                                            timeout=timeout, **options):
            acc.add(chunk)
        return acc.chat_completion()

    async def stream_chat(self, messages: Sequence[ChatMessage], sampling: SamplingParams | None = None, *,
                          tools: Sequence[Tool | dict[str, Any]] = (), tool_choice: str = "auto",
                          enable_thinking: bool | None = None, request_id: str = "", timeout: float | None = _UNSET,
                          **options: Unpack[SamplingOptions]) -> AsyncIterator[ChatChunk]:
        """Yields a chat turn's chunks as they come; leave the `async for` to cancel it."""
        params = _sampling(sampling, options)
        request = _chat_request(messages, tools, tool_choice, enable_thinking, params, request_id)
        call = self._stub.Chat(request, timeout=self._timeout(timeout), metadata=self._settings.metadata)
        try:
            async for message in call:
                yield _chat_chunk_from_proto(message, params)
        except grpc.RpcError as exc:
            raise RequestError.from_rpc_error(exc) from exc
        finally:
            call.cancel()

    async def tokenize(self, text: str, *, add_special_tokens: bool = False,
                       timeout: float | None = _UNSET) -> list[int]:
        try:
            reply = await self._stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens),
                                              timeout=self._timeout(timeout), metadata=self._settings.metadata)
        except grpc.RpcError as exc:
            raise RequestError.from_rpc_error(exc) from exc
        return list(reply.token_ids)

    async def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False,
                         timeout: float | None = _UNSET) -> str:
        return (await self._detokenize(token_ids, skip_special_tokens, False, timeout)).text

    async def token_texts(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False,
                          timeout: float | None = _UNSET) -> list[str]:
        """The text of each token on its own, in one call (a piece of a multi-byte character is U+FFFD)."""
        return list((await self._detokenize(token_ids, skip_special_tokens, True, timeout)).token_texts)

    async def _detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool, each_token: bool,
                          timeout: float | None) -> pb.DetokenizeResponse:
        try:
            return await self._stub.Detokenize(pb.DetokenizeRequest(token_ids=token_ids, each_token=each_token,
                                                                    skip_special_tokens=skip_special_tokens),
                                               timeout=self._timeout(timeout), metadata=self._settings.metadata)
        except grpc.RpcError as exc:
            raise RequestError.from_rpc_error(exc) from exc

    async def abort(self, request_id: str, *, timeout: float | None = _UNSET) -> bool:
        """Ends a waiting or running request; False when the server knows no such request."""
        try:
            reply = await self._stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self._timeout(timeout),
                                           metadata=self._settings.metadata)
        except grpc.RpcError as exc:
            raise RequestError.from_rpc_error(exc) from exc
        return reply.found

    async def model_info(self, *, timeout: float | None = _UNSET) -> ModelInfo:
        try:
            reply = await self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self._timeout(timeout),
                                                  metadata=self._settings.metadata)
        except grpc.RpcError as exc:
            raise RequestError.from_rpc_error(exc) from exc
        return _model_info_from_proto(reply)

    async def health(self, service: str = "", *, timeout: float | None = _UNSET) -> str:
        """The server's grpc.health.v1 answer for `service`: SERVING, NOT_SERVING or SERVICE_UNKNOWN."""
        try:
            reply = await health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=self._timeout(timeout))
        except grpc.RpcError as exc:
            raise RequestError.from_rpc_error(exc) from exc
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def wait_ready(self, timeout: float = 60.0) -> None:
        """Returns once the server reports SERVING on grpc.health.v1; raises RequestError after
        `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                last = await self.health(timeout=max(0.1, min(2.0, timeout)))
                if last == "SERVING":
                    return
            except RequestError as exc:
                last = exc.code
            if time.monotonic() >= deadline:
                raise RequestError("DEADLINE_EXCEEDED", f"{self._settings.target} not SERVING after {timeout}s ({last})")
            await asyncio.sleep(0.2)
