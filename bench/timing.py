"""Median seconds per call of a function: Triton's do_bench on a GPU (L2 flushed between calls),
a few wall-clock runs on the CPU, where interpreted kernels take seconds each."""
from __future__ import annotations

import statistics
import time


def timer(device: str):
    """A function timing fn() in median seconds: timed(fn, rep=200)."""
    if device.startswith("cuda"):
        import triton.testing

        return lambda fn, rep=200: triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median") * 1e-3

    def cpu_time(fn, rep=0):
        fn()
        times = []
        for _ in range(2):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return cpu_time
