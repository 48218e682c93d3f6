"""The project's Triton kernels compiled for a Hopper GPU (sm_90) on a machine without one.

Triton's interpreter runs the kernels' arithmetic on the CPU (the kernel tests), but not their
compilation: a kernel that the interpreter runs may still fail to compile for the GPU (a plain
module global inside a kernel, a type that only the compiler checks), and a launch argument that
Triton specialises on (an integer equal to 1 or a multiple of 16) makes a new variant compile
while serving. Both were found on a GPU only, each costing a device session (PERF_NOTES v14, v27).

`offline_compiles()` stands in for Triton's launcher: `kernel[grid](...)` binds and specialises
its arguments exactly as a launch does (Triton's own binder, for the CUDA backend and sm_90),
compiles the kernel to a cubin with Triton's LLVM and ptxas, and launches nothing. It records,
per kernel, each distinct specialisation (`Compiled`) and each compile error. The launches come
from the layers' own Python wrappers called on CPU tensors (`catalogue()`), at several row counts
of decode steps, so the test can assert that a step's row count never picks a new variant.

    python -m tools.sm90_compile            # compiles every kernel of the catalogue, prints a table

Must run in a process where Triton was imported without TRITON_INTERPRET (the tests start one).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections import defaultdict
from typing import Callable, Iterator

TARGET_ARCH = 90


@dataclasses.dataclass
class Compiled:
    kernel: str
    key: str           # Triton's cache key of the specialisation (types, alignments, constants, options)
    shared: int        # bytes of shared memory the kernel asks for
    seconds: float


@dataclasses.dataclass
class Record:
    compiled: dict[str, list[Compiled]] = dataclasses.field(default_factory=lambda: defaultdict(list))
    errors: dict[str, str] = dataclasses.field(default_factory=dict)     # kernel -> first compile error
    launches: dict[str, int] = dataclasses.field(default_factory=lambda: defaultdict(int))
    case: str = ""
    cases: dict[str, set[str]] = dataclasses.field(default_factory=lambda: defaultdict(set))   # kernel -> cases


@contextlib.contextmanager
def offline_compiles(arch: int = TARGET_ARCH) -> Iterator[Record]:
    """Within: every Triton launch compiles for sm_<arch> (once per specialisation) and runs nothing."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile, make_backend
    from triton.runtime import jit as triton_jit

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("tools.sm90_compile needs Triton imported without TRITON_INTERPRET=1")
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    record = Record()
    binders: dict[int, Callable] = {}
    seen: dict[tuple[int, str], bool] = {}

    def run(self, *args, grid, warmup, **kwargs):
        name = self.__name__
        record.launches[name] += 1
        record.cases[name].add(record.case)
        kwargs.pop("launch_pdl", None)   # a launch option; the kernel's code is the same
        binder = binders.get(id(self))
        if binder is None:
            binder = binders[id(self)] = triton_jit.create_function_from_signature(self.signature, self.params,
                                                                                    backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        key = str(triton_jit.compute_cache_key({}, specialization, options))
        if (id(self), key) in seen:
            return None
        seen[(id(self), key)] = True
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound_args, specialization, options)
        started = time.perf_counter()
        try:
            kernel = triton_compile(ASTSource(self, signature, constexprs, attrs), target=target,
                                    options=options.__dict__)
        except Exception as exc:  # noqa: BLE001 - recorded: the caller asserts there are none
            record.errors.setdefault(name, f"{type(exc).__name__}: {exc}"[:2000])
            return None
        record.compiled[name].append(Compiled(name, key, kernel.metadata.shared, time.perf_counter() - started))
        return None

    original = triton_jit.JITFunction.run
    triton_jit.JITFunction.run = run
    try:
        yield record
    finally:
        triton_jit.JITFunction.run = original
    del triton


# --- the launches: each layer's wrapper on CPU tensors ---------------------------------------------

DECODE_ROWS = (1, 2, 3, 5, 8, 13, 16, 17, 31, 64, 100, 256)   # a step's row counts (graphs capture some)


def catalogue() -> dict[str, Callable[[], None]]:
    """Named cases, each calling wrappers as the model calls them on a GPU (Qwen3-0.6B / 8B shapes,
    bf16; FP8 weights in 128 x 128 blocks) over DECODE_ROWS."""
    import torch

    bf16 = torch.bfloat16
    cases: dict[str, Callable[[], None]] = {}

    def fused() -> None:
        from worker_svc.layers import fused_kernels as fk
        for rows in DECODE_ROWS:
            for hidden in (1024, 4096):
                x, r = torch.randn(rows, hidden, dtype=bf16), torch.randn(rows, hidden, dtype=bf16)
                w = torch.ones(hidden, dtype=bf16)
                fk.rms_norm(x, w, 1e-6, r)
                fk.rms_norm(x, w, 1e-6)
                fk.rms_norm_fp8(x, w, 1e-6, r, 128)
                fk.rms_norm_fp8(x, w, 1e-6, None, 128)
                gate_up = torch.randn(rows, 2 * 3 * hidden, dtype=bf16)
                fk.silu_and_mul(gate_up)
                fk.silu_and_mul_fp8(gate_up, 128)
    cases["fused"] = fused

    def fp8() -> None:
        from worker_svc.layers import fp8_kernels as f8
        weight = torch.zeros(1024, 4096, dtype=torch.float8_e4m3fn)
        weight_scale = torch.ones(8, 32)
        for rows in DECODE_ROWS:
            x = torch.randn(rows, 4096, dtype=bf16)
            f8.per_token_group_quant(x, 128)
            f8.quantize_activation(x, 128)
            f8.fp8_linear(x, weight, weight_scale, (128, 128))
            f8.fp8_linear(x, weight, weight_scale, (128, 128), quantize_on_load=True)
            f8.fp8_linear(f8.quantize_activation(x, 128), weight, weight_scale, (128, 128))
    cases["fp8"] = fp8

    def gemv() -> None:
        from worker_svc.layers.gemv_kernels import gemv as run_gemv
        from worker_svc.layers.linear_selection import gemv_configs
        weight = torch.randn(1024, 4096, dtype=bf16)
        fp8_weight = weight.to(torch.float8_e4m3fn)
        weight_scale = torch.ones(8, 32)
        for rows in (1, 2, 4, 8, 16, 32, 64):
            for config in gemv_configs(rows, 1024, 4096, sms=132, pdl=True, fp8=True):
                x = torch.randn(rows, 4096, dtype=bf16)
                for n in sorted({rows, max(1, rows - 1)}):   # the bucket's smaller row counts run its config
                    run_gemv(x[:n], weight, config)
                    run_gemv(x[:n], fp8_weight, config, weight_scale=weight_scale, fp8_block=(128, 128))
    cases["gemv"] = gemv
    return cases


def compile_catalogue(names: list[str] | None = None) -> Record:
    """Every case of the catalogue (or those named) through offline_compiles."""
    cases = catalogue()
    with offline_compiles() as record:
        for name, case in cases.items():
            if names and name not in names:
                continue
            record.case = name
            case()
    return record


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or None
    started = time.perf_counter()
    record = compile_catalogue(names)
    print(f"{'kernel':36s} {'launches':>8s} {'variants':>8s} {'shared':>8s} {'compile s':>9s}")
    for name in sorted(set(record.launches)):
        compiled = record.compiled.get(name, [])
        shared = max((c.shared for c in compiled), default=0)
        print(f"{name:36s} {record.launches[name]:8d} {len(compiled):8d} {shared:8d} "
              f"{sum(c.seconds for c in compiled):9.2f}")
    for name, error in record.errors.items():
        print(f"FAILED {name}: {error}")
    print(f"{time.perf_counter() - started:.1f} s")
    return 1 if record.errors else 0


if __name__ == "__main__":
    sys.exit(main())
