"""Stage `linear`: decode-shaped linear layers on the GPU, bf16 and FP8, against the weight floor.

Part 1 (sweep, linear_sweep.py), per model (configs/qwen3-0.6b.json, qwen3-8b.json; --tp adds
Qwen3-8B's tensor-parallel shards) x projection (qkv, o, gate_up, down with SwiGLU on its input,
lm_head) x rows (1, 4, 16, 64, 256): cuBLAS bf16 (the down projection: SwiGLU kernel + cuBLAS), the
best of a sweep of GEMV launch settings (bf16 weights), the best FP8 weight-only GEMV, the best FP8
x FP8 (Triton with activations quantized on load or first, cuBLAS block-scaled), the weight floor
(weight bytes / measured copy bandwidth), the share of bandwidth of the best bf16 and FP8 paths, and
what the worker's start-up selection (worker_svc/layers/linear_selection.py) picks among its own
candidates, from the same measurements. Each time is a CUDA-graph replay of one call per weight copy
in turn, with enough copies to exceed 4 L2 caches, so weights come from memory as in a model. Every
setting swept is in linear.json, and the table's end lists the GEMV settings that come within 5% of
the best most often, to tune the start-up candidates from one run.

Part 2 (decode, linear_decode.py), Qwen3-8B's config with dummy weights, bf16 and --quantization
fp8: one decode step (forward + LM head, one CUDA graph) at batch 1, 64, 256 over a short context
(the step is then about the weights), with the start-up selection and without it (cuBLAS and the FP8
GEMM with its quantization kernel, as before), and the kernels per decoder layer at batch 1.

Part 3 (moe, linear_moe.py): one Qwen3-30B-A3B MoE layer at the decode batches, bf16 experts against
FP8 experts taking bf16 activations (weight-only), quantizing them on load, or quantized first.

    python -m bench.stages.linear --out DIR                 # one H200: < 3 minutes; DIR/linear.json
    python -m bench.stages.linear --out DIR --device cpu --tiny   # smoke test (Triton interpreter)

On the CPU the Triton kernels run under TRITON_INTERPRET=1, which needs the interpreter fixes of
the tests' triton_interpreter helper to run them as a GPU would; without them their rows record
the interpreter's errors (the harness is what the smoke test is for).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

from bench.stages.linear_decode import print_decode, run_decode
from bench.stages.linear_moe import print_moe, run_moe
from bench.stages.linear_sweep import print_sweep, run_sweep, suggested_configs


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The stage's own flags (bench/gpu_bench.py adds --out, --device and --tiny, as main does)."""
    p.add_argument("--models", default="8b,0.6b", help="swept in this order, then Qwen3-8B's --tp shards")
    p.add_argument("--tp", default="2", help="tensor-parallel sizes of Qwen3-8B's shards swept last (0: none)")
    p.add_argument("--rows", default="1,4,16,64,256")
    p.add_argument("--parts", default="sweep,decode,moe")
    p.add_argument("--decode-batches", default="1,64,256")
    p.add_argument("--decode-context", type=int, default=64)
    p.add_argument("--sweep-budget-s", type=float, default=100.0,
                   help="projections not started by then are skipped (the whole stage stays under 3 minutes)")


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a device-to-device copy, read and write counted (as the floors in PERF_NOTES)."""
    import torch

    size = (1 << 30) if device.startswith("cuda") else (16 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    if device.startswith("cuda"):
        import triton.testing

        seconds = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median") / 1e3
    else:
        start = time.perf_counter()
        dst.copy_(src)
        seconds = time.perf_counter() - start
    return 2 * size / seconds


def run(args: argparse.Namespace) -> dict:
    """Both parts (as --parts says); the result written to OUT/linear.json is returned."""
    import torch

    started = time.perf_counter()
    bandwidth = copy_bandwidth(args.device)
    result = {"device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
              "copy_bytes_per_s": bandwidth}
    parts = args.parts.split(",")
    from worker_svc.layers.pdl_launch import pdl_in_graphs

    result["pdl_in_graphs"] = pdl = pdl_in_graphs(torch.device(args.device))
    if "sweep" in parts:
        result["sweep"] = run_sweep(args, bandwidth, pdl)
        result["suggested"] = suggested_configs(result["sweep"])
    if "decode" in parts:
        result["decode"] = run_decode(args)
    if "moe" in parts:
        with torch.inference_mode():
            result["moe"] = run_moe(args)
    result["wall_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "linear.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def print_report(result: dict) -> None:
    bw = result["copy_bytes_per_s"]
    print(f"\n# {result['device']}: copy {bw / 1e12:.2f} TB/s (read + write); floor = weight bytes / that; "
          f"programmatic dependent launch in graphs: {'yes' if result.get('pdl_in_graphs') else 'no'}")
    if result.get("sweep"):
        print_sweep(result["sweep"], result.get("suggested", {}))
    if result.get("decode"):
        print_decode(result["decode"])
    if result.get("moe"):
        print_moe(result["moe"])
    print(f"\n(stage wall time {result['wall_s']:.0f} s)")


def report(args: argparse.Namespace, results: dict[str, dict]) -> None:
    """The stage's tables, from the record bench/gpu_bench.py wrote."""
    print_report(results["linear"]["result"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True, help="writes OUT/linear.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke test under Triton's interpreter)")
    add_arguments(parser)
    args = parser.parse_args(argv)
    if not args.device.startswith("cuda"):
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before anything imports triton
    print_report(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
