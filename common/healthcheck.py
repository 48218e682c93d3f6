"""Exits 0 when a gRPC server reports SERVING on grpc.health.v1, 1 otherwise.

The container healthcheck of both services (the images carry no grpc_health_probe binary):

    python -m common.healthcheck 127.0.0.1:50061 [--service NAME] [--timeout SECONDS] [--wait SECONDS]
                                 [--tls-ca CA.pem [--tls-server-name NAME]]

With --wait it keeps asking until the answer is SERVING or the time is up, for scripts that
start a server and wait for it. It imports only grpc and the health stubs, so a check costs a
fraction of a second.
"""
from __future__ import annotations

import pathlib
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.cli import ArgumentParser

def check_health(address: str, service: str = "", timeout_s: float = 3.0, *, tls_ca: str | None = None,
                 tls_server_name: str | None = None) -> str:
    """Returns the serving status name the server reports for `service` ("" is the whole
    server), or a short description of why no status came back. With tls_ca the check goes over
    TLS, trusting that CA; tls_server_name is the name the certificate must carry, when it is
    not the address's host (a probe inside the pod asks 127.0.0.1)."""
    if tls_ca:
        options = [("grpc.ssl_target_name_override", tls_server_name)] if tls_server_name else []
        credentials = grpc.ssl_channel_credentials(root_certificates=pathlib.Path(tls_ca).read_bytes())
        channel = grpc.secure_channel(address, credentials, options=options)
    else:
        channel = grpc.insecure_channel(address)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as err:
            return f"{err.code().name}: {err.details()}" if err.details() else err.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m common.healthcheck", description=__doc__,
                            env_prefix="QWEN3_SERVE_HEALTHCHECK_")
    parser.add_argument("address", help="host:port of the server")
    parser.add_argument("--service", default="", help="service name to ask about (empty: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for each answer")
    parser.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                        help="ask again until SERVING, for up to this long (0: ask once)")
    parser.add_argument("--tls-ca", metavar="PATH", help="check over TLS, trusting this PEM CA")
    parser.add_argument("--tls-server-name", metavar="NAME",
                        help="name the server's certificate must carry (unset: the address's host)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.wait
    while (status := check_health(args.address, args.service, args.timeout, tls_ca=args.tls_ca,
                                  tls_server_name=args.tls_server_name)) != "SERVING":
        if time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
