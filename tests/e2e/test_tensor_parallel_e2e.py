"""Tensor parallelism through the whole service: a scheduler over one group of two worker
processes (gloo on the CPU) generates, greedily, exactly what one worker and transformers do,
through chunked prefill; ModelInfo and Describe show the topology. A group whose peer dies
fails its next step at once, and the surviving rank exits (busy or idle) so that the group can
be restarted whole."""
from __future__ import annotations

import random
import time

import grpc
import pytest

from common.pb.llm.worker.v1 import worker_pb2, worker_pb2_grpc
from tests.support.client import generate_many, model_info
from tests.support.hf_reference import hf_greedy
from tools.loadtest.metrics import scrape_metrics
from tools.offline import LLM
from common.sampling import SamplingParams
from tests.support.procs import free_port, tensor_parallel_args, worker_proc

pytestmark = pytest.mark.timeout(240)

EXIT_GROUP_BROKEN = 3   # worker_svc.__main__.EXIT_GROUP_BROKEN (not imported: it would import the worker)
# A 48-token step budget splits the long prompts into chunks, mixed with the others' decodes.
SCHEDULER_ARGS = ("--max-num-batched-tokens", "48")


def _requests() -> list[dict]:
    rng = random.Random(6)
    lengths = [rng.randint(3, 40) for _ in range(13)] + [100, 120, 150]
    rng.shuffle(lengths)
    return [dict(token_ids=[rng.randrange(3, 512) for _ in range(n)], temperature=0.0, ignore_eos=True,
                 max_tokens=rng.randint(4, 16)) for n in lengths]


def _describe(addr: str) -> worker_pb2.WorkerInfo:
    with grpc.insecure_channel(addr) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Describe(worker_pb2.DescribeRequest(), timeout=10)


def test_two_ranks_serve_like_one_worker_and_transformers(tiny_model_dir, launch_services):
    requests = _requests()
    metrics_port = free_port()
    with launch_services(num_workers=2, tensor_parallel_size=2, worker_args=("--dist-timeout", "60"),
                         scheduler_args=(*SCHEDULER_ARGS, "--metrics-port", str(metrics_port))) as svc, \
            svc.channel() as channel:
        tp2 = generate_many(channel, requests)
        info = model_info(channel)
        metrics = scrape_metrics(metrics_port)
        ranks = [_describe(w.addr) for w in svc.workers]
        svc.workers[0].kill()
        # Rank 1 is idle: its heartbeat into rank 0's store is what notices.
        assert _wait_exit(svc.workers[1], 15) == EXIT_GROUP_BROKEN
    # One rank: the same engine in-process, with the same step budget.
    tp1 = LLM(str(tiny_model_dir), max_num_batched_tokens=48).generate(
        [r["token_ids"] for r in requests],
        [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r["max_tokens"]) for r in requests])

    [group] = info.worker_groups
    assert group.tensor_parallel_size == 2 and len(group.addresses) == 2 and group.healthy
    assert metrics['llm_worker_group_tensor_parallel_size{group="0"}'] == 2
    assert [(r.rank, r.world_size) for r in ranks] == [(0, 2), (1, 2)]
    assert ranks[0].num_kv_blocks == ranks[1].num_kv_blocks == group.num_kv_blocks
    for i, (req, got, single) in enumerate(zip(requests, tp2, tp1)):
        want = hf_greedy(tiny_model_dir, req["token_ids"], req["max_tokens"])
        assert got.token_ids == single == want, f"request {i} ({len(req['token_ids'])} prompt tokens)"


def _one_token_step(step_id: int, lease_epoch: int) -> worker_pb2.StepRequest:
    prompt = [11, 12, 13, 14]
    return worker_pb2.StepRequest(step_id=step_id, lease_epoch=lease_epoch, new_requests=[worker_pb2.NewRequest(
        seq_id=1, token_ids=prompt, num_prompt_tokens=len(prompt), num_scheduled_tokens=len(prompt),
        block_ids=[0], sampling=worker_pb2.SamplingOptions(temperature=0.0))])


def _wait_exit(proc, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while proc.popen.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return proc.popen.poll()


def test_a_dead_peer_fails_the_step_and_breaks_the_group(tiny_model_dir, tmp_path):
    init_addr = f"127.0.0.1:{free_port()}"
    ranks = [worker_proc(tiny_model_dir, tmp_path, "--num-kv-blocks", "8", "--dist-timeout", "5",
                         *tensor_parallel_args(2, rank, init_addr)).start() for rank in range(2)]
    try:
        for rank in ranks:
            rank.wait_serving()
        with grpc.insecure_channel(ranks[0].addr) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            stub.Claim(worker_pb2.ClaimRequest(owner="tests", epoch=1, lease_ms=60_000), timeout=10)
            ranks[1].kill()
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as failure:
                stub.Step(_one_token_step(1, lease_epoch=1), timeout=30)
        # gloo notices the closed connection at once; the collective timeout is the backstop.
        assert failure.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)
        assert time.monotonic() - started < 10
        assert _wait_exit(ranks[0], 15) == EXIT_GROUP_BROKEN
    finally:
        for rank in ranks:
            rank.kill()
