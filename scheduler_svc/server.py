"""The public gRPC API (llm.v1.Generation) of one frontend, plus health and reflection: where
requests are validated and frontend outputs become GenerateResponses (the only place the public
proto types appear)."""
from __future__ import annotations

import functools
import logging
import uuid

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.logging_setup import bind_request_id
from common.pb.llm.v1 import generation_pb2, generation_pb2_grpc
from common.reflection import enable_server_reflection
from scheduler_svc.admission_pool import AdmissionPool, admits_inline
from scheduler_svc.core_client import CoreUnreachable
from scheduler_svc.core_types import AddCode, CoreInfo
from scheduler_svc.frontend import Frontend, Refused
from scheduler_svc.output_stream import RequestOutput
from scheduler_svc.sequence import FinishReason
from scheduler_svc.validation import InvalidRequest, Limits, validate_request

log = logging.getLogger("scheduler.server")

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name

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


def to_response(request_id: str, out: RequestOutput) -> generation_pb2.GenerateResponse:
    msg = generation_pb2.GenerateResponse(request_id=request_id, token_ids=out.token_ids, text=out.text,
                                          logprobs=out.logprobs)
    if out.finish_reason is not None:
        msg.finish_reason = _FINISH_TO_PROTO[out.finish_reason]
        u = out.usage
        msg.usage.CopyFrom(generation_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                                cached_prompt_tokens=u.cached_prompt_tokens))
    return msg


def to_model_info(info: CoreInfo, *, model_name: str, vocab_size: int, eos_token_ids: list[int]) -> generation_pb2.ModelInfo:
    groups = [
        generation_pb2.WorkerGroupInfo(
            addresses=g.addresses, healthy=g.healthy, num_kv_blocks=g.num_kv_blocks,
            num_free_kv_blocks=g.num_free_kv_blocks, num_running=g.num_running, device=g.device,
            attention_backend=g.attention_backend, num_preemptions=g.num_preemptions,
            prefix_cache_queried_tokens=g.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=g.prefix_cache_hit_tokens, tensor_parallel_size=len(g.addresses))
        for g in info.groups
    ]
    up = [g for g in info.groups if g.block_size]
    return generation_pb2.ModelInfo(
        model=model_name, max_model_len=info.status.max_model_len, vocab_size=vocab_size,
        eos_token_ids=eos_token_ids, block_size=up[0].block_size if up else 0,
        num_kv_blocks=sum(g.num_kv_blocks for g in info.groups), worker_groups=groups)


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, frontend: Frontend, *, model_name: str, vocab_size: int, eos_token_ids: list[int],
                 limits: Limits) -> None:
        self.frontend = frontend
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.limits = limits
        self.admission = AdmissionPool()

    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        status = self.frontend.status
        if not status.max_model_len:     # no worker group has ever been up: nothing to validate against
            await self._refuse(context, grpc.StatusCode.UNAVAILABLE, status.reason or "no worker group is ready")
        tokenizer = self.frontend.tokenizer
        # Off the event loop unless it is small (admission_pool says why); a text of more tokens
        # than the context holds is refused by its count, its ids never listed.
        admit = functools.partial(
            validate_request, request, vocab_size=self.vocab_size, max_model_len=status.max_model_len,
            tokenize=functools.partial(tokenizer.encode, max_tokens=status.max_model_len - 1), limits=self.limits,
            max_input_bytes_per_token=tokenizer.max_input_bytes_per_token)
        try:
            prompt_ids, params = await self.admission.run(admits_inline(request), admit)
        except InvalidRequest as e:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        request_id = request.request_id or uuid.uuid4().hex
        bind_request_id(request_id)   # this handler's task ends with the request
        # Which frontend process serves the stream (several share the port): for operators and tests.
        await context.send_initial_metadata((("frontend-id", str(self.frontend.core.frontend_id)),))
        try:
            stream = await self.frontend.submit(request_id, prompt_ids, params)
        except Refused as e:
            await self._refuse(context, _REFUSAL_CODES[e.code], str(e))
        log.info("admitted: %d prompt tokens, max_tokens %d", len(prompt_ids), params.max_tokens)
        async for out in stream:
            yield to_response(request_id, out)

    async def _refuse(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        self.frontend.count_rejection(code.name)
        await context.abort(code, message)

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
        return to_model_info(info, model_name=self.model_name, vocab_size=self.vocab_size,
                             eos_token_ids=self.eos_token_ids)


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
