"""The public gRPC API (llm.v1.Generation) of one frontend, plus health and reflection: where
requests are validated and frontend outputs become GenerateResponses and ChatResponses (the only
place the public proto types appear).

A Chat request is rendered by the model's chat template (scheduler_svc/frontend/chat.py) and then served
as a Generate of the rendered tokens; its output text goes through one ChatOutputParser per sample
(scheduler_svc/frontend/chat_parser.py), which splits it into reasoning, content and tool calls.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import uuid

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.logging_setup import bind_request_id
from common.model_dir import ModelFacts
from common.pb.llm.v1 import generation_pb2, generation_pb2_grpc
from common.reflection import enable_server_reflection
from common.status_guard import bounded_message
from common.features import STRUCTURED_OUTPUT, unavailable
from scheduler_svc.frontend.admission_pool import (INLINE_TEXT_CHARS, INLINE_TOKEN_IDS, AdmissionPool, admits_inline,
                                                   chat_admits_inline)
from scheduler_svc.frontend.chat import (ChatMessage, ChatPrompt, Tool, ToolCall, chat_text_bytes, check_chat_counts,
                                         check_chat_size, render_chat)
from scheduler_svc.frontend.chat_parser import ChatDelta, ChatOutputParser
from scheduler_svc.frontend.core_client import CoreUnreachable
from scheduler_svc.engine.api import AddCode, CoreInfo, RequestError
from scheduler_svc.frontend.streams import Frontend, Refused, RequestFailed
from scheduler_svc.frontend.tokenizer import TooManyTokens
from scheduler_svc.frontend.output_stream import RequestOutput, TopLogprobs
from common.sampling import SamplingParams
from common.sampling_bounds import MAX_SAMPLING_BYTES
from scheduler_svc.engine.sequence import FinishReason
from scheduler_svc.frontend.validation import (InvalidRequest, Limits, check_constraint, validate_chat_sampling,
                                      validate_request)

logger = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name

# What a request's fields can take in bytes beyond its text (max_request_bytes): a varint id, a
# chat message's or tool's framing (tags, lengths, role; its strings count as text), its sampling
# options (MAX_SAMPLING_BYTES and a constraint), and spare room. The bound is tight on purpose:
# decoding costs by the number of values, and 200,000 chat messages fit in less than 2 MB.
_VARINT_BYTES = 5
_COPY_CHUNK = 4096        # strings copied into a message per call, off the event loop
_MESSAGE_BYTES = 32
_SLACK_BYTES = 64 << 10
# Each method's request message, whose longest field names what makes a request too long (decode_guard.py).
_REQUEST_TYPES = {"Generate": generation_pb2.GenerateRequest, "Chat": generation_pb2.ChatRequest,
                  "Tokenize": generation_pb2.TokenizeRequest, "Detokenize": generation_pb2.DetokenizeRequest}

_FINISH_TO_PROTO = {
    FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: generation_pb2.FINISH_REASON_ABORT,
}
_REFUSAL_CODES = {
    AddCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    AddCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    AddCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    AddCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
}


def _top_logprobs(tops: list[TopLogprobs]) -> list[generation_pb2.TopLogprobs]:
    return [generation_pb2.TopLogprobs(token_ids=ids, logprobs=values) for ids, values in tops]


def _fill_common(msg, out: RequestOutput) -> None:
    """What GenerateResponse and ChatResponse share: tokens, logprobs, the sample's ending."""
    msg.token_ids.extend(out.token_ids)
    msg.logprobs.extend(out.logprobs)
    msg.index = out.index
    if out.top_logprobs:
        msg.top_logprobs.extend(_top_logprobs(out.top_logprobs))
    if out.prompt_logprobs is not None:
        msg.prompt_logprobs.extend(out.prompt_logprobs)
        if out.prompt_top_logprobs is not None:
            msg.prompt_top_logprobs.extend(_top_logprobs(out.prompt_top_logprobs))
    if out.finish_reason is not None:
        msg.finish_reason = _FINISH_TO_PROTO[out.finish_reason]
        u = out.usage
        msg.usage.CopyFrom(generation_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                                cached_prompt_tokens=u.cached_prompt_tokens))
        if out.matched_stop is not None:
            msg.matched_stop = out.matched_stop


def to_response(request_id: str, out: RequestOutput) -> generation_pb2.GenerateResponse:
    msg = generation_pb2.GenerateResponse(request_id=request_id, text=out.text)
    _fill_common(msg, out)
    return msg


def to_chat_response(request_id: str, out: RequestOutput, delta: ChatDelta, num_tool_calls: int
                     ) -> generation_pb2.ChatResponse:
    """A chat message: `delta` is the parsed text of `out`; a turn that stopped after tool calls
    (num_tool_calls of them) ends with TOOL_CALLS, as vLLM reports it."""
    msg = generation_pb2.ChatResponse(
        request_id=request_id, text=delta.text, reasoning_text=delta.reasoning,
        tool_calls=[generation_pb2.ToolCall(id=c.id, name=c.name, arguments_json=c.arguments_json)
                    for c in delta.tool_calls])
    _fill_common(msg, out)
    if out.finish_reason is FinishReason.STOP and num_tool_calls:
        msg.finish_reason = generation_pb2.FINISH_REASON_TOOL_CALLS
    return msg


def _num_tool_calls(request: generation_pb2.ChatRequest) -> int:
    return sum(len(m.tool_calls) for m in request.messages)


def chat_from_proto(request: generation_pb2.ChatRequest) -> tuple[list[ChatMessage], list[Tool]]:
    messages = [ChatMessage(role=m.role, content=m.content,
                            tool_calls=tuple(ToolCall(c.id, c.name, c.arguments_json) for c in m.tool_calls),
                            tool_call_id=m.tool_call_id,
                            reasoning_content=m.reasoning_content if m.HasField("reasoning_content") else None)
                for m in request.messages]
    return messages, [Tool(t.name, t.description, t.parameters_json) for t in request.tools]


def to_model_info(info: CoreInfo, model: ModelFacts) -> generation_pb2.ModelInfo:
    groups = [
        generation_pb2.WorkerGroupInfo(
            addresses=g.addresses, healthy=g.healthy, num_kv_blocks=g.num_kv_blocks,
            num_free_kv_blocks=g.num_free_kv_blocks, num_running=g.num_running, device=g.device,
            attention_backend=g.attention_backend, num_preemptions=g.num_preemptions,
            prefix_cache_queried_tokens=g.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=g.prefix_cache_hit_tokens, tensor_parallel_size=len(g.addresses),
            kv_cache_dtype=g.kv_cache_dtype)
        for g in info.groups
    ]
    up = [g for g in info.groups if g.block_size]
    speculating = next((g for g in up if g.healthy and g.speculative_method), None)
    return generation_pb2.ModelInfo(
        model=model.name, max_model_len=info.status.max_model_len, vocab_size=model.vocab_size,
        eos_token_ids=model.eos_token_ids, block_size=up[0].block_size if up else 0,
        num_kv_blocks=sum(g.num_kv_blocks for g in info.groups), worker_groups=groups,
        features=[generation_pb2.Feature(name=f.name, available=f.available, detail=f.detail)
                  for f in info.status.features],
        speculative_method=speculating.speculative_method if speculating else "",
        num_speculative_tokens=speculating.num_speculative_tokens if speculating else 0)


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, frontend: Frontend, *, model: ModelFacts, limits: Limits,
                 allow_chat_special_tokens: bool = False) -> None:
        """`model`: its facts, named as served; `allow_chat_special_tokens`: a chat's text may write special tokens (trusted clients);
        by default they are tokenized as text (scheduler_svc/frontend/chat_tokens.py)."""
        self.frontend = frontend
        self.model = model
        self.limits = limits
        self.allow_chat_special_tokens = allow_chat_special_tokens
        self.admission = AdmissionPool()

    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        status = self.frontend.status
        if not status.max_model_len:     # no worker group has ever been up: nothing to validate against
            await self._refuse(context, grpc.StatusCode.UNAVAILABLE, status.reason or "no worker group is ready")
        tokenizer = self.frontend.tokenizer
        # Off the event loop unless it is small (admission_pool says why); a text of more tokens
        # than the context holds is refused by its count, its ids never listed.
        admit = functools.partial(
            validate_request, request, vocab_size=self.model.vocab_size, max_model_len=status.max_model_len,
            tokenize=functools.partial(tokenizer.encode, max_tokens=status.max_model_len - 1), limits=self.limits,
            max_input_bytes_per_token=tokenizer.max_input_bytes_per_token)
        try:
            prompt_ids, params = await self.admission.run(admits_inline(request), admit)
        except InvalidRequest as e:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        field = f"sampling.{params.constraint.kind}" if params.constraint is not None else ""
        await self._check_features(params, context)
        request_id = request.request_id or uuid.uuid4().hex
        bind_request_id(request_id)   # this handler's task ends with the request
        # Which frontend process serves the stream (several share the port): for operators and tests.
        await context.send_initial_metadata((("frontend-id", str(self.frontend.core.frontend_id)),))
        try:
            stream = await self.frontend.submit(request_id, prompt_ids, params)
        except Refused as e:
            await self._refuse(context, _REFUSAL_CODES[e.code], str(e))
        logger.info("admitted: %d prompt tokens, max_tokens %d, n %d", len(prompt_ids), params.max_tokens, params.n)
        try:
            async with contextlib.aclosing(stream):   # a cancelled call ends its request at once
                async for out in stream:
                    yield to_response(request_id, out)
        except RequestFailed as e:
            await self._fail(context, e.error, field)

    async def Chat(self, request: generation_pb2.ChatRequest, context: grpc.aio.ServicerContext):
        status = self.frontend.status
        if not status.max_model_len:
            await self._refuse(context, grpc.StatusCode.UNAVAILABLE, status.reason or "no worker group is ready")
        try:
            check_chat_counts(len(request.messages), len(request.tools), self.limits,   # before converting any
                              functools.partial(_num_tool_calls, request))
            prompt, params = await self.admission.run(
                chat_admits_inline(request), functools.partial(self._prepare_chat, request, status.max_model_len))
        except InvalidRequest as e:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        field = ("tools" if prompt.constraint is not None
                 else f"sampling.{params.constraint.kind}" if params.constraint is not None else "")
        await self._check_features(params, context)
        request_id = request.request_id or uuid.uuid4().hex
        bind_request_id(request_id)
        await context.send_initial_metadata((("frontend-id", str(self.frontend.core.frontend_id)),))
        try:
            stream = await self.frontend.submit(request_id, prompt.token_ids, params)
        except Refused as e:
            await self._refuse(context, _REFUSAL_CODES[e.code], str(e))
        logger.info("admitted chat: %d prompt tokens, max_tokens %d, n %d, tools %d (%s)", len(prompt.token_ids),
                    params.max_tokens, params.n, len(request.tools), request.tool_choice or "auto")
        parsers: dict[int, ChatOutputParser] = {}
        try:
            async with contextlib.aclosing(stream):
                async for out in stream:
                    parser = parsers.get(out.index)
                    if parser is None:
                        parser = parsers[out.index] = ChatOutputParser(reasoning_open=prompt.reasoning_open,
                                                                       parse_tool_calls=prompt.parse_tool_calls)
                    delta = parser.feed(out.text)
                    if out.finished:
                        tail = parser.finish()
                        delta = ChatDelta(delta.reasoning + tail.reasoning, delta.text + tail.text,
                                          delta.tool_calls + tail.tool_calls)
                    yield to_chat_response(request_id, out, delta, parser.num_tool_calls)
        except RequestFailed as e:
            await self._fail(context, e.error, field)

    def _prepare_chat(self, request: generation_pb2.ChatRequest, max_model_len: int
                      ) -> tuple[ChatPrompt, SamplingParams]:
        """The rendered prompt and the resolved sampling (with the tool_choice's constraint), or
        InvalidRequest. Runs in a thread: rendering and tokenizing a long chat take a while."""
        messages, tools = chat_from_proto(request)
        check_chat_size(messages, tools, self.limits)
        max_tokens = max_model_len - 1
        per_token = self.frontend.tokenizer.max_input_bytes_per_token
        size = chat_text_bytes(messages)
        if per_token is not None and size > max_tokens * per_token:
            raise InvalidRequest("messages", f"messages: the rendered prompt would be longer than max_model_len "
                                             f"{max_model_len} tokens: the messages hold {size} bytes of text, and a "
                                             f"token covers at most {per_token} bytes")
        try:
            prompt = render_chat(self.frontend.tokenizer, messages, tools, request.tool_choice,
                                 request.enable_thinking if request.HasField("enable_thinking") else None,
                                 limits=self.limits, allow_special_tokens=self.allow_chat_special_tokens,
                                 max_tokens=max_tokens)
        except TooManyTokens as e:
            raise InvalidRequest("messages", f"messages: the rendered prompt has {e.num_tokens} tokens; max_model_len "
                                             f"{max_model_len} leaves no room for a generated token") from None
        params = validate_chat_sampling(request.request_id, request.sampling, len(prompt.token_ids),
                                        vocab_size=self.model.vocab_size, max_model_len=max_model_len, limits=self.limits)
        if prompt.constraint is not None:
            if params.constraint is not None:
                raise InvalidRequest("sampling", f"sampling.{params.constraint.kind} cannot go with tool_choice "
                                                 f"{request.tool_choice!r}, which constrains the output to tool calls")
            check_constraint(prompt.constraint, self.limits, "tools")
            params = dataclasses.replace(params, constraint=prompt.constraint)
        return prompt, params

    async def Tokenize(self, request: generation_pb2.TokenizeRequest, context) -> generation_pb2.TokenizeResponse:
        text, limit = request.text, self.limits.max_prompt_bytes
        if len(text) > limit:       # characters: no more than bytes, and free to count
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, f"text is over {limit} bytes, the limit")
        size = len(text.encode("utf-8"))
        if size > limit:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                               f"text is {size} bytes, more than the limit of {limit}")
        ids = await self.admission.run(len(text) <= INLINE_TEXT_CHARS, functools.partial(
            self.frontend.tokenizer.encode, text, add_special_tokens=request.add_special_tokens))
        return generation_pb2.TokenizeResponse(token_ids=ids, count=len(ids),
                                               max_model_len=self.frontend.status.max_model_len)

    async def Detokenize(self, request: generation_pb2.DetokenizeRequest, context
                         ) -> generation_pb2.DetokenizeResponse:
        count, limit = len(request.token_ids), self.limits.max_detokenize_ids
        if count > limit:           # before a single id is copied
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                               f"token_ids has {count} ids, more than the limit of {limit}")
        tokenizer, skip, each_token, vocab_size = (self.frontend.tokenizer, request.skip_special_tokens,
                                                   request.each_token, self.model.vocab_size)

        def decode() -> generation_pb2.DetokenizeResponse:   # one trip to a thread for the checks and both decodes
            ids = list(request.token_ids)
            if ids and max(ids) >= vocab_size:
                index = next(i for i, token_id in enumerate(ids) if token_id >= vocab_size)
                raise InvalidRequest("token_ids", f"token_ids[{index}] = {ids[index]} is out of range: vocab_size is "
                                                  f"{vocab_size}")
            response = generation_pb2.DetokenizeResponse(text=tokenizer.decode(ids, skip_special_tokens=skip))
            if each_token:
                texts = tokenizer.decode_each(ids, skip_special_tokens=skip)
                for start in range(0, len(texts), _COPY_CHUNK):   # each copy holds the GIL: short ones
                    response.token_texts.extend(texts[start:start + _COPY_CHUNK])
            return response

        try:
            return await self.admission.run(count <= INLINE_TOKEN_IDS // 8, decode)
        except InvalidRequest as e:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def max_request_bytes(self, method: str) -> int | None:
        """The most bytes a request of `method` (a full method name) can take within the limits,
        with room to spare; a longer one is refused before it is decoded (decode_guard.py)."""
        limits, name = self.limits, method.rsplit("/", 1)[-1]
        sampling = MAX_SAMPLING_BYTES + limits.max_constraint_bytes
        if name == "Detokenize":
            return _VARINT_BYTES * limits.max_detokenize_ids + _SLACK_BYTES
        if name == "Tokenize":
            return limits.max_prompt_bytes + _SLACK_BYTES
        if name == "Chat":
            return (limits.max_prompt_bytes + _MESSAGE_BYTES * (limits.max_chat_messages + limits.max_tools) +
                    sampling + _SLACK_BYTES)
        if name == "Generate":
            ids = _VARINT_BYTES * max(self.frontend.status.max_model_len, 1 << 17)
            return max(limits.max_prompt_bytes, ids) + sampling + _SLACK_BYTES
        return None

    @staticmethod
    def request_type(method: str) -> type[Message] | None:
        """The request message of `method` (a full method name), read for the field that makes a
        request longer than max_request_bytes allows."""
        return _REQUEST_TYPES.get(method.rsplit("/", 1)[-1])

    async def _check_features(self, params: SamplingParams, context: grpc.aio.ServicerContext) -> None:
        """Refuses (UNIMPLEMENTED, naming the missing package) what the workers cannot serve."""
        if params.constraint is not None:
            missing = unavailable(self.frontend.status.features, STRUCTURED_OUTPUT)
            if missing is not None:
                await self._refuse(context, grpc.StatusCode.UNIMPLEMENTED, missing.detail)

    async def _fail(self, context: grpc.aio.ServicerContext, error: RequestError, field: str) -> None:
        """Ends the call with the status of a request that failed after admission."""
        message = f"{field or 'the constraint'} {error.message}" if error.about_constraint else error.message
        code = getattr(grpc.StatusCode, error.code, grpc.StatusCode.INTERNAL)
        await self._refuse(context, code, message)

    async def _refuse(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        self.frontend.count_rejection(code.name)
        await context.abort(code, bounded_message(message))

    async def Abort(self, request: generation_pb2.AbortRequest, context) -> generation_pb2.AbortResponse:
        try:
            return generation_pb2.AbortResponse(found=await self.frontend.abort(request.request_id))
        except CoreUnreachable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    async def GetModelInfo(self, request, context) -> generation_pb2.ModelInfo:
        try:
            info = await self.frontend.info()
        except CoreUnreachable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        if not info.status.max_model_len:
            await context.abort(grpc.StatusCode.UNAVAILABLE, info.status.reason or "no worker group is ready")
        return to_model_info(info, self.model)


async def keep_health_current(frontend: Frontend, servicer: health.aio.HealthServicer) -> None:
    """SERVING while the core admits requests and some worker group is up; NOT_SERVING while
    draining, and for good once cancelled (at shutdown), so a watcher hears it even when the
    drain is short. Wakes on every change of the frontend's view (no polling)."""
    last = None
    try:
        while True:
            changed = frontend.status_changed
            status = (health_pb2.HealthCheckResponse.SERVING if frontend.status.accepting and not frontend.draining
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
            if status != last:
                for name in ("", SERVICE_NAME):
                    await servicer.set(name, status)
                last = status
            await changed.wait()
    finally:
        await servicer.enter_graceful_shutdown()


def build_server(service: GenerationService, *, options: list | None = None,
                 interceptors: list | None = None) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    server = grpc.aio.server(options=options or [], interceptors=interceptors or [])
    generation_pb2_grpc.add_GenerationServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_server_reflection([SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name], server)
    return server, health_servicer
