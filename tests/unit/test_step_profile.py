"""worker_svc/step_profile.py: the first N eager steps' launches profiled and logged, graph replays and
later steps untouched; and through a real model runner, a prefill step's table names the ops it ran."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from worker_svc.step_profile import EagerStepProfiler


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
