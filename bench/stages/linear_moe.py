"""Part 3 of the linear stage (bench/stages/linear.py): one Qwen3-30B-A3B MoE layer at the decode
batches, bf16 experts against FP8 experts taking bf16 activations (weight-only), quantizing them on
load, or quantized first.
"""
from __future__ import annotations

import argparse
import json
import time

from bench.options import REPO
from bench.stages.linear_sweep import fp8_block


def run_moe(args: argparse.Namespace) -> dict:
    """One Qwen3-30B-A3B MoE layer (fused path) at the decode batches: bf16 experts, and FP8
    experts with each way of taking the activations (moe_kernels.FP8_ACTIVATIONS)."""
    import torch

    from worker_svc.layers import moe_kernels
    from worker_svc.layers.fp8 import quantize_blocks

    config = (dict(num_experts=8, num_experts_per_tok=2, hidden_size=64, moe_intermediate_size=64) if args.tiny
              else json.loads((REPO / "configs" / "qwen3-30b-a3b.json").read_text()))
    experts, top_k = config["num_experts"], config["num_experts_per_tok"]
    hidden, width = config["hidden_size"], config["moe_intermediate_size"]
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    block = fp8_block(min(hidden, width))
    g = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(experts, 2 * width, hidden, generator=g, device=device) * 0.02).to(dtype)
    w2 = (torch.randn(experts, hidden, width, generator=g, device=device) * 0.02).to(dtype)
    (q13, s13), (q2, s2) = quantize_blocks(w13, block), quantize_blocks(w2, block)
    rows = []
    for batch in [int(b) for b in args.decode_batches.split(",")]:
        x = torch.randn(batch, hidden, generator=g, device=device).to(dtype)
        logits = torch.randn(batch, experts, generator=g, device=device).to(dtype)
        runs = {"bf16": lambda x=x, logits=logits: moe_kernels.fused_moe(x, logits, w13, w2, top_k, True)}
        for mode in moe_kernels.FP8_ACTIVATIONS:
            runs[f"fp8 {mode}"] = lambda mode=mode, x=x, logits=logits: moe_kernels.fused_experts(
                x, q13, q2, *moe_kernels.route_topk(logits, top_k, True), w13_scale=s13, w2_scale=s2, block=block,
                fp8_activations=mode)
        row = {"batch": batch, "default_fp8": moe_kernels.default_fp8_activations(batch * top_k, experts)}
        for name, fn in runs.items():
            try:
                row[name] = _time_calls(fn, device)
            except Exception as exc:  # noqa: BLE001 - recorded
                row[name] = None
                row[f"{name} error"] = f"{type(exc).__name__}: {exc}"[:200]
        rows.append(row)
        print(f"   moe batch {batch}: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items()
                                                    if isinstance(v, float)), flush=True)
    return {"experts": experts, "top_k": top_k, "hidden": hidden, "width": width, "rows": rows}


def _time_calls(fn, device) -> float:
    """ms per call: CUDA-graph replays of 10 calls on a GPU, one wall-clock call elsewhere."""
    import torch

    fn()
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 50


def print_moe(moe: dict) -> None:
    names = ["bf16", *(f"fp8 {m}" for m in ("weight_only", "on_load", "given"))]
    print(f"\nMoE layer ({moe['experts']} experts, top-{moe['top_k']}, hidden {moe['hidden']}, width {moe['width']}), "
          "ms per call; default = moe_kernels' choice for FP8")
    print(f"{'batch':>5s} " + " ".join(f"{n:>15s}" for n in names) + "  default   fp8 default vs bf16")
    for r in moe["rows"]:
        default = r.get(f"fp8 {r['default_fp8']}")
        ratio = f"{r['bf16'] / default:6.2f}x" if default and r.get("bf16") else "     -"
        print(f"{r['batch']:5d} " + " ".join(f"{r[n]:15.4f}" if r.get(n) else f"{'-':>15s}" for n in names)
              + f"  {r['default_fp8']:10s} {ratio}")
