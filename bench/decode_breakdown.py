"""Where a decode step's time goes, for a fixed batch at a fixed context.

Drives a real worker process over loopback gRPC with the service's own scheduling code: the
Scheduler and BlockManager decide each step, build_step_request encodes it, the worker's reply
goes back through Scheduler.update and each sequence's incremental detokenizer, as the engine
does (the engine's asyncio loop and the client streams are left out). Per pure-decode step:
    scheduler  = schedule + encode + update + detokenize   (this process)
    transport  = round trip - the worker's total_ms        (serialisation, gRPC, loopback)
    prepare    = the worker's prepare_ms                    (input tensors from its mirrors)
    forward    = the worker's forward_ms                    (model + sampling, GPU time included)
    worker_rest = total_ms - prepare_ms - forward_ms        (decoding the request, building the reply)
Medians over the measured steps, after warm-up steps.
"""
from __future__ import annotations

import itertools
import random
import statistics
import time

import grpc

from common.pb.llm.worker.v1 import worker_pb2, worker_pb2_grpc
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.sampling_params import SamplingParams
from scheduler_svc.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.sequence import Sequence
from scheduler_svc.step_message import build_step_request
from scheduler_svc.tokenizer import load_tokenizer

MAX_MESSAGE_BYTES = 64 << 20


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def measure_decode_breakdown(worker_addr: str, model_dir, *, batch_sizes: list[int], context: int,
                             warmup_steps: int = 8, measured_steps: int = 48,
                             max_num_batched_tokens: int = 16384, max_token_id: int = 10000,
                             seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    tokenizer = load_tokenizer(model_dir)
    seq_ids = itertools.count(1)
    step_ids = itertools.count(1)
    rows = []
    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    with grpc.insecure_channel(worker_addr, options=options) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        info = stub.Describe(worker_pb2.DescribeRequest(), timeout=30)
        for batch in batch_sizes:
            stub.Reset(worker_pb2.ResetRequest(), timeout=30)
            scheduler = Scheduler(
                SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=info.max_model_len, block_size=info.block_size),
                BlockManager(info.num_kv_blocks, info.block_size))
            detokenizers = {}
            params = SamplingParams(temperature=1.0, max_tokens=warmup_steps + measured_steps + 1, ignore_eos=True)
            for i in range(batch):
                prompt = [rng.randint(0, max_token_id) for _ in range(context)]
                seq = Sequence(next(seq_ids), f"decode-{batch}-{i}", prompt, params)
                scheduler.add(seq)
                detokenizers[seq.seq_id] = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=False)
            samples = []
            decode_steps = 0
            while scheduler.has_unfinished():
                t0 = time.perf_counter()
                output = scheduler.schedule()
                request = build_step_request(next(step_ids), output)
                t1 = time.perf_counter()
                reply = stub.Step(request, timeout=600)
                t2 = time.perf_counter()
                received = scheduler.update(output, {t.seq_id: t.token_id for t in reply.sampled})
                for seq in received:
                    detokenizers[seq.seq_id].push(seq.token_ids[-1:])
                t3 = time.perf_counter()
                pure_decode = not request.new_requests and len(request.cached_requests) == batch and all(
                    r.num_scheduled_tokens == 1 for r in request.cached_requests)
                if not pure_decode:
                    continue
                decode_steps += 1
                if decode_steps <= warmup_steps:
                    continue
                timings = reply.timings
                samples.append(dict(
                    step_ms=(t3 - t0) * 1e3, scheduler_ms=((t1 - t0) + (t3 - t2)) * 1e3,
                    transport_ms=(t2 - t1) * 1e3 - timings.total_ms, prepare_ms=timings.prepare_ms,
                    forward_ms=timings.forward_ms,
                    worker_rest_ms=timings.total_ms - timings.prepare_ms - timings.forward_ms))
            row = {"batch": batch, "context": context, "steps": len(samples)}
            row.update({key: _median([s[key] for s in samples]) for key in samples[0]} if samples else {})
            rows.append(row)
        stub.Reset(worker_pb2.ResetRequest(), timeout=30)
    return rows
