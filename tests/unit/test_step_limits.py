"""The worker's step budget when --max-num-batched-tokens is unset: the scheduler's old default
on the CPU, sized by device memory on CUDA; what the worker warms up for is what it reports."""
from __future__ import annotations

import pytest
import torch

from worker_svc.config import WorkerConfig
from worker_svc.step_limits import GIB, default_max_num_batched_tokens, with_step_limits


@pytest.mark.parametrize("device_type, memory, tokens", [
    ("cpu", 0, 2048), ("cpu", 512 * GIB, 2048),
    ("cuda", 141 * GIB, 16384), ("cuda", 80 * GIB, 16384), ("cuda", 64 * GIB, 16384),
    ("cuda", 48 * GIB, 8192), ("cuda", 24 * GIB, 8192), ("cuda", 16 * GIB, 4096), ("cuda", 8 * GIB, 4096),
])
def test_the_step_budget_fits_the_device(device_type, memory, tokens):
    assert default_max_num_batched_tokens(device_type, memory) == tokens


def test_an_unset_budget_is_filled_and_a_set_one_kept():
    config = WorkerConfig(model="m")
    assert config.max_num_batched_tokens is None
    assert with_step_limits(config, torch.device("cpu")).max_num_batched_tokens == 2048
    assert with_step_limits(WorkerConfig(model="m", max_num_batched_tokens=64), torch.device("cpu")) \
        .max_num_batched_tokens == 64


def test_a_cpu_worker_reports_the_limits_it_warmed_up_for(tiny_model_dir):
    from worker_svc.model_runner import ModelRunner

    info = ModelRunner(WorkerConfig(model=str(tiny_model_dir), num_kv_blocks=16)).describe()
    assert (info.max_num_seqs, info.max_num_batched_tokens) == (256, 2048)
