"""Greedy streams through a worker killed and restarted mid-generation: the worker is killed once a
stream has its first tokens, the scheduler is given time to notice, and a new worker with the same
flags takes the old one's port while the streams wait."""
from __future__ import annotations

import dataclasses
import pathlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from common.pb.llm.v1 import generation_pb2, generation_pb2_grpc
from tests.support.client import model_info
from tests.support.procs import Services, worker_proc

UNHEALTHY_WAIT_S = 30.0


@dataclasses.dataclass
class RestartRun:
    streams: list[tuple[list[int], int]]   # each request's tokens and last finish reason
    seen_unhealthy: bool                   # the scheduler reported the dead worker before the restart


def stream_across_a_worker_restart(svc: Services, channel: grpc.Channel, model_dir: pathlib.Path,
                                   log_dir: pathlib.Path, requests: list[dict], worker_args: tuple[str, ...] = (),
                                   started_after: int = 5) -> RestartRun:
    """Streams `requests` (token_ids and max_tokens; greedy, ignore_eos) at once, restarting
    svc.workers[0] with `worker_args` as soon as one stream has `started_after` tokens."""
    started = threading.Event()
    streams: list = [None] * len(requests)

    def run(i: int) -> None:
        r = requests[i]
        request = generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=r["token_ids"]),
            sampling=generation_pb2.SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r["max_tokens"]))
        tokens, reason = [], 0
        for msg in generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=180):
            tokens += msg.token_ids
            if len(tokens) >= started_after:
                started.set()
            reason = msg.finish_reason or reason
        streams[i] = (tokens, reason)

    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(run, i) for i in range(len(requests))]
        assert started.wait(60), "no stream started"
        old = svc.workers[0]
        old.kill()
        seen_unhealthy = _wait_unhealthy(channel)
        port = int(old.addr.rsplit(":", 1)[1])
        svc.workers[0] = worker_proc(model_dir, log_dir, *worker_args, port=port).start()
        for f in futures:
            f.result()
    return RestartRun(streams, seen_unhealthy)


def _wait_unhealthy(channel: grpc.Channel) -> bool:
    deadline = time.monotonic() + UNHEALTHY_WAIT_S
    while time.monotonic() < deadline:
        if not model_info(channel).worker_groups[0].healthy:
            return True
        time.sleep(0.05)
    return False
