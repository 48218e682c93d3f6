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

from common.cli import (ArgumentParser, add_client_security_arguments, add_logging_arguments,
                        check_client_security_arguments, warn_if_exposed)
from common.logging_setup import setup_logging
from common.model_dir import read_model_facts
from common.security import (add_server_security_arguments, channel_credentials, read_secret,
                             server_security_from_args)
from common.worker_discovery import resolve_worker_addresses
from scheduler_svc.engine.core import EngineConfig, EngineCore
from scheduler_svc.frontend.core_client import LocalCoreClient
from scheduler_svc.engine.server import build_core_server
from scheduler_svc.frontend.process import Stop, drain_frontend, frontend_process_main, start_frontend
from scheduler_svc.engine.metrics import SchedulerMetrics
from scheduler_svc.engine.worker_client import GrpcWorkerClient, WorkerGroupClient
from scheduler_svc.frontend.limit_flags import add_limit_arguments, check_limit_arguments

# Seconds a frontend that died waits before it is started again (a crash loop stays slow).
FRONTEND_RESTART_DELAY_S = 1.0

log = logging.getLogger("scheduler")


def default_num_frontends(cpu_count: int | None = None) -> int:
    """One frontend process per 4 cores, up to 8; none (in-process) on machines of 2 cores or fewer,
    where extra processes would only compete with the core and the workers."""
    cpus = cpu_count or os.cpu_count() or 1
    return 0 if cpus <= 2 else min(8, max(1, cpus // 4))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m scheduler_svc", description="The scheduler service: public llm.v1.Generation API.")
    p.add_argument("--model", required=True, help="Hugging Face model directory (tokenizer and config are read from it)")
    p.add_argument("--served-model-name", default=None, help="name reported in ModelInfo (unset: the model directory's name)")
    p.add_argument("--workers", required=True,
                   help="worker addresses, comma-separated (host:port, unix:PATH, or dns:///NAME:PORT for every "
                        "address NAME resolves to); with --tensor-parallel-size N, each N consecutive addresses form "
                        "one group, rank 0 first; several groups serve in data parallel")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks per worker group")
    p.add_argument("--host", default="127.0.0.1", help="address of the public API (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=50051, help="port of the public API")
    p.add_argument("--frontends", type=int, default=None,
                   help="frontend processes serving the public port (0: one, inside the core's process; unset: "
                        f"one per 4 cores, up to 8, so {default_num_frontends()} here)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per streamed message (the first comes at once; the last carries the rest): "
                        "larger values trade inter-token latency for CPU")
    p.add_argument("--stream-window", type=int, default=256,
                   help="tokens a request may be generated ahead of what its client has read (tokens the client's "
                        "HTTP/2 stream window holds count as read); past it the request leaves the batch until the "
                        "client reads again (0: no bound; else at least twice --stream-interval)")
    p.add_argument("--core-address", default=None,
                   help="where the engine core listens for its frontends (unset: a unix socket in a private "
                        "temporary directory)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step (chunked prefill beyond it)")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (unset: the workers' limit)")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   help="wait for each step's reply before scheduling the next (without it: one step ahead)")
    p.add_argument("--max-waiting", type=int, default=4096, help="waiting-queue bound; past it requests get RESOURCE_EXHAUSTED")
    p.add_argument("--step-timeout", type=float, default=300.0, help="seconds before a silent worker is declared down")
    p.add_argument("--instance-id", default=None,
                   help="this scheduler's identity, under which it leases its workers (unset: HOSTNAME:PORT, stable "
                        "across restarts, so a restarted scheduler re-claims its workers at once)")
    p.add_argument("--worker-lease", type=float, default=EngineConfig.worker_lease_s,
                   help="seconds a worker stays leased to this scheduler without a step or renewal; another "
                        "scheduler can take it over only after that")
    p.add_argument("--priority-aging", type=float, default=EngineConfig.priority_aging_s, metavar="SECONDS",
                   help="seconds of waiting one priority level is worth: a waiting request is admitted before any "
                        "that arrives more than (its priority - theirs) x this later, so with priorities in "
                        "-N..N (--max-priority) none waits behind later arrivals for more than 2N x this "
                        "(0: strict priority)")
    p.add_argument("--max-request-failures", type=int, default=EngineConfig.max_request_failures,
                   help="a request in this many failed steps (the worker reset each time) is failed alone, "
                        "with INTERNAL naming the worker's error, instead of being re-sent again")
    p.add_argument("--shutdown-grace", type=float, default=30.0, help="seconds SIGTERM lets running requests finish")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics over HTTP on this port (0: off)")
    add_limit_arguments(p)
    p.add_argument("--allow-chat-special-tokens", action="store_true",
                   help="let the text of chat messages write special tokens (<|im_start|>, ...) as control tokens, "
                        "for trusted clients that write template structure on purpose; without it they are "
                        "tokenized as plain text")
    add_logging_arguments(p)
    add_server_security_arguments(p, "clients of the public API")
    add_client_security_arguments(p, "worker-", "the workers", "worker security",
                                  "how this scheduler proves itself to its workers")
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
    if not args.worker_lease > 0:
        p.error("--worker-lease must be positive")
    if not args.priority_aging >= 0:
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
    make = lambda a: GrpcWorkerClient(a, credentials=credentials, auth_token=token)  # noqa: E731
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
                    log.error("frontend %d exited with %s; starting it again", frontend_id, proc.exitcode)
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
    facts = read_model_facts(args.model)
    metrics = SchedulerMetrics()
    core = EngineCore(
        worker_groups(args), eos_token_ids=facts.eos_token_ids, metrics=metrics,
        config=EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                            max_model_len=args.max_model_len, max_waiting=args.max_waiting,
                            step_timeout_s=args.step_timeout, async_scheduling=args.async_scheduling,
                            instance_id=args.instance_id, worker_lease_s=args.worker_lease,
                            priority_aging_s=args.priority_aging, max_request_failures=args.max_request_failures))
    stop = Stop()
    stop.install()
    if args.metrics_port:
        metrics.watch(core.info)
        metrics.serve(args.metrics_port, args.host)
    local = None
    frontends = None
    with tempfile.TemporaryDirectory(prefix="qwen3-core-") as private_dir:
        if args.frontends == 0:
            local = await start_frontend(args, LocalCoreClient(core), security)
        else:
            core_address = args.core_address or f"unix:{os.path.join(private_dir, 'core.sock')}"
            core_server = build_core_server(core, metrics, core_address)
            await core_server.start()
            frontends = FrontendProcesses(args, core_address)
            for frontend_id in range(args.frontends):
                frontends.start(frontend_id)
            supervisor = asyncio.create_task(frontends.supervise())
        log.info("listening on %s:%d (%s), connecting to workers %s", args.host, args.port,
                 f"{args.frontends} frontend processes" if args.frontends else "frontend in process", args.workers)
        await core.start()
        await stop.event.wait()
        log.info("shutting down: no new requests, %.0fs for running ones", args.shutdown_grace)
        await core.shutdown(args.shutdown_grace)
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
        security = server_security_from_args(args, log)
    except (ValueError, OSError) as e:   # reported like a usage error, before anything starts
        raise SystemExit(f"python -m scheduler_svc: error: {e}") from e
    token, credentials = security
    warn_if_exposed(args.host, args.port, has_token=bool(token), has_tls=credentials is not None, log=log,
                    what="the scheduler's public API")
    asyncio.run(serve(args, security))


if __name__ == "__main__":
    main()
