"""Running a frontend: its public server started beside a core client, its draining, and the
main function of a frontend process (spawned by the engine core's process, scheduler_svc.__main__).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal

import grpc

from common.gc_freeze import freeze_startup_heap
from common.logging_setup import setup_logging
from common.model_dir import read_model_facts
from common.security import AsyncTokenAuthInterceptor, server_security_from_args
from common.status_guard import AsyncStatusGuardInterceptor
from scheduler_svc.frontend.chat import warm_up_chat
from scheduler_svc.frontend.config import FrontendConfig, frontend_config_from_args
from scheduler_svc.frontend.core_client import CoreClient, GrpcCoreClient
from scheduler_svc.frontend.decode_guard import DecodeGuardInterceptor
from scheduler_svc.frontend.streams import Frontend
from scheduler_svc.frontend.server import SERVICE_NAME, GenerationService, build_server, keep_health_current
from scheduler_svc.frontend.tokenizer import load_tokenizer

# The public API takes prompts of up to max_model_len tokens as ids (~5 bytes each) or text
# (Limits.max_prompt_bytes), and each method refuses a request longer than the limits allow
# before decoding it (GenerationService.max_request_bytes); anything far larger than the longest
# of them is refused by gRPC from its length alone, before it is even received (RESOURCE_EXHAUSTED).
MIN_PUBLIC_MESSAGE_BYTES = 8 * 1024 * 1024
# How long a frontend waits for the engine core's first status before it listens regardless.
ATTACH_WAIT_S = 30.0

logger = logging.getLogger(__name__)


class Stop:
    """Signals turned into one event; the second SIGINT (Ctrl-C twice) ends the process at once."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self._interrupts = 0

    def install(self, *, interrupt: bool = True) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.event.set)
        if interrupt:
            loop.add_signal_handler(signal.SIGINT, self._interrupt)

    def _interrupt(self) -> None:
        self._interrupts += 1
        if self._interrupts > 1:
            logger.warning("second interrupt: stopping now")
            os._exit(130)
        logger.info("interrupt: draining (press Ctrl-C again to stop at once)")
        self.event.set()


async def start_frontend(config: FrontendConfig, model: str, core: CoreClient,
                         security) -> tuple[Frontend, grpc.aio.Server, list]:
    """The frontend of `model` and its public server, started; returns them and its background tasks."""
    token, credentials = security
    facts = read_model_facts(model)
    tokenizer = load_tokenizer(model)
    warm_up_chat(tokenizer)
    frontend = Frontend(core, tokenizer, stream_interval=config.stream_interval,
                        stream_window=config.stream_window, eos_token_ids=facts.eos_token_ids)
    service = GenerationService(frontend, model=dataclasses.replace(facts, name=config.served_model_name or facts.name),
                                limits=config.limits, allow_chat_special_tokens=config.allow_chat_special_tokens)
    max_message = max(MIN_PUBLIC_MESSAGE_BYTES, *(service.max_request_bytes(f"/{SERVICE_NAME}/{method}") or 0
                                                  for method in ("Generate", "Chat", "Tokenize", "Detokenize")))
    interceptors = (([AsyncTokenAuthInterceptor(token)] if token else []) +
                    [DecodeGuardInterceptor(service.max_request_bytes, service.request_type),
                     AsyncStatusGuardInterceptor()])
    server, health_servicer = build_server(
        service, interceptors=interceptors,
        # Every frontend process binds the same public port; the kernel spreads connections.
        options=[("grpc.max_receive_message_length", max_message),
                 ("grpc.max_send_message_length", max_message), ("grpc.so_reuseport", 1)])
    listen = f"{config.host}:{config.port}"
    bound = server.add_secure_port(listen, credentials) if credentials else server.add_insecure_port(listen)
    if bound == 0:
        raise SystemExit(f"cannot listen on {listen}")
    tasks = [asyncio.create_task(frontend.run(), name="frontend-events"),
             asyncio.create_task(keep_health_current(frontend, health_servicer), name="health")]
    await wait_attached(frontend, tasks[0])
    await server.start()
    return frontend, server, tasks


async def wait_attached(frontend: Frontend, events: asyncio.Task, timeout_s: float = ATTACH_WAIT_S) -> bool:
    """Waits for the engine core's first status (or the event stream's end, or timeout_s), so the
    frontend listens knowing what the core knows: the kernel hands a connection on the shared port
    to any frontend listening, and one that listened before its first status would refuse the
    request as UNAVAILABLE ("not connected to the engine core yet") while the others serve."""
    waiter = asyncio.create_task(frontend.attached.wait())
    try:
        await asyncio.wait([waiter, events], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if not frontend.attached.is_set():
        logger.warning("no status from the engine core after %.0f s: listening regardless", timeout_s)
    return frontend.attached.is_set()


async def drain_frontend(frontend: Frontend, server: grpc.aio.Server, tasks: list, grace_s: float) -> None:
    """No new requests; the ones in flight get grace_s to finish (the core ends them by then)."""
    frontend.start_draining()
    deadline = asyncio.get_running_loop().time() + grace_s + 5.0
    while frontend.num_active and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    await server.stop(grace=1.0)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def serve_frontend_process(args: argparse.Namespace, frontend_id: int, core_address: str) -> None:
    security = server_security_from_args(args, logger)
    core = GrpcCoreClient(core_address, frontend_id)
    frontend, server, tasks = await start_frontend(frontend_config_from_args(args), args.model, core,
                                                   security)
    logger.info("frontend %d serving on %s:%d", frontend_id, args.host, args.port)
    freeze_startup_heap()
    stop = Stop()
    stop.install(interrupt=False)     # Ctrl-C reaches the whole group: the core decides what happens
    events = tasks[0]
    waiter = asyncio.create_task(stop.event.wait())
    await asyncio.wait([events, waiter], return_when=asyncio.FIRST_COMPLETED)
    if events.done():
        logger.error("frontend %d lost the engine core (%s); exiting", frontend_id, events.exception())
    await drain_frontend(frontend, server, tasks, args.shutdown_grace)
    await core.close()


def frontend_process_main(args: argparse.Namespace, frontend_id: int, core_address: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_logging(args.log_level, args.log_format)
    asyncio.run(serve_frontend_process(args, frontend_id, core_address))
