"""python -m scheduler_svc --model DIR --workers ADDR[,ADDR...] --port PORT"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from common.logging_setup import setup_logging
from common.model_dir import read_model_facts
from scheduler_svc.engine import Engine, EngineConfig
from scheduler_svc.server import build_server, keep_health_current
from scheduler_svc.tokenizer import load_tokenizer
from scheduler_svc.validation import Limits
from scheduler_svc.worker_client import MAX_MESSAGE_BYTES, GrpcWorkerClient, WorkerGroupClient

log = logging.getLogger("scheduler")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scheduler_svc", description="The scheduler service: public llm.v1.Generation API.")
    p.add_argument("--model", required=True, help="Hugging Face model directory (tokenizer and config are read from it)")
    p.add_argument("--served-model-name", default=None, help="name reported in ModelInfo (default: the directory's name)")
    p.add_argument("--workers", required=True,
                   help="worker addresses, comma-separated (host:port or unix:PATH); with --tensor-parallel-size N, "
                        "each N consecutive addresses form one group, rank 0 first; several groups serve in data parallel")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step (chunked prefill beyond it)")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the workers' limit)")
    p.add_argument("--max-waiting", type=int, default=4096, help="waiting-queue bound; past it requests get RESOURCE_EXHAUSTED")
    p.add_argument("--step-timeout", type=float, default=300.0, help="seconds before a silent worker is declared down")
    p.add_argument("--shutdown-grace", type=float, default=30.0, help="seconds SIGTERM lets running requests finish")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def worker_groups(spec: str, tp_size: int) -> list[WorkerGroupClient]:
    addresses = [a.strip() for a in spec.split(",") if a.strip()]
    if not addresses or len(addresses) % tp_size:
        raise SystemExit(f"--workers lists {len(addresses)} addresses, not a multiple of --tensor-parallel-size={tp_size}")
    return [WorkerGroupClient([GrpcWorkerClient(a) for a in addresses[i:i + tp_size]])
            for i in range(0, len(addresses), tp_size)]


async def serve(args: argparse.Namespace) -> None:
    facts = read_model_facts(args.model)
    engine = Engine(
        worker_groups(args.workers, args.tensor_parallel_size),
        tokenizer=load_tokenizer(args.model),
        eos_token_ids=facts.eos_token_ids,
        vocab_size=facts.vocab_size,
        config=EngineConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            max_waiting=args.max_waiting,
            step_timeout_s=args.step_timeout,
        ),
    )
    server, health_servicer = build_server(
        engine, model_name=args.served_model_name or facts.name, limits=Limits(),
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)],
    )
    server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()
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
    setup_logging(args.log_level)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
