"""Decode steps as the service runs them, for fixed batches at fixed contexts.

Drives a real worker process over loopback gRPC with the service's own scheduling code and its
async scheduling: the Scheduler and BlockManager decide each step, build_step_request encodes it,
two steps are in flight (step N+1 is sent before N's reply), and each reply goes back through
Scheduler.update. The client streams and frontends are left out (bench/host_path_cpu.py covers
them). Per pure-decode step, medians over the measured steps after warm-up:
    step        = time between consecutive replies (what the service's decode rate is)
    device      = the worker's device time of the step (CUDA events: forward, sampling, copies)
    scheduler   = schedule + encode + update here (hidden under the device when async)
    prepare     = the worker's host time applying the step and building its inputs (hidden too)
    launch      = the worker's host time launching the forward and the sampling
"""
from __future__ import annotations

import asyncio
import itertools
import random
import statistics
import time

import grpc

from common.pb.llm.worker.v1 import worker_pb2, worker_pb2_grpc
from scheduler_svc.engine.block_manager import BlockManager
from common.sampling import SamplingParams
from scheduler_svc.engine.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.engine.sequence import Sequence
from scheduler_svc.engine.step_message import build_step_request, parse_step_response

MAX_MESSAGE_BYTES = 64 << 20
LEASE_EPOCH = time.time_ns()     # this run's lease of the worker (worker_svc/lease.py)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


async def _measure_one(stub, info, batch: int, context: int, rng: random.Random, warmup_steps: int,
                       measured_steps: int, max_num_batched_tokens: int, max_token_id: int, seq_ids, step_ids) -> dict:
    await stub.Reset(worker_pb2.ResetRequest(lease_epoch=LEASE_EPOCH), timeout=60)
    step_ids = itertools.count(1)     # a reset worker expects step 1 next
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max_num_batched_tokens,
                                          max_model_len=info.max_model_len, block_size=info.block_size),
                          BlockManager(info.num_kv_blocks, info.block_size))
    params = SamplingParams(temperature=1.0, max_tokens=warmup_steps + measured_steps + 2, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randint(0, max_token_id) for _ in range(context)]
        scheduler.add(Sequence(next(seq_ids), f"decode-{batch}-{i}", prompt, params))
    in_flight = []      # (output, pure_decode, reply task)
    samples, decode_steps, last_reply = [], 0, None
    while scheduler.has_unfinished() or in_flight:
        while len(in_flight) < 2 and scheduler.has_unfinished():
            t0 = time.perf_counter()
            output = scheduler.schedule()
            if output.is_empty:
                break
            request = build_step_request(next(step_ids), output)
            request.lease_epoch = LEASE_EPOCH
            host_ms = (time.perf_counter() - t0) * 1e3
            pure = not output.new_requests and len(output.seqs) == batch and not output.multi_token_indices
            in_flight.append((output, pure, host_ms, asyncio.ensure_future(stub.Step(request, timeout=600))))
        output, pure, host_ms, task = in_flight.pop(0)
        reply = await task
        now = time.perf_counter()
        t0 = time.perf_counter()
        scheduler.update(output, parse_step_response(reply).token_ids)
        host_ms += (time.perf_counter() - t0) * 1e3
        gap_ms = (now - last_reply) * 1e3 if last_reply is not None else None
        last_reply = now
        if not pure or gap_ms is None:
            continue
        decode_steps += 1
        if decode_steps <= warmup_steps or len(samples) >= measured_steps:
            continue
        t = reply.timings
        samples.append(dict(step_ms=gap_ms, device_ms=t.device_ms, scheduler_ms=host_ms, prepare_ms=t.prepare_ms,
                            launch_ms=t.forward_ms))
    row = {"batch": batch, "context": context, "steps": len(samples)}
    if samples:
        row.update({key: _median([s[key] for s in samples]) for key in samples[0]})
    return row


def measure_decode_breakdown(worker_addr: str, model_dir, *, cases: list[tuple[int, int]], warmup_steps: int = 8,
                             measured_steps: int = 48, max_num_batched_tokens: int = 16384, max_token_id: int = 10000,
                             seed: int = 0) -> list[dict]:
    """One row per (batch, context) case."""
    async def run() -> list[dict]:
        rng = random.Random(seed)
        seq_ids = itertools.count(1)
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        async with grpc.aio.insecure_channel(worker_addr, options=options) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            info = await stub.Describe(worker_pb2.DescribeRequest(), timeout=30)
            await stub.Claim(worker_pb2.ClaimRequest(owner="bench.decode_breakdown", epoch=LEASE_EPOCH,
                                                     lease_ms=3_600_000), timeout=30)
            rows = []
            for batch, context in cases:
                if batch * (context + warmup_steps + measured_steps + 2) > info.num_kv_blocks * info.block_size:
                    rows.append({"batch": batch, "context": context, "steps": 0, "skipped": "KV cache too small"})
                    continue
                rows.append(await _measure_one(stub, info, batch, context, rng, warmup_steps, measured_steps,
                                               max_num_batched_tokens, max_token_id, seq_ids, None))
            await stub.Reset(worker_pb2.ResetRequest(lease_epoch=LEASE_EPOCH), timeout=60)
            return rows

    return asyncio.run(run())
