"""Reads a py-spy raw profile (`py-spy record --subprocesses --threads -f raw`) into tables: samples by process
and thread, then each process's functions by inclusive samples (a function counted once a sample however deep it
recurses). With `--gil` samples only the thread holding the interpreter lock is recorded, so a process's samples
over the rate are the time its Python held the lock.

    python -m tools.spy_table spy-gil.raw --rate 1000 [--within 'WorkerServicer|_serve '] [--top 40]
"""
from __future__ import annotations

import argparse
import collections
import re
import sys

PROCESS = re.compile(r'^process (\d+):"(.*)"$', re.DOTALL)
THREAD = re.compile(r"^thread \((\w+)\): ?(.*)$")
COUNTED = re.compile(r"\S \d+$")


def role(cmdline: str) -> str:
    """A short name for a process from its command line."""
    for needle, name in (("worker_svc", "worker"), ("sleep_worker", "worker"), ("scheduler_svc", "scheduler"),
                         ("gpu_bench", "bench"), ("pytest", "pytest")):
        if needle in cmdline:
            return name
    return cmdline.split()[0].rsplit("/", 1)[-1] if cmdline else "?"


def records(lines):
    """Each stack line whole: a command line in a process entry may hold newlines (a `python -c` script)."""
    held = ""
    for line in lines:
        held += line.rstrip("\n")
        if COUNTED.search(held):
            yield held
            held = ""
        else:
            held += "\n"


def parse(lines):
    """(process, thread, frames, count) for each stack line; frames outermost first, without the process and
    thread entries."""
    for line in records(lines):
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        process, thread, frames = "?", "", []
        for frame in stack.split(";"):
            match = PROCESS.match(frame)
            if match:
                process, frames = f"{role(match.group(2))} {match.group(1)}", []   # the innermost process's frames
                continue
            match = THREAD.match(frame)
            if match:
                thread = match.group(2) or match.group(1)
                continue
            frames.append(frame)
        yield process, thread, frames, int(count)


def function(frame: str) -> str:
    """`name (file:line)` -> `name (file)`: a function, whichever of its lines ran."""
    return re.sub(r":\d+\)$", ")", frame)


def tables(lines, rate: float, within: str | None, top: int) -> str:
    by_process: collections.Counter = collections.Counter()
    by_thread: collections.Counter = collections.Counter()
    inclusive: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for process, thread, frames, count in parse(lines):
        if within and not any(within.search(frame) for frame in frames):
            continue
        by_process[process] += count
        by_thread[process, thread] += count
        for name in {function(frame) for frame in frames}:
            inclusive[process][name] += count
    out = [f"samples{' within ' + within.pattern if within else ''}: {sum(by_process.values())} at {rate:g} Hz "
           f"({sum(by_process.values()) / rate:.2f} s)"]
    out.append(f"{'process':28s} {'thread':28s} {'samples':>8s} {'s':>7s}")
    for (process, thread), count in sorted(by_thread.items(), key=lambda kv: (-by_process[kv[0][0]], -kv[1])):
        out.append(f"{process:28.28s} {thread:28.28s} {count:8d} {count / rate:7.3f}")
    for process, total in by_process.most_common():
        out.append(f"\n{process}: {total} samples ({total / rate:.3f} s); functions by inclusive samples")
        for name, count in inclusive[process].most_common(top):
            out.append(f"  {count:8d} {count / total:6.1%}  {name}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw", help="py-spy's raw output (collapsed stacks)")
    p.add_argument("--rate", type=float, default=1000.0, help="py-spy's --rate (samples a second)")
    p.add_argument("--within", type=re.compile,
                   help="only stacks with a frame this regular expression finds (e.g. 'WorkerServicer|_serve ')")
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args(argv)
    with open(args.raw, errors="replace") as lines:
        print(tables(lines, args.rate, args.within, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
