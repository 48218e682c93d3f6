"""worker_svc/step_profile.py: the first N eager steps' launches profiled and logged, graph replays and
later steps untouched; and through a real model runner, a prefill step's table names the ops it ran."""
from __future__ import annotations

import json
import logging
import threading
from types import SimpleNamespace

import pytest
import torch

from tools import trace_gaps
from worker_svc import step_profile
from worker_svc.step_profile import EagerStepProfiler, trace_window, window_config


def step_batch(tokens: int, graph: bool = False) -> SimpleNamespace:
    """What the profiler reads of a StepBatch: whether a graph replays it, its tokens."""
    return SimpleNamespace(graph=graph, input_ids=None if graph else torch.zeros(tokens, dtype=torch.int64),
                           position_rows=list(range(tokens)))


def test_the_first_eager_steps_are_profiled_and_nothing_else(caplog):
    profiler = EagerStepProfiler(steps=2, device=torch.device("cpu"))
    x = torch.randn(64, 64)
    with caplog.at_level(logging.INFO, logger="worker_svc.step_profile"):
        with profiler.around(1, step_batch(4, graph=True)):   # a graph replay: not profiled, not counted
            x @ x
        for step in (2, 3, 4):
            with profiler.around(step, step_batch(64)):
                torch.mm(x, x)
    logged = [r.getMessage() for r in caplog.records]
    assert [m.split(":")[0] for m in logged] == ["eager step 2 (64 tokens)", "eager step 3 (64 tokens)"]
    assert all("aten::mm" in m and "Self CPU" in m for m in logged), logged[0]


def test_off_by_default_it_adds_nothing(caplog, monkeypatch):
    monkeypatch.delenv("WORKER_PROFILE_EAGER_STEPS", raising=False)
    profiler = EagerStepProfiler(steps=0)
    with caplog.at_level(logging.INFO, logger="worker_svc.step_profile"):
        with profiler.around(1, step_batch(8)):
            torch.ones(3).sum()
    assert caplog.records == []


def test_a_model_runner_profiles_its_prefill_step(tiny_model_dir, caplog):
    """Through a real runner on the CPU: the prompt's (eager) step is profiled, its table names the
    model's matmuls; the runner's tokens are what they are without the profiler."""
    from tests.support.runner_driver import Driver, make_runner, prompt

    def run(profiled: int) -> list[int]:
        d = Driver(make_runner(tiny_model_dir))
        d.runner._eager_profile = EagerStepProfiler(steps=profiled, device=d.runner.device)
        d.step(new=[d.new(1, prompt(1, 12), 12)])
        for _ in range(3):
            d.step(cached=[d.cached(1)])
        return d.tokens[1]

    with caplog.at_level(logging.INFO, logger="worker_svc.step_profile"):
        profiled = run(1)
    tables = [r.getMessage() for r in caplog.records if r.name == "worker_svc.step_profile"]
    assert len(tables) == 1 and tables[0].startswith("eager step") and "(12 tokens)" in tables[0]
    assert "aten::" in tables[0]
    assert profiled == run(0)


def test_a_trace_window_spans_its_steps_and_writes_one_trace(tmp_path, caplog):
    """WORKER_PROFILE_TRACE_STEPS: one profiler session from step FIRST to LAST, graph replays included,
    each launch a labelled span; the trace is written when a later step launches, and only once."""
    profiler = EagerStepProfiler(device=torch.device("cpu"), window=(3, 4), trace_dir=str(tmp_path))
    x = torch.randn(32, 32)
    with caplog.at_level(logging.INFO, logger="worker_svc.step_profile"):
        for step, graph in ((2, False), (3, False), (4, True), (5, False), (6, False)):
            with profiler.around(step, step_batch(8, graph=graph)):
                torch.mm(x, x)
    traces = list(tmp_path.glob("worker-trace-*-steps-3-4.json"))
    assert len(traces) == 1 and len(caplog.records) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    labels = {e["name"] for e in events if e.get("cat") == "user_annotation"}
    assert labels == {"launch step 3 eager 8 tokens", "launch step 4 graph 8 tokens"}
    assert sum(e.get("name") == "aten::mm" for e in events) == 2   # steps 3 and 4 only
    assert "no device activity" in trace_gaps.report(str(traces[0]))


@pytest.mark.parametrize("spec", ["12", "a-b", "9-3", "-1-4"])
def test_a_trace_window_that_is_not_first_last_is_refused(spec):
    with pytest.raises(ValueError, match="WORKER_PROFILE_TRACE_STEPS"):
        trace_window(spec)


def test_trace_gaps_finds_the_device_idle_and_what_the_host_was_in(tmp_path):
    """A hand-made trace: two steps; the second's launch starts late, so the device idles 300 us while
    the launching thread sits in a long cudaMalloc; its kernels start 5 us after their launch calls."""
    def x(name, cat, ts, dur, tid=1, corr=None):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "pid": 1,
                "args": {} if corr is None else {"correlation": corr}}
    events = [
        x("launch step 7 eager 16 tokens", "user_annotation", 0, 100),
        x("cuLaunchKernelEx", "cuda_runtime", 10, 5, corr=1),
        x("cuLaunchKernelEx", "cuda_runtime", 20, 5, corr=2),
        x("k1", "kernel", 15, 50, tid=7, corr=1),
        x("k2", "kernel", 65, 100, tid=7, corr=2),
        x("launch step 8 eager 16 tokens", "user_annotation", 110, 400),
        x("cudaMalloc", "cuda_runtime", 120, 340),
        x("cuLaunchKernelEx", "cuda_runtime", 460, 5, corr=3),
        x("k3", "kernel", 465, 50, tid=7, corr=3),
        x("aten::copy_", "cpu_op", 150, 30, tid=2),
        # Another RPC thread during step 8's launch: 40 us of its reply's Python (a function holding a
        # tolist), then a wait for its lock, which is not work.
        x("step_message.py(81): build_step_response", "python_function", 200, 40, tid=3),
        x("<built-in method tolist of Tensor object>", "python_function", 210, 10, tid=3),
        x("<built-in method acquire of _thread.lock object>", "python_function", 250, 200, tid=3),
        # The gRPC poller's thread: a function calling others, between them 300 us in untraced C (blocked).
        x("grpc/_server.py(1314): _serve", "python_function", 100, 700, tid=4),
        x("<lambda>", "python_function", 130, 5, tid=4),
        x("<lambda>", "python_function", 435, 5, tid=4),
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = trace_gaps.report(str(path), gap_us=100)
    assert "busy 0.20 ms" in out
    lines = out.splitlines()
    step7 = next(line for line in lines if line.split()[:1] == ["7"])
    assert step7.split()[3:9] == ["0.10", "0.01", "0.00", "2", "0.15", "100.0"] and step7.split()[-1] == "0.005"
    step8 = next(line for line in lines if line.split()[:1] == ["8"])
    # Others: thread 2's copy 30 us, thread 3's Python 40, the poller's two calls and 20 us of its own.
    assert step8.split()[3:6] == ["0.40", "0.34", "0.10"]
    gap = lines.index(next(line for line in lines if "idle" in line and "0.300 ms" in line))
    assert "cudaMalloc" in lines[gap + 1] and "0.045 in" in lines[gap + 1]


def test_a_trace_window_records_steps_launched_from_other_threads(tmp_path):
    """A worker launches each step from its own RPC thread: the window started on one thread records the
    launches of the others and stops on a third."""
    profiler = EagerStepProfiler(device=torch.device("cpu"), window=(3, 4), trace_dir=str(tmp_path))
    x = torch.randn(32, 32)

    def launch(step: int) -> None:
        with profiler.around(step, step_batch(8)):
            torch.mm(x, x)

    for step in (3, 4):
        thread = threading.Thread(target=launch, args=(step,))
        thread.start()
        thread.join()
    launch(5)
    (trace,) = tmp_path.glob("worker-trace-*-steps-3-4.json")
    events = json.loads(trace.read_text())["traceEvents"]
    spans = {e["name"]: e["tid"] for e in events if e.get("cat") == "user_annotation"}
    assert set(spans) == {"launch step 3 eager 8 tokens", "launch step 4 eager 8 tokens"}
    assert len(set(spans.values())) == 2
    assert sum(e.get("name") == "aten::mm" for e in events) == 2


def test_the_window_asks_only_for_the_profiler_options_this_torch_has(caplog):
    with caplog.at_level(logging.INFO, logger="worker_svc.step_profile"):
        config, all_threads = window_config({"profile_all_threads": True, "no_such_option": True})
    assert config is not None and all_threads
    assert [r.getMessage() for r in caplog.records] == [
        "this torch's profiler has no no_such_option option; the trace goes without it"]


def test_without_every_threads_recording_the_window_traces_nothing(tmp_path, monkeypatch, caplog):
    """A thread-local profiling session stopped on another thread crashes the process: a torch whose
    profiler cannot record every thread gets no trace, and says so."""
    monkeypatch.setattr(step_profile, "WINDOW_OPTIONS", {"no_such_option": True})
    profiler = EagerStepProfiler(device=torch.device("cpu"), window=(3, 4), trace_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="worker_svc.step_profile"):
        for step in (3, 4, 5):
            with profiler.around(step, step_batch(8)):
                torch.ones(2).sum()
    assert list(tmp_path.iterdir()) == []
    assert ["profile_all_threads" in r.getMessage() for r in caplog.records] == [True]
