"""Tensor-parallel rank and size of this process.

The whole torch.distributed world is the tensor-parallel group: one worker process per GPU,
all ranks of a worker group run every step. Without an initialised process group the worker
is a single rank (rank 0 of 1), so the parallel layers degrade to plain ones.
"""
from __future__ import annotations

import torch.distributed as dist


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_tp_rank() -> int:
    return dist.get_rank() if _distributed() else 0


def get_tp_size() -> int:
    return dist.get_world_size() if _distributed() else 1


def divide(numerator: int, denominator: int) -> int:
    """Exact division for shard sizes: a remainder means the model cannot be split this way."""
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator
