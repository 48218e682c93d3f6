"""Where the device waited, from a worker's Chrome trace (WORKER_PROFILE_TRACE_STEPS, worker_svc/step_profile.py).

    python -m tools.trace_gaps worker-trace-...json[.gz] [--gap-us 20] [--top 15]

Prints two tables. Each labelled step launch: its host time, how much of it was inside ops and CUDA calls
(the rest is Python between them), how long the worker's other threads worked meanwhile (inside Python
functions and ops, less their waits and long untraced stretches: with stacks, time the launching thread may
have waited for the interpreter lock), the kernels it launched, the device's span
for them and how much of that span the device was busy, and the median time from a kernel's launch call
to its start (large: the host runs ahead of the device; near zero: the device waits for the host). Then
the device's longest idle gaps, each with what every host thread was inside when it began (its innermost
event: an op, a CUDA runtime call, a Python function when traced with stacks)."""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import statistics
from dataclasses import dataclass, field

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
# Everything else with a duration is the host's (ops, annotations, CUDA runtime and driver calls, Python
# functions, the collector's runs, synchronizations where the window asked for them), but these.
NOT_HOST_CATS = {"gpu_user_annotation", "ac2g", "Trace"}
OP_CATS = {"cpu_op", "cuda_runtime", "cuda_driver"}   # a launch's time in these is not its Python's
LAUNCH = re.compile(r"launch step (\d+) (\w+) (\d+) tokens")
# A thread's innermost events that are waits, not work (a lock, a queue, a condition, the poller, an event).
WAITS = re.compile(r"acquire|wait|sleep|select|poll|get of _queue|Synchronize|Sync\b|result")


@dataclass
class Span:
    name: str
    cat: str
    start: float      # us
    end: float
    tid: object = 0
    correlation: int | None = None


@dataclass
class StepLaunch:
    step: int
    kind: str
    tokens: int
    span: Span
    kernels: list[Span] = field(default_factory=list)
    lags: list[float] = field(default_factory=list)


def load(path: str) -> list[Span]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)
    events = events.get("traceEvents", []) if isinstance(events, dict) else events
    spans = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") in NOT_HOST_CATS or "cat" not in e:
            continue
        start = float(e["ts"])
        corr = (e.get("args") or {}).get("correlation")
        spans.append(Span(e.get("name", ""), e["cat"], start, start + float(e.get("dur", 0)), e.get("tid", 0), corr))
    return sorted(spans, key=lambda s: s.start)


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping (start, end) intervals merged into disjoint ones, in order."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def busy_intervals(kernels: list[Span]) -> list[tuple[float, float]]:
    """The device's busy time as disjoint intervals (kernels of several streams merged)."""
    return merged([(k.start, k.end) for k in kernels])


def busy_within(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in intervals)


def gaps(intervals: list[tuple[float, float]], min_us: float) -> list[tuple[float, float]]:
    return [(a_end, b_start) for (_, a_end), (b_start, _) in zip(intervals, intervals[1:])
            if b_start - a_end >= min_us]


def step_launches(spans: list[Span]) -> list[StepLaunch]:
    """Each labelled launch with the kernels whose launch call ran inside it."""
    launches = []
    for s in spans:
        m = LAUNCH.fullmatch(s.name) if s.cat == "user_annotation" else None
        if m:
            launches.append(StepLaunch(int(m.group(1)), m.group(2), int(m.group(3)), s))
    by_corr = {s.correlation: s for s in spans if s.cat in DEVICE_CATS and s.correlation is not None}
    calls = [s for s in spans if s.cat in ("cuda_runtime", "cuda_driver") and s.correlation in by_corr]
    starts = [c.start for c in calls]
    for launch in launches:
        lo = bisect.bisect_left(starts, launch.span.start)
        hi = bisect.bisect_right(starts, launch.span.end)
        for call in calls[lo:hi]:
            if call.tid != launch.span.tid:
                continue
            kernel = by_corr[call.correlation]
            launch.kernels.append(kernel)
            launch.lags.append(kernel.start - call.start)
    return launches


def in_ops_us(thread_ops: list[Span], span: Span) -> float:
    """How much of `span` its thread spent inside ops or CUDA calls (the rest: Python between them)."""
    inside = [(max(o.start, span.start), min(o.end, span.end)) for o in thread_ops
              if o.end > span.start and o.start < span.end]
    return sum(b - a for a, b in merged(inside))


def working_intervals(spans: list[Span], blocked_us: float = 200.0) -> dict[object, list[tuple[float, float]]]:
    """Each host thread's working time as disjoint intervals: the stretches where its innermost open Python
    function or op is not a wait (a lock, a queue, a condition, the poller, an event), less those longer
    than blocked_us inside a function that calls others (there it sits in code the tracer does not see:
    a C call that blocks)."""
    by_tid: dict[object, list[Span]] = {}
    for s in spans:
        if s.cat in ("python_function", "cpu_op"):
            by_tid.setdefault(s.tid, []).append(s)
    out = {}
    for tid, events in by_tid.items():
        events.sort(key=lambda s: (s.start, -s.end))
        parents = {id(s) for s, after in zip(events, events[1:]) if after.start < s.end}
        bounds = sorted({t for s in events for t in (s.start, s.end)})
        working, stack, i = [], [], 0
        for a, b in zip(bounds, bounds[1:]):
            while i < len(events) and events[i].start <= a:
                stack.append(events[i])
                i += 1
            while stack and stack[-1].end <= a:
                stack.pop()
            open_ = [s for s in stack if s.end > a]   # an event that ended under a later-starting one
            if not open_:
                continue
            inner = open_[-1]
            if WAITS.search(inner.name) or (id(inner) in parents and b - a > blocked_us):
                continue
            working.append((a, b))
        out[tid] = merged(working)
    return out


def innermost(spans_by_tid: dict[object, list[Span]], starts_by_tid: dict[object, list[float]],
              t: float) -> dict[object, Span | None]:
    """For each host thread (its spans in start order, and their starts), the innermost (latest-starting)
    event open at time t."""
    out = {}
    for tid, spans in spans_by_tid.items():
        best = None
        i = bisect.bisect_right(starts_by_tid[tid], t)
        for s in reversed(spans[max(0, i - 400):i]):
            if s.end > t and (best is None or s.start > best.start):
                best = s
        out[tid] = best
    return out


def report(path: str, gap_us: float = 20.0, top: int = 15) -> str:
    spans = load(path)
    device = [s for s in spans if s.cat in DEVICE_CATS]
    host = [s for s in spans if s.cat not in DEVICE_CATS]
    intervals = busy_intervals(device)
    lines = []
    if intervals:
        t0 = intervals[0][0]
        total = intervals[-1][1] - t0
        busy = busy_within(intervals, t0, intervals[-1][1])
        lines.append(f"device: {len(device)} kernels/copies over {total / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms "
                     f"({100 * busy / total:.1f}%)")
    else:
        lines.append("no device activity in the trace (a CPU worker): the launches alone")
    lines.append("step  kind   tokens  launch ms  in ops ms  others ms  kernels  device span ms  busy %  lag p50 ms"
                 "  lag min ms")
    op_spans: dict[object, list[Span]] = {}
    for s in spans:
        if s.cat in OP_CATS:
            op_spans.setdefault(s.tid, []).append(s)
    working = working_intervals(host)
    others_of: dict[object, list[tuple[float, float]]] = {}   # a launching thread -> the others' work, merged once
    for launch in step_launches(spans):
        if launch.kernels:
            first = min(k.start for k in launch.kernels)
            last = max(k.end for k in launch.kernels)
            span_us = last - first
            busy_pct = 100 * busy_within(intervals, first, last) / span_us if span_us else 100.0
            lag50, lagmin = statistics.median(launch.lags) / 1e3, min(launch.lags) / 1e3
        else:
            span_us, busy_pct, lag50, lagmin = 0.0, 0.0, float("nan"), float("nan")
        in_ops = in_ops_us(op_spans.get(launch.span.tid, []), launch.span)
        tid = launch.span.tid
        if tid not in others_of:
            others_of[tid] = merged([iv for other, ivs in working.items() if other != tid for iv in ivs])
        others = busy_within(others_of[tid], launch.span.start, launch.span.end)
        lines.append(f"{launch.step:5d} {launch.kind:6} {launch.tokens:6d} {(launch.span.end - launch.span.start) / 1e3:10.2f}"
                     f" {in_ops / 1e3:10.2f} {others / 1e3:10.2f} {len(launch.kernels):8d} {span_us / 1e3:15.2f}"
                     f" {busy_pct:7.1f} {lag50:11.3f} {lagmin:11.3f}")
    if not intervals:
        return "\n".join(lines)
    by_tid: dict[object, list[Span]] = {}
    for s in host:
        by_tid.setdefault(s.tid, []).append(s)
    starts_by_tid = {tid: [s.start for s in spans] for tid, spans in by_tid.items()}
    all_gaps = gaps(intervals, gap_us)
    idle = sorted(all_gaps, key=lambda g: g[0] - g[1])[:top]
    lines.append(f"device idle: {(total - busy) / 1e3:.2f} ms in all; the {len(idle)} longest gaps "
                 f"(of {len(all_gaps)} >= {gap_us:g} us), host threads' innermost event at each start:")
    for a, b in idle:
        lines.append(f"  +{(a - t0) / 1e3:9.3f} ms  idle {(b - a) / 1e3:7.3f} ms")
        for tid, s in sorted(innermost(by_tid, starts_by_tid, a).items(), key=lambda kv: str(kv[0])):
            if s is not None:
                lines.append(f"      thread {tid}: {s.cat} {s.name[:90]} ({(s.end - s.start) / 1e3:.3f} ms, "
                             f"{(a - s.start) / 1e3:.3f} in)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--gap-us", type=float, default=20.0, help="the shortest idle gap listed")
    parser.add_argument("--top", type=int, default=15, help="how many of the longest gaps to list")
    args = parser.parse_args()
    print(report(args.trace, args.gap_us, args.top))


if __name__ == "__main__":
    main()
