"""Serves the OpenAI-compatible gateway (uvicorn) in front of a running scheduler.

    qwen3-serve gateway --target 127.0.0.1:50051 --port 8000
    curl localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
        -d '{"model": "tiny-qwen3", "messages": [{"role": "user", "content": "Hi"}]}'

Every flag also reads a QWEN3_SERVE_GATEWAY_* variable (`--help` names them). The process holds
no model: it needs only the scheduler's address (and its token / CA when the scheduler asks for
them). It exits on SIGTERM or SIGINT after the requests in flight finish (up to
--graceful-shutdown-s, then their streams are cut, which cancels them on the scheduler).
"""
from __future__ import annotations

import gc
import logging
import pathlib
import sys
from dataclasses import dataclass

from common.cli import (ArgumentParser, add_client_security_arguments, add_config_arguments, add_logging_arguments,
                        check_client_security_arguments, config_from_args, flag, is_loopback, warn_if_exposed)
from common.gc_freeze import freeze_startup_heap
from common.logging_setup import setup_logging
from gateway.config import GatewayConfig

logger = logging.getLogger(__name__)


CLIENTS = "clients"


@dataclass(frozen=True)
class GatewayFlags:
    """The gateway's command line; main() turns it into the app's GatewayConfig, whose defaults
    the shared flags take."""
    host: str = flag("127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    port: int = flag(8000, help="port to listen on")
    target: str | None = flag(None, help="the scheduler's llm.v1 address (unset: $QWEN3_SERVE_TARGET, else "
                                         "127.0.0.1:50051)")
    request_timeout_s: float = flag(GatewayConfig.request_timeout,
                                    help="deadline of each request on the scheduler, streams included (0: none)")
    graceful_shutdown_s: float = flag(30.0, help="on SIGTERM, how long requests in flight may take to finish")
    max_request_body_mib: float = flag(GatewayConfig.max_request_bytes / (1 << 20),
                                       help="refuse a request body larger than this with 413 (0: no bound)")
    max_request_json_values: int = flag(GatewayConfig.max_request_values,
                                        help="refuse with 413 a request body of more JSON values than this, counted "
                                             "by its commas, colons, [ and { as it arrives, before it is parsed (0: "
                                             "no bound)")
    max_sequences_per_request: int = flag(GatewayConfig.max_sequences_per_request,
                                          help="refuse a completion of more prompts x n than this with 400")
    header_timeout_s: float = flag(10.0, help="close a connection whose request headers are not all in this long "
                                              "after it began to wait")
    body_timeout_s: float = flag(GatewayConfig.body_timeout,
                                 help="refuse with 408 a request whose body is not all in this long after its headers")
    max_connections: int = flag(512, help="answer 503 to requests beyond this many open connections (or requests "
                                          "in flight)")
    api_key: str | None = flag(None, group=CLIENTS,
                               help="require `Authorization: Bearer KEY` on /v1/* (several: comma-separated)")
    api_key_file: str | None = flag(None, group=CLIENTS,
                                    help="file of API keys, one a line (with or instead of --api-key)")
    tls_cert: str | None = flag(None, group=CLIENTS, help="serve HTTPS with this PEM certificate (and --tls-key)")
    tls_key: str | None = flag(None, group=CLIENTS, help="private key of --tls-cert")
    allow_unauthenticated: bool = flag(False, group=CLIENTS,
                                       help="start without API keys on a non-loopback address although the "
                                            "scheduler's token is set (whoever reaches the gateway then uses the "
                                            "scheduler with that token)")


def _read_keys(flags: GatewayFlags) -> list[str]:
    keys = [k for k in (flags.api_key or "").split(",") if k.strip()]
    if flags.api_key_file:
        keys += [line.strip() for line in pathlib.Path(flags.api_key_file).read_text().splitlines() if line.strip()]
    return [k.strip() for k in keys]


def exposure_refusal(args, keys: list[str]) -> str | None:
    """Why the gateway must not start: it would hand the scheduler's token to whoever reaches a
    non-loopback address, asking them for no key (unless --allow-unauthenticated says it is meant)."""
    scheduler_token = args.scheduler_auth_token or args.scheduler_auth_token_file
    if not scheduler_token or keys or is_loopback(args.host) or args.allow_unauthenticated:
        return None
    return (f"--host {args.host} is reachable from other machines and the gateway holds the scheduler's token but "
            "asks its clients for no key: set --api-key or --api-key-file (or listen on 127.0.0.1; "
            "--allow-unauthenticated if this is meant)")


# Collections of the youngest generation: one per this many container objects made, not the
# interpreter's 700. Parsing a body makes an object per JSON array and object, and with 700 the
# collections (each older one walking the whole heap) took 2-3x the parse's own time.
GC_THRESHOLD = (50_000, 20, 20)
# Digits of an integer the parser converts (the interpreter's least bound; its default is 4,300):
# converting takes time quadratic in them, 8 MiB of 4,299-digit integers 0.5 s. No field takes
# more than 20 (a uint64).
MAX_INT_DIGITS = 640


def tune_for_parsing() -> None:
    """The interpreter's settings under which parsing a request body, on the event loop that
    writes every stream, costs what its size says: the objects made at start-up (modules, the
    app) are frozen out of every collection, the young generation is collected once per
    GC_THRESHOLD[0] new container objects, and integers of more than MAX_INT_DIGITS digits are
    refused."""
    freeze_startup_heap()
    gc.set_threshold(*GC_THRESHOLD)
    sys.set_int_max_str_digits(MAX_INT_DIGITS)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="qwen3-serve gateway", description=__doc__, env_prefix="QWEN3_SERVE_GATEWAY_")
    add_config_arguments(p, GatewayFlags, {CLIENTS: "who may call the gateway"})
    add_client_security_arguments(p, "scheduler-", "the scheduler", "scheduler",
                                  "how the gateway reaches the scheduler")
    add_logging_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        p.error("--tls-cert and --tls-key go together")
    check_client_security_arguments(p, args, "scheduler-")
    if min(args.max_request_body_mib, args.max_request_json_values) < 0 or args.max_sequences_per_request < 1:
        p.error("--max-request-body-mib and --max-request-json-values must be 0 or more and "
                "--max-sequences-per-request at least 1")
    if min(args.header_timeout_s, args.body_timeout_s) <= 0 or args.max_connections < 1:
        p.error("--header-timeout-s and --body-timeout-s must be positive and --max-connections at least 1")
    keys = _read_keys(config_from_args(GatewayFlags, args))
    if why := exposure_refusal(args, keys):
        p.error(why)
    setup_logging(args.log_level, args.log_format)

    import uvicorn   # imported here: `qwen3-serve gateway --help` needs neither it nor grpc

    from gateway.app import create_app
    from gateway.connection_guard import guarded_h11

    client_options = dict(token=args.scheduler_auth_token, token_file=args.scheduler_auth_token_file,
                          ca_file=args.scheduler_tls_ca, client_cert=args.scheduler_tls_cert,
                          client_key=args.scheduler_tls_key)
    config = GatewayConfig(target=args.target, api_keys=keys,
                           request_timeout=args.request_timeout_s or None,
                           client_options={k: v for k, v in client_options.items() if v is not None},
                           max_request_bytes=int(args.max_request_body_mib * (1 << 20)),
                           max_request_values=args.max_request_json_values,
                           max_sequences_per_request=args.max_sequences_per_request,
                           body_timeout=args.body_timeout_s)
    warn_if_exposed(args.host, args.port, has_token=bool(keys), has_tls=False, log=logger, what="the OpenAI gateway")
    # uvicorn's own loggers go through the process's handler (text or json): log_config=None
    # leaves logging as setup_logging made it. h11 and asyncio whatever else is installed: the
    # header deadline is an h11 protocol's.
    server = uvicorn.Server(uvicorn.Config(
        create_app(config), host=args.host, port=args.port, log_config=None, access_log=False,
        timeout_graceful_shutdown=args.graceful_shutdown_s, ssl_certfile=args.tls_cert, ssl_keyfile=args.tls_key,
        lifespan="on", http=guarded_h11(args.header_timeout_s, args.max_connections), loop="asyncio"))
    logger.info("OpenAI gateway on http%s://%s:%d, scheduler %s", "s" if args.tls_cert else "", args.host, args.port,
                config.target or "(default)")
    tune_for_parsing()
    server.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
