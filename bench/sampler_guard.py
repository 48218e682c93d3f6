"""What the sampler's non-finite guard (worker_svc/layers/logits_guard.py) costs per step: the time
of Sampler.sample with the guard and with it replaced by no-ops, on the same logits and rows.

Cases, each at several batch sizes over a Qwen3-sized vocabulary: greedy rows (the guard does
nothing there), drawing rows (temperature and top-p: one sum over the probabilities and one argmax
over the raw logits), and drawing rows with penalties (also a log-sum-exp over the penalised
logits). Each timing is the median of --iters calls after a warm-up, synchronised on the device;
the two variants alternate so that clock and load changes hit both alike.

    python -m bench.sampler_guard --out /tmp/sampler_guard.json                 # an H200: the defaults
    python -m bench.sampler_guard --device cpu --vocab 4096 --batches 1,8 --iters 5 --out /tmp/g.json
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

import worker_svc.layers.sampler as sampler_module
from worker_svc.layers.sampler import Sampler, SamplingOptions

CASES = {
    "greedy": SamplingOptions(temperature=0.0),
    "drawing": SamplingOptions(temperature=0.7, top_p=0.9),
    "drawing+penalties": SamplingOptions(temperature=0.7, top_p=0.9, repetition_penalty=1.1, frequency_penalty=0.2),
}


@dataclass
class Row:
    sampling: SamplingOptions
    penalty_row: int | None = None
    num_output_tokens: int = 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path, required=True, help="results as JSON")
    p.add_argument("--device", default="cuda")
    p.add_argument("--vocab", type=int, default=151936, help="Qwen3's padded vocabulary")
    p.add_argument("--batches", default="1,64,256", help="rows per step, comma-separated")
    p.add_argument("--dtype", default="bfloat16", help="of the logits, as the model returns them")
    p.add_argument("--iters", type=int, default=50)
    return p.parse_args(argv)


@contextmanager
def guard_off():
    """Sampler.sample as before the guard: every row usable, nothing replaced."""
    saved = sampler_module.drawable_rows, sampler_module.with_unusable_rows_raw
    sampler_module.drawable_rows = lambda probs: torch.ones(probs.shape[0], dtype=torch.bool, device=probs.device)
    sampler_module.with_unusable_rows_raw = lambda scores, raw: scores
    try:
        yield
    finally:
        sampler_module.drawable_rows, sampler_module.with_unusable_rows_raw = saved


def time_sample(sampler: Sampler, logits: torch.Tensor, rows: list[Row], device: torch.device) -> float:
    """Seconds of one sample() call, the device drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    sampler.sample(logits, rows)     # returns lists: it synchronises on the device itself
    return time.perf_counter() - started


def measure(args: argparse.Namespace, case: str, batch: int) -> dict:
    device = torch.device(args.device)
    options = CASES[case]
    sampler = Sampler(args.vocab, device, seed=0)
    rows = [Row(options) for _ in range(batch)]
    for i, row in enumerate(rows):
        row.penalty_row = sampler.add_request(list(range(i, i + 64)), 32, options)
    logits = torch.randn(batch, args.vocab, generator=torch.Generator().manual_seed(batch)).mul_(3)
    logits = logits.to(device=device, dtype=getattr(torch, args.dtype))
    times = {"guarded": [], "unguarded": []}
    for _ in range(3):                                     # warm-up: allocator, kernels
        time_sample(sampler, logits, rows, device)
    for _ in range(args.iters):
        times["guarded"].append(time_sample(sampler, logits, rows, device))
        with guard_off():
            times["unguarded"].append(time_sample(sampler, logits, rows, device))
    guarded, unguarded = (statistics.median(times[k]) * 1e6 for k in ("guarded", "unguarded"))
    return {"case": case, "batch": batch, "vocab": args.vocab, "dtype": args.dtype, "guarded_us": guarded,
            "unguarded_us": unguarded, "overhead_us": guarded - unguarded, "overhead_pct": 100 * (guarded / unguarded - 1)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_grad_enabled(False)
    device = torch.device(args.device)
    results = [measure(args, case, int(b)) for case in CASES for b in args.batches.split(",")]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": name, "results": results}, indent=2))
    print(f"sampler guard on {name}, vocab {args.vocab}, {args.dtype} logits, median of {args.iters}")
    print(f"{'case':<20}{'batch':>6}{'guarded us':>12}{'unguarded us':>14}{'overhead us':>13}{'overhead %':>12}")
    for r in results:
        print(f"{r['case']:<20}{r['batch']:>6}{r['guarded_us']:>12.1f}{r['unguarded_us']:>14.1f}"
              f"{r['overhead_us']:>13.1f}{r['overhead_pct']:>12.1f}")


if __name__ == "__main__":
    main()
