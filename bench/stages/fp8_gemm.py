"""Stage fp8_gemm: Qwen3-8B's four projections at the decode batch (--fixed-batch rows): bf16
F.linear against the FP8 path (token-group quantization + block-scaled GEMM), and a few tile shapes
for the GEMM besides fp8_kernels' own choice (the best is reported)."""
from __future__ import annotations

import argparse
import contextlib
import functools
import sys

from bench.floor import FP8_BLOCK
from bench.options import load_config
from bench.timing import timer

GEMM_CONFIGS = [dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=4),
                dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3),
                dict(BLOCK_M=64, BLOCK_N=64, GROUP_M=8, num_warps=4, num_stages=4),
                dict(BLOCK_M=128, BLOCK_N=64, GROUP_M=8, num_warps=4, num_stages=3)]


def run(args: argparse.Namespace) -> dict:
    if args.device == "cpu":
        from tools.triton_interpreter import gpu_faithful
    else:
        gpu_faithful = contextlib.nullcontext
    with gpu_faithful():
        return {"rows": [_row(args, name, cols, width) for name, (cols, width) in _projections(args).items()]}


def _projections(args: argparse.Namespace) -> dict[str, tuple[int, int]]:
    config = load_config(args, "8b")
    h, i, head_dim = config["hidden_size"], config["intermediate_size"], config.get("head_dim", 128)
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i)}


def _row(args: argparse.Namespace, name: str, cols: int, width: int) -> dict:
    import torch
    import torch.nn.functional as F

    from worker_svc.layers import fp8_kernels
    from worker_svc.layers.fp8 import quantize_blocks

    rows_count = 8 if args.tiny else args.fixed_batch
    block = (32, 32) if args.tiny else FP8_BLOCK
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    timed = timer(args.device)
    g = torch.Generator(device=args.device).manual_seed(0)
    weight = torch.randn(cols, width, generator=g, device=args.device).to(dtype) * 0.02
    w8, scale = quantize_blocks(weight, block)
    x = torch.randn(rows_count, width, generator=g, device=args.device).to(dtype)
    x8, x_scale = fp8_kernels.per_token_group_quant(x, block[1])
    sweep = []
    for candidate in GEMM_CONFIGS[:1] if args.tiny else GEMM_CONFIGS:   # interpreted: one is enough
        try:
            gemm = functools.partial(fp8_kernels.block_fp8_matmul, x8, x_scale, w8, scale, block, dtype,
                                     config=candidate)
            sweep.append((timed(gemm), candidate))
        except Exception as exc:   # e.g. out of shared memory: that shape is simply not a candidate
            print(f"{name}: {candidate} failed: {exc}", file=sys.stderr)
    best_s, best = min(sweep, key=lambda c: c[0]) if sweep else (None, None)
    return {"name": name, "rows": rows_count, "cols": cols, "width": width,
            "bf16_s": timed(lambda: F.linear(x, weight)),
            "fp8_s": timed(lambda: fp8_kernels.fp8_linear(x, w8, scale, block)),
            "quant_s": timed(lambda: fp8_kernels.per_token_group_quant(x, block[1])),
            "default_config": fp8_kernels._matmul_config(rows_count), "best_gemm_s": best_s, "best_config": best,
            "bf16_bytes": cols * width * 2, "fp8_bytes": cols * width}


def report(args: argparse.Namespace, results: dict[str, dict]) -> None:
    model = "tiny 8b" if args.tiny else "Qwen3-8B"
    print(f"\n{model} projections at the decode batch: bf16 F.linear vs FP8 (quantize + GEMM), ms")
    print(f"{'proj':8s} {'rows':>5s} {'N x K':>13s} {'bf16':>8s} {'fp8':>8s} {'speedup':>8s} {'quant':>7s} "
          f"{'best gemm':>9s}  best tiles")
    for r in results["fp8_gemm"]["result"]["rows"]:
        best = f"{r['best_gemm_s'] * 1e3:9.3f}  {r['best_config']}" if r["best_gemm_s"] else f"{'-':>9s}"
        print(f"{r['name']:8s} {r['rows']:5d} {r['cols']:>6d}x{r['width']:<6d} {r['bf16_s'] * 1e3:8.3f} "
              f"{r['fp8_s'] * 1e3:8.3f} {r['bf16_s'] / r['fp8_s']:7.2f}x {r['quant_s'] * 1e3:7.3f} {best}")


if __name__ == "__main__":
    from bench.gpu_bench import run_alone

    sys.exit(run_alone(__spec__.name, sys.argv[1:]))
