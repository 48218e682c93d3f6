"""The project's Triton kernels compiled for a Hopper GPU (sm_90) on a machine without one.

Triton's interpreter runs the kernels' arithmetic on the CPU (the kernel tests), but not their
compilation: a kernel that the interpreter runs may still fail to compile for the GPU (a plain
module global inside a kernel, a type that only the compiler checks), and a launch argument that
Triton specialises on (an integer equal to 1 or a multiple of 16) makes a new variant compile
while serving; and a tile may ask more shared memory than a block has, which only the launch
refuses. Each was found on a GPU only, at the cost of device time (PERF_NOTES v14, v27, v28).

`offline_compiles()` stands in for Triton's launcher: `kernel[grid](...)` binds and specialises
its arguments exactly as a launch does (Triton's own binder, for the CUDA backend and sm_90),
compiles the kernel to a cubin with Triton's LLVM and ptxas, and launches nothing. It records,
per kernel, each distinct specialisation (`Compiled`) and each compile error. The launches come
from the layers' own Python wrappers called on CPU tensors (tools/sm90_catalogue.py), at several row counts
of decode steps, so the test can assert that a step's row count never picks a new variant.

    python -m tools.sm90_compile            # compiles every kernel of the catalogue, prints a table
    python -m tools.sm90_compile sampling_eager_rows   # named cases only (extended ones too)
    python -m tools.sm90_compile fp8 --loops _block_fp8_matmul_kernel   # and each variant's main loop

`--loops KERNEL` prints, for each compiled variant of KERNEL, the instructions of its longest loop
(cuobjdump's SASS: a backward branch's body) by opcode: what a loop iteration issues, to weigh
against the bytes it reads (PERF_NOTES v41 found the few-row FP8 GEMM converting every element so).

Must run in a process where Triton was imported without TRITON_INTERPRET (the tests start one).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import tempfile
import sys
import time
from collections import defaultdict
from typing import Callable, Iterator

from tools.sm90_catalogue import catalogue

TARGET_ARCH = 90
# Shared memory one block may use on an H100 / H200 (227 KiB): Triton compiles past it, and the launch
# then fails (OutOfResources). A variant over it is a compile error here.
SHARED_LIMIT = 232_448


@dataclasses.dataclass
class Compiled:
    kernel: str
    key: str           # Triton's cache key of the specialisation (types, alignments, constants, options)
    shared: int        # bytes of shared memory the kernel asks for
    seconds: float
    design: tuple      # what the caller chose: the constants' values and the launch options
    argument_specs: dict[str, str]   # each other argument's specialisation: type, alignment, "equals 1"
    registers: int = 0     # per thread (cuobjdump's resource usage; 0 where it could not run)
    stack: int = 0         # bytes of stack per thread: registers spilled to local memory, most often
    loop: "Loop | None" = None   # the longest loop's instructions, for the kernels asked (--loops)


@dataclasses.dataclass
class Loop:
    """A loop of a kernel's SASS: the body of a backward branch (addresses in bytes)."""
    start: int
    end: int
    ops: collections.Counter   # opcode (its first part: "F2FP" of "F2FP.F16.E4M3.UNPACK_B") -> count

    @property
    def length(self) -> int:
        return sum(self.ops.values())

    def summary(self, top: int = 12) -> str:
        return f"{self.length} instructions: " + ", ".join(f"{op} {n}" for op, n in self.ops.most_common(top))


_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")


def sass_loops(sass: str) -> list[Loop]:
    """The loops of a kernel's SASS text (cuobjdump -sass), longest first: each branch to an earlier
    address closes a loop from its target to itself."""
    instructions = []
    for line in sass.splitlines():
        found = _SASS_LINE.match(line)
        if found:
            text = re.sub(r"^@!?U?P\w+\s+", "", found.group(2).strip())   # the predicate guarding it
            instructions.append((int(found.group(1), 16), text))
    loops = []
    for address, text in instructions:
        target = re.match(r"BRA(?:\.\w+)*\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            ops = collections.Counter(t.split()[0].split(".")[0] for a, t in instructions if start <= a <= address)
            loops.append(Loop(start, address, ops))
    return sorted(loops, key=lambda loop: -loop.length)


@dataclasses.dataclass
class Record:
    compiled: dict[str, list[Compiled]] = dataclasses.field(default_factory=lambda: defaultdict(list))
    errors: dict[str, str] = dataclasses.field(default_factory=dict)     # kernel -> first compile error
    launches: dict[str, int] = dataclasses.field(default_factory=lambda: defaultdict(int))

    def varying_arguments(self) -> dict[str, list[str]]:
        """Per kernel, the arguments whose specialisation alone made a second variant: variants of
        one design (the same constants and options) that differ in a runtime argument's type,
        alignment or "equals 1". Each is a compile that a step of another size (row count, offset
        into a buffer) starts while serving."""
        found: dict[str, set[str]] = defaultdict(set)
        for name, variants in self.compiled.items():
            by_design: dict[tuple, list[Compiled]] = defaultdict(list)
            for variant in variants:
                by_design[variant.design].append(variant)
            for group in by_design.values():
                for other in group[1:]:
                    found[name] |= {arg for arg, spec in other.argument_specs.items()
                                    if spec != group[0].argument_specs.get(arg)}
        return {name: sorted(args) for name, args in found.items() if args}


@contextlib.contextmanager
def offline_compiles(arch: int = TARGET_ARCH, loops_of: frozenset[str] = frozenset()) -> Iterator[Record]:
    """Within: every Triton launch compiles for sm_<arch> (once per specialisation) and runs nothing;
    the variants of the kernels named in loops_of also keep their longest loop (Compiled.loop)."""
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
        constants = {self.params[k[0]].name: v for k, v in constexprs.items() if self.params[k[0]].is_constexpr}
        design = (tuple(sorted((k, repr(v)) for k, v in constants.items())), repr(sorted(options.__dict__.items())))
        argument_specs = {param.name: repr(spec) for param, spec in zip(self.params, specialization)
                          if not param.is_constexpr}
        registers, stack = _resource_usage(kernel.asm["cubin"])
        loops = sass_loops(_cuobjdump(kernel.asm["cubin"], "-sass")) if name in loops_of else []
        record.compiled[name].append(Compiled(name, key, kernel.metadata.shared, time.perf_counter() - started,
                                              design, argument_specs, registers, stack, loops[0] if loops else None))
        if kernel.metadata.shared > SHARED_LIMIT:
            record.errors.setdefault(name, f"{kernel.metadata.shared} bytes of shared memory, over sm_{arch}'s "
                                           f"{SHARED_LIMIT} a block: the launch would fail "
                                           f"({', '.join(f'{k}={v}' for k, v in constants.items())})")
        return None

    original = triton_jit.JITFunction.run
    triton_jit.JITFunction.run = run
    try:
        yield record
    finally:
        triton_jit.JITFunction.run = original


def _cuobjdump(cubin: bytes, option: str) -> str:
    """What Triton's bundled cuobjdump prints of a cubin with `option` ("" where it could not run)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        cuobjdump = pathlib.Path(get_ptxas(TARGET_ARCH).path).with_name("cuobjdump")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            return subprocess.run([str(cuobjdump), option, f.name], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError, ImportError, TypeError):
        return ""


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) per thread of a cubin's kernel."""
    found = re.search(r"REG:(\d+) STACK:(\d+)", _cuobjdump(cubin, "--dump-resource-usage"))
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def compile_catalogue(names: list[str] | None = None, loops_of: frozenset[str] = frozenset()) -> Record:
    """Every case of the catalogue but the extended ones (or those named, extended ones included)
    through offline_compiles."""
    cases = catalogue(extended=bool(names))
    with offline_compiles(loops_of=loops_of) as record:
        for name, case in cases.items():
            if names and name not in names:
                continue
            case()
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", help="cases of the catalogue (default: all but the extended ones)")
    parser.add_argument("--json", type=pathlib.Path, help="also write the compile errors and varying arguments here")
    parser.add_argument("--loops", action="append", default=[], metavar="KERNEL",
                        help="print each variant's longest loop by opcode (repeatable)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    record = compile_catalogue(args.cases or None, frozenset(args.loops))
    varying = record.varying_arguments()
    print(f"{'kernel':36s} {'launches':>8s} {'variants':>8s} {'shared':>8s} {'regs':>5s} {'spilled':>7s} "
          f"{'compile s':>9s}")
    for name in sorted(set(record.launches)):
        compiled = record.compiled.get(name, [])
        shared = max((c.shared for c in compiled), default=0)
        registers = max((c.registers for c in compiled), default=0)
        spilled = sum(c.stack > 0 for c in compiled)   # variants using stack: spills, as a rule
        print(f"{name:36s} {record.launches[name]:8d} {len(compiled):8d} {shared:8d} {registers:5d} "
              f"{spilled:7d} {sum(c.seconds for c in compiled):9.2f}")
    for name in args.loops:
        for variant in record.compiled.get(name, []):
            constants = ", ".join(f"{k}={v}" for k, v in variant.design[0] if not k.startswith("stride"))
            print(f"LOOP {name} [{constants}] regs {variant.registers}: "
                  f"{variant.loop.summary() if variant.loop else 'no loop found'}")
    for name, error in record.errors.items():
        print(f"FAILED {name}: {error}")
    for name, arguments in varying.items():
        print(f"VARIANTS {name}: a new compile for each specialisation of {', '.join(arguments)}")
    print(f"{time.perf_counter() - started:.1f} s")
    if args.json:
        args.json.write_text(json.dumps({"errors": record.errors, "varying": varying,
                                         "kernels": {name: len(record.compiled.get(name, []))
                                                     for name in record.launches}}, indent=1))
    return 1 if record.errors or varying else 0


if __name__ == "__main__":
    sys.exit(main())
