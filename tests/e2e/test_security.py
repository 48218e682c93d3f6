"""Bearer tokens and TLS on the public API, and scheduler<->worker authentication."""
from __future__ import annotations

import shutil
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.pb.llm.v1 import generation_pb2, generation_pb2_grpc
from common.pb.llm.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.support.certs import make_ca_and_certs
from tests.support.client import generate
from tests.support.procs import Proc, free_port, running_services, worker_proc

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")]


def test_bearer_token_required_on_public_api(tiny_model_dir, tmp_path):
    with running_services(tiny_model_dir, tmp_path / "logs", scheduler_args=("--auth-token", "s3cret")) as svc, \
            svc.channel() as ch:
        with pytest.raises(grpc.RpcError) as err:
            generate(ch, text="hi", max_tokens=2)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Health stays open for probes.
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest()).status == \
            health_pb2.HealthCheckResponse.SERVING
        stub = generation_pb2_grpc.GenerationStub(ch)
        msgs = list(stub.Generate(
            generation_pb2.GenerateRequest(text="hi", sampling=generation_pb2.SamplingParams(max_tokens=2, ignore_eos=True)),
            metadata=(("authorization", "Bearer s3cret"),), timeout=30))
        assert msgs[-1].usage.completion_tokens == 2
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(
                generation_pb2.GenerateRequest(text="hi"), metadata=(("authorization", "Bearer wrong"),), timeout=30))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_tls_public_api_refuses_plaintext(tiny_model_dir, tmp_path):
    certs = make_ca_and_certs(tmp_path / "certs")
    args = ("--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key"))
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    worker = worker_proc(tiny_model_dir, log_dir).start()
    port = free_port()
    scheduler = Proc("scheduler", f"127.0.0.1:{port}",
                     ["scheduler_svc", "--model", str(tiny_model_dir), "--workers", worker.addr,
                      "--host", "127.0.0.1", "--port", str(port), *args], log_dir / "scheduler.log")
    try:
        worker.wait_serving()
        scheduler.start()
        creds = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes())
        with grpc.secure_channel(f"localhost:{port}", creds) as tls:
            grpc.channel_ready_future(tls).result(timeout=60)
            health_stub = health_pb2_grpc.HealthStub(tls)
            deadline = time.monotonic() + 60
            while health_stub.Check(health_pb2.HealthCheckRequest()).status != health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert generate(tls, text="hi", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3
        with grpc.insecure_channel(f"127.0.0.1:{port}") as plain:
            with pytest.raises(grpc.RpcError) as err:
                generate(plain, text="hi", max_tokens=2, timeout=5)
            assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        scheduler.stop()
        worker.stop()


def test_worker_accepts_steps_only_from_its_scheduler(tiny_model_dir, tmp_path):
    certs = make_ca_and_certs(tmp_path / "certs", names=("worker", "scheduler", "intruder"))
    token_file = tmp_path / "worker.token"
    token_file.write_text("w0rker\n")
    worker_args = ("--tls-cert", str(certs / "worker.pem"), "--tls-key", str(certs / "worker.key"),
                   "--tls-client-ca", str(certs / "ca.pem"), "--auth-token-file", str(token_file))
    scheduler_args = ("--worker-tls-ca", str(certs / "ca.pem"), "--worker-tls-cert", str(certs / "scheduler.pem"),
                      "--worker-tls-key", str(certs / "scheduler.key"), "--worker-auth-token-file", str(token_file))
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    port = free_port()
    worker = Proc("worker", f"localhost:{port}",
                  ["worker_svc", "--model", str(tiny_model_dir), "--host", "127.0.0.1", "--port", str(port),
                   "--device", "cpu", *worker_args], log_dir / "worker.log").start()
    sport = free_port()
    scheduler = Proc("scheduler", f"127.0.0.1:{sport}",
                     ["scheduler_svc", "--model", str(tiny_model_dir), "--workers", f"localhost:{port}",
                      "--host", "127.0.0.1", "--port", str(sport), *scheduler_args], log_dir / "scheduler.log")
    try:
        scheduler.start().wait_serving()
        with grpc.insecure_channel(scheduler.addr) as ch:
            assert generate(ch, text="hi", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3
        # A client with a valid certificate but no token is refused...
        creds = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes(), (certs / "intruder.key").read_bytes(),
                                             (certs / "intruder.pem").read_bytes())
        with grpc.secure_channel(f"localhost:{port}", creds) as ch:
            with pytest.raises(grpc.RpcError) as err:
                worker_pb2_grpc.WorkerStub(ch).Step(worker_pb2.StepRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # ... and one without a client certificate cannot even connect.
        creds = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes())
        with grpc.secure_channel(f"localhost:{port}", creds) as ch:
            with pytest.raises(grpc.RpcError) as err:
                worker_pb2_grpc.WorkerStub(ch).Describe(worker_pb2.DescribeRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        scheduler.stop()
        worker.stop()
