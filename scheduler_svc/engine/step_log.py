"""A line per applied step (`--step-log PATH`), for finding where a run's time goes: how long each
step took from the previous reply (the rate the engine core saw), the worker's device time for it,
and what it held. bench/stages/service.py reads it back (`summarize`) to split a run's wall time
into decode-only and mixed (prefill) steps by batch size, and the device's idle time between them.

Off by default. A buffered append, no flush per step: the file is complete once the engine core
shuts down (its last lines may be lost if the process is killed)."""
from __future__ import annotations

import io
import pathlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from scheduler_svc.engine.scheduler_output import SchedulerOutput

# kv_tokens: the KV the step's attention reads, every sequence's context through this step's tokens.
FIELDS = ("group", "reply_s", "step_ms", "device_ms", "launch_ms", "seqs", "sampled", "tokens", "kv_tokens",
          "in_flight")
# The batch sizes (sequences in a step) the summary groups steps by.
BATCH_BUCKETS = (1, 4, 16, 64, 128, 256, 512)


class StepLog:
    def __init__(self, path: str | pathlib.Path) -> None:
        self.path = pathlib.Path(path)
        new = not self.path.exists() or self.path.stat().st_size == 0
        self._file: io.TextIOBase | None = self.path.open("a", buffering=1 << 16)
        if new:
            self._file.write("\t".join(FIELDS) + "\n")

    def record(self, group: int, reply_s: float, step_ms: float, device_ms: float, launch_ms: float,
               output: "SchedulerOutput", in_flight: int) -> None:
        if self._file is None:
            return
        kv_tokens = sum(output.num_computed) + output.num_scheduled_tokens
        self._file.write(f"{group}\t{reply_s:.6f}\t{step_ms:.4f}\t{device_ms:.4f}\t{launch_ms:.4f}\t{len(output.seqs)}"
                         f"\t{len(output.sampling_seqs)}\t{output.num_scheduled_tokens}\t{kv_tokens}\t{in_flight}\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# floor_ms(seqs, sampled, tokens, kv_tokens): a step's floor, in ms (bench/stages/service.py's, from
# the model's shape and the measured rates).
FloorFn = Callable[[int, int, int, int], float]


@dataclass
class StepKind:
    """The steps of one kind and batch bucket: their count and summed times."""
    steps: int = 0
    step_ms: float = 0.0
    device_ms: float = 0.0
    floor_ms: float = 0.0
    tokens: int = 0

    def add(self, step_ms: float, device_ms: float, floor_ms: float, tokens: int) -> None:
        self.steps += 1
        self.step_ms += step_ms
        self.device_ms += device_ms
        self.floor_ms += floor_ms
        self.tokens += tokens

    def as_dict(self) -> dict:
        return dict(steps=self.steps, step_ms=round(self.step_ms, 3), device_ms=round(self.device_ms, 3),
                    floor_ms=round(self.floor_ms, 3), tokens=self.tokens)


def bucket(rows: int) -> str:
    """The smallest of BATCH_BUCKETS that holds `rows`, as a label ("<=16"), or ">512"."""
    for most in BATCH_BUCKETS:
        if rows <= most:
            return f"<={most}"
    return f">{BATCH_BUCKETS[-1]}"


def summarize(path: str | pathlib.Path, start_s: float = float("-inf"), end_s: float = float("inf"),
              floor_ms: FloorFn | None = None) -> dict:
    """A step log's totals over the steps replied between start_s and end_s (time.perf_counter,
    CLOCK_MONOTONIC: one clock for every process of a machine): the span from the first step's
    start to the last reply, the summed step and device times (step minus device: time the device
    did not spend on this group's steps, as the engine core saw it), and the same by kind (decode:
    one token a sequence; mixed: prefill chunks too) and batch bucket; with floor_ms, each step's
    floor summed alike. Lines of a half-written tail are skipped."""
    kinds: dict[str, StepKind] = {}
    total = StepKind()
    first = last = None
    with open(path) as f:
        header = f.readline().rstrip("\n").split("\t")
        for line in f:
            values = line.rstrip("\n").split("\t")
            if len(values) != len(header):
                continue
            row = dict(zip(header, values))
            reply_s, step_ms, device_ms = float(row["reply_s"]), float(row["step_ms"]), float(row["device_ms"])
            if not start_s <= reply_s <= end_s:
                continue
            seqs, tokens = int(row["seqs"]), int(row["tokens"])
            floor = floor_ms(seqs, int(row["sampled"]), tokens, int(row["kv_tokens"])) if floor_ms else 0.0
            first = reply_s - step_ms / 1e3 if first is None else first
            last = reply_s
            # A step whose scheduled tokens equal its sequences computes one token each: a pure decode.
            kind = f"{'decode' if tokens == seqs else 'mixed'} {bucket(seqs)}"
            kinds.setdefault(kind, StepKind()).add(step_ms, device_ms, floor, tokens)
            total.add(step_ms, device_ms, floor, tokens)
    order = {f"{k} {bucket(n)}": i for i, (k, n) in enumerate((k, n) for k in ("decode", "mixed")
                                                              for n in (*BATCH_BUCKETS, BATCH_BUCKETS[-1] + 1))}
    return dict(span_s=round((last - first), 4) if first is not None else 0.0, **total.as_dict(),
                kinds={k: kinds[k].as_dict() for k in sorted(kinds, key=lambda k: order.get(k, len(order)))})


def report_lines(summary: dict) -> list[str]:
    """The summary as a table: per kind, steps, ms a step, device ms a step, the floor a step and
    device / floor (when the summary has floors), and the kind's share of the run and of its
    distance to the floor (device time over the floor)."""
    span_ms = summary["span_s"] * 1e3 or float("nan")
    floors = summary.get("floor_ms", 0.0) > 0
    over_ms = (summary["device_ms"] - summary["floor_ms"]) if floors else float("nan")
    head = (f"steps from the engine core's step log: {summary['steps']} in {summary['span_s']:.3f} s, "
            f"device {summary['device_ms'] / 1e3:.3f} s ({summary['device_ms'] / span_ms:.1%} of the span)")
    if floors:
        head += f", floor {summary['floor_ms'] / 1e3:.3f} s (device over it: {over_ms / 1e3:.3f} s)"
    lines = [head, f"  {'kind':14s} {'steps':>6s} {'ms/step':>8s} {'dev/step':>8s} {'step-dev':>8s} {'tok/step':>8s} "
                   f"{'of span':>7s}" + (f" {'floor':>8s} {'dev/floor':>9s} {'of over':>7s}" if floors else "")]
    for kind, k in summary["kinds"].items():
        n = k["steps"] or 1
        line = (f"  {kind:14s} {k['steps']:6d} {k['step_ms'] / n:8.3f} {k['device_ms'] / n:8.3f} "
                f"{(k['step_ms'] - k['device_ms']) / n:8.3f} {k['tokens'] / n:8.1f} {k['step_ms'] / span_ms:7.1%}")
        if floors:
            line += (f" {k['floor_ms'] / n:8.3f} {k['device_ms'] / (k['floor_ms'] or float('nan')):9.2f} "
                     f"{(k['device_ms'] - k['floor_ms']) / (over_ms or float('nan')):7.1%}")
        lines.append(line)
    return lines
