"""Two schedulers pointed at one worker, as real processes: the worker belongs to the first (its
lease); the second is refused, says who holds the worker, and the first serves exactly what it
serves alone. Once the first dies, the second takes the worker over within the lease time, and a
restart of the second under the same identity re-claims it at once."""
from __future__ import annotations

import random
import re
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.client import generate, generate_many
from tests.support.procs import scheduler_proc, worker_proc
from tests.e2e.test_operability_e2e import wait_answering

pytestmark = pytest.mark.timeout(240)

LEASE_S = 3.0


def _requests() -> list[dict]:
    rng = random.Random(5)
    return [dict(token_ids=[rng.randrange(3, 500) for _ in range(rng.randint(5, 30))], temperature=0.0,
                 ignore_eos=True, max_tokens=24) for _ in range(6)]


def _health(addr: str) -> int:
    with grpc.insecure_channel(addr) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def _refusal(addr: str) -> str:
    with grpc.insecure_channel(addr) as ch, pytest.raises(grpc.RpcError) as refused:
        generate(ch, text="hi", max_tokens=2, timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    return refused.value.details()


def test_a_worker_serves_one_scheduler_and_the_other_takes_over_once_its_lease_lapses(tiny_model_dir, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    # A claim is granted at most --max-lease: 60 s here, so that a takeover timed by any lease
    # but the first's 3 s (the second's 60 s, or the cap) could not pass for it.
    worker = worker_proc(tiny_model_dir, logs, "--max-lease", "60").start()
    first = scheduler_proc(tiny_model_dir, logs, [worker.addr], "--instance-id", "sched-a",
                           "--worker-lease", str(LEASE_S))
    second = scheduler_proc(tiny_model_dir, logs, [worker.addr], "--instance-id", "sched-b", "--worker-lease", "60")
    procs = [worker, first, second]
    requests = _requests()
    try:
        worker.wait_serving()
        first.start().wait_serving()
        with grpc.insecure_channel(first.addr) as ch:
            alone = [c.token_ids for c in generate_many(ch, requests)]

        second.start()
        wait_answering(second)
        deadline = time.monotonic() + 60
        while "leased to scheduler 'sched-a'" not in (details := _refusal(second.addr)):
            assert time.monotonic() < deadline, details
            time.sleep(0.2)
        assert _health(second.addr) == health_pb2.HealthCheckResponse.NOT_SERVING

        # The second keeps trying to claim the worker (every 0.5 s) while the first serves.
        with grpc.insecure_channel(first.addr) as ch:
            assert [c.token_ids for c in generate_many(ch, requests)] == alone
        assert _health(second.addr) == health_pb2.HealthCheckResponse.NOT_SERVING

        # The worker granted the first the lease it asked for (not the default 10 s, nor the cap).
        assert re.search(rf"leased to scheduler 'sched-a' \(epoch \d+, {LEASE_S:g} s\)", worker.log.read_text())
        first.kill()
        died = time.monotonic()
        second.wait_serving(timeout=60)
        took = time.monotonic() - died
        # Within the lease, plus a reconnect interval and a loaded machine's slack (3.0-3.5 s with
        # six busy loops on two cores); any other lease (60 s) would take far longer.
        assert took < LEASE_S + 12.0, f"took the worker over after {took:.1f}s; the lease is {LEASE_S}s"
        with grpc.insecure_channel(second.addr) as ch:
            assert [c.token_ids for c in generate_many(ch, requests)] == alone
        assert "took the worker over" in worker.log.read_text()

        # The second restarts under the same identity: its 60 s lease does not make it wait.
        second.kill()
        restarted = time.monotonic()
        again = scheduler_proc(tiny_model_dir, logs, [worker.addr], "--instance-id", "sched-b",
                               "--worker-lease", "60")
        procs.append(again)
        again.start().wait_serving(timeout=50)
        assert time.monotonic() - restarted < 50
        assert "leased to" not in again.log.read_text(), "the restarted scheduler waited for its own lease"
        with grpc.insecure_channel(again.addr) as ch:
            assert [c.token_ids for c in generate_many(ch, requests)] == alone
        assert "claimed the worker again" in worker.log.read_text()
    finally:
        for proc in procs:
            proc.kill()


def test_a_lease_is_granted_at_most_max_lease_so_a_stranger_cannot_keep_the_worker(tiny_model_dir, tmp_path):
    """Anyone who reaches a worker whose owner fell silent may claim it, but not for 49.7 days:
    the claim is cut to --max-lease, after which another scheduler takes the worker."""
    from common.pb.llm.worker.v1 import worker_pb2, worker_pb2_grpc

    logs = tmp_path / "logs"
    logs.mkdir()
    worker = worker_proc(tiny_model_dir, logs, "--max-lease", "2").start()
    try:
        worker.wait_serving()
        with grpc.insecure_channel(worker.addr) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            claimed = stub.Claim(worker_pb2.ClaimRequest(owner="stranger", epoch=1, lease_ms=2**32 - 1), timeout=10)
            assert claimed.lease_ms == 2000
            claimed_at = time.monotonic()
            with pytest.raises(grpc.RpcError) as held:
                stub.Claim(worker_pb2.ClaimRequest(owner="scheduler", epoch=2, lease_ms=10_000), timeout=10)
            assert held.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "'stranger'" in held.value.details()
            time.sleep(max(0.0, claimed_at + 2.2 - time.monotonic()))
            taken = stub.Claim(worker_pb2.ClaimRequest(owner="scheduler", epoch=2, lease_ms=10_000), timeout=10)
            assert taken.lease_ms == 2000
    finally:
        worker.kill()


def test_a_worker_beyond_loopback_without_a_token_refuses_to_start_unless_told(tiny_model_dir, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    exposed = worker_proc(tiny_model_dir, logs, "--host", "0.0.0.0").start()
    assert exposed.popen.wait(120) == 2
    assert "--allow-unauthenticated" in exposed.log.read_text()
    allowed = worker_proc(tiny_model_dir, logs, "--host", "0.0.0.0", "--allow-unauthenticated")
    allowed.addr = allowed.addr.replace("127.0.0.1", "localhost")
    try:
        allowed.start().wait_serving()
        assert "WITHOUT authentication" in allowed.log.read_text()     # and it still says so loudly
    finally:
        allowed.kill()
