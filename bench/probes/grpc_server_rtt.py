"""Probe: one unary gRPC call's round trip over loopback against a synchronous server (a thread pool,
as the worker serves) and a grpc.aio server, each in its own process, from a synchronous and an aio
client (the scheduler's). The handler does nothing, so the times are gRPC's own: whether moving the
worker to grpc.aio would shorten the batch-1 host path (PERF_NOTES v32). Medians over --calls calls,
servers in turn, --rounds times.

    python -m bench.probes.grpc_server_rtt [--calls 3000] [--rounds 2]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REQUEST = health_pb2.HealthCheckRequest(service="probe")
WARM_UP = 300


class _Sync(health_pb2_grpc.HealthServicer):
    def Check(self, request, context):
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


class _Aio(health_pb2_grpc.HealthServicer):
    async def Check(self, request, context):
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def serve(kind: str, port: int) -> None:
    if kind == "sync":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        health_pb2_grpc.add_HealthServicer_to_server(_Sync(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        server.wait_for_termination()
        return

    async def main() -> None:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(_Aio(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def sync_client(port: int, calls: int) -> float:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        grpc.channel_ready_future(channel).result(timeout=30)
        for _ in range(WARM_UP):
            stub.Check(REQUEST)
        times = []
        for _ in range(calls):
            started = time.perf_counter()
            stub.Check(REQUEST)
            times.append(time.perf_counter() - started)
    return statistics.median(times)


async def aio_client(port: int, calls: int) -> float:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        await channel.channel_ready()
        for _ in range(WARM_UP):
            await stub.Check(REQUEST)
        times = []
        for _ in range(calls):
            started = time.perf_counter()
            await stub.Check(REQUEST)
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--serve", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return
    from tools.launch import free_port

    results: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for kind in ("sync", "aio"):
            port = free_port()
            server = subprocess.Popen([sys.executable, "-m", "bench.probes.grpc_server_rtt", "--serve", kind, str(port)])
            try:
                results.setdefault((kind, "sync"), []).append(sync_client(port, args.calls))
                results.setdefault((kind, "aio"), []).append(asyncio.run(aio_client(port, args.calls)))
            finally:
                server.kill()
                server.wait()
    print(f"{'server':8s} {'client':8s} {'round trip us (median of each round)':>40s}")
    for (server_kind, client_kind), times in results.items():
        print(f"{server_kind:8s} {client_kind:8s} {'  '.join(f'{t * 1e6:6.0f}' for t in times):>40s}")


if __name__ == "__main__":
    main()
