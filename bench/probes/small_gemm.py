"""Probe: cuBLAS against a plain Triton GEMM on the decode steps' projections at 64-512 rows (PERF_NOTES v56).

At 128-256 rows the start-up selection keeps cuBLAS for Qwen3-0.6B's projections, and its runner-up (the GEMV
kernel's tensor-core loop as a tiled GEMM) is 2.4x slower on down (PERF_NOTES v56's selection log); cuBLAS itself
runs o and down at 150-170 TFLOP/s there (16 output tiles of 128 x 128 for 132 SMs). Whether a plain Triton
GEMM (grouped tile order, K pipelined, split over K with float32 atomics into a zeroed buffer, then one cast)
beats cuBLAS on these shapes says whether a new candidate is worth building. Beside them, F.linear through
cuBLASLt (torch.backends.cuda.preferred_blas_library): if it wins, no kernel of ours is needed. (PyTorch's
TunableOp would time other algorithms only on ROCm: on CUDA its GEMM has the default alone.) Each method is
timed as CUDA-graph replays of 16 calls over 8 copies of the weight (past L2), the split's memset and cast
included.

    python3 -m bench.probes.small_gemm [--rows 64,128,256,512] [--models 0.6b,8b]
    python3 -m bench.probes.small_gemm --check    # without CUDA: the kernel against F.linear, interpreted
"""
from __future__ import annotations

import argparse
import itertools
import sys

from tools.triton_interpreter import gpu_faithful   # before triton: without CUDA, Triton's interpreter

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from worker_svc.layers.fp8_kernels import grouped_tile  # noqa: E402

SHAPES = {"0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)},
          "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}}
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
TILES = ((64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (64, 64, 128, 4, 3))
SPLITS = (1, 2, 4, 8)
COPIES = 8
CALLS = 16


@triton.jit
def _matmul_kernel(a_ptr, w_ptr, c_ptr, M, N, K, k_per_split, stride_am, stride_wn, stride_cm,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   SPLIT_K: tl.constexpr):
    """c = a @ w^T for a [M, K], w [N, K]; with SPLIT_K > 1 c is a zeroed float32 buffer each slice of K
    adds its partial product to."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = tl.program_id(1) * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    offs_k = k_begin + tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_begin, k_end, BLOCK_K):
        a = tl.load(a_ptrs, mask=(offs_m < M)[:, None] & (offs_k < k_end - k + k_begin)[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=(offs_n < N)[None, :] & (offs_k < k_end - k + k_begin)[:, None], other=0.0)
        acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT_K == 1:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(c_ptrs, acc, mask=mask, sem="relaxed")


def triton_linear(x: torch.Tensor, w: torch.Tensor, tile: tuple, split: int) -> torch.Tensor:
    """x @ w^T by _matmul_kernel (split over K into a float32 buffer, then cast, when split > 1)."""
    block_m, block_n, block_k, warps, stages = tile
    m, k = x.shape
    n = w.shape[0]
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), split) * block_k
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if split == 1 else \
        torch.zeros(m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n), triton.cdiv(k, k_per_split))
    _matmul_kernel[grid](x, w, out, m, n, k, k_per_split, x.stride(0), w.stride(0), out.stride(0),
                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, SPLIT_K=split,
                         num_warps=warps, num_stages=stages)
    return out if split == 1 else out.to(x.dtype)


def _graph_us(fn, weights, x) -> float:
    """Microseconds a call: CALLS calls in a CUDA graph over the weights in turn, replayed."""
    for w in weights[:2]:
        fn(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            fn(x, weights[i % len(weights)])
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return sorted(times)[len(times) // 2]


def _lt_us(weights, x) -> float:
    """F.linear's microseconds a call through cuBLASLt; nan where this torch or device refuses."""
    default = torch.backends.cuda.preferred_blas_library()
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        return _graph_us(lambda a, w: F.linear(a, w), weights, x)
    except Exception as exc:   # noqa: BLE001 - a probe: say it and go on
        print(f"  cuBLASLt: {type(exc).__name__}: {exc}")
        return float("nan")
    finally:
        torch.backends.cuda.preferred_blas_library(default)


def measure(models: list[str], rows_list: list[int]) -> None:
    torch.manual_seed(0)
    print(f"{'shape':>22} {'rows':>5} {'cuBLAS us':>9} {'TF/s':>5} {'Lt us':>6} {'triton us':>9} {'TF/s':>5} "
          f"{'ratio':>5}  best tile (m n k warps stages) split")
    for model in models:
        for name, (n, k) in SHAPES[model].items():
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(COPIES)]
            for rows in rows_list:
                x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                flops = 2 * rows * n * k
                cublas = _graph_us(lambda a, w: F.linear(a, w), weights, x)
                lt = _lt_us(weights, x)
                best = (float("inf"), None)
                reference = F.linear(x, weights[0]).float()
                for tile, split in itertools.product(TILES, SPLITS):
                    if triton.cdiv(k, tile[2] * split) < 2:   # each slice at least two K tiles
                        continue
                    try:
                        got = triton_linear(x, weights[0], tile, split).float()
                        err = (got - reference).abs().max().item() / reference.abs().max().item()
                        if err > 2e-2:
                            print(f"  {model} {name} {rows} {tile} split{split}: wrong (relative error {err:.3g})")
                            continue
                        us = _graph_us(lambda a, w, t=tile, s=split: triton_linear(a, w, t, s), weights, x)
                    except Exception as exc:   # a config the device cannot run (shared memory): skipped, said
                        print(f"  {model} {name} {rows} {tile} split{split}: {type(exc).__name__}")
                        continue
                    best = min(best, (us, (tile, split)), key=lambda b: b[0])
                us, (tile, split) = best
                print(f"{model + ' ' + name + f' {n}x{k}':>22} {rows:5d} {cublas:9.2f} {flops / cublas / 1e6:5.0f} "
                      f"{lt:6.2f} {us:9.2f} {flops / us / 1e6:5.0f} {cublas / us:5.2f}  {tile} split{split}",
                      flush=True)


def check() -> None:
    """The kernel against F.linear on small shapes, every tile shape class and split (CPU interpreter)."""
    torch.manual_seed(0)
    for (m, n, k), split in itertools.product(((5, 48, 96), (33, 80, 160)), (1, 2, 3)):
        x = torch.randn(m, k)
        w = torch.randn(n, k)
        got = triton_linear(x, w, (16, 32, 32, 4, 1), split)
        torch.testing.assert_close(got, F.linear(x, w), rtol=1e-4, atol=1e-4)
    print("small_gemm: the kernel matches F.linear (splits 1-3, ragged M, N and K)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="64,128,256,512")
    p.add_argument("--models", default="0.6b,8b")
    p.add_argument("--check", action="store_true")
    args = p.parse_args(argv)
    if args.check:
        with gpu_faithful():
            check()
    else:
        measure(args.models.split(","), [int(r) for r in args.rows.split(",")])


if __name__ == "__main__":
    sys.exit(main())
