"""python -m scheduler_svc --model DIR --workers ADDR[,ADDR...] --port PORT"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal

import grpc

from common.cli import ArgumentParser, add_logging_arguments, warn_if_exposed
from common.logging_setup import setup_logging
from common.model_dir import read_model_facts
from common.security import (AsyncTokenAuthInterceptor, add_server_security_arguments, channel_credentials,
                             read_secret, server_security_from_args)
from common.worker_discovery import resolve_worker_addresses
from scheduler_svc.decode_guard import DecodeGuardInterceptor
from scheduler_svc.engine import Engine, EngineConfig
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.server import build_server, keep_health_current
from scheduler_svc.tokenizer import load_tokenizer
from scheduler_svc.validation import Limits
from scheduler_svc.worker_client import GrpcWorkerClient, WorkerGroupClient

# The public API takes prompts of up to max_model_len tokens as ids (~5 bytes each) or text
# (Limits.max_prompt_bytes); anything far larger is refused by gRPC before it is buffered.
MAX_PUBLIC_MESSAGE_BYTES = 64 * 1024 * 1024

log = logging.getLogger("scheduler")


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
    p.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step (chunked prefill beyond it)")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (unset: the workers' limit)")
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   help="wait for each step's reply before scheduling the next (without it: one step ahead)")
    p.add_argument("--max-waiting", type=int, default=4096, help="waiting-queue bound; past it requests get RESOURCE_EXHAUSTED")
    p.add_argument("--step-timeout", type=float, default=300.0, help="seconds before a silent worker is declared down")
    p.add_argument("--shutdown-grace", type=float, default=30.0, help="seconds SIGTERM lets running requests finish")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics over HTTP on this port (0: off)")
    add_logging_arguments(p)
    add_server_security_arguments(p, "clients of the public API")
    sec = p.add_argument_group("worker security", "how this scheduler proves itself to its workers")
    sec.add_argument("--worker-auth-token", default=None, help="bearer token the workers require")
    sec.add_argument("--worker-auth-token-file", default=None, help="file holding --worker-auth-token")
    sec.add_argument("--worker-tls-ca", default=None, help="reach workers over TLS, trusting this CA")
    sec.add_argument("--worker-tls-cert", default=None, help="client certificate for workers that require mTLS")
    sec.add_argument("--worker-tls-key", default=None, help="private key of --worker-tls-cert")
    args = p.parse_args(argv)
    if bool(args.worker_tls_cert) != bool(args.worker_tls_key):
        p.error("--worker-tls-cert and --worker-tls-key go together")
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


async def serve(args: argparse.Namespace, token: str | None, credentials: grpc.ServerCredentials | None) -> None:
    facts = read_model_facts(args.model)
    metrics = SchedulerMetrics()
    engine = Engine(
        worker_groups(args),
        tokenizer=load_tokenizer(args.model),
        eos_token_ids=facts.eos_token_ids,
        vocab_size=facts.vocab_size,
        config=EngineConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            max_waiting=args.max_waiting,
            step_timeout_s=args.step_timeout,
            async_scheduling=args.async_scheduling,
        ),
        metrics=metrics,
    )
    interceptors = ([AsyncTokenAuthInterceptor(token)] if token else []) + [DecodeGuardInterceptor()]
    server, health_servicer = build_server(
        engine, model_name=args.served_model_name or facts.name, limits=Limits(),
        options=[("grpc.max_receive_message_length", MAX_PUBLIC_MESSAGE_BYTES),
                 ("grpc.max_send_message_length", MAX_PUBLIC_MESSAGE_BYTES)],
        interceptors=interceptors,
    )
    listen = f"{args.host}:{args.port}"
    if credentials:
        server.add_secure_port(listen, credentials)
    else:
        server.add_insecure_port(listen)
    await server.start()
    if args.metrics_port:
        metrics.watch(engine)
        metrics.serve(args.metrics_port, args.host)
    health_task = asyncio.create_task(keep_health_current(engine, health_servicer))
    log.info("listening on %s:%d, connecting to workers %s", args.host, args.port, args.workers)
    await engine.start()
    log.info("serving %s (max_model_len %d)", facts.name, engine.max_model_len)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: no new requests, %.0fs for running ones", args.shutdown_grace)
    await engine.shutdown(args.shutdown_grace)
    health_task.cancel()
    await server.stop(grace=1.0)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        token, credentials = server_security_from_args(args, log)
    except (ValueError, OSError) as e:   # reported like a usage error, before anything starts
        raise SystemExit(f"python -m scheduler_svc: error: {e}") from e
    warn_if_exposed(args.host, args.port, has_token=bool(token), has_tls=credentials is not None, log=log,
                    what="the scheduler's public API")
    asyncio.run(serve(args, token, credentials))


if __name__ == "__main__":
    main()
