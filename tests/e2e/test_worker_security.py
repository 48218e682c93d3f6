"""The worker's bearer token and (mutual) TLS, on an in-process server that loads no model:
a call that passes the checks reaches the servicer, which answers UNAVAILABLE ("still loading"),
so the status code tells how far each call got."""
from __future__ import annotations

import argparse
import logging
import shutil

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.pb.llm.worker.v1 import worker_pb2, worker_pb2_grpc
from common.security import server_credentials
from tests.support.certs import make_ca_and_certs
from tests.support.procs import free_port
from common.security import add_server_security_arguments, server_security_from_args
from worker_svc.__main__ import main
from worker_svc.server import WorkerServer

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
BEARER = (("authorization", "Bearer t0ken"),)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI")
    return make_ca_and_certs(tmp_path_factory.mktemp("certs"), names=("worker", "scheduler"))


@pytest.fixture
def serve():
    servers = []

    def start(**security) -> str:
        port = free_port()
        server = WorkerServer("127.0.0.1", port, **security)
        server.start()
        servers.append(server)
        return f"localhost:{port}"

    yield start
    for server in servers:
        server.stop(grace=0)


def code_of(call, *args, **kwargs) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call(*args, timeout=10, **kwargs)
    return err.value.code()


def test_token_guards_every_worker_call_but_not_health(serve):
    with grpc.insecure_channel(serve(auth_token="t0ken")) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        steps = lambda request, **kw: list(stub.Steps(iter([request]), **kw))  # noqa: E731 - the stream, read out
        for call, request in ((stub.Step, worker_pb2.StepRequest()), (steps, worker_pb2.StepRequest()),
                              (stub.Describe, worker_pb2.DescribeRequest()), (stub.Reset, worker_pb2.ResetRequest())):
            assert code_of(call, request) == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(call, request, metadata=(("authorization", "Bearer wrong"),)) == \
                grpc.StatusCode.UNAUTHENTICATED
            assert code_of(call, request, metadata=(("authorization", "t0ken"),)) == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(call, request, metadata=BEARER) == grpc.StatusCode.UNAVAILABLE
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING


@needs_openssl
def test_mutual_tls_needs_a_certificate_from_the_client_ca(serve, certs, tmp_path):
    credentials = server_credentials(str(certs / "worker.pem"), str(certs / "worker.key"), str(certs / "ca.pem"))
    address = serve(auth_token="t0ken", credentials=credentials)
    ca, read = (certs / "ca.pem").read_bytes(), lambda name: (certs / name).read_bytes()
    with grpc.secure_channel(address, grpc.ssl_channel_credentials(ca, read("scheduler.key"), read("scheduler.pem"))) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        assert code_of(stub.Describe, worker_pb2.DescribeRequest(), metadata=BEARER) == grpc.StatusCode.UNAVAILABLE
        assert code_of(stub.Describe, worker_pb2.DescribeRequest()) == grpc.StatusCode.UNAUTHENTICATED
    stranger = make_ca_and_certs(tmp_path / "other-ca", names=("stranger",))
    foreign = grpc.ssl_channel_credentials(ca, (stranger / "stranger.key").read_bytes(),
                                           (stranger / "stranger.pem").read_bytes())
    for client in (grpc.ssl_channel_credentials(ca), foreign):   # no certificate; one the CA never signed
        with grpc.secure_channel(address, client) as ch:
            assert code_of(worker_pb2_grpc.WorkerStub(ch).Describe, worker_pb2.DescribeRequest(), metadata=BEARER) == \
                grpc.StatusCode.UNAVAILABLE
            assert code_of(health_pb2_grpc.HealthStub(ch).Check, health_pb2.HealthCheckRequest()) == \
                grpc.StatusCode.UNAVAILABLE   # the handshake fails before any call
    with grpc.insecure_channel(address) as plain:
        assert code_of(worker_pb2_grpc.WorkerStub(plain).Describe, worker_pb2.DescribeRequest(), metadata=BEARER) == \
            grpc.StatusCode.UNAVAILABLE


@needs_openssl
def test_tls_without_client_ca_serves_any_client_that_trusts_the_server(serve, certs):
    address = serve(credentials=server_credentials(str(certs / "worker.pem"), str(certs / "worker.key")))
    with grpc.secure_channel(address, grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes())) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING


LOG = logging.getLogger("test")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_server_security_arguments(parser, "tests")
    return parser.parse_args(argv)


def test_flags_that_cannot_work_are_refused(tmp_path):
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "token").write_text("t0ken\n")
    assert server_security_from_args(parse("--auth-token-file", str(tmp_path / "token")), LOG) == ("t0ken", None)
    assert server_security_from_args(parse(), LOG) == (None, None)
    for argv, error in ((("--tls-cert", "c.pem"), "go together"),
                        (("--tls-key", "k.pem"), "go together"),
                        (("--tls-client-ca", "ca.pem"), "needs --tls-cert"),
                        (("--auth-token-file", str(tmp_path / "empty")), "empty token"),
                        (("--auth-token", ""), "empty token")):
        with pytest.raises(ValueError, match=error):
            server_security_from_args(parse(*argv), LOG)
    with pytest.raises(FileNotFoundError):
        server_security_from_args(parse("--auth-token-file", str(tmp_path / "missing")), LOG)
    with pytest.raises(SystemExit):   # a token inline and in a file: which one was meant?
        parse("--auth-token", "a", "--auth-token-file", str(tmp_path / "token"))
    with pytest.raises(SystemExit) as exit_:   # main reports the same errors as usage errors
        main(["--model", str(tmp_path), "--tls-cert", "c.pem"])
    assert exit_.value.code == 2
