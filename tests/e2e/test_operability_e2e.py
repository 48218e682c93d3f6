"""Operating the scheduler service through real processes: what it says before any worker has
joined (UNAVAILABLE naming why, health NOT_SERVING until a group is ready, one log line per change
of why it waits, not one per poll), and Ctrl-C twice stopping it at once."""
from __future__ import annotations

import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.pb.llm.v1 import generation_pb2, generation_pb2_grpc
from tests.support.client import generate, model_info
from tests.support.procs import Proc, free_port, running_services, scheduler_proc, worker_proc

pytestmark = pytest.mark.timeout(180)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def wait_answering(proc: Proc, timeout_s: float = 120.0) -> None:
    """Waits until the process answers health checks at all (whatever it says)."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(proc.addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            assert proc.popen.poll() is None, proc.log.read_text()[-3000:]
            try:
                stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                return
            except grpc.RpcError:
                assert time.monotonic() < deadline, f"{proc.addr} never answered:\n{proc.log.read_text()[-3000:]}"
                time.sleep(0.1)


def test_before_any_worker_joined_requests_are_unavailable_and_health_waits_for_the_group(tiny_model_dir, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    worker_port = free_port()
    scheduler = scheduler_proc(tiny_model_dir, logs, [f"127.0.0.1:{worker_port}"]).start()
    worker = None
    try:
        wait_answering(scheduler)
        with grpc.insecure_channel(scheduler.addr) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            watch = health.Watch(health_pb2.HealthCheckRequest(service="llm.v1.Generation"), timeout=150)
            assert next(watch).status == NOT_SERVING
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == NOT_SERVING

            stub = generation_pb2_grpc.GenerationStub(ch)
            with pytest.raises(grpc.RpcError) as refused:
                generate(ch, text="hello", max_tokens=2)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no worker group is ready" in refused.value.details()
            with pytest.raises(grpc.RpcError) as no_info:
                stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=5)
            assert no_info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no worker group is ready" in no_info.value.details()

            # It retries every 0.5 s; the reason it waits does not change, so it says so once.
            time.sleep(3.0)
            waiting = [line for line in scheduler.log.read_text().splitlines() if "waiting for its workers" in line]
            assert len(waiting) == 1, waiting
            assert "Connection refused" in waiting[0] or "UNAVAILABLE" in waiting[0]

            worker = worker_proc(tiny_model_dir, logs, port=worker_port).start()
            assert next(watch).status == SERVING
            watch.cancel()
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == SERVING
            assert generate(ch, text="hello", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3
            assert model_info(ch).worker_groups[0].healthy
        assert "group 0 connected" in scheduler.log.read_text()
    finally:
        scheduler.kill()
        if worker is not None:
            worker.kill()


def test_a_second_ctrl_c_stops_at_once_while_the_first_drains(tiny_model_dir, tmp_path):
    with running_services(tiny_model_dir, tmp_path / "logs", scheduler_args=("--shutdown-grace", "120")) as svc, \
            svc.channel() as ch:
        stream = generation_pb2_grpc.GenerationStub(ch).Generate(generation_pb2.GenerateRequest(
            text="Once upon a time", sampling=generation_pb2.SamplingParams(max_tokens=4000, ignore_eos=True)),
            timeout=150)
        next(stream)
        scheduler = svc.scheduler.popen
        scheduler.send_signal(signal.SIGINT)
        # The first Ctrl-C drains: new requests are refused, the running one goes on.
        time.sleep(1.0)
        assert scheduler.poll() is None, "the first Ctrl-C did not leave the running request its grace"
        with pytest.raises(grpc.RpcError) as late:
            generate(ch, text="late", max_tokens=2, timeout=10)
        assert late.value.code() == grpc.StatusCode.UNAVAILABLE
        next(stream)
        started = time.monotonic()
        scheduler.send_signal(signal.SIGINT)
        status = scheduler.wait(30)
        assert time.monotonic() - started < 10, "the second Ctrl-C waited for the grace period"
        assert status == 130, f"exit status {status}: a second Ctrl-C is an interruption, not a clean stop"
        # The client is not left hanging: its stream ends with an error status.
        with pytest.raises(grpc.RpcError):
            for _ in stream:
                pass
    assert "second interrupt: stopping now" in svc.scheduler.log.read_text()
