"""Stage decode: decode steps as the service runs them, for fixed batches at fixed contexts
(--decode-cases BATCHxCONTEXT), each beside its floor.

Drives a real worker process over loopback gRPC with the service's own scheduling code and its
async scheduling: the Scheduler and BlockManager decide each step, build_step_request encodes it,
steps are in flight as the engine core keeps them (step N+1 sent before N's reply, N+2 too up to
32 requests and N+3 up to 4; --decode-in-flight 2,3 measures each case at each depth instead), and each reply goes
back through Scheduler.update. The client streams and frontends are left out (the host_path stage
covers them). Every request may generate until the last prompt's chunked prefill is done and the
timed steps are over, so each case reaches steps where the whole batch decodes; the timing stops
there.
Per pure-decode step, medians over the measured steps after warm-up:
    step        = time between consecutive replies (what the service's decode rate is)
    device      = the worker's device time of the step (CUDA events: forward, sampling, copies)
    scheduler   = schedule + encode + update here (hidden under the device when async)
    prepare     = the worker's host time applying the step and building its inputs (hidden too)
    launch      = the worker's host time launching the forward and the sampling
The worker inherits this environment; WORKER_FUSED_KERNELS=0 times the unfused torch path.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass

from bench.options import max_token_id, model_dir

REQUIRES = ("checkpoint", "bandwidth")
LEASE_EPOCH = time.time_ns()     # this run's lease of the worker (worker_svc/lease.py)
STEPS_IN_FLIGHT = 2     # past the engine core's third-step bound; --decode-in-flight
MOST_IN_FLIGHT = 4      # the most --decode-in-flight may ask (each case's requests outlast that many more steps)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decode-cases", default="1x1024,64x1024,256x1024,512x1024,256x4096",
                   help="BATCHxCONTEXT cases of the decode stage")
    p.add_argument("--decode-in-flight", default="auto",
                   help="comma-separated steps in flight to measure each case at, or auto: as the service's engine "
                        "core keeps them by default (3 up to its --third-step-max-seqs requests, else 2: "
                        "docs/PERF_NOTES.md v39)")
    p.add_argument("--decode-warmup-steps", type=int, default=8)
    p.add_argument("--decode-measured-steps", type=int, default=48)
    p.add_argument("--decode-gpu-memory-utilization", type=float, default=0.95,
                   help="the decode stage's worker has the GPU alone; 256x4096 needs ~116 GiB of KV")


@dataclass(frozen=True)
class Case:
    batch: int
    context: int
    max_tokens: int      # each request's: enough to outlast every prompt's prefill and the timed steps

    @classmethod
    def parse(cls, text: str, budget: int, warmup_steps: int, measured_steps: int) -> "Case":
        batch, context = (int(x) for x in text.split("x"))
        # Chunked prefill runs the prompts in order, budget tokens a step minus the decodes beside them.
        prefill_steps = -(-batch * context // max(budget - batch, 1)) + 1
        return cls(batch, context, prefill_steps + warmup_steps + measured_steps + 2 * MOST_IN_FLIGHT)

    def blocks_needed(self, block_size: int) -> int:
        return self.batch * -(-(self.context + self.max_tokens) // block_size)


def cases(args: argparse.Namespace) -> list[Case]:
    return [Case.parse(c, args.max_num_batched_tokens, args.decode_warmup_steps, args.decode_measured_steps)
            for c in args.decode_cases.split(",")]


def run(args: argparse.Namespace) -> dict:
    from tools.launch import worker_proc

    all_cases = cases(args)
    worker = worker_proc(model_dir(args), args.out / "logs", "--device", args.device, "--attention-backend",
                         args.attention_backend, "--max-num-seqs", str(max(c.batch for c in all_cases)),
                         "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                         "--max-model-len", str(max(c.context + c.max_tokens for c in all_cases) + 16),
                         "--gpu-memory-utilization", str(args.decode_gpu_memory_utilization)).start()
    try:
        worker.wait_serving(timeout=900)
        rows = asyncio.run(_measure_all(worker.addr, all_cases, args))
    finally:
        worker.stop()
    return {"rows": rows, "fused_kernels": os.environ.get("WORKER_FUSED_KERNELS", "1") != "0"}


async def _measure_all(worker_addr: str, all_cases: list[Case], args: argparse.Namespace) -> list[dict]:
    from common.cli import ArgumentParser, add_config_arguments
    from scheduler_svc.engine.config import EngineConfig
    from scheduler_svc.engine.worker_client import GrpcWorkerClient

    rng = random.Random(0)
    seq_ids = itertools.count(1)
    top_id = max_token_id(args)
    # The engine core's own client: steps over its Steps stream, or as calls where the scheduler's flags
    # from the environment (QWEN3_SERVE_NO_STEP_STREAM) say so, read as the scheduler reads them.
    engine_flags = ArgumentParser()
    add_config_arguments(engine_flags, EngineConfig)
    client = GrpcWorkerClient(worker_addr, step_stream=engine_flags.parse_args([]).step_stream)
    try:
        info = await client.describe(timeout=30)
        await client.claim("bench.stages.decode", LEASE_EPOCH, 3600.0, timeout=30)
        rows = []
        for case in all_cases:
            needed = case.blocks_needed(info.block_size)
            if needed > info.num_kv_blocks:
                rows.append({"batch": case.batch, "context": case.context, "steps": 0,
                             "skipped": f"KV cache too small: needs {needed} blocks, has {info.num_kv_blocks}"})
                continue
            for depth in in_flight_depths(args, case.batch):
                row = await _measure_one(client, info, case, rng, top_id, seq_ids, args, depth)
                rows.append({**row, "in_flight": depth})
        await client.reset(LEASE_EPOCH, timeout=60)
        return rows
    finally:
        await client.close()


def in_flight_depths(args: argparse.Namespace, batch: int) -> list[int]:
    """The depths a case of `batch` requests is measured at (--decode-in-flight)."""
    from scheduler_svc.engine.config import FOURTH_STEP_MAX_SEQS, THIRD_STEP_MAX_SEQS, steps_in_flight

    if args.decode_in_flight == "auto":
        return [steps_in_flight(batch, THIRD_STEP_MAX_SEQS, FOURTH_STEP_MAX_SEQS)]
    depths = [int(d) for d in str(args.decode_in_flight).split(",")]
    if not all(1 <= d <= MOST_IN_FLIGHT for d in depths):
        raise ValueError(f"--decode-in-flight: each depth must lie in 1..{MOST_IN_FLIGHT}, not {args.decode_in_flight}")
    return depths


async def _measure_one(client, info, case: Case, rng: random.Random, top_id: int, seq_ids,
                       args: argparse.Namespace, depth: int = STEPS_IN_FLIGHT) -> dict:
    from common.sampling import SamplingParams
    from scheduler_svc.engine.block_manager import BlockManager
    from scheduler_svc.engine.scheduler import Scheduler, SchedulerConfig
    from scheduler_svc.engine.sequence import Sequence
    from scheduler_svc.engine.step_message import build_step_request, parse_step_response

    await client.reset(LEASE_EPOCH, timeout=60)
    step_ids = itertools.count(1)     # a reset worker expects step 1 next
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=case.batch, max_num_batched_tokens=args.max_num_batched_tokens,
                                          max_model_len=info.max_model_len, block_size=info.block_size),
                          BlockManager(info.num_kv_blocks, info.block_size))
    params = SamplingParams(temperature=1.0, max_tokens=case.max_tokens, ignore_eos=True)
    for i in range(case.batch):
        prompt = [rng.randint(0, top_id) for _ in range(case.context)]
        scheduler.add(Sequence(next(seq_ids), f"decode-{case.batch}-{i}", prompt, params))
    in_flight = []      # (output, pure decode, scheduler ms, reply task)
    samples, decode_steps, last_reply = [], 0, None
    while (scheduler.has_unfinished() and len(samples) < args.decode_measured_steps) or in_flight:
        while len(in_flight) < depth and scheduler.has_unfinished() \
                and len(samples) < args.decode_measured_steps:
            t0 = time.perf_counter()
            output = scheduler.schedule()
            if output.is_empty:
                break
            request = build_step_request(next(step_ids), output)
            request.lease_epoch = LEASE_EPOCH
            host_ms = (time.perf_counter() - t0) * 1e3
            pure = not output.new_requests and len(output.seqs) == case.batch and not output.cached.multi_token_indices
            in_flight.append((output, pure, host_ms, asyncio.ensure_future(client.step(request, timeout=600))))
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
        if decode_steps <= args.decode_warmup_steps or len(samples) >= args.decode_measured_steps:
            continue
        t = reply.timings
        samples.append(dict(step_ms=gap_ms, device_ms=t.device_ms, scheduler_ms=host_ms, prepare_ms=t.prepare_ms,
                            launch_ms=t.forward_ms, kv_tokens=sum(output.num_computed) + len(output.seqs)))
    row = {"batch": case.batch, "context": case.context, "steps": len(samples)}
    if samples:
        row.update({key: statistics.median(s[key] for s in samples) for key in samples[0]})
    return row


def report(args: argparse.Namespace, results: dict[str, dict]) -> None:
    from bench.floor import ModelShape, decode_step_floor_s
    from bench.options import measured_rates

    decode, rates = results["decode"]["result"], measured_rates(results)
    shape = ModelShape.from_file(model_dir(args) / "config.json")
    fused = "on" if decode.get("fused_kernels", True) else "off"
    print(f"\npipelined decode steps (steps in flight: fl; medians, ms; fused kernels {fused}; "
          f"floor: weights + the batch's KV over the copy bandwidth{'' if rates else ': no bandwidth stage'})")
    print(f"{'batch':>5s} {'ctx':>5s} {'fl':>2s} {'step':>7s} {'device':>7s} {'floor':>7s} {'step/dev':>8s} {'dev/floor':>9s} "
          f"{'step/floor':>10s} {'sched':>6s} {'prep':>6s} {'launch':>6s} {'tok/s':>8s}")
    for row in decode["rows"]:
        kv_tokens = row.get("kv_tokens") or row["batch"] * row["context"]
        floor_ms = decode_step_floor_s(shape, row["batch"], kv_tokens, rates) * 1e3 if rates else float("nan")
        if "step_ms" not in row:
            reason = row.get("skipped", "no pure-decode steps measured")
            print(f"{row['batch']:5d} {row['context']:5d} {row.get('in_flight', STEPS_IN_FLIGHT):2d} {'-':>7s} "
                  f"{'-':>7s} {floor_ms:7.3f}   {reason}")
            continue
        device = row["device_ms"] or float("nan")    # 0: no device timing (a CPU run)
        print(f"{row['batch']:5d} {row['context']:5d} {row.get('in_flight', STEPS_IN_FLIGHT):2d} "
              f"{row['step_ms']:7.2f} {device:7.2f} {floor_ms:7.3f} "
              f"{row['step_ms'] / device:8.2f} {device / floor_ms:9.2f} "
              f"{row['step_ms'] / floor_ms:10.2f} {row['scheduler_ms']:6.2f} {row['prepare_ms']:6.2f} "
              f"{row['launch_ms']:6.2f} {row['batch'] / row['step_ms'] * 1e3:8.0f}")


if __name__ == "__main__":
    from bench.gpu_bench import run_alone

    sys.exit(run_alone(__spec__.name, sys.argv[1:]))
