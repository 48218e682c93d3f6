"""The gateway's HTTP application (FastAPI): OpenAI's /v1/completions, /v1/chat/completions and
/v1/models, and /health, over one llm.v1 connection to the scheduler (common.client.AsyncClient).

Guarantees:
- every error is OpenAI's error body with an HTTP status mapped from the gRPC status
  (errors.py); a streamed request that the scheduler refuses is refused with that status too,
  since the stream's headers are only sent once its first chunk came (a failure after that
  point is one `data: {"error": ...}` event, then `data: [DONE]`);
- a client that disconnects mid-stream cancels the gRPC calls at once (not at the next write),
  which aborts the requests on the scheduler and frees their KV-cache blocks;
- streams are server-sent events, `data: {json}\\n\\n` each, ending with `data: [DONE]\\n\\n`;
  with stream_options.include_usage, every chunk has `"usage": null` and one last chunk with no
  choices carries the request's usage, as OpenAI sends it;
- a request body over max_request_bytes is refused with 413 before it is read whole (by its
  Content-Length, or as soon as a chunked body passes the bound), and a completion of more than
  max_sequences_per_request prompts x n with 400, so that one client cannot take the gateway's
  memory or the scheduler's waiting queue;
- `/v1/*` requires `Authorization: Bearer KEY` when API keys are configured; /health and /metrics
  never do (probes and scrapers carry no secrets), as vLLM's server has it;
- /metrics is Prometheus' text format (metrics.py): requests by route and status, time to first
  and last byte, requests in progress, tokens.

Choice indexes: a chat turn's choices are its n samples; a completion's choice index is
prompt index * n + sample index, as OpenAI numbers a batch of prompts.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.client import AsyncClient, ChatChunk, ChatCompletion, Completion, CompletionChunk, RequestError, ToolCall
from common.logging_setup import request_context
from gateway import outputs
from gateway.config import GatewayConfig
from gateway.errors import GatewayError, bad_param, error_body, from_request_error
from gateway.metrics import GatewayMetrics, HttpMetrics
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.token_text import TokenTexts
from gateway.translate import chat_call, completion_prompts, completion_sampling

log = logging.getLogger("openai_gateway")

HEALTH_TIMEOUT_S = 5.0


class Gateway:
    """The state behind the routes: the scheduler connection, the served model's name, the
    cache of token texts (for logprobs) and the metrics."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or GatewayMetrics()
        self.client = AsyncClient(config.target, timeout=config.request_timeout, **config.client_options)
        self.token_texts = TokenTexts(self.client)
        self.created = int(time.time())
        self._model_name: str | None = None

    async def close(self) -> None:
        await self.client.close()

    async def model_name(self) -> str:
        """The scheduler's model name, asked once (a scheduler keeps its model for its life)."""
        if self._model_name is None:
            self._model_name = (await self.client.model_info(timeout=HEALTH_TIMEOUT_S)).model
        return self._model_name

    async def check_model(self, requested: str | None) -> str:
        name = await self.model_name()
        if requested not in (None, "", name):
            raise GatewayError(404, f"The model {requested!r} does not exist; this server serves {name!r}",
                               "model", "model_not_found")
        return name


# ---- responses ----------------------------------------------------------------------------------

class EventStream(StreamingResponse):
    """Server-sent events whose body is cancelled as soon as the client disconnects. Starlette's
    StreamingResponse, under ASGI 2.4 servers (uvicorn), only notices at its next write, which
    for a request waiting in the scheduler's queue may be minutes away."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    with contextlib.suppress(OSError):   # the client went away between two writes
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()


async def _opened(stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """`stream` with its first item already received: a refusal of the request raises here, before
    any response header is sent, so it gets its own HTTP status rather than a 200 stream."""
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        first = None

    async def rest() -> AsyncIterator[Any]:
        try:
            if first is None:
                return
            yield first
            async for item in stream:
                yield item
        finally:
            await stream.aclose()
    return rest()


def _tool_call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}


def _stream_failure(exc: Exception) -> str:
    """The event that ends a stream that failed after its headers were sent."""
    if isinstance(exc, GatewayError):
        return outputs.sse(exc.body())
    if isinstance(exc, RequestError):
        error = from_request_error(exc)
        log.warning("stream failed: %s", exc)
        return outputs.sse(error.body())
    log.exception("stream failed")
    return outputs.sse(error_body(500, f"internal error: {type(exc).__name__}: {exc}", code="internal"))


# ---- /v1/completions ----------------------------------------------------------------------------

async def completions(gateway: Gateway, req: CompletionRequest, request: Request):
    sampling = completion_sampling(req)
    prompts = completion_prompts(req)
    n = sampling.n or 1
    if len(prompts) * n > gateway.config.max_sequences_per_request:
        raise bad_param("prompt", f"a request may ask for at most {gateway.config.max_sequences_per_request} "
                                  f"sequences (prompts x n); this one asks for {len(prompts)} x {n}")
    model = await gateway.check_model(req.model)
    rid = req.request_id or uuid.uuid4().hex
    rids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
    base = {"id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()), "model": model}
    with request_context(rid):
        if req.stream:
            streams = [gateway.client.stream(p, sampling, request_id=r) for p, r in zip(prompts, rids)]
            items = await _opened(outputs.merge(streams))
            return EventStream(_event_stream(
                lambda usage: _completion_choices(gateway, items, n, bool(sampling.logprobs), usage), base, req,
                lambda usage: gateway.metrics.count_usage("/v1/completions", usage)))
        results: list[Completion] = await _unless_disconnected(request, _gather(
            [gateway.client.generate(p, sampling, request_id=r) for p, r in zip(prompts, rids)]))
    usage = outputs.UsageTotal()
    choices = []
    for p, result in enumerate(results):
        for sample in result.samples or [result]:
            usage.add(sample.usage, first_sample=sample.index == 0)
            logprobs = None
            if sampling.logprobs:
                texts = await gateway.token_texts.texts(outputs.token_ids_of(sample.token_ids, sample.top_logprobs))
                logprobs = outputs.completion_logprobs(sample.token_ids, sample.logprobs or [], sample.top_logprobs,
                                                       texts, 0)
            choices.append({"index": p * n + sample.index, "text": sample.text, "logprobs": logprobs,
                            "finish_reason": sample.finish_reason, "stop_reason": sample.matched_stop})
    gateway.metrics.count_usage("/v1/completions", usage)
    return {**base, "choices": choices, "usage": usage.to_json()}


async def _event_stream(choices: Callable[[outputs.UsageTotal], AsyncIterator[dict[str, Any]]],
                        base: dict[str, Any], req: CompletionRequest | ChatCompletionRequest,
                        on_end: Callable[[outputs.UsageTotal], None]) -> AsyncIterator[str]:
    """What every stream sends around its choices (`choices(usage)` yields one choice per event and
    adds each finished sample's usage): with stream_options.include_usage, `"usage": null` on every
    chunk and a last chunk of the total; a failure after the headers as one error event; then [DONE].
    `on_end(usage)` is told what the finished samples used, however the stream ends."""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    usage = outputs.UsageTotal()
    extra = {"usage": None} if include_usage else {}
    try:
        async for choice in choices(usage):
            yield outputs.sse({**base, "choices": [choice], **extra})
        if include_usage:
            yield outputs.sse({**base, "choices": [], "usage": usage.to_json()})
    except Exception as exc:  # noqa: BLE001 - the headers are sent: the stream's last event says what failed
        yield _stream_failure(exc)
    finally:
        on_end(usage)
    yield outputs.DONE


async def _completion_choices(gateway: Gateway, items: AsyncIterator[tuple[int, CompletionChunk]], n: int,
                              logprobs: bool, usage: outputs.UsageTotal) -> AsyncIterator[dict[str, Any]]:
    offsets: dict[int, int] = {}   # choice index -> length of its text so far (logprobs' text_offset)
    async for p, chunk in items:
        index = p * n + chunk.index
        choice: dict[str, Any] = {"index": index, "text": chunk.text, "logprobs": None,
                                  "finish_reason": chunk.finish_reason}
        if chunk.finish_reason is not None:
            choice["stop_reason"] = chunk.matched_stop
        if logprobs and chunk.token_ids:
            texts = await gateway.token_texts.texts(outputs.token_ids_of(chunk.token_ids, chunk.top_logprobs))
            choice["logprobs"] = outputs.completion_logprobs(chunk.token_ids, chunk.logprobs or [],
                                                             chunk.top_logprobs, texts, offsets.get(index, 0))
        offsets[index] = offsets.get(index, 0) + len(chunk.text)
        if chunk.usage is not None:
            usage.add(chunk.usage, first_sample=chunk.index == 0)
        # A chunk whose tokens end inside a UTF-8 character has no text yet: nothing to send.
        if chunk.text or chunk.finish_reason is not None or choice["logprobs"] is not None:
            yield choice


# ---- /v1/chat/completions -----------------------------------------------------------------------

async def chat_completions(gateway: Gateway, req: ChatCompletionRequest, request: Request):
    call = chat_call(req)
    model = await gateway.check_model(req.model)
    rid = req.request_id or uuid.uuid4().hex
    base = {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()), "model": model}
    kwargs = dict(tools=call.tools, tool_choice=call.tool_choice, enable_thinking=call.enable_thinking, request_id=rid)
    logprobs = bool(call.sampling.logprobs)
    with request_context(rid):
        if req.stream:
            stream = gateway.client.stream_chat(call.messages, call.sampling, **kwargs)
            items = await _opened(outputs.merge([stream]))
            return EventStream(_event_stream(lambda usage: _chat_choices(gateway, items, logprobs, usage),
                                             {**base, "object": "chat.completion.chunk"}, req,
                                             lambda usage: gateway.metrics.count_usage("/v1/chat/completions", usage)))
        result: ChatCompletion = await _unless_disconnected(
            request, gateway.client.chat(call.messages, call.sampling, **kwargs))
    usage = outputs.UsageTotal()
    choices = []
    for sample in result.samples or [result]:
        usage.add(sample.usage, first_sample=sample.index == 0)
        message: dict[str, Any] = {"role": "assistant",
                                   "content": sample.text if sample.text or not sample.tool_calls else None,
                                   "reasoning_content": sample.reasoning or None,
                                   "tool_calls": [_tool_call_json(c) for c in sample.tool_calls]}
        choice: dict[str, Any] = {"index": sample.index, "message": message, "logprobs": None,
                                  "finish_reason": sample.finish_reason}
        if logprobs:
            choice["logprobs"] = await _chat_logprobs(gateway, sample.token_ids, sample.logprobs, sample.top_logprobs)
        choices.append(choice)
    gateway.metrics.count_usage("/v1/chat/completions", usage)
    return {**base, "choices": choices, "usage": usage.to_json()}


async def _chat_logprobs(gateway: Gateway, token_ids, logprobs, top_logprobs) -> dict[str, Any]:
    texts = await gateway.token_texts.texts(outputs.token_ids_of(token_ids, top_logprobs))
    return outputs.chat_logprobs(token_ids, logprobs or [], top_logprobs, texts)


async def _chat_choices(gateway: Gateway, items: AsyncIterator[tuple[int, ChatChunk]], logprobs: bool,
                        usage: outputs.UsageTotal) -> AsyncIterator[dict[str, Any]]:
    calls_so_far: dict[int, int] = {}   # choice index -> tool calls sent (each delta's tool_calls[].index)
    async for _, chunk in items:
        i = chunk.index
        if i not in calls_so_far:   # a choice's first chunk names the role, as OpenAI's do
            calls_so_far[i] = 0
            yield {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        delta: dict[str, Any] = {}
        if chunk.text:
            delta["content"] = chunk.text
        if chunk.reasoning:
            delta["reasoning_content"] = chunk.reasoning
        if chunk.tool_calls:
            delta["tool_calls"] = [{"index": calls_so_far[i] + k, **_tool_call_json(c)}
                                   for k, c in enumerate(chunk.tool_calls)]
            calls_so_far[i] += len(chunk.tool_calls)
        choice: dict[str, Any] = {"index": i, "delta": delta, "logprobs": None, "finish_reason": chunk.finish_reason}
        if logprobs and chunk.token_ids:
            choice["logprobs"] = await _chat_logprobs(gateway, chunk.token_ids, chunk.logprobs, chunk.top_logprobs)
        if chunk.usage is not None:
            usage.add(chunk.usage, first_sample=i == 0)
        if delta or chunk.finish_reason is not None or choice["logprobs"] is not None:
            yield choice


class ClientGone(Exception):
    """The client closed the connection before its (unstreamed) answer was ready."""


async def _unless_disconnected(request: Request, call):
    """Awaits `call` (a coroutine) unless the client disconnects first, which cancels it (and so
    its gRPC calls: a client that gave up on a long unstreamed completion frees its KV blocks).
    The body has been read, so the next ASGI message can only be http.disconnect."""
    task = asyncio.ensure_future(call)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        watcher.cancel()
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _gather(calls: list) -> list:
    """Runs the calls concurrently; the first failure cancels the others (and their gRPC calls)."""
    if len(calls) == 1:
        return [await calls[0]]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in calls]
    except BaseExceptionGroup as grouped:
        raise grouped.exceptions[0] from None
    return [t.result() for t in tasks]


# ---- the application ----------------------------------------------------------------------------

class ApiKeyCheck:
    """Refuses /v1/* without `Authorization: Bearer KEY` of a configured key (401, OpenAI's body).
    A plain ASGI middleware: Starlette's BaseHTTPMiddleware would stand between the routes and
    the client's disconnect, which cancels the gRPC calls."""

    def __init__(self, app, keys: Sequence[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            scheme, _, key = header.partition(b" ")
            # compare_digest against every key: the time taken says nothing about any of them.
            matches = [hmac.compare_digest(key.strip(), k) for k in self.keys]
            if scheme.lower() != b"bearer" or not any(matches):
                body = error_body(401, "a valid API key is required: Authorization: Bearer KEY", code="invalid_api_key")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuses a request body over `max_bytes` with 413: at once by its Content-Length, or while a
    chunked body is read (FastAPI lets an HTTPException raised while reading the body through)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: str) -> StarletteHTTPException:
        return StarletteHTTPException(413, f"the request body is {size} bytes, more than the gateway's limit of "
                                           f"{self.max_bytes} (--max-request-body-mib)")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            error = self._too_large(length.decode())
            await JSONResponse(error_body(413, error.detail, code="request_too_large"), status_code=413,
                               headers={"connection": "close"})(scope, receive, send)
            return
        received = 0

        async def bounded() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large(f"more than {received}")
            return message

        await self.app(scope, bounded, send)


def _validation_error(exc: RequestValidationError) -> GatewayError:
    """pydantic's complaint about a request body as one 400 naming the first field at fault."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        why = first.get("ctx", {}).get("error", "")
        return GatewayError(400, f"the request body is not valid JSON: {why}".rstrip(": "), None, "invalid_json")
    # Unions report every alternative's path (messages.0.content.str); keep the field's own path.
    param = ""
    for part in loc:
        if part.isdigit():
            param += f"[{part}]"
        elif part in ("str", "int", "list[str]", "list[int]", "list[list[int]]", "NamedToolChoice") or "[" in part \
                or part.startswith("literal"):
            break
        else:
            param += f".{part}" if param else part
    if first.get("type") == "extra_forbidden":
        return GatewayError(400, f"unrecognized request argument: {param}", param or None, "unknown_parameter")
    if first.get("type") == "missing":
        return GatewayError(400, f"{param} is required", param or None, "missing_parameter")
    return GatewayError(400, f"{param}: {first.get('msg', 'invalid value')}", param or None, "invalid_parameter")


def create_app(config: GatewayConfig) -> FastAPI:
    state: dict[str, Gateway] = {}
    metrics = GatewayMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        state["gateway"] = Gateway(config, metrics)   # the gRPC aio channel belongs to the server's event loop
        try:
            yield
        finally:
            await state.pop("gateway").close()

    app = FastAPI(title="qwen3-serve OpenAI-compatible gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    if config.api_keys:
        app.add_middleware(ApiKeyCheck, keys=config.api_keys)
    if config.max_request_bytes:
        app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    app.add_middleware(HttpMetrics, metrics=metrics)   # added last: outermost, so refusals count too

    @app.exception_handler(GatewayError)
    async def on_gateway_error(_request: Request, exc: GatewayError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestError)
    async def on_request_error(_request: Request, exc: RequestError):
        error = from_request_error(exc)
        if error.status >= 500:
            log.warning("scheduler call failed: %s", exc)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_request: Request, exc: RequestValidationError):
        error = _validation_error(exc)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_request: Request, exc: StarletteHTTPException):
        code = "request_too_large" if exc.status_code == 413 else None
        return JSONResponse(error_body(exc.status_code, str(exc.detail), code=code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientGone)
    async def on_client_gone(_request: Request, _exc: ClientGone):
        return JSONResponse(error_body(499, "the client closed the request", code="cancelled"), status_code=499)

    @app.exception_handler(Exception)
    async def on_unexpected(_request: Request, exc: Exception):
        log.exception("request failed")
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}: {exc}", code="internal"),
                            status_code=500)

    @app.post("/v1/completions")
    async def post_completions(req: CompletionRequest, request: Request):
        return await completions(state["gateway"], req, request)

    @app.post("/v1/chat/completions")
    async def post_chat_completions(req: ChatCompletionRequest, request: Request):
        return await chat_completions(state["gateway"], req, request)

    async def model_card() -> dict[str, Any]:
        gateway = state["gateway"]
        info = await gateway.client.model_info(timeout=HEALTH_TIMEOUT_S)
        gateway._model_name = info.model
        return {"id": info.model, "object": "model", "created": gateway.created, "owned_by": "qwen3-serve",
                "root": info.model, "parent": None, "max_model_len": info.max_model_len}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [await model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        card = await model_card()
        if model_id != card["id"]:
            raise GatewayError(404, f"The model {model_id!r} does not exist; this server serves {card['id']!r}",
                               "model", "model_not_found")
        return card

    @app.get("/health")
    async def health():
        """200 while the scheduler reports SERVING on grpc.health.v1, else 503 with its answer."""
        try:
            status = await state["gateway"].client.health(timeout=HEALTH_TIMEOUT_S)
        except RequestError as exc:
            return JSONResponse(error_body(503, f"the scheduler cannot be asked: {exc}", code=exc.code.lower()),
                                status_code=503)
        if status != "SERVING":
            return JSONResponse(error_body(503, f"the scheduler reports {status}", code=status.lower()),
                                status_code=503)
        return {"status": "ok", "scheduler": status}

    @app.get("/metrics")
    async def prometheus_metrics():
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    return app
