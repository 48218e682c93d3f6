"""CPU use of running processes, read from /proc (Linux): a sampler that records, once a second,
how many cores each watched process (and each of its children, found by parent pid) used since the
last sample. Benchmarks report it so that a bound on one process (the engine core, a frontend, the
client itself) shows instead of being mistaken for the system's speed."""
from __future__ import annotations

import os
import statistics
import threading
import time

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS    # utime, stime (fields 14, 15 of stat)


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rpartition(")")[2].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return out


class CpuSampler:
    """Samples named processes (and their children, named NAME/child-PID) every interval_s."""

    def __init__(self, named_pids: dict[str, int], interval_s: float = 1.0, with_children: bool = True) -> None:
        self.named_pids = dict(named_pids)
        self.interval_s = interval_s
        self.with_children = with_children
        self.samples: dict[str, list[float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "CpuSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _watched(self) -> dict[str, int]:
        watched = dict(self.named_pids)
        if self.with_children:
            for name, pid in self.named_pids.items():
                for child in children_of(pid):
                    watched[f"{name}/{child}"] = child
        return watched

    def _run(self) -> None:
        last = {name: (time.monotonic(), cpu_seconds(pid)) for name, pid in self._watched().items()}
        while not self._stop.wait(self.interval_s):
            now_watched = self._watched()
            for name, pid in now_watched.items():
                used, now = cpu_seconds(pid), time.monotonic()
                if name in last and used is not None and last[name][1] is not None:
                    cores = (used - last[name][1]) / max(now - last[name][0], 1e-9)
                    self.samples.setdefault(name, []).append(round(cores, 3))
                last[name] = (now, used)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per process: median and max cores used over the samples."""
        return {name: {"median": statistics.median(v), "max": max(v), "samples": len(v)}
                for name, v in sorted(self.samples.items()) if v}
