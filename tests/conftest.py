"""Shared fixtures: the tiny seeded checkpoint and the real services started as processes."""
from __future__ import annotations

import os
import pathlib

import pytest

# Two cores: one torch thread per process keeps the worker, scheduler and test from fighting.
# (Set before anything imports torch, whose OpenMP runtime reads it once.)
os.environ.setdefault("OMP_NUM_THREADS", "1")
from hypothesis import HealthCheck, settings  # noqa: E402

from common.tiny_model import write_tiny_draft, write_tiny_eagle3, write_tiny_qwen3  # noqa: E402
from tests.support.procs import running_services  # noqa: E402

# The property tests draw the same examples on every run: a suite that finds a new bug only on
# some runs fails whichever change it happens to run on. To hunt for new bugs, draw afresh:
# `HYPOTHESIS_PROFILE=explore pytest tests/unit/test_gateway_fuzz.py` (or --hypothesis-seed=N);
# what it finds becomes an @example or a plain test.
# Neither fails a test for an example or its drawing taking long: that depends on how busy the machine is.
_NOT_TIMED = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("repeatable", derandomize=True, **_NOT_TIMED)
settings.register_profile("explore", derandomize=False, **_NOT_TIMED)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


def pytest_configure(config):
    """Without CUDA, tests/support/triton_interpreter sets TRITON_INTERPRET, which triton reads once,
    when it is first imported, so the Triton kernels' tests run interpreted. Not in xdist's
    controller, which runs no test: importing torch there costs seconds of the cores the workers use."""
    if hasattr(config, "workerinput") or config.getoption("dist", "no") == "no" or not config.getoption("tx", None):
        from tests.support import triton_interpreter  # noqa: F401


def pytest_ignore_collect(collection_path, config):
    """`-m "not e2e"` does not even import tests/e2e (its imports cost seconds of the fast run)."""
    if collection_path.name != "e2e" or not config.option.markexpr:
        return None
    from _pytest.mark.expression import Expression

    expression = Expression.compile(config.option.markexpr)
    excluded = not any(expression.evaluate(lambda name, others=others: name == "e2e" or others)
                       for others in (False, True))
    return True if excluded else None


def pytest_collection_modifyitems(config, items):
    """Everything under tests/e2e starts processes: marked e2e, so `-m "not e2e"` runs the fast part.
    In xdist's workers the e2e files come first: files are handed out in this order
    (--no-loadscope-reorder), so the long ones start early and the many short unit files even out
    the two workers' ends. (xdist's own order, by number of tests, handed them out last.)"""
    for item in items:
        if "e2e" in item.path.parts:
            item.add_marker(pytest.mark.e2e)
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: "e2e" not in item.path.parts)


@pytest.fixture(scope="session", autouse=True)
def interpreted_kernels_patch_triton_once():
    """Interpreted kernels' @triton.jit helpers reuse their launch's patches (several times faster)."""
    from tests.support import triton_interpreter

    with triton_interpreter.faster_interpreter():
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> pathlib.Path:
    """The embedded default checkpoint, written afresh for this test session."""
    return write_tiny_qwen3(tmp_path_factory.mktemp("models") / "tiny-qwen3")


@pytest.fixture(scope="session")
def tiny_eagle3_dir(tmp_path_factory) -> pathlib.Path:
    """A random EAGLE-3 head for the tiny model, in the published layout."""
    return write_tiny_eagle3(tmp_path_factory.mktemp("models") / "tiny-eagle3")


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory) -> pathlib.Path:
    """A second tiny Qwen3 (other weights, one layer) with the tiny model's tokenizer."""
    return write_tiny_draft(tmp_path_factory.mktemp("models") / "tiny-draft")


@pytest.fixture(scope="session")
def tiny_self_draft_dir(tiny_model_dir, tmp_path_factory) -> pathlib.Path:
    """The tiny model itself, copied, as a draft model: it drafts what the target samples greedily."""
    import shutil

    return pathlib.Path(shutil.copytree(tiny_model_dir, tmp_path_factory.mktemp("models") / "tiny-self-draft"))


@pytest.fixture
def graphs_on_the_cpu(monkeypatch):
    """CUDA graphs on the CPU that replay what they captured, over an attention that reads every
    length from the device (tests/support/graph_stand_ins.py)."""
    from tests.support.graph_stand_ins import replaying_graphs_on_the_cpu

    replaying_graphs_on_the_cpu(monkeypatch)


@pytest.fixture(scope="session")
def services(tiny_model_dir, tmp_path_factory):
    """A scheduler and one worker on the tiny model, with default settings."""
    with running_services(tiny_model_dir, tmp_path_factory.mktemp("logs")) as svc:
        yield svc


@pytest.fixture
def launch_services(tiny_model_dir, tmp_path):
    """Starts services with custom flags: `with launch_services(worker_args=(...)) as svc:`."""
    def launch(**kwargs):
        return running_services(tiny_model_dir, tmp_path / "logs", **kwargs)
    return launch
