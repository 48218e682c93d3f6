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

The package: sampling.py (SamplingParams), results.py (what calls return), calls.py (each RPC's
request and replies, built once for both clients), accumulator.py (a stream folded into a
Completion), base.py (what both clients share: channel, deadlines, streams), sync.py (Client) and
aio.py (AsyncClient).
"""
from common.client.aio import AsyncClient
from common.client.calls import ChatMessage, Prompt
from common.client.base import DEFAULT_TARGET, MAX_MESSAGE_BYTES, TARGET_ENV
from common.client.results import (ChatChunk, ChatCompletion, Completion, CompletionChunk, FinishReason, ModelInfo,
                                   RequestError, Tool, ToolCall, TopLogprobs, Usage, WorkerGroupInfo)
from common.client.sampling import SamplingOptions, SamplingParams
from common.client.sync import Client

__all__ = [
    "AsyncClient", "ChatChunk", "ChatCompletion", "ChatMessage", "Client", "Completion", "CompletionChunk",
    "DEFAULT_TARGET", "FinishReason", "MAX_MESSAGE_BYTES", "ModelInfo", "Prompt", "RequestError", "SamplingOptions",
    "SamplingParams", "TARGET_ENV", "Tool", "ToolCall", "TopLogprobs", "Usage", "WorkerGroupInfo",
]
