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
it is for.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING, ContextManager, Iterator

import torch

if TYPE_CHECKING:
    from worker_svc.step_batch import StepBatch

logger = logging.getLogger(__name__)

EAGER_STEPS = int(os.environ.get("WORKER_PROFILE_EAGER_STEPS", "0"))
TABLE_ROWS = 25


class EagerStepProfiler:
    """Profiles the launch of the first `steps` eager steps (`around`); graph replays pass untouched."""

    def __init__(self, steps: int = EAGER_STEPS, device: torch.device | None = None) -> None:
        self.left = steps
        self.device = device

    def around(self, step_id: int, batch: "StepBatch") -> ContextManager[None]:
        """What the step's launch runs in: the profiler for the next eager step while any are left, else
        nothing (the step loop's usual case: no work but this test)."""
        if batch.graph or self.left <= 0:
            return contextlib.nullcontext()
        self.left -= 1
        tokens = len(batch.input_ids) if batch.input_ids is not None else len(batch.position_rows)
        return self._profiled(step_id, tokens)

    @contextlib.contextmanager
    def _profiled(self, step_id: int, num_tokens: int) -> Iterator[None]:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device is not None and self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        started = time.perf_counter()
        with torch.profiler.profile(activities=activities) as profile:
            yield
            launched_ms = (time.perf_counter() - started) * 1e3
        averages = profile.key_averages()
        table = averages.table(sort_by="self_cpu_time_total", row_limit=TABLE_ROWS)
        logger.info("eager step %d (%d tokens): launched in %.2f ms under the profiler, %d ops; host time by op "
                    "(self):\n%s", step_id, num_tokens, launched_ms, sum(a.count for a in averages), table)
