"""Compiling Triton kernels ahead of their first launch, many at once.

A start-up that tries dozens of kernel variants (linear_selection) would compile them one after
another, a second or two each. `compile_ahead(calls)` runs the calls with every `launch` turned
into a compile-only request under Triton's async compile mode on a thread pool, so the variants
compile in parallel; the later real launches find them compiled. Kernels launched directly
(kernel[grid](...)) inside compile_ahead still run, after their own compile.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import Callable, Iterable

_COMPILE_ONLY: ContextVar[bool] = ContextVar("triton_compile_only", default=False)


def launch(kernel, grid, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), or, inside compile_ahead, only its compilation (the
    outputs are then left unwritten)."""
    if _COMPILE_ONLY.get():
        kernel.warmup(*args, grid=grid, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


def compile_ahead(calls: Iterable[Callable[[], object]], threads: int | None = None) -> int:
    """Runs each call with launches compiled, not run, the compiles spread over `threads`
    (default: the CPUs); returns how many calls raised (their kernels compile, and fail, again
    at their first real launch)."""
    from triton.runtime._async_compile import AsyncCompileMode

    failures = 0
    with ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool, AsyncCompileMode(pool, ignore_errors=True):
        token = _COMPILE_ONLY.set(True)
        try:
            for call in calls:
                try:
                    call()
                except Exception:  # noqa: BLE001 - reported by the caller's own launch later
                    failures += 1
        finally:
            _COMPILE_ONLY.reset(token)
    return failures
