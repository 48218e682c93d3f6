"""What the grammar mask costs a step on the device: `apply_bitmask` (worker_svc/layers/grammar.py)
for a batch of logits with some rows constrained, against the step's sampling-sized work (a softmax
over the same logits) for scale. Zero constrained rows must cost nothing (the call returns at once).

Each case times the bitmask's host-to-device copy plus the masking, as a worker pays it per step
(CUDA events around 50 repetitions after 5 warm-ups; perf_counter on CPU).

    python -m bench.grammar_mask_cost [--device cuda] [--vocab 151936] [--out out.json]
    python -m bench.grammar_mask_cost --device cpu --vocab 4096 --batches 1,16   # a quick check
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch

from worker_svc.layers.grammar import apply_bitmask


def timed(fn, device: torch.device, repeats: int = 50, warmup: int = 5) -> float:
    """Microseconds per call."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / repeats
    begin = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - begin) * 1e6 / repeats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=151936, help="Qwen3's logits width")
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--fractions", default="0,0.1,0.5,1", help="shares of the batch that are constrained")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    words = (args.vocab + 31) // 32
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        logits = torch.randn(batch, args.vocab, generator=generator).to(device, dtype)
        softmax_us = timed(lambda: logits.float().softmax(-1), device)
        for fraction in [float(f) for f in args.fractions.split(",")]:
            constrained = round(batch * fraction)
            if fraction > 0 and constrained == 0:
                constrained = 1
            index = list(range(0, batch, max(batch // max(constrained, 1), 1)))[:constrained]
            bitmask = torch.randint(-2**31, 2**31 - 1, (constrained, words), dtype=torch.int32, generator=generator)
            if device.type == "cuda":
                bitmask = bitmask.pin_memory()
            work = logits.clone()
            mask_us = timed(lambda: apply_bitmask(work, index, bitmask if constrained else None), device)
            rows.append({"batch": batch, "constrained": constrained, "apply_us": mask_us, "softmax_us": softmax_us})

    if args.out:
        args.out.write_text(json.dumps({"device": str(device), "vocab": args.vocab, "dtype": args.dtype, "rows": rows}, indent=2))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"apply_bitmask on {name}, vocab {args.vocab}, {args.dtype}")
    print(f"{'batch':>6} {'constrained':>11} {'apply_us':>9} {'softmax_us':>10}")
    for r in rows:
        print(f"{r['batch']:>6} {r['constrained']:>11} {r['apply_us']:>9.1f} {r['softmax_us']:>10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
