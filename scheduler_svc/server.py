"""The public gRPC API (llm.v1.Generation) over the engine, plus health and reflection."""
from __future__ import annotations

import asyncio
import logging
import uuid

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.logging_setup import bind_request_id
from common.pb.llm.v1 import generation_pb2, generation_pb2_grpc
from common.reflection import enable_server_reflection
from scheduler_svc.engine import DuplicateRequest, Engine, EngineFull, EngineUnavailable
from scheduler_svc.validation import InvalidRequest, validate_request

log = logging.getLogger("scheduler.server")

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, engine: Engine, *, model_name: str, limits) -> None:
        self.engine = engine
        self.model_name = model_name
        self.limits = limits

    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            prompt_ids, params = await asyncio.to_thread(
                validate_request, request,
                vocab_size=self.engine.vocab_size,
                max_model_len=self.engine.max_model_len,
                tokenize=self.engine.tokenizer.encode,
                limits=self.limits,
            )
        except InvalidRequest as e:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        request_id = request.request_id or uuid.uuid4().hex
        bind_request_id(request_id)   # this handler's task ends with the request
        try:
            stream = self.engine.add_request(request_id, prompt_ids, params)
        except EngineFull as e:
            await self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except DuplicateRequest as e:
            await self._refuse(context, grpc.StatusCode.ALREADY_EXISTS, str(e))
        except EngineUnavailable as e:
            await self._refuse(context, grpc.StatusCode.UNAVAILABLE, str(e))
        log.info("admitted: %d prompt tokens, max_tokens %d", len(prompt_ids), params.max_tokens)
        async for out in stream:
            yield generation_pb2.GenerateResponse(
                request_id=request_id, token_ids=out.token_ids, text=out.text,
                logprobs=out.logprobs, finish_reason=out.finish_reason, usage=out.usage,
            )

    async def _refuse(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        self.engine.metrics.observe_rejection(code.name)
        await context.abort(code, message)

    async def Abort(self, request: generation_pb2.AbortRequest, context) -> generation_pb2.AbortResponse:
        return generation_pb2.AbortResponse(found=self.engine.abort(request.request_id))

    async def GetModelInfo(self, request, context) -> generation_pb2.ModelInfo:
        groups = [
            generation_pb2.WorkerGroupInfo(
                addresses=g.client.addresses,
                healthy=g.healthy,
                num_kv_blocks=g.info.num_kv_blocks if g.info else 0,
                num_free_kv_blocks=g.scheduler.block_manager.num_free_blocks if g.scheduler else 0,
                num_running=g.scheduler.num_running if g.scheduler else 0,
                device=g.info.device if g.info else "",
                attention_backend=g.info.attention_backend if g.info else "",
                num_preemptions=g.scheduler.num_preemptions if g.scheduler else 0,
                prefix_cache_queried_tokens=g.scheduler.block_manager.prefix_cache_queried_tokens if g.scheduler else 0,
                prefix_cache_hit_tokens=g.scheduler.block_manager.prefix_cache_hit_tokens if g.scheduler else 0,
                tensor_parallel_size=len(g.client.ranks),
            )
            for g in self.engine.groups
        ]
        first = self.engine.groups[0].info
        return generation_pb2.ModelInfo(
            model=self.model_name,
            max_model_len=self.engine.max_model_len,
            vocab_size=self.engine.vocab_size,
            eos_token_ids=self.engine.eos_token_ids,
            block_size=first.block_size,
            num_kv_blocks=sum(g.num_kv_blocks for g in groups),
            worker_groups=groups,
        )


async def keep_health_current(engine: Engine, servicer: health.aio.HealthServicer, interval_s: float = 0.25) -> None:
    """SERVING while the engine admits requests and some worker group is up."""
    last = None
    while True:
        status = (health_pb2.HealthCheckResponse.SERVING if engine.accepting
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        if status != last:
            for name in ("", SERVICE_NAME):
                await servicer.set(name, status)
            last = status
        await asyncio.sleep(interval_s)


def build_server(engine: Engine, *, model_name: str, limits, options: list | None = None,
                 interceptors: list | None = None) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    server = grpc.aio.server(options=options or [], interceptors=interceptors or [])
    generation_pb2_grpc.add_GenerationServicer_to_server(
        GenerationService(engine, model_name=model_name, limits=limits), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_server_reflection([SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name], server)
    return server, health_servicer
