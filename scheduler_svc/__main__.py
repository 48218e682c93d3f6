"""python -m scheduler_svc --model DIR --workers ADDR[,ADDR...] --port PORT

The scheduler service's processes: this one is the engine core (scheduling, block tables, the
worker connections); it starts --frontends frontend processes that serve the public API on the
same port (the kernel spreads client connections over them, SO_REUSEPORT) and reach the core over
a unix socket. With --frontends 0 the one frontend runs inside this process (the simplest layout,
for small machines and the demo).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import os
import socket
import tempfile

from common.cli import (ArgumentParser, add_client_security_arguments, add_config_arguments, add_logging_arguments,
                        check_client_security_arguments, config_from_args, warn_if_exposed)
from common.gc_freeze import freeze_startup_heap
from common.logging_setup import setup_logging
from common.model_dir import read_model_facts
from common.security import (add_server_security_arguments, channel_credentials, read_secret,
                             server_security_from_args)
from common.worker_discovery import resolve_worker_addresses
from scheduler_svc.config import ServiceConfig
from scheduler_svc.engine.config import ENGINE, EngineConfig
from scheduler_svc.engine.core import EngineCore
from scheduler_svc.engine.metrics import SchedulerMetrics
from scheduler_svc.engine.server import build_core_server
from scheduler_svc.engine.worker_client import GrpcWorkerClient, WorkerGroupClient
from scheduler_svc.frontend.config import FRONTENDS, FrontendConfig, frontend_config_from_args
from scheduler_svc.frontend.core_client import LocalCoreClient
from scheduler_svc.frontend.limit_flags import add_limit_arguments, check_limit_arguments
from scheduler_svc.frontend.process import Stop, drain_frontend, frontend_process_main, start_frontend

# Seconds a frontend that died waits before it is started again (a crash loop stays slow).
FRONTEND_RESTART_DELAY_S = 1.0

logger = logging.getLogger(__name__)


def default_num_frontends(cpu_count: int | None = None) -> int:
    """One frontend process per 4 cores, up to 8; none (in-process) on machines of 2 cores or fewer,
    where extra processes would only compete with the core and the workers."""
    cpus = cpu_count or os.cpu_count() or 1
    return 0 if cpus <= 2 else min(8, max(1, cpus // 4))


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m scheduler_svc", description="The scheduler service: public llm.v1.Generation API.")
    add_config_arguments(p, ServiceConfig)
    add_config_arguments(p, FrontendConfig, {FRONTENDS: "the processes that serve the public API"})
    add_config_arguments(p, EngineConfig, {ENGINE: "scheduling and the workers"})
    add_limit_arguments(p)
    add_logging_arguments(p)
    add_server_security_arguments(p, "clients of the public API")
    add_client_security_arguments(p, "worker-", "the workers", "worker security",
                                  "how this scheduler proves itself to its workers")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    check_client_security_arguments(p, args, "worker-")
    if args.frontends is None:
        args.frontends = default_num_frontends()
    if args.frontends < 0:
        p.error("--frontends must be 0 or more")
    if args.stream_interval < 1:
        p.error("--stream-interval must be at least 1")
    if args.stream_window < 0 or 0 < args.stream_window < 2 * args.stream_interval:
        p.error(f"--stream-window must be 0 or at least twice --stream-interval ({2 * args.stream_interval})")
    if not args.worker_lease_s > 0:
        p.error("--worker-lease must be positive")
    if not args.priority_aging_s >= 0:
        p.error("--priority-aging must not be negative")
    if args.max_request_failures < 1:
        p.error("--max-request-failures must be at least 1")
    check_limit_arguments(p, args)
    if args.instance_id is None:
        args.instance_id = f"{socket.gethostname()}:{args.port}"
    if not args.instance_id:
        p.error("--instance-id must not be empty")
    return args


def worker_groups(args: argparse.Namespace) -> list[WorkerGroupClient]:
    addresses = resolve_worker_addresses(args.workers)
    tp_size = args.tensor_parallel_size
    if len(addresses) % tp_size:
        raise SystemExit(f"--workers gives {len(addresses)} addresses, not a multiple of --tensor-parallel-size={tp_size}")
    credentials = (channel_credentials(args.worker_tls_ca, args.worker_tls_cert, args.worker_tls_key)
                   if args.worker_tls_ca else None)
    token = read_secret(args.worker_auth_token, args.worker_auth_token_file)
    make = lambda a: GrpcWorkerClient(a, credentials=credentials, auth_token=token,  # noqa: E731
                                      step_stream=args.step_stream)
    return [WorkerGroupClient([make(a) for a in addresses[i:i + tp_size]]) for i in range(0, len(addresses), tp_size)]


# -- the engine core ---------------------------------------------------------------------------------

class FrontendProcesses:
    """The frontend processes of this core: started, restarted when one dies, stopped."""

    def __init__(self, args: argparse.Namespace, core_address: str) -> None:
        self.args = args
        self.core_address = core_address
        self._context = multiprocessing.get_context("spawn")
        self.procs: dict[int, multiprocessing.Process] = {}
        self._stopping = False

    def start(self, frontend_id: int) -> None:
        proc = self._context.Process(target=frontend_process_main, args=(self.args, frontend_id, self.core_address),
                                     name=f"frontend-{frontend_id}", daemon=True)
        proc.start()
        self.procs[frontend_id] = proc

    async def supervise(self) -> None:
        while not self._stopping:
            for frontend_id, proc in list(self.procs.items()):
                if not proc.is_alive() and not self._stopping:
                    logger.error("frontend %d exited with %s; starting it again", frontend_id, proc.exitcode)
                    await asyncio.sleep(FRONTEND_RESTART_DELAY_S)
                    if not self._stopping:
                        self.start(frontend_id)
            await asyncio.sleep(0.5)

    async def stop(self, timeout_s: float) -> None:
        self._stopping = True
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()          # SIGTERM: each drains (its requests are ended by now)
        deadline = asyncio.get_running_loop().time() + timeout_s
        for proc in self.procs.values():
            while proc.is_alive() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            if proc.is_alive():
                proc.kill()


async def serve(args: argparse.Namespace, security) -> None:
    service, frontend = config_from_args(ServiceConfig, args), frontend_config_from_args(args)
    facts = read_model_facts(service.model)
    metrics = SchedulerMetrics()
    core = EngineCore(worker_groups(args), eos_token_ids=facts.eos_token_ids, metrics=metrics,
                      config=config_from_args(EngineConfig, args))
    stop = Stop()
    stop.install()
    if service.metrics_port:
        metrics.watch(core.info)
        metrics.serve(service.metrics_port, frontend.host)
    local = None
    frontends = None
    with tempfile.TemporaryDirectory(prefix="qwen3-core-") as private_dir:
        if service.frontends == 0:
            local = await start_frontend(frontend, service.model, LocalCoreClient(core), security)
        else:
            core_address = service.core_address or f"unix:{os.path.join(private_dir, 'core.sock')}"
            core_server = build_core_server(core, metrics, core_address)
            await core_server.start()
            frontends = FrontendProcesses(args, core_address)
            for frontend_id in range(service.frontends):
                frontends.start(frontend_id)
            supervisor = asyncio.create_task(frontends.supervise())
        logger.info("listening on %s:%d (%s), connecting to workers %s", frontend.host, frontend.port,
                    f"{service.frontends} frontend processes" if service.frontends else "frontend in process",
                    service.workers)
        await core.start()
        freeze_startup_heap()
        await stop.event.wait()
        logger.info("shutting down: no new requests, %.0fs for running ones", service.shutdown_grace)
        await core.shutdown(service.shutdown_grace)
        if local is not None:
            await drain_frontend(*local, grace_s=0.0)
        else:
            supervisor.cancel()
            await frontends.stop(timeout_s=10.0)
            await core_server.stop(grace=1.0)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        security = server_security_from_args(args, logger)
    except (ValueError, OSError) as e:   # reported like a usage error, before anything starts
        raise SystemExit(f"python -m scheduler_svc: error: {e}") from e
    token, credentials = security
    warn_if_exposed(args.host, args.port, has_token=bool(token), has_tls=credentials is not None, log=logger,
                    what="the scheduler's public API")
    asyncio.run(serve(args, security))


if __name__ == "__main__":
    main()
