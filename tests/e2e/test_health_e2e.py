"""grpc.health.v1 through real processes: Check and Watch on the scheduler and on a worker, and
Watch turning NOT_SERVING as soon as a process starts draining on SIGTERM (what Kubernetes-style
watchers and grpc-health-probe rely on to stop routing to it)."""
from __future__ import annotations

import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.pb.llm.v1 import generation_pb2, generation_pb2_grpc
from tests.support.procs import running_services, scheduler_proc, worker_proc

pytestmark = pytest.mark.timeout(180)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _check(channel: grpc.Channel, service: str) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _watch(channel: grpc.Channel, service: str):
    return health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=service), timeout=60)


def test_scheduler_watch_turns_not_serving_while_it_drains(tiny_model_dir, tmp_path):
    with running_services(tiny_model_dir, tmp_path / "logs", scheduler_args=("--shutdown-grace", "30")) as svc, \
            svc.channel() as ch:
        overall, generation = _watch(ch, ""), _watch(ch, "llm.v1.Generation")
        assert next(overall).status == SERVING and next(generation).status == SERVING
        stream = generation_pb2_grpc.GenerationStub(ch).Generate(generation_pb2.GenerateRequest(
            text="Once upon a time", sampling=generation_pb2.SamplingParams(max_tokens=300, ignore_eos=True)),
            timeout=60)
        next(stream)
        svc.scheduler.popen.send_signal(signal.SIGTERM)
        assert next(generation).status == NOT_SERVING
        assert next(overall).status == NOT_SERVING
        # Told while draining: the admitted request still streams to its end.
        rest = list(stream)
        assert len(rest) > 1, "NOT_SERVING came only after the drain"
        assert rest[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
        assert rest[-1].usage.completion_tokens == 300
        overall.cancel()
        generation.cancel()
        assert svc.scheduler.popen.wait(30) == 0


def test_check_and_watch_follow_an_idle_scheduler_and_a_worker_from_start_to_sigterm(tiny_model_dir, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    worker = worker_proc(tiny_model_dir, logs).start()
    scheduler = scheduler_proc(tiny_model_dir, logs, [worker.addr])
    try:
        with grpc.insecure_channel(worker.addr) as worker_ch:
            # wait_for_ready: the watch starts as soon as the port opens, before or after the model loads.
            # Its deadline covers the whole test (the worker's load, the scheduler's start and stop) on a
            # loaded machine: at 60 s it could end before the worker's SIGTERM was seen.
            worker_watch = health_pb2_grpc.HealthStub(worker_ch).Watch(
                health_pb2.HealthCheckRequest(service="llm.worker.v1.Worker"), timeout=150, wait_for_ready=True)
            seen = [next(worker_watch).status]
            while seen[-1] != SERVING:
                assert seen[-1] == NOT_SERVING, seen      # loading: never SERVICE_UNKNOWN
                seen.append(next(worker_watch).status)
            assert _check(worker_ch, "") == SERVING and _check(worker_ch, "llm.worker.v1.Worker") == SERVING

            scheduler.start().wait_serving()
            with grpc.insecure_channel(scheduler.addr) as ch:
                assert _check(ch, "") == SERVING and _check(ch, "llm.v1.Generation") == SERVING
                watch = _watch(ch, "llm.v1.Generation")
                assert next(watch).status == SERVING
                # Nothing to drain: the scheduler stops within a health poll, and still says so first.
                scheduler.popen.send_signal(signal.SIGTERM)
                assert next(watch).status == NOT_SERVING
                watch.cancel()
            assert scheduler.popen.wait(30) == 0

            worker.popen.send_signal(signal.SIGTERM)
            assert next(worker_watch).status == NOT_SERVING
            worker_watch.cancel()
        assert worker.popen.wait(30) == 0
    finally:
        scheduler.kill()
        worker.kill()
