"""The engine core's side of llm.engine.v1: frontends in other processes reach the core here,
over a unix socket (or loopback TCP) that only the service's own processes use."""
from __future__ import annotations

import logging

import grpc

from common.pb.llm.engine.v1 import engine_pb2, engine_pb2_grpc
from common.status_guard import AsyncStatusGuardInterceptor
from scheduler_svc.engine import api_wire as core_wire
from scheduler_svc.engine.core import EngineCore
from scheduler_svc.engine.metrics import SchedulerMetrics

logger = logging.getLogger(__name__)

# An AddRequests batch carries whole prompts.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024


class EngineCoreService(engine_pb2_grpc.EngineCoreServicer):
    def __init__(self, core: EngineCore, metrics: SchedulerMetrics) -> None:
        self.core = core
        self.metrics = metrics

    async def Attach(self, request, context):
        frontend_id = request.frontend_id
        queue = self.core.attach(frontend_id)
        logger.info("frontend %d attached", frontend_id)
        try:
            while True:
                yield core_wire.event_to_pb(await queue.get())
        finally:
            # The stream ended: the frontend went away (or the core is stopping).
            if self.core.detach(frontend_id, queue):
                logger.info("frontend %d detached", frontend_id)

    async def AddRequests(self, request, context):
        return core_wire.add_results_to_pb(self.core.add_requests(core_wire.add_requests_from_pb(request)))

    async def AbortRequests(self, request, context):
        if request.seq_ids:
            self.core.abort(list(request.seq_ids), core_wire.reason_from_pb(request.reason), request.notify)
        found = self.core.abort_request_id(request.request_id) if request.request_id else False
        return engine_pb2.AbortRequestsResponse(found=found)

    async def PauseRequests(self, request, context):
        self.core.set_paused(list(request.pause_seq_ids), list(request.resume_seq_ids))
        return engine_pb2.PauseRequestsResponse()

    async def GetInfo(self, request, context):
        return core_wire.info_to_pb(self.core.info())

    async def Report(self, request, context):
        for code, count in request.rejected.items():
            self.metrics.observe_rejection(code, count)
        return engine_pb2.ReportResponse()


def build_core_server(core: EngineCore, metrics: SchedulerMetrics, address: str) -> grpc.aio.Server:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.so_reuseport", 0)], interceptors=[AsyncStatusGuardInterceptor()])
    engine_pb2_grpc.add_EngineCoreServicer_to_server(EngineCoreService(core, metrics), server)
    if server.add_insecure_port(address) == 0:
        raise OSError(f"the engine core cannot listen on {address}")
    return server

