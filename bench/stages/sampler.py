"""Stage sampler: the torch sampler (layers/sampler.py) against the device sampler's kernels
(layers/device_sampler.py) on Qwen3's 151,936-token vocabulary, and decode steps of a
Qwen3-0.6B-shaped runner (dummy weights) with --sampler torch and kernels.

- sampling: per batch and mode, ms per call of the torch sampler, of the kernels launched eagerly
  and of the kernels replayed in a CUDA graph; `ok` checks every drawn token against the torch
  sampler's distribution (greedy: the same token; else a token it gives a nonzero probability);
  `paths` counts how the truncating rows found their cut (layers/sampling_kernels.py: gathered,
  bracketed, alone, min-p).
- steps: per batch, the step's wall time (launch to tokens on the host, one at a time) and what the
  host launched outside CUDA graphs in one profiled pure-decode step (kernels, graph replays, copies).

    python -m bench.stages.sampler --out /tmp/bench                 # < 2 minutes on one H200
    python -m bench.stages.sampler --out /tmp/smoke --device cpu --tiny
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import statistics
import sys
import time

import numpy as np

from bench.options import config_dir

VOCAB = 151_936
MODES = ("greedy", "temperature", "top-k 50", "top-p 0.9", "min-p 0.05", "mixed")
STEP_SAMPLERS = ("torch", "kernels")
PROMPT_LEN = 32


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sampler-batches", default="1,16,64,256", help="batches of the sampler stage")
    p.add_argument("--sampler-iters", type=int, default=20, help="timed calls per case of the sampler stage")


def run(args: argparse.Namespace) -> dict:
    if args.device == "cpu":
        from tools.triton_interpreter import gpu_faithful
    else:
        gpu_faithful = contextlib.nullcontext
    batches = [int(b) for b in args.sampler_batches.split(",")]
    vocab, iters = (512, 2) if args.tiny else (VOCAB, args.sampler_iters)
    if args.tiny:
        batches = [b for b in batches if b <= 16]
    with gpu_faithful():
        return {"sampling": sampling_table(args.device, vocab, batches, iters),
                "steps": step_table(args, batches, 8 if args.tiny else args.sampler_iters)}


def options_of(mode: str, n: int) -> list:
    from worker_svc.layers.sampler import SamplingOptions

    each = {"greedy": SamplingOptions(temperature=0.0), "temperature": SamplingOptions(temperature=0.8),
            "top-k 50": SamplingOptions(top_k=50), "top-p 0.9": SamplingOptions(top_p=0.9),
            "min-p 0.05": SamplingOptions(min_p=0.05)}
    if mode != "mixed":
        return [each[mode]] * n
    cycle = list(each.values())
    return [cycle[i % len(cycle)] for i in range(n)]


# --- sampling alone -------------------------------------------------------------------------------

def sampling_table(device_name: str, vocab: int, batches: list[int], iters: int) -> list[dict]:
    import torch

    device = torch.device(device_name)
    generator = torch.Generator(device=device).manual_seed(0)
    rows = []
    for batch in batches:
        logits = (torch.randn(batch, vocab, device=device, generator=generator) * 4).to(torch.bfloat16)
        rows += [{"batch": batch, "mode": mode, **sampling_case(logits, mode, iters)} for mode in MODES]
    return rows


def sampling_case(logits, mode: str, iters: int) -> dict:
    """Both samplers on logits [batch, vocab], every row with the mode's options."""
    import torch

    from worker_svc.layers.device_sampler import DeviceSampler
    from worker_svc.layers.sampler import Sampler

    (batch, vocab), device = logits.shape, logits.device
    options = options_of(mode, batch)
    old = Sampler(vocab, device)
    meta = old.metadata(options, [None] * batch)
    new = DeviceSampler(vocab, device, capacity=batch, max_rows=batch)
    for row, o in enumerate(options):
        new.add(row, [1], 1, o)
    new.flush()
    rows = torch.arange(batch, device=device)
    tokens = torch.zeros(batch, dtype=torch.int64, device=device)
    logprobs = torch.zeros(batch, dtype=torch.float32, device=device)
    last = torch.zeros(new.capacity + 1, dtype=torch.int64, device=device)

    def new_eager():
        new.sample(logits, rows, tokens, logprobs, last)

    old_ms = timed(device, lambda: old.sample(logits, meta), iters)
    new_ms = timed(device, new_eager, iters)
    graph_ms = timed_graph(device, new_eager, iters) if device.type == "cuda" else None
    new_eager()
    paths = collections.Counter(p for p in new.cut_paths(batch) if p != "none")
    return {"old_ms": old_ms, "new_ms": new_ms, "new_graph_ms": graph_ms, "ok": agrees(old, meta, logits, tokens, mode),
            "paths": dict(paths)}


def agrees(old, meta, logits, tokens, mode: str) -> bool:
    """Greedy: the torch sampler's token; any mode: a token of nonzero reference probability, or one
    whose logit ties the smallest kept logit (top-k/top-p keep one of equal logits at their edge by
    position; the kernels keep every tie, as vLLM does)."""
    import torch

    probs = old.probabilities(logits, meta)
    picked = probs.gather(1, tokens[:, None]).squeeze(1)
    if mode == "greedy" and not torch.equal(tokens, logits.argmax(-1)):
        return False
    edge = logits.float().masked_fill(probs <= 0, float("inf")).amin(-1)
    at_edge = logits.float().gather(1, tokens[:, None]).squeeze(1) >= edge
    return bool(((picked > 0) | at_edge).all())


def timed(device, fn, iters: int) -> float:
    """ms per call, after warm-up calls (device time and host time together: the calls in a row)."""
    import torch

    for _ in range(3):
        fn()
    if device.type != "cuda":
        started = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - started) * 1e3 / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def timed_graph(device, fn, iters: int) -> float:
    import torch

    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return timed(device, graph.replay, iters)


# --- decode steps ---------------------------------------------------------------------------------

def step_table(args: argparse.Namespace, batches: list[int], steps: int) -> list[dict]:
    rows = []
    for sampler in STEP_SAMPLERS:
        runner = make_runner(args, sampler, max(batches), steps)
        for batch in batches:
            rows.append({"sampler": sampler, "batch": batch, **decode_steps(runner, batch, steps)})
        del runner
        gc.collect()
    return rows


def make_runner(args: argparse.Namespace, sampler: str, max_batch: int, steps: int):
    from worker_svc.config import WorkerConfig
    from worker_svc.model_runner import ModelRunner

    config = WorkerConfig(model=str(config_dir(args, "0.6b")), device=args.device, load_format="dummy",
                          attention_backend=args.attention_backend,
                          sampler=sampler, max_num_seqs=max_batch, max_num_batched_tokens=max(max_batch * PROMPT_LEN, 512),
                          max_model_len=PROMPT_LEN + steps + 32, num_kv_blocks=max_batch * blocks_per_seq(steps) + 16)
    return ModelRunner(config)


def decode_steps(runner, batch: int, steps: int) -> dict:
    """The batch's prompts in one step, warm-up decodes, then `steps` timed decodes and one profiled."""
    from worker_svc.runner_io import NewRequest

    runner.reset()
    rng = np.random.default_rng(batch)
    per_seq = blocks_per_seq(steps)
    options = options_of("mixed", batch)
    new = [NewRequest(s + 1, rng.integers(0, min(10_000, runner.vocab_size), PROMPT_LEN).tolist(), PROMPT_LEN, 0,
                      PROMPT_LEN, list(range(s * per_seq, (s + 1) * per_seq)), o)
           for s, o in enumerate(options)]
    seq_ids = [n.seq_id for n in new]
    step_id = iter(range(1, 10**9))
    runner.step(step_input(next(step_id), new=new))
    for _ in range(3):
        runner.step(step_input(next(step_id), cached=seq_ids))
    wall = []
    for _ in range(steps - 5):
        started = time.perf_counter()
        runner.step(step_input(next(step_id), cached=seq_ids))
        wall.append((time.perf_counter() - started) * 1e3)
    return {"step_ms": statistics.median(wall), **launches(runner, step_input(next(step_id), cached=seq_ids))}


def blocks_per_seq(steps: int) -> int:
    return -(-(PROMPT_LEN + steps + 16) // 16)   # the runner's default block size


def step_input(step_id: int, new=(), cached=()):
    from worker_svc.step_message import StepInput

    empty = np.zeros(0, np.int64)
    return StepInput(step_id, [], list(new), list(cached), np.ones(len(cached), np.int64), empty, empty, empty)


def launches(runner, step) -> dict:
    """What the host launched in one step: kernels (alone), graph replays, copies."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if runner.device.type != "cuda":
        runner.step(step)
        return {"kernels": None, "graphs": None, "copies": None}
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.step(step)
    calls = collections.Counter(e.name for e in prof.events() if e.name.startswith(("cuda", "cu")))
    return {"kernels": sum(n for name, n in calls.items() if "LaunchKernel" in name),
            "graphs": sum(n for name, n in calls.items() if "GraphLaunch" in name),
            "copies": sum(n for name, n in calls.items() if "Memcpy" in name)}


def report(args: argparse.Namespace, results: dict[str, dict]) -> None:
    result = results["sampler"]["result"]
    print("\nsampler: ms per call over the vocabulary (bf16 logits); ok: every token drawn is one the torch "
          "sampler can draw (greedy: its token)")
    print(f"{'batch':>5s} {'mode':12s} {'torch':>8s} {'kernels':>8s} {'in graph':>9s} {'speed-up':>9s} ok  paths")
    for r in result["sampling"]:
        best = r["new_graph_ms"] if r["new_graph_ms"] is not None else r["new_ms"]
        graph = f"{r['new_graph_ms']:9.3f}" if r["new_graph_ms"] is not None else f"{'-':>9s}"
        paths = " ".join(f"{name} {count}" for name, count in sorted(r.get("paths", {}).items()))
        print(f"{r['batch']:5d} {r['mode']:12s} {r['old_ms']:8.3f} {r['new_ms']:8.3f} {graph} "
              f"{r['old_ms'] / best:8.1f}x {'yes' if r['ok'] else 'NO ':3s} {paths}")
    print("\nsampler: decode steps of Qwen3-0.6B (dummy weights, mixed sampling rows); launched outside "
          "graphs in one step")
    print(f"{'sampler':8s} {'batch':>5s} {'step ms':>8s} {'kernels':>8s} {'graphs':>7s} {'copies':>7s}")
    for r in result["steps"]:
        print(f"{r['sampler']:8s} {r['batch']:5d} {r['step_ms']:8.3f} {r['kernels']!s:>8s} {r['graphs']!s:>7s} "
              f"{r['copies']!s:>7s}")


if __name__ == "__main__":
    from bench.gpu_bench import run_alone

    sys.exit(run_alone(__spec__.name, sys.argv[1:]))
