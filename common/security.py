"""Bearer-token checks and TLS credentials for both services.

The public API can require `authorization: Bearer <token>`; a worker can require its
scheduler's token, or a client certificate signed by a CA it trusts (mutual TLS). Health checks
stay open so orchestrators can probe without secrets.
"""
from __future__ import annotations

import argparse
import hmac
import logging
import pathlib

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"


def _authorized(metadata, token: str) -> bool:
    for key, value in metadata or ():
        if key == "authorization":
            # Constant-time comparison: the token is a secret.
            return hmac.compare_digest(value.encode(), f"Bearer {token}".encode())
    return False


def _exempt(method: str) -> bool:
    return method.startswith(HEALTH_PREFIX)


def _deny_handler(handler: grpc.RpcMethodHandler | None, aio: bool):
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED."""
    message = "missing or wrong bearer token (send metadata 'authorization: Bearer <token>')"

    if aio:
        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
    else:
        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler is not None and handler.response_streaming and not handler.request_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    if handler is not None and handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """For synchronous servers (the worker)."""

    def __init__(self, token: str) -> None:
        self._token = token

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if _exempt(handler_call_details.method) or _authorized(handler_call_details.invocation_metadata, self._token):
            return handler
        return _deny_handler(handler, aio=False)


class AsyncTokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """For asyncio servers (the scheduler)."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if _exempt(handler_call_details.method) or _authorized(handler_call_details.invocation_metadata, self._token):
            return handler
        return _deny_handler(handler, aio=True)


def server_credentials(cert: str, key: str, client_ca: str | None = None) -> grpc.ServerCredentials:
    """TLS for a server; with client_ca, clients must present a certificate signed by it (mTLS)."""
    return grpc.ssl_server_credentials(
        [(pathlib.Path(key).read_bytes(), pathlib.Path(cert).read_bytes())],
        root_certificates=pathlib.Path(client_ca).read_bytes() if client_ca else None,
        require_client_auth=client_ca is not None,
    )


def channel_credentials(ca: str | None, cert: str | None = None, key: str | None = None) -> grpc.ChannelCredentials:
    """TLS for a client; cert/key present this client's own certificate (mTLS)."""
    read = lambda p: pathlib.Path(p).read_bytes() if p else None  # noqa: E731
    return grpc.ssl_channel_credentials(root_certificates=read(ca), private_key=read(key), certificate_chain=read(cert))


def read_secret(value: str | None, file: str | None) -> str | None:
    """A token given inline or, better (it stays out of `ps`), in a file; None when neither.
    An empty one is an error: callers treat "no token" as "no authentication", so an empty
    file (a failed secret mount, say) would otherwise switch authentication off silently."""
    secret = pathlib.Path(file).read_text().strip() if file else value
    if secret is not None and not secret:
        raise ValueError(f"empty token{f' in {file}' if file else ''}")
    return secret


def add_server_security_arguments(parser: argparse.ArgumentParser, who: str) -> None:
    """The flags that decide who may call a server (`who` names its callers in the help)."""
    group = parser.add_argument_group("security", f"who may call this server: {who} (health checks stay open)")
    token = group.add_mutually_exclusive_group()
    token.add_argument("--auth-token-file", metavar="PATH",
                       help="file holding the token every call must send as 'authorization: Bearer <token>'")
    token.add_argument("--auth-token", help="the token inline (discouraged: any local user sees it in ps)")
    group.add_argument("--tls-cert", metavar="PATH", help="PEM certificate chain: serve only TLS (with --tls-key)")
    group.add_argument("--tls-key", metavar="PATH", help="PEM private key of --tls-cert")
    group.add_argument("--tls-client-ca", metavar="PATH",
                       help="PEM CA: mutual TLS, clients must present a certificate it signed")


def server_security_from_args(args: argparse.Namespace, log: logging.Logger) -> tuple[str | None, grpc.ServerCredentials | None]:
    """The bearer token and TLS credentials the flags ask for; reads the files now, so a wrong
    path fails at start-up rather than at the first call."""
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
    if args.auth_token is not None:
        log.warning("--auth-token is visible in the process list; prefer --auth-token-file")
    token = read_secret(args.auth_token, args.auth_token_file)
    credentials = server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
    if token and credentials is None:
        log.warning("the bearer token travels in plaintext: add --tls-cert/--tls-key unless the network is private")
    return token, credentials
