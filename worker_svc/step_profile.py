"""A diagnostic: where an eager step's launch time goes on the host.

A decode step replays a CUDA graph; a step with prefill chunks (or any step no graph takes) runs the
model eagerly, launching each kernel from Python. The engine core's step log (`--step-log`) gives each
step's launch time beside its device time; on an H100 the service's 16k-token mixed steps took 24-58 ms
to launch for 35-40 ms of device time (PERF_NOTES v50): the host, not the GPU, set their pace, and a CPU
estimate of the forward's own Python (its launches stubbed) came to ~7 ms of it. This says where the rest
is: with WORKER_PROFILE_EAGER_STEPS=N (default 0: off) the worker runs the launch of its first N eager
steps under torch.profiler (host activity, and the CUDA runtime's calls where there is a GPU) and logs,
for each, its launch time under the profiler and the ops that took the most host time (their own time,
the CUDA runtime calls among them: a launch that waits for the device shows there, as does a host sync).
The profiler's overhead makes every step slower (the first also pays its start-up); the shares are what
it is for. Its exit synchronizes the device: the table's `cudaDeviceSynchronize` is that wait (the step's
device work left once it launched), logged apart, not part of the launch; what the launch spent outside every
op is its Python (v51: ~17 ms of a 16k-token step's ~25 on an H100's host).

The per-step tables cannot say what the device did meanwhile (each profile ends by waiting for it). With
WORKER_PROFILE_TRACE_STEPS=FIRST-LAST one profiler session spans the launches of steps FIRST..LAST instead,
graph replays included, every step's launch a labelled span on its thread (every thread's ops are recorded:
each step launches from its own RPC thread), the CUDA runtime's synchronizations and the collector's runs as
events where this torch records them, the kernels on the device's timeline, and writes a Chrome trace
(WORKER_PROFILE_TRACE_DIR, default the system's temporary directory) when the first step after LAST launches; WORKER_PROFILE_TRACE_STACK=1 adds the Python calls of every thread (much
slower: keep the window short). `python -m tools.trace_gaps TRACE` reads it: the device's idle gaps and what
the host was doing during each.
"""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from typing import TYPE_CHECKING, ContextManager, Iterator

import torch

if TYPE_CHECKING:
    from worker_svc.step_batch import StepBatch

logger = logging.getLogger(__name__)

EAGER_STEPS = int(os.environ.get("WORKER_PROFILE_EAGER_STEPS", "0"))
TABLE_ROWS = 25


def trace_window(spec: str) -> tuple[int, int] | None:
    """WORKER_PROFILE_TRACE_STEPS's "FIRST-LAST" (step ids) as a pair; None when empty."""
    if not spec.strip():
        return None
    try:
        first, last = (int(part) for part in spec.split("-"))
    except ValueError:
        raise ValueError(f"WORKER_PROFILE_TRACE_STEPS={spec!r}: expected FIRST-LAST step ids, e.g. 10-24") from None
    if first < 0 or last < first:
        raise ValueError(f"WORKER_PROFILE_TRACE_STEPS={spec!r}: expected 0 <= FIRST <= LAST")
    return first, last


# What the trace window asks of Kineto beyond the defaults, each where this torch has it: every thread's
# ops (a worker launches each step from its own RPC thread; by default only the starting thread's are
# recorded), the CUDA runtime's synchronizations as events (a host sync inside a launch shows by name), the
# Python collector's runs (a pause that is no op), and no Python event objects at the end (export only).
WINDOW_OPTIONS = {"profile_all_threads": True, "enable_cuda_sync_events": True, "record_python_gc_info": True,
                  "trace_only": True}


def window_config(options: dict[str, bool] | None = None):
    """An _ExperimentalConfig with those of `options` (default WINDOW_OPTIONS) this torch takes (its
    constructor's signature names them; each missing one is logged), and whether it records every thread."""
    from torch._C._profiler import _ExperimentalConfig

    signature = (_ExperimentalConfig.__init__.__doc__ or "").split("\n", 1)[0]
    wanted = WINDOW_OPTIONS if options is None else options
    taken = {name: value for name, value in wanted.items() if f"{name}:" in signature}
    for name in sorted(wanted.keys() - taken.keys()):
        logger.info("this torch's profiler has no %s option; the trace goes without it", name)
    return _ExperimentalConfig(**taken), "profile_all_threads" in taken


class EagerStepProfiler:
    """Profiles the launch of the first `steps` eager steps (`around`); graph replays pass untouched."""

    def __init__(self, steps: int = EAGER_STEPS, device: torch.device | None = None,
                 window: tuple[int, int] | None = None, trace_dir: str | None = None,
                 with_stack: bool | None = None) -> None:
        self.left = steps
        self.device = device
        self.window = window if window is not None else trace_window(
            os.environ.get("WORKER_PROFILE_TRACE_STEPS", ""))
        self.trace_dir = trace_dir or os.environ.get("WORKER_PROFILE_TRACE_DIR") or tempfile.gettempdir()
        self.with_stack = (with_stack if with_stack is not None
                           else os.environ.get("WORKER_PROFILE_TRACE_STACK", "") == "1")
        self._trace: torch.profiler.profile | None = None

    def around(self, step_id: int, batch: "StepBatch", replays: bool | None = None) -> ContextManager[None]:
        """What the step's launch runs in: the profiler for the next eager step while any are left, a
        labelled span in the trace window's session, else nothing (the step loop's usual case: no work
        but these tests). replays: whether the step replays a graph (default: a staged decode's)."""
        replays = batch.graph if replays is None else replays
        if self.window is not None:
            return self._in_window(step_id, batch, replays)
        if replays or self.left <= 0:
            return contextlib.nullcontext()
        self.left -= 1
        return self._profiled(step_id, self._tokens(batch))

    def _in_window(self, step_id: int, batch: "StepBatch", replays: bool) -> ContextManager[None]:
        first, last = self.window
        if self._trace is None and first <= step_id <= last:
            config, all_threads = window_config()
            if not all_threads:   # stopped on another thread than its start's, a thread-local session crashes
                logger.warning("WORKER_PROFILE_TRACE_STEPS needs a torch whose profiler records every thread "
                               "(profile_all_threads); no trace")
                self.window = None
                return contextlib.nullcontext()
            self._trace = torch.profiler.profile(activities=self._activities(), with_stack=self.with_stack,
                                                 experimental_config=config)
            self._trace.start()
        elif self._trace is not None and step_id > last:
            self._write_trace(first, last)
        if self._trace is None:
            return contextlib.nullcontext()
        kind = "graph" if replays else "eager"
        return torch.profiler.record_function(f"launch step {step_id} {kind} {self._tokens(batch)} tokens")

    def _write_trace(self, first: int, last: int) -> None:
        trace, self._trace, self.window = self._trace, None, None   # one window a process
        trace.stop()
        path = os.path.join(self.trace_dir, f"worker-trace-{os.getpid()}-steps-{first}-{last}.json")
        trace.export_chrome_trace(path)
        logger.info("steps %d-%d traced: %s (read it with python -m tools.trace_gaps)", first, last, path)

    def _activities(self) -> list[torch.profiler.ProfilerActivity]:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device is not None and self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        return activities

    @staticmethod
    def _tokens(batch: "StepBatch") -> int:
        return len(batch.input_ids) if batch.input_ids is not None else len(batch.position_rows)

    @contextlib.contextmanager
    def _profiled(self, step_id: int, num_tokens: int) -> Iterator[None]:
        started = time.perf_counter()
        with torch.profiler.profile(activities=self._activities()) as profile:
            yield
            launched = time.perf_counter()
        # The profiler's exit synchronizes the device before it stops (the table's cudaDeviceSynchronize):
        # that wait is the step's device work left after its launch, not the launch's (PERF_NOTES v51).
        exit_ms = (time.perf_counter() - launched) * 1e3
        averages = profile.key_averages()
        table = averages.table(sort_by="self_cpu_time_total", row_limit=TABLE_ROWS)
        logger.info("eager step %d (%d tokens): launched in %.2f ms under the profiler, %d ops, then %.2f ms in the "
                    "profiler's exit (its device synchronization: the step's device work left); host time by op "
                    "(self):\n%s", step_id, num_tokens, (launched - started) * 1e3, sum(a.count for a in averages),
                    exit_ms, table)
