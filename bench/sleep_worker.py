"""A real worker process whose forward and sampling are replaced by a wait of fixed length, for
measuring the host path (scheduler core, frontends, step messages, the worker's own preparation)
without a GPU: `python -m bench.sleep_worker --forward-ms 7.4 --trace FILE <worker flags>`.

Everything up to the device is the real code: the gRPC server, step parsing, validation, the
persistent batch and the input preparation with its host-to-device staging. A pure-decode step is
prepared as on a GPU, staged for the decode graphs (batch_prep's staged path; a stand-in holds what it
reads of them), unless --eager-host-path (the CPU worker's path, which has no graphs). The "device" is a
clock: each step occupies it for --forward-ms after the previous one (as a CUDA stream runs work
in order), launch returns at once and the result waits for its step's end, as on a GPU. Sampled
tokens are a fixed function of the step and row. --trace writes one line per step: its end time,
the number of requests and of tokens.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time

import numpy as np
import torch

from worker_svc.model_runner import ModelRunner
from worker_svc.step_batch import StepBatch
from worker_svc.runner_io import StepOutput
from worker_svc.staging import PendingStep


class _SleepingStep(PendingStep):
    def __init__(self, step_id: int, started: float, prepare_ms: float, forward_ms: float, tokens: list[int],
                 done_at: float, trace) -> None:
        super().__init__(step_id, started, prepare_ms, forward_ms, len(tokens), None, None, None, None)
        self._token_list, self._done_at, self._trace = tokens, done_at, trace

    def result(self) -> StepOutput:
        time.sleep(max(0.0, self._done_at - time.perf_counter()))
        self._trace()
        return StepOutput(self.step_id, self._token_list, None, self._prepare_ms, self._forward_ms,
                          (time.perf_counter() - self._started) * 1e3)


class StagedGraphs:
    """What batch_prep reads of a GPU worker's decode graphs (cuda_graphs.DecodeGraphs) to stage a
    pure-decode step for their replay: nothing replays here."""
    staged = usable = True
    sample = None

    def __init__(self, largest: int) -> None:
        self.batch_sizes = [largest]
        self.rows = torch.zeros(largest, dtype=torch.int64)

    def can_run(self, meta) -> bool:   # an unstaged step: the runner's eager path (which the sleep replaces)
        return False


class SleepRunner(ModelRunner):
    def __init__(self, config, forward_ms: float, trace_path: str | None, staged: bool = True) -> None:
        super().__init__(config)
        if staged:
            self.decode_graphs = StagedGraphs(self.graph_tokens)
        self.forward_s = forward_ms / 1e3
        self._device_free_at = 0.0
        self._trace_file = open(trace_path, "w", buffering=1) if trace_path else None
        self._lock = threading.Lock()

    def _execute(self, step_id: int, batch: StepBatch, started: float, prepare_ms: float) -> PendingStep:
        launched = time.perf_counter()
        done_at = max(launched, self._device_free_at) + self.forward_s
        self._device_free_at = done_at
        rows = batch.sampling_rows
        tokens = ((rows * 7 + step_id) % (self.vocab_size - 3) + 3).tolist()
        if batch.graph:   # staged: one token a row
            num_requests = num_tokens = len(rows)
        else:
            num_requests, num_tokens = len(batch.meta.seq_lens_cpu), int(np.sum(batch.meta.query_lens_cpu))

        def trace() -> None:
            if self._trace_file is not None:
                with self._lock:
                    self._trace_file.write(f"{time.time():.6f} {num_requests} {num_tokens}\n")

        return _SleepingStep(step_id, started, prepare_ms, (time.perf_counter() - launched) * 1e3, tokens, done_at,
                             trace)


def main(argv: list[str] | None = None) -> int:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--forward-ms", type=float, required=True)
    extra.add_argument("--trace", default=None)
    extra.add_argument("--eager-host-path", action="store_true",
                       help="prepare decode steps as the CPU worker does (no graphs) rather than as a GPU's")
    ours, rest = extra.parse_known_args(argv)
    import worker_svc.__main__ as worker_main
    import worker_svc.model_runner

    # The worker's entry point builds ModelRunner(config): give it the sleeping one instead.
    worker_svc.model_runner.ModelRunner = lambda config: SleepRunner(config, ours.forward_ms, ours.trace,
                                                                          not ours.eager_host_path)
    return worker_main.main(rest)


if __name__ == "__main__":
    sys.exit(main())
