"""Faults and overload through real processes: a worker killed mid-generation, a burst past the
queue bound, graceful shutdown, and a soak with random cancellations."""
from __future__ import annotations

import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common.pb.llm.v1 import generation_pb2, generation_pb2_grpc
from tests.support.client import generate, generate_many, model_info
from tests.support.procs import running_services, worker_proc
from tests.support.worker_restart import stream_across_a_worker_restart

pytestmark = pytest.mark.timeout(300)


def _requests(seed: int, n: int, max_tokens: int) -> list[dict]:
    rng = random.Random(seed)
    return [dict(token_ids=[rng.randrange(3, 512) for _ in range(rng.randint(10, 80))],
                 temperature=0.0, ignore_eos=True, max_tokens=max_tokens) for _ in range(n)]


def _rss_kb(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def test_worker_killed_mid_generation_streams_finish_unchanged(tiny_model_dir, tmp_path):
    requests = _requests(11, 16, 120)
    with running_services(tiny_model_dir, tmp_path / "logs") as svc, svc.channel() as ch:
        undisturbed = generate_many(ch, requests)
        run = stream_across_a_worker_restart(svc, ch, tiny_model_dir, tmp_path / "logs", requests)
        assert run.seen_unhealthy, "the scheduler never reported the dead worker"
        assert model_info(ch).worker_groups[0].healthy
    for i, (tokens, reason) in enumerate(run.streams):
        assert reason == generation_pb2.FINISH_REASON_LENGTH
        assert tokens == undisturbed[i].token_ids, f"stream {i} lost or repeated tokens across the restart"


def test_burst_past_queue_bound_is_refused_cleanly(tiny_model_dir, tmp_path):
    bound = 8
    requests = _requests(12, 10 * bound, 16)
    with running_services(tiny_model_dir, tmp_path / "logs",
                          scheduler_args=("--max-waiting", str(bound), "--max-num-seqs", "4")) as svc, svc.channel() as ch:
        rss_before = _rss_kb(svc.scheduler.popen.pid)

        def attempt(r):
            try:
                return generate(ch, **r)
            except grpc.RpcError as e:
                return e

        with ThreadPoolExecutor(len(requests)) as pool:
            outcomes = list(pool.map(attempt, requests))
        rss_after = _rss_kb(svc.scheduler.popen.pid)
        refused = [o for o in outcomes if isinstance(o, grpc.RpcError)]
        served = [o for o in outcomes if not isinstance(o, grpc.RpcError)]
        assert refused and served
        assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "waiting" in e.details() for e in refused)
        assert all(c.finish_reason == generation_pb2.FINISH_REASON_LENGTH and len(c.token_ids) == 16 for c in served)
        assert rss_after - rss_before < 100_000, f"scheduler grew by {rss_after - rss_before} kB"
        group = model_info(ch).worker_groups[0]
        assert group.num_free_kv_blocks == group.num_kv_blocks


def test_sigterm_drains_running_requests_and_exits_zero(tiny_model_dir, tmp_path):
    with running_services(tiny_model_dir, tmp_path / "logs", scheduler_args=("--shutdown-grace", "30")) as svc:
        with svc.channel() as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            stream = stub.Generate(generation_pb2.GenerateRequest(
                text="Once upon a time", sampling=generation_pb2.SamplingParams(max_tokens=200, ignore_eos=True)), timeout=60)
            next(stream)
            svc.scheduler.popen.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            with pytest.raises(grpc.RpcError) as err:
                generate(ch, text="late", max_tokens=2)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            rest = list(stream)
        assert rest[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
        assert rest[-1].usage.completion_tokens == 200
        assert svc.scheduler.popen.wait(30) == 0


def test_soak_with_random_cancellations_loses_nothing(services):
    rng = random.Random(13)
    num_requests, rate = 240, 40.0        # a steady 40 requests/s for about six seconds
    outcomes: dict[int, str] = {}

    def one(i: int, cancel_after: int | None) -> None:
        stub = generation_pb2_grpc.GenerationStub(ch)
        req = generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=[rng.randrange(3, 512) for _ in range(rng.randint(4, 60))]),
            sampling=generation_pb2.SamplingParams(max_tokens=rng.randint(1, 40), temperature=0.8, ignore_eos=True))
        stream = stub.Generate(req, timeout=120)
        n = 0
        try:
            for msg in stream:
                n += len(msg.token_ids)
                if msg.finish_reason:
                    outcomes[i] = generation_pb2.FinishReason.Name(msg.finish_reason)
                if cancel_after is not None and n >= cancel_after and not msg.finish_reason:
                    stream.cancel()
        except grpc.RpcError as e:
            outcomes[i] = "cancelled" if e.code() == grpc.StatusCode.CANCELLED else f"error:{e.code().name}"

    with services.channel() as ch, ThreadPoolExecutor(64) as pool:
        futures = []
        start = time.monotonic()
        for i in range(num_requests):
            time.sleep(max(0.0, start + i / rate - time.monotonic()))
            futures.append(pool.submit(one, i, rng.randint(1, 10) if rng.random() < 0.25 else None))
        for f in futures:
            f.result()
        assert len(outcomes) == num_requests, "some request ended with neither a finish reason nor a status"
        assert not [o for o in outcomes.values() if o.startswith("error")]
        assert sum(o == "cancelled" for o in outcomes.values()) > 10
        deadline = time.monotonic() + 10
        while (g := model_info(ch).worker_groups[0]).num_free_kv_blocks != g.num_kv_blocks or g.num_running:
            assert time.monotonic() < deadline, f"blocks still held after the soak: {g}"
            time.sleep(0.05)


def test_request_with_deadline_ends_cleanly_while_the_worker_is_down(tiny_model_dir, tmp_path):
    with running_services(tiny_model_dir, tmp_path / "logs") as svc, svc.channel() as ch:
        svc.workers[0].kill()
        deadline = time.monotonic() + 30
        while model_info(ch).worker_groups[0].healthy:
            assert time.monotonic() < deadline, "the scheduler never noticed the dead worker"
            time.sleep(0.05)
        # Admitted and queued (the scheduler keeps accepting), then ended by the client's deadline.
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            generate(ch, text="anyone there?", max_tokens=4, timeout=2.0)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 15            # ended by the 2 s deadline, not left hanging
        group = model_info(ch).worker_groups[0]
        assert group.num_running == 0 and group.num_free_kv_blocks == group.num_kv_blocks
        # Once a worker is back on the same address, the service answers again.
        port = int(svc.workers[0].addr.rsplit(":", 1)[1])
        svc.workers[0] = worker_proc(tiny_model_dir, tmp_path / "logs", port=port).start()
        assert generate(ch, text="back?", max_tokens=3, ignore_eos=True, timeout=120).usage.completion_tokens == 3


def test_requests_of_a_dead_group_move_to_the_healthy_one(tiny_model_dir, tmp_path):
    requests = _requests(14, 12, 100)
    with running_services(tiny_model_dir, tmp_path / "logs", num_workers=2) as svc, svc.channel() as ch:
        undisturbed = generate_many(ch, requests)
        results: list = [None] * len(requests)
        started = threading.Barrier(len(requests) + 1)

        def run(i: int) -> None:
            r = requests[i]
            stream = generation_pb2_grpc.GenerationStub(ch).Generate(generation_pb2.GenerateRequest(
                token_ids=generation_pb2.TokenIds(ids=r["token_ids"]),
                sampling=generation_pb2.SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r["max_tokens"])),
                timeout=180)
            tokens, reason = [], 0
            for n, msg in enumerate(stream):
                tokens += msg.token_ids
                reason = msg.finish_reason or reason
                if n == 0:
                    started.wait()
            results[i] = (tokens, reason)

        with ThreadPoolExecutor(len(requests)) as pool:
            futures = [pool.submit(run, i) for i in range(len(requests))]
            started.wait(60)          # every stream has its first token: both groups are busy
            info = model_info(ch)
            assert all(g.num_running > 0 for g in info.worker_groups), "the load did not spread"
            svc.workers[1].kill()     # and it stays dead
            for f in futures:
                f.result()
        groups = model_info(ch).worker_groups
        assert not groups[1].healthy and groups[0].healthy
    for i, (tokens, reason) in enumerate(results):
        assert reason == generation_pb2.FINISH_REASON_LENGTH
        assert tokens == undisturbed[i].token_ids, f"stream {i} changed when its group died"
