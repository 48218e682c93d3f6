"""Probe: the host's critical path of an eagle3 verifying step on the CPU (tiny model, CUDA-graph
stand-ins that replay nothing, the device sampler's kernels interpreted), from launch() to the
target graph's replay, with the step before not yet settled: launched ahead of its acceptance
(spec_decode/ahead.py) against settling first (the path before it). The derivation kernel is left
out (its launch is timed on a GPU); medians over --steps steps at each batch.

    PYTHONPATH=. python -m bench.probes.spec_ahead_host [--batches 1,8] [--steps 60]
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
import time

from tests.support import triton_interpreter  # noqa: F401  (before triton: interpreted on the CPU)


def measure(model_dir, head_dir, batch: int, steps: int, ahead: bool) -> list[float]:
    """Launch-to-replay times (us) of `steps` verifying steps (8 to a run: the stand-ins' drafts are
    all accepted, and the runner's max_model_len is 64)."""
    times = []
    while len(times) < steps:
        times += _run(model_dir, head_dir, batch, ahead)
    return times


def _run(model_dir, head_dir, batch: int, ahead: bool) -> list[float]:
    import pytest

    from tests.support.graph_stand_ins import capture_on_the_cpu, replaying_graphs_on_the_cpu, speculating_runner
    from tests.support.runner_driver import GREEDY, prompt
    from tests.support.speculative_loop import AheadLoop
    from tests.support.triton_interpreter import gpu_faithful
    from worker_svc import model_runner
    from worker_svc.spec_decode import ahead as ahead_module

    patch = pytest.MonkeyPatch()
    replaying_graphs_on_the_cpu(patch)
    capture_on_the_cpu(patch)                                  # replays run nothing: only the host is timed
    patch.setattr(ahead_module, "derive", lambda *args: None)   # one kernel launch, timed on a GPU
    if not ahead:
        patch.setattr(model_runner, "plan_ahead", lambda *args: None)
    runner = speculating_runner(model_dir, "eagle3", head_dir, graphed=True, graph_requests=batch, staged=True)
    times, started = [], []
    launch, replay = runner.launch, runner.decode_graphs.replay
    runner.launch = lambda step: started.append(time.perf_counter()) or launch(step)
    runner.decode_graphs.replay = lambda n: times.append(time.perf_counter() - started[-1]) or replay(n)
    requests = {s: (prompt(s, 8 + s), GREEDY) for s in range(1, batch + 1)}
    with gpu_faithful():
        AheadLoop(runner, 3).run(requests, 32, steps=10)
    patch.undo()
    return [t * 1e6 for t in times[2:]]   # the verifying steps after the first


def main() -> None:
    from common.tiny_model import write_tiny_eagle3, write_tiny_qwen3

    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,8")
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    root = pathlib.Path(tempfile.mkdtemp())
    model_dir, head_dir = write_tiny_qwen3(root / "model"), write_tiny_eagle3(root / "head")
    for batch in (int(b) for b in args.batches.split(",")):
        for rep in range(3):
            before = statistics.median(measure(model_dir, head_dir, batch, args.steps, ahead=False))
            after = statistics.median(measure(model_dir, head_dir, batch, args.steps, ahead=True))
            print(f"batch {batch} run {rep}: launch -> replay, settling first {before:.1f} us, ahead {after:.1f} us")


if __name__ == "__main__":
    main()
