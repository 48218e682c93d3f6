"""Stage bandwidth: the device's copy bandwidth (read + write bytes of a 2 GiB device copy per
second), and its bf16 and FP8 matmul rates (8192^3 on random data): the rates of every floor."""
from __future__ import annotations

import argparse
import functools
import sys

from bench.timing import timer

COPY_BYTES = {"cuda": 2 << 30, "cpu": 64 << 20}
MATMUL_N = {"cuda": 8192, "cpu": 512}


def run(args: argparse.Namespace) -> dict:
    import torch

    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    timed = timer(args.device)
    copy_bytes_per_s = _copy_bytes_per_s(args.device, COPY_BYTES[kind], timed)
    n = MATMUL_N[kind]
    dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=args.device).to(dtype) for _ in range(2))
    bf16_rate = 2 * n ** 3 / timed(lambda: a @ b, rep=500)
    fp8_rate, fp8_how = _fp8_rate(a, b, timed, bf16_rate) if kind == "cuda" else (2 * bf16_rate, "assumed 2x bf16")
    return {"device": torch.cuda.get_device_name() if kind == "cuda" else "cpu",
            "copy_bytes_per_s": copy_bytes_per_s, "bf16_flops_per_s": bf16_rate, "fp8_flops_per_s": fp8_rate,
            "fp8_rate_from": fp8_how}


def _copy_bytes_per_s(device: str, size: int, timed) -> float:
    import torch

    src = torch.empty(size, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    return 2 * size / timed(functools.partial(dst.copy_, src), rep=400)


def _fp8_rate(a, b, timed, bf16_rate: float) -> tuple[float, str]:
    """cuBLAS FP8 with per-tensor scales: the hardware's FP8 rate (else twice bf16's, said so)."""
    import torch

    n = a.shape[0]
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
        one = torch.ones((), device=a.device)
        return 2 * n ** 3 / timed(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)), \
            "torch._scaled_mm"
    except Exception as exc:  # recorded: the FP8 floor then assumes twice the bf16 rate
        return 2 * bf16_rate, f"assumed 2x bf16 ({type(exc).__name__}: {exc})"[:200]


def report(args: argparse.Namespace, results: dict[str, dict]) -> None:
    rates = results["bandwidth"]["result"]
    print(f"# {rates['device']}: copy {rates['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write), matmul "
          f"bf16 {rates['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s, fp8 {rates['fp8_flops_per_s'] / 1e12:.0f} "
          f"TFLOP/s ({rates['fp8_rate_from']})")


if __name__ == "__main__":
    from bench.gpu_bench import run_alone

    sys.exit(run_alone(__spec__.name, sys.argv[1:]))
