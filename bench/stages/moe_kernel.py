"""Stage moe_kernel: one Qwen3-30B-A3B MoE layer (128 experts, top-8, hidden 2048, width 768, bf16):
the fused Triton path against the reference expert loop at --kernel-batches (median time, largest
difference), and the floor of reading the experts the batch touches. On the CPU (--tiny) the
kernels run under Triton's interpreter."""
from __future__ import annotations

import argparse
import contextlib
import functools
import sys

from bench.floor import ModelShape, expected_touched
from bench.options import load_config, measured_rates
from bench.timing import timer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kernel-batches", default="1,64,256", help="token counts of the moe_kernel stage")


def run(args: argparse.Namespace) -> dict:
    if args.device == "cpu":
        from tools.triton_interpreter import gpu_faithful
    else:
        gpu_faithful = contextlib.nullcontext
    with gpu_faithful():
        return _rows(args)


def _rows(args: argparse.Namespace) -> dict:
    import torch

    from worker_svc.layers import moe, moe_kernels

    config = load_config(args, "moe")
    shape = ModelShape(config)
    experts, top_k = shape.experts, shape.top_k
    hidden, width = config["hidden_size"], config["moe_intermediate_size"]
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    g = torch.Generator(device=args.device).manual_seed(0)
    w13 = (torch.randn(experts, 2 * width, hidden, generator=g, device=args.device) * 0.02).to(dtype)
    w2 = (torch.randn(experts, hidden, width, generator=g, device=args.device) * 0.02).to(dtype)
    gate = (torch.randn(experts, hidden, generator=g, device=args.device) * 0.02).to(dtype)
    timed = timer(args.device)
    rows = []
    for batch in [int(b) for b in args.kernel_batches.split(",")]:
        x = torch.randn(batch, hidden, generator=g, device=args.device).to(dtype)
        logits = x @ gate.T
        fused = functools.partial(moe_kernels.fused_moe, x, logits, w13, w2, top_k, True)
        reference = functools.partial(_reference, x, logits, w13, w2, top_k)
        expected, actual = reference(), fused()
        touched = len(torch.unique(moe.route(logits, top_k, True)[1]))
        error = (actual.float() - expected.float()).abs().max().item()
        fused_s, reference_s = timed(fused), timed(reference, rep=50)
        rows.append({"batch": batch, "fused_s": fused_s, "reference_s": reference_s, "max_abs_error": error,
                     "output_max": expected.float().abs().max().item(), "touched_experts": touched,
                     "expected_touched": expected_touched(batch, experts, top_k),
                     "touched_bytes": touched * 3 * hidden * width * w13.element_size()})
    return {"rows": rows, "experts": experts, "top_k": top_k, "hidden": hidden, "width": width}


def _reference(x, logits, w13, w2, top_k: int):
    from worker_svc.layers import moe

    weights, ids = moe.route(logits, top_k, True)
    return moe.moe_reference(x, w13, w2, weights, ids)


def report(args: argparse.Namespace, results: dict[str, dict]) -> None:
    k, rates = results["moe_kernel"]["result"], measured_rates(results)
    print(f"\nMoE layer ({k['experts']} experts, top-{k['top_k']}, hidden {k['hidden']}, width {k['width']}): "
          "fused Triton path vs reference loop; floor: reading the touched experts once")
    print(f"{'batch':>5s} {'fused ms':>9s} {'loop ms':>9s} {'speedup':>8s} {'experts':>8s} {'floor ms':>9s} "
          f"{'of floor':>8s} {'max err':>9s}")
    for r in k["rows"]:
        floor_s = r["touched_bytes"] / rates["copy_bytes_per_s"] if rates else float("nan")
        print(f"{r['batch']:5d} {r['fused_s'] * 1e3:9.3f} {r['reference_s'] * 1e3:9.3f} "
              f"{r['reference_s'] / r['fused_s']:7.1f}x {r['touched_experts']:8d} {floor_s * 1e3:9.3f} "
              f"{floor_s / r['fused_s']:8.1%} {r['max_abs_error']:9.2e}")


if __name__ == "__main__":
    from bench.gpu_bench import run_alone

    sys.exit(run_alone(__spec__.name, sys.argv[1:]))
