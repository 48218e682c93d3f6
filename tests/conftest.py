"""Shared fixtures: the tiny seeded checkpoint and the real services started as processes."""
from __future__ import annotations

import os
import pathlib

import pytest

from common.tiny_model import write_tiny_qwen3
from tests.procs import running_services

# Two cores: one torch thread per process keeps the worker, scheduler and test from fighting.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> pathlib.Path:
    """The embedded default checkpoint, written afresh for this test session."""
    return write_tiny_qwen3(tmp_path_factory.mktemp("models") / "tiny-qwen3")


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
