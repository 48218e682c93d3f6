"""Stage profile: where a decode step's device time goes. torch.profiler over decode steps
(CUDA-graph replays) of a ModelRunner in this process, at --profile-batches and one context;
per batch, the kernel time per step and the kernels that take the most of it.

Kernels launched with PDL (programmatic dependent launch: the projections, and on a Hopper the
whole decode layer, PERF_NOTES v45) start before the kernel ahead of them ends and wait, so their
profiled times overlap and sum past the step. Each kernel is therefore also charged only the time
by which it extends the device's busy span (`busy_attribution`): those charges sum to the span, and
a kernel that mostly waited is charged little."""

from __future__ import annotations

import argparse
import collections
import sys
import time

import numpy as np

from bench.options import config_dir, model_dir

REQUIRES = ("checkpoint",)
PROFILED_STEPS = 10


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile-batches", default="1,64,256")
    p.add_argument("--profile-context", type=int, default=1024, help="context of the profile stage")
    p.add_argument("--profile-config", default=None,
                   help="profile a config of bench.options.CONFIGS (e.g. 8b) with dummy weights instead of the checkpoint")
    p.add_argument("--profile-quantization", choices=("fp8",), default=None,
                   help="the profiled config's weights quantized on load (block FP8)")


def run(args: argparse.Namespace) -> dict:
    dummy = args.profile_config is not None
    path = config_dir(args, args.profile_config) if dummy else model_dir(args)
    return {"rows": profile_decode(path, batches=[int(b) for b in args.profile_batches.split(",")],
                                   context=args.profile_context, attention_backend=args.attention_backend,
                                   load_format="dummy" if dummy else "auto", quantization=args.profile_quantization),
            "model": args.profile_config or "checkpoint", "quantization": args.profile_quantization}


def _step(runner, step_id: int, new=(), cached=(), counts=None):
    from worker_svc.step_message import StepInput

    cached = list(cached)
    num = np.ones(len(cached), np.int64) if counts is None else np.array(counts, np.int64)
    empty = np.zeros(0, np.int64)
    return runner.launch(StepInput(step_id, [], list(new), cached, num, empty, empty, empty)).result()


def profile_decode(path, *, batches: list[int], context: int, attention_backend: str = "auto",
                   load_format: str = "auto", quantization: str | None = None) -> list[dict]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from worker_svc.config import WorkerConfig
    from worker_svc.layers.sampler import SamplingOptions
    from worker_svc.model_runner import ModelRunner

    largest = max(batches)
    steps_needed = 4 + 2 * PROFILED_STEPS
    runner = ModelRunner(WorkerConfig(model=str(path), device="cuda", attention_backend=attention_backend,
                                      max_num_seqs=largest, max_num_batched_tokens=16384,
                                      max_model_len=context + steps_needed + 16, load_format=load_format,
                                      quantization=quantization))
    rng = np.random.default_rng(0)
    bs = runner.block_size
    blocks_per_seq = -(-(context + steps_needed + 1) // bs)
    rows = []
    step_id = 0
    options = SamplingOptions(temperature=1.0)
    for batch in batches:
        runner.reset()
        seq_ids = list(range(1, batch + 1))
        step_id = prefill_contexts(runner, seq_ids, context, blocks_per_seq, rng, options, step_id)
        for _ in range(4):               # warm-up decodes
            step_id += 1
            _step(runner, step_id, cached=seq_ids)
        torch.cuda.synchronize()
        started = time.perf_counter()    # the same steps unprofiled: wall time a step (launch to result)
        for _ in range(PROFILED_STEPS):
            step_id += 1
            _step(runner, step_id, cached=seq_ids)
        wall_ms = (time.perf_counter() - started) * 1e3 / PROFILED_STEPS
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(PROFILED_STEPS):
                step_id += 1
                _step(runner, step_id, cached=seq_ids)
            torch.cuda.synchronize()
        per_kernel: dict[str, float] = collections.defaultdict(float)
        spans = []
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                per_kernel[event.name] += event.device_time / 1e3 / PROFILED_STEPS   # us -> ms per step
                spans.append((event.time_range.start, event.time_range.end, event.name))
        total = sum(per_kernel.values())
        top = sorted(per_kernel.items(), key=lambda kv: -kv[1])
        busy, added = busy_attribution(spans)
        rows.append({"batch": batch, "context": context, "device_ms_per_step": total, "wall_ms_per_step": wall_ms,
                     "top": [(name, round(ms, 4)) for name, ms in top[:25]],
                     "busy_ms_per_step": busy / 1e3 / PROFILED_STEPS,
                     "top_busy": [(name, round(us / 1e3 / PROFILED_STEPS, 4))
                                  for name, us in sorted(added.items(), key=lambda kv: -kv[1])[:25]]})
    return rows


def prefill_contexts(runner, seq_ids: list[int], context: int, blocks_per_seq: int, rng, options, step_id: int) -> int:
    """Request i of seq_ids (from 1) gets a prompt of `context` random tokens in KV blocks [(i - 1) *
    blocks_per_seq, i * blocks_per_seq), prefilled one request a step (a prompt may exceed the step's token
    budget: 16,384-token chunks). Returns the last step id."""
    from worker_svc.step_message import NewRequest

    for seq_id in seq_ids:
        blocks = list(range((seq_id - 1) * blocks_per_seq, seq_id * blocks_per_seq))
        prompt = rng.integers(0, min(10000, runner.vocab_size), context).tolist()
        done = 0
        while done < context:
            n = min(16384, context - done)
            step_id += 1
            if done == 0:
                _step(runner, step_id, new=[NewRequest(seq_id, prompt, context, 0, n, blocks, options)])
            else:
                _step(runner, step_id, cached=[seq_id], counts=[n])
            done += n
    return step_id


def busy_attribution(spans) -> tuple[float, dict[str, float]]:
    """(the device's busy time, each name's share of it) for (start, end, name) intervals that may
    overlap: in start order, each interval is charged the part of it past the latest end before
    it, so the charges sum to the union of the intervals."""
    added: dict[str, float] = collections.defaultdict(float)
    frontier = float("-inf")
    busy = 0.0
    for start, end, name in sorted(spans):
        extends = end - max(start, frontier)
        if extends > 0:
            added[name] += extends
            busy += extends
        frontier = max(frontier, end)
    return busy, dict(added)


def report(args: argparse.Namespace, results: dict[str, dict]) -> None:
    result = results["profile"]["result"]
    model = f"{result.get('model', 'checkpoint')}{' ' + result['quantization'] if result.get('quantization') else ''}"
    for row in result["rows"]:
        print(f"\nprofile ({model}): decode graph replay at batch {row['batch']}, context {row['context']}: "
              f"{row['device_ms_per_step']:.2f} ms of kernels per step (profiled), "
              f"{row.get('wall_ms_per_step', float('nan')):.2f} ms wall a step unprofiled; top kernels (ms per step, share)")
        for name, ms in row["top"][:12]:
            print(f"  {ms:7.3f} {ms / row['device_ms_per_step']:6.1%}  {name[:90]}")
        if "busy_ms_per_step" in row:   # (results before v45 lack it)
            busy = row["busy_ms_per_step"]
            print(f"  the device busy {busy:.2f} ms a step ({row['device_ms_per_step'] - busy:.2f} ms of the kernels' time "
                  f"overlaps: PDL); each kernel's share of the busy time (ms per step, share)")
            for name, ms in row["top_busy"][:12]:
                print(f"  {ms:7.3f} {ms / busy if busy else 0:6.1%}  {name[:90]}")


if __name__ == "__main__":
    from bench.gpu_bench import run_alone

    sys.exit(run_alone(__spec__.name, sys.argv[1:]))
